"""Speculative decoding: propose k tokens cheaply, verify them in one forward pass.

The target model scores the sequence's last token plus the k proposed ones in one step;
rejection sampling then keeps a prefix of the proposals and adds one token of its own, so
a step yields between 1 and k + 1 tokens. Proposals here are deterministic (a point mass
q = delta(d)), for which rejection sampling reduces to: accept d with probability p(d),
else sample from p with d removed and renormalised — exactly the target distribution at
any temperature (Leviathan et al. 2023), and plain argmax agreement when greedy.

Two proposers share one interface (``Proposer.draft``), and ``make_proposer`` picks one
from the engine's configuration.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from gemel.engine.sequence import Sequence
from gemel.sampling_params import SamplingParams

if TYPE_CHECKING:
    from gemel.config import EngineConfig
    from gemel.engine.block_manager import BlockManager
    from gemel.engine.model_runner import ModelRunner


def draft_room(seq: Sequence, k: int, max_model_len: int) -> int:
    """How many draft tokens ``seq`` can take next step (0 or less: none). Only decoding
    sequences take drafts, and not those needing logprobs, grammars or penalties: they
    decode one token a step. A draft also leaves room for the token verification adds."""
    p = seq.params
    if seq.num_uncomputed_tokens != 1 or p.logprobs is not None or p.structured_output is not None or p.uses_penalties:
        return 0
    return min(p.max_tokens - seq.num_output_tokens, max_model_len - seq.num_tokens, k + 1) - 1


class Proposer(ABC):
    """Drafts up to ``k`` tokens a step for the sequences that can take them."""

    k: int

    def draft(self, seqs: Iterable[Sequence], max_model_len: int) -> None:
        """Set ``spec_token_ids`` of the sequences in ``seqs`` that can take a draft."""
        candidates = []
        for seq in seqs:
            room = draft_room(seq, self.k, max_model_len)
            if room > 0:
                candidates.append((seq, room))
        self._draft(candidates)

    @abstractmethod
    def _draft(self, candidates: list[tuple[Sequence, int]]) -> None:
        """Draft for each (sequence, room) pair: at most ``room`` tokens."""


class NgramProposer(Proposer):
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens
    (n from ``n_max`` down to ``n_min``) and propose the tokens that followed it."""

    def __init__(self, k: int, n_max: int = 4, n_min: int = 1, window: int = 2048):
        self.k, self.n_max, self.n_min, self.window = k, n_max, n_min, window

    def _draft(self, candidates: list[tuple[Sequence, int]]) -> None:
        for seq, room in candidates:
            seq.spec_token_ids = self.propose(seq.token_ids)[:room]

    def propose(self, token_ids: list[int]) -> list[int]:
        tokens = token_ids[-self.window :]
        length = len(tokens)
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            pattern = tokens[-n:]
            first = pattern[0]
            # Scan right to left for the most recent earlier match.
            for start in range(length - n - 1, -1, -1):
                if tokens[start] == first and tokens[start : start + n] == pattern:
                    follow = tokens[start + n : start + n + self.k]
                    if follow:
                        return follow
                    break
        return []


class DraftLayersProposer(Proposer):
    """Self-speculation: k greedy tokens from the target model's first ``num_layers`` layers
    (``ModelRunner.draft_greedy``). Whole drafts only, as the draft passes run in lockstep;
    a sequence takes one when it has room for k tokens and the blocks for every draft
    position can be allocated."""

    def __init__(self, k: int, num_layers: int, runner: ModelRunner, block_manager: BlockManager):
        self.k, self.num_layers = k, num_layers
        self.runner, self.block_manager = runner, block_manager

    def _draft(self, candidates: list[tuple[Sequence, int]]) -> None:
        k = self.k
        batch = [seq for seq, room in candidates if room == k and self.block_manager.allocate_slots(seq, k + 1)]
        if batch:
            drafts = self.runner.draft_greedy(batch, k, self.num_layers)
            for seq, draft in zip(batch, drafts):
                seq.spec_token_ids = draft


def make_proposer(
    config: EngineConfig, model_num_layers: int, runner: ModelRunner, block_manager: BlockManager
) -> Proposer | None:
    """The proposer ``config.speculative_method`` names, or None without speculation."""
    k = config.num_speculative_tokens
    if config.speculative_method == "ngram":
        return NgramProposer(k, n_max=config.ngram_max)
    if config.speculative_method == "draft_layers":
        if not 1 <= config.draft_layers < model_num_layers:
            raise ValueError(f"draft_layers must be between 1 and {model_num_layers - 1} for this model")
        return DraftLayersProposer(k, config.draft_layers, runner, block_manager)
    return None


@dataclass
class SpecStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < proposed:
            self.accepted_per_position.extend([0] * (proposed - len(self.accepted_per_position)))
        for i in range(accepted):
            self.accepted_per_position[i] += 1


def verify(
    probs_or_logits: torch.Tensor,
    draft: list[int],
    params: SamplingParams,
    generator: torch.Generator | None,
) -> list[int]:
    """Tokens to emit for one sequence: ``probs_or_logits`` has k + 1 rows (raw logits when
    greedy, processed target probabilities otherwise)."""
    k = len(draft)
    out: list[int] = []
    if params.greedy:
        target = probs_or_logits.argmax(dim=-1).tolist()
        for i, d in enumerate(draft):
            if target[i] != d:
                return out + [target[i]]
            out.append(d)
        return out + [target[k]]
    probs = probs_or_logits / probs_or_logits.sum(dim=-1, keepdim=True)
    u = torch.rand(k, generator=generator, device=probs.device).tolist() if k else []
    for i, d in enumerate(draft):
        if u[i] < float(probs[i, d]):
            out.append(d)
            continue
        residual = probs[i].clone()
        residual[d] = 0.0
        total = residual.sum()
        if float(total) <= 0.0:  # p was a point mass on d: rejection impossible in exact arithmetic
            out.append(d)
            continue
        out.append(int(torch.multinomial(residual / total, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[k], 1, generator=generator)))
    return out
