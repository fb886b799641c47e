"""Per-tenant token buckets with a fake clock."""

from __future__ import annotations

import asyncio

from gemel.gateway.ratelimit import InProcessRateLimiter


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def run(coro):
    return asyncio.run(coro)


def test_burst_is_the_bucket_then_one_per_second():
    clock = Clock()
    rl = InProcessRateLimiter(clock)

    async def go():
        results = [await rl.acquire("a:requests", 1, 60) for _ in range(100)]
        assert sum(r.allowed for r in results) == 60
        refused = [r for r in results if not r.allowed]
        assert all(r.retry_after_s == 1 for r in refused)
        clock.t += 1.0  # the advertised wait is enough for one more
        assert (await rl.acquire("a:requests", 1, 60)).allowed
        assert not (await rl.acquire("a:requests", 1, 60)).allowed
        # another tenant has its own bucket
        assert (await rl.acquire("b:requests", 1, 60)).allowed

    run(go())


def test_retry_after_rounds_up_to_whole_seconds():
    clock = Clock()
    rl = InProcessRateLimiter(clock)

    async def go():
        assert (await rl.acquire("t", 600, 600)).allowed  # empty the bucket (10 per second)
        d = await rl.acquire("t", 25, 600)
        assert not d.allowed and d.retry_after_s == 3  # 2.5 s -> 3
        clock.t += 3
        assert (await rl.acquire("t", 25, 600)).allowed

    run(go())


def test_token_reservation_is_capped_and_settled():
    clock = Clock()
    rl = InProcessRateLimiter(clock)

    async def go():
        d = await rl.acquire("t:tokens", 5000, 1000)  # more than a minute's worth: takes the whole bucket
        assert d.allowed and d.charged == 1000
        await rl.adjust("t:tokens", 30 - 1000, 1000)  # it used 30: 970 come back
        assert (await rl.acquire("t:tokens", 970, 1000)).allowed
        assert not (await rl.acquire("t:tokens", 1, 1000)).allowed
        # using more than reserved leaves a debt, bounded by one minute's worth
        await rl.adjust("t:tokens", 5000, 1000)
        assert rl.buckets["t:tokens"].level == -1000
        d = await rl.acquire("t:tokens", 100, 1000)
        assert not d.allowed and d.retry_after_s == 66  # (100 + 1000) / (1000/60) = 66 s

    run(go())


def test_limit_change_applies():
    clock = Clock()
    rl = InProcessRateLimiter(clock)

    async def go():
        for _ in range(10):
            assert (await rl.acquire("t", 1, 100)).allowed
        # lowered to 5/min: the bucket shrinks to 5
        assert rl.buckets["t"].level == 90
        assert (await rl.acquire("t", 1, 5)).allowed
        assert rl.buckets["t"].level == 4

    run(go())
