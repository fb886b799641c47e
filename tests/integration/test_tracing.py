"""Tracing against a real server: the span tree of a request and its traceparent.

The server runs with the test-only switch ``observability.trace_memory_exporter`` (see the
``obs_server`` fixture), which keeps finished spans in memory and serves them as JSON at
``/internal/traces``.
"""

from __future__ import annotations

import json
import secrets
import time

import httpx
import pytest

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"


def spans_of(url: str, trace_id: str, want: int, timeout: float = 10) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        spans = [s for s in httpx.get(f"{url}/internal/traces", timeout=10).json()["spans"] if s["trace_id"] == trace_id]
        if len(spans) >= want or time.monotonic() > deadline:
            return spans
        time.sleep(0.1)


def check_tree(spans: list[dict], parent_span_id: str | None) -> dict:
    by_name = {s["name"]: s for s in spans}
    server = next(s for s in spans if s["kind"] == "SERVER")
    assert server["parent_span_id"] == parent_span_id
    for name in ("queue", "prefill", "decode"):
        child = by_name[name]
        assert child["parent_span_id"] == server["span_id"], name
        assert child["start_time_ns"] <= child["end_time_ns"]
        # Child spans are placed from the engine's monotonic stamps: inside the server span
        # (a millisecond of slack for the monotonic -> wall clock conversion).
        assert child["start_time_ns"] >= server["start_time_ns"] - 1_000_000, name
        assert child["end_time_ns"] <= server["end_time_ns"] + 1_000_000, name
    q, p, d = by_name["queue"], by_name["prefill"], by_name["decode"]
    assert q["end_time_ns"] <= p["start_time_ns"] + 1000 and p["end_time_ns"] <= d["start_time_ns"] + 1000
    return server


def test_openai_request_span_tree_keeps_incoming_trace_id(obs_server):
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 5,
            "temperature": 0.7, "top_p": 0.9, "seed": 11}  # fmt: skip
    r = httpx.post(f"{obs_server.url}/v1/chat/completions", json=body, timeout=120,
                   headers={"traceparent": f"00-{trace_id}-{parent}-01"})  # fmt: skip
    r.raise_for_status()
    usage = r.json()["usage"]
    _, resp_trace, resp_span, flags = r.headers["traceparent"].split("-")
    assert resp_trace == trace_id and resp_span != parent and flags == "01"
    spans = spans_of(obs_server.url, trace_id, 4)
    assert sorted(s["name"] for s in spans) == sorted(["POST /v1/chat/completions", "queue", "prefill", "decode"])
    server = check_tree(spans, parent)
    assert server["span_id"] == resp_span  # the traceparent returned names the server span
    a = server["attributes"]
    assert a["gen_ai.request.model"] == MODEL and a["gemel.model_id"] == MODEL
    assert a["gemel.tenant"] == "anonymous"
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert a["gen_ai.request.max_tokens"] == 5 and a["gen_ai.request.temperature"] == pytest.approx(0.7)
    assert a["gen_ai.request.top_p"] == pytest.approx(0.9) and a["gen_ai.request.seed"] == 11
    assert a["gen_ai.response.finish_reasons"] == [r.json()["choices"][0]["finish_reason"]]
    assert a["http.route"] == "/v1/chat/completions" and a["http.response.status_code"] == 200


def test_gemini_stream_span_tree_without_traceparent(obs_server):
    body = {"contents": [{"role": "user", "parts": [{"text": "Count to three."}]}], "generationConfig": {"maxOutputTokens": 4}}
    with httpx.stream("POST", f"{obs_server.url}/v1beta/models/gemini-2.0-flash:streamGenerateContent?alt=sse",
                      json=body, timeout=120) as r:  # fmt: skip
        r.raise_for_status()
        traceparent = r.headers["traceparent"]
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    _, trace_id, span_id, _ = traceparent.split("-")
    spans = spans_of(obs_server.url, trace_id, 4)
    server = check_tree(spans, None)  # a new trace: the server span is its root
    assert server["span_id"] == span_id
    assert server["attributes"]["gen_ai.usage.output_tokens"] == chunks[-1]["usageMetadata"]["candidatesTokenCount"]


def test_unsampled_caller_gets_traceparent_but_no_spans(obs_server):
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = httpx.post(f"{obs_server.url}/v1/chat/completions", json=body, timeout=120,
                   headers={"traceparent": f"00-{trace_id}-{parent}-00"})  # fmt: skip
    assert r.status_code == 200
    assert r.headers["traceparent"].startswith(f"00-{trace_id}-") and r.headers["traceparent"].endswith("-00")
    assert spans_of(obs_server.url, trace_id, 1, timeout=1) == []


def test_error_responses_are_traced_too(obs_server):
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    r = httpx.post(f"{obs_server.url}/v1/chat/completions", json={"model": "no-such-model", "messages": []},
                   headers={"traceparent": f"00-{trace_id}-{parent}-01"}, timeout=30)  # fmt: skip
    assert r.status_code in (400, 404)
    assert r.headers["traceparent"].split("-")[1] == trace_id
    (span,) = spans_of(obs_server.url, trace_id, 1)
    assert span["kind"] == "SERVER" and span["attributes"]["http.response.status_code"] == r.status_code
