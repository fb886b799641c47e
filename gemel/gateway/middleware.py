"""The gateway in front of the REST surfaces: an ASGI middleware.

For every HTTP request except the public paths (health, readiness, metrics, API docs): read
the credentials (the body too, when a signature covers it), authenticate, admit (tenant
concurrency and requests/min), run the app, release. Refusals are answered here, in the
calling surface's error format (``gemel.api.errors``):

============================  ==========================================  ==================================
case                          Gemini surface                              OpenAI surface
============================  ==========================================  ==================================
no credentials                401 UNAUTHENTICATED                         401 ``authentication_error``
unknown API key               400 INVALID_ARGUMENT + ErrorInfo            401 ``invalid_api_key``
                              ``API_KEY_INVALID`` (what Google answers)
bad signature (any reason),   401 UNAUTHENTICATED                         401 ``invalid_signature``
signature required
anonymous caller not local    403 PERMISSION_DENIED                       403
rate limited                  429 RESOURCE_EXHAUSTED + RetryInfo +        429 ``rate_limit_exceeded`` +
                              Retry-After                                 retry-after
class queue full              503 UNAVAILABLE + RetryInfo + Retry-After   503 + retry-after
============================  ==========================================  ==================================

On ``GET /v1/models[/id]``, which both surfaces share, the credential's form decides: a
Bearer token gets OpenAI's statuses, a Google-style key Google's.

A ``?key=`` value is replaced by ``REDACTED`` in the request scope before the app (and the
server's access log, which reads the same scope) sees it: keys never reach the logs.
"""

from __future__ import annotations

import logging
from urllib.parse import parse_qsl, urlencode

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gemel.api.errors import APIError, error_body, error_headers, surface_of
from gemel.gateway.gateway import AuthError, Credentials, Gateway, Refusal, credentials_from
from gemel.gateway.signing import SIGNATURE_HEADER

log = logging.getLogger("gemel.gateway")

API_KEY_INVALID = {
    "@type": "type.googleapis.com/google.rpc.ErrorInfo",
    "reason": "API_KEY_INVALID",
    "domain": "googleapis.com",
    "metadata": {"service": "generativelanguage.googleapis.com"},
}


def auth_api_error(err: AuthError, surface: str, creds: Credentials) -> APIError:
    """The answer to a failed authentication, as the calling surface's clients expect it."""
    openai_like = surface == "openai" or (surface == "both" and creds.source == "bearer")
    if err.reason == "invalid_key":
        if openai_like:
            return APIError(401, "Incorrect API key provided. Check the key or create one with `gemel keys create`.", code="invalid_api_key")
        return APIError(400, err.message, details=[API_KEY_INVALID])
    if err.reason == "not_loopback":
        return APIError(403, err.message, code="permission_denied")
    if err.reason.startswith("signature"):
        return APIError(401, err.message, code="invalid_signature")
    return APIError(401, err.message, code=None)


def redact_query_key(scope: Scope) -> str | None:
    """Take ``key`` out of the query string (returned), leaving ``key=REDACTED`` in the scope."""
    raw: bytes = scope.get("query_string") or b""
    if b"key=" not in raw:
        return None
    pairs = parse_qsl(raw.decode("latin-1"), keep_blank_values=True)
    key = None
    out = []
    for name, value in pairs:
        if name == "key":
            key = key if key is not None else value
            value = "REDACTED"
        out.append((name, value))
    if key is not None:
        scope["query_string"] = urlencode(out).encode("latin-1")
    return key


async def read_body(receive: Receive) -> tuple[bytes | None, Receive]:
    """The whole request body, and a ``receive`` that replays it to the app (None: client gone)."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None, receive
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    body = b"".join(chunks)
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return body, replay


class GatewayMiddleware:
    def __init__(self, app: ASGIApp, gateway: Gateway):
        self.app = app
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        query_key = redact_query_key(scope)
        if self.gateway.is_public(scope["path"]):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        client = scope.get("client")
        creds = credentials_from(headers, query_key, client_host=client[0] if client else None)
        if SIGNATURE_HEADER in headers:
            body, receive = await read_body(receive)
            if body is None:
                return  # the client went away while sending
            creds.body = body
        state = scope.setdefault("state", {})
        surface = surface_of(scope["path"])
        try:
            principal = self.gateway.authenticate(creds)
        except AuthError as e:
            state["tenant"] = e.tenant or "unknown"
            await self._answer(scope, receive, send, auth_api_error(e, surface, creds), surface, creds)
            return
        state["principal"] = principal
        state["tenant"] = principal.tenant
        try:
            admission = await self.gateway.admit(principal)
        except Refusal as e:
            await self._answer(scope, receive, send, e.to_api_error(), surface, creds)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            await self.gateway.release(admission)

    async def _answer(self, scope: Scope, receive: Receive, send: Send, err: APIError, surface: str, creds: Credentials) -> None:
        response = JSONResponse(error_body(err, surface), err.status, headers=error_headers(err))  # type: ignore[arg-type]
        await response(scope, receive, send)
