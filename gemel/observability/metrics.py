"""Prometheus metrics at ``/metrics``, named as vLLM's under ``gemel:``.

Two sources, so the engine/front-end process split loses nothing:

- per-request and per-token metrics (histograms, token counters, ``request_success``) are
  observed in the front end from each engine message (``MetricsObserver.on_iteration``),
  labelled ``model_name`` and ``tenant``;
- engine-wide counters and gauges (queues, KV usage, prefix cache, preemptions, speculative
  decoding) are read at scrape time from the latest cumulative ``EngineStats`` the engine
  process sent (``EngineStatsCollector``), so no delta can be dropped between messages.

Every app owns its ``CollectorRegistry`` (never the global default one), so tests may build
several apps in one process. Gateway rejections are read at scrape time from the gateway's
``GatewayCounters`` when it exists (``GatewayCollector``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gemel.observability.periodic import Periodic
from gemel.observability.stats import EngineObserver, IterationStats

log = logging.getLogger("gemel.stats")

PREFIX = "gemel:"

# Bucket edges as vLLM's (vllm/v1/metrics/loggers.py), so dashboards port unchanged.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]  # fmt: skip
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip


def build_1_2_5_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exponent
            if v > max_value:
                return out
            out.append(float(v))
        exponent += 1


def iteration_buckets(max_tokens: int) -> list[float]:
    edges = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    return [float(e) for e in edges if e <= max_tokens] or [1.0]


REQUEST_LABELS = ["model_name", "tenant"]


class GemelMetrics:
    """The app's registry and the metrics the front end observes itself."""

    def __init__(self, max_model_len: int = 1 << 17, max_num_batched_tokens: int = 16384):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        token_buckets = build_1_2_5_buckets(max(max_model_len, 10))

        def hist(name: str, doc: str, buckets: list[float], labels: list[str] = REQUEST_LABELS) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r)

        def counter(name: str, doc: str, labels: list[str] = REQUEST_LABELS) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=r)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token (arrival to first token's step).", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Gap between two steps that gave a sequence tokens.", ITL_BUCKETS)
        self.tpot = hist(
            "request_time_per_output_token_seconds", "Per request: decode time / (output tokens - 1).", ITL_BUCKETS
        )
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to the end of the request.", LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled (waiting for the engine).", LATENCY_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds", "First scheduled to first token.", LATENCY_BUCKETS)
        self.decode = hist("request_decode_time_seconds", "First token to last token.", LATENCY_BUCKETS)
        self.inference = hist("request_inference_time_seconds", "First scheduled to last token.", LATENCY_BUCKETS)
        self.req_prompt_tokens = hist("request_prompt_tokens", "Prompt tokens per request.", token_buckets)
        self.req_generation_tokens = hist("request_generation_tokens", "Generated tokens per request.", token_buckets)
        self.iteration_tokens = hist(
            "iteration_tokens_total", "Tokens computed in one engine step.", iteration_buckets(max_num_batched_tokens),
            ["model_name"],
        )  # fmt: skip
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled (counted when the first token comes).")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.request_success = counter(
            "request_success", "Requests ended, by finish reason (stop, length, abort, error).",
            [*REQUEST_LABELS, "finished_reason"],
        )  # fmt: skip
        # Totals since start per model, for the stats log and the dashboard (cheap to read).
        self.totals: dict[str, dict[str, float]] = {}

    def observer(self, model_name: str) -> MetricsObserver:
        self.totals.setdefault(model_name, {"prompt_tokens": 0, "generation_tokens": 0, "requests": 0})
        return MetricsObserver(self, model_name)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class MetricsObserver(EngineObserver):
    """Front-end metrics of one model's engine."""

    def __init__(self, metrics: GemelMetrics, model_name: str):
        self.m = metrics
        self.model = model_name
        # Each metric's child per label values, looked up once: ``labels()`` validates and
        # locks on every call, and the ITL histogram is observed once per generated token.
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def on_iteration(self, it: IterationStats) -> None:
        m, model, child = self.m, self.model, self._child
        totals = m.totals[model]
        for n in it.iteration_tokens:
            child(m.iteration_tokens, model).observe(n)
        for tenant, n in it.prompt_tokens.items():
            child(m.prompt_tokens, model, tenant).inc(n)
            totals["prompt_tokens"] += n
        for tenant, n in it.generation_tokens.items():
            child(m.generation_tokens, model, tenant).inc(n)
            totals["generation_tokens"] += n
        for tenant, v in it.ttfts:
            child(m.ttft, model, tenant).observe(v)
        for tenant, v in it.itls:
            child(m.itl, model, tenant).observe(v)
        for fs in it.finished:
            labels = (model, fs.tenant)
            totals["requests"] += 1
            child(m.request_success, *labels, fs.finish_reason).inc()
            child(m.e2e, *labels).observe(fs.e2e_latency_s)
            child(m.req_prompt_tokens, *labels).observe(fs.num_prompt_tokens)
            child(m.req_generation_tokens, *labels).observe(fs.num_generation_tokens)
            for hist, value in (
                (m.queue, fs.queue_time_s),
                (m.prefill, fs.prefill_time_s),
                (m.decode, fs.decode_time_s),
                (m.inference, fs.inference_time_s),
                (m.tpot, fs.mean_time_per_output_token_s),
            ):
                if value is not None:
                    child(hist, *labels).observe(value)


