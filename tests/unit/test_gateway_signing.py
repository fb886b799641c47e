"""X-LLM-Signature verification and the client helper, with a fixed clock."""

from __future__ import annotations

import hashlib
import json

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gemel.client import Ed25519Auth, sign_request, signature_header
from gemel.gateway.signing import NonceCache, SignatureError, SignatureVerifier, SigningKey, b64url_encode, parse_header

NOW = 1_700_000_000.0
BODY = b'{"contents":[{"parts":[{"text":"hi"}]}]}'


@pytest.fixture
def key():
    return Ed25519PrivateKey.generate()


@pytest.fixture
def clock():
    return {"t": NOW}


@pytest.fixture
def verifier(key, clock):
    keys = {"k1": SigningKey("acme", "k1", key.public_key())}
    return SignatureVerifier(keys.get, clock=lambda: clock["t"])


def reason(verifier, header, body=BODY) -> str:
    with pytest.raises(SignatureError) as e:
        verifier.verify(header, body)
    return e.value.reason


def forge(key, claims: dict, alg: str = "ed25519") -> str:
    payload = b64url_encode(json.dumps(claims).encode())
    return f"{alg}.{payload}.{b64url_encode(key.sign(f'{alg}.{payload}'.encode()))}"


def test_valid_then_replay(verifier, key):
    h = signature_header(BODY, "k1", key, now=NOW)
    assert verifier.verify(h, BODY).tenant == "acme"
    assert reason(verifier, h) == "signature_replay"


def test_each_failure_has_its_reason_and_message(verifier, key, clock):
    messages = set()

    def check(expected, header, body=BODY):
        with pytest.raises(SignatureError) as e:
            verifier.verify(header, body)
        assert e.value.reason == expected, e.value.message
        messages.add(e.value.message.split(":")[0] + e.value.reason)
        return e.value

    check("signature_unknown_key", signature_header(BODY, "nope", key, now=NOW))
    other = Ed25519PrivateKey.generate()
    assert check("signature_invalid", signature_header(BODY, "k1", other, now=NOW)).tenant == "acme"
    check("signature_expired", signature_header(BODY, "k1", key, now=NOW - 60))
    check("signature_future", signature_header(BODY, "k1", key, now=NOW + 20, ttl_s=15))  # exp = now + 35 s
    check("signature_body_mismatch", signature_header(BODY, "k1", key, now=NOW), body=BODY + b" ")
    check("signature_malformed", "garbage")
    assert len(messages) == 6


def test_skew_window(verifier, key):
    # 29 s ahead is accepted, 31 s ahead is not; just expired is refused
    assert verifier.verify(signature_header(BODY, "k1", key, now=NOW, ttl_s=29), BODY)
    assert reason(verifier, signature_header(BODY, "k1", key, now=NOW, ttl_s=31)) == "signature_future"
    assert reason(verifier, signature_header(BODY, "k1", key, now=NOW - 15.001, ttl_s=15)) == "signature_expired"


def test_signature_checked_before_expiry(verifier, key):
    # a forged header tells an attacker nothing about timing: bad signature wins over expiry
    other = Ed25519PrivateKey.generate()
    assert reason(verifier, signature_header(BODY, "k1", other, now=NOW - 600)) == "signature_invalid"


def test_nonce_not_burnt_by_a_failed_request(verifier, key):
    h_bad_body = signature_header(BODY, "k1", key, now=NOW, nonce="n" * 16)
    assert reason(verifier, h_bad_body, body=b"other") == "signature_body_mismatch"
    # the same nonce with the right body still works once
    assert verifier.verify(signature_header(BODY, "k1", key, now=NOW, nonce="n" * 16), BODY)
    assert reason(verifier, signature_header(BODY, "k1", key, now=NOW, nonce="n" * 16)) == "signature_replay"


def test_nonces_forgotten_after_expiry(verifier, key, clock):
    verifier.verify(signature_header(BODY, "k1", key, now=NOW, ttl_s=10, nonce="x" * 16), BODY)
    assert len(verifier.nonces) == 1
    clock["t"] = NOW + 11
    verifier.verify(signature_header(BODY, "k1", key, now=NOW + 11, ttl_s=10), BODY)
    assert len(verifier.nonces) == 1  # the first one was purged


