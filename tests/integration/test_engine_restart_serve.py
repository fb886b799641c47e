"""kill -9 of the engine under mixed load: every request still ends 200 with a complete answer.

The API process starts a fresh engine and resubmits each unfinished request with the tokens
it had produced; streams pause instead of failing. /readyz is red while the engine restarts
and green after; the restart is counted in /metrics. Uses its own server, since it kills it.
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

GEMINI = "gemini-2.0-flash"
OPENAI = "gpt-4o-mini"
MAX_TOKENS = 40
TOPICS = ["the sea", "a library", "winter", "a robot", "bread", "a city at night", "mountains", "a violin",
          "rain", "a garden", "trains", "the moon"]  # fmt: skip


@pytest.fixture(scope="module")
def phoenix(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("phoenix"), name="phoenix", extra_config="embeddings: null\n")
    yield srv
    srv.stop()


def _openai(url: str, topic: str, stream: bool) -> tuple[int, str, int]:
    body = {
        "model": OPENAI, "messages": [{"role": "user", "content": f"Write about {topic}."}], "temperature": 0,
        "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": stream,
    }  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
        text, tokens, finish = "", 0, None
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                for choice in event["choices"]:
                    text += choice["delta"].get("content") or ""
                    finish = choice["finish_reason"] or finish
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
            return (r.status_code if finish == "length" else 599), text, tokens
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    out = r.json()
    ok = r.status_code == 200 and out["choices"][0]["finish_reason"] == "length"
    return (200 if ok else r.status_code or 599), out["choices"][0]["message"]["content"] if ok else "", out.get("usage", {}).get("completion_tokens", 0)


def _gemini(url: str, topic: str, stream: bool) -> tuple[int, str, int]:
    body = {"contents": [{"parts": [{"text": f"Write about {topic}."}]}],
            "generationConfig": {"temperature": 0, "maxOutputTokens": MAX_TOKENS}}  # fmt: skip
    if stream:
        text, tokens, finish = "", 0, None
        with httpx.stream("POST", f"{url}/v1beta/models/{GEMINI}:streamGenerateContent?alt=sse", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                for cand in event.get("candidates", []):
                    text += "".join(p.get("text", "") for p in cand["content"]["parts"])
                    finish = cand.get("finishReason") or finish
                tokens = event["usageMetadata"].get("candidatesTokenCount", tokens)
            return (r.status_code if finish in ("STOP", "MAX_TOKENS") else 599), text, tokens
    r = httpx.post(f"{url}/v1beta/models/{GEMINI}:generateContent", json=body, timeout=120)
    out = r.json()
    ok = r.status_code == 200 and out["candidates"][0].get("finishReason") in ("STOP", "MAX_TOKENS")
    text = "".join(p.get("text", "") for p in out["candidates"][0]["content"]["parts"]) if ok else ""
    return (200 if ok else r.status_code), text, out.get("usageMetadata", {}).get("candidatesTokenCount", 0)


def test_kill_9_under_48_mixed_requests(phoenix):
    url = phoenix.url
    calls = [(fn, topic, stream) for topic in TOPICS for fn in (_openai, _gemini) for stream in (False, True)]
    assert len(calls) == 48
    with ThreadPoolExecutor(len(calls)) as pool:
        reference = list(pool.map(lambda c: c[0](url, c[1], c[2]), calls))
    assert all(status == 200 for status, _, _ in reference), reference

    killed, red = threading.Event(), threading.Event()

    def kill_when_busy() -> None:
        while phoenix.stats()["num_running"] < 8:
            time.sleep(0.02)
        time.sleep(0.5)  # well into decoding
        os.kill(phoenix.stats()["pid"], signal.SIGKILL)
        killed.set()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # red, with the reason, while the engine restarts
            r = httpx.get(f"{url}/readyz", timeout=5)
            if r.status_code == 503 and "restarting" in json.dumps(r.json()):
                red.set()
                return
            time.sleep(0.02)

    with ThreadPoolExecutor(len(calls) + 1) as pool:
        killer = pool.submit(kill_when_busy)
        results = list(pool.map(lambda c: c[0](url, c[1], c[2]), calls))
        killer.result(timeout=60)
    assert killed.is_set() and red.is_set()
    for (fn, topic, stream), (status, text, tokens), (_, _, ref_tokens) in zip(calls, results, reference):
        assert status == 200, (fn.__name__, topic, stream, status)
        assert text  # a complete answer, not an error event
        if fn is _openai:
            assert tokens == MAX_TOKENS  # nothing lost: the full budget, across the restart

    deadline = time.monotonic() + 30
    while httpx.get(f"{url}/readyz", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, "/readyz did not recover"
        time.sleep(0.2)
    metrics = httpx.get(f"{url}/metrics", timeout=5).text
    restarts = [line for line in metrics.splitlines() if line.startswith("gemel:engine_restarts_total{")]
    assert any('reason="killed"' in line and line.endswith(" 1.0") for line in restarts), restarts
    assert "restarting it in" in phoenix.log()
