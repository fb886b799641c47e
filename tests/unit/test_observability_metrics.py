"""Metrics without a server: front-end accounting, the Prometheus exposition, the stats log."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gemel.engine.output_processor import OutputProcessor, RequestState
from gemel.engine.protocol import EngineCoreOutput, EngineStats
from gemel.observability.metrics import (
    EngineStatsCollector,
    GatewayCollector,
    GemelMetrics,
    StatsLogger,
    build_1_2_5_buckets,
    find_gateway_counters,
)
from gemel.observability.stats import FinishedRequestStats, IterationStats
from gemel.sampling_params import SamplingParams

MODEL = "m"


def samples(metrics: GemelMetrics) -> dict[tuple[str, frozenset], float]:
    body, _ = metrics.render()
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(all_samples: dict, name: str, **labels) -> float:
    return all_samples.get((name, frozenset(labels.items())), 0.0)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from gemel.loader.tokenizer import Tokenizer

    return Tokenizer.from_pretrained_dir(tiny_llama_dir)


def test_1_2_5_buckets():
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(7) == [1, 2, 5]


def test_finished_request_intervals_follow_vllm():
    fs = FinishedRequestStats(
        "r", "t", "length", arrival=10.0, end=13.0, num_prompt_tokens=5, num_generation_tokens=5,
        scheduled=10.5, first_token=11.0, last_token=12.0,
    )  # fmt: skip
    assert fs.queue_time_s == 0.5 and fs.prefill_time_s == 0.5 and fs.decode_time_s == 1.0
    assert fs.inference_time_s == 1.5 and fs.e2e_latency_s == 3.0
    assert fs.mean_time_per_output_token_s == pytest.approx(0.25)
    never = FinishedRequestStats("r", "t", "abort", arrival=1.0, end=2.0, num_prompt_tokens=3, num_generation_tokens=0)
    assert never.queue_time_s is None and never.prefill_time_s is None and never.mean_time_per_output_token_s is None


def test_output_processor_records_tokens_ttft_itl_and_finish(tokenizer):
    proc = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=3, temperature=0.0)
    state = RequestState("r1", "hi", [1, 2, 3, 4], params, tokenizer, tenant="acme")
    state.metrics["arrival"] = 100.0
    proc.add(state)
    steps = [
        (100.5, EngineCoreOutput("r1", [], events=[("scheduled", 100.2)])),
        (100.6, EngineCoreOutput("r1", [5], events=[("first_token", 100.6)])),
        (100.7, EngineCoreOutput("r1", [6, 7], finish_reason="length", events=[("finished", 100.7)])),
    ]
    its = []
    for t, out in steps:
        it = IterationStats(t)
        proc.process([out], it)
        its.append(it)
    assert its[1].ttfts == [("acme", pytest.approx(0.6))]
    assert its[1].prompt_tokens == {"acme": 4} and its[1].generation_tokens == {"acme": 1}
    assert its[2].itls == [("acme", pytest.approx(0.1))]  # one ITL per step, even with two tokens
    assert [(tok.position, round(tok.latency_s, 3)) for tok in its[2].tokens] == [(1, 0.05), (2, 0.05)]
    assert [tok.position for tok in its[1].tokens] == [0]
    (fs,) = its[2].finished
    assert (fs.tenant, fs.finish_reason, fs.num_prompt_tokens, fs.num_generation_tokens) == ("acme", "length", 4, 3)
    assert fs.queue_time_s == pytest.approx(0.2) and fs.prefill_time_s == pytest.approx(0.4)
    assert fs.decode_time_s == pytest.approx(0.1)
    assert "r1" not in proc.requests


def test_tenant_defaults_to_anonymous(tokenizer):
    state = RequestState("r", None, [1], SamplingParams(), tokenizer)
    assert state.tenant == "anonymous"


def test_metrics_observer_exports_histograms_and_counters():
    metrics = GemelMetrics(max_model_len=2048, max_num_batched_tokens=512)
    obs = metrics.observer(MODEL)
    it = IterationStats(1.0, iteration_tokens=[40, 1])
    it.add_prompt("a", 40)
    it.add_generation("a", 2)
    it.ttfts.append(("a", 0.2))
    it.itls.append(("a", 0.05))
    it.finished.append(
        FinishedRequestStats("r", "a", "stop", 0.0, 1.0, 40, 2, scheduled=0.1, first_token=0.2, last_token=0.25)
    )
    obs.on_iteration(it)
    s = samples(metrics)
    lab = {"model_name": MODEL, "tenant": "a"}
    assert value(s, "gemel:prompt_tokens_total", **lab) == 40
    assert value(s, "gemel:generation_tokens_total", **lab) == 2
    assert value(s, "gemel:request_success_total", **lab, finished_reason="stop") == 1
    for h in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
              "request_time_per_output_token_seconds", "request_prompt_tokens", "request_generation_tokens"):  # fmt: skip
        assert value(s, f"gemel:{h}_count", **lab) == 1, h
    assert value(s, "gemel:request_prompt_tokens_sum", **lab) == 40
    assert value(s, "gemel:iteration_tokens_total_count", model_name=MODEL) == 2
    assert value(s, "gemel:iteration_tokens_total_sum", model_name=MODEL) == 41
    assert metrics.totals[MODEL]["generation_tokens"] == 2
    # Label children are looked up once and reused: later steps and other tenants still count.
    obs.on_iteration(IterationStats(2.0, itls=[("a", 0.04), ("b", 0.03), ("a", 0.06)]))
    s = samples(metrics)
    assert value(s, "gemel:inter_token_latency_seconds_count", **lab) == 3
    assert value(s, "gemel:inter_token_latency_seconds_sum", **lab) == pytest.approx(0.15)
    assert value(s, "gemel:inter_token_latency_seconds_count", model_name=MODEL, tenant="b") == 1


def fake_engine(**stats) -> SimpleNamespace:
    return SimpleNamespace(stats=EngineStats(**stats), state="ready")


def test_engine_stats_collector_reads_latest_cumulative_stats():
    metrics = GemelMetrics()
    engine = fake_engine(num_running=3, num_waiting=2, kv_cache_usage=0.25, prefix_cache_queries=100,
                         prefix_cache_hits=40, num_preemptions=1, spec_num_drafts=5, spec_num_draft_tokens=20,
                         spec_num_accepted_tokens=12, spec_accepted_per_position=[5, 4, 2, 1])  # fmt: skip
    metrics.registry.register(EngineStatsCollector(lambda: [(MODEL, engine)]))
    s = samples(metrics)
    assert value(s, "gemel:num_requests_running", model_name=MODEL) == 3
    assert value(s, "gemel:num_requests_waiting", model_name=MODEL) == 2
    assert value(s, "gemel:kv_cache_usage_perc", model_name=MODEL) == 0.25
    assert value(s, "gemel:prefix_cache_queries_total", model_name=MODEL) == 100
    assert value(s, "gemel:prefix_cache_hits_total", model_name=MODEL) == 40
    assert value(s, "gemel:num_preemptions_total", model_name=MODEL) == 1
    assert value(s, "gemel:spec_decode_num_accepted_tokens_total", model_name=MODEL) == 12
    assert value(s, "gemel:spec_decode_num_accepted_tokens_per_pos_total", model_name=MODEL, position="2") == 2
    engine.stats = EngineStats(prefix_cache_queries=150, prefix_cache_hits=90)  # a later message
    s = samples(metrics)
    assert value(s, "gemel:prefix_cache_hits_total", model_name=MODEL) == 90


def test_gateway_counters_exported_when_present():
    from gemel.gateway.counters import GatewayCounters

    counters = GatewayCounters()
    counters.auth_failure("unknown", "missing_key")
    counters.auth_failure("unknown", "missing_key")
    counters.rate_limited("acme", "requests")
    counters.admission_rejected("acme", "queue_full")
    holder = SimpleNamespace(gateway_counters=counters)
    metrics = GemelMetrics()
    metrics.registry.register(GatewayCollector(lambda: find_gateway_counters(holder)))
    s = samples(metrics)
    assert value(s, "gemel:gateway_auth_failures_total", tenant="unknown", reason="missing_key") == 2
    assert value(s, "gemel:gateway_rate_limited_total", tenant="acme", kind="requests") == 1
    assert value(s, "gemel:gateway_admission_rejected_total", tenant="acme", reason="queue_full") == 1


def test_gateway_families_exist_without_a_gateway():
    metrics = GemelMetrics()
    metrics.registry.register(GatewayCollector(lambda: None))
    body, _ = metrics.render()
    names = {f.name for f in text_string_to_metric_families(body.decode())}
    assert {"gemel:gateway_auth_failures", "gemel:gateway_rate_limited", "gemel:gateway_admission_rejected"} <= names


def test_registries_are_per_app():
    a, b = GemelMetrics(), GemelMetrics()  # would raise "Duplicated timeseries" on a shared registry
    a.observer(MODEL).on_iteration(IterationStats(0.0, generation_tokens={"x": 3}))
    assert value(samples(b), "gemel:generation_tokens_total", model_name=MODEL, tenant="x") == 0


def test_stats_log_line_only_after_activity(caplog):
    metrics = GemelMetrics()
    engine = fake_engine(num_running=0, prefix_cache_queries=0, prefix_cache_hits=0)
    logger = StatsLogger(metrics, lambda: [(MODEL, engine)], interval_s=10)
    metrics.observer(MODEL)
    logger._snapshot_all()
    assert logger.lines() == []  # idle: nothing logged
    metrics.observer(MODEL).on_iteration(IterationStats(0.0, prompt_tokens={"a": 100}, generation_tokens={"a": 20}))
    engine.stats = EngineStats(num_running=2, num_waiting=1, kv_cache_usage=0.5, prefix_cache_queries=100, prefix_cache_hits=25)
    (line,) = logger.lines()
    for part in ("Avg prompt throughput", "Avg generation throughput", "Running: 2 reqs", "Waiting: 1 reqs",
                 "KV cache usage: 50.0%", "Prefix cache hit rate: 25.0%"):  # fmt: skip
        assert part in line, line
    engine.stats = EngineStats(prefix_cache_queries=100, prefix_cache_hits=25)
    assert logger.lines() == []
    logging.getLogger("gemel.stats")  # the logger name users filter on
