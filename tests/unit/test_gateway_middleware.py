"""The gateway in front of a small app, over HTTP in-process (no engine): auth on both
surfaces, admission, counters, key redaction."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fastapi import Depends, FastAPI, Request

from gemel.api.auth import Principal, authenticate
from gemel.api.errors import install_error_handlers
from gemel.client import sign_request
from gemel.config import GatewayConfig, GemelConfig
from gemel.gateway.gateway import Gateway, binds_loopback_only
from gemel.gateway.middleware import GatewayMiddleware
from gemel.gateway.tenants import TenantsFile, add_api_key, add_signing_key, save_tenants


def make_app(gateway: Gateway) -> tuple[FastAPI, dict]:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(GatewayMiddleware, gateway=gateway)
    gates: dict[str, asyncio.Event] = {}

    async def info(request: Request, principal: Principal) -> dict:
        return {
            "tenant": principal.tenant, "priority": principal.priority, "via": principal.via,
            "query": request.url.query, "body": (await request.body()).decode(),
            "quota": None if principal.quota is None else [principal.quota.max_running_seqs, principal.quota.max_kv_blocks_share],
        }

    @app.post("/v1beta/models/{model}:countTokens")
    async def count(model: str, request: Request, principal: Principal = Depends(authenticate)):
        return await info(request, principal)

    @app.post("/v1/chat/completions")
    async def chat(request: Request, principal: Principal = Depends(authenticate)):
        return await info(request, principal)

    @app.get("/v1/models")
    async def models(request: Request, principal: Principal = Depends(authenticate)):
        return await info(request, principal)

    @app.get("/healthz")
    async def healthz():
        return {"status": "OK"}

    @app.post("/v1beta/models/{model}:generateContent")
    async def generate(model: str, request: Request, principal: Principal = Depends(authenticate)):
        data = json.loads(await request.body() or b"{}")
        await principal.admit_generation(data.get("prompt", 10), data.get("max", 10))
        gate = gates.setdefault(data.get("gate", "g"), asyncio.Event())

        async def engine():
            await gate.wait()
            yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1] * data.get("generated", 3))])

        async for _ in principal.meter(engine()):
            pass
        return {"tenant": principal.tenant}

    return app, gates


def client(app, host: str = "127.0.0.1") -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=(host, 1234)), base_url="http://test")


@pytest.fixture
def tenants(tmp_path):
    tf = TenantsFile()
    keys = {
        "acme": add_api_key(tf, "acme"),
        "strict": add_api_key(tf, "strict"),
        "limited": add_api_key(tf, "limited"),
        "batch": add_api_key(tf, "batch"),
    }
    tf.tenants["acme"].priority = "P0"
    tf.tenants["acme"].engine.max_running_seqs = 4
    tf.tenants["acme"].engine.max_kv_blocks_share = 0.5
    tf.tenants["strict"].require_signature = True
    tf.tenants["limited"].rpm = 3
    tf.tenants["limited"].max_concurrent = 1
    tf.tenants["limited"].tpm = 100
    tf.tenants["batch"].priority = "P2"
    signer = Ed25519PrivateKey.generate()
    kid = add_signing_key(tf, "strict", signer.public_key())
    path = tmp_path / "tenants.yaml"
    save_tenants(path, tf)
    return SimpleNamespace(path=path, keys=keys, signer=signer, kid=kid)


def gateway_for(tenants, **kw) -> Gateway:
    return Gateway(GatewayConfig(tenants_file=str(tenants.path), **kw))


def run(coro):
    return asyncio.run(coro)


def test_anonymous_mode_loopback_only():
    async def go():
        gw = Gateway(GatewayConfig())
        app, _ = make_app(gw)
        async with client(app) as c:
            r = await c.post("/v1beta/models/m:countTokens", headers={"x-goog-api-key": "anything"})
            assert r.status_code == 200 and r.json()["tenant"] == "anonymous" and r.json()["priority"] == 1
        async with client(app, "10.1.2.3") as c:
            r = await c.post("/v1beta/models/m:countTokens")
            assert r.status_code == 403 and r.json()["error"]["status"] == "PERMISSION_DENIED"
        app2, _ = make_app(Gateway(GatewayConfig(insecure=True)))
        async with client(app2, "10.1.2.3") as c:
            assert (await c.post("/v1beta/models/m:countTokens")).status_code == 200

    run(go())


def test_serve_refuses_public_address_without_auth(tmp_path):
    from gemel.api.server import gateway_problem

    def cfg(**gw):
        return GemelConfig.model_validate({"server": {"host": gw.pop("host")}, "gateway": gw, "embeddings": None})

    assert "refusing" in gateway_problem(cfg(host="0.0.0.0"))
    assert "refusing" in gateway_problem(cfg(host="::"))
    assert gateway_problem(cfg(host="0.0.0.0", insecure=True)) is None
    assert gateway_problem(cfg(host="127.0.0.1")) is None
    assert gateway_problem(cfg(host="localhost")) is None
    assert "does not exist" in gateway_problem(cfg(host="0.0.0.0", tenants_file=str(tmp_path / "none.yaml")))
    bad = tmp_path / "bad.yaml"
    bad.write_text("tenants: {a: {priority: P9}}")
    assert "bad tenants file" in gateway_problem(cfg(host="0.0.0.0", tenants_file=str(bad)))
    assert binds_loopback_only("::1") and binds_loopback_only("127.0.0.2") and not binds_loopback_only("0.0.0.0")


def test_missing_and_unknown_keys_per_surface(tenants):
    async def go():
        gw = gateway_for(tenants)
        app, _ = make_app(gw)
        async with client(app) as c:
            r = await c.post("/v1beta/models/m:countTokens")
            assert r.status_code == 401 and r.json()["error"]["status"] == "UNAUTHENTICATED"
            r = await c.post("/v1/chat/completions")
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            bad = tenants.keys["acme"][:-4] + "AAAA"  # right key id, wrong secret
            for headers, params in (({"x-goog-api-key": "nope"}, {}), ({}, {"key": bad})):
                r = await c.post("/v1beta/models/m:countTokens", headers=headers, params=params)
                err = r.json()["error"]
                assert r.status_code == 400 and err["status"] == "INVALID_ARGUMENT"
                assert err["details"][0]["@type"] == "type.googleapis.com/google.rpc.ErrorInfo"
                assert err["details"][0]["reason"] == "API_KEY_INVALID" and err["details"][0]["domain"] == "googleapis.com"
                assert bad not in r.text
            r = await c.post("/v1/chat/completions", headers={"authorization": f"Bearer {bad}"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key" and bad not in r.text
            # the path both surfaces share answers by the credential's form
            assert (await c.get("/v1/models", headers={"authorization": "Bearer nope"})).status_code == 401
            assert (await c.get("/v1/models", headers={"x-goog-api-key": "nope"})).status_code == 400
            assert (await c.get("/healthz")).status_code == 200  # public
        counts = gw.counters.as_dict()["auth_failures"]
        assert counts["unknown"]["missing_key"] == 2
        assert counts["unknown"]["invalid_key"] == 3 and counts["acme"]["invalid_key"] == 2

    run(go())


def test_valid_key_three_ways_and_redaction(tenants):
    async def go():
        app, _ = make_app(gateway_for(tenants))
        key = tenants.keys["acme"]
        async with client(app) as c:
            for kw in ({"headers": {"x-goog-api-key": key}}, {"params": {"key": key, "alt": "sse"}},
                       {"headers": {"authorization": f"Bearer {key}"}}):
                r = await c.post("/v1beta/models/m:countTokens", **kw)
                body = r.json()
                assert r.status_code == 200 and body["tenant"] == "acme" and body["priority"] == 0 and body["via"] == "api_key"
                assert key not in body["query"]
                assert body["quota"] == [4, 0.5]
            r = await c.post("/v1beta/models/m:countTokens", params={"key": key, "alt": "sse"})
            assert r.json()["query"] == "key=REDACTED&alt=sse"

    run(go())


def test_signatures_through_the_middleware(tenants):
    async def go():
        gw = gateway_for(tenants)
        app, _ = make_app(gw)
        body = b'{"contents": []}'
        async with client(app) as c:
            # a tenant that requires signatures: key alone refused, signature alone accepted
            r = await c.post("/v1beta/models/m:countTokens", headers={"x-goog-api-key": tenants.keys["strict"]})
            assert r.status_code == 401 and "requires signed requests" in r.json()["error"]["message"]
            headers = sign_request(body, tenants.kid, tenants.signer)
            r = await c.post("/v1beta/models/m:countTokens", content=body, headers=headers)
            assert r.status_code == 200 and r.json()["via"] == "signature" and r.json()["body"] == body.decode()
            r = await c.post("/v1beta/models/m:countTokens", content=body, headers=headers)
            assert r.status_code == 401 and "replay" in r.json()["error"]["message"]
            # OpenAI surface: 401 with code invalid_signature; an unknown API key beside a good signature is ignored
            headers = sign_request(body, tenants.kid, tenants.signer) | {"authorization": "Bearer placeholder"}
            assert (await c.post("/v1/chat/completions", content=body, headers=headers)).status_code == 200
            r = await c.post("/v1/chat/completions", content=body + b" ", headers=sign_request(body, tenants.kid, tenants.signer))
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_signature"
        counts = gw.counters.as_dict()["auth_failures"]["strict"]
        assert counts == {"signature_required": 1, "signature_replay": 1, "signature_body_mismatch": 1}

    run(go())


def test_rpm_and_concurrency_and_tokens(tenants):
    async def go():
        gw = gateway_for(tenants)
        app, gates = make_app(gw)
        h = {"x-goog-api-key": tenants.keys["limited"]}
        async with client(app) as c:
            # max_concurrent 1: a second request while the first waits is refused
            first = asyncio.ensure_future(c.post("/v1beta/models/m:generateContent", headers=h,
                                                 json={"prompt": 10, "max": 50, "generated": 5}))
            while not gw.in_flight.get("limited"):
                await asyncio.sleep(0.01)
            assert gw.queued["P1"] == 1
            r = await c.post("/v1beta/models/m:countTokens", headers=h)
            assert r.status_code == 429 and r.headers["retry-after"] == "1" and "in flight" in r.json()["error"]["message"]
            gates["g"].set()
            assert (await first).status_code == 200
            assert gw.queued["P1"] == 0 and gw.in_flight == {}
            # tokens: 60 reserved (10 + 50), 15 used -> 85 left of 100
            assert round(gw.limiter.buckets["limited:tokens"].level) == 85
            r = await c.post("/v1beta/models/m:generateContent", headers=h, json={"prompt": 10, "max": 80})
            assert r.status_code == 429 and "tokens per minute" in r.json()["error"]["message"]
            assert int(r.headers["retry-after"]) >= 1
            # rpm 3 (the refused concurrent one did not count): the fourth request of the minute
            # is refused, with RetryInfo on Gemini
            assert (await c.post("/v1beta/models/m:countTokens", headers=h)).status_code == 200
            r = await c.post("/v1beta/models/m:countTokens", headers=h)
            assert r.status_code == 429
            err = r.json()["error"]
            assert err["status"] == "RESOURCE_EXHAUSTED" and "requests per minute" in err["message"]
            retry = [d for d in err["details"] if d["@type"] == "type.googleapis.com/google.rpc.RetryInfo"][0]
            assert retry["retryDelay"] == f"{r.headers['retry-after']}s"
            r = await c.post("/v1/chat/completions", headers={"authorization": f"Bearer {tenants.keys['limited']}"})
            assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded" and "retry-after" in r.headers
            # another tenant is unaffected
            assert (await c.post("/v1beta/models/m:countTokens", headers={"x-goog-api-key": tenants.keys["acme"]})).status_code == 200
        assert gw.counters.as_dict()["rate_limited"]["limited"] == {"concurrent": 1, "tokens": 1, "requests": 2}
        names = {name for name, _, _ in gw.counters.samples()}
        assert names == {"gemel:gateway_rate_limited_total"}
        assert ("gemel:gateway_rate_limited_total", {"tenant": "limited", "kind": "requests"}, 2) in list(gw.counters.samples())

    run(go())


def test_class_queue_bound(tenants):
    async def go():
        gw = gateway_for(tenants, queue_limits={"P0": 5, "P1": 5, "P2": 2}, queue_retry_after_s=2)
        app, gates = make_app(gw)
        h = {"x-goog-api-key": tenants.keys["batch"]}
        async with client(app) as c:
            waiting = [asyncio.ensure_future(c.post("/v1beta/models/m:generateContent", headers=h, json={"gate": f"g{i}"}))
                       for i in range(2)]
            while gw.queued["P2"] < 2:
                await asyncio.sleep(0.01)
            r = await c.post("/v1beta/models/m:generateContent", headers=h, json={"gate": "g9"})
            assert r.status_code == 503 and r.json()["error"]["status"] == "UNAVAILABLE" and r.headers["retry-after"] == "2"
            # other classes have their own queues
            r = asyncio.ensure_future(c.post("/v1beta/models/m:generateContent",
                                             headers={"x-goog-api-key": tenants.keys["acme"]}, json={"gate": "a"}))
            while gw.queued["P0"] < 1:
                await asyncio.sleep(0.01)
            # a first token takes a request out of the queue: there is room again
            gates["g0"].set()
            await waiting[0]
            assert gw.queued["P2"] == 1
            for name in ("g1", "a"):
                gates[name].set()
            await waiting[1]
            assert (await r).status_code == 200
            assert gw.queued == {"P0": 0, "P1": 0, "P2": 0}
        assert gw.counters.as_dict()["admission_rejected"] == {"batch": {"queue_full": 1}}

    run(go())


def test_new_keys_are_picked_up_without_restart(tenants):
    from gemel.gateway.tenants import load_tenants

    async def go():
        gw = gateway_for(tenants, reload_interval_s=0.001)
        app, _ = make_app(gw)
        tf = load_tenants(tenants.path)
        new = add_api_key(tf, "newcomer")
        save_tenants(tenants.path, tf)
        time.sleep(0.01)
        async with client(app) as c:
            r = await c.post("/v1beta/models/m:countTokens", headers={"x-goog-api-key": new})
            assert r.status_code == 200 and r.json()["tenant"] == "newcomer"
            # a broken file keeps the previous tenants
            tenants.path.write_text("tenants: [")
            time.sleep(0.01)
            assert (await c.post("/v1beta/models/m:countTokens", headers={"x-goog-api-key": new})).status_code == 200

    run(go())


def test_priority_only_lowered():
    p = Principal(tenant="t", priority_class="P1", priority=1)
    assert p.priority_for(None) == 1 and p.priority_for(0) == 1 and p.priority_for(2) == 2


def test_grpc_metadata_entry_point(tenants):
    gw = gateway_for(tenants)
    p = gw.authenticate_metadata([("x-goog-api-key", tenants.keys["acme"]), ("bin-bin", b"\x00")])
    assert p.tenant == "acme" and p.via == "api_key"
    body = b"\x0a\x02hi"
    p = gw.authenticate_metadata(list(sign_request(body, tenants.kid, tenants.signer).items()), body=body)
    assert p.tenant == "strict" and p.via == "signature"
