"""Routes without engines: the configuration's checks, the weighted and sticky choices, the
canary's SLO window and rollback, the fallback decisions, the stream record, the metrics and
the admin endpoints (over in-process HTTP)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry, generate_latest
from starlette.testclient import TestClient

from gemel.api import admin
from gemel.api.errors import APIError, install_error_handlers
from gemel.api.routes import RouteDecision, Routing
from gemel.api.state import ServedModel
from gemel.config import GatewayConfig, GemelConfig, RouteConfig
from gemel.engine.async_llm import EngineDeadError
from gemel.engine.protocol import EngineStats
from gemel.gateway.gateway import Gateway
from gemel.gateway.middleware import GatewayMiddleware
from gemel.gateway.principal import Principal
from gemel.gateway.routes import (
    PrefillClock, Route, RouteError, RoutesCollector, RouteTable, SLOWindow, p99, predicted_ttft_s, rendezvous_pick,
    weighted_pick,
)
from gemel.gateway.tenants import TenantsFile, add_api_key, save_tenants
from gemel.observability.stats import FinishedRequestStats, IterationStats

SMOL, GEMMA = "smollm2-135m-instruct", "gemma3-270m"


def route_config(**kw) -> RouteConfig:
    data = {
        "name": "chat",
        "targets": [{"model": SMOL, "weight": 90}, {"model": GEMMA, "weight": 10, "canary": True}],
    } | kw
    return RouteConfig.model_validate(data)


def catalogue(routes: list[dict], **kw) -> GemelConfig:
    return GemelConfig.model_validate(
        {"models": [{"id": SMOL, "source": SMOL, "aliases": ["gemini-2.0-flash"]}, {"id": GEMMA, "source": GEMMA}],
         "routes": routes} | kw
    )  # fmt: skip


# -- configuration -------------------------------------------------------------------------------
def test_config_accepts_a_route_and_keeps_its_names():
    cfg = catalogue([route_config(sticky="user", slo={"ttft_p99_ms": 2000, "error_rate": 0.05, "window": 50},
                                  fallback=GEMMA).model_dump()])  # fmt: skip
    (r,) = cfg.routes
    assert (r.name, r.sticky, r.fallback, r.slo.window) == ("chat", "user", GEMMA, 50)
    assert [(t.model, t.weight, t.canary) for t in r.targets] == [(SMOL, 90, False), (GEMMA, 10, True)]


@pytest.mark.parametrize(
    "route, words",
    [
        ({"name": "gemini-2.0-flash"}, "already a model id or alias"),
        ({"name": SMOL}, "already a model id or alias"),
        ({"name": "text-embedding-004"}, "already a model id or alias"),
        ({"targets": [{"model": "nope", "weight": 1}]}, "not the id of a generative model"),
        ({"targets": [{"model": "gemini-2.0-flash", "weight": 1}]}, "not the id of a generative model"),
        ({"fallback": "all-minilm-l6-v2"}, "not the id of a generative model"),
        ({"targets": [{"model": SMOL, "weight": 0}]}, "needs a weight above 0"),
        ({"targets": [{"model": SMOL, "weight": 1}, {"model": SMOL, "weight": 2}]}, "appears twice"),
        ({"sticky": "session"}, "sticky"),
    ],
)
def test_config_refuses_bad_routes(route, words):
    base = {"name": "chat", "targets": [{"model": SMOL, "weight": 1}]}
    with pytest.raises(ValueError, match=words):
        catalogue([base | route])


def test_config_refuses_a_route_name_used_twice():
    r = {"name": "chat", "targets": [{"model": SMOL, "weight": 1}]}
    with pytest.raises(ValueError, match="used twice"):
        catalogue([r, r])


def test_unrouted_config_is_unchanged():
    assert GemelConfig().routes == []


# -- choosing ------------------------------------------------------------------------------------
def test_weighted_pick_follows_the_weights():
    rng = random.Random(7)
    counts = Counter(weighted_pick([90, 10, 0], rng) for _ in range(20000))
    assert counts[2] == 0
    assert 0.085 < counts[1] / 20000 < 0.115
    assert weighted_pick([0, 0], rng) is None


def test_rendezvous_pick_is_stable_and_follows_the_weights():
    names, weights = [SMOL, GEMMA], [90, 10]
    first = {f"user-{i}": rendezvous_pick(f"user-{i}", names, weights, "chat") for i in range(4000)}
    again = {k: rendezvous_pick(k, names, weights, "chat") for k in first}
    assert first == again  # the same key, the same target
    share = sum(1 for v in first.values() if v == 1) / len(first)
    assert 0.08 < share < 0.12


def test_rendezvous_moves_only_the_keys_of_a_target_whose_weight_changes():
    names = [SMOL, GEMMA]
    before = {f"u{i}": rendezvous_pick(f"u{i}", names, [90, 10]) for i in range(3000)}
    after = {k: rendezvous_pick(k, names, [90, 0]) for k in before}
    assert all(v == 0 for v in after.values())  # the canary at 0 gets nobody
    assert all(after[k] == 0 for k, v in before.items() if v == 0)  # the primary's keys stayed
    grown = {k: rendezvous_pick(k, names, [90, 30]) for k in before}
    assert all(grown[k] == 1 for k, v in before.items() if v == 1)  # a larger canary keeps its keys
    assert sum(1 for v in grown.values() if v == 1) > sum(1 for v in before.values() if v == 1)


def test_sticky_route_keeps_a_key_and_spreads_keys():
    route = Route(route_config(sticky="user"), rng=random.Random(1))
    for user in ("alice", "bob", "carol"):
        assert len({route.pick(user).model for _ in range(50)}) == 1
    spread = Counter(route.pick(f"user-{i}").model for i in range(2000))
    assert spread[GEMMA] > 100 and spread[SMOL] > 1500
    # without a key a sticky route places requests at random
    assert len({route.pick(None).model for _ in range(200)}) == 2


def test_unsticky_route_ignores_the_key():
    route = Route(route_config(), rng=random.Random(3))
    assert len({route.pick("alice").model for _ in range(300)}) == 2


# -- the SLO window and the rollback --------------------------------------------------------------
def test_p99_is_nearest_rank():
    assert p99([]) is None
    assert p99([3.0, 1.0, 2.0]) == 3.0
    assert p99(range(1, 201)) == 198


def test_slo_window_judges_only_a_full_window():
    slo = route_config(slo={"ttft_p99_ms": 100, "error_rate": 0.2, "window": 4}).slo
    w = SLOWindow(4)
    for _ in range(3):
        w.add(5.0, True)
    assert w.breach(slo) is None  # three slow failures, but the window is not full
    w.add(0.01, False)
    assert "TTFT p99" in w.breach(slo)
    fast = SLOWindow(4)
    for e in (True, False, False, False):
        fast.add(0.01, e)
    assert fast.breach(slo) is not None and "error rate 0.25" in fast.breach(slo)
    fine = SLOWindow(4)
    for _ in range(10):
        fine.add(0.05, False)
    assert fine.breach(slo) is None and fine.summary()["seen"] == 4


def test_canary_breaking_its_slo_is_rolled_back_and_stays_out(caplog):
    route = Route(route_config(slo={"ttft_p99_ms": 1, "window": 5}), rng=random.Random(5))
    canary = route.target(GEMMA)
    primary = route.target(SMOL)
    for _ in range(10):
        assert route.record(primary, 9.0, True) is False  # the primary is not judged
    results = [route.record(canary, 0.5, False) for _ in range(5)]
    assert results == [False, False, False, False, True]  # within the window, not before it is full
    assert canary.weight == 0 and canary.status == "rolled_back" and canary.rollbacks == 1
    assert "broke its SLO" in caplog.text and "TTFT p99" in canary.reason
    assert {route.pick().model for _ in range(500)} == {SMOL}
    assert route.record(canary, 9.0, True) is False and canary.rollbacks == 1  # late records change nothing
    snap = route.snapshot()
    assert snap["targets"][1]["status"] == "rolled_back" and snap["targets"][1]["share"] == 0.0


def test_operator_changes():
    route = Route(route_config(slo={"ttft_p99_ms": 1, "window": 2}))
    canary = route.target(GEMMA)
    route.record(canary, 1.0, False)
    route.record(canary, 1.0, False)
    assert canary.status == "rolled_back"
    route.set_weights({GEMMA: 25})  # back in, judged over a fresh window
    assert canary.status == "serving" and canary.weight == 25 and canary.window.summary()["seen"] == 0
    with pytest.raises(RouteError, match="no target"):
        route.set_weights({"nope": 1})
    with pytest.raises(RouteError, match=">= 0"):
        route.set_weights({SMOL: -1})
    with pytest.raises(RouteError, match="weight above 0"):
        route.set_weights({SMOL: 0, GEMMA: 0})
    route.rollback()
    assert canary.weight == 0 and canary.status == "rolled_back" and canary.rollbacks == 1  # manual: not counted again
    with pytest.raises(RouteError, match="only target with weight"):
        route.rollback(SMOL)
    route.set_weights({GEMMA: 10})
    promoted = route.promote()
    assert promoted is canary and not canary.canary and canary.status == "promoted"
    assert route.target(SMOL).weight == 0 and canary.weight == 100
    assert route.record(canary, 9.0, True) is False  # a promoted target is not judged
    with pytest.raises(RouteError, match="name the target"):
        route.promote()  # no canary left


# -- fallback decisions ---------------------------------------------------------------------------
def fake_model(model_id: str, state: str = "ready", waiting: int = 0, in_flight: int = 0) -> ServedModel:
    engine = SimpleNamespace(state=state, stats=EngineStats(num_waiting=waiting), num_in_flight=in_flight, observers=[])
    return ServedModel(model_id, "generate", "1", [], model_id, "", 64, model_id, engine=engine)


def routing(route: dict, models: list[ServedModel]) -> Routing:
    return Routing([route_config(**route)], models)


def test_a_model_name_is_never_routed():
    r = routing({}, [fake_model(SMOL), fake_model(GEMMA)])
    assert r.decide(SMOL, None, None) is None and r.decide("gemini-2.0-flash", None, None) is None
    assert r.primary("chat") == SMOL and r.primary(SMOL) is None
    d = r.decide("models/chat", None, None)
    assert d.model.id in (SMOL, GEMMA) and d.fallback is None


@pytest.mark.parametrize("state, reason", [("dead", "engine_down"), ("failed", "engine_down"),
                                           ("restarting", "engine_restarting"), ("starting", "engine_not_ready")])  # fmt: skip
def test_fallback_when_the_chosen_engine_cannot_serve(state, reason):
    smol, gemma = fake_model(SMOL, state), fake_model(GEMMA)
    r = routing({"targets": [{"model": SMOL, "weight": 1}], "fallback": GEMMA}, [smol, gemma])
    d = r.decide("chat", None, None)
    assert d.model is gemma and d.fallback is gemma and d.fallback_reason == reason and d.target.model == SMOL
    assert r.get("chat").fallbacks == {reason: 1} and r.get("chat").target(SMOL).requests == 0


def test_no_fallback_when_the_fallback_cannot_serve_either():
    smol, gemma = fake_model(SMOL, "dead"), fake_model(GEMMA, "dead")
    r = routing({"targets": [{"model": SMOL, "weight": 1}], "fallback": GEMMA}, [smol, gemma])
    d = r.decide("chat", None, None)
    assert d.model is smol and d.fallback is None  # the target answers its own 503
    without = routing({"targets": [{"model": SMOL, "weight": 1}]}, [fake_model(SMOL, "dead"), gemma])
    assert without.decide("chat", None, None).fallback is None


def test_a_crashed_canary_counts_as_errors():
    smol, gemma = fake_model(SMOL), fake_model(GEMMA, "dead")
    r = routing({"targets": [{"model": GEMMA, "weight": 1, "canary": True}, {"model": SMOL, "weight": 0}],
                 "slo": {"error_rate": 0.5, "window": 3}, "fallback": SMOL}, [smol, gemma])  # fmt: skip
    for _ in range(3):
        assert r.decide("chat", None, None).model is smol
    canary = r.get("chat").target(GEMMA)
    assert canary.status == "rolled_back" and canary.rollbacks == 1


def principal_in(gateway: Gateway, cls: str = "P1") -> Principal:
    p = Principal(priority_class=cls)
    p.admission = SimpleNamespace(gateway=gateway)
    return p


def test_fallback_when_the_class_queue_is_full_and_overflow_admission():
    gw = Gateway(GatewayConfig(queue_limits={"P0": 2, "P1": 2, "P2": 0}))
    smol, gemma = fake_model(SMOL), fake_model(GEMMA)
    r = routing({"targets": [{"model": SMOL, "weight": 1}], "fallback": GEMMA}, [smol, gemma])
    assert r.decide("chat", principal_in(gw), None).fallback is None
    gw.queued["P1"] = 2
    d = r.decide("chat", principal_in(gw), None)
    assert d.fallback_reason == "queue_full" and d.overflow
    gemma.engine.num_in_flight = 2  # the fallback has a backlog of its own: no overflow past it
    assert r.decide("chat", principal_in(gw), None).fallback is None
    gemma.engine.num_in_flight = 0
    assert r.decide("chat", principal_in(gw, "P2"), None).fallback is None  # a closed class stays closed

    async def admit(overflow: bool) -> None:
        admission = await gw.admit(Principal())
        try:
            await admission.admit_generation(1, 1, overflow=overflow)
        finally:
            await gw.release(admission)

    from gemel.gateway.gateway import Refusal

    with pytest.raises(Refusal):
        asyncio.run(admit(False))
    asyncio.run(admit(True))  # a queue-full fallback passes the full queue


def test_fallback_on_predicted_ttft():
    smol, gemma = fake_model(SMOL, waiting=9), fake_model(GEMMA)
    r = routing({"targets": [{"model": SMOL, "weight": 1}], "fallback": GEMMA, "slo": {"ttft_p99_ms": 500}}, [smol, gemma])
    assert r.decide("chat", None, None).fallback is None  # no prefill seen yet: no prediction
    r.prefill[SMOL].add(0.1)  # 10 x 100 ms > 500 ms
    d = r.decide("chat", None, None)
    assert d.fallback_reason == "predicted_ttft" and d.model is gemma
    r.prefill[GEMMA].add(0.6)  # the fallback would be later still
    assert r.decide("chat", None, None).fallback is None
    smol.engine.stats = EngineStats(num_waiting=2)
    r.prefill[GEMMA].add(0.0)
    assert r.decide("chat", None, None).fallback is None  # 3 x 100 ms is within the SLO


def test_prefill_clock_learns_from_finished_requests():
    smol = fake_model(SMOL)
    r = routing({}, [smol, fake_model(GEMMA)])
    (observer,) = smol.engine.observers
    done = FinishedRequestStats("r", "t", "stop", 0.0, 1.0, 5, 1, scheduled=0.1, first_token=0.3)
    aborted = FinishedRequestStats("a", "t", "abort", 0.0, 1.0, 5, 1, scheduled=0.1, first_token=5.0)
    observer.on_iteration(IterationStats(1.0, finished=[done, aborted]))
    assert r.prefill[SMOL].seconds == pytest.approx(0.2) and r.prefill[SMOL].samples == 1
    assert predicted_ttft_s(3, 0.2) == pytest.approx(0.8) and predicted_ttft_s(3, None) is None
    clock = PrefillClock(alpha=0.5)
    clock.add(1.0)
    clock.add(3.0)
    assert clock.seconds == 2.0


def test_a_route_without_weight_uses_its_fallback_or_refuses():
    r = routing({"targets": [{"model": SMOL, "weight": 1}, {"model": GEMMA, "weight": 0}], "fallback": GEMMA},
                [fake_model(SMOL), fake_model(GEMMA)])  # fmt: skip
    r.get("chat").target(SMOL).weight = 0
    assert r.decide("chat", None, None).fallback_reason == "no_target"
    bare = routing({"targets": [{"model": SMOL, "weight": 1}]}, [fake_model(SMOL), fake_model(GEMMA)])
    bare.get("chat").target(SMOL).weight = 0
    with pytest.raises(APIError) as e:
        bare.decide("chat", None, None)
    assert e.value.status == 503


def test_sticky_tenant_uses_the_principal():
    r = routing({"sticky": "tenant"}, [fake_model(SMOL), fake_model(GEMMA)])
    for tenant in ("acme", "globex", "initech"):
        assert len({r.decide("chat", Principal(tenant=tenant), "ignored-user").model.id for _ in range(30)}) == 1


# -- the stream record -----------------------------------------------------------------------------
async def _stream(n: int, fail: BaseException | None = None):
    for i in range(n):
        await asyncio.sleep(0)
        yield i
    if fail is not None:
        raise fail


async def _drain(streams) -> None:
    for s in streams:
        async for _ in s:
            pass


def test_observed_streams_feed_the_canary_window():
    async def run() -> Route:
        route = Route(route_config(slo={"ttft_p99_ms": 60000, "error_rate": 0.5, "window": 4}))
        canary = route.target(GEMMA)
        for _ in range(2):
            d = RouteDecision(route, canary, fake_model(GEMMA))
            await _drain(d.observe([_stream(3), _stream(2)]))  # two prompts, one record
        d = RouteDecision(route, canary, fake_model(GEMMA))
        with pytest.raises(EngineDeadError):
            await _drain(d.observe([_stream(1, EngineDeadError("gone"))]))
        d = RouteDecision(route, canary, fake_model(GEMMA))
        with pytest.raises(ValueError):  # the request's own fault (a 400): not the canary's
            await _drain(d.observe([_stream(1, ValueError("too long"))]))
        d = RouteDecision(route, canary, fake_model(GEMMA))
        s = d.observe([_stream(5)])[0]
        await s.__anext__()
        await s.aclose()  # the client left after the first output: its TTFT still counts
        d = RouteDecision(route, canary, fake_model(GEMMA))
        left = d.observe([_stream(5)])[0]
        await left.aclose()  # never started: nothing learnt
        return route

    route = asyncio.run(run())
    w = route.target(GEMMA).window
    assert [e for _, e in w.samples] == [False, False, True, False]  # the 400 left no sample, the disconnect did
    assert all(t is not None for t, e in w.samples if not e)
    assert route.target(GEMMA).status == "serving"


def test_fallback_answers_are_not_recorded():
    route = Route(route_config(slo={"error_rate": 0.0, "window": 1}))
    d = RouteDecision(route, route.target(GEMMA), fake_model(SMOL), "engine_down")
    streams = [_stream(1)]
    assert d.observe(streams) is streams


# -- metrics -----------------------------------------------------------------------------------------
def test_routes_collector():
    table = RouteTable([route_config(slo={"ttft_p99_ms": 1, "window": 1}, fallback=SMOL)])
    route = table.get("chat")
    route.chosen(route.target(SMOL))
    route.fell_back("engine_down")
    route.record(route.target(GEMMA), 1.0, False)
    registry = CollectorRegistry()
    registry.register(RoutesCollector(lambda: table))
    text = generate_latest(registry).decode()
    assert f'gemel:canary_rollbacks_total{{route="chat",target="{GEMMA}"}} 1.0' in text
    assert 'gemel:fallback_requests_total{reason="engine_down",route="chat"} 1.0' in text
    assert f'gemel:route_requests_total{{route="chat",target="{SMOL}"}} 1.0' in text
    assert f'gemel:route_target_weight{{route="chat",target="{GEMMA}"}} 0.0' in text
    empty = CollectorRegistry()
    empty.register(RoutesCollector(lambda: None))
    assert "gemel:canary_rollbacks_total{" not in generate_latest(empty).decode()


# -- the admin endpoints -----------------------------------------------------------------------------
def admin_app(gateway: Gateway) -> tuple[FastAPI, Routing]:
    r = routing({"slo": {"ttft_p99_ms": 2000, "window": 10}}, [fake_model(SMOL), fake_model(GEMMA)])
    app = FastAPI()
    install_error_handlers(app)
    app.state.gemel = SimpleNamespace(routes=r)
    app.state.gateway = gateway
    app.add_middleware(GatewayMiddleware, gateway=gateway)
    app.include_router(admin.router)
    return app, r


def test_admin_endpoints_with_tenants(tmp_path):
    tf = TenantsFile()
    ops_key = add_api_key(tf, "ops")
    user_key = add_api_key(tf, "acme")
    tf.tenant("ops").admin = True
    save_tenants(tmp_path / "tenants.yaml", tf)
    app, r = admin_app(Gateway(GatewayConfig(tenants_file=str(tmp_path / "tenants.yaml"))))
    with TestClient(app) as client:
        assert client.get("/admin/routes").status_code == 401
        refused = client.get("/admin/routes", headers={"x-goog-api-key": user_key})
        assert refused.status_code == 403 and "admin" in refused.json()["error"]["message"]
        ops = {"x-goog-api-key": ops_key}
        (route,) = client.get("/admin/routes", headers=ops).json()["routes"]
        assert route["name"] == "chat" and [t["weight"] for t in route["targets"]] == [90, 10]
        assert route["targets"][1]["slo_window"] == {"size": 10, "seen": 0, "ttft_p99_ms": None, "error_rate": None}
        assert route["targets"][0]["engine"] == "ready"
        assert client.get("/admin/routes/nope", headers=ops).status_code == 404
        changed = client.post("/admin/routes/chat", json={"weights": {GEMMA: 30}}, headers=ops)
        assert changed.status_code == 200 and changed.json()["route"]["targets"][1]["weight"] == 30
        assert client.post("/admin/routes/chat", json={"rollback": True}, headers=ops).json()["route"]["targets"][1]["status"] == "rolled_back"
        assert client.post("/admin/routes/chat", json={"promote": GEMMA}, headers=ops).json()["route"]["targets"][1]["status"] == "promoted"
        assert r.get("chat").target(GEMMA).weight == 100
        bad = client.post("/admin/routes/chat", json={"weights": {"nope": 1}}, headers=ops)
        assert bad.status_code == 400 and "no target" in bad.json()["error"]["message"]
        assert client.post("/admin/routes/chat", json={}, headers=ops).status_code == 400
        assert client.post("/admin/routes/chat", json={"rollback": True, "promote": True}, headers=ops).status_code == 400
        assert client.post("/admin/routes/chat", json={"weights": {SMOL: 1}}, headers={"x-goog-api-key": user_key}).status_code == 403


def test_admin_endpoints_anonymous_are_loopback_only():
    app, _ = admin_app(Gateway(GatewayConfig(insecure=True)))
    with TestClient(app, client=("127.0.0.1", 5000)) as client:
        assert client.get("/admin/routes").status_code == 200
    with TestClient(app, client=("10.1.2.3", 5000)) as client:
        r = client.get("/admin/routes")
        assert r.status_code == 403 and "loopback" in r.json()["error"]["message"]


def test_keys_cli_marks_admin_tenants(tmp_path):
    from gemel.gateway.cli import main as keys_main
    from gemel.gateway.tenants import load_tenants

    path = str(tmp_path / "t.yaml")
    assert keys_main(["set", "--tenants", path, "--tenant", "ops", "--admin", "yes"]) == 0
    assert load_tenants(path).tenants["ops"].admin is True
    assert keys_main(["set", "--tenants", path, "--tenant", "ops", "--admin", "no"]) == 0
    assert load_tenants(path).tenants["ops"].admin is False


def test_route_cli_renders_and_reports(capsys):
    from gemel.gateway.route_cli import main as route_main, render

    text = render({"name": "chat", "sticky": "none", "fallback": GEMMA, "requests": 3, "slo": None, "fallbacks": {"engine_down": 1},
                   "targets": [{"model": SMOL, "weight": 90, "share": 0.9, "canary": False, "status": "serving", "requests": 2},
                               {"model": GEMMA, "weight": 0, "share": 0.0, "canary": True, "status": "rolled_back",
                                "reason": "TTFT p99 9 ms", "requests": 1, "rollbacks": 1,
                                "slo_window": {"size": 5, "seen": 5, "ttft_p99_ms": 9.0, "error_rate": 0.0}}]})  # fmt: skip
    assert "gemma3-270m (canary)" in text and "rolled_back: TTFT p99 9 ms" in text and "engine_down 1" in text
    assert route_main(["set", "chat", "oops", "--url", "http://127.0.0.1:9"]) == 2
    assert "MODEL=WEIGHT" in capsys.readouterr().err
    assert route_main(["show", "--url", "http://127.0.0.1:9", "--timeout", "2"]) == 2  # nothing listens there
