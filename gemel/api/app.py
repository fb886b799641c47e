"""The FastAPI application of ``gemel serve``: both surfaces over one catalogue of engines."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from gemel import __version__
from gemel.api import admin, gemini, health, model_list, openai_api
from gemel.api.drain import Drain, DrainMiddleware
from gemel.api.limits import RequestLimitsMiddleware
from gemel.api.errors import install_error_handlers
from gemel.api.middleware import ResponseHeadersMiddleware
from gemel.api.state import ServerState
from gemel.config import GemelConfig
from gemel.gateway.gateway import Gateway
from gemel.gateway.middleware import GatewayMiddleware
from gemel.observability.setup import install as install_observability


def create_app(config: GemelConfig | None = None, grpc: bool = False) -> FastAPI:
    """Build the app; engines start (in their own processes) when the app's lifespan starts.

    ``grpc``: also start the Gemini gRPC listener (``config.grpc``, when enabled) with the
    lifespan, on the same loop and over the same state; ``gemel serve`` asks for it."""
    state = ServerState(config or GemelConfig())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        grpc_server = None
        if grpc and state.config.grpc.enabled:
            from gemel.api.grpc_server import GrpcServer

            grpc_server = app.state.grpc_server = GrpcServer.bind(app)  # a port in use fails here
        await state.start()
        app.state.observability.start()
        if grpc_server is not None:
            await grpc_server.start()
        try:
            yield
        finally:
            if grpc_server is not None:
                await grpc_server.stop()  # drains in-flight calls before the engines stop
            await app.state.observability.stop()
            await state.stop()

    app = FastAPI(
        title="gemel",
        version=__version__,
        description="Gemini (REST) and OpenAI-compatible APIs over gemel's engine.",
        lifespan=lifespan,
    )
    app.state.gemel = state
    install_error_handlers(app)
    gateway = Gateway(state.config.gateway)  # keys, signatures, limits, admission
    app.state.gateway = gateway
    app.state.gateway_counters = gateway.counters  # every rejection per tenant and reason
    app.add_middleware(GatewayMiddleware, gateway=gateway)  # inside the response-headers middleware
    server = state.config.server
    app.add_middleware(  # body size and JSON shape, before the gateway reads a body
        RequestLimitsMiddleware, max_body_mb=server.max_body_mb, max_json_depth=server.max_json_depth,
        max_json_values=server.max_json_values,
    )
    app.state.drain = Drain(state.config.server.drain_timeout_s)  # begun by gemel serve's signal handler
    app.add_middleware(DrainMiddleware, drain=app.state.drain)  # outside the gateway: refusals need no admission
    app.add_middleware(
        ResponseHeadersMiddleware, default_model_id=state.default.id, default_model_version=state.default.version
    )
    app.include_router(health.router)
    app.include_router(model_list.router)  # before the Gemini routers: /v1/models is shared
    app.include_router(gemini.router, prefix="/v1beta")
    app.include_router(gemini.router, prefix="/v1")
    app.include_router(openai_api.router)
    app.include_router(admin.router)  # /admin/routes: routes' state and changes (admins only)
    install_observability(app, state)  # /metrics, /dashboard, tracing (outermost middleware)
    return app
