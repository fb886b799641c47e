"""What one ``gemel serve`` process serves: the model catalogue and its engines.

Hangs off ``app.state.gemel``; no module-level globals, so tests may build several apps.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

from starlette.requests import Request

from gemel.api.errors import APIError
from gemel.api.routes import Routing
from gemel.config import GemelConfig, ServerConfig
from gemel.engine.async_llm import AsyncLLM, EngineNotReadyError
from gemel.engine.supervisor import RestartPolicy
from gemel.loader import integrity, sources
from gemel.scale.context import REQUEST_STATE

log = logging.getLogger("gemel.api")


@dataclass
class ServedModel:
    """One catalogue entry as the API sees it: names, limits, and what runs it."""

    id: str
    kind: Literal["generate", "embed"]
    version: str
    aliases: list[str]
    display_name: str
    description: str
    max_output_tokens: int
    source: str
    created: int = field(default_factory=lambda: int(time.time()))
    engine: AsyncLLM | None = None
    encoder_task: asyncio.Task | None = None  # the embedding model, loading in a thread
    failure: str | None = None  # why this model cannot serve (e.g. its weights differ); its engine never starts

    @property
    def model_version(self) -> str:
        return f"{self.id}@{self.version}"

    @property
    def input_token_limit(self) -> int:
        if self.engine is not None:
            return self.engine.max_model_len
        if self.encoder_task is not None and self.encoder_task.done() and not self.encoder_task.exception():
            return self.encoder_task.result().max_seq_length
        return 0

    @property
    def loaded(self) -> bool:
        if self.engine is not None:
            return self.engine.ready
        return self.encoder_task is not None and self.encoder_task.done() and not self.encoder_task.exception()


def state_of(request: Request) -> ServerState:
    return request.app.state.gemel


def mark_model(request: Request, model: ServedModel) -> None:
    """Name the model that served this request in the response headers (x-model-id, x-model-version;
    a replica pool adds x-gemel-replica, ``gemel.scale.context``)."""
    request.state.model_id = model.id
    request.state.model_version = model.version
    REQUEST_STATE.set(request.state)


def restart_policy(server: ServerConfig) -> RestartPolicy:
    """When a model's dead or stalled engine is started again (``engine/supervisor.py``)."""
    return RestartPolicy(
        max_restarts=server.engine_max_restarts, window_s=server.engine_restart_window_s, stall_s=server.engine_stall_s
    )


def _served_model(entry, kind: Literal["generate", "embed"], description: str, max_output_tokens: int, engine: AsyncLLM | None = None) -> ServedModel:
    """The catalogue entry of a configured model (``ModelEntry`` or ``EmbeddingsConfig``)."""
    return ServedModel(
        id=entry.id,
        kind=kind,
        version=entry.version,
        aliases=list(entry.aliases),
        display_name=entry.display_name or entry.id,
        description=description,
        max_output_tokens=max_output_tokens,
        source=entry.source,
        engine=engine,
    )