class EngineStatsCollector(Collector):
    """Gauges and engine-side counters, read from each engine's latest stats at scrape time."""

    def __init__(self, engines: Callable[[], Iterable[tuple[str, Any]]]):
        self.engines = engines  # () -> [(model name, AsyncLLM)]

    def describe(self):  # no auto-describe call into collect() at registration
        return []

    def collect(self):
        g_running = GaugeMetricFamily(PREFIX + "num_requests_running", "Requests in the engine's running batch.", labels=["model_name"])
        g_waiting = GaugeMetricFamily(PREFIX + "num_requests_waiting", "Requests waiting to be scheduled.", labels=["model_name"])
        g_kv = GaugeMetricFamily(PREFIX + "kv_cache_usage_perc", "KV-cache usage (1 = full).", labels=["model_name"])
        g_up = GaugeMetricFamily(PREFIX + "engine_up", "1 when the model's engine process is ready.", labels=["model_name"])

        def c(name: str, doc: str, labels=("model_name",)) -> CounterMetricFamily:
            return CounterMetricFamily(PREFIX + name, doc, labels=list(labels))

        c_preempt = c("num_preemptions", "Preemptions (a running sequence gave its KV blocks back).")
        c_queries = c("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        c_hits = c("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        c_drafts = c("spec_decode_num_drafts", "Speculative drafts verified.")
        c_draft_tokens = c("spec_decode_num_draft_tokens", "Speculative tokens proposed.")
        c_accepted = c("spec_decode_num_accepted_tokens", "Speculative tokens accepted.")
        c_per_pos = c(
            "spec_decode_num_accepted_tokens_per_pos", "Speculative tokens accepted, by draft position.",
            ("model_name", "position"),
        )  # fmt: skip
        c_restarts = c("engine_restarts", "Engine processes started again after a crash, a kill or a stall.", ("model_name", "reason"))
        c_tier_hits = c("kv_tier_hits", "Prefix blocks loaded back from the KV tier instead of recomputed.", ("model_name", "tier"))
        c_tier_bytes = c("kv_tier_bytes", "Bytes moved by the KV tier: saved from the pool, written to disk, loaded back.",
                         ("model_name", "direction"))
        for model, engine in self.engines():
            for reason, n in getattr(engine, "restarts", {}).items():
                c_restarts.add_metric([model, reason], n)
            s = engine.stats
            g_running.add_metric([model], s.num_running)
            g_waiting.add_metric([model], s.num_waiting)
            g_kv.add_metric([model], s.kv_cache_usage)
            g_up.add_metric([model], 1.0 if engine.state == "ready" else 0.0)
            c_preempt.add_metric([model], s.num_preemptions)
            if s.kv_tier_bytes_saved or s.kv_tier_bytes_written or s.kv_tier_bytes_loaded:
                c_tier_hits.add_metric([model, "host"], s.kv_tier_host_hits)
                c_tier_hits.add_metric([model, "disk"], s.kv_tier_disk_hits)
                for direction, n in (("saved", s.kv_tier_bytes_saved), ("written", s.kv_tier_bytes_written),
                                     ("loaded", s.kv_tier_bytes_loaded)):
                    c_tier_bytes.add_metric([model, direction], n)
            c_queries.add_metric([model], s.prefix_cache_queries)
            c_hits.add_metric([model], s.prefix_cache_hits)
            c_drafts.add_metric([model], s.spec_num_drafts)
            c_draft_tokens.add_metric([model], s.spec_num_draft_tokens)
            c_accepted.add_metric([model], s.spec_num_accepted_tokens)
            for pos, n in enumerate(s.spec_accepted_per_position):
                c_per_pos.add_metric([model, str(pos)], n)
        yield from (
            g_running, g_waiting, g_kv, g_up, c_preempt, c_queries, c_hits, c_drafts, c_draft_tokens, c_accepted, c_per_pos,
            c_restarts, c_tier_hits, c_tier_bytes,
        )
        pools = [(model, engine) for model, engine in self.engines() if hasattr(engine, "replica_info")]
        if pools:
            yield from replica_families(pools)


def replica_families(pools: list[tuple[str, Any]]) -> list:
    """Models served by engine replicas (``gemel.scale``): how many run, and each one's load."""
    g_count = GaugeMetricFamily(PREFIX + "replicas", "Engine replicas running the model.", labels=["model_name"])
    labels = ["model_name", "replica"]
    g_ongoing = GaugeMetricFamily(PREFIX + "replica_ongoing_requests", "Requests the front end has on the replica.", labels=labels)
    g_running = GaugeMetricFamily(PREFIX + "replica_num_requests_running", "Requests in the replica's running batch.", labels=labels)
    g_kv = GaugeMetricFamily(PREFIX + "replica_kv_cache_usage_perc", "The replica's KV-cache usage (1 = full).", labels=labels)
    c_queries = CounterMetricFamily(PREFIX + "replica_prefix_cache_queries", "Prompt tokens the replica looked up in its prefix cache.", labels=labels)
    c_hits = CounterMetricFamily(PREFIX + "replica_prefix_cache_hits", "Prompt tokens found in the replica's prefix cache.", labels=labels)
    for model, pool in pools:
        replicas = pool.replica_info()
        g_count.add_metric([model], len(replicas))
        for r in replicas:
            key = [model, r["replica"]]
            g_ongoing.add_metric(key, r["ongoing_requests"])
            g_running.add_metric(key, r["num_running"])
            g_kv.add_metric(key, r["kv_cache_usage"])
            c_queries.add_metric(key, r["prefix_cache_queries"])
            c_hits.add_metric(key, r["prefix_cache_hits"])
    return [g_count, g_ongoing, g_running, g_kv, c_queries, c_hits]


# The gateway's rejection counters: (attribute on GatewayCounters, metric name, second label).
GATEWAY_COUNTERS = [
    ("auth_failures", "gateway_auth_failures", "reason", "Requests refused by authentication, by reason."),
    ("rate_limited", "gateway_rate_limited", "kind", "Requests refused by a rate limit (requests or tokens per minute)."),
    ("admission_rejected", "gateway_admission_rejected", "reason", "Requests refused by admission control, by reason."),
]


def _counter_items(obj: Any) -> Iterable[tuple[tuple[str, str], float]]:
    """``{(tenant, reason): n}`` or ``{tenant: {reason: n}}`` -> ((tenant, reason), n) pairs."""
    if not obj:
        return []
    items = []
    for key, value in dict(obj).items():
        if isinstance(value, dict):
            items.extend(((str(key), str(k2)), float(v2)) for k2, v2 in value.items())
        elif isinstance(key, tuple) and len(key) == 2:
            items.append(((str(key[0]), str(key[1])), float(value)))
    return items


class GatewayCollector(Collector):
    """``gemel:gateway_*_total{tenant,...}`` from the gateway's ``GatewayCounters``, read at scrape time.

    ``counters`` returns the object or None (no gateway). Its ``as_dict()`` gives
    ``{"auth_failures": {tenant: {reason: n}}, "rate_limited": {tenant: {kind: n}},
    "admission_rejected": {tenant: {reason: n}}}`` (see ``gemel/gateway/counters.py``).
    The three families are always exported, empty when there is no gateway.
    """

    def __init__(self, counters: Callable[[], Any]):
        self.counters = counters

    def describe(self):
        return []

    def collect(self):
        snapshot: dict = {}
        try:
            obj = self.counters()
            if obj is not None:
                snapshot = obj.as_dict() if hasattr(obj, "as_dict") else {}
        except Exception:
            log.exception("reading the gateway counters failed")
        for attr, name, label, doc in GATEWAY_COUNTERS:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["tenant", label])
            for (tenant, reason), n in _counter_items(snapshot.get(attr)):
                family.add_metric([tenant, reason], n)
            yield family


