"""Liveness, readiness and the engine's internal stats (which tests read, e.g. to see a disconnect free its blocks)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from gemel.api.state import state_of

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="liveness: the front end answers (also while draining)")
async def healthz(request: Request) -> Response:
    st = state_of(request)
    return JSONResponse({"status": "OK", "models_loaded": [m.id for m in st.models if m.loaded]})


def _engine_problem(st, m) -> str | None:
    if m.failure is not None:  # refused at start-up (e.g. its weights failed verification)
        return f"failed: {m.failure}"
    if m.engine is None:
        task = m.encoder_task
        if task is None or not task.done():
            return "loading"
        return f"failed: {task.exception()}" if task.exception() else None
    e = m.engine
    if e.state == "restarting":
        return f"restarting: {e.error}"
    if e.state != "ready":
        return e.error or e.state
    age = time.monotonic() - e.last_report
    if age > st.config.server.engine_stale_after_s:
        return f"engine silent for {age:.0f}s"
    return None


@router.get("/readyz", summary="readiness: every model loaded, its engine responsive, not shutting down")
async def readyz(request: Request) -> Response:
    st = state_of(request)
    drain = getattr(request.app.state, "drain", None)
    if drain is not None and drain.draining:  # shutting down: the load balancer should stop sending
        return JSONResponse(
            {"status": "DRAINING", "in_flight": drain.in_flight}, status_code=503, headers={"Retry-After": "1"}
        )
    problems = {m.id: p for m in st.models if (p := _engine_problem(st, m)) is not None}
    if problems:
        return JSONResponse({"status": "UNAVAILABLE", "problems": problems}, status_code=503, headers={"Retry-After": "1"})
    return JSONResponse({"status": "READY", "models": [m.id for m in st.models]})


@router.get("/internal/stats", summary="engine stats per model (KV blocks, queues)")
async def internal_stats(request: Request) -> Response:
    st = state_of(request)
    now = time.monotonic()
    engines = {}
    for m in st.models:
        e = m.engine
        if e is None:
            continue
        s = e.stats
        engines[m.id] = {
            "state": e.state,
            "error": e.error,
            "pid": e.pid,
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "num_free_blocks": s.num_free_blocks,
            "num_blocks": s.num_blocks,
            "kv_cache_usage": s.kv_cache_usage,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            "num_preemptions": s.num_preemptions,
            "step_tokens": s.step_tokens,
            "step_time_s": s.step_time_s,
            "num_requests_in_flight": e.num_in_flight,
            "last_report_age_s": (now - e.last_report) if e.last_report else None,
        }
        if hasattr(e, "replica_info"):  # a replica pool (gemel.scale): each replica, and the router's settings
            engines[m.id]["replicas"] = e.replica_info()
            engines[m.id]["scale"] = e.describe()
    return JSONResponse({"default_model": st.default.id, "engines": engines})
