"""Routes on a real ``gemel serve`` with SmolLM2 and Gemma 3: the weighted split, sticky users,
a canary rolled back for its SLO, the admin endpoints and ``gemel route``, and the fallback
model when the primary's engine is killed, through google-genai, openai and gRPC.

One server for the module; the last test kills SmolLM2's engine (restarts are off), so it
runs last."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from google.ai.generativelanguage_v1beta import types as gtypes
from google.genai import errors as genai_errors
from google.genai import types

from conftest import free_port, start_server

pytestmark = pytest.mark.slow

SMOL, GEMMA = "smollm2-135m-instruct", "gemma3-270m"
SERVICE = "google.ai.generativelanguage.v1beta.GenerativeService"

CONFIG = f"""
embeddings: null
server:
  stats_interval_s: 0.2
  log_level: warning
  engine_max_restarts: 0
models:
  - {{id: {SMOL}, source: {SMOL}, aliases: [gemini-2.0-flash, gpt-4o-mini]}}
  - {{id: {GEMMA}, source: {GEMMA}}}
routes:
  - name: chat
    targets:
      - {{model: {SMOL}, weight: 90}}
      - {{model: {GEMMA}, weight: 10, canary: true}}
    slo: {{ttft_p99_ms: 600000, error_rate: 0.5, window: 50}}
    fallback: {GEMMA}
  - name: sticky-chat
    targets: [{{model: {SMOL}, weight: 50}}, {{model: {GEMMA}, weight: 50}}]
    sticky: user
  - name: doomed-canary
    targets: [{{model: {SMOL}, weight: 50}}, {{model: {GEMMA}, weight: 50, canary: true}}]
    slo: {{ttft_p99_ms: 1, window: 5}}
"""


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    port = free_port()
    srv = start_server(tmp_path_factory.mktemp("routes"), name="routes", extra_config=CONFIG, grpc_port=port)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield {"server": srv, "channel": channel}
    channel.close()
    srv.stop()


@pytest.fixture(scope="module")
def genai_client(env):
    from google import genai

    return genai.Client(api_key="x", http_options=types.HttpOptions(base_url=env["server"].url, api_version="v1beta"))


@pytest.fixture(scope="module")
def openai_client(env):
    return openai.OpenAI(api_key="x", base_url=f"{env['server'].url}/v1", max_retries=0, timeout=120)


ONE_TOKEN = types.GenerateContentConfig(max_output_tokens=1)


def gemini_model(genai_client, model: str, text: str = "Hi") -> str:
    """The model that answered a Gemini call, from its modelVersion (id@version)."""
    r = genai_client.models.generate_content(model=model, contents=text, config=ONE_TOKEN)
    return r.model_version.split("@")[0]


def openai_model(openai_client, model: str, user: str | None = None) -> str:
    kw = {"user": user} if user else {}
    r = openai_client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=1, **kw)
    return r.model


def admin(env) -> dict:
    return {r["name"]: r for r in httpx.get(f"{env['server'].url}/admin/routes", timeout=10).json()["routes"]}


def metric(env, name: str, **labels) -> float:
    text = httpx.get(f"{env['server'].url}/metrics", timeout=10).text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(name + "{") and line.split("}")[0].split("{", 1)[1] == want:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def generate_call(env):
    return env["channel"].unary_unary(
        f"/{SERVICE}/GenerateContent",
        request_serializer=gtypes.GenerateContentRequest.serialize,
        response_deserializer=gtypes.GenerateContentResponse.deserialize,
    )


def grpc_request(model: str) -> gtypes.GenerateContentRequest:
    return gtypes.GenerateContentRequest(
        model=f"models/{model}",
        contents=[gtypes.Content(role="user", parts=[gtypes.Part(text="Hi")])],
        generation_config=gtypes.GenerationConfig(max_output_tokens=1),
    )


def gemel_command() -> list[str]:
    script = Path(sys.executable).with_name("gemel")
    return [str(script)] if script.exists() else [sys.executable, "-m", "gemel.cli"]


# -- the split ------------------------------------------------------------------------------------
def test_weighted_split_converges(env, genai_client, openai_client):
    n = 400
    with ThreadPoolExecutor(4) as pool:
        futures = [
            pool.submit(gemini_model, genai_client, "chat", f"Hi {i}") if i % 2 else pool.submit(openai_model, openai_client, "chat")
            for i in range(n)
        ]
        answered = Counter(f.result() for f in futures)
    assert set(answered) <= {SMOL, GEMMA}
    share = answered[GEMMA] / n
    assert 0.04 < share < 0.17, answered  # 10 % of 400: within four standard deviations
    route = admin(env)["chat"]
    served = {t["model"]: t["requests"] for t in route["targets"]}
    assert served == {SMOL: answered[SMOL], GEMMA: answered[GEMMA]} and route["fallbacks"] == {}
    assert route["targets"][1]["status"] == "serving" and route["targets"][1]["slo_window"]["seen"] == min(50, answered[GEMMA])
    assert metric(env, "gemel:route_requests_total", route="chat", target=GEMMA) == answered[GEMMA]


def test_routed_answers_name_their_model(env, genai_client, openai_client):
    """x-model-id, modelVersion and OpenAI's model agree on the model that answered; no fallback."""
    url = env["server"].url
    for _ in range(6):
        r = httpx.post(f"{url}/v1beta/models/chat:generateContent", json={"contents": [{"parts": [{"text": "Hi"}]}],
                       "generationConfig": {"maxOutputTokens": 1}}, timeout=60)  # fmt: skip
        assert r.status_code == 200 and "x-gemel-fallback" not in r.headers
        assert r.json()["modelVersion"] == f"{r.headers['x-model-id']}@1"
        raw = openai_client.chat.completions.with_raw_response.create(
            model="chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=1
        )
        assert raw.parse().model == raw.headers["x-model-id"] in (SMOL, GEMMA)
        resp, call = generate_call(env).with_call(grpc_request("chat"), timeout=60)
        initial = dict(call.initial_metadata())
        assert resp.model_version == f"{initial['x-model-id']}@1" and "x-gemel-fallback" not in initial
    # a model's own name is not routed, and answers as it always did
    assert openai_model(openai_client, "gpt-4o-mini") == "gpt-4o-mini"
    assert gemini_model(genai_client, GEMMA) == GEMMA
    # where nothing is generated, a route's name stands for its main target
    assert genai_client.models.count_tokens(model="chat", contents="Hello there").total_tokens > 0


