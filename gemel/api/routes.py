"""Routes applied to requests: which model serves a routed name, the fallback, the canary's record.

``gemel.gateway.routes`` keeps the routes (weights, stickiness, SLO windows); this module
joins them to the engines. ``decide`` runs where the request path resolves a model name
(``pipeline.route_or_resolve``): for a route's name it picks the target, and sends the
request to the route's fallback model instead when the target cannot serve in time:

* its engine is not ready: loading (``engine_not_ready``), restarting after a crash
  (``engine_restarting``), dead or failed (``engine_down``);
* its priority class queue is full, so the gateway would refuse it with 503 (``queue_full``);
  the fallback is then admitted past that bound, as it does not wait on the saturated
  target, but only while the fallback's own backlog is under the class's limit;
* the TTFT predicted from its queue is over the route's ``slo.ttft_p99_ms``
  (``predicted_ttft``; see ``gemel.gateway.routes.predicted_ttft_s``).

The fallback is used only when it can serve itself (its engine ready; for a predicted TTFT,
its own prediction within the SLO). A name that is a model id or alias is never routed.
``RouteDecision.observe`` wraps the engine streams so the route learns each request's time
to first output and whether it failed, for the canary's SLO window.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gemel.api.errors import APIError
from gemel.engine.async_llm import EngineDeadError, EngineNotReadyError
from gemel.gateway.routes import PrefillClock, Route, RouteTable, Target, predicted_ttft_s
from gemel.observability.stats import EngineObserver, IterationStats

if TYPE_CHECKING:
    from gemel.api.state import ServedModel, ServerState
    from gemel.config import RouteConfig
    from gemel.engine.output_processor import RequestOutput
    from gemel.gateway.principal import Principal

USER_HEADER = "x-gemel-user"  # the caller's user id for ``sticky: user`` (besides OpenAI's ``user`` field)
FALLBACK_HEADER = "x-gemel-fallback"  # names the fallback model that answered

# Engine states a request cannot be served in, and the fallback reason each gives.
_UNAVAILABLE = {
    "created": "engine_not_ready",
    "starting": "engine_not_ready",
    "restarting": "engine_restarting",
    "dead": "engine_down",
    "failed": "engine_down",
    "stopped": "engine_down",
}
# Reasons that say the target crashed: they count as errors in a canary's SLO window.
_CRASHED = ("engine_restarting", "engine_down")


class PrefillObserver(EngineObserver):
    """Feeds a model's ``PrefillClock`` from its finished requests."""

    def __init__(self, clock: PrefillClock):
        self.clock = clock

    def on_iteration(self, it: IterationStats) -> None:
        for fs in it.finished:
            prefill = fs.prefill_time_s
            if prefill is not None and fs.finish_reason != "abort":
                self.clock.add(prefill)


class Routing:
    """The server's routes and what they need to know of its models."""

    def __init__(self, configs: list[RouteConfig], models: list[ServedModel]):
        self.table = RouteTable(configs)
        self.models = {m.id: m for m in models}
        self.prefill: dict[str, PrefillClock] = {}
        if self.table:
            for m in models:
                if m.engine is not None:
                    clock = self.prefill[m.id] = PrefillClock()
                    m.engine.observers.append(PrefillObserver(clock))

    def get(self, name: str) -> Route | None:
        return self.table.get(name.removeprefix("models/"))

    def primary(self, name: str) -> str | None:
        """The model id a route's name stands for where nothing is generated (token counts, model
        lookups): its target with the most weight; None when ``name`` is not a route."""
        route = self.get(name)
        if route is None:
            return None
        return max(route.targets, key=lambda t: t.weight).model

    # -- the decision --------------------------------------------------------------------------
    def unavailable(self, model: ServedModel) -> str | None:
        if model.failure is not None or model.engine is None:
            return "engine_down"
        return _UNAVAILABLE.get(model.engine.state)

    def predicted_ttft_s(self, model: ServedModel) -> float | None:
        """Requests ahead of a new one (the engine's waiting count, or the front end's requests
        not yet running when that is higher: they may not have reached the engine's stats yet)
        times the model's recent prefill time."""
        engine = model.engine
        if engine is None:
            return None
        stats = engine.stats
        waiting = max(stats.num_waiting, engine.num_in_flight - stats.num_running)
        clock = self.prefill.get(model.id)
        return predicted_ttft_s(waiting, clock.seconds if clock else None)

    def backlog(self, model: ServedModel) -> int:
        engine = model.engine
        if engine is None:
            return 0
        return max(engine.stats.num_waiting, engine.num_in_flight - engine.stats.num_running)

    def decide(self, name: str, principal: Principal | None, user: str | None) -> RouteDecision | None:
        """The model that serves a request for ``name``; None when ``name`` is not a route."""
        route = self.get(name)
        if route is None:
            return None
        key = None
        if route.sticky == "tenant" and principal is not None:
            key = principal.tenant
        elif route.sticky == "user":
            key = user or None
        target = route.pick(key)
        fallback = self.models.get(route.fallback) if route.fallback else None
        if target is None:
            if fallback is None:
                raise APIError(503, f"route {route.name} has no target with weight and no fallback", retry_after_s=None)
            route.fell_back("no_target")
            return RouteDecision(route, None, fallback, "no_target")
        model = self.models[target.model]
        reason = self._fallback_reason(route, model, fallback, principal)
        if reason is None:
            route.chosen(target)
            return RouteDecision(route, target, model, None)
        route.fell_back(reason)
        if reason in _CRASHED:
            route.record(target, None, error=True)
        return RouteDecision(route, target, fallback, reason)

    def _fallback_reason(
        self, route: Route, model: ServedModel, fallback: ServedModel | None, principal: Principal | None
    ) -> str | None:
        """Why ``model`` should not serve this request and ``fallback`` should, or None."""
        if fallback is None or fallback is model or self.unavailable(fallback) is not None:
            return None
        reason = self.unavailable(model)
        if reason is not None:
            return reason
        admission = principal.admission if principal is not None else None
        if admission is not None:
            gateway, cls = admission.gateway, principal.priority_class
            limit = gateway.queue_limits.get(cls, 0)
            if limit > 0 and gateway.queued.get(cls, 0) >= limit and self.backlog(fallback) < limit:
                return "queue_full"
        slo_ms = route.slo.ttft_p99_ms if route.slo is not None else None
        if slo_ms is not None:
            predicted = self.predicted_ttft_s(model)
            if predicted is not None and predicted * 1000 > slo_ms:
                theirs = self.predicted_ttft_s(fallback)
                if theirs is None or theirs * 1000 <= slo_ms:
                    return "predicted_ttft"
        return None

    def snapshot(self) -> list[dict]:
        routes = self.table.snapshot()
        for r in routes:
            for t in r["targets"]:
                m = self.models.get(t["model"])
                t["engine"] = (m.engine.state if m.engine is not None else "none") if m is not None else "unknown"
                clock = self.prefill.get(t["model"])
                t["prefill_ms"] = round(clock.seconds * 1000, 2) if clock is not None and clock.seconds is not None else None
        return routes


