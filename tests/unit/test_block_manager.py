"""Paged KV bookkeeping and the prefix cache, without a model."""

from __future__ import annotations

from gemel.engine.block_manager import BlockManager
from gemel.engine.scheduler import Scheduler, SchedulerConfig
from gemel.engine.sequence import Sequence
from gemel.sampling_params import SamplingParams


def seq(sid: str, tokens: list[int], priority: int = 1, arrival: float = 0.0) -> Sequence:
    return Sequence(sid, tokens, SamplingParams(max_tokens=8), arrival_time=arrival, priority=priority)


def test_allocate_and_free_return_pool_to_full():
    bm = BlockManager(10, 4)
    s = seq("a", list(range(10)))
    assert bm.allocate_slots(s, 10)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 7
    s.num_computed_tokens = 10
    assert bm.allocate_slots(s, 1)  # 11th token fits in the third block
    assert len(s.block_table) == 3
    s.num_computed_tokens = 12
    assert bm.allocate_slots(s, 1)
    assert len(s.block_table) == 4
    bm.free(s)
    assert bm.num_free_blocks == 10 and s.block_table == []


def test_allocation_fails_without_side_effects_when_full():
    bm = BlockManager(2, 4)
    s = seq("a", list(range(12)))
    assert not bm.allocate_slots(s, 12)
    assert bm.num_free_blocks == 2 and s.block_table == []


def test_prefix_hit_requires_equal_chain_and_leaves_last_token():
    bm = BlockManager(16, 4)
    a = seq("a", list(range(12)))
    assert bm.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    bm.cache_full_blocks(a)
    b = seq("b", list(range(12)) + [99])
    ids, hashes = bm.find_cached_prefix(b)
    assert ids == a.block_table[:3]
    same = seq("c", list(range(12)))  # identical: the last block is left to compute
    assert len(bm.find_cached_prefix(same)[0]) == 2
    other = seq("d", [0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10, 11, 5])
    assert bm.find_cached_prefix(other)[0] == a.block_table[:1]


def test_freed_cached_blocks_are_reused_then_evicted_lru():
    bm = BlockManager(4, 2)
    a = seq("a", [1, 2, 3, 4])
    assert bm.allocate_slots(a, 4)
    a.num_computed_tokens = 4
    bm.cache_full_blocks(a)
    bm.free(a)
    assert bm.num_free_blocks == 4
    b = seq("b", [1, 2, 3, 4, 5])
    ids, hashes = bm.find_cached_prefix(b)
    assert len(ids) == 2  # still findable after free
    # Pressure: a new unrelated sequence takes every block, evicting the cached ones.
    c = seq("c", [7, 7, 7, 7, 7, 7, 7, 7])
    assert bm.allocate_slots(c, 8)
    assert bm.find_cached_prefix(b) == ([], [])
    assert bm.hash_to_block == {}


def test_scheduler_token_budget_and_chunked_prefill():
    bm = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10), bm)
    a, b = seq("a", list(range(25))), seq("b", list(range(100, 104)))
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq_id, n) for s, n in out.scheduled] == [("a", 10)]
    sched.update_after_step(out)
    out = sched.schedule()
    assert [(s.seq_id, n) for s, n in out.scheduled] == [("a", 10)]
    sched.update_after_step(out)
    out = sched.schedule()  # a's last 5 prompt tokens, then b joins with the rest of the budget
    assert [(s.seq_id, n) for s, n in out.scheduled] == [("a", 5), ("b", 4)]


def test_scheduler_respects_sequence_cap():
    bm = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100), bm)
    for i in range(3):
        sched.add(seq(str(i), [1, 2, 3]))
    out = sched.schedule()
    assert len(out.scheduled) == 2 and len(sched.waiting) == 1


def test_preemption_picks_lowest_priority_latest_arrival():
    bm = BlockManager(6, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100), bm, clock=lambda: 0.0)
    # distinct prompts: identical ones would wait for each other's blocks (in-step prefix reuse)
    p0 = seq("p0", list(range(8)), priority=0, arrival=0.0)
    p2_old = seq("p2-old", list(range(10, 18)), priority=2, arrival=0.0)
    p2_new = seq("p2-new", list(range(20, 28)), priority=2, arrival=0.0001)
    for s in (p0, p2_old, p2_new):
        sched.add(s)
    out = sched.schedule()
    assert len(out.scheduled) == 3 and bm.num_free_blocks == 0
    sched.update_after_step(out)
    for s in (p0, p2_old, p2_new):  # each sampled a token: now needs a 3rd block
        s.append_token(5)
    out = sched.schedule()
    assert [s.seq_id for s in out.preempted] == ["p2-new"]
    assert {s.seq_id for s, _ in out.scheduled} == {"p0", "p2-old"}
    assert p2_new.num_computed_tokens == 0 and p2_new in sched.waiting


