"""Per-tenant rate limits: token buckets behind the ``RateLimiter`` protocol.

A limit of N per minute is a bucket of capacity N (the burst a tenant may send at once)
refilled continuously at N/60 per second. Requests take 1 from the tenant's requests bucket;
generation reserves prompt + maximum output tokens from its tokens bucket at admission and
settles the difference when the request ends (``adjust``), which may leave the bucket in
debt (never more than one minute's worth) when a request used more than it reserved.

``InProcessRateLimiter`` keeps the buckets in this process (one replica). A Redis-backed
implementation (shared by replicas) will implement the same two coroutines.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Decision:
    allowed: bool
    charged: float = 0.0  # what was taken from the bucket (a request above the capacity takes the capacity)
    retry_after_s: float = 0.0  # whole seconds (>= 1) until the same acquire would succeed, when refused


class RateLimiter(Protocol):
    async def acquire(self, key: str, amount: float, per_minute: float) -> Decision:
        """Take ``amount`` (capped at the capacity) from bucket ``key`` if it holds that much."""
        ...

    async def adjust(self, key: str, delta: float, per_minute: float) -> None:
        """Take ``delta`` more (or give back ``-delta``) once the real cost is known."""
        ...


class TokenBucket:
    __slots__ = ("capacity", "rate", "level", "stamp")

    def __init__(self, per_minute: float, now: float):
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity  # a new bucket starts full
        self.stamp = now

    def refill(self, per_minute: float, now: float) -> None:
        if per_minute != self.capacity:  # the limit changed (tenants file reloaded)
            self.level = min(self.level, float(per_minute))
            self.capacity, self.rate = float(per_minute), per_minute / 60.0
        if now > self.stamp:
            self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def take(self, amount: float) -> Decision:
        amount = min(amount, self.capacity)
        if self.level >= amount:
            self.level -= amount
            return Decision(True, charged=amount)
        wait = (amount - self.level) / self.rate
        return Decision(False, retry_after_s=float(max(1, math.ceil(wait - 1e-9))))

    def settle(self, delta: float) -> None:
        self.level = max(-self.capacity, min(self.capacity, self.level - delta))


class InProcessRateLimiter:
    """Token buckets in a dict; call from one event loop (no locking needed there)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.buckets: dict[str, TokenBucket] = {}

    def _bucket(self, key: str, per_minute: float) -> TokenBucket:
        now = self.clock()
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = TokenBucket(per_minute, now)
        else:
            bucket.refill(per_minute, now)
        return bucket

    async def acquire(self, key: str, amount: float, per_minute: float) -> Decision:
        return self._bucket(key, per_minute).take(amount)

    async def adjust(self, key: str, delta: float, per_minute: float) -> None:
        if delta:
            self._bucket(key, per_minute).settle(delta)
