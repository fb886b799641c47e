"""Which replica served a request, for the response's ``x-gemel-replica`` header.

``mark_model`` (``gemel.api.state``) puts the HTTP request's ``request.state`` here; the
replica pool, iterated later in the same task (or in tasks it starts), notes the replica that
took each of the request's prompts on it, as ``mark_model`` notes the model.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

REQUEST_STATE: ContextVar[Any] = ContextVar("gemel_request_state", default=None)


def note_replica(replica_id: str) -> None:
    """Add ``replica_id`` to the current request's ``replica`` (comma-separated, each once)."""
    state = REQUEST_STATE.get()
    if state is None:
        return
    seen = getattr(state, "replica", None)
    if not seen:
        state.replica = replica_id
    elif replica_id not in seen.split(","):
        state.replica = f"{seen},{replica_id}"