class ResponseCacheCollector(Collector):
    """``gemel:response_cache_requests_total{kind,result}`` (kind exact|semantic, result
    hit|miss|bypass) from the response cache's counts, read at scrape time; empty while the
    cache is off. ``cache`` returns the ``gemel.cache.response.ResponseCache`` or None."""

    def __init__(self, cache: Callable[[], Any]):
        self.cache = cache

    def describe(self):
        return []

    def collect(self):
        family = CounterMetricFamily(
            PREFIX + "response_cache_requests", "Response cache lookups, by kind (exact, semantic) and result (hit, miss, bypass).",
            labels=["kind", "result"],
        )  # fmt: skip
        cache = self.cache()
        for (kind, result), n in dict(getattr(cache, "counts", None) or {}).items():
            family.add_metric([kind, result], n)
        yield family


def find_gateway_counters(*holders: Any) -> Any:
    """The gateway's ``GatewayCounters``: ``app.state.gateway_counters`` (or ``.gateway.counters``)."""
    for holder in holders:
        if holder is None:
            continue
        for getter in (lambda h: getattr(h, "gateway_counters", None), lambda h: getattr(getattr(h, "gateway", None), "counters", None)):
            try:
                value = getter(holder)
            except Exception:
                value = None
            if value is not None and hasattr(value, "as_dict"):
                return value
    return None


