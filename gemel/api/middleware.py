"""Headers every response carries: request id, model id and version, latency, trace (and
x-gemel-fallback when a route's fallback model answered, x-gemel-replica when engine
replicas serve the model).

A plain ASGI middleware (not BaseHTTPMiddleware) so streaming and disconnect detection pass
through untouched. Handlers name the model they served in ``request.state.model_id`` /
``model_version``; the default model is reported otherwise.
"""

from __future__ import annotations

import re
import secrets
import time
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def child_traceparent(incoming: str | None) -> str:
    """A W3C traceparent for this server's span: the caller's trace id when it sent one."""
    m = _TRACEPARENT.match((incoming or "").strip().lower())
    trace_id = m.group(1) if m and m.group(1) != "0" * 32 else secrets.token_hex(16)
    flags = m.group(3) if m else "01"
    return f"00-{trace_id}-{secrets.token_hex(8)}-{flags}"


class ResponseHeadersMiddleware:
    def __init__(self, app: ASGIApp, default_model_id: str, default_model_version: str):
        self.app = app
        self.default_model_id = default_model_id
        self.default_model_version = default_model_version

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        headers = Headers(scope=scope)
        request_id = headers.get("x-request-id") or uuid.uuid4().hex
        state = scope.setdefault("state", {})
        # The tracing middleware (outside this one) names the request's span; else a fresh id.
        traceparent = state.get("traceparent") or child_traceparent(headers.get("traceparent"))
        state["request_id"] = request_id
        state["traceparent"] = traceparent

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                h = MutableHeaders(scope=message)
                h["x-request-id"] = request_id
                h["x-model-id"] = state.get("model_id") or self.default_model_id
                h["x-model-version"] = state.get("model_version") or self.default_model_version
                if state.get("fallback_model"):  # a route's fallback answered (gemel.api.routes)
                    h["x-gemel-fallback"] = state["fallback_model"]
                if state.get("replica"):  # the engine replica(s) that served it (gemel.scale)
                    h["x-gemel-replica"] = state["replica"]
                if state.get("response_cache"):  # what the response cache did (gemel.cache): exact | semantic | miss
                    h["x-gemel-cache"] = state["response_cache"]
                h["x-inference-latency-ms"] = f"{(time.perf_counter() - start) * 1000:.1f}"
                h.setdefault("x-content-type-options", "nosniff")  # JSON and event streams are never sniffed as HTML
                h["traceparent"] = traceparent
            await send(message)

        await self.app(scope, receive, send_with_headers)
