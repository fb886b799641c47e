"""OpenAI-compatible surface (SPEC F32): chat completions, completions, embeddings.

Bodies are pydantic models (so the OpenAPI document describes them); unknown fields are
accepted as OpenAI's SDK adds new ones often, but fields that would change the answer and
that gemel cannot honour yet (tools, response_format, logit_bias, ...) are refused by name.
Non-OpenAI sampling parameters (top_k, min_p, repetition_penalty, ignore_eos, priority,
min_tokens) are read from the top level, where ``extra_body`` puts them.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import JSONResponse, Response, StreamingResponse

from gemel.api.auth import Principal, authenticate
from gemel.api.errors import as_api_error, invalid, openai_error
from gemel.api.inputs import build_params, openai_messages
from gemel.api.structured import openai_spec
from gemel.api.lifecycle import Collector, Deadline, collect, first_output, guarded
from gemel.api.state import ServedModel, mark_model, state_of
from gemel.embeddings.vectors import truncate
from gemel.engine.output_processor import CompletionOutput, RequestOutput, TokenLogprob
from gemel.sampling_params import SamplingParams

router = APIRouter(tags=["openai"])

OPENAI_NAMES = {
    "n": "n", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty", "max_tokens": "max_tokens", "min_tokens": "min_tokens",
    "logprobs": "logprobs", "priority": "priority", "stop strings": "stop", "at most 16 stop strings": "stop",
    "seed": "seed",
}


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Sampling fields both OpenAI generation endpoints share, plus gemel's extras."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # not OpenAI's: vLLM-style extras at the top level
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    priority: int | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


# -- validation -----------------------------------------------------------------------
def _refuse(body: BaseModel) -> None:
    if body.logit_bias:
        raise invalid("logit_bias is not supported by gemel yet", param="logit_bias")
    if isinstance(body, ChatCompletionRequest):
        if body.tools or body.functions or body.tool_choice not in (None, "none", "auto"):
            raise invalid("tools are not supported by gemel yet", param="tools")
    if isinstance(body, CompletionRequest):
        if body.suffix:
            raise invalid("suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise invalid("best_of must equal n when given", param="best_of")


def _params(body: SamplingFields, model: ServedModel, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    if max_tokens is not None and max_tokens > model.max_output_tokens:
        raise invalid(
            f"max_tokens: {max_tokens} is more than model {model.id}'s limit of {model.max_output_tokens}",
            param="max_tokens",
        )
    kwargs: dict = {
        "n": body.n,
        "max_tokens": model.max_output_tokens if max_tokens is None else max_tokens,
        "stop": [body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        "seed": body.seed,
        "ignore_eos": body.ignore_eos,
        "logprobs": logprobs,
    }
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                 "repetition_penalty", "min_tokens", "priority"):
        value = getattr(body, name)
        if value is not None:
            kwargs[name] = value
    if kwargs.get("temperature", 1.0) > 2.0:
        raise invalid("temperature must be between 0 and 2", param="temperature")
    return build_params(kwargs, OPENAI_NAMES)


def _logprobs_count(body: ChatCompletionRequest) -> int | None:
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise invalid("top_logprobs requires logprobs to be true", param="top_logprobs")
        if not 0 <= body.top_logprobs <= 20:
            raise invalid("top_logprobs must be between 0 and 20", param="top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


# -- response pieces ------------------------------------------------------------------
class Formatter:
    """Engine outputs -> OpenAI JSON, for one request (its prompts x n choices)."""

    def __init__(self, kind: Literal["chat", "text"], model_name: str, tokenizer, top_logprobs: int | None):
        self.kind = kind
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.top_logprobs = top_logprobs
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def logprobs(self, lps: list[TokenLogprob], text_offset: int = 0) -> dict | None:
        if self.top_logprobs is None:
            return None
        k = self.top_logprobs
        if self.kind == "chat":
            def entry(t: int, p: float) -> dict:
                s = self.token(t)
                return {"token": s, "logprob": p, "bytes": list(s.encode("utf-8"))}

            return {
                "content": [entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, p) for t, p in lp.top[:k]]} for lp in lps],
                "refusal": None,
            }
        tokens = [self.token(lp.token_id) for lp in lps]
        offsets, pos = [], text_offset
        for s in tokens:
            offsets.append(pos)
            pos += len(s)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{self.token(t): p for t, p in lp.top[:k]} for lp in lps] if k else None,
            "text_offset": offsets,
        }

    def usage(self, prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict:
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}
        if cached:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    def envelope(self, choices: list[dict], usage: dict | None, chunk: bool = False, usage_null: bool = False) -> dict:
        """A response or stream chunk; ``usage_null`` writes ``"usage": null`` as include_usage streams do."""
        obj = {"chat": "chat.completion", "text": "text_completion"}[self.kind] + (".chunk" if chunk and self.kind == "chat" else "")
        body = {
            "id": self.id, "object": obj, "created": self.created, "model": self.model_name,
            "system_fingerprint": "gemel", "choices": choices,
        }
        if usage is not None or usage_null:
            body["usage"] = usage
        return body

    def choice(self, c: CompletionOutput, index: int, text: str, lps: list[TokenLogprob] | None, delta: bool, first: bool = False) -> dict:
        finish = c.finish_reason if c.finish_reason != "abort" else "stop"
        logprobs = self.logprobs(lps or []) if lps is not None else None
        if self.kind == "text":
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if delta:
            d: dict = {"content": text}
            if first:
                d["role"] = "assistant"
            return {"index": index, "delta": d, "logprobs": logprobs, "finish_reason": finish}
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs, "finish_reason": finish}


def _sse(obj: dict | str) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n"


# -- shared generation path -----------------------------------------------------------
class Prompt:
    def __init__(self, text: str | None, ids: list[int]):
        self.text = text
        self.ids = ids


async def _merged(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the request's position."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in s:
                queue.put_nowait((i, out))
        except Exception as e:  # re-raised in the consumer
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:  # cancelling a pump closes its stream, which aborts the request in the engine
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _gather_or_cancel(*aws):
    """gather(), but the first failure cancels (and so aborts) the others."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


