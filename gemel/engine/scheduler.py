"""Continuous batching as in vLLM V1: each step is a mapping {sequence: tokens to compute}.

There are no separate prefill and decode phases. A sequence asks for
``num_tokens - num_computed_tokens`` tokens; the step's token budget caps that, which
gives chunked prefill; a preempted sequence simply has all its tokens uncomputed again,
which gives recompute preemption (the prefix cache makes the recompute cheap).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gemel.engine.block_manager import BlockManager
from gemel.engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    aging_seconds: float = 30.0  # a waiting request gains one priority class per this many seconds


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    first_scheduled: list[Sequence] = field(default_factory=list)  # left the queue for the first time

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def always_ready(seq: Sequence) -> bool:
    return True


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        clock: Callable[[], float] = time.monotonic,
        is_ready: Callable[[Sequence], bool] = always_ready,
    ):
        """``is_ready`` says whether a waiting sequence may be admitted now (a sequence whose
        grammar is still compiling is not); by default every one is."""
        self.config = config
        self.block_manager = block_manager
        self.clock = clock
        self.is_ready = is_ready
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._token_budget = config.max_num_batched_tokens
        self.num_preemptions = 0

    @property
    def token_budget(self) -> int:
        """Tokens the next ``schedule()`` may batch: ``max_num_batched_tokens`` unless the
        engine sets a smaller one to meet its step-time target."""
        return self._token_budget

    def set_token_budget(self, tokens: int) -> None:
        self._token_budget = tokens

    # -- queue management ---------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def effective_priority(self, seq: Sequence, now: float) -> float:
        """Priority class minus aging credit, so batch work cannot starve forever."""
        waited = max(0.0, now - seq.arrival_time)
        return max(0.0, seq.priority - waited / self.config.aging_seconds)

    def _order_key(self, now: float) -> Callable[[Sequence], tuple[float, float]]:
        return lambda s: (self.effective_priority(s, now), s.arrival_time)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Remove a sequence from the queues and free its blocks."""
        if seq.status == SequenceStatus.RUNNING and seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(seq)
        out.preempted.append(seq)

    # -- the step ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        out = SchedulerOutput()
        budget = self.token_budget
        key = self._order_key(now)
        self.running.sort(key=key)
        self.waiting.sort(key=key)
        self._preempt_for_waiting(now, out)
        num_preempted_for_waiting = len(out.preempted)

        # 1. Running sequences, most important first; the least important yield blocks.
        scheduled_ids: set[str] = set()
        # Blocks this step's prompt chunks complete: a waiting prompt whose next uncached block is
        # one of them waits a step and then reuses it, instead of computing it a second time
        # (32 requests behind one system prompt arrive together; SGLang's in-batch prefix check).
        completing: set[int] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens + len(seq.spec_token_ids), budget)
            if seq.spec_token_ids:  # keep only the proposals that fit the budget
                del seq.spec_token_ids[max(0, num_new - seq.num_uncomputed_tokens) :]
            if num_new <= 0:
                i += 1
                continue
            while not self.block_manager.allocate_slots(seq, num_new):
                victim = self.running[-1]
                if victim.seq_id in scheduled_ids:  # never undo work already planned this step
                    victim = seq
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, num_new))
                scheduled_ids.add(seq.seq_id)
                if self.waiting and seq.num_uncomputed_tokens > 1:  # only waiting prompts look
                    completing.update(self.block_manager.hashes_completed(seq, num_new))
                budget -= num_new
                i += 1
                continue
            # seq itself was preempted; the list shifted under index i

        # 2. Waiting sequences, unless running ones had to be preempted for room this step.
        if len(out.preempted) > num_preempted_for_waiting:
            return out
        admitted: list[Sequence] = []
        for seq in self.waiting:
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if not self.is_ready(seq):  # e.g. its grammar is still compiling: let others pass
                continue
            if seq.quota is not None and not self._within_quota(seq):  # its tenant is at its share
                continue
            cached_ids: list[int] = []
            cached_hashes: list[int] = []
            if seq.num_computed_tokens == 0:
                tier_hits = self.block_manager.stats.tier_hits
                cached_ids, cached_hashes = self.block_manager.find_cached_prefix(seq)
                restored = self.block_manager.stats.tier_hits - tier_hits
                if restored:  # loaded back from the KV tier for this sequence
                    seq.num_tier_tokens = restored * self.block_manager.block_size
                if completing and self.block_manager.first_uncached_hash(seq, cached_hashes) in completing:
                    continue  # another prompt computes its next block this step: reuse it next step
            num_cached = len(cached_ids) * self.block_manager.block_size
            num_new = seq.num_tokens - max(num_cached, seq.num_computed_tokens)
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if not self.block_manager.allocate_slots(seq, num_new, cached_ids, cached_hashes):
                break
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
                seq.num_cached_tokens = max(num_cached, seq.num_computed_tokens)  # forked KV counts
                self.block_manager.record_prefix_lookup(seq.num_tokens, seq.num_cached_tokens)
                out.first_scheduled.append(seq)
            completing.update(self.block_manager.hashes_completed(seq, num_new))
            admitted.append(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, num_new))
            budget -= num_new
        if admitted:
            taken = {id(s) for s in admitted}
            self.waiting = [s for s in self.waiting if id(s) not in taken]
        return out

    def _within_quota(self, seq: Sequence) -> bool:
        """Tenant quotas: running-sequence cap and KV-block share, checked at admission."""
        quota = seq.quota
        mine = [s for s in self.running if s.tenant == seq.tenant]
        if quota.max_running_seqs is not None and len(mine) >= quota.max_running_seqs:
            return False
        if quota.max_kv_blocks_share is not None:
            held = sum(len(s.block_table) for s in mine)
            need = -(-seq.num_tokens // self.block_manager.block_size) - len(seq.block_table)
            if mine and held + need > quota.max_kv_blocks_share * self.block_manager.num_blocks:
                return False
        return True

    def _preempt_for_waiting(self, now: float, out: SchedulerOutput) -> None:
        """Let a more important waiting request take blocks from less important running ones."""
        if not self.waiting or not self.running:
            return
        head = self.waiting[0]
        head_prio = self.effective_priority(head, now)
        need = -(-head.num_tokens // self.block_manager.block_size)
        while self.block_manager.num_free_blocks < need and self.running:
            victim = self.running[-1]
            if self.effective_priority(victim, now) <= head_prio or victim.priority <= head.priority:
                return
            self._preempt(victim, out)

    def update_after_step(self, out: SchedulerOutput, num_rejected: dict[str, int] | None = None) -> None:
        """Advance computed-token counters and register newly full blocks for prefix reuse.

        Rejected speculative tokens were computed but are not part of the sequence: their
        KV slots are simply overwritten later."""
        for seq, num_new in out.scheduled:
            if seq.status != SequenceStatus.RUNNING:
                continue
            seq.num_computed_tokens += num_new - (num_rejected or {}).get(seq.seq_id, 0)
            self.block_manager.cache_full_blocks(seq)
