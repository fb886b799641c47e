"""The gateway through real HTTP on a real `gemel serve`: keys made with
`gemel keys`, both REST surfaces, every signature path, rate limits, admission, and no
plaintext key on disk or in the logs."""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from gemel.client import Ed25519Auth, load_private_key, sign_request, signature_header
from gemel.gateway.signing import b64url_encode

from conftest import Server, free_port, launch, serve_command

pytestmark = pytest.mark.slow

MODEL = "gemini-2.0-flash"
COUNT = f"/v1beta/models/{MODEL}:countTokens"
GENERATE = f"/v1beta/models/{MODEL}:generateContent"
CHAT = "/v1/chat/completions"
COUNT_BODY = json.dumps({"contents": [{"role": "user", "parts": [{"text": "Hello there"}]}]}).encode()

CONFIG = """
engine:
  dtype: float32
  kv_cache_memory_mb: 128
  max_num_seqs: 16
  max_num_batched_tokens: 512
server:
  stats_interval_s: 0.2
  log_level: info
gateway:
  queue_limits: {P0: 64, P1: 64, P2: 0}
  queue_retry_after_s: 2
"""


def gemel_command() -> list[str]:
    script = Path(sys.executable).with_name("gemel")
    return [str(script)] if script.exists() else [sys.executable, "-m", "gemel.cli"]


