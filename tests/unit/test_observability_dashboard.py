"""The dashboard's data without a server: token ring buffer, cursor, summary; the vendored assets."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import yaml

from gemel.engine.protocol import EngineStats
from gemel.observability.dashboard import DashboardState, percentile, recent, static_file
from gemel.observability.stats import FinishedRequestStats, IterationStats, TokenTiming

ROOT = Path(__file__).resolve().parents[2]


def make_state(size: int = 100) -> tuple[DashboardState, SimpleNamespace]:
    engine = SimpleNamespace(stats=EngineStats(num_running=2, num_waiting=1, kv_cache_usage=0.1,
                                               prefix_cache_queries=10, prefix_cache_hits=5), state="ready")  # fmt: skip
    return DashboardState(lambda: [("m", engine)], timeline_size=size), engine


def step(state: DashboardState, positions: list[int], latency: float = 0.02) -> None:
    now = time.monotonic()
    it = IterationStats(now, generation_tokens={"a": len(positions)})
    it.tokens = [TokenTiming(now, p, latency, "a") for p in positions]
    it.itls = [("a", latency)]
    state.record("m", it)


def test_percentile():
    assert percentile([], 50) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0


def test_recent_samples_walk_back_from_the_newest():
    from collections import deque

    samples = deque([(float(t), float(100 - t)) for t in range(100)])
    assert recent(samples, 95.0) == [1.0, 2.0, 3.0, 4.0, 5.0]  # t = 95..99, sorted by value
    samples.append((93.0, 0.5))  # a little out of order (another engine's clock): still read
    assert recent(samples, 92.5) == [0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    assert recent(samples, 200.0) == [] and recent(deque(), 0.0) == []


def test_token_cursor_and_ring_buffer():
    state, _ = make_state(size=100)
    step(state, [0, 1, 2])
    first = state.data(None)
    assert [p[1] for p in first["tokens"]["points"]] == [0, 1, 2]
    cursor = first["tokens"]["next"]
    step(state, [3, 4])
    again = state.data(cursor)
    assert [p[1] for p in again["tokens"]["points"]] == [3, 4]
    assert again["tokens"]["points"][0][2] == 20.0  # latency in ms
    assert state.data(again["tokens"]["next"])["tokens"]["points"] == []
    for _ in range(60):
        step(state, [0, 1, 2, 3])
    assert len(state.tokens) == 100  # bounded
    assert len(state.data(0)["tokens"]["points"]) == 100  # a stale cursor gets what is left


def test_summary_and_series():
    state, engine = make_state()
    state.sample()
    step(state, [0, 1, 2, 3], latency=0.05)
    now = time.monotonic()
    state.record("m", IterationStats(now, ttfts=[("a", 0.2)], finished=[FinishedRequestStats("r", "a", "stop", now - 1, now, 5, 4)]))
    state.series[-1]["t"] -= 1.0  # as if a second had passed
    state.sample()
    d = state.data(None)
    s = d["summary"]
    assert s["running"] == 2 and s["waiting"] == 1 and s["kv_cache_usage_perc"] == 10.0
    assert s["prefix_cache_hit_perc"] == 50.0
    assert s["ttft_ms"]["p50"] == 200.0 and s["itl_ms"]["p99"] == 50.0
    assert s["requests_total"] == 1 and s["finish_reasons"] == {"stop": 1}
    assert s["generation_tokens_per_s"] > 0
    assert len(d["series"]["t"]) == 2 and d["series"]["gen_tps"][-1] > 0
    json.dumps(d)  # JSON-able


def test_vendored_assets_ship_in_the_package():
    js = static_file("echarts.min.js")
    assert len(js) > 500_000 and b"Apache" in js[:2000]
    page = static_file("dashboard.html").decode()
    assert "/dashboard/static/echarts.min.js" in page and "http" not in page.split("<body>")[0].replace("http-equiv", "")
    assert b"heatmap" in static_file("dashboard.js")
    assert (ROOT / "gemel/observability/static/echarts.LICENSE").exists()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"gemel.observability" = ["static/*"]' in pyproject


def test_prometheus_scrape_config():
    cfg = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    gemel = jobs["gemel"]
    assert gemel.get("metrics_path", "/metrics") == "/metrics"
    assert gemel["static_configs"][0]["targets"]
