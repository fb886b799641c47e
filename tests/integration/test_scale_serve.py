"""``gemel serve`` with two engine replicas on a local Ray instance it starts itself.

Both replicas serve (``x-gemel-replica`` names each over prompts that share nothing, on REST
and as gRPC metadata), requests sharing a long system prompt land on one replica (and hit its
prefix cache), a second front end attaches to the replicas' application without deploying or
deleting it (``scale.attach``, as under KubeRay's RayService), and neither a killed replica
engine (restarted inside its replica) nor a killed replica worker (its requests resumed on the
other replica, Ray Serve starting a new one) loses a request.
Uses its own server: it kills parts of it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
from google.ai.generativelanguage_v1beta import types

from conftest import free_port, start_server

pytestmark = pytest.mark.slow

pytest.importorskip("ray.serve", reason="the ray extra is not installed (pip install 'gemel[ray]')")

MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 40
SYSTEM = (
    "You are the archivist of a small harbour town. You answer questions about its history, its boats, "
    "its lighthouse and its people in two short sentences, plainly and without inventing names. "
    "When you do not know, you say so and suggest where in the town archive the answer might be found."
)


@pytest.fixture(scope="module")
def grpc_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def pair(tmp_path_factory, grpc_port):
    srv = start_server(
        tmp_path_factory.mktemp("scale"), name="scale", extra_config="embeddings: null\nscale:\n  replicas: 2\n",
        ready_timeout=420, grpc_port=grpc_port,
    )  # fmt: skip
    yield srv
    srv.stop()
    assert srv.proc.returncode == 0, srv.log()


def _stats(srv) -> dict:
    return srv.stats()


def _log(srv) -> str:
    return srv.log_path.read_text(errors="replace")


def _completion(url: str, prompt: str, stream: bool = False, max_tokens: int = MAX_TOKENS) -> tuple[int, str | None, str, int]:
    """(status, x-gemel-replica, text, completion tokens); a stream's error event is status 599."""
    body = {"model": "gpt-4o-mini", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    if not stream:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=180)
        out = r.json()
        if r.status_code != 200:
            return r.status_code, r.headers.get("x-gemel-replica"), json.dumps(out), 0
        return 200, r.headers.get("x-gemel-replica"), out["choices"][0]["text"], out["usage"]["completion_tokens"]
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    text, tokens, finish = "", 0, None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=180) as r:
        replica = r.headers.get("x-gemel-replica")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return 599, replica, json.dumps(event), 0
            for choice in event["choices"]:
                text += choice["text"]
                finish = choice["finish_reason"] or finish
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return (r.status_code if finish == "length" else 599), replica, text, tokens


def test_both_replicas_serve(pair):
    replicas = {r["replica"] for r in _stats(pair)["replicas"]}
    assert len(replicas) == 2
    seen = []
    for i, topic in enumerate(["The harbour at dawn", "Seven bakers of Lyon", "A violin in the attic", "Trains over the pass"]):
        status, replica, text, tokens = _completion(pair.url, f"{topic}, story number {i}:", max_tokens=8)
        assert status == 200 and text and tokens == 8
        seen.append(replica)
    assert set(seen) == replicas  # prompts that share nothing spread over both
    r = httpx.post(
        f"{pair.url}/v1beta/models/gemini-2.0-flash:generateContent",
        json={"contents": [{"parts": [{"text": "Name a colour."}]}], "generationConfig": {"maxOutputTokens": 4}}, timeout=120,
    )
    assert r.status_code == 200 and r.headers["x-gemel-replica"] in replicas
    metrics = httpx.get(f"{pair.url}/metrics", timeout=10).text
    assert f'gemel:replicas{{model_name="{MODEL}"}} 2.0' in metrics
    assert all(f'gemel:replica_ongoing_requests{{model_name="{MODEL}",replica="{r}"}}' in metrics for r in replicas)
    assert httpx.get(f"{pair.url}/readyz", timeout=10).status_code == 200


