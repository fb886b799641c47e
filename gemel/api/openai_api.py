"""OpenAI-compatible surface: chat completions, completions, embeddings.

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
from starlette.responses import JSONResponse, Response

from gemel.api.auth import Principal, authenticate
from gemel.api.errors import APIError, invalid, openai_error
from gemel.api.inputs import openai_messages
from gemel.api.limits import MAX_CONTENTS, MAX_PARTS, OPENAI_MAX_STOP, check_count, check_schema_size
from gemel.api.params import make_params, plain_knobs
from gemel.api import pipeline
from gemel.api.pipeline import Generation, GenerationRequest, Prompter, PromptInput
from gemel.api.state import ServedModel, state_of
from gemel.api.structured import openai_spec
from gemel.embeddings.vectors import truncate
from gemel.engine.output_processor import CompletionOutput, RequestOutput, TokenLogprob
from gemel.sampling_params import SamplingParams

router = APIRouter(tags=["openai"])
MAX_CHOICES = 64  # prompts x n of one completions request

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
    modalities: Any = None  # refused unless ["text"]: the models write text only
    audio: Any = None  # audio output: refused


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
def check_limits(body: SamplingFields) -> None:
    """The lists a client controls, bounded before any work is done on them."""
    if isinstance(body.stop, list):
        check_count(body.stop, OPENAI_MAX_STOP, "stop", "stop sequences")
    if isinstance(body, ChatCompletionRequest):
        check_count(body.messages, MAX_CONTENTS, "messages", "messages")
        parts = 0
        for i, msg in enumerate(body.messages):
            content = msg.get("content")
            parts += len(content) if isinstance(content, list) else 0
            if parts > MAX_PARTS:
                raise invalid(
                    f"messages[{i}].content takes the request over {MAX_PARTS} content parts, the most one may hold",
                    param=f"messages[{i}].content",
                )
        fmt = body.response_format
        spec = fmt.get("json_schema") if isinstance(fmt, dict) else None
        if isinstance(spec, dict) and spec.get("schema") is not None:
            check_schema_size(spec["schema"], "response_format.json_schema.schema")


def _refuse(body: BaseModel) -> None:
    if body.logit_bias:
        raise invalid("logit_bias is not supported by gemel yet", param="logit_bias")
    if body.stream_options is not None and not body.stream:  # as OpenAI and vLLM answer
        raise invalid("stream_options is only allowed when stream is true", param="stream_options")
    if isinstance(body, ChatCompletionRequest):
        if body.tools or body.functions or body.tool_choice not in (None, "none", "auto"):
            raise invalid("tools are not supported by gemel yet", param="tools")
        if body.modalities is not None and (not isinstance(body.modalities, list) or any(m != "text" for m in body.modalities)):
            raise invalid("modalities: only text output is supported", param="modalities")
        if body.audio is not None:
            raise invalid("audio output is not supported", param="audio")
    if isinstance(body, CompletionRequest):
        if body.suffix:
            raise invalid("suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise invalid("best_of must equal n when given", param="best_of")


def _params(body: SamplingFields, model: ServedModel, max_tokens: int | None, logprobs: int | None, sent_as: dict[str, str]) -> SamplingParams:
    if max_tokens is not None and max_tokens > model.max_output_tokens:
        name = sent_as.get("max_tokens", "max_tokens")
        raise invalid(f"{name}: {max_tokens} is more than model {model.id}'s limit of {model.max_output_tokens}", param=name)
    kwargs: dict = {
        "max_tokens": model.max_output_tokens if max_tokens is None else max_tokens,
        "stop": [body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        "logprobs": logprobs,
    }
    for field, name in plain_knobs("openai"):
        value = getattr(body, field)
        if value is not None:
            kwargs[name] = value
    if kwargs.get("temperature", 1.0) > 2.0:
        raise invalid("temperature must be between 0 and 2", param="temperature")
    return make_params(kwargs, "openai", sent_as)


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


# -- the generation answer --------------------------------------------------------------
async def _generate(
    request: Request,
    body: SamplingFields,
    kind: Literal["chat", "text"],
    prompts: Prompter,
    max_tokens: int | None,
    logprobs: int | None,
    principal: Principal,
    echo: bool = False,
    sent_as: dict[str, str] | None = None,
    prompt_chars: int = 0,
) -> Response:
    method = "chat completions" if kind == "chat" else "completions"
    call = pipeline.http_call(request, body.model, "openai", kind="generate", method=method, user=body.user)
    _refuse(body)
    params = _params(body, call.model, max_tokens, logprobs, sent_as or {})
    if kind == "chat" and body.response_format:
        structured = await asyncio.to_thread(openai_spec, body.response_format)  # metaschema and grammar checks
        if structured is not None:
            params = replace(params, structured_output=structured)
    req = GenerationRequest(
        call.model, params, call.deadline, prompts, priority=body.priority, prompt_chars=prompt_chars, route=call.route
    )
    gen = await pipeline.start_http_generation(request, call, req, principal)
    answered_as = call.model.id if call.route is not None else body.model  # a route's name: the model that answered
    fmt = Formatter(kind, answered_as, call.model.engine.tokenizer, logprobs)
    if not body.stream:
        return JSONResponse(_unary(fmt, gen, await pipeline.finish(gen, call.guard), echo))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    items = await pipeline.relay(gen, call.guard)
    return pipeline.stream_response(_events(fmt, gen, items, include_usage, echo))


def _unary(fmt: Formatter, gen: Generation, outs: list[RequestOutput], echo: bool) -> dict:
    n = gen.request.params.n
    choices, completion_tokens, cached = [], 0, 0
    for pi, out in enumerate(outs):
        cached += out.num_cached_tokens
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            text = (gen.prompts[pi].text or "") + c.text if echo else c.text
            choices.append(fmt.choice(c, pi * n + c.index, text, c.logprobs, delta=False))
    return fmt.envelope(choices, fmt.usage(gen.prompt_tokens, completion_tokens, cached), chunk=False)


async def _events(fmt: Formatter, gen: Generation, items, include_usage: bool, echo: bool) -> AsyncIterator[str]:
    """The SSE events of a streamed answer: each choice opens (chat: a role delta; text with
    echo: the prompt), then its deltas; usage last when asked for, then ``[DONE]``."""
    n = gen.request.params.n
    generated: dict[int, int] = {}
    cached: dict[int, int] = {}
    started: set[int] = set()
    try:
        async for item in items:
            if isinstance(item, APIError):  # headers are sent: report in-band, as OpenAI does
                yield _sse(openai_error(item))
                break
            pi, out = item
            cached[pi] = out.num_cached_tokens
            choices = []
            for c in out.outputs:
                index = pi * n + c.index
                generated[index] = len(c.token_ids)
                if index not in started:
                    started.add(index)
                    if fmt.kind == "chat":
                        opening = fmt.choice(_blank(c), index, "", None, delta=True, first=True)
                        yield _sse(fmt.envelope([opening], None, chunk=True, usage_null=include_usage))
                    elif echo and gen.prompts[pi].text:
                        choices.append(fmt.choice(_blank(c), index, gen.prompts[pi].text, None, True))
                if c.delta_text or c.finish_reason is not None:
                    lps = c.delta_logprobs if fmt.top_logprobs is not None else None
                    choices.append(fmt.choice(c, index, c.delta_text, lps, delta=True))
            if choices:
                yield _sse(fmt.envelope(choices, None, chunk=True, usage_null=include_usage))
    finally:
        await items.aclose()
    if include_usage:
        yield _sse(fmt.envelope([], fmt.usage(gen.prompt_tokens, sum(generated.values()), sum(cached.values())), chunk=True))
    yield _sse("[DONE]")


def _blank(c: CompletionOutput) -> CompletionOutput:
    return replace(c, finish_reason=None)


# -- routes ---------------------------------------------------------------------------
@router.post("/v1/chat/completions", summary="OpenAI chat completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, principal: Principal = Depends(authenticate)) -> Response:
    check_limits(body)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is not None and max_tokens < 1:
        name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        raise invalid(f"{name} must be a positive integer (got {max_tokens})", param=name)

    sent_as = {"max_tokens": "max_completion_tokens"} if body.max_completion_tokens is not None else {}
    sent_as["logprobs"] = "top_logprobs"
    messages = openai_messages(body.messages, state_of(request).resolve(body.model, "openai").id)
    return await _generate(
        request, body, "chat", pipeline.chat_prompt(messages), max_tokens, _logprobs_count(body), principal,
        sent_as=sent_as, prompt_chars=pipeline.message_chars(messages),
    )


@router.post("/v1/completions", summary="OpenAI completions")
async def completions(body: CompletionRequest, request: Request, principal: Principal = Depends(authenticate)) -> Response:
    check_limits(body)
    raw = [body.prompt] if isinstance(body.prompt, str) or (body.prompt and isinstance(body.prompt[0], int)) else body.prompt
    if len(raw) * body.n > MAX_CHOICES:  # before any prompt is tokenised
        raise invalid(f"at most {MAX_CHOICES} choices (prompts x n) per request", param="prompt")
    if body.max_tokens is not None and body.max_tokens < 1:
        raise invalid(f"max_tokens must be a positive integer (got {body.max_tokens})", param="max_tokens")
    if body.logprobs is not None and not 0 <= body.logprobs <= 20:
        raise invalid("logprobs must be between 0 and 20", param="logprobs")
    if body.echo and body.logprobs is not None:
        raise invalid("echo with logprobs is not supported", param="echo")

    def prompts(tokenizer) -> list[PromptInput]:
        if not raw:
            raise invalid("prompt must not be empty", param="prompt")
        out = []
        for i, p in enumerate(raw):
            if not p:  # an empty string or an empty list of token ids
                raise invalid(f"prompt[{i}] must not be empty", param="prompt")
            if isinstance(p, str):
                out.append(PromptInput(p, tokenizer.encode(p)))
            else:
                if any(t < 0 or t >= tokenizer.vocab_size for t in p):
                    raise invalid(f"prompt[{i}]: token ids must be in [0, {tokenizer.vocab_size})", param="prompt")
                out.append(PromptInput(tokenizer.decode(p), list(p)))
        return out

    chars = sum(len(p) for p in raw)  # token ids count as characters: decoding them is work too
    return await _generate(
        request, body, "text", prompts, body.max_tokens, body.logprobs, principal, echo=body.echo, prompt_chars=chars
    )


@router.post("/v1/embeddings", summary="OpenAI embeddings")
async def embeddings(body: EmbeddingRequest, request: Request, principal: Principal = Depends(authenticate)) -> Response:
    call = pipeline.http_call(request, body.model, "openai", kind="embed", method="embeddings")
    texts = [body.input] if isinstance(body.input, str) else body.input
    if not texts:
        raise invalid("input must not be empty", param="input")
    if not all(isinstance(t, str) for t in texts):
        raise invalid("input: token-id inputs are not supported for this model; send strings", param="input")
    if any(not t for t in texts):
        raise invalid("input: strings must not be empty", param="input")
    limit = call.state.config.embeddings.max_batch if call.state.config.embeddings else 100
    if len(texts) > limit:
        raise invalid(f"input: at most {limit} inputs per request (got {len(texts)})", param="input")
    encoder = await pipeline.encoder_of(call.state, call.model, call.deadline, call.guard)
    if body.dimensions is not None and not 1 <= body.dimensions <= encoder.dimensions:
        raise invalid(f"dimensions must be between 1 and {encoder.dimensions}", param="dimensions")
    vectors = await pipeline.embed(call.state, call.model, texts, call.deadline, call.guard)
    vectors = truncate(vectors, body.dimensions).numpy().astype("<f4")
    data = []
    for i, v in enumerate(vectors):
        emb = base64.b64encode(v.tobytes()).decode() if body.encoding_format == "base64" else v.tolist()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    tokens = sum(await pipeline.off_loop(sum(map(len, texts)), encoder.count_tokens, texts))
    return JSONResponse(
        {"object": "list", "data": data, "model": body.model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    )

