"""Where cached answers live: in this process (``MemoryStore``) or in Redis (``RedisStore``),
shared by every front end.

An entry is the engine-level result of a request, as plain JSON: for each prompt its final
candidates (text, token ids, finish reason, stop reason, logprobs) and its prefix-cache
count. Prompts are not stored: a replay takes them from the request it answers. Both stores
bound the entries by age (``ttl_s``) and number (``max_entries``, least recently used out).
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from gemel.engine.output_processor import CompletionOutput, RequestOutput, TokenLogprob

log = logging.getLogger("gemel.cache")

FORMAT = 1  # bumped when the entry's layout changes; other layouts read as misses


# -- entries --------------------------------------------------------------------------------------
def encode_entry(outputs: Sequence[RequestOutput]) -> dict:
    """The final outputs of a request (one per prompt) as a JSON-ready entry."""

    def logprobs(lps: list[TokenLogprob] | None):
        if lps is None:
            return None
        return [[lp.token_id, lp.logprob, [[t, p] for t, p in lp.top]] for lp in lps]

    return {
        "v": FORMAT,
        "outputs": [
            {
                "cached_tokens": out.num_cached_tokens,
                "candidates": [
                    {
                        "index": c.index,
                        "text": c.text,
                        "token_ids": list(c.token_ids),
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                        "logprobs": logprobs(c.logprobs),
                    }
                    for c in out.outputs
                ],
            }
            for out in outputs
        ],
    }


def decode_entry(entry: dict, request_ids: Sequence[str], prompts: Sequence[tuple[str | None, list[int]]]) -> list[RequestOutput] | None:
    """Fresh final outputs of an entry for a request's prompts ((text, token ids) each); None
    when the entry does not fit them (another layout, another number of prompts)."""
    if entry.get("v") != FORMAT or len(entry.get("outputs", ())) != len(prompts):
        return None
    outs = []
    for rid, (text, ids), stored in zip(request_ids, prompts, entry["outputs"]):
        candidates = []
        for c in stored["candidates"]:
            lps = c["logprobs"]
            candidates.append(
                CompletionOutput(
                    index=c["index"],
                    text=c["text"],
                    token_ids=list(c["token_ids"]),
                    finish_reason=c["finish_reason"],
                    stop_reason=c["stop_reason"],
                    logprobs=None if lps is None else [TokenLogprob(t, p, [(a, b) for a, b in top]) for t, p, top in lps],
                )
            )
        outs.append(
            RequestOutput(rid, text, list(ids), candidates, finished=True, num_cached_tokens=stored["cached_tokens"])
        )
    return outs


def dumps(entry: dict) -> bytes:
    return json.dumps(entry, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def loads(data: bytes | str | None) -> dict | None:
    if data is None:
        return None
    try:
        entry = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    return entry if isinstance(entry, dict) else None


# -- in this process -----------------------------------------------------------------------------
class MemoryStore:
    """Entries of this front end: an LRU dictionary whose entries also expire after ``ttl_s``
    (``clock`` is injectable so tests need not wait)."""

    def __init__(self, ttl_s: float, max_entries: int, clock: Callable[[], float] = time.monotonic):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.clock = clock
        self._entries: OrderedDict[str, tuple[float, dict]] = OrderedDict()  # key -> (expires at, entry)

    def __len__(self) -> int:
        return len(self._entries)

    async def get(self, key: str) -> dict | None:
        item = self._entries.get(key)
        if item is None:
            return None
        if item[0] <= self.clock():
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return item[1]

    async def put(self, key: str, entry: dict) -> None:
        self._entries[key] = (self.clock() + self.ttl_s, entry)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    async def close(self) -> None:
        self._entries.clear()


# -- in Redis -------------------------------------------------------------------------------------
# KEYS[1] the entry, KEYS[2] the recency index (scores: last use in microseconds, on Redis's
# own clock so front ends agree); ARGV: entry bytes, ttl (ms), max entries, the entry's member
# name, the prefix of entry keys.
PUT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local ttl = tonumber(ARGV[2])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
redis.call('ZADD', KEYS[2], now, ARGV[4])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - ttl * 1000)
local over = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[3])
if over > 0 then
  local old = redis.call('ZRANGE', KEYS[2], 0, over - 1)
  redis.call('ZREMRANGEBYRANK', KEYS[2], 0, over - 1)
  for _, member in ipairs(old) do
    redis.call('DEL', ARGV[5] .. member)
  end
end
redis.call('PEXPIRE', KEYS[2], ttl)
return over
"""

# KEYS[1] the entry, KEYS[2] the recency index; ARGV: the entry's member name. A hit counts as a use.
GET_LUA = """
local value = redis.call('GET', KEYS[1])
if value then
  local t = redis.call('TIME')
  redis.call('ZADD', KEYS[2], 'XX', tonumber(t[1]) * 1000000 + tonumber(t[2]), ARGV[1])
end
return value
"""


class RedisStore:
    """Entries shared by every front end: each a JSON string with Redis's TTL, plus one sorted
    set of the keys by last use, trimmed to ``max_entries`` on every write (the trimmed
    entries are deleted with it), so the store is bounded whatever Redis's ``maxmemory-policy``.
    One Redis, not a Redis Cluster (a write touches keys it only learns inside the script).

    When Redis cannot be reached a lookup is a miss and a write is dropped (a warning is
    logged once per outage; Redis is tried again after ``retry_s``): the cache never fails a
    request. ``redis.asyncio`` is imported only when this store is used."""

    def __init__(
        self,
        url: str,
        ttl_s: float,
        max_entries: int,
        prefix: str = "gemel:response-cache:",
        retry_s: float = 5.0,
        timeout_s: float = 0.5,
    ):
        import redis.asyncio as redis

        self.url = url
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.max_entries = max_entries
        self.prefix = prefix
        self.entry_prefix = prefix + "entry:"
        self.index_key = prefix + "recent"
        self.retry_s = retry_s
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._put = self.client.register_script(PUT_LUA)
        self._get = self.client.register_script(GET_LUA)
        self.down_since: float | None = None
        self.unavailable_total = 0

    async def _call(self, script, keys: list[str], args: list):
        from redis.exceptions import RedisError

        now = time.monotonic()
        if self.down_since is not None and now - self.down_since < self.retry_s:
            self.unavailable_total += 1
            return None
        try:
            reply = await script(keys=keys, args=args)
        except (RedisError, OSError) as e:
            if self.down_since is None:
                log.warning("response cache: Redis at %s unreachable (%s); answering from the engines until it is back", self.url, e)
            self.down_since = now
            self.unavailable_total += 1
            return None
        if self.down_since is not None:
            log.warning("response cache: Redis at %s reachable again", self.url)
            self.down_since = None
        return reply

    async def get(self, key: str) -> dict | None:
        return loads(await self._call(self._get, [self.entry_prefix + key, self.index_key], [key]))

    async def put(self, key: str, entry: dict) -> None:
        args = [dumps(entry), self.ttl_ms, self.max_entries, key, self.entry_prefix]
        await self._call(self._put, [self.entry_prefix + key, self.index_key], args)

    async def close(self) -> None:
        await self.client.aclose()
