"""``gemel serve`` with two engine replicas on a local Ray instance it starts itself.

Both replicas serve (``x-gemel-replica`` names each over prompts that share nothing),
requests sharing a long system prompt land on one replica (and hit its prefix cache), and
neither a killed replica engine (restarted inside its replica) nor a killed replica worker
(its requests resumed on the other replica, Ray Serve starting a new one) loses a request.
Uses its own server: it kills parts of it.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import start_server

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
def pair(tmp_path_factory):
    srv = start_server(
        tmp_path_factory.mktemp("scale"), name="scale", extra_config="embeddings: null\nscale:\n  replicas: 2\n", ready_timeout=420
    )
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
