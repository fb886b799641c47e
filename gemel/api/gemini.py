"""Gemini REST surface, served under ``/v1beta`` and ``/v1``.

Request bodies are parsed with proto3 JSON rules into the official
``google.ai.generativelanguage`` messages (camelCase or snake_case names, enum names or
numbers, integral floats for integers), so anything the SDKs or curl send is read the way
Google reads it. Responses are plain JSON with the camelCase names the SDKs expect.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from google.protobuf import json_format
from google.protobuf.message import Message
from starlette.responses import JSONResponse, Response

from gemel.api.auth import Principal, authenticate
from gemel.api.errors import APIError, gemini_error, invalid
from gemel.api.inputs import check_gemini_base64, gemini_messages, gemini_parts_text
from gemel.api.lifecycle import Deadline
from gemel.api.params import camel, gemini_fields, make_params, plain_knobs
from gemel.api import pipeline
from gemel.api.pipeline import Generation, GenerationRequest, Guard, HttpCall
from gemel.api.state import ServedModel, ServerState
from gemel.api.structured import gemini_spec
from gemel.embeddings.vectors import truncate
from gemel.engine.output_processor import CompletionOutput, RequestOutput, TokenLogprob
from gemel.sampling_params import SamplingParams

router = APIRouter(tags=["gemini"])

FINISH_REASON = {"stop": "STOP", "length": "MAX_TOKENS", "abort": "OTHER"}

# generationConfig fields gemel honours (the decoding knobs and the answer's form), and those
# accepted and ignored (proto field names).
HONOURED = gemini_fields() | {
    "response_logprobs", "response_mime_type", "response_modalities", "response_schema", "response_json_schema",
}
IGNORED = {"thinking_config"}


def _types():
    from google.ai.generativelanguage_v1beta import types

    return types


def api_version(request: Request) -> str:
    return "v1" if request.url.path.startswith("/v1/") else "v1beta"


async def read_json(request: Request) -> dict:
    """The body as a JSON object whatever the Content-Type (curl users often omit it)."""
    raw = await request.body()
    try:
        body = json.loads(raw) if raw.strip() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise invalid(f"Invalid JSON payload received. {e}") from None
    if not isinstance(body, dict):
        raise invalid("Invalid JSON payload received. Expected an object at the top level.")
    return body


def parse(body: dict, message_type) -> Message:
    """Proto3 JSON -> the official request message; wrong types answer 400 naming the field."""
    check_gemini_base64(body)
    try:
        return json_format.ParseDict(body, message_type.pb()(), ignore_unknown_fields=True)
    except json_format.ParseError as e:
        raise invalid(f"Invalid JSON payload received. {e}") from None
    except (TypeError, ValueError) as e:
        raise invalid(f"Invalid JSON payload received. {e}") from None


def sampling_params(req, model: ServedModel) -> SamplingParams:
    """generationConfig -> SamplingParams; fields gemel cannot honour yet are refused by name."""
    gc = req.generation_config
    for fd, _ in gc.ListFields():
        if fd.name not in HONOURED and fd.name not in IGNORED:
            raise invalid(
                f"generationConfig.{camel(fd.name)} is not supported by gemel yet",
                param=f"generationConfig.{camel(fd.name)}",
            )
    structured = gemini_spec(
        gc.response_mime_type,
        json_format.MessageToDict(gc.response_schema) if gc.HasField("response_schema") else None,
        json_format.MessageToDict(gc.response_json_schema) if gc.HasField("response_json_schema") else None,
    )
    text_modality = _types().GenerationConfig.Modality.TEXT
    if any(m != text_modality for m in gc.response_modalities):
        raise invalid("generationConfig.responseModalities: only TEXT is supported", param="generationConfig.responseModalities")
    kwargs: dict = {"stop": list(gc.stop_sequences), "structured_output": structured}
    if gc.HasField("max_output_tokens"):
        if gc.max_output_tokens < 1:
            raise invalid(
                f"generationConfig.maxOutputTokens must be a positive integer (got {gc.max_output_tokens})",
                param="generationConfig.maxOutputTokens",
            )
        if gc.max_output_tokens > model.max_output_tokens:
            raise invalid(
                f"generationConfig.maxOutputTokens: {gc.max_output_tokens} is more than model {model.id}'s "
                f"limit of {model.max_output_tokens}",
                param="generationConfig.maxOutputTokens",
            )
        kwargs["max_tokens"] = gc.max_output_tokens
    else:
        kwargs["max_tokens"] = model.max_output_tokens
    for proto_name, name in plain_knobs("gemini"):
        if gc.HasField(proto_name):
            kwargs[name] = getattr(gc, proto_name)
    if gc.HasField("top_k"):
        if gc.top_k < 0:
            raise invalid("generationConfig.topK must be >= 0", param="generationConfig.topK")
        kwargs["top_k"] = gc.top_k
    if gc.HasField("logprobs") and not gc.response_logprobs:
        raise invalid(
            "generationConfig.logprobs is only allowed when generationConfig.responseLogprobs is true",
            param="generationConfig.logprobs",
        )
    if gc.response_logprobs:
        kwargs["logprobs"] = gc.logprobs if gc.HasField("logprobs") else 0
    return make_params(kwargs, "gemini")


def refuse_unsupported(req) -> None:
    """Tools and cached contents change the answer's meaning: refuse them rather than ignore them."""
    for fd, _ in req.ListFields():
        if fd.name in ("tools", "tool_config", "cached_content"):
            raise invalid(f"{camel(fd.name)} is not supported by gemel yet", param=camel(fd.name))


