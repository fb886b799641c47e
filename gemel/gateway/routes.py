"""Routes: a public model name over weighted catalogue models, a canary judged by its SLO.

A route (``routes`` in gemel.yaml, ``gemel.config.RouteConfig``) maps the name clients call
onto targets with weights. Each request picks one target:

* ``sticky: none``: at random, in proportion to the weights;
* ``sticky: tenant`` / ``user``: by weighted rendezvous hashing of the key (the tenant, or the
  caller's user id) with each target, so a key stays on its target while the weights stay
  the same, and a weight change moves only the keys it must (a canary set to 0 sends its own
  keys elsewhere and nobody else's). A request without a key is placed at random.

A canary target is judged over its last ``slo.window`` requests (time to the first output,
p99; share of server errors). Once the window is full and either bound is broken, its
weight drops to 0 at once and it stays out until an operator gives it weight again. All of
it runs on the server's event loop; nothing here knows HTTP or the engines (``gemel.api.routes``
applies it to requests).
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gemel.config import RouteConfig, RouteSLO

log = logging.getLogger("gemel.routes")

# Why a request went to the route's fallback (the ``reason`` label of gemel:fallback_requests_total).
FALLBACK_REASONS = ("engine_not_ready", "engine_restarting", "engine_down", "queue_full", "predicted_ttft", "no_target")


def weighted_pick(weights: Sequence[float], rng: random.Random | None = None) -> int | None:
    """An index drawn in proportion to ``weights``; None when none is above 0."""
    total = sum(w for w in weights if w > 0)
    if total <= 0:
        return None
    x = (rng or random).random() * total
    last = None
    for i, w in enumerate(weights):
        if w <= 0:
            continue
        last = i
        x -= w
        if x < 0:
            return i
    return last  # rounding at the very top of the range


def _unit(text: str) -> float:
    """A hash of ``text`` as a number in (0, 1), the same in every process."""
    h = int.from_bytes(hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()[:8], "big")
    return (h + 0.5) / 2**64


def rendezvous_pick(key: str, names: Sequence[str], weights: Sequence[float], salt: str = "") -> int | None:
    """The index of ``key``'s target by weighted rendezvous hashing: each target scores
    ``-w / ln(u)`` with ``u`` a hash of (salt, target, key) in (0, 1); the highest wins, which
    happens with probability ``w / sum(w)``. Changing one weight only moves keys to or from
    that target. None when no weight is above 0."""
    best, best_score = None, -math.inf
    for i, (name, w) in enumerate(zip(names, weights)):
        if w <= 0:
            continue
        score = -w / math.log(_unit(f"{salt}\x00{name}\x00{key}"))
        if score > best_score:
            best, best_score = i, score
    return best


def p99(values: Iterable[float]) -> float | None:
    """Nearest-rank 99th percentile (for fewer than 100 values: the largest)."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


class SLOWindow:
    """A canary's last ``size`` requests: (seconds to the first output or None, failed)."""

    def __init__(self, size: int):
        self.samples: deque[tuple[float | None, bool]] = deque(maxlen=size)

    def add(self, ttft_s: float | None, error: bool) -> None:
        self.samples.append((ttft_s, error))

    @property
    def full(self) -> bool:
        return len(self.samples) == self.samples.maxlen

    def ttft_p99_s(self) -> float | None:
        return p99(t for t, _ in self.samples if t is not None)

    def error_rate(self) -> float | None:
        if not self.samples:
            return None
        return sum(1 for _, e in self.samples if e) / len(self.samples)

    def breach(self, slo: RouteSLO) -> str | None:
        """Which bound the window breaks, in words; None while it is not full or keeps both."""
        if not self.full:
            return None
        ttft = self.ttft_p99_s()
        if slo.ttft_p99_ms is not None and ttft is not None and ttft * 1000 > slo.ttft_p99_ms:
            return f"TTFT p99 {ttft * 1000:.0f} ms over {len(self.samples)} requests > {slo.ttft_p99_ms:g} ms"
        rate = self.error_rate()
        if slo.error_rate is not None and rate is not None and rate > slo.error_rate:
            return f"error rate {rate:.2f} over {len(self.samples)} requests > {slo.error_rate:g}"
        return None

    def clear(self) -> None:
        self.samples.clear()

    def summary(self) -> dict:
        ttft = self.ttft_p99_s()
        rate = self.error_rate()
        return {
            "size": self.samples.maxlen,
            "seen": len(self.samples),
            "ttft_p99_ms": None if ttft is None else round(ttft * 1000, 1),
            "error_rate": None if rate is None else round(rate, 4),
        }


