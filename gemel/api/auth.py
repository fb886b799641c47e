"""Who is calling: the ``Principal`` the gateway middleware authenticated (API key or signature).

Keys and signatures are checked by ``gemel.gateway.middleware.GatewayMiddleware`` before a
route runs; ``authenticate`` only hands the routes its result. Without the middleware (an
app assembled by hand) every caller is the anonymous principal.
"""

from __future__ import annotations

from starlette.requests import Request

from gemel.gateway.principal import Principal

__all__ = ["Principal", "api_key_of", "authenticate"]


def api_key_of(request: Request) -> str | None:
    """The key as each surface's clients send it: x-goog-api-key, ?key=, or a Bearer token."""
    key = request.headers.get("x-goog-api-key") or request.query_params.get("key")
    if key:
        return key
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip() or None
    return None


async def authenticate(request: Request) -> Principal:
    principal = request.scope.get("state", {}).get("principal")
    return principal if isinstance(principal, Principal) else Principal()
