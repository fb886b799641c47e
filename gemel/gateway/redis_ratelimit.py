"""Rate limits shared by every front end: the token buckets of ``ratelimit`` kept in Redis.

Each bucket is one Redis hash (``level``, ``stamp``), refilled and taken from by a Lua
script, so that check-and-take is atomic across front ends and replicas, and on Redis's own
clock (``TIME``), so front ends whose clocks disagree still refill a bucket at one rate.
An idle bucket expires after two minutes (a full one would be refilled by then anyway).

When Redis cannot be reached the limiter does what ``on_unavailable`` says:

* ``local`` (the default): each front end falls back to its own in-process buckets, so a
  tenant still meets its limit per front end (up to N times it across N front ends) and
  nothing is refused because of the outage; Redis is tried again after ``retry_s``.
* ``deny``: requests that need a bucket are refused with 503 and Retry-After until Redis is
  back (for deployments where an over-spend costs more than an outage).

Either way a warning is logged once per outage and ``unavailable_total`` counts the calls
that could not reach Redis.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Literal

from gemel.gateway.ratelimit import Decision, InProcessRateLimiter

log = logging.getLogger("gemel.gateway")

# KEYS[1] bucket; ARGV: amount, capacity (= per minute), mode ("take" | "adjust").
# "take" returns {1, charged} or {0, seconds to wait}; "adjust" returns {1, 0}. Numbers travel as
# strings (Lua numbers returned to Redis are truncated to integers).
TOKEN_BUCKET_LUA = """
local amount = tonumber(ARGV[1])
local capacity = tonumber(ARGV[2])
local rate = capacity / 60.0
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local state = redis.call('HMGET', KEYS[1], 'level', 'stamp', 'capacity')
local level = tonumber(state[1])
local stamp = tonumber(state[2])
local old_capacity = tonumber(state[3])
if level == nil then
  level = capacity
  stamp = now
elseif old_capacity ~= capacity then
  level = math.min(level, capacity)
end
if now > stamp then
  level = math.min(capacity, level + (now - stamp) * rate)
end
local result
if ARGV[3] == 'take' then
  local want = math.min(amount, capacity)
  if level >= want then
    level = level - want
    result = {1, tostring(want)}
  else
    result = {0, tostring((want - level) / rate)}
  end
else
  level = math.max(-capacity, math.min(capacity, level - amount))
  result = {1, '0'}
end
redis.call('HSET', KEYS[1], 'level', tostring(level), 'stamp', tostring(now), 'capacity', tostring(capacity))
redis.call('EXPIRE', KEYS[1], 120)
return result
"""

OnUnavailable = Literal["local", "deny"]


class RedisRateLimiter:
    """The ``RateLimiter`` protocol over Redis (``redis.asyncio``, imported only when used)."""

    def __init__(
        self,
        url: str,
        on_unavailable: OnUnavailable = "local",
        prefix: str = "gemel:ratelimit:",
        retry_s: float = 5.0,
        timeout_s: float = 0.5,
    ):
        import redis.asyncio as redis

        self.url = url
        self.on_unavailable = on_unavailable
        self.prefix = prefix
        self.retry_s = retry_s
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.script = self.client.register_script(TOKEN_BUCKET_LUA)
        self.local = InProcessRateLimiter()
        self.down_since: float | None = None  # monotonic; None while Redis answers
        self.unavailable_total = 0

    async def _call(self, key: str, amount: float, per_minute: float, mode: str) -> list | None:
        """The script's reply, or None when Redis is unreachable (then within ``retry_s`` of
        the last failure Redis is not tried again, so an outage costs no timeouts per request)."""
        from redis.exceptions import RedisError

        now = time.monotonic()
        if self.down_since is not None and now - self.down_since < self.retry_s:
            self.unavailable_total += 1
            return None
        try:
            reply = await self.script(keys=[self.prefix + key], args=[repr(float(amount)), repr(float(per_minute)), mode])
        except (RedisError, OSError) as e:
            if self.down_since is None:
                log.warning("rate limits: Redis at %s unreachable (%s); %s", self.url, e, self._fallback_words())
            self.down_since = now
            self.unavailable_total += 1
            return None
        if self.down_since is not None:
            log.warning("rate limits: Redis at %s reachable again; limits are shared again", self.url)
            self.down_since = None
        return reply

    def _fallback_words(self) -> str:
        if self.on_unavailable == "deny":
            return "refusing rate-limited requests until it is back"
        return "each front end enforces the limits on its own until it is back"

    async def acquire(self, key: str, amount: float, per_minute: float) -> Decision:
        reply = await self._call(key, amount, per_minute, "take")
        if reply is None:
            if self.on_unavailable == "deny":
                from gemel.gateway.gateway import Refusal

                raise Refusal(
                    503, "rate limits are unavailable (their shared store cannot be reached); retry shortly",
                    self.retry_s, "rate_limits_unavailable",
                )
            return await self.local.acquire(key, amount, per_minute)
        allowed, value = int(reply[0]), float(reply[1])
        if allowed:
            return Decision(True, charged=value)
        return Decision(False, retry_after_s=float(max(1, math.ceil(value - 1e-9))))

    async def adjust(self, key: str, delta: float, per_minute: float) -> None:
        if not delta:
            return
        if await self._call(key, delta, per_minute, "adjust") is None and self.on_unavailable == "local":
            await self.local.adjust(key, delta, per_minute)

    async def close(self) -> None:
        await self.client.aclose()
