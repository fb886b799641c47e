"""What the front end learns about requests and steps, handed to metrics, tracing and the dashboard.

Pure data, no Prometheus or OpenTelemetry here: the engine's front end (``AsyncLLM`` and its
``OutputProcessor``) fills these in and passes them to its ``EngineObserver``s. As in vLLM V1,
the engine process only stamps events with ``time.monotonic()`` (system-wide on Linux, so its
stamps compare with the front end's); the intervals are computed here, in the front end:

- queue   = scheduled   - arrival      (arrival: when the front end took the request)
- prefill = first_token - scheduled
- decode  = finished    - first_token  (finished: the engine's stamp, else the last token's step)
- TTFT    = first token's step - arrival; ITL = gap between two steps that gave a sequence tokens
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ANONYMOUS = "anonymous"


def tenant_label(tenant: str | None) -> str:
    """The tenant as metrics and spans name it: ``anonymous`` until the gateway sets one."""
    return tenant or ANONYMOUS


@dataclass
class TokenTiming:
    """One output token as the front end saw it (the dashboard's heatmap cell input)."""

    t: float  # monotonic time of the engine step that produced it
    position: int  # index of the token within its response (0: the first token)
    latency_s: float  # since the previous token of the same sequence (for position 0: since arrival)
    tenant: str


@dataclass
class FinishedRequestStats:
    """A request's life, once it finished (or was aborted: ``finish_reason == "abort"``)."""

    request_id: str
    tenant: str
    finish_reason: str
    arrival: float  # monotonic
    end: float  # monotonic, when the front end saw the end
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int = 0
    num_tier_tokens: int = 0  # of the cached ones, loaded back from the KV tier
    num_preemptions: int = 0
    scheduled: float | None = None  # engine stamps (monotonic); None when it never got there
    first_token: float | None = None
    last_token: float | None = None
    params: Any = None  # the request's SamplingParams
    observer_handles: list = field(default_factory=list, repr=False)  # EngineObserver.begin_request's

    @property
    def e2e_latency_s(self) -> float:
        return max(0.0, self.end - self.arrival)

    @property
    def queue_time_s(self) -> float | None:
        return None if self.scheduled is None else max(0.0, self.scheduled - self.arrival)

    @property
    def prefill_time_s(self) -> float | None:
        if self.scheduled is None or self.first_token is None:
            return None
        return max(0.0, self.first_token - self.scheduled)

    @property
    def decode_time_s(self) -> float | None:
        if self.first_token is None or self.last_token is None:
            return None
        return max(0.0, self.last_token - self.first_token)

    @property
    def inference_time_s(self) -> float | None:
        if self.scheduled is None or self.last_token is None:
            return None
        return max(0.0, self.last_token - self.scheduled)

    @property
    def mean_time_per_output_token_s(self) -> float | None:
        """vLLM's TPOT: decode time over the tokens after the first."""
        decode = self.decode_time_s
        if decode is None or self.num_generation_tokens < 2:
            return None
        return decode / (self.num_generation_tokens - 1)


@dataclass
class IterationStats:
    """What one engine message (one step, or a heartbeat) brought to the front end."""

    time: float  # the engine's monotonic stamp of the message (its "iteration timestamp")
    iteration_tokens: list[int] = field(default_factory=list)  # batched tokens of each step run
    prompt_tokens: dict[str, int] = field(default_factory=dict)  # per tenant, prompts whose first token came
    generation_tokens: dict[str, int] = field(default_factory=dict)  # per tenant
    ttfts: list[tuple[str, float]] = field(default_factory=list)  # (tenant, seconds)
    itls: list[tuple[str, float]] = field(default_factory=list)  # (tenant, seconds), one per sequence step
    tokens: list[TokenTiming] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)

    def add_prompt(self, tenant: str, n: int) -> None:
        self.prompt_tokens[tenant] = self.prompt_tokens.get(tenant, 0) + n

    def add_generation(self, tenant: str, n: int) -> None:
        self.generation_tokens[tenant] = self.generation_tokens.get(tenant, 0) + n

    @property
    def empty(self) -> bool:
        return not (self.iteration_tokens or self.prompt_tokens or self.generation_tokens or self.finished)


class EngineObserver:
    """Receives an engine front end's stats; the default methods do nothing.

    ``on_iteration`` runs on the event loop for every engine message. ``begin_request`` runs
    in the context of the code that iterates ``AsyncLLM.generate`` (the HTTP request's task,
    so the current OpenTelemetry span is the request's); what it returns is handed back to
    ``end_request`` when the request finishes or is aborted.
    """

    def on_iteration(self, stats: IterationStats) -> None:
        pass

    def begin_request(self, request_id: str, tenant: str, params: Any) -> Any:
        return None

    def end_request(self, handle: Any, stats: FinishedRequestStats) -> None:
        pass


def notify_observers(observers: list[EngineObserver], it: IterationStats) -> None:
    """Hand one engine message's stats to every observer, then close each finished request's
    handles; an observer that fails is logged and never fails the request."""
    import logging

    log = logging.getLogger("gemel.observability")
    for obs in observers:
        try:
            obs.on_iteration(it)
        except Exception:
            log.exception("observer %r failed", obs)
    for fs in it.finished:
        for obs, handle in zip(observers, fs.observer_handles):
            try:
                obs.end_request(handle, fs)
            except Exception:
                log.exception("observer %r failed at request end", obs)
