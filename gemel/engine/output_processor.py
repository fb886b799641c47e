"""Front-end half of a request: detokenise incrementally, apply stop strings, gather n candidates.

Runs beside the API (or the offline ``LLM``), never in the engine core, as in vLLM V1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from gemel.engine.protocol import EngineCoreOutput
from gemel.loader.tokenizer import IncrementalDetokenizer, Tokenizer
from gemel.observability.stats import FinishedRequestStats, IterationStats, TokenTiming, tenant_label
from gemel.sampling_params import SamplingParams


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob) alternatives, best first


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or token that ended it
    logprobs: list[TokenLogprob] | None = None
    delta_text: str = ""  # new since the previous RequestOutput
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        if not self.logprobs:
            return None
        return sum(lp.logprob for lp in self.logprobs)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)  # engine event stamps (monotonic)


class _Candidate:
    """State of one of a request's n sequences."""

    def __init__(self, index: int, seq_id: str, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams):
        self.out = CompletionOutput(index=index, logprobs=[] if params.logprobs is not None else None)
        self.seq_id = seq_id
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=True)
        self.params = params
        self.full_text = ""
        self.emitted = 0
        self.holdback = max((len(s) for s in params.stop), default=1) - 1
        self.last_token_ts: float | None = None  # the step that gave this sequence its latest token

    def add(self, out: EngineCoreOutput) -> str | None:
        """Take one step's tokens; return this sequence's id if a stop string ended it."""
        c = self.out
        for i, tok in enumerate(out.new_token_ids):
            if c.finish_reason is not None:
                break
            c.token_ids.append(tok)
            c.delta_token_ids.append(tok)
            if c.logprobs is not None:
                lp = TokenLogprob(tok, out.new_logprobs[i] or 0.0, out.new_top_logprobs[i] or [])
                c.logprobs.append(lp)
                c.delta_logprobs.append(lp)
            is_stop_token = out.finish_reason == "stop" and out.stop_token_id == tok and i == len(out.new_token_ids) - 1
            if is_stop_token:
                self.detok.add([])  # the stop token is not part of the text
            else:
                start = max(0, len(self.full_text) - self.holdback)
                self.full_text += self.detok.add([tok])
                if self.params.stop and self._check_stop_strings(start):
                    return self.seq_id
        if out.finish_reason is not None and c.finish_reason is None:
            self.full_text += self.detok.flush()  # a held-back incomplete character, if any
            c.finish_reason = out.finish_reason
            if out.stop_token_id is not None:
                c.stop_reason = out.stop_token_id
        return None

    def _check_stop_strings(self, search_from: int) -> bool:
        for stop in self.params.stop:
            pos = self.full_text.find(stop, search_from)
            if pos >= 0:
                end = pos + len(stop) if self.params.include_stop_str_in_output else pos
                self.full_text = self.full_text[:end]
                self.out.finish_reason = "stop"
                self.out.stop_reason = stop
                return True
        return False

    def resume_from(self, prev: CompletionOutput) -> None:
        """Go on from what another engine produced: its tokens are this sequence's so far, and
        the text a consumer saw of them is not sent again."""
        c = self.out
        c.token_ids = list(prev.token_ids)
        if c.logprobs is not None:
            c.logprobs = list(prev.logprobs or [])
        c.finish_reason, c.stop_reason = prev.finish_reason, prev.stop_reason
        self.full_text = prev.text if prev.finished else self.detok.add(list(prev.token_ids))
        self.emitted = min(len(prev.text), len(self.full_text))

    def take_delta(self) -> None:
        """Expose text up to the hold-back margin (a stop string may still be forming)."""
        c = self.out
        visible = len(self.full_text) if c.finish_reason else max(self.emitted, len(self.full_text) - self.holdback)
        c.delta_text = self.full_text[self.emitted : visible]
        c.text = self.full_text[:visible]
        self.emitted = visible

    def clear_delta(self) -> None:
        self.out.delta_text = ""
        self.out.delta_token_ids = []
        self.out.delta_logprobs = []


