"""Signed requests: verifying ``X-LLM-Signature``.

The header is ``ed25519.<payload>.<signature>``:

* ``payload``: unpadded base64url of the JSON object ``{"iss": key id, "exp": Unix ms,
  "nonce": >= 16 characters, "body_sha256": lowercase hex SHA-256 of the exact body bytes}``;
* ``signature``: unpadded base64url of the Ed25519 signature over the ASCII bytes
  ``ed25519.<payload>``, checked with the public key registered under ``iss``.

Checks, in order, each failure with its own message and counter reason: the header's shape
(``signature_malformed``), the key id (``signature_unknown_key``), the signature
(``signature_invalid``), the expiry - past (``signature_expired``) or more than 30 s ahead
(``signature_future``) -, the body digest (``signature_body_mismatch``), and last the nonce
(``signature_replay``): a nonce is remembered, per key id, until its ``exp`` has passed, after
which the request would be refused as expired anyway. A nonce is recorded only for a request
that passed every other check, so a forged request cannot burn a legitimate client's nonce.
The client side is ``gemel.client.sign_request``.
"""

from __future__ import annotations

import base64
import hashlib
import heapq
import hmac
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

SIGNATURE_HEADER = "x-llm-signature"
ALG = "ed25519"
MAX_FUTURE_S = 30.0  # an exp further ahead than this is refused (and bounds the nonce memory)
MIN_NONCE_LEN = 16
MAX_NONCE_LEN = 256
MAX_HEADER_LEN = 4096

