"""Batched sampling (SPEC F16): penalties, temperature, top-k, top-p, min-p, seeds, logprobs.

Every rule is a tensor operation over the whole batch. A sampled token inverts the row's
cumulative distribution at one uniform draw (the first token whose running probability passes
it): one random number a row and step, where the "exponential race" (argmax of p / q with
q ~ Exp(1)) draws one per vocabulary entry, which on a CPU cost more than the model's forward
at batch 32. Each seeded request draws its number from its own generator (``draw``), so its
tokens do not depend on what else is in the batch. On CPU the C++ kernel ``sample_rows`` does
the whole row (top-k and top-p as a floor on the logits found without a sort, softmax, min-p,
the walk) in two passes over the logits.
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
        # gemel's C++ argmax and sampling for CPU logits (torch.ops.gemel.argmax_rows and
        # sample_rows); set by the model runner once the kernels are built.
        self.cpu_argmax = False
        self.cpu_sample = False

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

    @staticmethod
    def draw(generator: torch.Generator) -> float:
        """The one uniform number in [0, 1) a seeded row uses a step, from its generator. A
        resumed seeded request replays its earlier steps' draws through this too."""
        return float(torch.rand((), generator=generator, dtype=torch.float64, device=generator.device))

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        shared = self.shared_generator
        uniform = torch.rand(len(batch.generators), generator=shared, dtype=torch.float64,
                             device=shared.device if shared is not None else "cpu").cpu()
        for i, gen in enumerate(batch.generators):
            if gen is not None:
                uniform[i] = self.draw(gen)
        vocab = logits.shape[-1]
        if self.cpu_sample and logits.device.type == "cpu" and logits.dim() == 2 and vocab > 0:
            return torch.ops.gemel.sample_rows(logits.contiguous(), batch.temperature.float(), batch.top_k.long(),
                                               batch.top_p.float(), batch.min_p.float(), uniform)
        temperature = batch.temperature
        if bool((batch.top_k < vocab).any()) or bool((batch.top_p < 1.0).any()):  # cut on the tempered logits
            greedy_rows = temperature < 1e-5
            temp = torch.where(greedy_rows, torch.ones_like(temperature), temperature)
            logits = _top_k_top_p(logits / temp.view(-1, 1), batch.top_k, batch.top_p)
            temperature = torch.where(greedy_rows, temperature, torch.ones_like(temperature))
        return _inverse_cdf(logits, temperature, batch.min_p, uniform.to(logits.device))


def _inverse_cdf(logits: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """sample_rows in PyTorch ops (GPUs, or no C++ kernels): the first token whose running
    sum of exp((logit - max) / T), min-p applied, passes ``uniform`` times the row's total;
    greedy rows (T = 0) take the argmax."""
    finite = torch.isfinite(logits)
    # greedy rows, and rows torch.argmax answers by a NaN or +inf or that have no finite logit
    greedy_rows = (temperature < 1e-5) | (logits.isnan() | logits.isposinf()).any(dim=-1) | ~finite.any(dim=-1)
    inverse = torch.where(greedy_rows, torch.ones_like(temperature), temperature).reciprocal().view(-1, 1)
    peak = torch.where(finite, logits, torch.finfo(logits.dtype).min).max(dim=-1, keepdim=True).values
    weights = torch.exp(((logits - peak) * inverse).clamp(min=-104.0))
    weights = torch.where((weights >= min_p.view(-1, 1)) & finite, weights, torch.zeros_like(weights))
    running = weights.double().cumsum(dim=-1)
    target = (uniform * running[:, -1]).view(-1, 1)
    sampled = torch.searchsorted(running, target, right=True).view(-1)
    # past the end by rounding: the row's last weight
    positions = torch.arange(logits.shape[-1], device=logits.device).expand_as(logits)
    last = torch.where(weights > 0, positions, 0).max(dim=-1).values
    return torch.where(greedy_rows, logits.argmax(dim=-1), torch.minimum(sampled, last))


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
