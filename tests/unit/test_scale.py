"""Engine replicas without Ray: the prefix-aware replica choice and its load bound, the
``scale`` settings, the pool's sum of replica stats, and a request resumed from another
engine's output (what a lost replica's requests go on from)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from gemel.config import GemelConfig
from gemel.engine.block_manager import hash_block
from gemel.engine.output_processor import CompletionOutput, RequestOutput, RequestState
from gemel.engine.protocol import EngineCoreOutput, EngineStats
from gemel.sampling_params import SamplingParams
from gemel.scale.router import PrefixRouter

BS = 4
SYSTEM = list(range(100, 124))  # six blocks shared by the "chat" prompts


def prompt(tail: list[int]) -> list[int]:
    return SYSTEM + tail


# -- the prompt's key ---------------------------------------------------------------------------------------
def test_prefix_hashes_are_the_engines_block_chain():
    r = PrefixRouter(BS)
    ids = list(range(1, 11))  # two full blocks and a partial one
    first = hash_block(None, (1, 2, 3, 4), "t")
    assert r.prefix_hashes(ids, "t") == (first, hash_block(first, (5, 6, 7, 8), "t"))
    assert r.prefix_hashes(ids, "other tenant") != r.prefix_hashes(ids, "t")  # the tenant salt keeps caches apart
    assert r.prefix_hashes([1, 2, 3], "t") == ()
    assert len(PrefixRouter(BS, max_blocks=3).prefix_hashes(list(range(40)), "")) == 3
    assert PrefixRouter(BS, policy="round_robin").prefix_hashes(ids, "t") == ()


# -- the choice -----------------------------------------------------------------------------------------------
def test_a_shared_prefix_stays_on_one_replica_and_new_prompts_spread():
    r = PrefixRouter(BS, seed=1)
    live = ["a", "b"]
    r.set_replicas(live)
    first = r.choose(r.prefix_hashes(prompt([1, 2, 3, 4]), ""), live, request_id="q1")
    assert first.reason == "least_loaded" and first.matched_blocks == 0
    r.release("q1")
    for i in range(5):  # the system prompt's blocks were served by `first`: every later one goes there
        c = r.choose(r.prefix_hashes(prompt([i, 9, 9, 9]), ""), live, request_id=f"s{i}")
        assert (c.replica, c.reason, c.matched_blocks) == (first.replica, "prefix", len(SYSTEM) // BS)
        r.release(f"s{i}")
    # prompts sharing nothing alternate (a tie goes to the replica picked longer ago)
    picks = []
    for i in range(6):
        c = r.choose(r.prefix_hashes([i * 10 + k for k in range(8)], ""), live, request_id=f"n{i}")
        assert c.reason == "least_loaded"
        picks.append(c.replica)
        r.release(f"n{i}")
    assert set(picks) == {"a", "b"} and all(x != y for x, y in zip(picks, picks[1:]))


def test_the_load_bound_gives_way_to_the_less_loaded():
    r = PrefixRouter(BS, margin_requests=4, margin_ratio=0.5, seed=0)
    live = ["a", "b"]
    r.set_replicas(live)
    hashes = r.prefix_hashes(prompt([7, 7, 7, 7]), "")
    home = r.choose(hashes, live, request_id="r0").replica
    other = "b" if home == "a" else "a"
    for i in range(1, 5):  # up to 4 more than the least loaded (0): still home
        assert r.choose(hashes, live, request_id=f"r{i}").replica == home
    assert r.ongoing() == {home: 5, other: 0}
    c = r.choose(hashes, live, request_id="r5")  # home would be 5 ahead: the less loaded of two
    assert (c.replica, c.reason) == (other, "balance")
    # the map now names `other` for this prefix, the most recent to serve it
    assert r.choose(hashes, live, request_id="r6").replica == other
    assert r.counts.decisions == {"least_loaded": 1, "prefix": 5, "balance": 1}


def test_the_margin_grows_with_the_load():
    r = PrefixRouter(BS, margin_requests=4, margin_ratio=0.5, seed=0)
    live = ["a", "b"]
    r.set_replicas(live)
    for i in range(20):
        r.assign(f"b{i}", "b")
    for i in range(30):
        r.assign(f"a{i}", "a", r.prefix_hashes(prompt([1, 1, 1, 1]), ""))
    # a has 30, the least loaded 20: within max(4, 50% of 20) = 10 -> a keeps its prefix
    assert r.choose(r.prefix_hashes(prompt([2, 2, 2, 2]), ""), live).replica == "a"
    r.assign("a30", "a")
    assert r.choose(r.prefix_hashes(prompt([3, 3, 3, 3]), ""), live).reason == "balance"


def test_release_assign_exclude_and_lost_replicas():
    r = PrefixRouter(BS, seed=3)
    r.set_replicas(["a", "b", "c"])
    hashes = r.prefix_hashes(prompt([5, 5, 5, 5]), "")
    r.assign("x", "a", hashes)
    assert r.ongoing() == {"a": 1, "b": 0, "c": 0}
    r.assign("x", "b")  # Ray Serve placed it elsewhere than chosen: the count moves, with its prefix
    assert r.ongoing() == {"a": 0, "b": 1, "c": 0} and r.replica_of("x") == "b"
    assert r.choose(hashes, ["a", "b", "c"]).replica == "b"
    c = r.choose(hashes, ["a", "b", "c"], exclude=["b"])  # b failed this request: any other
    assert c.replica in ("a", "c")
    assert r.choose(hashes, ["b"], exclude=["b"]).replica == "b"  # unless it is the only one left
    r.release("x")
    r.release("x")
    assert r.ongoing() == {"a": 0, "b": 0, "c": 0}
    # b is gone: its map entries are skipped, not followed
    added, removed = r.set_replicas(["a", "c", "d"])
    assert (added, removed) == (["d"], ["b"])
    assert r.choose(hashes, ["a", "c", "d"]).matched_blocks == 0
    assert r.choose([], []) is None


def test_the_map_is_lru_bounded():
    r = PrefixRouter(BS, max_entries=8, seed=0)
    live = ["a", "b"]
    r.set_replicas(live)
    old = r.prefix_hashes([1] * 16, "")  # 4 blocks
    r.assign("o", "a", old)
    for i in range(2):
        r.assign(f"n{i}", "b", r.prefix_hashes([10 + i] * 16, ""))
    assert r.describe()["entries"] == 8
    assert r.choose(old, live).matched_blocks == 0  # aged out


def test_round_robin_cycles():
    r = PrefixRouter(BS, policy="round_robin")
    live = ["a", "b", "c"]
    picks = [r.choose(r.prefix_hashes(prompt([]), ""), live, request_id=str(i)).replica for i in range(6)]
    assert picks == ["b", "c", "a", "b", "c", "a"]


# -- settings ---------------------------------------------------------------------------------------------------
def test_scale_settings():
    assert not GemelConfig().scale.enabled
    assert GemelConfig.model_validate({"scale": {"replicas": 2}}).scale.enabled
    auto = GemelConfig.model_validate({"scale": {"min_replicas": 1, "max_replicas": 3}}).scale
    assert auto.enabled and auto.autoscaling
    for bad in ({"min_replicas": 2}, {"min_replicas": 3, "max_replicas": 2}, {"replicas": 2, "min_replicas": 1, "max_replicas": 2},
                {"routing": "random"}, {"replicas": 0}):
        with pytest.raises(ValueError):
            GemelConfig.model_validate({"scale": bad})


def test_replicas_flag_wins_over_the_file():
    from gemel.api.server import add_serve_arguments, apply_overrides

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    config = GemelConfig.model_validate({"scale": {"min_replicas": 1, "max_replicas": 4}})
    out = apply_overrides(config, parser.parse_args(["--replicas", "2", "--routing", "round_robin"]))
    assert (out.scale.replicas, out.scale.autoscaling, out.scale.routing) == (2, False, "round_robin")
    assert apply_overrides(config, parser.parse_args([])).scale.autoscaling


def test_replica_resources_share_the_cores():
    from gemel.config import EngineConfig, ScaleConfig
    from gemel.scale.pool import replica_resources

    assert replica_resources(ScaleConfig(replicas=2), EngineConfig(), 16) == (8, 8.0)
    assert replica_resources(ScaleConfig(min_replicas=1, max_replicas=3), EngineConfig(), 2) == (1, 0.667)
    assert replica_resources(ScaleConfig(replicas=2, engine_threads=3), EngineConfig(), 16) == (3, 8.0)
    assert replica_resources(ScaleConfig(replicas=2), EngineConfig(num_threads=5), 16)[0] == 5
    assert replica_resources(ScaleConfig(replicas=4, ray_address="head:6379"), EngineConfig(), 16) == (4, 4.0)


def test_one_replica_imports_no_ray():
    code = "import sys, gemel.api.app, gemel.api.server; from gemel.config import GemelConfig; " \
           "assert not GemelConfig().scale.enabled; print('ray' in sys.modules, 'gemel.scale.pool' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


# -- the pool's view of its replicas ------------------------------------------------------------------------------
def test_replica_stats_add_up():
    from gemel.scale.pool import sum_stats

    a = EngineStats(num_running=2, num_waiting=1, num_free_blocks=30, num_blocks=100, prefix_cache_queries=50,
                    prefix_cache_hits=20, step_time_s=0.1, spec_accepted_per_position=[3, 1])
    b = EngineStats(num_running=1, num_free_blocks=90, num_blocks=100, prefix_cache_queries=10, step_time_s=0.3,
                    spec_accepted_per_position=[2])
    s = sum_stats([a, b])
    assert (s.num_running, s.num_waiting, s.num_blocks, s.prefix_cache_queries, s.prefix_cache_hits) == (3, 1, 200, 60, 20)
    assert s.kv_cache_usage == pytest.approx(0.4) and s.step_time_s == 0.3
    assert s.spec_accepted_per_position == [5, 1]
    assert sum_stats([]) == EngineStats()


# -- a request resumed from another engine's output ---------------------------------------------------------------
def test_resume_from_another_engines_output_sends_nothing_twice(tiny_llama_dir):
    from gemel.loader.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained_dir(tiny_llama_dir)
    prompt_ids = tok.encode("The quick brown fox")
    generated = tok.encode(" jumps over the lazy dog. Hello, world!")
    params = SamplingParams(max_tokens=len(generated), temperature=0)

    def step(state: RequestState, tokens: list[int], last: bool) -> RequestOutput:
        cand = state.candidates[0]
        cand.add(EngineCoreOutput(state.request_id, tokens, finish_reason="length" if last else None))
        cand.take_delta()
        out = state.output()
        cand.clear_delta()
        return out

    # all in one engine
    whole = RequestState("r", None, prompt_ids, params, tok)
    texts = [step(whole, [t], i == len(generated) - 1).outputs[0].delta_text for i, t in enumerate(generated)]
    # the first engine dies after 5 tokens; the second goes on from the output its consumer saw
    first = RequestState("r", None, prompt_ids, params, tok)
    seen = [step(first, [t], False) for t in generated[:5]][-1]
    second = RequestState("r", None, prompt_ids, params, tok)
    second.resume_from(seen)
    assert second.candidates[0].out.token_ids == generated[:5] and second.first_token_ts is not None
    rest = [step(second, [t], i == len(generated) - 1).outputs[0] for i, t in enumerate(generated[5:], start=5)]
    assert seen.outputs[0].text + "".join(o.delta_text for o in rest) == "".join(texts)
    assert rest[-1].text == "".join(texts) and rest[-1].token_ids == generated and rest[-1].finish_reason == "length"


def test_resume_keeps_finished_candidates():
    prev = RequestOutput("r", None, [1, 2], [CompletionOutput(0, "done", [5, 6], "stop"), CompletionOutput(1, "go", [7])])
    state = RequestState.__new__(RequestState)
    state.metrics = {"arrival": 1.0}

    class Cand:
        def resume_from(self, out):
            self.out = out

    state.candidates = [Cand(), Cand()]
    state.resume_from(prev)
    assert [c.out.text for c in state.candidates] == ["done", "go"] and state.first_token_ts == 1.0
