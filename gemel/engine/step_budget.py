"""Step-time target: size each step's token budget from measured step times.

A step's time is close to linear in the tokens it computes plus the keys its prompt chunks
attend to: ``t ≈ fixed + per_token * tokens + per_key * prefill_keys``, where a chunk of x
tokens after c cached ones reads x * (c + (x + 1) / 2) keys. The second term is what makes a
late chunk of a long prompt dearer than its first one (at 2,000 tokens of context a 64-token
chunk's attention cost as much as its projections). We fit that plane over recent steps
(least squares) and, while sequences are decoding, allow only as many tokens as keep the step
under the inter-token-latency target. Long prompts then prefill in chunks between decode steps
instead of stalling every stream for the whole prefill (Sarathi-Serve's "stall-free batching").

The target bounds the streams' p99, not their mean: a step planned to take exactly the target
by the fit overshoots it about half the time (step times for the same work scatter by 10-30%
on a shared CPU, and a plane is only an approximation). So the budget plans against the
target less the fit's usual overshoot, a high quantile of its recent residuals.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple


class StepCost(NamedTuple):
    fixed: float  # seconds a step costs whatever it computes
    per_token: float  # seconds per token computed
    per_key: float  # seconds per key a prompt chunk's token attends to


def prefill_keys(context: int, chunk: int) -> float:
    """Keys the ``chunk`` new tokens of a prompt read after ``context`` cached ones (causal)."""
    return chunk * (context + (chunk + 1) / 2)


class StepTimeModel:
    def __init__(
        self, window: int = 64, min_prefill_chunk: int = 16, over_target_chunk: int = 64, overshoot_quantile: float = 0.9,
        whole_prompt_tokens: int = 256,
    ):
        self.samples: deque[tuple[int, float, float]] = deque(maxlen=window)
        # Recent steps that computed no prompt chunk, (tokens, seconds): direct evidence of what
        # decodes alone cost, at the batch they ran.
        self.decode_steps: deque[tuple[int, float]] = deque(maxlen=8)
        self.min_prefill_chunk = min_prefill_chunk
        self.over_target_chunk = over_target_chunk
        self.overshoot_quantile = overshoot_quantile
        self.whole_prompt_tokens = whole_prompt_tokens

    def observe(self, num_tokens: int, seconds: float, prefill_keys: float = 0.0) -> None:
        if num_tokens > 0 and seconds > 0:
            self.samples.append((num_tokens, prefill_keys, seconds))
            if prefill_keys == 0:
                self.decode_steps.append((num_tokens, seconds))

    def fit(self) -> StepCost | None:
        """The cost plane, or None until the samples span two sizes. The keys' term is fitted
        only where the samples vary in keys independently of tokens (else it is 0)."""
        if len(self.samples) < 4:
            return None
        n = len(self.samples)
        mx = sum(x for x, _, _ in self.samples) / n
        mk = sum(k for _, k, _ in self.samples) / n
        my = sum(y for _, _, y in self.samples) / n
        sxx = sum((x - mx) ** 2 for x, _, _ in self.samples)
        if sxx == 0:
            return None
        skk = sum((k - mk) ** 2 for _, k, _ in self.samples)
        sxk = sum((x - mx) * (k - mk) for x, k, _ in self.samples)
        sxy = sum((x - mx) * (y - my) for x, _, y in self.samples)
        sky = sum((k - mk) * (y - my) for _, k, y in self.samples)
        det = sxx * skk - sxk * sxk
        per_token, per_key = sxy / sxx, 0.0
        if skk > 0 and det > 1e-9 * sxx * skk:
            both = ((skk * sxy - sxk * sky) / det, (sxx * sky - sxk * sxy) / det)
            if both[1] >= 0:  # more keys never make a step cheaper: else fit tokens alone
                per_token, per_key = both
        per_token = max(per_token, 1e-7)
        return StepCost(max(my - per_token * mx - per_key * mk, 0.0), per_token, per_key)

    def overshoot(self, fit: StepCost) -> float:
        """Seconds by which recent steps ran over what ``fit`` predicts for them, at the
        ``overshoot_quantile`` of its residuals (0 when the fit is at least that exact)."""
        residuals = sorted(y - (fit.fixed + fit.per_token * x + fit.per_key * k) for x, k, y in self.samples)
        return max(residuals[int(self.overshoot_quantile * (len(residuals) - 1))], 0.0)

    def budget(
        self, target_s: float, num_decoding: int, max_tokens: int, prefill_context: int = 0, num_waiting: int = 0,
        prompts_in_line: Sequence[int] = (),
    ) -> int:
        """Tokens allowed in the next step while ``num_decoding`` sequences wait on it for their
        next token, ``num_waiting`` requests wait for their first, and the prompt to be continued
        has ``prefill_context`` tokens cached already.

        A request waiting for its first token counts as much as a stream waiting for its next:
        while more wait than decode, the step may take the target times their ratio. Else a
        burst of 32 requests crawls in behind the first four streams' ITL (the last of them
        waited ~9 s for its first token at C=32 on the 2-core Xeon).

        Cautious where the fit knows little: with no fit yet (e.g. only decode steps seen, all
        the same size) the step gets the floor, and the fit is never extrapolated past twice
        the largest step measured. A long prompt arriving after a run of decode-only steps
        therefore probes larger steps instead of taking the whole budget at once on a guess
        (which stalled every running stream for one long step). The floor lets prompts always
        advance: ``min_prefill_chunk`` tokens, or the larger ``over_target_chunk`` where decodes
        alone take longer than the target (it is missed anyway; prompts should not crawl as
        well): as recent decode-only steps of about this batch measured it, or, where there are
        none, as the fit predicts it (a plane fitted to steps that all carry a chunk
        extrapolates poorly to decodes alone, so measurements come first). The step is planned to end the fit's usual overshoot
        (``overshoot``) before the target, so that the streams' p99 rather than their mean
        stays under it.

        Short prompts are never cut: the floor also covers the prompts next in line
        (``prompts_in_line``: their tokens still to compute, in order) whole, as many as
        ``whole_prompt_tokens`` hold together. A burst of newcomers then gets in a few whole
        prompts a step instead of crawling in by 16-64 tokens a step behind a batch of streams:
        on 2 vCPUs capped at AVX2, 32 prompts of 128 tokens arriving at once next to 32 streams
        waited up to 9.6 s for a first token (TTFT p99) with 50 ms steps, 4.0-4.2 s with no
        target at all (and then the streams' ITL p99 was 485-640 ms). Long prompts are still
        chunked to the target.
        """
        if num_decoding == 0:
            return max_tokens
        target_s *= max(1.0, num_waiting / num_decoding)
        fit = self.fit()
        measured = [t for n, t in self.decode_steps if abs(n - num_decoding) <= max(2, num_decoding // 4)]
        if measured:  # decode-only steps of about this batch: what decodes alone cost
            decodes_over = statistics.median(measured) > target_s
        else:  # none (every recent step carried a newcomer's chunk, e.g. 30 streams behind a
            # long shared prompt): the fit's prediction is all there is to go by
            decodes_over = fit is not None and fit.fixed + fit.per_token * num_decoding > target_s
        whole = 0
        for tokens in prompts_in_line:
            if whole + tokens > self.whole_prompt_tokens:
                break
            whole += tokens
        if decodes_over:
            return min(max_tokens, num_decoding + max(self.over_target_chunk, whole))
        floor = min(max_tokens, num_decoding + max(self.min_prefill_chunk, whole))
        if fit is None:
            return floor
        spare = target_s - self.overshoot(fit) - fit.fixed - fit.per_token * num_decoding
        if spare <= 0:
            return floor
        # The largest x with per_key / 2 x^2 + (per_token + per_key (context + 1/2)) x <= spare,
        # written without the cancellation of (sqrt(b^2 + 4 a c) - b) / 2a for a small a.
        a = fit.per_key / 2
        b = fit.per_token + fit.per_key * (prefill_context + 0.5)
        chunk = 2 * spare / (b + math.sqrt(b * b + 4 * a * spare))
        affordable = num_decoding + int(chunk + 1e-9)
        affordable = min(affordable, 2 * max(n for n, _, _ in self.samples))
        return max(floor, min(max_tokens, affordable))
