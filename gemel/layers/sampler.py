"""Batched sampling (SPEC F16): penalties, temperature, top-k, top-p, min-p, seeds, logprobs.

Every rule is a tensor operation over the whole batch. Randomness uses the
"exponential race" form of sampling (argmax of p / q with q ~ Exp(1)); each seeded
request draws its q from its own generator, so its tokens do not depend on what else is
in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [N] float32; 0 = greedy
    top_k: torch.Tensor  # [N] int64; vocab size = off
    top_p: torch.Tensor  # [N] float32
    min_p: torch.Tensor  # [N] float32
    presence_penalty: torch.Tensor  # [N]
    frequency_penalty: torch.Tensor  # [N]
    repetition_penalty: torch.Tensor  # [N]
    generators: list[torch.Generator | None]  # per row; None = the runner's shared generator
    output_counts: torch.Tensor | None = None  # [N, V] occurrences of each token in the output
    seen_mask: torch.Tensor | None = None  # [N, V] token appears in prompt or output
    num_logprobs: list[int | None] | None = None  # per row: top-k alternatives wanted, None = none
    all_greedy: bool = False


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # chosen token's log-probability, when asked for
    top_logprobs: list[list[tuple[int, float]] | None]


class Sampler:
    def __init__(self, shared_generator: torch.Generator | None = None):
        self.shared_generator = shared_generator
        # gemel's C++ argmax for CPU logits (torch.ops.gemel.argmax_rows, same answers);
        # set by the model runner once the kernels are built.
        self.cpu_argmax = False

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = None
        if batch.num_logprobs and any(k is not None for k in batch.num_logprobs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self._apply_penalties(logits, batch)
        if batch.all_greedy:
            tokens = self._argmax(logits)
        else:
            tokens = self._sample(logits, batch)
        token_list = tokens.tolist()
        chosen: list[float | None] = [None] * len(token_list)
        tops: list[list[tuple[int, float]] | None] = [None] * len(token_list)
        if raw_logprobs is not None:
            chosen_lp = raw_logprobs.gather(1, tokens.view(-1, 1)).squeeze(1).tolist()
            max_k = max(k or 0 for k in batch.num_logprobs)
            top_vals = top_ids = None
            if max_k > 0:
                top_vals, top_ids = raw_logprobs.topk(max_k, dim=-1)
                top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
            for i, k in enumerate(batch.num_logprobs):
                if k is None:
                    continue
                chosen[i] = chosen_lp[i]
                tops[i] = list(zip(top_ids[i][:k], top_vals[i][:k])) if k and top_ids else []
        return SamplerOutput(token_list, chosen, tops)

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if self.cpu_argmax and logits.device.type == "cpu" and logits.dim() == 2 and logits.shape[1] > 0:
            return torch.ops.gemel.argmax_rows(logits)
        return logits.argmax(dim=-1)

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.seen_mask is not None:
            rp = batch.repetition_penalty.view(-1, 1)
            penalised = torch.where(logits > 0, logits / rp, logits * rp)
            logits = torch.where(batch.seen_mask, penalised, logits)
        if batch.output_counts is not None:
            counts = batch.output_counts
            logits = logits - batch.frequency_penalty.view(-1, 1) * counts
            logits = logits - batch.presence_penalty.view(-1, 1) * (counts > 0).float()
        return logits

    def processed_probs(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Target probabilities after temperature, top-k, top-p and min-p (unnormalised after min-p)."""
        greedy_rows = batch.temperature < 1e-5
        temp = torch.where(greedy_rows, torch.ones_like(batch.temperature), batch.temperature)
        logits = logits / temp.view(-1, 1)
        vocab = logits.shape[-1]
        if bool((batch.top_k < vocab).any()) or bool((batch.top_p < 1.0).any()):
            logits = _top_k_top_p(logits, batch.top_k, batch.top_p)
        probs = torch.softmax(logits, dim=-1)
        if bool((batch.min_p > 0).any()):
            threshold = probs.max(dim=-1, keepdim=True).values * batch.min_p.view(-1, 1)
            probs = torch.where(probs < threshold, torch.zeros_like(probs), probs)
        return probs

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        greedy_rows = batch.temperature < 1e-5
        greedy_tokens = self._argmax(logits)
        probs = self.processed_probs(logits, batch)
        q = torch.empty_like(probs).exponential_(generator=self.shared_generator)
        for i, gen in enumerate(batch.generators):
            if gen is not None:
                q[i].exponential_(generator=gen)
        sampled = (probs / q).argmax(dim=-1)
        return torch.where(greedy_rows, greedy_tokens, sampled)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus (top-p), with one sort for the batch."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).view(1, -1)
    remove = ranks >= top_k.clamp(min=1).view(-1, 1)
    probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    cumulative = probs.cumsum(dim=-1) - probs  # mass strictly before each token
    remove |= cumulative >= top_p.view(-1, 1)
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