_B64URL = re.compile(r"^[A-Za-z0-9_-]+$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class SignatureError(Exception):
    """A refused signature: ``reason`` for the counters, ``message`` for the client."""

    def __init__(self, reason: str, message: str, tenant: str | None = None):
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.tenant = tenant


@dataclass(frozen=True)
class Claims:
    iss: str
    exp: int  # Unix milliseconds
    nonce: str
    body_sha256: str


def b64url_encode(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def b64url_decode(text: str) -> bytes:
    """Strict unpadded base64url: no padding, no other alphabet."""
    if not _B64URL.match(text) or len(text) % 4 == 1:
        raise ValueError("not unpadded base64url")
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _malformed(detail: str) -> SignatureError:
    return SignatureError(
        "signature_malformed",
        f"X-LLM-Signature is malformed: {detail}; expected ed25519.<payload>.<signature>, both parts "
        'unpadded base64url, the payload the JSON {"iss", "exp", "nonce", "body_sha256"}',
    )


def parse_header(value: str) -> tuple[bytes, Claims, bytes]:
    """(signed bytes, claims, signature) of a header, or SignatureError('signature_malformed')."""
    if len(value) > MAX_HEADER_LEN:
        raise _malformed(f"longer than {MAX_HEADER_LEN} characters")
    parts = value.strip().split(".")
    if len(parts) != 3:
        raise _malformed(f"{len(parts)} dot-separated part{'s' if len(parts) != 1 else ''} instead of 3")
    alg, payload_b64, sig_b64 = parts
    if alg != ALG:
        raise _malformed(f"algorithm {alg[:32]!r} is not supported (only {ALG!r})")
    try:
        payload = b64url_decode(payload_b64)
    except ValueError:
        raise _malformed("the payload is not unpadded base64url") from None
    try:
        signature = b64url_decode(sig_b64)
    except ValueError:
        raise _malformed("the signature is not unpadded base64url") from None
    if len(signature) != 64:
        raise _malformed(f"an Ed25519 signature is 64 bytes, this one is {len(signature)}")
    try:
        obj = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise _malformed("the payload is not JSON") from None
    if not isinstance(obj, dict):
        raise _malformed("the payload is not a JSON object")
    missing = [k for k in ("iss", "exp", "nonce", "body_sha256") if k not in obj]
    if missing:
        raise _malformed(f"the payload lacks {', '.join(missing)}")
    iss, exp, nonce, digest = obj["iss"], obj["exp"], obj["nonce"], obj["body_sha256"]
    if not isinstance(iss, str) or not iss or len(iss) > 256:
        raise _malformed("iss must be a non-empty string (the key id)")
    if not isinstance(exp, int) or isinstance(exp, bool):
        raise _malformed("exp must be an integer (Unix time in milliseconds)")
    if not isinstance(nonce, str) or not MIN_NONCE_LEN <= len(nonce) <= MAX_NONCE_LEN:
        raise _malformed(f"nonce must be a string of {MIN_NONCE_LEN} to {MAX_NONCE_LEN} characters")
    if not isinstance(digest, str) or not _HEX64.match(digest):
        raise _malformed("body_sha256 must be 64 lowercase hex digits")
    signed = f"{alg}.{payload_b64}".encode("ascii")
    return signed, Claims(iss, exp, nonce, digest), signature


class NonceCache:
    """Nonces seen per key id, each kept until its request's exp has passed."""

    def __init__(self) -> None:
        self._expiry: dict[tuple[str, str], int] = {}
        self._heap: list[tuple[int, tuple[str, str]]] = []

    def __len__(self) -> int:
        return len(self._expiry)

    def purge(self, now_ms: int) -> None:
        heap = self._heap
        while heap and heap[0][0] < now_ms:
            exp, key = heapq.heappop(heap)
            if self._expiry.get(key) == exp:
                del self._expiry[key]

    def seen(self, iss: str, nonce: str, now_ms: int) -> bool:
        self.purge(now_ms)
        return (iss, nonce) in self._expiry

    def add(self, iss: str, nonce: str, exp_ms: int) -> None:
        key = (iss, nonce)
        self._expiry[key] = exp_ms
        heapq.heappush(self._heap, (exp_ms, key))


@dataclass(frozen=True)
class SigningKey:
    tenant: str
    key_id: str
    public_key: object  # cryptography's Ed25519PublicKey


class SignatureVerifier:
    """Checks headers against the registered public keys; remembers nonces."""

    def __init__(self, lookup: Callable[[str], SigningKey | None], clock: Callable[[], float] = time.time):
        self.lookup = lookup
        self.clock = clock  # seconds since the epoch
        self.nonces = NonceCache()

    def verify(self, header: str, body: bytes) -> SigningKey:
        from cryptography.exceptions import InvalidSignature

        signed, claims, signature = parse_header(header)
        key = self.lookup(claims.iss)
        if key is None:
            raise SignatureError("signature_unknown_key", f"X-LLM-Signature: unknown signing key id (iss) {claims.iss[:64]!r}")
        try:
            key.public_key.verify(signature, signed)
        except InvalidSignature:
            raise SignatureError(
                "signature_invalid", f"X-LLM-Signature: the signature does not verify with the public key of {claims.iss!r}", key.tenant
            ) from None
        now_ms = int(self.clock() * 1000)
        if claims.exp < now_ms:
            raise SignatureError(
                "signature_expired", f"X-LLM-Signature: expired {(now_ms - claims.exp) / 1000:.1f} s ago (exp is Unix milliseconds)", key.tenant
            )
        if claims.exp > now_ms + MAX_FUTURE_S * 1000:
            raise SignatureError(
                "signature_future",
                f"X-LLM-Signature: exp is {(claims.exp - now_ms) / 1000:.1f} s in the future, more than the "
                f"{MAX_FUTURE_S:g} s allowed (check the client's clock)",
                key.tenant,
            )
        digest = hashlib.sha256(body).hexdigest()
        if not hmac.compare_digest(digest, claims.body_sha256):
            raise SignatureError(
                "signature_body_mismatch", "X-LLM-Signature: body_sha256 does not match the SHA-256 of the request body", key.tenant
            )
        if self.nonces.seen(claims.iss, claims.nonce, now_ms):
            raise SignatureError(
                "signature_replay",
                "X-LLM-Signature: this nonce was already used (a replayed request); sign every request with a fresh nonce",
                key.tenant,
            )
        self.nonces.add(claims.iss, claims.nonce, claims.exp)
        return key