async def _generate(
    request: Request,
    body: SamplingFields,
    kind: Literal["chat", "text"],
    prompts_of,  # (tokenizer) -> list[Prompt]
    max_tokens: int | None,
    logprobs: int | None,
    echo: bool = False,
    principal: Principal | None = None,
) -> Response:
    st = state_of(request)
    model = st.generative(body.model, "openai", method="chat completions" if kind == "chat" else "completions")
    mark_model(request, model)
    _refuse(body)
    deadline = Deadline.from_request(request, st.config.server)
    params = _params(body, model, max_tokens, logprobs)
    if kind == "chat":
        structured = openai_spec(body.response_format)
        if structured is not None:
            params = replace(params, structured_output=structured)
    engine = model.engine
    await guarded(request, engine.wait_ready(min(deadline.remaining(), st.config.server.engine_ready_timeout_s)), deadline)
    prompts: list[Prompt] = prompts_of(engine.tokenizer, model)
    fmt = Formatter(kind, body.model, engine.tokenizer, logprobs)
    n = params.n
    principal = principal or Principal()
    prompt_tokens = sum(len(p.ids) for p in prompts)
    # the gateway (F42, F43): class queue bound and tokens/min reservation, then the tenant's
    # class as the engine priority (F14; a tenant may only lower it) and its engine quota (F15)
    params.priority = principal.priority_for(body.priority)
    await principal.admit_generation(prompt_tokens, params.max_tokens * n * len(prompts))
    streams = [
        principal.meter(
            engine.generate(uuid.uuid4().hex, p.text, p.ids, params, principal.tenant, deadline.at, quota=principal.quota), i
        )
        for i, p in enumerate(prompts)
    ]

    if not body.stream:
        if len(streams) == 1:
            outs = [await collect(request, streams[0], deadline)]
        else:
            runs = (Collector().run(s) for s in streams)
            outs = await guarded(request, _gather_or_cancel(*runs), deadline)
        choices, completion_tokens, cached = [], 0, 0
        for pi, out in enumerate(outs):
            cached += out.num_cached_tokens
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                text = (prompts[pi].text or "") + c.text if echo else c.text
                choices.append(fmt.choice(c, pi * n + c.index, text, c.logprobs, delta=False))
        return JSONResponse(fmt.envelope(choices, fmt.usage(prompt_tokens, completion_tokens, cached), chunk=False))

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    merged = _merged(streams)
    first = await guarded(request, first_output(merged), deadline)  # early errors keep their status

    async def events() -> AsyncIterator[str]:
        generated: dict[int, int] = {}
        cached: dict[int, int] = {}
        started: set[int] = set()
        try:
            item = first
            while True:
                pi, out = item
                cached[pi] = out.num_cached_tokens
                choices = []
                for c in out.outputs:
                    index = pi * n + c.index
                    generated[index] = len(c.token_ids)
                    is_first = index not in started
                    if kind == "chat" and is_first:
                        started.add(index)
                        opening = fmt.choice(_blank(c), index, "", None, delta=True, first=True)
                        yield _sse(fmt.envelope([opening], None, chunk=True, usage_null=include_usage))
                    elif kind == "text" and is_first:
                        started.add(index)
                        if echo and prompts[pi].text:
                            choices.append(fmt.choice(_blank(c), index, prompts[pi].text, None, True))
                    if c.delta_text or c.finish_reason is not None:
                        lps = c.delta_logprobs if logprobs is not None else None
                        choices.append(fmt.choice(c, index, c.delta_text, lps, delta=True))
                if choices:
                    yield _sse(fmt.envelope(choices, None, chunk=True, usage_null=include_usage))
                item = await merged.__anext__()
        except StopAsyncIteration:
            pass
        except Exception as e:  # headers are sent: report in-band, as OpenAI does
            err = deadline.exceeded("mid-stream") if isinstance(e, TimeoutError) else as_api_error(e)
            yield _sse(openai_error(err))
        finally:
            await merged.aclose()
        if include_usage:
            yield _sse(fmt.envelope([], fmt.usage(prompt_tokens, sum(generated.values()), sum(cached.values())), chunk=True))
        yield _sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _blank(c: CompletionOutput) -> CompletionOutput:
    from dataclasses import replace

    return replace(c, finish_reason=None)


