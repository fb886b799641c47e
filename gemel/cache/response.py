"""The response cache: finished answers of deterministic requests, replayed without the engine.

``gemel.api.pipeline.start_generation`` asks ``ResponseCache.lookup`` once the prompts are
tokenised, before readiness and admission. A hit is a list of final ``RequestOutput``s,
replayed as engine streams (``Lookup.streams``), so every surface renders and streams it as
it would the engine's; a miss returns a ``Lookup`` whose ``finished`` stores the answer when
the generation completes without error.

* Exact: same tenant, model, prompt tokens and answer-changing knobs (``keys.exact_key``).
* Semantic, for the tenants or routes that opt in: the nearest earlier one-prompt request of
  the same tenant, model and knobs whose prompt embedding is at least ``threshold`` similar.
* Only deterministic requests (greedy, or a seed) are looked up or stored.
* ``Cache-Control: no-cache`` skips the read (the fresh answer is stored); ``no-store`` skips both.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from gemel.cache.keys import deterministic, exact_key, partition_key
from gemel.cache.semantic import Embed, SemanticIndex
from gemel.cache.store import MemoryStore, RedisStore, decode_entry, encode_entry
from gemel.engine.output_processor import RequestOutput

if TYPE_CHECKING:
    from gemel.config import ResponseCacheConfig

log = logging.getLogger("gemel.cache")

KINDS = ("exact", "semantic")
RESULTS = ("hit", "miss", "bypass")
STORED_FINISH = ("stop", "length")  # an aborted answer is not the answer


@dataclass
class Lookup:
    """One request's dealings with the cache: its hit, or what storing its answer needs."""

    cache: ResponseCache
    result: str = "miss"  # the x-gemel-cache header: exact | semantic | miss
    outputs: list[RequestOutput] | None = None  # a hit's final outputs, one per prompt
    key: str | None = None  # where the answer goes; None: not stored
    partition: str | None = None  # the semantic index it joins; None: none
    text: str | None = None  # what the semantic index embeds
    vector: Any = None  # its embedding, when the lookup computed it
    _stored: bool = field(default=False, repr=False)

    def streams(self) -> list[AsyncIterator[RequestOutput]]:
        """A hit as engine streams: per prompt one output with the whole text, then the finish."""
        return [replay(out) for out in self.outputs or []]

    def finished(self, outputs: Sequence[RequestOutput | None]) -> None:
        """The generation completed: keep its answer (written in the background)."""
        if self.key is None or self._stored:
            return
        if not outputs or any(o is None or not o.finished for o in outputs):
            return
        if any(c.finish_reason not in STORED_FINISH for o in outputs for c in o.outputs):
            return
        self._stored = True
        self.cache.spawn(self.cache.keep(self, encode_entry(outputs)))


async def replay(final: RequestOutput) -> AsyncIterator[RequestOutput]:
    content = [
        replace(c, finish_reason=None, stop_reason=None, delta_text=c.text, delta_token_ids=list(c.token_ids),
                delta_logprobs=list(c.logprobs or []))
        for c in final.outputs
    ]  # fmt: skip
    yield replace(final, outputs=content, finished=False)
    yield final