# -- responses ---------------------------------------------------------------------------
class ResponseBuilder:
    """Turns engine outputs into GenerateContentResponse JSON, unary or chunk by chunk."""

    def __init__(self, model: ServedModel, prompt_tokens: int, logprobs: int | None, tokenizer):
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.logprobs = logprobs
        self.tokenizer = tokenizer
        self.response_id = uuid.uuid4().hex[:24]
        self.finished: set[int] = set()

    def usage(self, out: RequestOutput) -> dict:
        generated = sum(len(c.token_ids) for c in out.outputs)
        usage = {
            "promptTokenCount": self.prompt_tokens,
            "candidatesTokenCount": generated,
            "totalTokenCount": self.prompt_tokens + generated,
            "promptTokensDetails": [{"modality": "TEXT", "tokenCount": self.prompt_tokens}],
        }
        if out.num_cached_tokens:
            usage["cachedContentTokenCount"] = out.num_cached_tokens
        return usage

    def _logprobs_result(self, lps: list[TokenLogprob]) -> dict:
        token = lambda i: self.tokenizer.decode([i], skip_special_tokens=False)  # noqa: E731
        result = {
            "chosenCandidates": [{"token": token(lp.token_id), "tokenId": lp.token_id, "logProbability": lp.logprob} for lp in lps],
            "logProbabilitySum": sum(lp.logprob for lp in lps),
        }
        if self.logprobs:
            result["topCandidates"] = [
                {"candidates": [{"token": token(t), "tokenId": t, "logProbability": p} for t, p in lp.top[: self.logprobs]]}
                for lp in lps
            ]
        return result

    def _candidate(self, c: CompletionOutput, text: str, lps: list[TokenLogprob] | None) -> dict:
        cand: dict = {"content": {"parts": [{"text": text}], "role": "model"}, "index": c.index}
        if c.finish_reason is not None:
            cand["finishReason"] = FINISH_REASON.get(c.finish_reason, "OTHER")
        if self.logprobs is not None and lps is not None:
            cand["logprobsResult"] = self._logprobs_result(lps)
            if c.finish_reason is not None and c.logprobs:
                cand["avgLogprobs"] = sum(lp.logprob for lp in c.logprobs) / len(c.logprobs)
        return cand

    def _envelope(self, candidates: list[dict], out: RequestOutput) -> dict:
        return {
            "candidates": candidates,
            "usageMetadata": self.usage(out),
            "modelVersion": self.model.model_version,
            "responseId": self.response_id,
        }

    def unary(self, out: RequestOutput) -> dict:
        return self._envelope([self._candidate(c, c.text, c.logprobs) for c in out.outputs], out)

    def chunk(self, out: RequestOutput) -> dict | None:
        """The stream chunk of one engine output, or None when it brings nothing new."""
        candidates = []
        for c in out.outputs:
            if c.index in self.finished:
                continue
            if c.delta_text or c.finish_reason is not None:
                candidates.append(self._candidate(c, c.delta_text, c.delta_logprobs))
            if c.finish_reason is not None:
                self.finished.add(c.index)
        return self._envelope(candidates, out) if candidates else None