@dataclass
class Target:
    """One model behind a route, as it stands now."""

    model: str
    weight: float
    configured_weight: float
    canary: bool
    window: SLOWindow | None = None
    status: str = "serving"  # serving | rolled_back | promoted
    reason: str | None = None  # why it was rolled back
    changed_at: float | None = None  # wall time of the last rollback or promotion
    requests: int = 0  # requests this target was chosen for
    rollbacks: int = 0  # automatic rollbacks (SLO breaches)

    def snapshot(self, total_weight: float) -> dict:
        body = {
            "model": self.model,
            "weight": self.weight,
            "configured_weight": self.configured_weight,
            "share": round(self.weight / total_weight, 4) if total_weight > 0 else 0.0,
            "canary": self.canary,
            "status": self.status,
            "requests": self.requests,
            "rollbacks": self.rollbacks,
        }
        if self.reason is not None:
            body["reason"] = self.reason
        if self.changed_at is not None:
            body["changed_at"] = self.changed_at
        if self.window is not None:
            body["slo_window"] = self.window.summary()
        return body


class RouteError(ValueError):
    """An operator's change that cannot apply (unknown target, no weight left)."""


class Route:
    """One route's targets, choice and canary verdicts."""

    def __init__(self, config: RouteConfig, rng: random.Random | None = None, clock: Callable[[], float] = time.time):
        self.name = config.name
        self.sticky = config.sticky
        self.slo = config.slo
        self.fallback = config.fallback
        self.rng = rng or random.Random()
        self.clock = clock
        self.targets = [
            Target(t.model, t.weight, t.weight, t.canary, SLOWindow(config.slo.window) if t.canary and config.slo else None)
            for t in config.targets
        ]
        self.fallbacks: dict[str, int] = {}  # by reason
        self.fallback_served = 0

    # -- choosing ------------------------------------------------------------------------------
    @property
    def total_weight(self) -> float:
        return sum(t.weight for t in self.targets if t.weight > 0)

    def pick(self, key: str | None = None) -> Target | None:
        """The target of one request: by ``key`` when the route is sticky and there is one,
        else at random by weight; None when every weight is 0."""
        weights = [t.weight for t in self.targets]
        if self.sticky != "none" and key:
            i = rendezvous_pick(key, [t.model for t in self.targets], weights, salt=self.name)
        else:
            i = weighted_pick(weights, self.rng)
        return None if i is None else self.targets[i]

    def chosen(self, target: Target) -> None:
        target.requests += 1

    def fell_back(self, reason: str) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
        self.fallback_served += 1

    def target(self, model: str | None = None, canary: bool = False) -> Target:
        """The target serving ``model``; without one, the route's canary (when ``canary``)."""
        if model is None:
            canaries = [t for t in self.targets if t.canary]
            if not canary or len(canaries) != 1:
                raise RouteError(f"route {self.name}: name the target (one of {', '.join(t.model for t in self.targets)})")
            return canaries[0]
        for t in self.targets:
            if t.model == model:
                return t
        raise RouteError(f"route {self.name} has no target {model!r} (its targets: {', '.join(t.model for t in self.targets)})")

    # -- the canary's verdict ----------------------------------------------------------------------
    def record(self, target: Target, ttft_s: float | None, error: bool) -> bool:
        """One finished request of ``target``; True when it made a canary break its SLO (and so
        rolled it back). Only canaries still serving with weight are judged."""
        if target.window is None or self.slo is None or not target.canary or target.status != "serving" or target.weight <= 0:
            return False
        target.window.add(ttft_s, error)
        breach = target.window.breach(self.slo)
        if breach is None:
            return False
        target.rollbacks += 1
        self._out(target, breach)
        log.warning(
            "route %s: canary %s broke its SLO (%s); rolled back, its weight is now 0", self.name, target.model, breach
        )
        return True

    def _out(self, target: Target, reason: str) -> None:
        target.weight = 0.0
        target.status = "rolled_back"
        target.reason = reason
        target.changed_at = self.clock()

    # -- operators' changes ----------------------------------------------------------------------
    def rollback(self, model: str | None = None) -> Target:
        """Take a target (default: the canary) out of the route now."""
        target = self.target(model, canary=True)
        if all(t.weight <= 0 for t in self.targets if t is not target):
            raise RouteError(f"route {self.name}: {target.model} is its only target with weight; give another one weight first")
        self._out(target, "rolled back by an operator")
        log.warning("route %s: %s rolled back by an operator", self.name, target.model)
        return target

    def promote(self, model: str | None = None) -> Target:
        """Make a target (default: the canary) the route's only one: all the weight, no longer judged."""
        target = self.target(model, canary=True)
        for t in self.targets:
            t.weight = 0.0
            if t.window is not None:
                t.window.clear()
        target.weight = 100.0
        target.canary = False
        target.status = "promoted"
        target.reason = None
        target.changed_at = self.clock()
        log.warning("route %s: %s promoted; it now takes every request", self.name, target.model)
        return target

    def set_weights(self, weights: dict[str, float]) -> None:
        """New weights for the targets named (the others keep theirs). A rolled-back canary
        given weight serves and is judged again, over a fresh window."""
        for model, w in weights.items():
            self.target(model)
            if not isinstance(w, (int, float)) or isinstance(w, bool) or not math.isfinite(w) or w < 0:
                raise RouteError(f"route {self.name}: the weight of {model} must be a number >= 0 (got {w!r})")
        if sum(weights.get(t.model, t.weight) for t in self.targets) <= 0:
            raise RouteError(f"route {self.name}: at least one target needs a weight above 0")
        for t in self.targets:
            if t.model not in weights:
                continue
            t.weight = float(weights[t.model])
            if t.weight > 0 and t.status == "rolled_back":
                t.status, t.reason, t.changed_at = "serving", None, self.clock()
                if t.window is not None:
                    t.window.clear()
        log.warning("route %s: weights set to %s", self.name, ", ".join(f"{t.model}={t.weight:g}" for t in self.targets))

    def snapshot(self) -> dict:
        total = self.total_weight
        return {
            "name": self.name,
            "sticky": self.sticky,
            "fallback": self.fallback,
            "slo": self.slo.model_dump() if self.slo is not None else None,
            "targets": [t.snapshot(total) for t in self.targets],
            "fallbacks": dict(self.fallbacks),
            "requests": sum(t.requests for t in self.targets) + self.fallback_served,
        }


