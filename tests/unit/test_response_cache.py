"""The response cache without a server: which request fields make a key, TTL and LRU bounds,
tenant isolation, the Redis backend against a real redis-server, and the semantic match on
real MiniLM embeddings."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from gemel.cache.keys import cache_directives, deterministic, exact_key, partition_key
from gemel.cache.response import ResponseCache, replay
from gemel.cache.semantic import SemanticIndex, conversation_text, same_question
from gemel.cache.store import MemoryStore, RedisStore, decode_entry, encode_entry
from gemel.config import GemelConfig, ResponseCacheConfig
from gemel.engine.output_processor import CompletionOutput, RequestOutput, TokenLogprob
from gemel.engine.structured_output import StructuredOutputSpec
from gemel.sampling_params import SamplingParams

PROMPT = [1, 2, 3, 4]


def run(coro):
    return asyncio.run(coro)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def key(params: SamplingParams, tenant: str = "a", model: tuple[str, str] = ("m", "1"), prompt=PROMPT) -> str:
    return exact_key(tenant, *model, [prompt], params)


def final(text: str = "Paris.", ids=(5, 6), finish: str = "stop", logprobs=None, n: int = 1) -> RequestOutput:
    outs = [CompletionOutput(i, text, list(ids), finish, None, logprobs) for i in range(n)]
    return RequestOutput("r", "prompt", PROMPT, outs, finished=True, num_cached_tokens=3)


# -- keys -------------------------------------------------------------------------------------
GREEDY = SamplingParams(temperature=0.0, max_tokens=32)
SEEDED = SamplingParams(temperature=0.8, seed=7, max_tokens=32)

CHANGES_ANSWER = [
    ("n", 2),
    ("presence_penalty", 0.5),
    ("frequency_penalty", 0.5),
    ("repetition_penalty", 1.2),
    ("stop", ["\n"]),
    ("stop_token_ids", [9]),
    ("max_tokens", 33),
    ("min_tokens", 4),
    ("ignore_eos", True),
    ("logprobs", 2),
    ("include_stop_str_in_output", True),
    ("structured_output", StructuredOutputSpec("json_object")),
]


@pytest.mark.parametrize("field,value", CHANGES_ANSWER)
def test_every_answer_changing_field_changes_the_key(field, value):
    for base in (GREEDY, SEEDED):
        assert key(dataclasses.replace(base, **{field: value})) != key(base), field


@pytest.mark.parametrize("field,value", [("temperature", 0.9), ("top_p", 0.5), ("top_k", 5), ("min_p", 0.1), ("seed", 8)])
def test_sampling_knobs_change_a_sampled_key(field, value):
    assert key(dataclasses.replace(SEEDED, **{field: value})) != key(SEEDED)


def test_greedy_ignores_the_knobs_greedy_decoding_never_reads():
    # the argmax after the penalties: temperature (below the greedy cut), top-p/k, min-p and seed do nothing
    variants = [
        dataclasses.replace(GREEDY, top_p=0.5, top_k=3, min_p=0.2, seed=11),
        dataclasses.replace(GREEDY, temperature=1e-6),
        dataclasses.replace(GREEDY, priority=0),
    ]
    assert {key(v) for v in variants} == {key(GREEDY)}


def test_priority_and_number_spelling_do_not_change_the_key():
    assert key(dataclasses.replace(SEEDED, priority=2)) == key(SEEDED)
    assert key(dataclasses.replace(SEEDED, top_p=1)) == key(dataclasses.replace(SEEDED, top_p=1.0))


def test_tenant_model_version_and_prompt_are_in_the_key():
    base = key(GREEDY)
    assert key(GREEDY, tenant="b") != base
    assert key(GREEDY, model=("other", "1")) != base
    assert key(GREEDY, model=("m", "2")) != base
    assert key(GREEDY, prompt=[1, 2, 3, 5]) != base
    assert exact_key("a", "m", "1", [PROMPT, PROMPT], GREEDY) != base  # two prompts are another request


def test_partition_leaves_the_prompt_out_but_keeps_tenant_and_knobs():
    p = partition_key("a", "m", "1", GREEDY)
    assert p == partition_key("a", "m", "1", dataclasses.replace(GREEDY, top_k=4))
    assert p != partition_key("b", "m", "1", GREEDY)
    assert p != partition_key("a", "m", "1", dataclasses.replace(GREEDY, max_tokens=5))


def test_only_deterministic_requests_are_cacheable():
    assert deterministic(GREEDY) and deterministic(SEEDED)
    assert not deterministic(SamplingParams(temperature=0.7))


def test_cache_control_directives():
    assert cache_directives(None) == (False, False)
    assert cache_directives("max-age=0") == (False, False)
    assert cache_directives("No-Cache") == (True, False)
    assert cache_directives("private, no-store") == (True, True)


def test_config_off_by_default_and_redis_needs_a_url():
    assert GemelConfig().cache.response is None
    assert GemelConfig.model_validate({"cache": None}).cache.response is None
    assert GemelConfig.model_validate({"cache": {"response": None}}).cache.response is None
    assert GemelConfig.model_validate({"cache": {"response": {}}}).cache.response.exact
    with pytest.raises(ValueError, match="redis_url"):
        GemelConfig.model_validate({"cache": {"response": {"backend": "redis"}}})
    cfg = GemelConfig.model_validate({"gateway": {"redis_url": "redis://127.0.0.1:1/0"}, "cache": {"response": {"backend": "redis"}}})
    assert cfg.cache.response.backend == "redis"
    with pytest.raises(ValueError):
        GemelConfig.model_validate({"cache": {"response": {"semantic": {"threshold": 1.5}}}})


# -- entries and replay ---------------------------------------------------------------------------
def test_entry_round_trip_keeps_text_ids_finish_and_logprobs():
    lps = [TokenLogprob(5, -0.25, [(5, -0.25), (7, -1.5)]), TokenLogprob(6, -0.125, [(6, -0.125)])]
    entry = encode_entry([final(logprobs=lps, n=2)])
    (out,) = decode_entry(entry, ["new"], [("other prompt", [9, 9])])
    assert out.request_id == "new" and out.prompt == "other prompt" and out.prompt_token_ids == [9, 9]
    assert out.finished and out.num_cached_tokens == 3
    assert [c.index for c in out.outputs] == [0, 1]
    c = out.outputs[1]
    assert (c.text, c.token_ids, c.finish_reason) == ("Paris.", [5, 6], "stop")
    assert c.logprobs == lps
    assert decode_entry(entry, ["a", "b"], [("x", [1]), ("y", [2])]) is None  # another number of prompts


def test_replay_is_one_content_output_then_the_finish():
    async def collect():
        return [o async for o in replay(final(text="Hi there", ids=(1, 2, 3)))]

    content, last = run(collect())
    c = content.outputs[0]
    assert not content.finished and c.finish_reason is None
    assert (c.delta_text, c.delta_token_ids, c.text) == ("Hi there", [1, 2, 3], "Hi there")
    d = last.outputs[0]
    assert last.finished and d.finish_reason == "stop" and d.delta_text == "" and d.text == "Hi there"


# -- the memory store -----------------------------------------------------------------------------
def test_memory_store_expires_entries_after_ttl():
    clock = Clock()
    store = MemoryStore(ttl_s=10, max_entries=5, clock=clock)
    run(store.put("k", {"v": 1}))
    clock.now += 9.9
    assert run(store.get("k")) == {"v": 1}
    clock.now += 0.2
    assert run(store.get("k")) is None and len(store) == 0


def test_memory_store_evicts_the_least_recently_used():
    store = MemoryStore(ttl_s=100, max_entries=3)

    async def scenario():
        for k in "abc":
            await store.put(k, {"k": k})
        assert await store.get("a")  # a is now the most recent
        await store.put("d", {"k": "d"})
        return [await store.get(k) is not None for k in "abcd"]

    assert run(scenario()) == [True, False, True, True]
    assert len(store) == 3


# -- the cache: lookups, storing, tenants --------------------------------------------------------
PROMPTS = [("Where is Paris?", PROMPT)]


def cache(**overrides) -> ResponseCache:
    return ResponseCache(ResponseCacheConfig(**overrides))


async def miss_then_store(c: ResponseCache, tenant: str, params=GREEDY, answer: RequestOutput | None = None, prompts=PROMPTS, **kw):
    lookup = await c.lookup(tenant, "m", "1", prompts, params, **kw)
    lookup.finished([answer or final()])
    await c.drain()
    return lookup


def test_exact_hit_for_the_same_tenant_only():
    c = cache()

    async def scenario():
        first = await miss_then_store(c, "alpha")
        again = await c.lookup("alpha", "m", "1", PROMPTS, GREEDY)
        other = await c.lookup("beta", "m", "1", PROMPTS, GREEDY)
        return first, again, other

    first, again, other = run(scenario())
    assert first.result == "miss" and first.outputs is None
    assert again.result == "exact" and again.outputs[0].outputs[0].text == "Paris."
    assert other.result == "miss" and other.outputs is None
    assert c.counts["exact", "hit"] == 1 and c.counts["exact", "miss"] == 2


def test_non_deterministic_requests_are_neither_read_nor_stored():
    c = cache()
    sampled = SamplingParams(temperature=0.7, max_tokens=32)

    async def scenario():
        await miss_then_store(c, "a", sampled)
        return await c.lookup("a", "m", "1", PROMPTS, sampled)

    assert run(scenario()).result == "miss"
    assert len(c.store) == 0 and c.counts["exact", "bypass"] == 2


def test_no_cache_skips_the_read_but_stores_and_no_store_skips_both():
    c = cache()

    async def scenario():
        await miss_then_store(c, "a")
        fresh = await miss_then_store(c, "a", answer=final(text="Paris!"), no_cache=True)
        after = await c.lookup("a", "m", "1", PROMPTS, GREEDY)
        await miss_then_store(c, "a", answer=final(text="ignored"), no_cache=True, no_store=True)
        last = await c.lookup("a", "m", "1", PROMPTS, GREEDY)
        return fresh, after, last

    fresh, after, last = run(scenario())
    assert fresh.result == "miss"
    assert after.outputs[0].outputs[0].text == "Paris!"  # the fresh answer replaced the old one
    assert last.outputs[0].outputs[0].text == "Paris!"
    assert c.counts["exact", "bypass"] == 2


def test_unfinished_or_aborted_answers_are_not_stored():
    c = cache()

    async def scenario():
        lookup = await c.lookup("a", "m", "1", PROMPTS, GREEDY)
        lookup.finished([final(finish="abort")])
        lookup.finished([None])
        await c.drain()

    run(scenario())
    assert len(c.store) == 0


def test_the_cache_bounds_its_entries():
    c = cache(max_entries=2)

    async def scenario():
        for i in range(3):
            lookup = await c.lookup("a", "m", "1", [("p", [i + 1])], GREEDY)
            lookup.finished([final()])
        await c.drain()
        return [(await c.lookup("a", "m", "1", [("p", [i + 1])], GREEDY)).result for i in range(3)]

    assert run(scenario()) == ["miss", "exact", "exact"]


# -- the Redis store ------------------------------------------------------------------------------
def test_redis_store_is_shared_between_front_ends_and_bounded(redis_url):
    prefix = "test-rc-shared:"

    async def scenario():
        one = RedisStore(redis_url, ttl_s=60, max_entries=3, prefix=prefix)
        two = RedisStore(redis_url, ttl_s=60, max_entries=3, prefix=prefix)
        try:
            entry = encode_entry([final()])
            await one.put("k1", entry)
            seen = await two.get("k1")
            for k in ("k2", "k3"):
                await two.put(k, entry)
            await one.get("k1")  # k1 used again: k2 is now the least recently used
            await one.put("k4", entry)
            present = [await two.get(k) is not None for k in ("k1", "k2", "k3", "k4")]
            members = await one.client.zcard(one.index_key)
            ttl = await one.client.pttl(one.entry_prefix + "k4")
            return seen, present, members, ttl
        finally:
            await one.close()
            await two.close()

    seen, present, members, ttl = run(scenario())
    assert decode_entry(seen, ["x"], [("p", PROMPT)])[0].outputs[0].text == "Paris."
    assert present == [True, False, True, True]
    assert members == 3
    assert 0 < ttl <= 60_000


def test_redis_entries_expire_with_their_ttl(redis_url):
    async def scenario():
        store = RedisStore(redis_url, ttl_s=0.05, max_entries=10, prefix="test-rc-ttl:")
        try:
            await store.put("k", {"v": 1})
            for _ in range(200):  # Redis expires the key itself; poll until it has
                if await store.get("k") is None:
                    return True
                await asyncio.sleep(0.02)
            return False
        finally:
            await store.close()

    assert run(scenario())


def test_redis_cache_two_front_ends_share_answers_not_tenants(redis_url):
    cfg = ResponseCacheConfig(backend="redis", redis_url=redis_url)

    async def scenario():
        one = ResponseCache(cfg, store=RedisStore(redis_url, 60, 100, prefix="test-rc-tenants:"))
        two = ResponseCache(cfg, store=RedisStore(redis_url, 60, 100, prefix="test-rc-tenants:"))
        try:
            await miss_then_store(one, "alpha")
            return (await two.lookup("alpha", "m", "1", PROMPTS, GREEDY)).result, (
                await two.lookup("beta", "m", "1", PROMPTS, GREEDY)
            ).result
        finally:
            await one.close()
            await two.close()

    assert run(scenario()) == ("exact", "miss")


def test_unreachable_redis_is_a_miss_never_an_error(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here

    async def scenario():
        store = RedisStore(f"redis://127.0.0.1:{port}/0", 60, 10)
        try:
            await store.put("k", {"v": 1})
            return await store.get("k"), store.unavailable_total
        finally:
            await store.close()

    value, failures = run(scenario())
    assert value is None and failures >= 1


# -- semantic -------------------------------------------------------------------------------------
def test_conversation_text_leaves_the_template_out():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    assert conversation_text(msgs) == "system: Be brief.\nHi?"


@pytest.mark.parametrize(
    "a,b,same",
    [
        ("Convert 10 miles to kilometers.", "Convert 10 kilometers to miles.", False),
        ("Is Python faster than C?", "Is C faster than Python?", False),
        ("What is 12 times 13?", "What is 12 times 14?", False),
        ("Should I take the job?", "Should I not take the job?", False),
        ("What is the capital of France?", "What's the capital of France?", True),
        ("I don't eat meat, what should I cook?", "I do not eat meat, what should I cook?", True),
    ],
)
def test_same_question_guards(a, b, same):
    assert same_question(a, b) is same


def test_semantic_index_bounds_and_expiry():
    import numpy as np

    clock = Clock()
    index = SemanticIndex(dims=3, ttl_s=10, max_entries=2, clock=clock)
    index.add("p", np.array([1.0, 0, 0]), "k1", "one")
    index.add("p", np.array([0, 1.0, 0]), "k2", "two")
    index.add("q", np.array([1.0, 0, 0]), "k3", "three")  # past the bound: k1 goes
    assert len(index) == 2
    assert index.search("p", np.array([1.0, 0.01, 0]), 0.9) == []
    assert [k for k, _ in index.search("q", np.array([1.0, 0.01, 0]), 0.9)] == ["k3"]
    clock.now += 11
    assert index.search("q", np.array([1.0, 0, 0]), 0.9) == [] and len(index) == 1


@pytest.fixture(scope="module")
def encoder():
    from gemel.embeddings import SentenceEncoder
    from gemel.loader.sources import ModelNotFound, resolve

    try:
        return SentenceEncoder(resolve("all-minilm-l6-v2"))
    except ModelNotFound:
        pytest.skip("the packaged all-MiniLM-L6-v2 is not installed")


# (cached prompt, later prompt, should the later one get the cached answer)
PARAPHRASES = [
    ("What is the capital of France?", "What's the capital of France?", True),
    ("How do I reverse a list in Python?", "How can I reverse a list in Python?", True),
    ("How many days are in a leap year?", "How many days does a leap year have?", True),
    ("How do I make a cup of tea?", "How do you make a cup of tea?", True),
    ("What is the capital of France?", "What is the capital of Germany?", False),
    ("How do I reverse a list in Python?", "How do I sort a list in Python?", False),
    ("What is the boiling point of water?", "What is the freezing point of water?", False),
    ("Convert 10 miles to kilometers.", "Convert 10 kilometers to miles.", False),
    ("Tell me a joke about cats.", "Tell me a joke about dogs.", False),
]


def test_semantic_threshold_on_paraphrases(encoder):
    c = ResponseCache(
        ResponseCacheConfig(semantic={"enabled": True, "threshold": 0.95, "tenants": ["alpha"]}),
        embed=lambda text: _embed(encoder, text),
        dims=encoder.dimensions,
    )

    async def scenario():
        results = []
        for i, (cached, later, _) in enumerate(PARAPHRASES):  # distinct token ids: only the embeddings may match
            await miss_then_store(c, "alpha", answer=final(text=f"answer to {cached}"), semantic_text=cached,
                                  prompts=[(cached, [i + 1])])  # fmt: skip
            lookup = await c.lookup("alpha", "m", "1", [(later, [i + 2000])], GREEDY, semantic_text=later)
            got = lookup.outputs[0].outputs[0].text if lookup.outputs else None
            results.append((lookup.result, got))
            other = await c.lookup("beta", "m", "1", [(later, [i + 2000])], GREEDY, semantic_text=later)
            assert other.result == "miss"  # tenant beta neither opted in nor owns alpha's answers
        return results

    results = run(scenario())
    for (cached, later, same), (result, text) in zip(PARAPHRASES, results):
        if same:
            assert (result, text) == ("semantic", f"answer to {cached}"), later
        else:
            assert result == "miss", later


async def _embed(encoder, text: str):
    return encoder.embed([text])[0].numpy()


# -- the pipeline's hook: store once the last output is out -----------------------------------------
async def _stream(*outs: RequestOutput):
    for out in outs:
        yield out


def _generation(n_streams: int):
    from gemel.api.pipeline import Generation

    finished: list = []
    content = dataclasses.replace(final(), finished=False)
    gen = Generation(None, [], [_stream(content, final()) for _ in range(n_streams)])  # type: ignore[arg-type]
    gen.on_finished = finished.append
    return gen, finished


@pytest.mark.parametrize("n", [1, 2])
def test_generation_reports_its_final_outputs_once_complete(n):
    gen, finished = _generation(n)

    async def consume():
        return [item async for item in gen.outputs()]

    assert len(run(consume())) == 2 * n
    assert len(finished) == 1 and len(finished[0]) == n and all(o.finished for o in finished[0])

    gen, finished = _generation(n)
    assert len(run(gen.results())) == n and len(finished) == 1


@pytest.mark.parametrize("n", [1, 2])
def test_an_abandoned_stream_is_not_reported(n):
    gen, finished = _generation(n)

    async def first_only():
        outputs = gen.outputs()
        await outputs.__anext__()
        await outputs.aclose()  # the client left

    run(first_only())
    assert finished == []


def test_build_follows_the_config(redis_url):
    from types import SimpleNamespace

    from gemel.cache.response import build

    assert build(SimpleNamespace(config=GemelConfig(), models=[])) is None
    cfg = GemelConfig.model_validate({"gateway": {"redis_url": redis_url}, "cache": {"response": {"backend": "redis"}}})
    cache = build(SimpleNamespace(config=cfg, models=[]))
    assert isinstance(cache.store, RedisStore) and cache.store.url == redis_url
    run(cache.close())
    memory = build(SimpleNamespace(config=GemelConfig.model_validate({"cache": {"response": {"semantic": {"enabled": True}}}}), models=[]))
    assert isinstance(memory.store, MemoryStore) and memory.index is None  # no embedding model: exact only