class ServerState:
    def __init__(self, config: GemelConfig):
        self.config = config
        self.started_at = time.time()
        self.models: list[ServedModel] = []
        for entry in config.models:
            sources.resolve(entry.source)  # fail at start-up, with the install hint, not per request
            if config.scale.enabled:  # engine replicas on Ray Serve; Ray is imported only here
                from gemel.scale.pool import ReplicaPool

                engine = ReplicaPool(
                    entry.id, config.engine_config(entry), config.scale, stats_interval_s=config.server.stats_interval_s,
                    log_level=config.server.log_level, restart=restart_policy(config.server),
                    ready_timeout_s=config.server.engine_ready_timeout_s,
                )  # fmt: skip
            else:
                engine = AsyncLLM(
                    config.engine_config(entry),  # unset CPU threads adapt (gemel.engine.threads)
                    stats_interval_s=config.server.stats_interval_s,
                    log_level=config.server.log_level,
                    restart=restart_policy(config.server),
                )
            description = entry.description or f"{entry.id} served by gemel"
            self.models.append(_served_model(entry, "generate", description, entry.max_output_tokens, engine))
        emb = config.embeddings
        if emb is not None:
            try:
                sources.resolve(emb.source)
                self.models.append(_served_model(emb, "embed", f"{emb.id} sentence embeddings served by gemel", 1))
            except sources.ModelNotFound as e:
                log.warning("no embedding model: %s", e)
        self.by_name: dict[str, ServedModel] = {}
        for m in self.models:
            for name in [m.id, *m.aliases]:
                self.by_name[name] = m
        self.default = self.models[0]
        self.routes = Routing(config.routes, self.models)  # public names over weighted models (gemel.api.routes)
        self._embed_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gemel-embed")
        self.response_cache = None  # finished answers replayed without the engine (gemel.cache); None: off
        if config.cache.response is not None:
            from gemel.cache.response import build

            self.response_cache = build(self)

    # -- life cycle ---------------------------------------------------------------------
    async def start(self) -> None:
        """Check every model's weights (in threads, at once), then start the engines of those intact."""
        mode = self.config.server.verify_weights
        checks = await asyncio.gather(*(asyncio.to_thread(integrity.check_for_serve, m.source, mode) for m in self.models))
        for m, check in zip(self.models, checks):
            if check.failure is not None:
                m.failure = check.failure
                log.error("model %s will not serve: %s", m.id, check.failure)
            elif not check.checked and mode != "off":
                log.warning("model %s: %s", m.id, check.summary)
            else:
                log.info("model %s: %s", m.id, check.summary)
        loop = asyncio.get_running_loop()
        for m in self.models:
            if m.failure is not None:
                continue
            if m.engine is not None:
                await m.engine.start()
            else:
                m.encoder_task = asyncio.ensure_future(loop.run_in_executor(self._embed_executor, self._load_encoder, m))

    def _load_encoder(self, m: ServedModel):
        from gemel.embeddings import SentenceEncoder

        emb = self.config.embeddings
        encoder = SentenceEncoder(sources.resolve(m.source), num_threads=emb.num_threads if emb else 1)
        log.info("embedding model %s ready (%d dimensions)", m.id, encoder.dimensions)
        return encoder

    async def stop(self) -> None:
        if self.response_cache is not None:
            await self.response_cache.close()
        await asyncio.gather(*(m.engine.shutdown() for m in self.models if m.engine is not None))
        self._embed_executor.shutdown(wait=False, cancel_futures=True)

    @property
    def engines(self) -> list[AsyncLLM]:
        return [m.engine for m in self.models if m.engine is not None]

    # -- lookups ------------------------------------------------------------------------
    def resolve(self, name: str, surface: str = "gemini", api_version: str = "v1beta") -> ServedModel:
        """A model by id or alias (``models/`` prefix allowed), else 404 in the surface's words;
        503 with the reason for a model that cannot serve, while the others do."""
        key = name.removeprefix("models/")
        model = self.by_name.get(key) or self.by_name.get(self.routes.primary(key) or "")  # a route: its main target
        if model is None:
            if surface == "openai":
                raise APIError(
                    404,
                    f"The model `{key}` does not exist or you do not have access to it.",
                    param="model",
                    code="model_not_found",
                )
            raise APIError(
                404,
                f"models/{key} is not found for API version {api_version}. "
                "Call ListModels to see the list of available models and their supported methods.",
            )
        if model.failure is not None:
            raise APIError(503, f"model {model.id} is unavailable: {model.failure}", retry_after_s=None)
        return model

    def generative(self, name: str, surface: str = "gemini", api_version: str = "v1beta", method: str = "generateContent") -> ServedModel:
        model = self.resolve(name, surface, api_version)
        if model.engine is None:
            raise APIError(400, f"model {model.id} is an embedding model; it does not support {method}", param="model")
        return model

    def embedding(self, name: str, surface: str = "gemini", api_version: str = "v1beta", method: str = "embedContent") -> ServedModel:
        model = self.resolve(name, surface, api_version)
        if model.kind != "embed":
            raise APIError(400, f"model {model.id} is a generative model; it does not support {method}", param="model")
        return model

    async def encoder(self, model: ServedModel, timeout: float):
        try:
            return await asyncio.wait_for(asyncio.shield(model.encoder_task), timeout)
        except TimeoutError:
            raise EngineNotReadyError(f"the embedding model {model.id} is still loading") from None

    async def embed(self, model: ServedModel, texts: list[str], timeout: float):
        """Unit vectors [len(texts), dims], computed in the embedding thread (never on the loop)."""
        encoder = await self.encoder(model, timeout)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._embed_executor, encoder.embed, texts)
