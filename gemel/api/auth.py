"""Who is calling. No key is required yet; the gateway (SPEC F40) replaces ``authenticate``
through FastAPI's dependency overrides to check keys and name the tenant."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request


@dataclass
class Principal:
    api_key: str | None
    tenant: str = ""


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
    return Principal(api_key=api_key_of(request))
