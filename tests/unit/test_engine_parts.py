"""The engine core's parts on their own: candidate forking, the proposers and their factory,
and the scheduler's readiness callback and token budget."""

from __future__ import annotations

import pytest

from gemel.config import EngineConfig
from gemel.engine.block_manager import BlockManager
from gemel.engine.forking import CandidateForks
from gemel.engine.scheduler import Scheduler, SchedulerConfig
from gemel.engine.sequence import Sequence, SequenceStatus
from gemel.engine.spec_decode import DraftLayersProposer, NgramProposer, draft_room, make_proposer
from gemel.sampling_params import SamplingParams


def seq(sid: str, tokens: list[int], **params) -> Sequence:
    return Sequence(seq_id=sid, token_ids=tokens, params=SamplingParams(**params))


class FakeRunner:
    def __init__(self):
        self.copies: list[tuple[int, int]] = []
        self.drafts: list[tuple[list[str], int, int]] = []

    def copy_block(self, src: int, dst: int) -> None:
        self.copies.append((src, dst))

    def draft_greedy(self, seqs: list[Sequence], k: int, num_layers: int) -> list[list[int]]:
        self.drafts.append(([s.seq_id for s in seqs], k, num_layers))
        return [[7] * k for _ in seqs]


def _forks(num_blocks: int = 16):
    bm = BlockManager(num_blocks, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100), bm)
    runner = FakeRunner()
    live: dict[str, Sequence] = {}
    return CandidateForks(sched, bm, runner, live.get), sched, bm, runner, live


def test_followers_wait_for_the_leaders_prompt_then_fork_from_it():
    forks, sched, bm, runner, live = _forks()
    leader = seq("a#0", list(range(10)))
    live["a#0"] = leader
    sched.add(leader)
    follower = seq("a#1", list(range(10)))
    assert forks.hold(follower, leader) and forks.has_pending()
    forks.fork_ready()  # the leader's prompt is not computed yet
    assert forks.has_pending() and follower not in sched.waiting
    sched.update_after_step(sched.schedule())
    forks.fork_ready()
    assert not forks.has_pending() and forks.num_forks == 1
    assert follower in sched.waiting and follower.num_computed_tokens == 9
    assert follower.block_table[:2] == leader.block_table[:2]
    assert runner.copies == [(leader.block_table[2], follower.block_table[2])]


def test_nothing_to_wait_for_holds_nothing():
    forks, *_ = _forks()
    leader = seq("a#0", [1, 2, 3])
    assert not forks.hold(seq("x", [1]), None)
    leader.append_token(4)  # already sampling
    assert not forks.hold(seq("a#1", [1, 2, 3]), leader)
    leader.status = SequenceStatus.FINISHED
    assert not forks.hold(seq("a#2", [1, 2, 3]), leader)
    assert not forks.has_pending()


def test_followers_of_a_finished_leader_are_computed_normally():
    forks, sched, _, _, live = _forks()
    leader = seq("a#0", [1, 2, 3, 4, 5])
    follower = seq("a#1", [1, 2, 3, 4, 5])
    forks.hold(follower, leader)
    forks.fork_ready()  # the leader is not live: gone
    assert sched.waiting == [follower] and follower.num_computed_tokens == 0 and forks.num_forks == 0


def test_a_fork_without_a_free_block_computes_the_follower_normally():
    forks, sched, bm, runner, live = _forks(num_blocks=3)
    leader = seq("a#0", list(range(10)))  # 3 blocks, the last one partial
    live["a#0"] = leader
    sched.add(leader)
    follower = seq("a#1", list(range(10)))
    forks.hold(follower, leader)
    sched.update_after_step(sched.schedule())
    forks.fork_ready()
    assert forks.num_forks == 0 and runner.copies == [] and sched.waiting == [follower]


def test_an_aborted_follower_leaves_the_queue_finished():
    forks, *_ = _forks()
    leader = seq("a#0", [1, 2, 3])
    follower = seq("a#1", [1, 2, 3])
    forks.hold(follower, leader)
    forks.abort(follower)
    assert follower.is_finished and forks.pending == {"a#0": []}
    forks.abort(seq("other", [9]))  # not a follower: nothing happens


def test_scheduler_readiness_callback_and_token_budget():
    bm = BlockManager(16, 4)
    ready = {"b"}
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=100), bm, is_ready=lambda s: s.seq_id in ready)
    assert sched.token_budget == 100
    sched.set_token_budget(3)
    assert sched.token_budget == 3
    sched.add(seq("a", [1, 2, 3, 4]))
    sched.add(seq("b", [5, 6, 7, 8]))
    out = sched.schedule()
    assert [(s.seq_id, n) for s, n in out.scheduled] == [("b", 3)]
    assert Scheduler(SchedulerConfig(), bm).is_ready(seq("c", [1]))


def test_draft_room_skips_what_decodes_one_token_a_step():
    s = seq("a", [1, 2, 3], max_tokens=10)
    s.num_computed_tokens = 2
    assert draft_room(s, 4, 100) == 4
    assert draft_room(s, 4, 5) == 1  # the context's end
    assert draft_room(seq("b", [1, 2, 3], max_tokens=10), 4, 100) == 0  # still prefilling
    for params in ({"logprobs": 1}, {"repetition_penalty": 1.2}):
        t = seq("c", [1, 2, 3], max_tokens=10, **params)
        t.num_computed_tokens = 2
        assert draft_room(t, 4, 100) == 0


def test_make_proposer_picks_from_the_config():
    runner, bm = FakeRunner(), BlockManager(16, 4)
    assert make_proposer(EngineConfig(), 4, runner, bm) is None
    ngram = make_proposer(EngineConfig(speculative_method="ngram", num_speculative_tokens=3, ngram_max=2), 4, runner, bm)
    assert isinstance(ngram, NgramProposer) and (ngram.k, ngram.n_max) == (3, 2)
    draft = make_proposer(EngineConfig(speculative_method="draft_layers", draft_layers=2), 4, runner, bm)
    assert isinstance(draft, DraftLayersProposer) and draft.num_layers == 2
    with pytest.raises(ValueError, match="draft_layers must be between 1 and 3 for this model"):
        make_proposer(EngineConfig(speculative_method="draft_layers", draft_layers=4), 4, runner, bm)


def test_draft_layers_proposer_drafts_whole_drafts_only():
    runner, bm = FakeRunner(), BlockManager(16, 4)
    proposer = DraftLayersProposer(2, 1, runner, bm)
    whole = seq("whole", [1, 2, 3], max_tokens=10)
    short = seq("short", [1, 2, 3], max_tokens=2)  # room for one draft token only
    for s in (whole, short):
        bm.allocate_slots(s, 3)
        s.num_computed_tokens = 2
    proposer.draft([whole, short], 100)
    assert runner.drafts == [(["whole"], 2, 1)]
    assert whole.spec_token_ids == [7, 7] and short.spec_token_ids == []