def test_grpc_metadata_names_the_replica(pair, grpc_port):
    """gRPC answers carry x-gemel-replica in their initial metadata, as REST answers carry the header."""
    replicas = {r["replica"] for r in _stats(pair)["replicas"]}
    service = "/google.ai.generativelanguage.v1beta.GenerativeService"
    request = types.GenerateContentRequest(
        model="models/gemini-2.0-flash", contents=[types.Content(role="user", parts=[types.Part(text="Name a colour.")])],
        generation_config=types.GenerationConfig(max_output_tokens=4),
    )  # fmt: skip
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        unary = channel.unary_unary(f"{service}/GenerateContent", request_serializer=types.GenerateContentRequest.serialize,
                                    response_deserializer=types.GenerateContentResponse.deserialize)  # fmt: skip
        response, call = unary.with_call(request, timeout=120)
        initial = dict(call.initial_metadata())
        assert response.candidates[0].content.parts[0].text
        assert initial["x-gemel-replica"] in replicas and initial["x-model-id"] == MODEL
        assert "x-gemel-replica" not in dict(call.trailing_metadata())  # no other replica took it over
        stream = channel.unary_stream(f"{service}/StreamGenerateContent", request_serializer=types.GenerateContentRequest.serialize,
                                      response_deserializer=types.GenerateContentResponse.deserialize)(request, timeout=120)  # fmt: skip
        assert list(stream)
        assert dict(stream.initial_metadata())["x-gemel-replica"] in replicas


# A second front end in another process: a replica pool with scale.attach on the server's Ray
# instance, which must find the server's application, generate on one of its replicas and,
# on shutdown, leave the application to the server.
ATTACH = r"""
import asyncio, logging, sys, types, uuid
from gemel.config import load_config
from gemel.sampling_params import SamplingParams
from gemel.scale.context import REQUEST_STATE
from gemel.scale.pool import ReplicaPool

async def main(path, address):
    config = load_config(path)
    scale = config.scale.model_copy(update={"attach": True, "ray_address": address})
    entry = config.models[0]
    pool = ReplicaPool(entry.id, config.engine_config(entry), scale, stats_interval_s=0.2, ready_timeout_s=60)
    await pool.start()
    try:
        await pool.wait_ready(120)
        state = types.SimpleNamespace(replica=None)
        REQUEST_STATE.set(state)
        prompt = "The lighthouse keeper wrote"
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        async for out in pool.generate(uuid.uuid4().hex, prompt, pool.tokenizer.encode_rendered(prompt), params):
            pass
        print("replica", state.replica, "tokens", len(out.outputs[0].token_ids), "known", ",".join(sorted(pool.router.replicas)))
    finally:
        await pool.shutdown()

logging.basicConfig(level=logging.INFO)
asyncio.run(main(*sys.argv[1:]))
"""


def _gcs_address(srv) -> str:
    """The GCS address of the Ray instance the server started (its raylet's command line)."""
    import psutil

    for proc in psutil.Process(srv.proc.pid).children(recursive=True):
        try:
            args = proc.cmdline()
        except psutil.Error:
            continue
        for arg in args:
            if arg.startswith("--gcs-address="):
                return arg.split("=", 1)[1]
    raise AssertionError("no raylet under the server")