# -- stickiness -----------------------------------------------------------------------------------------
def test_sticky_users_stay_put_and_spread(env, openai_client):
    from google import genai

    placed: dict[str, set[str]] = {}
    for u in range(16):
        user = f"user-{u}"
        placed[user] = {openai_model(openai_client, "sticky-chat", user=user) for _ in range(4)}
        client = genai.Client(api_key="x", http_options=types.HttpOptions(
            base_url=env["server"].url, api_version="v1beta", headers={"x-gemel-user": user}))  # fmt: skip
        placed[user] |= {gemini_model(client, "sticky-chat") for _ in range(4)}
    assert all(len(models) == 1 for models in placed.values()), placed
    assert {next(iter(m)) for m in placed.values()} == {SMOL, GEMMA}, placed  # 16 users at 50/50: both used


# -- the canary's rollback -------------------------------------------------------------------------------
def test_canary_missing_its_slo_is_rolled_back_and_stays_out(env, genai_client, openai_client):
    canary_answers = 0
    for i in range(200):
        model = gemini_model(genai_client, "doomed-canary") if i % 2 else openai_model(openai_client, "doomed-canary")
        canary_answers += model == GEMMA
        if admin(env)["doomed-canary"]["targets"][1]["status"] == "rolled_back":
            break
    target = admin(env)["doomed-canary"]["targets"][1]
    assert target["status"] == "rolled_back" and target["weight"] == 0, target
    assert canary_answers == 5  # rolled back by its fifth request, the window's size
    assert "TTFT p99" in target["reason"] and target["rollbacks"] == 1
    later = Counter(openai_model(openai_client, "doomed-canary") for _ in range(30))
    later.update(gemini_model(genai_client, "doomed-canary") for _ in range(30))
    assert later == Counter({SMOL: 60})  # it stays out
    assert metric(env, "gemel:canary_rollbacks_total", route="doomed-canary", target=GEMMA) == 1
    assert "doomed-canary: canary gemma3-270m broke its SLO" in env["server"].log()
    dash = httpx.get(f"{env['server'].url}/dashboard/data", timeout=10).json()
    shown = {r["name"]: r for r in dash["routes"]}["doomed-canary"]["targets"][1]
    assert shown["status"] == "rolled_back" and shown["rollbacks"] == 1


