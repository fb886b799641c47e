"""The built-in live dashboard: ``/dashboard`` and the JSON it polls.

``DashboardState`` keeps, in memory and bounded:

- a ring buffer of recent output tokens (arrival time, position in its response, latency
  since the previous token of that response), filled by ``DashboardObserver`` from every
  engine step in the front end: the per-token latency heatmap's input;
- recent TTFT and ITL samples, for percentiles over the last minute;
- one sample a second of throughput, queues, KV-cache usage and prefix-cache hit rate
  (five minutes of it), for the line charts;
- the routes' state when the server has routes (``routes``: weights, requests per target,
  rollbacks, fallbacks), read when the page polls.

``GET /dashboard/data?since=N`` answers the summary, the series and the tokens after cursor
``N``; the page (``static/dashboard.html``, drawn with the vendored Apache ECharts build
``static/echarts.min.js``; nothing is fetched from elsewhere) polls it every second.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from importlib import resources
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from gemel.observability.periodic import Periodic
from gemel.observability.stats import EngineObserver, IterationStats

SAMPLE_INTERVAL_S = 1.0
SERIES_LEN = 300  # five minutes of one-second samples
PERCENTILE_WINDOW_S = 60.0
RATE_WINDOW_S = 5.0
MAX_POINTS_PER_POLL = 5000


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]) of already sorted values."""
    if not sorted_values:
        return None
    k = (len(sorted_values) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    if lo == hi:
        return sorted_values[lo]
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def wall_of(t_mono: float, now_mono: float, now_wall: float) -> float:
    return now_wall - (now_mono - t_mono)


def recent(samples: deque[tuple[float, float]], cutoff: float, slack_s: float = 5.0) -> list[float]:
    """Sorted values of the ``(wall s, value)`` samples taken at or after ``cutoff``.

    Samples arrive in time order (give or take the engines' clocks), so the walk starts at the
    newest and stops ``slack_s`` before the cutoff instead of reading all 50,000 every second.
    """
    values = []
    for t, v in reversed(samples):
        if t < cutoff - slack_s:
            break
        if t >= cutoff:
            values.append(v)
    values.sort()
    return values


class DashboardState:
    def __init__(self, engines: Callable[[], Iterable[tuple[str, Any]]], timeline_size: int = 20000):
        self.engines = engines
        self.tokens: deque[tuple[int, float, int, float, str]] = deque(maxlen=timeline_size)  # seq, wall s, pos, latency s, model
        self.next_seq = 0
        self.ttfts: deque[tuple[float, float]] = deque(maxlen=20000)  # (wall s, seconds)
        self.itls: deque[tuple[float, float]] = deque(maxlen=50000)
        self.series: deque[dict] = deque(maxlen=SERIES_LEN)
        self.totals = {"prompt_tokens": 0, "generation_tokens": 0, "requests": 0}
        self.finish_reasons: dict[str, int] = {}
        self.routes: Callable[[], list[dict]] | None = None  # the routes' snapshot (gemel.api.routes)
        self._sampler = Periodic(self.sample, SAMPLE_INTERVAL_S, "dashboard sampler")

    def observer(self, model_name: str) -> DashboardObserver:
        return DashboardObserver(self, model_name)

    # -- recording (event loop) -----------------------------------------------------------
    def record(self, model: str, it: IterationStats) -> None:
        now_mono, now_wall = time.monotonic(), time.time()
        for tok in it.tokens:
            self.tokens.append((self.next_seq, wall_of(tok.t, now_mono, now_wall), tok.position, tok.latency_s, model))
            self.next_seq += 1
        t_wall = wall_of(it.time, now_mono, now_wall)
        self.ttfts.extend((t_wall, v) for _, v in it.ttfts)
        self.itls.extend((t_wall, v) for _, v in it.itls)
        self.totals["prompt_tokens"] += sum(it.prompt_tokens.values())
        self.totals["generation_tokens"] += sum(it.generation_tokens.values())
        for fs in it.finished:
            self.totals["requests"] += 1
            self.finish_reasons[fs.finish_reason] = self.finish_reasons.get(fs.finish_reason, 0) + 1

    # -- the once-a-second sampler ----------------------------------------------------------
    def start(self) -> None:
        self.sample()
        self._sampler.start()

    async def stop(self) -> None:
        await self._sampler.stop()

    def sample(self) -> None:
        running = waiting = queries = hits = 0
        kv = 0.0
        for _, engine in self.engines():
            s = engine.stats
            running += s.num_running
            waiting += s.num_waiting
            kv = max(kv, s.kv_cache_usage)
            queries += s.prefix_cache_queries
            hits += s.prefix_cache_hits
        now = time.time()
        cutoff = now - 10.0
        ttft = recent(self.ttfts, cutoff)
        itl = recent(self.itls, cutoff)
        self.series.append(
            {
                "t": now,
                "prompt_tokens": self.totals["prompt_tokens"],
                "generation_tokens": self.totals["generation_tokens"],
                "running": running,
                "waiting": waiting,
                "kv": kv,
                "prefix_queries": queries,
                "prefix_hits": hits,
                "ttft_p50": percentile(ttft, 50),
                "ttft_p99": percentile(ttft, 99),
                "itl_p50": percentile(itl, 50),
                "itl_p99": percentile(itl, 99),
            }
        )

    # -- the JSON the page polls ------------------------------------------------------------
    def data(self, since: int | None) -> dict:
        now = time.time()
        series = list(self.series)
        out_series: dict[str, list] = {k: [] for k in ("t", "gen_tps", "prompt_tps", "running", "waiting", "kv_perc", "prefix_hit_perc", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")}  # fmt: skip
        for i, s in enumerate(series):
            prev = series[max(0, i - 1)]
            base = series[max(0, i - 10)]
            dt = s["t"] - prev["t"]
            dq = s["prefix_queries"] - base["prefix_queries"]
            out_series["t"].append(round(s["t"] * 1000))
            out_series["gen_tps"].append(round((s["generation_tokens"] - prev["generation_tokens"]) / dt, 2) if dt > 0 else 0)
            out_series["prompt_tps"].append(round((s["prompt_tokens"] - prev["prompt_tokens"]) / dt, 2) if dt > 0 else 0)
            out_series["running"].append(s["running"])
            out_series["waiting"].append(s["waiting"])
            out_series["kv_perc"].append(round(100.0 * s["kv"], 2))
            out_series["prefix_hit_perc"].append(round(100.0 * (s["prefix_hits"] - base["prefix_hits"]) / dq, 2) if dq > 0 else None)
            for key in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99"):
                v = s[key]
                out_series[key + "_ms"].append(None if v is None else round(v * 1000, 2))
        # Summary: rates over the last few seconds, percentiles over the last minute.
        base = next((s for s in series if s["t"] >= series[-1]["t"] - RATE_WINDOW_S), None) if series else None
        last = series[-1] if series else None
        rate = lambda key: (  # noqa: E731
            (last[key] - base[key]) / (last["t"] - base["t"]) if last and base and last["t"] > base["t"] else 0.0
        )
        cutoff = now - PERCENTILE_WINDOW_S
        ttft = recent(self.ttfts, cutoff)
        itl = recent(self.itls, cutoff)
        ms = lambda v: None if v is None else round(v * 1000, 2)  # noqa: E731
        running = waiting = queries = hits = 0
        kv = 0.0
        models = []
        for name, engine in self.engines():
            st = engine.stats
            models.append({"name": name, "state": engine.state})
            running += st.num_running
            waiting += st.num_waiting
            kv = max(kv, st.kv_cache_usage)
            queries += st.prefix_cache_queries
            hits += st.prefix_cache_hits
        # Tokens after the cursor (the first poll gets the last minute's).
        if since is None:
            points = [p for p in self.tokens if p[1] >= cutoff]
        else:
            first_seq = self.tokens[0][0] if self.tokens else self.next_seq
            skip = max(0, since - first_seq)
            points = [p for i, p in enumerate(self.tokens) if i >= skip]
        points = points[-MAX_POINTS_PER_POLL:]
        return {
            "now": round(now * 1000),
            "models": models,
            "summary": {
                "generation_tokens_per_s": round(rate("generation_tokens"), 2),
                "prompt_tokens_per_s": round(rate("prompt_tokens"), 2),
                "running": running,
                "waiting": waiting,
                "kv_cache_usage_perc": round(100.0 * kv, 2),
                "prefix_cache_hit_perc": round(100.0 * hits / queries, 2) if queries else None,
                "prefix_cache_hits": hits,
                "prefix_cache_queries": queries,
                "ttft_ms": {f"p{q}": ms(percentile(ttft, q)) for q in (50, 90, 99)},
                "itl_ms": {f"p{q}": ms(percentile(itl, q)) for q in (50, 90, 99)},
                "requests_total": self.totals["requests"],
                "generation_tokens_total": self.totals["generation_tokens"],
                "finish_reasons": dict(self.finish_reasons),
            },
            "series": out_series,
            "routes": self.routes() if self.routes is not None else [],
            "tokens": {
                "next": self.next_seq,
                "columns": ["t_ms", "position", "latency_ms"],
                "points": [[round(p[1] * 1000), p[2], round(p[3] * 1000, 3)] for p in points],
            },
        }


class DashboardObserver(EngineObserver):
    def __init__(self, state: DashboardState, model_name: str):
        self.state = state
        self.model = model_name

    def on_iteration(self, it: IterationStats) -> None:
        self.state.record(self.model, it)


def static_file(name: str) -> bytes:
    return resources.files("gemel.observability").joinpath("static", name).read_bytes()


_STATIC_TYPES = {"echarts.min.js": "text/javascript", "dashboard.js": "text/javascript", "dashboard.css": "text/css"}

router = APIRouter(tags=["observability"])


def _dashboard(request: Request) -> DashboardState | None:
    obs = getattr(request.app.state, "observability", None)
    return getattr(obs, "dashboard", None)


@router.get("/dashboard", summary="live dashboard (throughput, latency, KV and prefix cache, per-token heatmap)")
async def dashboard_page(request: Request) -> Response:
    if _dashboard(request) is None:
        return JSONResponse({"error": {"code": 404, "message": "the dashboard is disabled"}}, status_code=404)
    return HTMLResponse(static_file("dashboard.html").decode(), headers={"Cache-Control": "no-cache"})


@router.get("/dashboard/data", summary="the dashboard's data: summary, one-second series, recent token timings")
async def dashboard_data(request: Request, since: int | None = None) -> Response:
    dash = _dashboard(request)
    if dash is None:
        return JSONResponse({"error": {"code": 404, "message": "the dashboard is disabled"}}, status_code=404)
    return JSONResponse(dash.data(since), headers={"Cache-Control": "no-store"})


@router.get("/dashboard/static/{name}", include_in_schema=False)
async def dashboard_static(name: str) -> Response:
    media = _STATIC_TYPES.get(name)
    if media is None:
        return Response(status_code=404)
    return Response(static_file(name), media_type=media, headers={"Cache-Control": "public, max-age=3600"})
