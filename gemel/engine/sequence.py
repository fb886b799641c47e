"""One generation stream: its tokens, its KV blocks and where it is in its life."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from gemel.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, stop token or stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # client went away, deadline, or error


@dataclass
class Sequence:
    """A request as the scheduler sees it.

    ``token_ids`` holds prompt then output tokens. ``num_computed_tokens`` counts the
    tokens whose KV is in the cache; the scheduler asks for
    ``num_tokens - num_computed_tokens`` more each step, which covers prefill, chunked
    prefill, decode and recompute after preemption with one rule (as in vLLM V1).
    """

    seq_id: str
    token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 1
    tenant: str = ""
    max_model_len: int = 1 << 30
    quota: object | None = None  # TenantQuota of the tenant, if any

    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first schedule
    num_tier_tokens: int = 0  # of which loaded back from the KV tier (host memory or disk)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of this seq's full blocks
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    num_preemptions: int = 0
    spec_token_ids: list[int] = field(default_factory=list)  # proposed tokens to verify next step
    first_scheduled_time: float | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def check_stop(self) -> FinishReason | None:
        """Token-level stop rules; stop strings are checked by the detokenizing front end."""
        last = self.token_ids[-1]
        n_out = self.num_output_tokens
        if n_out >= self.params.min_tokens:
            if not self.params.ignore_eos and last in self.eos_token_ids:
                self.stop_token_id = last
                return FinishReason.STOP
            if last in self.params.stop_token_ids:
                self.stop_token_id = last
                return FinishReason.STOP
        if n_out >= self.params.max_tokens or self.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None