def test_a_front_end_attaches_to_the_application(pair):
    replicas = {r["replica"] for r in _stats(pair)["replicas"]}
    config = pair.log_path.with_name("scale.yaml")
    # Ray's token authentication: a driver joining a running cluster sends the token only in
    # token mode (the local instance's token is the user's ~/.ray/auth_token)
    env = dict(os.environ, RAY_AUTH_MODE="token")
    out = subprocess.run([sys.executable, "-c", ATTACH, str(config), _gcs_address(pair)],
                         capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    words = out.stdout.split()
    report = dict(zip(words[::2], words[1::2]))
    assert report["replica"] in replicas and report["tokens"] == "4", out.stdout
    assert set(report["known"].split(",")) == replicas  # Ray Serve's router told the attached pool the set
    assert "attached to the Ray Serve application gemel-" in out.stderr
    # the server's application outlived the attached front end
    status, replica, text, tokens = _completion(pair.url, "After the fair, the square", max_tokens=4)
    assert status == 200 and tokens == 4 and replica in replicas
    assert {r["replica"] for r in _stats(pair)["replicas"]} == replicas


def test_a_shared_system_prompt_stays_on_one_replica(pair):
    hits_before = {r["replica"]: r["prefix_cache_hits"] for r in _stats(pair)["replicas"]}
    homes = []
    for question in ["When was the lighthouse built?", "Who fixed the nets?", "How deep is the harbour?", "What did the ferry carry?"]:
        r = httpx.post(
            f"{pair.url}/v1/chat/completions",
            json={"model": "gpt-4o-mini", "max_tokens": 6, "temperature": 0,
                  "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]},
            timeout=120,
        )  # fmt: skip
        assert r.status_code == 200
        homes.append(r.headers["x-gemel-replica"])
    assert len(set(homes)) == 1, homes
    home = homes[0]
    # the three later requests found the system prompt's blocks in their replica's cache (the
    # counts reach /internal/stats with the pool's next poll of the replicas)
    deadline = time.monotonic() + 30
    while True:
        hits = {r["replica"]: r["prefix_cache_hits"] for r in _stats(pair)["replicas"]}
        if hits[home] - hits_before.get(home, 0) >= 3 * 48:
            break
        assert time.monotonic() < deadline, (hits_before, hits)
        time.sleep(0.2)


def _load_then_kill(srv, which: str) -> tuple[list, list, dict]:
    """Eight requests (half streamed) with a reference run first; mid-way, SIGKILL the ``which``
    pid (engine_pid or worker_pid) of a replica running at least two of them."""
    calls = [(f"Chapter {i} of the long voyage began when", i % 2 == 0) for i in range(8)]
    run = lambda c: _completion(srv.url, c[0], c[1])  # noqa: E731
    with ThreadPoolExecutor(len(calls)) as pool:
        reference = list(pool.map(run, calls))
    assert all(status == 200 for status, *_ in reference), reference
    victim: dict = {}

    def kill_when_busy() -> None:
        while True:
            busy = [r for r in _stats(srv)["replicas"] if r["num_running"] >= 2]
            if busy:
                break
            time.sleep(0.05)
        time.sleep(0.5)  # well into decoding
        victim.update(busy[0])
        os.kill(busy[0][which], signal.SIGKILL)

    with ThreadPoolExecutor(len(calls) + 1) as pool:
        killer = pool.submit(kill_when_busy)
        results = list(pool.map(run, calls))
        killer.result(timeout=60)
    return reference, results, victim


def test_a_killed_replica_engine_loses_no_request(pair):
    _, results, victim = _load_then_kill(pair, "engine_pid")
    for status, _, text, tokens in results:
        assert status == 200 and text and tokens == MAX_TOKENS, (status, text)
    assert "restarting it in" in _log(pair)  # the replica's own AsyncLLM restarted its engine
    deadline = time.monotonic() + 120
    while True:  # the engine is back in the same replica, a fresh process
        now = {r["replica"]: r for r in _stats(pair)["replicas"]}
        r = now.get(victim["replica"])
        if r is not None and r["state"] == "ready" and r["engine_pid"] != victim["engine_pid"]:
            assert r["restarts"] == {"killed": 1}
            break
        assert time.monotonic() < deadline, now
        time.sleep(0.5)


def test_a_killed_replica_worker_loses_no_request(pair):
    _, results, victim = _load_then_kill(pair, "worker_pid")
    for status, _, text, tokens in results:
        assert status == 200 and text and tokens == MAX_TOKENS, (status, text)
    log = _log(pair)
    assert f"replica {victim['replica']} lost request" in log and "resubmitting it to another replica" in log
    assert httpx.get(f"{pair.url}/readyz", timeout=10).status_code == 200  # the other replica serves meanwhile
    deadline = time.monotonic() + 240
    while True:  # Ray Serve starts a replacement replica
        ids = {r["replica"] for r in _stats(pair)["replicas"] if r["state"] == "ready"}
        if len(ids) == 2 and victim["replica"] not in ids:
            break
        assert time.monotonic() < deadline, ids
        time.sleep(1.0)
    metrics = httpx.get(f"{pair.url}/metrics", timeout=10).text
    assert f'gemel:engine_restarts_total{{model_name="{MODEL}",reason="replica"}} 1.0' in metrics
    status, replica, text, tokens = _completion(pair.url, "After the storm, the harbour", max_tokens=4)
    assert status == 200 and tokens == 4