def _is_error(exc: BaseException) -> bool:
    """Whether a request's failure counts against a canary: the server's errors (5xx, the
    engine gone or not ready), not the client's (4xx) nor a deadline it set."""
    if isinstance(exc, (EngineDeadError, EngineNotReadyError)):
        return True
    if isinstance(exc, (TimeoutError, asyncio.CancelledError)):
        return False
    status = getattr(exc, "status", None)
    if isinstance(exc, APIError) or hasattr(exc, "to_api_error"):
        return isinstance(status, int) and status >= 500 and status != 504
    return not isinstance(exc, ValueError)  # RequestRejected and other refusals of the request are 400s


@dataclass
class RouteDecision:
    """Where one routed request goes: its route, the target chosen, the model that serves it
    (the fallback when ``fallback_reason`` says why), and its record for the canary's window."""

    route: Route
    target: Target | None
    model: ServedModel
    fallback_reason: str | None = None
    started: float = field(default_factory=time.monotonic)
    _pending: int = 0
    _ttft_s: float | None = None
    _timed_out_s: float | None = None
    _recorded: bool = False

    @property
    def fallback(self) -> ServedModel | None:
        """The fallback model answering instead of the chosen target, or None."""
        return self.model if self.fallback_reason is not None else None

    @property
    def overflow(self) -> bool:
        """Admitted past a full class queue (a queue-full fallback)."""
        return self.fallback_reason == "queue_full"

    def observe(self, streams: list[AsyncIterator[RequestOutput]]) -> list[AsyncIterator[RequestOutput]]:
        """The engine streams of the request, each passing its timing and failure to the route.
        Only the chosen target's own answers are recorded (not a fallback's)."""
        if self.fallback_reason is not None or self.target is None:
            return streams
        self._pending = len(streams)
        return [self._watch(s) for s in streams]

    async def _watch(self, stream: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        error = False
        try:
            async for out in stream:
                if self._ttft_s is None:
                    self._ttft_s = time.monotonic() - self.started
                yield out
        except Exception as e:
            if isinstance(e, TimeoutError):
                if self._ttft_s is None:
                    self._timed_out_s = time.monotonic() - self.started  # no output by the deadline: at least this long
            elif _is_error(e):
                error = True
            else:
                self._recorded = True  # the request's own fault (a 400): says nothing of the target
            raise
        finally:
            self._pending -= 1
            if error:
                self._record(True)
            elif self._pending <= 0:
                self._record(False)
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    def _record(self, error: bool) -> None:
        if self._recorded or self.target is None:
            return
        ttft = self._ttft_s if self._ttft_s is not None else self._timed_out_s
        if ttft is None and not error:
            return  # the client left before any output: nothing learnt
        self._recorded = True
        self.route.record(self.target, ttft, error)


def principal_of(scope_state: dict) -> Principal | None:
    """The principal the gateway middleware left in a request's scope state."""
    from gemel.gateway.principal import Principal

    principal = scope_state.get("principal")
    return principal if isinstance(principal, Principal) else None


def routing_of(state: ServerState) -> Routing | None:
    routing = getattr(state, "routes", None)
    return routing if isinstance(routing, Routing) else None