def keys(*args: str, lines: int = 1) -> str:
    """Run `gemel keys ...`; its stdout (the key or key id), checked to be one line."""
    r = subprocess.run([*gemel_command(), "keys", *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert len(out) == lines, r.stdout
    return out[0] if out else ""


@dataclass
class Env:
    server: Server
    tenants: Path
    keys: dict[str, str] = field(default_factory=dict)
    signer_pem: Path | None = None
    signer_iss: str = ""
    strict_pem: Path | None = None
    strict_iss: str = ""

    @property
    def url(self) -> str:
        return self.server.url

    def full_log(self) -> str:
        return self.server.log_path.read_text(errors="replace")


def start(tmp: Path, tenants: Path, ready_timeout: float = 240) -> Server:
    config = tmp / "gemel.yaml"
    config.write_text(CONFIG)
    port = free_port()
    args = ["--config", str(config), "--tenants", str(tenants), "--host", "127.0.0.1",
            "--port", str(port), "--no-embeddings", "--no-grpc"]
    return launch(args, port, tmp / "server.log", ready_timeout)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gateway")
    tenants = tmp / "tenants.yaml"
    t = str(tenants)
    e = Env(server=None, tenants=tenants)  # type: ignore[arg-type]
    e.keys["alpha"] = keys("create", "--tenants", t, "--tenant", "alpha", "--priority", "P0")
    e.keys["limited"] = keys("create", "--tenants", t, "--tenant", "limited", "--rpm", "60")
    e.keys["other"] = keys("create", "--tenants", t, "--tenant", "other", "--rpm", "60")
    e.keys["tokens"] = keys("create", "--tenants", t, "--tenant", "tokens", "--tpm", "200")
    e.keys["batch"] = keys("create", "--tenants", t, "--tenant", "batch", "--priority", "P2")
    e.keys["strict"] = keys("create", "--tenants", t, "--tenant", "strict")
    keys("set", "--tenants", t, "--tenant", "strict", "--require-signature", "yes", lines=0)
    e.signer_pem, e.strict_pem = tmp / "signer.pem", tmp / "strict.pem"
    e.signer_iss = keys("ed25519", "--tenants", t, "--tenant", "signer", "--out", str(e.signer_pem))
    e.strict_iss = keys("ed25519", "--tenants", t, "--tenant", "strict", "--out", str(e.strict_pem))
    e.server = start(tmp, tenants)
    yield e
    e.server.stop()


def post(env: Env, path: str, body: bytes = COUNT_BODY, headers: dict | None = None, params: dict | None = None) -> httpx.Response:
    h = {"content-type": "application/json"} | (headers or {})
    return httpx.post(env.url + path, content=body, headers=h, params=params, timeout=120)


def error(r: httpx.Response) -> dict:
    return r.json()["error"]


# -- API keys --------------------------------------------------------------------------------
def test_health_is_public(env):
    assert httpx.get(env.url + "/healthz", timeout=10).status_code == 200
    assert httpx.get(env.url + "/readyz", timeout=10).status_code == 200


def test_missing_key_is_401_on_both_surfaces(env):
    r = post(env, COUNT)
    assert r.status_code == 401 and error(r)["status"] == "UNAUTHENTICATED" and error(r)["code"] == 401
    chat = json.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    r = post(env, CHAT, chat)
    assert r.status_code == 401 and error(r)["type"] == "authentication_error"
    assert httpx.get(env.url + "/v1beta/models", timeout=10).status_code == 401


def test_unknown_key_gemini_is_400_api_key_invalid(env):
    from google import genai
    from google.genai import errors, types

    bad = env.keys["alpha"][:-6] + "abcdef"  # known key id, wrong secret
    for headers, params in (({"x-goog-api-key": "AIzaSyNotAKey"}, None), (None, {"key": bad})):
        r = post(env, COUNT, headers=headers, params=params)
        err = error(r)
        assert r.status_code == 400 and err["status"] == "INVALID_ARGUMENT" and err["code"] == 400
        assert {"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "API_KEY_INVALID",
                "domain": "googleapis.com"}.items() <= err["details"][0].items()
    client = genai.Client(api_key="AIzaSyNotAKey", http_options=types.HttpOptions(base_url=env.url, api_version="v1beta"))
    with pytest.raises(errors.ClientError) as e:
        client.models.count_tokens(model=MODEL, contents="hi")
    assert e.value.code == 400 and e.value.status == "INVALID_ARGUMENT"


def test_unknown_key_openai_is_401(env):
    import openai

    client = openai.OpenAI(api_key="sk-not-a-key", base_url=f"{env.url}/v1", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as e:
        client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"


def test_valid_key_with_both_sdks(env):
    import openai
    from google import genai
    from google.genai import types

    g = genai.Client(api_key=env.keys["alpha"], http_options=types.HttpOptions(base_url=env.url, api_version="v1beta"))
    r = g.models.generate_content(model=MODEL, contents="Say hi.", config=types.GenerateContentConfig(max_output_tokens=4, temperature=0))
    assert r.candidates[0].content.parts[0].text
    o = openai.OpenAI(api_key=env.keys["alpha"], base_url=f"{env.url}/v1", max_retries=0, timeout=120)
    c = o.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "Say hi."}], max_tokens=4, temperature=0)
    assert c.choices[0].message.content and c.usage.completion_tokens <= 4
    # ?key= (what the cookbook's curl uses)
    assert post(env, COUNT, params={"key": env.keys["alpha"]}).json()["totalTokens"] > 0


# -- signed requests ---------------------------------------------------------------------------
def test_signature_alone_authenticates_and_replay_is_refused(env):
    headers = sign_request(COUNT_BODY, env.signer_iss, env.signer_pem)
    first = post(env, COUNT, headers=headers)
    assert first.status_code == 200 and first.json()["totalTokens"] > 0
    again = post(env, COUNT, headers=headers)  # the exact same request, byte for byte
    assert again.status_code == 401 and error(again)["status"] == "UNAUTHENTICATED"
    assert "replay" in error(again)["message"]


def test_clock_skew(env):
    key = load_private_key(env.signer_pem)
    # a client clock 20 s fast signing for 15 s: exp 35 s ahead of the server -> refused
    r = post(env, COUNT, headers=sign_request(COUNT_BODY, env.signer_iss, key, now=time.time() + 20, ttl_s=15))
    assert r.status_code == 401 and "in the future" in error(r)["message"]
    # a client clock 10 s fast is within the window
    r = post(env, COUNT, headers=sign_request(COUNT_BODY, env.signer_iss, key, now=time.time() + 10, ttl_s=15))
    assert r.status_code == 200
    # a client clock 20 s slow: already expired
    r = post(env, COUNT, headers=sign_request(COUNT_BODY, env.signer_iss, key, now=time.time() - 20, ttl_s=15))
    assert r.status_code == 401 and "expired" in error(r)["message"]