class RouteTable:
    """Every route of one server, by name."""

    def __init__(self, configs: Iterable[RouteConfig] = (), rng: random.Random | None = None):
        self.routes: dict[str, Route] = {c.name: Route(c, rng) for c in configs}

    def get(self, name: str) -> Route | None:
        return self.routes.get(name)

    def __bool__(self) -> bool:
        return bool(self.routes)

    def snapshot(self) -> list[dict]:
        return [r.snapshot() for r in self.routes.values()]


@dataclass
class PrefillClock:
    """A model's recent per-request prefill time (first scheduled to first token), smoothed."""

    alpha: float = 0.2
    seconds: float | None = None
    samples: int = field(default=0)

    def add(self, seconds: float) -> None:
        self.seconds = seconds if self.seconds is None else self.seconds + self.alpha * (seconds - self.seconds)
        self.samples += 1


def predicted_ttft_s(waiting: int, prefill_s: float | None) -> float | None:
    """The time to first output of a request joining a queue of ``waiting`` requests: each of
    them and then this one prefill in turn, ``(waiting + 1) x`` the recent per-request prefill
    time. It ignores batching (several prompts prefill in one step) and decode steps in
    between, so it errs high under light load and low under heavy decode load; None until a
    prefill has been seen."""
    if prefill_s is None:
        return None
    return (max(0, waiting) + 1) * prefill_s


class RoutesCollector:
    """``gemel:canary_rollbacks_total{route,target}``, ``gemel:fallback_requests_total{route,reason}``,
    ``gemel:route_requests_total{route,target}`` and ``gemel:route_target_weight{route,target}``,
    read from the routes at scrape time."""

    def __init__(self, table: Callable[[], RouteTable | None]):
        self.table = table

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        rollbacks = CounterMetricFamily(
            "gemel:canary_rollbacks", "Canary targets rolled back for breaking their route's SLO.", labels=["route", "target"]
        )
        fallbacks = CounterMetricFamily(
            "gemel:fallback_requests", "Routed requests served by the route's fallback model, by reason.", labels=["route", "reason"]
        )
        requests = CounterMetricFamily(
            "gemel:route_requests", "Routed requests, by the target chosen for them.", labels=["route", "target"]
        )
        weights = GaugeMetricFamily("gemel:route_target_weight", "A route target's current weight.", labels=["route", "target"])
        table = self.table()
        for route in table.routes.values() if table is not None else ():
            for t in route.targets:
                rollbacks.add_metric([route.name, t.model], t.rollbacks)
                requests.add_metric([route.name, t.model], t.requests)
                weights.add_metric([route.name, t.model], t.weight)
            for reason, n in route.fallbacks.items():
                fallbacks.add_metric([route.name, reason], n)
        yield from (rollbacks, fallbacks, requests, weights)
