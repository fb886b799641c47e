"""Per-request decoding parameters, validated once at the edge."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gemel.engine.structured_output import StructuredOutputSpec


class SamplingParamError(ValueError):
    """A bad decoding parameter: the field it concerns and what that field must be.

    Each API surface renders it under its own name for the field (``temperature`` on
    OpenAI, ``generationConfig.temperature`` on Gemini), so the error carries the field
    rather than a sentence to be picked apart.
    """

    def __init__(self, field: str, requirement: str):
        super().__init__(f"{field} {requirement}")
        self.field = field
        self.requirement = requirement

    def message_for(self, name: str) -> str:
        """The message with the field called ``name``, as the caller's surface spells it."""
        return f"{name} {self.requirement}"


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
    structured_output: StructuredOutputSpec | None = None  # grammar the output must match

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """Raise SamplingParamError for the first bad field, so every surface can answer 400 naming it."""
        checks = [
            ("n", isinstance(self.n, int) and 1 <= self.n <= 16, "must be an integer between 1 and 16"),
            ("temperature", self.temperature >= 0.0, "must be >= 0"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", isinstance(self.top_k, int), "must be an integer"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("repetition_penalty", self.repetition_penalty > 0.0, "must be > 0"),
            ("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 1, "must be a positive integer"),
            ("min_tokens", isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
             "must be between 0 and max_tokens"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be between 0 and 20"),
            ("priority", self.priority in (0, 1, 2), "must be 0, 1 or 2"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must hold non-empty strings only"),
            ("stop", len(self.stop) <= 16, f"may hold at most 16 strings (got {len(self.stop)})"),
            ("seed", self.seed is None or isinstance(self.seed, int), "must be an integer"),
        ]
        for name, ok, requirement in checks:
            if not ok:
                raise SamplingParamError(name, requirement)

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
