"""Step-time target (SPEC F13): size each step's token budget from measured step times.

A step's time is close to linear in the tokens it computes: ``t ≈ fixed + per_token * n``.
We fit that line over recent steps (least squares) and, while sequences are decoding,
allow only as many tokens as keep the step under the inter-token-latency target. Long
prompts then prefill in chunks between decode steps instead of stalling every stream
for the whole prefill (Sarathi-Serve's "stall-free batching").
"""

from __future__ import annotations

from collections import deque


class StepTimeModel:
    def __init__(self, window: int = 64, min_prefill_chunk: int = 64):
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)
        self.min_prefill_chunk = min_prefill_chunk

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            self.samples.append((num_tokens, seconds))

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None until the samples span two sizes."""
        if len(self.samples) < 4:
            return None
        n = len(self.samples)
        mx = sum(x for x, _ in self.samples) / n
        my = sum(y for _, y in self.samples) / n
        var = sum((x - mx) ** 2 for x, _ in self.samples)
        if var == 0:
            return None
        slope = sum((x - mx) * (y - my) for x, y in self.samples) / var
        slope = max(slope, 1e-7)
        return max(my - slope * mx, 0.0), slope

    def budget(self, target_s: float, num_decoding: int, max_tokens: int) -> int:
        """Tokens allowed in the next step while ``num_decoding`` sequences wait on it.

        Cautious where the fit knows little: with no fit yet (e.g. only decode steps seen, all
        the same size) the step gets the floor, and the fit is never extrapolated past twice
        the largest step measured. A long prompt arriving after a run of decode-only steps
        therefore probes 80, 160, 320 ... tokens instead of taking the whole budget at once
        on a guess (which stalled every running stream for one long step).
        """
        if num_decoding == 0:
            return max_tokens
        floor = num_decoding + self.min_prefill_chunk  # prefills always make some progress
        fit = self.fit()
        if fit is None:
            return floor
        fixed, per_token = fit
        affordable = int((target_s - fixed) / per_token)
        affordable = min(affordable, 2 * max(n for n, _ in self.samples))
        return max(floor, min(max_tokens, affordable))