# -- routes ---------------------------------------------------------------------------
@router.post("/v1/chat/completions", summary="OpenAI chat completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, principal: Principal = Depends(authenticate)) -> Response:
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is not None and max_tokens < 1:
        name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        raise invalid(f"{name} must be a positive integer (got {max_tokens})", param=name)

    def prompts(tokenizer, model: ServedModel) -> list[Prompt]:
        messages = openai_messages(body.messages, model.id)
        return [Prompt(tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                       tokenizer.encode_chat(messages, add_generation_prompt=True))]

    return await _generate(request, body, "chat", prompts, max_tokens, _logprobs_count(body), principal=principal)


@router.post("/v1/completions", summary="OpenAI completions")
async def completions(body: CompletionRequest, request: Request, principal: Principal = Depends(authenticate)) -> Response:
    if body.max_tokens is not None and body.max_tokens < 1:
        raise invalid(f"max_tokens must be a positive integer (got {body.max_tokens})", param="max_tokens")
    if body.logprobs is not None and not 0 <= body.logprobs <= 20:
        raise invalid("logprobs must be between 0 and 20", param="logprobs")
    if body.echo and body.logprobs is not None:
        raise invalid("echo with logprobs is not supported", param="echo")

    def prompts(tokenizer, model: ServedModel) -> list[Prompt]:
        raw = body.prompt
        if isinstance(raw, str):
            raw = [raw]
        if not raw:
            raise invalid("prompt must not be empty", param="prompt")
        if isinstance(raw[0], int):
            raw = [raw]
        out = []
        for i, p in enumerate(raw):
            if isinstance(p, str):
                if not p:
                    raise invalid(f"prompt[{i}] must not be empty", param="prompt")
                out.append(Prompt(p, tokenizer.encode(p)))
            else:
                if not p or any(t < 0 or t >= tokenizer.vocab_size for t in p):
                    raise invalid(f"prompt[{i}]: token ids must be in [0, {tokenizer.vocab_size})", param="prompt")
                out.append(Prompt(tokenizer.decode(p), list(p)))
        if len(out) * body.n > 64:
            raise invalid("at most 64 choices (prompts x n) per request", param="prompt")
        return out

    return await _generate(request, body, "text", prompts, body.max_tokens, body.logprobs, echo=body.echo, principal=principal)


@router.post("/v1/embeddings", summary="OpenAI embeddings")
async def embeddings(body: EmbeddingRequest, request: Request, principal: Principal = Depends(authenticate)) -> Response:
    st = state_of(request)
    model = st.embedding(body.model, "openai", method="embeddings")
    mark_model(request, model)
    deadline = Deadline.from_request(request, st.config.server)
    texts = [body.input] if isinstance(body.input, str) else body.input
    if not texts:
        raise invalid("input must not be empty", param="input")
    if not all(isinstance(t, str) for t in texts):
        raise invalid("input: token-id inputs are not supported for this model; send strings", param="input")
    if any(not t for t in texts):
        raise invalid("input: strings must not be empty", param="input")
    limit = st.config.embeddings.max_batch if st.config.embeddings else 100
    if len(texts) > limit:
        raise invalid(f"input: at most {limit} inputs per request (got {len(texts)})", param="input")
    encoder = await guarded(request, st.encoder(model, deadline.remaining()), deadline)
    if body.dimensions is not None and not 1 <= body.dimensions <= encoder.dimensions:
        raise invalid(f"dimensions must be between 1 and {encoder.dimensions}", param="dimensions")
    vectors = await guarded(request, st.embed(model, texts, deadline.remaining()), deadline)
    vectors = truncate(vectors, body.dimensions).numpy().astype("<f4")
    data = []
    for i, v in enumerate(vectors):
        emb = base64.b64encode(v.tobytes()).decode() if body.encoding_format == "base64" else v.tolist()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    tokens = sum(encoder.count_tokens(texts))
    return JSONResponse(
        {"object": "list", "data": data, "model": body.model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    )

