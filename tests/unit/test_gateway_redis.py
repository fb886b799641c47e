"""Rate limits shared through a real Redis: one bucket for every front end, atomic takes,
and the stated behaviour when Redis cannot be reached (``local`` or ``deny``)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from gemel.gateway.gateway import Refusal
from gemel.gateway.redis_ratelimit import RedisRateLimiter



def _run(coro):
    return asyncio.run(coro)


def test_two_front_ends_share_one_bucket(redis_url):
    async def scenario():
        a, b = RedisRateLimiter(redis_url, prefix="t1:"), RedisRateLimiter(redis_url, prefix="t1:")
        try:
            decisions = [await (a if i % 2 else b).acquire("acme:requests", 1, 30) for i in range(40)]
            return [d.allowed for d in decisions], decisions[-1]
        finally:
            await a.close()
            await b.close()

    allowed, last = _run(scenario())
    assert sum(allowed) == 30 and allowed[:30] == [True] * 30  # not 30 per front end
    assert not last.allowed and last.retry_after_s >= 1


def test_concurrent_takes_are_atomic(redis_url):
    async def scenario():
        # A generous timeout: 100 connections opening at once on a busy 2-core machine timed out
        # at the default 0.5 s once in CI, and each limiter then fell back to its own bucket.
        limiters = [RedisRateLimiter(redis_url, prefix="t2:", timeout_s=10.0) for _ in range(4)]
        try:
            results = await asyncio.gather(*(lim.acquire("acme:tokens", 10, 600) for lim in limiters for _ in range(25)))
            assert all(lim.unavailable_total == 0 for lim in limiters), "Redis was not reached"
            return sum(d.charged for d in results if d.allowed)
        finally:
            for lim in limiters:
                await lim.close()

    assert _run(scenario()) == 600  # 100 takes of 10 from a bucket of 600: exactly 60 granted


def test_adjust_settles_across_front_ends(redis_url):
    async def scenario():
        a, b = RedisRateLimiter(redis_url, prefix="t3:"), RedisRateLimiter(redis_url, prefix="t3:")
        try:
            assert (await a.acquire("acme:tokens", 100, 100)).allowed  # reserved the whole minute
            refused = await b.acquire("acme:tokens", 10, 100)
            await a.adjust("acme:tokens", -90, 100)  # the request used 10 of its 100
            return refused, await b.acquire("acme:tokens", 80, 100)
        finally:
            await a.close()
            await b.close()

    refused, after = _run(scenario())
    assert not refused.allowed and after.allowed


def test_unreachable_redis_falls_back_to_local_buckets(tmp_path, caplog, redis_factory):
    url, proc = redis_factory(str(tmp_path))
    proc.kill()
    proc.wait()

    async def scenario():
        lim = RedisRateLimiter(url, on_unavailable="local", timeout_s=0.2)
        try:
            return [(await lim.acquire("acme:requests", 1, 5)).allowed for _ in range(8)], lim.unavailable_total
        finally:
            await lim.close()

    with caplog.at_level(logging.WARNING, logger="gemel.gateway"):
        allowed, unavailable = _run(scenario())
    assert allowed == [True] * 5 + [False] * 3  # the limit still holds in this front end
    assert unavailable == 8
    assert sum("unreachable" in r.message for r in caplog.records) == 1  # once per outage, not per request


def test_unreachable_redis_refuses_when_set_to_deny(tmp_path, redis_factory):
    url, proc = redis_factory(str(tmp_path))
    proc.kill()
    proc.wait()

    async def scenario():
        lim = RedisRateLimiter(url, on_unavailable="deny", timeout_s=0.2, retry_s=3)
        try:
            with pytest.raises(Refusal) as info:
                await lim.acquire("acme:requests", 1, 5)
            return info.value
        finally:
            await lim.close()

    refusal = _run(scenario())
    assert refusal.status == 503 and refusal.retry_after_s == 3 and refusal.code == "rate_limits_unavailable"


def test_limits_are_shared_again_when_redis_returns(tmp_path, redis_factory):
    async def scenario():
        url, proc = redis_factory(str(tmp_path))
        lim = RedisRateLimiter(url, prefix="t6:", timeout_s=0.2, retry_s=0.2)
        try:
            assert (await lim.acquire("k", 1, 60)).allowed
            proc.kill()
            proc.wait()
            await lim.acquire("k", 1, 60)
            assert lim.down_since is not None
            port = int(url.rsplit(":", 1)[1].split("/")[0])
            import subprocess
            import shutil

            proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", ""],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for _ in range(100):
                await asyncio.sleep(0.1)
                await lim.acquire("k", 1, 60)
                if lim.down_since is None:
                    return True
            return False
        finally:
            await lim.close()
            proc.kill()

    assert _run(scenario())
