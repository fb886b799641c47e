"""The FastAPI application of ``gemel serve``: both surfaces over one catalogue of engines."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from gemel import __version__
from gemel.api import gemini, health, model_list, openai_api
from gemel.api.errors import install_error_handlers
from gemel.api.middleware import ResponseHeadersMiddleware
from gemel.api.state import ServerState
from gemel.config import GemelConfig


def create_app(config: GemelConfig | None = None) -> FastAPI:
    """Build the app; engines start (in their own processes) when the app's lifespan starts."""
    state = ServerState(config or GemelConfig())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(
        title="gemel",
        version=__version__,
        description="Gemini (REST) and OpenAI-compatible APIs over gemel's engine.",
        lifespan=lifespan,
    )
    app.state.gemel = state
    install_error_handlers(app)
    app.add_middleware(
        ResponseHeadersMiddleware, default_model_id=state.default.id, default_model_version=state.default.version
    )
    app.include_router(health.router)
    app.include_router(model_list.router)  # before the Gemini routers: /v1/models is shared
    app.include_router(gemini.router, prefix="/v1beta")
    app.include_router(gemini.router, prefix="/v1")
    app.include_router(openai_api.router)
    return app