@pytest.mark.parametrize(
    "claims_or_header",
    [
        "ed25519.abc",
        "ed25519.a.b.c",
        "rs256.e30.AAAA",
        "ed25519.e30=.AAAA",
        "ed25519.!!!.AAAA",
        {"iss": "k1", "exp": 1, "nonce": "short", "body_sha256": "0" * 64},
        {"iss": "k1", "exp": "1", "nonce": "n" * 16, "body_sha256": "0" * 64},
        {"iss": "k1", "exp": 1.5, "nonce": "n" * 16, "body_sha256": "0" * 64},
        {"iss": "k1", "exp": True, "nonce": "n" * 16, "body_sha256": "0" * 64},
        {"iss": "k1", "exp": 1, "nonce": "n" * 16, "body_sha256": "0" * 64 + "0"},
        {"iss": "k1", "exp": 1, "nonce": "n" * 16, "body_sha256": "A" * 64},
        {"iss": "", "exp": 1, "nonce": "n" * 16, "body_sha256": "0" * 64},
        {"exp": 1, "nonce": "n" * 16, "body_sha256": "0" * 64},
        [1, 2],
    ],
)
def test_malformed(verifier, key, claims_or_header):
    header = claims_or_header if isinstance(claims_or_header, str) else forge(key, claims_or_header)
    assert reason(verifier, header) == "signature_malformed"


def test_wrong_alg_and_not_json(verifier, key):
    good = {"iss": "k1", "exp": int(NOW * 1000) + 5000, "nonce": "n" * 16, "body_sha256": hashlib.sha256(BODY).hexdigest()}
    assert reason(verifier, forge(key, good, alg="ED25519")) == "signature_malformed"
    payload = b64url_encode(b"not json")
    assert reason(verifier, f"ed25519.{payload}.{b64url_encode(key.sign(f'ed25519.{payload}'.encode()))}") == "signature_malformed"
    # and the well-formed one passes
    assert verifier.verify(forge(key, good), BODY).key_id == "k1"


def test_header_format_matches_the_contract(key):
    h = sign_request(BODY, "k1", key, now=NOW)["X-LLM-Signature"]
    alg, payload, sig = h.split(".")
    assert alg == "ed25519" and "=" not in payload + sig
    signed, claims, signature = parse_header(h)
    assert signed == f"ed25519.{payload}".encode()
    assert claims.iss == "k1" and claims.exp == int((NOW + 15) * 1000) and len(claims.nonce) >= 16
    assert claims.body_sha256 == hashlib.sha256(BODY).hexdigest()
    key.public_key().verify(signature, signed)


def test_nonce_cache_keeps_latest_expiry():
    c = NonceCache()
    c.add("k", "n", 100)
    c.add("k", "n", 200)
    c.purge(150)
    assert c.seen("k", "n", 150)
    assert not c.seen("k", "n", 201)


def test_httpx_auth_signs_the_body_sent(key, clock):
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["header"] = request.headers["x-llm-signature"]
        seen["body"] = request.content
        return httpx.Response(200)

    client = httpx.Client(transport=httpx.MockTransport(handler), auth=Ed25519Auth("k1", key))
    client.post("http://x/v1/chat/completions", json={"a": 1})
    keys = {"k1": SigningKey("acme", "k1", key.public_key())}
    import time

    v = SignatureVerifier(keys.get, clock=time.time)
    assert v.verify(seen["header"], seen["body"]).tenant == "acme"


def test_load_private_key_from_pem_text_and_path(tmp_path, key):
    from cryptography.hazmat.primitives import serialization

    from gemel.client import load_private_key

    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    p = tmp_path / "k.pem"
    p.write_bytes(pem)
    for src in (pem, pem.decode(), str(p), p):
        assert load_private_key(src).public_key().public_bytes_raw() == key.public_key().public_bytes_raw()
