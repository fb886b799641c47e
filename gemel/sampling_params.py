"""Per-request decoding parameters (SPEC F16), validated once at the edge."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gemel.engine.structured_output import StructuredOutputSpec


@dataclass
class SamplingParams:
    """How one request's tokens are chosen and when its generation stops.

    Field names follow vLLM so users can carry their habits over. ``temperature == 0``
    means greedy. ``top_k <= 0`` disables top-k. ``logprobs`` is the number of top
    alternatives to return per token (0 = only the chosen token's), ``None`` = none.
    ``priority`` is the scheduling class (0 critical, 1 standard, 2 batch; lower runs first).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    priority: int = 1
    include_stop_str_in_output: bool = False
    structured_output: StructuredOutputSpec | None = None  # grammar the output must match (F17)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field, so every API surface can map it to a 400."""
        checks = [
            (isinstance(self.n, int) and 1 <= self.n <= 16, "n must be an integer between 1 and 16"),
            (self.temperature >= 0.0, "temperature must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (isinstance(self.top_k, int), "top_k must be an integer"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (self.repetition_penalty > 0.0, "repetition_penalty must be > 0"),
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens must be a positive integer"),
            (isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
             "min_tokens must be between 0 and max_tokens"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be between 0 and 20"),
            (self.priority in (0, 1, 2), "priority must be 0, 1 or 2"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
            (len(self.stop) <= 16, "at most 16 stop strings"),
            (self.seed is None or isinstance(self.seed, int), "seed must be an integer"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