# -- the generation routes ---------------------------------------------------------------
def generation_request(model: ServedModel, req, deadline: Deadline) -> GenerationRequest:
    """A GenerateContentRequest (the protobuf; REST and gRPC alike) -> the shared request."""
    refuse_unsupported(req)
    params = sampling_params(req, model)
    system = req.system_instruction if req.HasField("system_instruction") else None
    return GenerationRequest(model, params, deadline, pipeline.chat_prompt(gemini_messages(req.contents, system, model.id)))


def response_builder(gen: Generation) -> ResponseBuilder:
    req = gen.request
    return ResponseBuilder(req.model, gen.prompt_tokens, req.params.logprobs, req.model.engine.tokenizer)


async def _start(request: Request, model: str, method: str, principal: Principal) -> tuple[HttpCall, Generation]:
    call = pipeline.http_call(request, model, "gemini", api_version(request), "generate", method)
    req = generation_request(call.model, parse(await read_json(request), _types().GenerateContentRequest), call.deadline)
    return call, await pipeline.start_generation(call.state, req, principal, call.guard)


@router.post("/models/{model}:generateContent", summary="Gemini generateContent")
async def generate_content(model: str, request: Request, principal: Principal = Depends(authenticate)) -> Response:
    call, gen = await _start(request, model, "generateContent", principal)
    (out,) = await pipeline.finish(gen, call.guard)
    return JSONResponse(response_builder(gen).unary(out))


@router.post("/models/{model}:streamGenerateContent", summary="Gemini streamGenerateContent (SSE or JSON array)")
async def stream_generate_content(model: str, request: Request, principal: Principal = Depends(authenticate)) -> Response:
    alt = request.query_params.get("alt") or request.query_params.get("$alt") or "json"
    if alt not in ("sse", "json"):
        raise invalid(f"alt must be sse or json (got {alt!r})", param="alt")
    call, gen = await _start(request, model, "streamGenerateContent", principal)
    items = await pipeline.relay(gen, call.guard)
    builder = response_builder(gen)
    sse = alt == "sse"

    def encode(obj: dict, index: int) -> str:
        data = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
        if sse:
            return f"data: {data}\r\n\r\n"
        return ("[" if index == 0 else ",\r\n") + data

    async def events() -> AsyncIterator[str]:
        sent = 0
        try:
            async for item in items:
                if isinstance(item, APIError):  # the status line is gone: the error travels as an event
                    yield encode(gemini_error(item), sent)
                    sent += 1
                    break
                _, out = item
                chunk = builder.chunk(out)
                if chunk is not None or (out.finished and sent == 0):
                    yield encode(chunk or builder.unary(out), sent)
                    sent += 1
        finally:
            await items.aclose()
        if not sse:
            yield "]" if sent else "[]"

    return pipeline.stream_response(events(), "text/event-stream" if sse else "application/json")


@router.post("/models/{model}:countTokens", summary="Gemini countTokens")
async def count_tokens(model: str, request: Request, principal: Principal = Depends(authenticate)) -> Response:
    call = pipeline.http_call(request, model, "gemini", api_version(request), "any")
    req = parse(await read_json(request), _types().CountTokensRequest)
    return JSONResponse(await count_tokens_result(call.state, call.model, req, call.deadline, call.guard))


async def count_tokens_result(st: ServerState, served: ServedModel, req, deadline: Deadline, guard: Guard) -> dict:
    """CountTokensResponse JSON for a parsed request (REST and gRPC)."""
    if req.HasField("generate_content_request"):
        inner = req.generate_content_request
        contents, system = inner.contents, inner.system_instruction if inner.HasField("system_instruction") else None
    else:
        contents, system = req.contents, None
    if served.kind == "embed":
        if not contents:
            raise invalid("contents is not specified", param="contents")
        texts = [gemini_parts_text(c, f"contents[{i}]", served.id) for i, c in enumerate(contents)]
        total = await pipeline.count_text_tokens(st, served, texts, deadline, guard)
    else:
        total = await pipeline.count_chat_tokens(st, served, gemini_messages(contents, system, served.id), guard)
    return {"totalTokens": total, "promptTokensDetails": [{"modality": "TEXT", "tokenCount": total}]}


