"""Speculative decoding (SPEC F18): propose k tokens cheaply, verify them in one forward pass.

The target model scores the sequence's last token plus the k proposed ones in one step;
rejection sampling then keeps a prefix of the proposals and adds one token of its own, so
a step yields between 1 and k + 1 tokens. Proposals here are deterministic (a point mass
q = delta(d)), for which rejection sampling reduces to: accept d with probability p(d),
else sample from p with d removed and renormalised — exactly the target distribution at
any temperature (Leviathan et al. 2023), and plain argmax agreement when greedy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gemel.sampling_params import SamplingParams


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens
    (n from ``n_max`` down to ``n_min``) and propose the tokens that followed it."""

    def __init__(self, k: int, n_max: int = 4, n_min: int = 1, window: int = 2048):
        self.k, self.n_max, self.n_min, self.window = k, n_max, n_min, window

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