def test_route_cli(env):
    url = env["server"].url

    def route(*args: str) -> str:
        r = subprocess.run([*gemel_command(), "route", *args, "--url", url], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout

    shown = route("show", "doomed-canary")
    assert "gemma3-270m (canary)" in shown and "rolled_back" in shown and "automatic rollbacks: 1" in shown
    assert "route chat:" in route("show") and "route sticky-chat:" in route("show")
    route("set", "doomed-canary", f"{GEMMA}=50")
    assert admin(env)["doomed-canary"]["targets"][1]["status"] == "serving"
    route("rollback", "doomed-canary")
    assert admin(env)["doomed-canary"]["targets"][1]["weight"] == 0
    route("promote", "doomed-canary", GEMMA)
    targets = admin(env)["doomed-canary"]["targets"]
    assert [t["weight"] for t in targets] == [0, 100] and targets[1]["status"] == "promoted"
    bad = subprocess.run([*gemel_command(), "route", "set", "nope", f"{SMOL}=1", "--url", url], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "no route" in bad.stderr


def test_dashboard_table_shows_the_routes(env, tmp_path):
    """The dashboard's routes table in a real browser (skips without chromium, as test_dashboard)."""
    from test_dashboard import browser

    driver = browser(tmp_path)
    try:
        driver.get(f"{env['server'].url}/dashboard")
        deadline = time.monotonic() + 60
        rows: list[str] = []
        while time.monotonic() < deadline:
            rows = driver.execute_script(
                "const p = document.getElementById('routes-panel');"
                "return p.hidden ? [] : Array.from(document.querySelectorAll('#routes-table tbody tr'), r => r.innerText);"
            )
            if len(rows) >= 6:
                break
            time.sleep(0.5)
        assert len(rows) == 6, rows  # three routes of two targets
        assert [r.split("\t")[0] for r in rows[::2]] == ["chat", "sticky-chat", "doomed-canary"], rows
        assert "gemma3-270m (canary)" in rows[1] and "serving" in rows[1], rows
        assert "fallback gemma3-270m" in driver.find_element("id", "routes-fallbacks").text
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
    finally:
        driver.quit()


# -- the fallback (kills SmolLM2's engine: keep last) ------------------------------------------------
def test_fallback_serves_when_the_primary_is_down(env, genai_client, openai_client):
    url = env["server"].url
    r = httpx.post(f"{url}/admin/routes/chat", json={"weights": {SMOL: 100, GEMMA: 0}}, timeout=10)
    assert r.status_code == 200
    pid = httpx.get(f"{url}/internal/stats", timeout=10).json()["engines"][SMOL]["pid"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while httpx.get(f"{url}/internal/stats", timeout=10).json()["engines"][SMOL]["state"] not in ("dead", "failed"):
        assert time.monotonic() < deadline, "the killed engine is still reported alive"
        time.sleep(0.1)

    # Gemini REST: the header, x-model-id and modelVersion name the fallback
    g = genai_client.models.generate_content(model="chat", contents="Hi", config=ONE_TOKEN)
    assert g.model_version == f"{GEMMA}@1"
    if g.sdk_http_response is not None:
        assert g.sdk_http_response.headers.get("x-gemel-fallback") == GEMMA
    r = httpx.post(f"{url}/v1beta/models/chat:streamGenerateContent?alt=sse",
                   json={"contents": [{"parts": [{"text": "Hi"}]}], "generationConfig": {"maxOutputTokens": 2}}, timeout=60)  # fmt: skip
    assert r.status_code == 200 and r.headers["x-gemel-fallback"] == GEMMA and r.headers["x-model-id"] == GEMMA
    assert f'"modelVersion":"{GEMMA}@1"' in r.text

    # OpenAI, unary and streamed: model names the fallback
    raw = openai_client.chat.completions.with_raw_response.create(
        model="chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=1
    )
    assert raw.headers["x-gemel-fallback"] == GEMMA and raw.headers["x-model-id"] == GEMMA and raw.parse().model == GEMMA
    chunks = list(openai_client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, stream=True))  # fmt: skip
    assert chunks and {c.model for c in chunks} == {GEMMA}

    # gRPC: initial metadata
    resp, call = generate_call(env).with_call(grpc_request("chat"), timeout=60)
    initial = dict(call.initial_metadata())
    assert initial["x-gemel-fallback"] == GEMMA and initial["x-model-id"] == GEMMA and resp.model_version == f"{GEMMA}@1"

    # a request pinning the dead model (by id or alias) gets 503, never the fallback
    with pytest.raises(genai_errors.ServerError) as e:
        genai_client.models.generate_content(model=SMOL, contents="Hi", config=ONE_TOKEN)
    assert e.value.code == 503
    with pytest.raises(openai.InternalServerError) as e2:
        openai_client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    assert e2.value.status_code == 503 and "x-gemel-fallback" not in e2.value.response.headers
    with pytest.raises(grpc.RpcError) as e3:
        generate_call(env).with_call(grpc_request(SMOL), timeout=60)
    assert e3.value.code() == grpc.StatusCode.UNAVAILABLE

    assert metric(env, "gemel:fallback_requests_total", route="chat", reason="engine_down") == 5
    assert admin(env)["chat"]["fallbacks"] == {"engine_down": 5}
