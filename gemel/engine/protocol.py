"""Messages between the front end and the engine core (same process or across a queue)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gemel.sampling_params import SamplingParams


@dataclass(frozen=True)
class TenantQuota:
    """A tenant's share of the engine, enforced when its requests are admitted."""

    max_running_seqs: int | None = None
    max_kv_blocks_share: float | None = None  # fraction of all KV blocks, 0..1


@dataclass
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    tenant: str = ""
    fork_of: str | None = None  # candidate i > 0 of an n-request: share candidate 0's prompt KV
    quota: TenantQuota | None = None
    # Tokens the request generated already, in an engine that died: they count as output (for
    # max_tokens, penalties, seeds and grammars), so the request goes on where it stopped.
    output_token_ids: list[int] = field(default_factory=list)


@dataclass
class EngineCoreOutput:
    """What one sequence produced in one step, with monotonic-clock event stamps."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float | None] = field(default_factory=list)
    new_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    finish_reason: str | None = None
    stop_token_id: int | None = None
    num_cached_tokens: int = 0
    num_tier_tokens: int = 0  # of the cached ones, loaded back from the KV tier
    events: list[tuple[str, float]] = field(default_factory=list)  # ("scheduled"|"preempted"|..., t)


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    step_tokens: int = 0
    step_time_s: float = 0.0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    kv_tier_host_hits: int = 0  # blocks loaded back from the KV tier's host memory
    kv_tier_disk_hits: int = 0  # and from its disk
    kv_tier_bytes_loaded: int = 0
    kv_tier_bytes_saved: int = 0  # copied out of the pool into host memory
    kv_tier_bytes_written: int = 0  # written to disk
