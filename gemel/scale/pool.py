"""``ReplicaPool``: one model served by N engine replicas on Ray Serve, behind ``AsyncLLM``'s interface.

With ``scale.replicas`` above 1 (or ``scale.min_replicas``/``max_replicas``), ``ServedModel.engine``
is a pool instead of an ``AsyncLLM``, and the pipeline, health checks, metrics, tracing and the
dashboard use it unchanged: ``start``, ``wait_ready``, ``generate``, ``shutdown``, ``tokenizer``,
``max_model_len``, ``state``, ``ready``, ``error``, ``stats``, ``num_in_flight``, ``pid``,
``restarts``, ``observers``, ``last_report``.

The design: each replica (``gemel.scale.replica.EngineReplica``, a Ray Serve deployment) runs a
whole ``AsyncLLM``, its engine process and its ``OutputProcessor``; it streams the same
``RequestOutput``s a local engine gives (detokenised there), each with the engine's stats since
the last one. The front end keeps what needs no engine: tokenisation (its own tokenizer, loaded
without the weights), the replica choice (``gemel.scale.router``, prefix-aware with a load
bound), the observers (fed the replicas' stats, so metrics are the same as with one engine),
and a poll of every replica's state every ``server.stats_interval_s``.

Faults: a replica's engine process that dies is restarted by the replica's own ``AsyncLLM``,
which resubmits its requests (the pool sees a pause). A replica that dies itself (its Ray
worker killed, its node lost) fails its streams with a Ray actor error: the pool resubmits each
of them to another replica with the output it had streamed so far (``AsyncLLM.generate``'s
``resume``), so the continuation is exact, and Ray Serve starts a replacement replica.

Ray: the pool starts a local Ray instance itself (``ray.init(num_cpus=<cores>,
include_dashboard=False)``, shut down with the last pool) unless ``scale.ray_address`` names a
running cluster to join. Ray is imported here, and only when a pool is built. With
``scale.attach`` the pool deploys nothing: it sends to the application someone else deployed on
that cluster from the same settings (KubeRay, through ``gemel.scale.app``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, fields
from typing import Any

from gemel.config import EngineConfig, ScaleConfig
from gemel.engine.async_llm import EngineDeadError, EngineNotReadyError, RequestRejected, load_tokenizer
from gemel.engine.output_processor import RequestOutput
from gemel.engine.protocol import EngineStats, TenantQuota
from gemel.engine.supervisor import RestartPolicy
from gemel.observability.stats import EngineObserver, FinishedRequestStats, IterationStats, notify_observers, tenant_label
from gemel.sampling_params import SamplingParams
from gemel.scale.context import note_replica
from gemel.scale.router import POOLS, PrefixRouter, RouteHint

log = logging.getLogger("gemel.scale")

MAX_RESUBMITS = 3  # replicas lost by one request before it fails
SNAPSHOT_TIMEOUT_S = 10.0
ORPHAN_TTL_S = 60.0  # how long an aborted request's observer handles wait for its replica's report


class _ReplicaLost(RuntimeError):
    """A replica's stream ended without the request's end."""


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def replica_resources(scale: ScaleConfig, engine: EngineConfig, node_cores: int) -> tuple[int, float]:
    """(engine threads, Ray CPUs) of each replica: the node's cores shared by the most replicas
    that may run at once, unless configured."""
    most = scale.max_replicas or scale.replicas
    threads = engine.num_threads or scale.engine_threads or max(1, node_cores // most)
    num_cpus = scale.num_cpus if scale.num_cpus is not None else (node_cores / most if not scale.ray_address else float(threads))
    return threads, round(num_cpus, 3)


# -- the Ray runtime, shared by the pools of one process ---------------------------------------------
_ray_lock = threading.Lock()
_ray_users = 0
_ray_started_here = False


def import_ray() -> None:
    """Import Ray, without its C++ crash handler: it would take the SIGTERM on which the server drains
    (read once, when Ray is first imported)."""
    if "ray" not in sys.modules:
        os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    import ray  # noqa: F401


def acquire_ray(scale: ScaleConfig) -> None:
    """Connect to ``scale.ray_address``, or start a local Ray instance, and start Ray Serve
    without its HTTP proxy (gemel's front end is the entry point)."""
    global _ray_users, _ray_started_here
    import_ray()
    import ray
    from ray import serve

    with _ray_lock:
        if not ray.is_initialized():
            if scale.ray_address:
                ray.init(address=scale.ray_address, logging_level=logging.WARNING)
                log.info("joined the Ray cluster at %s (%s CPUs)", scale.ray_address, ray.cluster_resources().get("CPU"))
            else:
                ray.init(num_cpus=cores(), include_dashboard=False, logging_level=logging.WARNING)
                _ray_started_here = True
                log.info("started a local Ray instance with %d CPUs", cores())
            serve.start(proxy_location="Disabled")
        _ray_users += 1


def release_ray() -> None:
    """The last pool of the process stops Ray Serve and the local Ray instance it started (on a
    cluster it only disconnects; its applications are deleted by their pools)."""
    global _ray_users, _ray_started_here
    import ray
    from ray import serve

    with _ray_lock:
        _ray_users -= 1
        if _ray_users > 0 or not ray.is_initialized():
            return
        if _ray_started_here:
            serve.shutdown()
            _ray_started_here = False
        ray.shutdown()


def _app_name(model_id: str) -> str:
    return "gemel-" + re.sub(r"[^A-Za-z0-9_-]+", "-", model_id)


def sum_stats(stats: list[EngineStats]) -> EngineStats:
    """The stats of several engines as one: counters and queues add up, the KV usage is that of
    all their blocks together, the step time is the slowest."""
    total = EngineStats()
    if not stats:
        return total
    per_pos: list[int] = []
    for s in stats:
        for f in fields(EngineStats):
            v = getattr(s, f.name)
            if isinstance(v, int) and not isinstance(v, bool):
                setattr(total, f.name, getattr(total, f.name) + v)
        for i, n in enumerate(s.spec_accepted_per_position):
            if i < len(per_pos):
                per_pos[i] += n
            else:
                per_pos.append(n)
    total.spec_accepted_per_position = per_pos
    total.kv_cache_usage = 1.0 - total.num_free_blocks / total.num_blocks if total.num_blocks else 0.0
    total.step_time_s = max(s.step_time_s for s in stats)
    return total


class ReplicaPool:
    """One model on N engine replicas (see the module's docstring)."""

    def __init__(
        self,
        model_id: str,
        config: EngineConfig,
        scale: ScaleConfig,
        stats_interval_s: float = 0.5,
        log_level: str = "info",
        restart: RestartPolicy | None = None,
        ready_timeout_s: float = 600.0,
    ):
        self.model_id = model_id
        self.scale = scale
        self.threads, self.num_cpus = replica_resources(scale, config, cores())
        self.config = config.model_copy(update={"num_threads": self.threads})
        self.stats_interval_s = stats_interval_s
        self.log_level = log_level
        self.restart_policy = restart or RestartPolicy()
        self.ready_timeout_s = ready_timeout_s
        self.app_name = _app_name(model_id)
        self.tokenizer = None
        self.max_model_len = config.max_model_len or 0
        self.info = None
        self.state = "created"
        self.error: str | None = None
        self.stats = EngineStats()
        self.last_report = 0.0
        self.observers: list[EngineObserver] = []
        self.router = PrefixRouter(
            config.block_size, scale.routing, max_entries=scale.prefix_map_entries,
            margin_requests=scale.load_margin_requests, margin_ratio=scale.load_margin_ratio,
        )  # fmt: skip
        self.replicas: dict[str, dict] = {}  # the latest snapshot of each live replica
        self._restarts_by_replica: dict[str, dict[str, int]] = {}  # kept after a replica is gone
        self._replicas_lost: set[str] = set()  # replicas whose worker died with requests on it
        self._active: set[str] = set()
        self._handles: dict[str, list] = {}  # request id -> what each observer's begin_request gave
        self._orphans: dict[str, float] = {}  # aborted request id -> when (its replica reports it later)
        self._tasks: list[asyncio.Task] = []
        self._ready = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle = None  # Ray Serve's DeploymentHandle (unary calls)
        self._stream = None  # the same, streaming
        self._deployed = False
        self._deploying: asyncio.Future | None = None  # the deployment's worker thread
        self._ray_held = False
        self._lost_errors: tuple[type[BaseException], ...] = (_ReplicaLost,)

    # -- life cycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Load the tokenizer, then deploy the replicas in the background (Ray's start and the
        replicas' model loads take a while; until one replica is ready the pool is starting)."""
        self._loop = asyncio.get_running_loop()
        self.state = "starting"
        POOLS[self.app_name] = self
        self.tokenizer, model_len = await asyncio.to_thread(load_tokenizer, self.config.model)
        self.max_model_len = min(self.config.max_model_len or model_len, model_len)
        self._tasks.append(asyncio.ensure_future(self._deploy()))

    def _describe_scale(self) -> str:
        s = self.scale
        if s.attach:
            return f"attaching to the Ray Serve application {self.app_name} on {s.ray_address}, routing {s.routing}"
        if s.autoscaling:
            count = f"{s.min_replicas}..{s.max_replicas} replicas (autoscaling on ongoing requests, target {s.target_ongoing_requests:g})"
        else:
            count = f"{s.replicas} replicas"
        return f"{count}, each {self.num_cpus:g} Ray CPUs and {self.threads} engine threads, routing {s.routing}"

    async def _deploy(self) -> None:
        log.info("model %s: starting %s", self.model_id, self._describe_scale())
        self._deploying = asyncio.get_running_loop().run_in_executor(None, self._run_deployment)
        try:
            await asyncio.shield(self._deploying)  # a shutdown meanwhile waits for it, then stops Ray
        except Exception as e:
            if self.state == "stopped":
                return
            log.exception("model %s: the replicas could not be deployed", self.model_id)
            self.state, self.error = "failed", f"{type(e).__name__}: {e}"
            self._ready.set()
            return
        self._deployed = True
        self._tasks.append(asyncio.ensure_future(self._poll_loop()))

    def _run_deployment(self) -> None:
        """Blocking (a worker thread): Ray, then the application, until its replicas are up (or,
        attaching, until the application exists)."""
        import_ray()
        import ray.exceptions
        from ray import serve

        if self.state == "stopped":  # shut down before Ray started
            return
        acquire_ray(self.scale)
        self._ray_held = True
        lost = [ray.exceptions.RayActorError]
        if hasattr(ray.exceptions, "ActorUnavailableError"):
            lost.append(ray.exceptions.ActorUnavailableError)
        self._lost_errors = (_ReplicaLost, *lost)
        if self.scale.attach:
            handle = self._attach()
        else:
            handle = serve.run(self.application(), name=self.app_name, route_prefix=None)
        self._handle = handle
        self._stream = handle.options(stream=True)

    def _attach(self):
        """The handle of the application deployed by someone else, once it exists (KubeRay deploys
        it when its cluster is up, which may be after this front end starts, and an application
        being built has no handle yet)."""
        from ray import serve
        from ray.serve.exceptions import RayServeException

        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            try:
                handle = serve.get_app_handle(self.app_name)
                break
            except RayServeException:
                if self.state == "stopped":
                    raise RuntimeError("stopped while waiting for the application") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no Ray Serve application {self.app_name} on {self.scale.ray_address} after "
                                       f"{self.ready_timeout_s:g}s (scale.attach: something else deploys it)") from None  # fmt: skip
                time.sleep(1.0)
        log.info("model %s: attached to the Ray Serve application %s", self.model_id, self.app_name)
        return handle

    def application(self):
        """The Ray Serve application of this model's replicas: what ``gemel serve`` deploys, and
        what ``gemel.scale.app.build`` gives a RayService to deploy from the same settings."""
        from ray import serve
        from ray.serve.config import RequestRouterConfig

        from gemel.scale.replica import EngineReplica

        s = self.scale
        options: dict[str, Any] = dict(
            name="engine",
            max_ongoing_requests=s.max_ongoing_requests,
            ray_actor_options={"num_cpus": self.num_cpus},
            request_router_config=RequestRouterConfig(
                request_router_class="gemel.scale.replica.ReplicaRequestRouter", request_router_kwargs={"pool": self.app_name}
            ),
            health_check_period_s=5.0,
            health_check_timeout_s=30.0,
            graceful_shutdown_timeout_s=s.graceful_shutdown_s,
            logging_config={"enable_access_log": False, "log_level": "WARNING"},
        )
        if s.autoscaling:
            options["autoscaling_config"] = {
                "min_replicas": s.min_replicas,
                "max_replicas": s.max_replicas,
                "target_ongoing_requests": s.target_ongoing_requests,
                "upscale_delay_s": s.upscale_delay_s,
                "downscale_delay_s": s.downscale_delay_s,
            }
        else:
            options["num_replicas"] = s.replicas
        restart = asdict(self.restart_policy)
        return serve.deployment(EngineReplica, **options).bind(
            self.config.model_dump(), self.stats_interval_s, self.log_level, restart, self.ready_timeout_s
        )

    async def shutdown(self, timeout: float = 5.0) -> None:
        for task in self._tasks:
            task.cancel()
        self.state = "stopped"
        self._ready.set()
        POOLS.pop(self.app_name, None)
        if self._deploying is not None and not self._deploying.done():  # Ray may be starting: let it, then stop it
            try:
                await asyncio.wait_for(asyncio.shield(self._deploying), 120)
            except BaseException:
                pass
        if self._ray_held:
            self._ray_held = False
            await asyncio.to_thread(self._teardown)

    def _teardown(self) -> None:
        from ray import serve

        try:
            if self.scale.ray_address and self._deployed and not self.scale.attach:  # an attached one is not ours
                serve.delete(self.app_name)
        finally:
            release_ray()

    # -- readiness ----------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        """The engine process of the first replica (``replica_info`` lists them all)."""
        for rid in sorted(self.replicas):
            return self.replicas[rid].get("engine_pid")
        return None

    @property
    def num_in_flight(self) -> int:
        return len(self._active)

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def restarts(self) -> dict[str, int]:
        """Engine restarts inside the replicas, by reason, and replicas lost (``replica``)."""
        out: dict[str, int] = {}
        for counts in self._restarts_by_replica.values():
            for reason, n in counts.items():
                out[reason] = out.get(reason, 0) + n
        if self._replicas_lost:
            out["replica"] = len(self._replicas_lost)
        return out

    async def wait_ready(self, timeout: float) -> None:
        """Until a replica is ready: while Ray and the replicas start, and while none is running."""
        if self.state == "ready":
            return
        if self.state in ("starting", "created", "restarting"):
            try:
                await asyncio.wait_for(self._wait_ready(), timeout)
            except TimeoutError:
                raise EngineNotReadyError(self._not_ready_message()) from None
        self.check_alive()

    async def _wait_ready(self) -> None:
        while self.state in ("starting", "created", "restarting"):
            self._ready.clear()
            await self._ready.wait()

    def _not_ready_message(self) -> str:
        if self.state == "restarting":
            return f"no replica of the model is ready ({self.error}); retry shortly"
        return "the model is still loading; retry shortly"

    def check_alive(self) -> None:
        if self.state == "ready":
            return
        if self.state in ("starting", "created", "restarting"):
            raise EngineNotReadyError(self._not_ready_message())
        raise EngineDeadError(f"the engine is unavailable ({self.error or self.state})")

    # -- the replicas' state --------------------------------------------------------------------
    def on_replicas(self, replica_ids: list[str]) -> None:
        """Ray Serve's replica set changed (called on its router's thread)."""
        added, removed = self.router.set_replicas(replica_ids)
        if (added or removed) and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._replicas_changed, added, removed, len(self.router.replicas))
            except RuntimeError:  # the loop is closed: shutting down
                pass

    def _replicas_changed(self, added: list[str], removed: list[str], count: int) -> None:
        for rid in removed:
            self.replicas.pop(rid, None)
        log.info(
            "model %s: %d replica%s running%s%s", self.model_id, count, "" if count == 1 else "s",
            f", started {', '.join(added)}" if added else "", f", gone {', '.join(removed)}" if removed else "",
        )  # fmt: skip
        self._aggregate()

    async def _poll_loop(self) -> None:
        while True:
            try:
                await self._poll()
            except Exception:
                log.exception("model %s: polling the replicas failed", self.model_id)
            await asyncio.sleep(self.stats_interval_s)

    async def _poll(self) -> None:
        ids = list(self.router.replicas)
        targets = ids or [None]  # none known yet: any replica answers (and Ray Serve's router starts)
        results = await asyncio.gather(*(self._snapshot(rid) for rid in targets), return_exceptions=True)
        for snap in results:
            if isinstance(snap, dict):
                self._on_snapshot(snap)
        now = time.monotonic()
        for rid, since in list(self._orphans.items()):
            if now - since > ORPHAN_TTL_S:
                self._orphans.pop(rid, None)
                self._handles.pop(rid, None)
        self._aggregate()

    async def _snapshot(self, replica_id: str | None) -> dict:
        response = self._handle.snapshot.remote(route=RouteHint(target=replica_id) if replica_id else None)
        try:
            return await asyncio.wait_for(asyncio.ensure_future(response), SNAPSHOT_TIMEOUT_S)
        except BaseException:
            response.cancel()
            raise

    def _on_snapshot(self, snap: dict) -> None:
        rid = snap["replica"]
        if self.router.replicas and rid not in self.router.replicas:
            return
        self.replicas[rid] = snap
        self._restarts_by_replica[rid] = snap["restarts"]
        if snap["max_model_len"]:
            self.max_model_len = snap["max_model_len"]
        self.last_report = time.monotonic()
        self._dispatch(snap["iterations"])

    def _aggregate(self) -> None:
        """The pool's state and stats from its replicas' latest snapshots."""
        if self.state in ("stopped", "failed"):
            return
        live = self.router.replicas or list(self.replicas)  # before Ray Serve's router has told the set
        snaps = [s for rid, s in self.replicas.items() if rid in live]
        self.stats = sum_stats([s["stats"] for s in snaps])
        states = [s["state"] for s in snaps]
        if "ready" in states:
            self.state, self.error = "ready", None
            self._ready.set()
        elif self._deployed:
            errors = [s["error"] for s in snaps if s["error"]]
            self.state = "restarting"
            self.error = errors[0] if errors else "no replica is running; Ray Serve is starting one"

    def replica_info(self) -> list[dict]:
        """Each live replica: its ids and processes, load and engine stats (/internal/stats)."""
        ongoing = self.router.ongoing()
        out = []
        for rid in self.router.replicas:
            snap = self.replicas.get(rid, {})
            s = snap.get("stats") or EngineStats()
            out.append({
                "replica": rid, "state": snap.get("state", "unknown"), "error": snap.get("error"),
                "worker_pid": snap.get("pid"), "engine_pid": snap.get("engine_pid"),
                "engine_threads": snap.get("threads"), "ongoing_requests": ongoing.get(rid, 0),
                "num_running": s.num_running, "num_waiting": s.num_waiting, "kv_cache_usage": s.kv_cache_usage,
                "prefix_cache_queries": s.prefix_cache_queries, "prefix_cache_hits": s.prefix_cache_hits,
                "restarts": snap.get("restarts", {}),
            })  # fmt: skip
        return out

    def describe(self) -> dict:
        """The pool's settings and routing decisions so far."""
        return {
            "replicas": len(self.router.replicas),
            "ray_cpus_per_replica": self.num_cpus,
            "engine_threads_per_replica": self.threads,
            "autoscaling": self.scale.autoscaling,
            "router": self.router.describe(),
        }

    # -- observers --------------------------------------------------------------------------------
    def _begin_observers(self, request_id: str, tenant: str, params: SamplingParams) -> list:
        handles = []
        for obs in self.observers:
            try:
                handles.append(obs.begin_request(request_id, tenant, params))
            except Exception:  # observability must never fail a request
                log.exception("observer %r failed at request start", obs)
                handles.append(None)
        return handles

    def _dispatch(self, iterations: list[IterationStats]) -> None:
        """A replica's engine stats to the front end's observers, each finished request with the
        handles its observers gave at its start."""
        for it in iterations:
            for fs in it.finished:
                fs.observer_handles = self._handles.pop(fs.request_id, [])
                self._orphans.pop(fs.request_id, None)
            notify_observers(self.observers, it)

    # -- requests -------------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        tenant: str = "",
        deadline: float | None = None,
        quota: TenantQuota | None = None,
        resume: RequestOutput | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """``AsyncLLM.generate`` over the replicas: the router picks one; a replica lost mid-way
        hands the request, with what it streamed so far, to another."""
        if self.state != "restarting":
            self.check_alive()
        if not prompt_ids:
            raise RequestRejected("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestRejected(
                f"the prompt has {len(prompt_ids)} tokens; this model's context is {self.max_model_len} tokens"
            )
        if request_id in self._active:
            raise RequestRejected(f"request id {request_id!r} is already running")
        self._active.add(request_id)
        self._handles[request_id] = self._begin_observers(request_id, tenant_label(tenant), params)
        arrival = time.monotonic()
        hashes = self.router.prefix_hashes(prompt_ids, tenant)
        last = resume
        exclude: set[str] = set()
        lost = 0
        finished = failed = False
        try:
            while True:
                hint = RouteHint(request_id=request_id, hashes=hashes, exclude=frozenset(exclude))
                stream = self._stream.generate.remote(request_id, prompt, prompt_ids, params, tenant, quota, resume=last, route=hint)
                replica = None
                try:
                    async for item in _items(stream, deadline):
                        if item[0] == "replica":
                            replica = item[1]
                            self.router.assign(request_id, replica)
                            note_replica(replica)
                        elif item[0] == "error":
                            if isinstance(item[1], (EngineDeadError, EngineNotReadyError)):
                                raise _ReplicaLost(str(item[1]))  # another replica may serve
                            raise item[1]
                        else:
                            self._dispatch(item[2])
                            last = item[1]
                            yield last
                            if last.finished:
                                finished = True
                                return
                    raise _ReplicaLost("the replica's stream ended before the request did")
                except self._lost_errors as e:
                    lost += 1
                    if replica is not None:
                        exclude.add(replica)
                        if not isinstance(e, _ReplicaLost):
                            self._replicas_lost.add(replica)
                    made = sum(len(o.token_ids) for o in last.outputs) if last is not None else 0
                    if lost > MAX_RESUBMITS:
                        failed = True
                        raise EngineDeadError(f"the model's replicas failed this request {lost} times ({e})") from None
                    log.warning(
                        "model %s: replica %s lost request %s after %d tokens (%s); resubmitting it to another replica",
                        self.model_id, replica or "?", request_id, made, str(e).splitlines()[0] if str(e) else type(e).__name__,
                    )  # fmt: skip
                finally:
                    if not finished:
                        stream.cancel()  # a request abandoned here is aborted in its replica's engine
        finally:
            self._active.discard(request_id)
            self.router.release(request_id)
            if failed:
                self._fail_stats(request_id, tenant, prompt_ids, params, arrival, last)
            elif not finished and request_id in self._handles:
                self._orphans[request_id] = time.monotonic()  # its replica reports the abort

    def _fail_stats(self, request_id, tenant, prompt_ids, params, arrival, last) -> None:
        """A request no replica could finish: the observers hear of it from here."""
        now = time.monotonic()
        made = sum(len(o.token_ids) for o in last.outputs) if last is not None else 0
        fs = FinishedRequestStats(request_id, tenant_label(tenant), "error", arrival, now, len(prompt_ids), made, params=params)
        self._dispatch([IterationStats(now, finished=[fs])])


async def _items(stream, deadline: float | None) -> AsyncIterator[tuple]:
    """A replica's stream, each item awaited until ``deadline`` (monotonic, as the loop's clock)."""
    while True:
        try:
            if deadline is None:
                item = await stream.__anext__()
            else:
                async with asyncio.timeout_at(deadline):
                    item = await stream.__anext__()
        except StopAsyncIteration:
            return
        yield item
