"""/metrics against a real server: the counters and histograms match what was served,
and every metric the Grafana dashboard (deploy/grafana) queries exists."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"


def scrape(url: str) -> tuple[dict, list]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    families = list(text_string_to_metric_families(text))
    values = {}
    for family in families:
        for s in family.samples:
            values[(s.name, frozenset(s.labels.items()))] = s.value
    return values, families


def total(values: dict, name: str, **labels) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lab), v in values.items() if n == name and want <= lab)


def delta(after: dict, before: dict, name: str, **labels) -> float:
    return total(after, name, **labels) - total(before, name, **labels)


def openai_chat(url: str, content: str, max_tokens: int, stream: bool = False) -> dict:
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0}  # fmt: skip
    if not stream:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        r.raise_for_status()
        j = r.json()
        return {"prompt": j["usage"]["prompt_tokens"], "completion": j["usage"]["completion_tokens"],
                "reason": j["choices"][0]["finish_reason"]}  # fmt: skip
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    usage, reason = None, None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                reason = choice.get("finish_reason") or reason
    return {"prompt": usage["prompt_tokens"], "completion": usage["completion_tokens"], "reason": reason}


def gemini_generate(url: str, text: str, max_tokens: int) -> dict:
    body = {"contents": [{"role": "user", "parts": [{"text": text}]}],
            "generationConfig": {"maxOutputTokens": max_tokens, "temperature": 0}}  # fmt: skip
    r = httpx.post(f"{url}/v1beta/models/gemini-2.0-flash:generateContent", json=body, timeout=120)
    r.raise_for_status()
    j = r.json()
    u = j["usageMetadata"]
    reason = {"MAX_TOKENS": "length", "STOP": "stop"}[j["candidates"][0]["finishReason"]]
    return {"prompt": u["promptTokenCount"], "completion": u.get("candidatesTokenCount", 0), "reason": reason}


def wait_idle(url: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        values, _ = scrape(url)
        if total(values, "gemel:num_requests_running") == 0 and total(values, "gemel:num_requests_waiting") == 0:
            return
        time.sleep(0.2)


def test_metrics_match_what_was_served(obs_server):
    url = obs_server.url
    wait_idle(url)
    before, _ = scrape(url)
    served = [
        openai_chat(url, "Name three colours.", 6),
        openai_chat(url, "Name three colours.", 5),  # same prompt: prefix-cache hits
        openai_chat(url, "Write a haiku about the sea.", 7, stream=True),
        gemini_generate(url, "What is two plus two?", 4),
    ]
    time.sleep(0.5)  # the engine's stats heartbeat (0.2 s) carries the last counters
    after, _ = scrape(url)
    n = len(served)
    prompt = sum(s["prompt"] for s in served)
    completion = sum(s["completion"] for s in served)
    lab = {"model_name": MODEL, "tenant": "anonymous"}

    assert delta(after, before, "gemel:prompt_tokens_total", **lab) == prompt
    assert delta(after, before, "gemel:generation_tokens_total", **lab) == completion
    for reason in {s["reason"] for s in served}:
        want = sum(1 for s in served if s["reason"] == reason)
        assert delta(after, before, "gemel:request_success_total", **lab, finished_reason=reason) == want
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens"):  # fmt: skip
        assert delta(after, before, f"gemel:{hist}_count", **lab) == n, hist
        inf_bucket = delta(after, before, f"gemel:{hist}_bucket", **lab, le="+Inf")
        assert inf_bucket == n, hist
    assert delta(after, before, "gemel:request_prompt_tokens_sum", **lab) == prompt
    assert delta(after, before, "gemel:request_generation_tokens_sum", **lab) == completion
    # One inter-token latency per step after the first (no speculation here: one token a step).
    assert delta(after, before, "gemel:inter_token_latency_seconds_count", **lab) == completion - n
    multi = sum(1 for s in served if s["completion"] > 1)
    assert delta(after, before, "gemel:request_time_per_output_token_seconds_count", **lab) == multi
    # Every token the engine computed was in some step: prompts less their cached prefix, and
    # each generated token but the last is fed back.
    hits = delta(after, before, "gemel:prefix_cache_hits_total", model_name=MODEL)
    queries = delta(after, before, "gemel:prefix_cache_queries_total", model_name=MODEL)
    assert queries == prompt and hits > 0  # the repeated prompt hit the prefix cache
    assert delta(after, before, "gemel:iteration_tokens_total_sum", model_name=MODEL) == prompt - hits + completion - n
    assert delta(after, before, "gemel:iteration_tokens_total_count", model_name=MODEL) >= completion - n
    # Latency sums are plausible: e2e covers queue + prefill + decode.
    e2e = delta(after, before, "gemel:e2e_request_latency_seconds_sum", **lab)
    parts = sum(delta(after, before, f"gemel:request_{p}_time_seconds_sum", **lab) for p in ("queue", "prefill", "decode"))
    assert 0 < parts <= e2e + 1e-3
    assert total(after, "gemel:num_requests_running", model_name=MODEL) == 0
    assert total(after, "gemel:kv_cache_usage_perc", model_name=MODEL) == 0
    assert total(after, "gemel:engine_up", model_name=MODEL) == 1


def test_aborted_stream_is_counted(obs_server):
    url = obs_server.url
    wait_idle(url)
    before, _ = scrape(url)
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 200, "stream": True, "temperature": 0, "stop": []}  # fmt: skip
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                break  # hang up after the first token
    deadline = time.monotonic() + 15
    lab = {"model_name": MODEL, "tenant": "anonymous", "finished_reason": "abort"}
    while time.monotonic() < deadline:
        after, _ = scrape(url)
        if delta(after, before, "gemel:request_success_total", **lab) == 1:
            break
        time.sleep(0.2)
    assert delta(after, before, "gemel:request_success_total", **lab) == 1
    assert delta(after, before, "gemel:e2e_request_latency_seconds_count", model_name=MODEL) == 1
    wait_idle(url)


def known_names(families) -> set[str]:
    names = set()
    for f in families:
        names.add(f.name)
        names.update(s.name for s in f.samples)
        if f.type == "counter":
            names.add(f.name + "_total")
        if f.type == "histogram":
            names.update(f.name + suffix for suffix in ("_bucket", "_sum", "_count"))
    return names


def test_grafana_dashboard_queries_only_exported_metrics(obs_server):
    dashboard = json.loads((ROOT / "deploy/grafana/gemel-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if v.get("definition")]
    assert len(exprs) >= 20
    queried = {m for e in exprs for m in re.findall(r"gemel:[A-Za-z0-9_:]+", e)}
    _, families = scrape(obs_server.url)
    missing = queried - known_names(families)
    assert not missing, f"the Grafana dashboard queries metrics gemel does not export: {sorted(missing)}"
    # Counters are queried through rate() with their _total names, as prometheus-client exports them.
    counters = {f.name for f in families if f.type == "counter"}
    for e in exprs:
        if e.startswith("label_values("):
            continue
        for m in re.findall(r"gemel:[A-Za-z0-9_:]+", e):
            if m.removesuffix("_total") in counters:
                assert m.endswith("_total") and "rate(" in e, e
    for name in ("gemel:prefix_cache_hits_total", "gemel:prefix_cache_queries_total",
                 "gemel:time_to_first_token_seconds_bucket", "gemel:gateway_rate_limited_total"):  # fmt: skip
        assert name in queried


def test_every_response_carries_the_f34_headers(obs_server):
    for method, path in (("GET", "/metrics"), ("GET", "/dashboard"), ("GET", "/healthz"), ("GET", "/nope")):
        r = httpx.request(method, f"{obs_server.url}{path}", timeout=10)
        for h in ("x-model-id", "x-model-version", "x-inference-latency-ms", "x-request-id", "traceparent"):
            assert h in r.headers, (path, h)
        assert re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}", r.headers["traceparent"])