# -- embeddings ----------------------------------------------------------------------------
def _embed_text(req, where: str, model_id: str) -> str:
    if not req.HasField("content") or not req.content.parts:
        raise invalid(f"{where}content is not specified", param=f"{where}content")
    return gemini_parts_text(req.content, f"{where}content", model_id)


def _dimensions(req, where: str, dims: int) -> int | None:
    if not req.HasField("output_dimensionality"):
        return None
    d = req.output_dimensionality
    if d < 1 or d > dims:
        raise invalid(f"{where}outputDimensionality must be between 1 and {dims} (got {d})", param=f"{where}outputDimensionality")
    return d


def _embedding(vectors, dims: int | None) -> dict:
    """One ContentEmbedding: the unit vector cut to ``dims`` (non-finite values as 0)."""
    return {"values": [float(x) if math.isfinite(x) else 0.0 for x in truncate(vectors, dims)[0].tolist()]}


async def embed_content_result(st: ServerState, served: ServedModel, req, deadline: Deadline, guard: Guard) -> dict:
    """EmbedContentResponse JSON for a parsed request (REST and gRPC)."""
    encoder = await pipeline.encoder_of(st, served, deadline, guard)
    text = _embed_text(req, "", served.id)
    dims = _dimensions(req, "", encoder.dimensions)
    return {"embedding": _embedding(await pipeline.embed(st, served, [text], deadline, guard), dims)}


async def batch_embed_result(
    st: ServerState, served: ServedModel, req, deadline: Deadline, guard: Guard, version: str, outer: str
) -> dict:
    """BatchEmbedContentsResponse JSON for a parsed request (REST and gRPC); ``outer`` names
    where the request's model came from, for an inner request naming another."""
    if not req.requests:
        raise invalid("requests is not specified", param="requests")
    limit = st.config.embeddings.max_batch if st.config.embeddings else 100
    if len(req.requests) > limit:
        raise invalid(f"requests: at most {limit} requests are allowed in a batch (got {len(req.requests)})", param="requests")
    encoder = await pipeline.encoder_of(st, served, deadline, guard)
    texts, dims = [], []
    for i, r in enumerate(req.requests):
        where = f"requests[{i}]."
        if r.model and st.resolve(r.model, "gemini", version) is not served:
            raise invalid(f"{where}model: {r.model} differs from {outer}", param=f"{where}model")
        texts.append(_embed_text(r, where, served.id))
        dims.append(_dimensions(r, where, encoder.dimensions))
    vectors = await pipeline.embed(st, served, texts, deadline, guard)
    return {"embeddings": [_embedding(vectors[i : i + 1], d) for i, d in enumerate(dims)]}


@router.post("/models/{model}:embedContent", summary="Gemini embedContent")
async def embed_content(model: str, request: Request, principal: Principal = Depends(authenticate)) -> Response:
    call = pipeline.http_call(request, model, "gemini", api_version(request), "embed", "embedContent")
    req = parse(await read_json(request), _types().EmbedContentRequest)
    return JSONResponse(await embed_content_result(call.state, call.model, req, call.deadline, call.guard))


@router.post("/models/{model}:batchEmbedContents", summary="Gemini batchEmbedContents")
async def batch_embed_contents(model: str, request: Request, principal: Principal = Depends(authenticate)) -> Response:
    version = api_version(request)
    call = pipeline.http_call(request, model, "gemini", version, "embed", "batchEmbedContents")
    req = parse(await read_json(request), _types().BatchEmbedContentsRequest)
    outer = f"the model in the URL (models/{model})"
    return JSONResponse(await batch_embed_result(call.state, call.model, req, call.deadline, call.guard, version, outer))


@router.get("/tunedModels", summary="Gemini tunedModels.list (gemel serves none)")
async def tuned_models(principal: Principal = Depends(authenticate)) -> Response:
    return JSONResponse({})