def test_waiting_high_priority_preempts_running_low_priority():
    bm = BlockManager(4, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100), bm, clock=lambda: 0.0)
    low = seq("low", list(range(16)), priority=2)
    sched.add(low)
    sched.update_after_step(sched.schedule())
    high = seq("high", list(range(100, 108)), priority=0)
    sched.add(high)
    out = sched.schedule()
    assert [s.seq_id for s in out.preempted] == ["low"]
    assert [s.seq_id for s, _ in out.scheduled] == ["high"]


def test_aging_lets_batch_class_overtake():
    now = [0.0]
    bm = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=100, aging_seconds=10), bm, clock=lambda: now[0])
    old_batch = seq("batch", [1, 2], priority=2, arrival=0.0)
    sched.add(old_batch)
    now[0] = 100.0
    fresh_p0 = seq("p0", [3, 4], priority=0, arrival=100.0)
    sched.add(fresh_p0)
    out = sched.schedule()
    assert [s.seq_id for s, _ in out.scheduled] == ["batch"]


def test_tenant_quotas_cap_running_sequences_and_kv_share():
    from gemel.engine.protocol import TenantQuota

    bm = BlockManager(20, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1000), bm, clock=lambda: 0.0)
    capped = TenantQuota(max_running_seqs=2)
    for i in range(4):
        s = seq(f"a{i}", [1, 2, 3])
        s.tenant, s.quota = "a", capped
        sched.add(s)
    other = seq("b0", [4, 5, 6])
    other.tenant = "b"
    sched.add(other)
    out = sched.schedule()
    assert sorted(s.seq_id for s, _ in out.scheduled) == ["a0", "a1", "b0"]  # b is not held back by a

    bm2 = BlockManager(20, 4)
    sched2 = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1000), bm2, clock=lambda: 0.0)
    share = TenantQuota(max_kv_blocks_share=0.25)  # 5 of 20 blocks
    for i in range(3):
        s = seq(f"k{i}", list(range(10 * i, 10 * i + 8)))  # 2 blocks each, distinct
        s.tenant, s.quota = "k", share
        sched2.add(s)
    out = sched2.schedule()
    assert len(out.scheduled) == 2  # a third would hold 6 blocks > 5


def test_prompts_that_arrive_together_reuse_a_shared_prefix_instead_of_computing_it_twice():
    """Prompts behind one system prompt arrive in the same step: the first computes the shared
    blocks, the others wait one step and then find them cached (one physical copy)."""
    bm = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100), bm)
    system = list(range(1000, 1012))  # 3 full blocks
    first, second, third = (seq(f"s{i}", system + [i, i + 1]) for i in range(3))
    other = seq("other", list(range(2000, 2014)))  # unrelated: not held back
    for s in (first, second, third, other):
        sched.add(s)
    out = sched.schedule()
    assert [s.seq_id for s, _ in out.scheduled] == ["s0", "other"]
    assert [s.seq_id for s in sched.waiting] == ["s1", "s2"]
    sched.update_after_step(out)
    first.append_token(7)
    other.append_token(7)
    out = sched.schedule()
    assert {(s.seq_id, n) for s, n in out.scheduled} == {("s0", 1), ("other", 1), ("s1", 2), ("s2", 2)}
    assert second.num_cached_tokens == third.num_cached_tokens == 12
    assert second.block_table[:3] == third.block_table[:3] == first.block_table[:3]
    assert bm.stats.hits == 24


def test_a_prompt_waits_for_the_block_a_running_chunk_computes_this_step():
    bm = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8), bm)
    long = seq("long", list(range(100, 124)))  # 6 blocks, prefilled 8 tokens a step
    sched.add(long)
    sched.update_after_step(sched.schedule())  # blocks 0-1 computed and cached
    follower = seq("follower", list(range(100, 116)) + [5])  # shares blocks 0-3
    sched.add(follower)
    sched.set_token_budget(20)  # room for follower too, but long computes blocks 2-5 now, and
    out = sched.schedule()  # follower's first uncached block is block 2
    assert [(s.seq_id, n) for s, n in out.scheduled] == [("long", 16)] and sched.waiting == [follower]
    sched.update_after_step(out)
    long.append_token(7)
    out = sched.schedule()
    assert [(s.seq_id, n) for s, n in out.scheduled] == [("long", 1), ("follower", 1)]
    assert follower.num_cached_tokens == 16 and follower.block_table[:4] == long.block_table[:4]
    other_tenant = seq("t2", list(range(100, 116)) + [6])
    other_tenant.tenant = "t2"  # a prefix is never shared across tenants, so never waited for
    assert bm.first_uncached_hash(other_tenant, []) != bm.first_uncached_hash(follower, [])