class ResponseCache:
    """The exact store, the semantic index and the counters of ``gemel:response_cache_requests_total``."""

    def __init__(
        self,
        config: ResponseCacheConfig,
        store: MemoryStore | RedisStore | None = None,
        embed: Embed | None = None,
        dims: int = 0,
        redis_url: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        if store is None:
            if config.backend == "redis":
                store = RedisStore(config.redis_url or redis_url, config.ttl_s, config.max_entries)
            else:
                store = MemoryStore(config.ttl_s, config.max_entries, clock)
        self.store = store
        sem = config.semantic
        self.embed = embed
        self.index: SemanticIndex | None = None
        if sem.enabled:
            if embed is None or dims <= 0:
                log.warning("response cache: semantic matching is off: the server has no embedding model")
            else:
                self.index = SemanticIndex(dims, config.ttl_s, config.max_entries, clock)
        self.semantic_names = frozenset(sem.tenants)
        self.counts: dict[tuple[str, str], int] = {(k, r): 0 for k in KINDS for r in RESULTS}
        self._tasks: set[asyncio.Task] = set()

    # -- the request path -------------------------------------------------------------------------
    def semantic_for(self, tenant: str, names: Sequence[str | None]) -> bool:
        """Whether a request of ``tenant`` (calling the routes ``names``, if any) opted in."""
        return self.index is not None and (tenant in self.semantic_names or any(n in self.semantic_names for n in names if n))

    async def lookup(
        self,
        tenant: str,
        model_id: str,
        model_version: str,
        prompts: Sequence[tuple[str | None, list[int]]],
        params,
        semantic_text: str | None = None,
        names: Sequence[str | None] = (),
        no_cache: bool = False,
        no_store: bool = False,
    ) -> Lookup:
        """The cached answer of a request (``prompts``: (text, token ids) each), or how to store
        its own. ``semantic_text`` is what the semantic match embeds (a conversation's messages)."""
        exact_on = self.config.exact
        semantic = self.semantic_for(tenant, names) and len(prompts) == 1
        lookup = Lookup(self)
        if not deterministic(params):
            self._count(exact_on, semantic, "bypass")
            return lookup
        key = exact_key(tenant, model_id, model_version, [ids for _, ids in prompts], params)
        partition = partition_key(tenant, model_id, model_version, params) if semantic else None
        text = semantic_text if semantic_text is not None else prompts[0][0]
        if not no_store:
            lookup.key, lookup.partition, lookup.text = key, partition, text if semantic else None
        if no_cache:
            self._count(exact_on, semantic, "bypass")
            return lookup
        if exact_on:
            outputs = self._decode(await self.store.get(key), prompts)
            self.counts["exact", "hit" if outputs else "miss"] += 1
            if outputs:
                lookup.result, lookup.outputs, lookup.key = "exact", outputs, None
                return lookup
        if semantic:
            vector = await self.embed(text) if text else None
            lookup.vector = vector
            if vector is not None:
                for candidate, _ in self.index.search(partition, vector, self.config.semantic.threshold, text):
                    outputs = self._decode(await self.store.get(candidate), prompts)
                    if outputs:
                        self.counts["semantic", "hit"] += 1
                        lookup.result, lookup.outputs, lookup.key = "semantic", outputs, None
                        return lookup
                    self.index.discard(partition, candidate)
            self.counts["semantic", "miss"] += 1
        return lookup

    def _count(self, exact_on: bool, semantic: bool, result: str) -> None:
        if exact_on:
            self.counts["exact", result] += 1
        if semantic:
            self.counts["semantic", result] += 1

    @staticmethod
    def _decode(entry: dict | None, prompts) -> list[RequestOutput] | None:
        if entry is None:
            return None
        return decode_entry(entry, [uuid.uuid4().hex for _ in prompts], prompts)

    async def keep(self, lookup: Lookup, entry: dict) -> None:
        """Write an answer, and index its prompt for the semantic match."""
        await self.store.put(lookup.key, entry)
        if lookup.partition is None or self.index is None:
            return
        vector = lookup.vector
        if vector is None and lookup.text:
            vector = await self.embed(lookup.text)
        if vector is not None:
            self.index.add(lookup.partition, vector, lookup.key, lookup.text)

    # -- life cycle -------------------------------------------------------------------------------
    def spawn(self, work) -> None:
        """Run ``work`` in the background (a write never delays the answer); failures are logged."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("response cache: storing an answer failed: %s", task.exception())

    async def drain(self) -> None:
        """Wait for the writes in flight (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        await self.drain()
        await self.store.close()


def build(state: Any) -> ResponseCache | None:
    """The response cache of a server's state (``cache.response`` in its config), or None when off."""
    config = state.config.cache.response
    if config is None:
        return None
    embed, dims = (None, 0)
    if config.semantic.enabled:
        from gemel.cache.semantic import server_embedder

        embed, dims = server_embedder(state)
    return ResponseCache(config, embed=embed, dims=dims, redis_url=state.config.gateway.redis_url)