class StatsLogger:
    """vLLM's periodic one-line log: throughput, queues, KV usage, prefix hit rate; only after activity."""

    def __init__(self, metrics: GemelMetrics, engines: Callable[[], Iterable[tuple[str, Any]]], interval_s: float):
        self.metrics = metrics
        self.engines = engines
        self.interval_s = interval_s
        self._last: dict[str, tuple[float, float, float, int, int]] = {}
        self._logger = Periodic(self.log_due_lines, interval_s, "stats log")

    def start(self) -> None:
        if self.interval_s > 0:
            self._snapshot_all()
            self._logger.start()

    async def stop(self) -> None:
        await self._logger.stop()

    def _snapshot_all(self) -> None:
        now = time.monotonic()
        for model, engine in self.engines():
            self._last[model] = self._snapshot(model, engine, now)

    def _snapshot(self, model: str, engine: Any, now: float) -> tuple[float, float, float, int, int]:
        t = self.metrics.totals.get(model, {})
        s = engine.stats
        return now, t.get("prompt_tokens", 0), t.get("generation_tokens", 0), s.prefix_cache_queries, s.prefix_cache_hits

    def log_due_lines(self) -> None:
        for line in self.lines():
            log.info("%s", line)

    def lines(self) -> list[str]:
        """The lines due now (and the new baseline); a model with no activity logs nothing."""
        out = []
        now = time.monotonic()
        for model, engine in self.engines():
            cur = self._snapshot(model, engine, now)
            prev = self._last.get(model, cur)
            self._last[model] = cur
            s = engine.stats
            dt = max(1e-9, cur[0] - prev[0])
            prompt, gen = cur[1] - prev[1], cur[2] - prev[2]
            queries, hits = cur[3] - prev[3], cur[4] - prev[4]
            if not (prompt or gen or s.num_running or s.num_waiting):
                continue
            hit_rate = 100.0 * hits / queries if queries > 0 else 0.0
            out.append(
                f"{model}: Avg prompt throughput: {prompt / dt:.1f} tokens/s, "
                f"Avg generation throughput: {gen / dt:.1f} tokens/s, "
                f"Running: {s.num_running} reqs, Waiting: {s.num_waiting} reqs, "
                f"KV cache usage: {100.0 * s.kv_cache_usage:.1f}%, Prefix cache hit rate: {hit_rate:.1f}%"
            )
        return out