class RequestState:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        tenant: str = "",
    ):
        self.request_id = request_id
        self.tenant = tenant_label(tenant)
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.params = params
        self.candidates = [
            _Candidate(i, child_id(request_id, i, params.n), tokenizer, prompt_ids, params) for i in range(params.n)
        ]
        self.num_cached_tokens = 0
        self.num_tier_tokens = 0  # of the cached prompt tokens, loaded back from the KV tier
        self.metrics: dict[str, float] = {"arrival": time.monotonic()}
        self.first_token_ts: float | None = None  # the step that gave the first token of any candidate
        self.observer_handles: list = []  # what each EngineObserver.begin_request returned

    def resume_from(self, prev: RequestOutput) -> None:
        """Continue a request another engine served up to ``prev`` (the last output its consumer
        saw); its first token was counted there, so no TTFT is taken here."""
        for cand, out in zip(self.candidates, prev.outputs):
            cand.resume_from(out)
        self.num_cached_tokens = prev.num_cached_tokens
        self.first_token_ts = self.metrics["arrival"]

    def finished_stats(self, end: float, finish_reason: str | None = None) -> FinishedRequestStats:
        """This request's stats for metrics and tracing (``end``: monotonic, when it ended)."""
        last = [c.last_token_ts for c in self.candidates if c.last_token_ts is not None]
        m = self.metrics
        first = m.get("first_token", self.first_token_ts)
        return FinishedRequestStats(
            request_id=self.request_id,
            tenant=self.tenant,
            finish_reason=finish_reason or self.candidates[0].out.finish_reason or "abort",
            arrival=m["arrival"],
            end=end,
            num_prompt_tokens=len(self.prompt_ids),
            num_generation_tokens=sum(len(c.out.token_ids) for c in self.candidates),
            num_cached_tokens=self.num_cached_tokens,
            num_tier_tokens=self.num_tier_tokens,
            num_preemptions=int(m.get("num_preemptions", 0)),
            scheduled=m.get("scheduled"),
            first_token=first,
            last_token=m["finished"] if "finished" in m and len(self.candidates) == 1 else (max(last) if last else None),
            params=self.params,
            observer_handles=self.observer_handles,
        )

    @property
    def finished(self) -> bool:
        return all(c.out.finished for c in self.candidates)

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_ids,
            outputs=[_snapshot(c.out) for c in self.candidates],
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            metrics=dict(self.metrics),
        )


def _snapshot(c: CompletionOutput) -> CompletionOutput:
    """A copy the caller may keep while the live state goes on changing."""
    from dataclasses import replace

    return replace(
        c,
        token_ids=list(c.token_ids),
        logprobs=None if c.logprobs is None else list(c.logprobs),
        delta_token_ids=list(c.delta_token_ids),
        delta_logprobs=list(c.delta_logprobs),
    )


def child_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}#{index}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Candidate i of a seeded request uses seed + i, so each candidate differs yet repeats."""
    if params.n == 1:
        return params
    from dataclasses import replace

    return replace(params, n=1, seed=None if params.seed is None else params.seed + index)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.child_to_request: dict[str, tuple[RequestState, int]] = {}

    def add(self, state: RequestState) -> None:
        self.requests[state.request_id] = state
        for i, cand in enumerate(state.candidates):
            self.child_to_request[cand.seq_id] = (state, i)

    def remove(self, request_id: str) -> list[str]:
        """Forget a request; return the engine ids of its sequences still running."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        for cand in state.candidates:
            self.child_to_request.pop(cand.seq_id, None)
        return [c.seq_id for c in state.candidates if not c.out.finished]

    def process(
        self, core_outputs: list[EngineCoreOutput], iteration: IterationStats | None = None
    ) -> tuple[list[RequestOutput], list[str]]:
        """Engine outputs -> per-request outputs (with deltas), plus engine ids to abort.

        With ``iteration`` (the step's stats, its ``time`` the engine's stamp), also record
        token counts, TTFT, ITL, per-token timings and the requests that finished."""
        touched: dict[str, RequestState] = {}
        to_abort: list[str] = []
        for out in core_outputs:
            entry = self.child_to_request.get(out.request_id)
            if entry is None:
                continue
            state, index = entry
            for name, t in out.events:
                state.metrics.setdefault(name, t)
                if name == "preempted":
                    state.metrics["num_preemptions"] = state.metrics.get("num_preemptions", 0) + 1
            state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
            state.num_tier_tokens = max(state.num_tier_tokens, out.num_tier_tokens)
            cand = state.candidates[index]
            if cand.out.finished:
                continue
            before = len(cand.out.token_ids)
            stopped = cand.add(out)
            if iteration is not None:
                _record_tokens(state, cand, len(cand.out.token_ids) - before, iteration)
            if stopped:
                to_abort.append(stopped)
            touched[state.request_id] = state
        results = []
        for state in touched.values():
            for cand in state.candidates:
                cand.take_delta()
            results.append(state.output())
            for cand in state.candidates:
                cand.clear_delta()
            if state.finished:
                self.remove(state.request_id)
                if iteration is not None:
                    iteration.finished.append(state.finished_stats(time.monotonic()))
        return results, to_abort


def _record_tokens(state: RequestState, cand: _Candidate, k: int, it: IterationStats) -> None:
    """Account for ``k`` tokens that one step gave one candidate (several with speculation:
    the step's gap is shared between them in the per-token timings; ITL is one per step)."""
    if k <= 0:
        return
    t = it.time
    tenant = state.tenant
    if state.first_token_ts is None:
        state.first_token_ts = t
        it.ttfts.append((tenant, max(0.0, t - state.metrics["arrival"])))
        it.add_prompt(tenant, len(state.prompt_ids))
    prev = cand.last_token_ts
    if prev is not None:
        it.itls.append((tenant, max(0.0, t - prev)))
    gap = max(0.0, t - (prev if prev is not None else state.metrics["arrival"])) / k
    start = len(cand.out.token_ids) - k
    for j in range(k):
        it.tokens.append(TokenTiming(t, start + j, gap, tenant))
    cand.last_token_ts = t
    it.add_generation(tenant, k)
