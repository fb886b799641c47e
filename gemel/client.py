"""Client helpers for gemel's gateway: signed requests (docs/gateway.md, "Signed requests").

    from gemel.client import Ed25519Auth, sign_request
    headers = sign_request(body_bytes, key_id, "client.pem")      # {"X-LLM-Signature": ...}
    httpx.post(url, content=body_bytes, headers=headers)

    client = httpx.Client(auth=Ed25519Auth(key_id, "client.pem"))  # signs every request
    client.post(url, json={...})

``key_id`` is what ``gemel keys ed25519 --tenant T --out client.pem`` printed. The signature
covers the exact body bytes, so send the bytes you signed (``content=``, not ``json=``,
unless you use ``Ed25519Auth``, which signs what httpx actually sends). Each signature holds
a fresh nonce and is valid for ``ttl_s`` seconds (the server refuses an ``exp`` more than
30 s ahead of its clock), so sign each request, retries included, anew.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import time
from collections.abc import Generator

import httpx

SIGNATURE_HEADER = "X-LLM-Signature"
ALG = "ed25519"
DEFAULT_TTL_S = 15.0  # leaves 15 s for clock skew either way within the server's 30 s


def _b64url(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def load_private_key(key):
    """An Ed25519 private key from a key object, PEM bytes/text, or a PEM file path."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    if isinstance(key, Ed25519PrivateKey):
        return key
    if isinstance(key, os.PathLike) or (isinstance(key, str) and not key.lstrip().startswith("-----BEGIN")):
        with open(key, "rb") as f:
            key = f.read()
    if isinstance(key, str):
        key = key.encode()
    loaded = serialization.load_pem_private_key(key, password=None)
    if not isinstance(loaded, Ed25519PrivateKey):
        raise ValueError("not an Ed25519 private key")
    return loaded


def signature_header(
    body: bytes, key_id: str, private_key, *, ttl_s: float = DEFAULT_TTL_S, now: float | None = None, nonce: str | None = None
) -> str:
    """The ``X-LLM-Signature`` value for a request with this exact body."""
    key = load_private_key(private_key)
    now = time.time() if now is None else now
    claims = {
        "iss": key_id,
        "exp": int((now + ttl_s) * 1000),
        "nonce": nonce if nonce is not None else secrets.token_urlsafe(18),
        "body_sha256": hashlib.sha256(body).hexdigest(),
    }
    payload = _b64url(json.dumps(claims, separators=(",", ":")).encode())
    signing_input = f"{ALG}.{payload}"
    return f"{signing_input}.{_b64url(key.sign(signing_input.encode('ascii')))}"


def sign_request(
    body: bytes | str, key_id: str, private_key, *, ttl_s: float = DEFAULT_TTL_S, now: float | None = None, nonce: str | None = None
) -> dict[str, str]:
    """Headers that authenticate a request with this exact body as the signing key's tenant.

    ``private_key``: an ``Ed25519PrivateKey``, PEM bytes, or the path of the PEM file.
    ``now`` (seconds since the epoch) and ``nonce`` are for tests."""
    if isinstance(body, str):
        body = body.encode()
    return {SIGNATURE_HEADER: signature_header(body, key_id, private_key, ttl_s=ttl_s, now=now, nonce=nonce)}


class Ed25519Auth(httpx.Auth):
    """httpx authentication that signs every request (its body as sent) with an Ed25519 key.

    Works with ``httpx.Client(auth=...)`` and ``httpx.AsyncClient(auth=...)``. A request that
    carries both a valid signature and an API key is authenticated by the signature alone."""

    requires_request_body = True

    def __init__(self, key_id: str, private_key, ttl_s: float = DEFAULT_TTL_S):
        self.key_id = key_id
        self.private_key = load_private_key(private_key)
        self.ttl_s = ttl_s

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers[SIGNATURE_HEADER] = signature_header(request.content, self.key_id, self.private_key, ttl_s=self.ttl_s)
        yield request