def test_every_signature_failure_has_its_own_message(env):
    key = load_private_key(env.signer_pem)
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    def forged_payload(claims: dict) -> str:
        payload = b64url_encode(json.dumps(claims).encode())
        return f"ed25519.{payload}.{b64url_encode(key.sign(f'ed25519.{payload}'.encode()))}"

    now_ms = int(time.time() * 1000)
    digest = hashlib.sha256(COUNT_BODY).hexdigest()
    cases = {
        "unknown": (signature_header(COUNT_BODY, "nobody-1234", key), COUNT_BODY),
        "bad signature": (signature_header(COUNT_BODY, env.signer_iss, Ed25519PrivateKey.generate()), COUNT_BODY),
        "expired": (signature_header(COUNT_BODY, env.signer_iss, key, now=time.time() - 60), COUNT_BODY),
        "future": (signature_header(COUNT_BODY, env.signer_iss, key, ttl_s=120), COUNT_BODY),
        "body": (signature_header(COUNT_BODY, env.signer_iss, key), COUNT_BODY.replace(b"Hello", b"Howdy")),
        "malformed": ("ed25519.not-a-valid-header", COUNT_BODY),
        "short nonce": (forged_payload({"iss": env.signer_iss, "exp": now_ms + 5000, "nonce": "abc", "body_sha256": digest}), COUNT_BODY),
    }
    messages = {}
    for name, (header, body) in cases.items():
        r = post(env, COUNT, body=body, headers={"X-LLM-Signature": header})
        assert r.status_code == 401, (name, r.text)
        assert error(r)["status"] == "UNAUTHENTICATED"
        messages[name] = error(r)["message"]
    assert "unknown signing key" in messages["unknown"]
    assert "does not verify" in messages["bad signature"]
    assert "expired" in messages["expired"]
    assert "in the future" in messages["future"]
    assert "body_sha256 does not match" in messages["body"]
    assert "malformed" in messages["malformed"] and "malformed" in messages["short nonce"]
    assert len({m for n, m in messages.items() if n != "short nonce"}) == 6
    # OpenAI surface: 401 invalid_signature
    chat = json.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    r = post(env, CHAT, chat, headers={"X-LLM-Signature": signature_header(chat + b" ", env.signer_iss, key)})
    assert r.status_code == 401 and error(r)["code"] == "invalid_signature"


def test_tenant_requiring_signatures(env):
    r = post(env, COUNT, headers={"x-goog-api-key": env.keys["strict"]})
    assert r.status_code == 401 and "requires signed requests" in error(r)["message"]
    r = post(env, COUNT, headers=sign_request(COUNT_BODY, env.strict_iss, env.strict_pem))
    assert r.status_code == 200


def test_httpx_auth_on_openai_surface(env):
    with httpx.Client(auth=Ed25519Auth(env.signer_iss, env.signer_pem), timeout=120) as c:
        r = c.post(env.url + CHAT, json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}],
                                         "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] <= 2


