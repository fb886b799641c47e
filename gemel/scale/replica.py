"""The Ray Serve side: a replica hosting one engine, and the request router that places calls.

``EngineReplica`` is the deployment class: each replica is a Ray actor that runs an
``AsyncLLM``, which spawns the engine process and restarts it when it dies (resubmitting its
requests), exactly as in a single-engine ``gemel serve``. The replica's constructor returns
once the model is loaded, so Ray Serve sends a new (e.g. autoscaled) replica no request
before it can serve. ``generate`` streams, in order: ``("replica", id)``, then for each output
``("output", RequestOutput, [IterationStats])``, or one ``("error", exception)`` when the
engine refuses or fails the request. The stats are what the replica's engine told its front
end since the last item (token counts, TTFT, finished requests), so gemel's metrics, traces and
dashboard in the front-end process see every replica as they see a local engine.

``ReplicaRequestRouter`` runs in the front-end process (Ray Serve builds it where the handle
is used): it asks the model's ``PrefixRouter`` (``gemel.scale.router``) for each request's
replica, sends a call with a ``target`` to that replica alone (the pool's stats polls), and
tells the pool the replica set whenever it changes (autoscaling, a replica replaced).
"""

from __future__ import annotations

import logging
import os

from ray import serve
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from gemel.config import EngineConfig
from gemel.engine.async_llm import AsyncLLM, EngineDeadError, EngineNotReadyError, RequestRejected
from gemel.engine.supervisor import RestartPolicy
from gemel.observability.stats import EngineObserver, IterationStats

log = logging.getLogger("gemel.scale.replica")


class Recorder(EngineObserver):
    """Keeps the replica engine's stats until the front end takes them."""

    def __init__(self) -> None:
        self.pending: list[IterationStats] = []

    def on_iteration(self, stats: IterationStats) -> None:
        if not stats.empty:
            for fs in stats.finished:
                fs.observer_handles = []  # the front end's own handles replace them there
            self.pending.append(stats)

    def drain(self) -> list[IterationStats]:
        out, self.pending = self.pending, []
        return out


class EngineReplica:
    """One replica: an ``AsyncLLM`` and its engine process."""

    async def __init__(self, engine_config: dict, stats_interval_s: float, log_level: str, restart: dict, ready_timeout_s: float):
        logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.config = EngineConfig(**engine_config)
        self.recorder = Recorder()
        self.engine = AsyncLLM(self.config, stats_interval_s=stats_interval_s, log_level=log_level, restart=RestartPolicy(**restart))
        self.engine.observers.append(self.recorder)
        await self.engine.start()
        await self.engine.wait_ready(ready_timeout_s)  # raises when the model cannot load: Ray Serve retries
        log.info(
            "replica %s ready (worker pid %d, engine pid %s, %s engine threads)",
            self.replica_id, os.getpid(), self.engine.pid, self.config.num_threads or "adaptive",
        )

    async def generate(self, request_id, prompt, prompt_ids, params, tenant="", quota=None, resume=None, route=None):
        """Stream one request (see the module's docstring for the items)."""
        yield ("replica", self.replica_id)
        try:
            async for out in self.engine.generate(request_id, prompt, prompt_ids, params, tenant, None, quota, resume=resume):
                yield ("output", out, self.recorder.drain())
        except (EngineDeadError, EngineNotReadyError, RequestRejected) as e:
            yield ("error", e)

    async def snapshot(self, route=None) -> dict:
        """This replica's state for the pool: its engine's stats and the stats not yet taken."""
        e = self.engine
        return {
            "replica": self.replica_id,
            "pid": os.getpid(),
            "engine_pid": e.pid,
            "state": e.state,
            "error": e.error,
            "stats": e.stats,
            "restarts": dict(e.restarts),
            "in_flight": e.num_in_flight,
            "max_model_len": e.max_model_len,
            "threads": self.config.num_threads,
            "iterations": self.recorder.drain(),
        }

    async def check_health(self) -> None:
        """Ray Serve replaces a replica whose engine is past its restart budget."""
        if self.engine.state in ("failed", "dead", "stopped"):
            raise RuntimeError(f"engine {self.engine.state}: {self.engine.error}")

    async def __del__(self) -> None:
        await self.engine.shutdown()


class ReplicaRequestRouter(RequestRouter):
    """Ray Serve's request router for gemel's replicas (see the module's docstring)."""

    def initialize_state(self, pool: str = "", **kwargs) -> None:
        self.pool_name = pool

    def _pool(self):
        from gemel.scale import router  # the module itself, not a pickled copy's globals

        return router.POOLS.get(self.pool_name)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        pool = self._pool()
        if pool is not None:
            pool.on_replicas([r.replica_id.unique_id for r in replicas])

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        pool = self._pool()
        if pool is not None:
            pool.on_replicas([r.replica_id.unique_id for r in self.curr_replicas.values()])

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        hint = pending_request.kwargs.get("route") if pending_request is not None else None
        pool = self._pool()
        if hint is None or pool is None:
            return [candidate_replicas]
        # Never an empty ranking: Ray Serve asks again at once, without yielding its loop.
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if hint.target is not None:  # gone: any replica answers, and the pool sees whose answer it is
            return [[by_id[hint.target]]] if hint.target in by_id else [candidate_replicas]
        choice = pool.router.choose(hint.hashes, list(by_id), hint.exclude, hint.request_id)
        if choice is None:
            return [candidate_replicas]
        rest = [r for rid, r in by_id.items() if rid != choice.replica]
        return [[by_id[choice.replica]], rest] if rest else [[by_id[choice.replica]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        hint = pending_request.kwargs.get("route")
        pool = self._pool()
        if hint is not None and hint.request_id and pool is not None:
            pool.router.assign(hint.request_id, replica_id.unique_id)
