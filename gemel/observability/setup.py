"""Wires metrics, tracing, the dashboard and the stats log into one app (``create_app`` calls ``install``)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import JSONResponse, Response

from gemel.observability.dashboard import DashboardState
from gemel.observability.dashboard import router as dashboard_router
from gemel.observability.metrics import (
    EngineStatsCollector,
    GatewayCollector,
    GemelMetrics,
    ResponseCacheCollector,
    StatsLogger,
    find_gateway_counters,
)
from gemel.gateway.routes import RoutesCollector
from gemel.observability.tracing import Tracing, TracingMiddleware

log = logging.getLogger("gemel.observability")


class Observability:
    """Everything observability of one app; hangs off ``app.state.observability``."""

    def __init__(self, app: FastAPI, server_state: Any, span_exporter: Any = None):
        cfg = server_state.config.observability
        self.config = cfg
        self.app = app
        self.server_state = server_state
        engine_cfg = server_state.config.engine
        self.metrics = GemelMetrics(
            max_model_len=engine_cfg.max_model_len or 1 << 17, max_num_batched_tokens=engine_cfg.max_num_batched_tokens
        )
        self.metrics.registry.register(EngineStatsCollector(self.engines))
        self.metrics.registry.register(GatewayCollector(self.gateway_counters))
        self.metrics.registry.register(ResponseCacheCollector(lambda: getattr(server_state, "response_cache", None)))
        self.metrics.registry.register(RoutesCollector(lambda: getattr(getattr(server_state, "routes", None), "table", None)))
        self.tracing = Tracing(cfg, exporter=span_exporter)
        self.dashboard = DashboardState(self.engines, cfg.token_timeline_size) if cfg.dashboard else None
        if self.dashboard is not None and getattr(server_state, "routes", None) is not None:
            self.dashboard.routes = server_state.routes.snapshot  # each route's split and rollbacks
        self.stats_logger = StatsLogger(self.metrics, self.engines, cfg.log_stats_interval_s)
        for model in server_state.models:
            if model.engine is None:
                continue
            observers = [self.metrics.observer(model.id), self.tracing.observer(model.id)]
            if self.dashboard is not None:
                observers.append(self.dashboard.observer(model.id))
            model.engine.observers.extend(observers)

    def engines(self) -> list[tuple[str, Any]]:
        return [(m.id, m.engine) for m in self.server_state.models if m.engine is not None]

    def gateway_counters(self) -> Any:
        return find_gateway_counters(self.app.state, self.server_state)

    def start(self) -> None:
        self.stats_logger.start()
        if self.dashboard is not None:
            self.dashboard.start()

    async def stop(self) -> None:
        await self.stats_logger.stop()
        if self.dashboard is not None:
            await self.dashboard.stop()
        self.tracing.shutdown()


router = APIRouter(tags=["observability"])


@router.get("/metrics", summary="Prometheus metrics (gemel:*, named as vLLM's)")
async def metrics(request: Request) -> Response:
    body, content_type = request.app.state.observability.metrics.render()
    return Response(body, media_type=content_type)


@router.get("/internal/traces", summary="finished spans (only with observability.trace_memory_exporter, for tests)")
async def internal_traces(request: Request) -> Response:
    tracing = request.app.state.observability.tracing
    if tracing.memory is None:
        return JSONResponse(
            {"error": {"code": 404, "message": "enable observability.trace_memory_exporter to keep spans in memory"}},
            status_code=404,
        )
    return JSONResponse({"spans": tracing.finished_spans()})


def install(app: FastAPI, server_state: Any, span_exporter: Any = None) -> Observability:
    """Add /metrics, /dashboard, the tracing middleware and the observers to ``app``.

    Call after the app's other middleware is added: the tracing middleware must be the
    outermost, so the response-headers middleware sends the span's ``traceparent``."""
    obs = Observability(app, server_state, span_exporter)
    app.state.observability = obs
    app.include_router(router)
    app.include_router(dashboard_router)
    app.add_middleware(TracingMiddleware, tracing=obs.tracing)
    return obs