# -- rate limits and admission ---------------------------------------------------------------
def test_rpm_bucket_serves_60_of_100_and_others_are_unaffected(env):
    async def burst(key: str, n: int, client: httpx.AsyncClient) -> list[httpx.Response]:
        h = {"x-goog-api-key": key, "content-type": "application/json"}
        return await asyncio.gather(*(client.post(env.url + COUNT, content=COUNT_BODY, headers=h) for _ in range(n)))

    async def go():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        async with httpx.AsyncClient(limits=limits, timeout=120) as client:
            await client.get(env.url + "/healthz")
            t0 = time.monotonic()
            limited, other = await asyncio.gather(burst(env.keys["limited"], 100, client), burst(env.keys["other"], 20, client))
            return limited, other, time.monotonic() - t0

    limited, other, elapsed = asyncio.run(go())
    served = [r for r in limited if r.status_code == 200]
    refused = [r for r in limited if r.status_code != 200]
    # the bucket holds 60; it refills at 1/s, so a burst that took longer than a second may get one more per second
    assert 60 <= len(served) <= 60 + int(elapsed) + 1, (len(served), elapsed)
    assert all(r.status_code == 429 for r in refused)
    for r in refused:
        err = error(r)
        assert err["status"] == "RESOURCE_EXHAUSTED"
        retry = int(r.headers["retry-after"])
        assert retry >= 1
        info = [d for d in err["details"] if d["@type"] == "type.googleapis.com/google.rpc.RetryInfo"]
        assert info and info[0]["retryDelay"] == f"{retry}s"
    assert all(r.status_code == 200 for r in other)
    # the advertised delay is usable: after it, the tenant is served again
    time.sleep(int(refused[-1].headers["retry-after"]))
    assert post(env, COUNT, headers={"x-goog-api-key": env.keys["limited"]}).status_code == 200


def test_tokens_per_minute(env):
    h = {"x-goog-api-key": env.keys["tokens"]}
    body = json.dumps({"contents": [{"parts": [{"text": "Hi"}]}], "generationConfig": {"maxOutputTokens": 4, "temperature": 0}}).encode()
    assert post(env, GENERATE, body, headers=h).status_code == 200
    # prompt + 190 is about a minute's worth, more than what is left after the first request
    big = json.dumps({"contents": [{"parts": [{"text": "Hi"}]}], "generationConfig": {"maxOutputTokens": 190}}).encode()
    r = post(env, GENERATE, big, headers=h)
    assert r.status_code == 429 and "tokens per minute" in error(r)["message"]
    assert int(r.headers["retry-after"]) >= 1
    # openai surface: retry-after too
    chat = json.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 190}).encode()
    r = post(env, CHAT, chat, headers={"authorization": f"Bearer {env.keys['tokens']}"})
    assert r.status_code == 429 and error(r)["code"] == "rate_limit_exceeded" and int(r.headers["retry-after"]) >= 1


def test_full_class_queue_is_503_at_once(env):
    body = json.dumps({"contents": [{"parts": [{"text": "Hi"}]}], "generationConfig": {"maxOutputTokens": 2}}).encode()
    t0 = time.monotonic()
    r = post(env, GENERATE, body, headers={"x-goog-api-key": env.keys["batch"]})
    assert r.status_code == 503 and error(r)["status"] == "UNAVAILABLE" and r.headers["retry-after"] == "2"
    assert time.monotonic() - t0 < 5
    # countTokens does not queue for the engine
    assert post(env, COUNT, headers={"x-goog-api-key": env.keys["batch"]}).status_code == 200


# -- last: nothing leaked ----------------------------------------------------------------------
def test_zz_no_plaintext_key_on_disk_or_in_logs(env):
    time.sleep(0.5)  # let the access log flush
    text = env.tenants.read_text()
    log = env.full_log()
    assert "POST /v1beta/models" in log  # the access log is on (log_level info)
    assert "key=REDACTED" in log  # the ?key= requests were logged, without the key
    for tenant, key in env.keys.items():
        secret = key.split("_", 2)[2]
        assert key not in text and secret not in text, tenant
        assert key not in log and secret not in log, tenant
    assert "PRIVATE KEY" not in text
    assert oct(env.tenants.stat().st_mode & 0o777) == "0o600"


def test_refuses_public_address_without_auth(tmp_path):
    r = subprocess.run([*serve_command(), "--host", "0.0.0.0", "--port", str(free_port()), "--no-embeddings", "--no-grpc"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--insecure" in r.stderr
    r = subprocess.run([*serve_command(), "--host", "0.0.0.0", "--tenants", str(tmp_path / "missing.yaml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "does not exist" in r.stderr
