"""Who is calling, as the handlers see it: tenant, priority, engine quota, admission hooks.

The gateway middleware puts one ``Principal`` in the request scope (``scope["state"]
["principal"]``); ``gemel.api.auth.authenticate`` hands it to the routes. Without a gateway
(a bare app in a unit test) the principal is the anonymous one and every hook is a no-op.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from gemel.engine.output_processor import RequestOutput
    from gemel.engine.protocol import TenantQuota
    from gemel.gateway.gateway import Admission

ANONYMOUS = "anonymous"


@dataclass
class Principal:
    tenant: str = ANONYMOUS
    priority_class: str = "P1"
    priority: int = 1  # SamplingParams.priority from the priority class: P0 -> 0, P1 -> 1, P2 -> 2
    quota: TenantQuota | None = None  # per-tenant engine quota passed with each engine request
    via: Literal["anonymous", "api_key", "signature"] = "anonymous"
    key_id: str | None = None  # the API key id or signing key id that authenticated the call
    admission: Admission | None = None  # this request's hold on the gateway (limits, queues)

    def priority_for(self, requested: int | None = None) -> int:
        """The engine priority of a request: the tenant's class, or a lower one it asked for
        (OpenAI's ``priority`` extra); a tenant can never raise itself above its class."""
        if requested is None:
            return self.priority
        return max(self.priority, requested)

    async def admit_generation(self, prompt_tokens: int, max_new_tokens: int, overflow: bool = False) -> None:
        """Before the engine sees it: the class queue bound (503) and the tokens/min reservation
        (429) of prompt + maximum output. Raises ``gemel.api.errors.APIError``. ``overflow``:
        a route's fallback taking a request its full class queue would refuse (not bounded by it)."""
        if self.admission is None:
            return
        from gemel.gateway.gateway import Refusal

        try:
            await self.admission.admit_generation(prompt_tokens, max_new_tokens, overflow)
        except Refusal as e:
            raise e.to_api_error() from None

    def meter(self, stream: AsyncIterator[RequestOutput], index: int = 0) -> AsyncIterator[RequestOutput]:
        """Wrap an engine stream: its first output takes the request out of its class queue,
        its token counts settle the tokens/min reservation when the request ends."""
        if self.admission is None:
            return stream
        return self.admission.meter(stream, index)
