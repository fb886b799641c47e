"""n candidates of one request share its prompt's KV.

The first candidate (the leader) is scheduled as usual; the others (its followers) wait
until the leader's prompt KV is computed, then start from a fork of its blocks: the full
blocks are shared, the partial last one is copied, and each follower recomputes only its
last prompt token, to get the logits for its own first sample.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from gemel.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from gemel.engine.block_manager import BlockManager
    from gemel.engine.model_runner import ModelRunner
    from gemel.engine.scheduler import Scheduler


class CandidateForks:
    """Followers waiting for their leader's prompt KV, and how many were forked from it."""

    def __init__(
        self,
        scheduler: Scheduler,
        block_manager: BlockManager,
        runner: ModelRunner,
        lookup: Callable[[str], Sequence | None],
    ):
        """``lookup`` finds a live sequence by id (a leader that is gone has finished)."""
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.runner = runner
        self.lookup = lookup
        self.pending: dict[str, list[Sequence]] = {}  # leader id -> followers waiting for its prefill
        self.num_forks = 0

    def has_pending(self) -> bool:
        return bool(self.pending)

    def hold(self, seq: Sequence, leader: Sequence | None) -> bool:
        """Keep ``seq`` back until ``leader``'s prompt KV is computed. False, holding nothing,
        when there is nothing to wait for: no leader, or one already finished or sampling."""
        if leader is None or leader.is_finished or leader.num_output_tokens != 0:
            return False
        self.pending.setdefault(leader.seq_id, []).append(seq)
        return True

    def fork_ready(self) -> None:
        """Schedule the followers of every leader whose prompt KV is computed, each from a fork
        of the leader's blocks (or computed normally when the fork finds no room); the
        followers of a leader that is gone are computed normally."""
        for leader_id in list(self.pending):
            leader = self.lookup(leader_id)
            followers = self.pending[leader_id]
            if leader is None or leader.is_finished:
                del self.pending[leader_id]
                for seq in followers:  # nothing to share any more: compute normally
                    self.scheduler.add(seq)
                continue
            if leader.status != SequenceStatus.RUNNING or leader.num_computed_tokens < leader.num_prompt_tokens:
                continue
            del self.pending[leader_id]
            for seq in followers:
                self._fork(leader, seq)

    def _fork(self, leader: Sequence, seq: Sequence) -> None:
        copy = self.block_manager.fork(leader, seq, seq.num_prompt_tokens - 1)
        if copy is not False:
            if copy is not None:
                self.runner.copy_block(*copy)
            self.num_forks += 1
        self.scheduler.add(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop ``seq`` if it is a waiting follower (it then counts as finished)."""
        for followers in self.pending.values():
            if seq in followers:
                followers.remove(seq)
                seq.status = SequenceStatus.FINISHED
