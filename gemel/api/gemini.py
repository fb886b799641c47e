"""Gemini REST surface (SPEC F30), served under ``/v1beta`` and ``/v1``.

Request bodies are parsed with proto3 JSON rules into the official
``google.ai.generativelanguage`` messages (camelCase or snake_case names, enum names or
numbers, integral floats for integers), so anything the SDKs or curl send is read the way
Google reads it. Responses are plain JSON with the camelCase names the SDKs expect.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import AsyncIterator, Awaitable

from fastapi import APIRouter, Depends, Request
from google.protobuf import json_format
from google.protobuf.message import Message
from starlette.responses import JSONResponse, Response, StreamingResponse

from gemel.api.auth import Principal, authenticate
from gemel.api.errors import APIError, as_api_error, gemini_error, invalid
from gemel.api.inputs import build_params, check_gemini_base64, gemini_messages, gemini_parts_text
from gemel.api.lifecycle import Deadline, collect, first_output, guarded
from gemel.api.state import ServedModel, ServerState, mark_model, state_of
from gemel.api.structured import gemini_spec
from gemel.embeddings.vectors import truncate
from gemel.engine.output_processor import CompletionOutput, RequestOutput, TokenLogprob
from gemel.sampling_params import SamplingParams

router = APIRouter(tags=["gemini"])

FINISH_REASON = {"stop": "STOP", "length": "MAX_TOKENS", "abort": "OTHER"}

# generationConfig fields gemel honours, and those accepted and ignored (proto field names).
HONOURED = {
    "candidate_count", "stop_sequences", "max_output_tokens", "temperature", "top_p", "top_k", "seed",
    "presence_penalty", "frequency_penalty", "response_logprobs", "logprobs", "response_mime_type",
    "response_modalities", "response_schema", "response_json_schema",
}
IGNORED = {"thinking_config"}
# SamplingParams field -> the Gemini name its validation errors should carry.
GEMINI_NAMES = {
    "n": "generationConfig.candidateCount",
    "temperature": "generationConfig.temperature",
    "top_p": "generationConfig.topP",
    "top_k": "generationConfig.topK",
    "presence_penalty": "generationConfig.presencePenalty",
    "frequency_penalty": "generationConfig.frequencyPenalty",
    "max_tokens": "generationConfig.maxOutputTokens",
    "logprobs": "generationConfig.logprobs",
    "stop strings": "generationConfig.stopSequences",
    "at most 16 stop strings": "generationConfig.stopSequences",
    "seed": "generationConfig.seed",
}


def _types():
    from google.ai.generativelanguage_v1beta import types

    return types


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(w.title() for w in rest)


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
    for proto_name, name in (
        ("candidate_count", "n"), ("temperature", "temperature"), ("top_p", "top_p"), ("seed", "seed"),
        ("presence_penalty", "presence_penalty"), ("frequency_penalty", "frequency_penalty"),
    ):
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
    return build_params(kwargs, GEMINI_NAMES)


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
class GenerateJob:
    """A parsed, validated generateContent request, ready for the engine.

    Transport-agnostic: the REST routes build one with ``from_http``, the gRPC surface
    (``gemel.api.grpc_server``) with the proto it received; both then ``launch`` it."""

    def __init__(self, state: ServerState, model: ServedModel, req, deadline: Deadline):
        self.state = state
        self.model = model
        self.deadline = deadline
        refuse_unsupported(req)
        self.params = sampling_params(req, self.model)
        engine = self.model.engine
        self.engine = engine
        self.messages = gemini_messages(
            req.contents, req.system_instruction if req.HasField("system_instruction") else None, self.model.id
        )
        self.request_id = uuid.uuid4().hex

    @classmethod
    def from_http(cls, request: Request, model_name: str, body: dict, method: str) -> GenerateJob:
        state = state_of(request)
        model = state.generative(model_name, "gemini", api_version(request), method)
        mark_model(request, model)
        deadline = Deadline.from_request(request, state.config.server)
        return cls(state, model, parse(body, _types().GenerateContentRequest), deadline)

    def wait_ready(self) -> Awaitable[None]:
        """The engine's readiness, bounded by the deadline (the caller guards it)."""
        return self.engine.wait_ready(min(self.deadline.remaining(), self.state.config.server.engine_ready_timeout_s))

    async def launch(self, principal: Principal) -> AsyncIterator[RequestOutput]:
        """Tokenise and hand the request to the engine; every surface goes through here."""
        engine = self.engine
        tok = engine.tokenizer
        prompt = tok.apply_chat_template(self.messages, add_generation_prompt=True)
        prompt_ids = tok.encode_chat(self.messages, add_generation_prompt=True)
        self.builder = ResponseBuilder(self.model, len(prompt_ids), self.params.logprobs, tok)
        # the gateway (F42, F43): class queue bound and tokens/min reservation, then the tenant's
        # class as the engine priority (F14) and its engine quota (F15)
        self.params.priority = principal.priority_for(None)
        await principal.admit_generation(len(prompt_ids), self.params.max_tokens * self.params.n)
        stream = engine.generate(
            self.request_id, prompt, prompt_ids, self.params, principal.tenant, self.deadline.at, quota=principal.quota
        )
        return principal.meter(stream)

    async def start(self, request: Request, principal: Principal) -> AsyncIterator[RequestOutput]:
        await guarded(request, self.wait_ready(), self.deadline)
        return await self.launch(principal)


@router.post("/models/{model}:generateContent", summary="Gemini generateContent")
async def generate_content(model: str, request: Request, principal: Principal = Depends(authenticate)) -> Response:
    job = GenerateJob.from_http(request, model, await read_json(request), "generateContent")
    stream = await job.start(request, principal)
    out = await collect(request, stream, job.deadline)
    return JSONResponse(job.builder.unary(out))


@router.post("/models/{model}:streamGenerateContent", summary="Gemini streamGenerateContent (SSE or JSON array)")
async def stream_generate_content(model: str, request: Request, principal: Principal = Depends(authenticate)) -> Response:
    alt = request.query_params.get("alt") or request.query_params.get("$alt") or "json"
    if alt not in ("sse", "json"):
        raise invalid(f"alt must be sse or json (got {alt!r})", param="alt")
    job = GenerateJob.from_http(request, model, await read_json(request), "streamGenerateContent")
    stream = await job.start(request, principal)
    first = await guarded(request, first_output(stream), job.deadline)  # errors so far get a real status
    sse = alt == "sse"

    def encode(obj: dict, index: int) -> str:
        data = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
        if sse:
            return f"data: {data}\r\n\r\n"
        return ("[" if index == 0 else ",\r\n") + data

    async def events() -> AsyncIterator[str]:
        sent = 0
        try:
            out = first
            while True:
                chunk = job.builder.chunk(out)
                if chunk is not None or (out.finished and sent == 0):
                    yield encode(chunk or job.builder.unary(out), sent)
                    sent += 1
                if out.finished:
                    break
                out = await stream.__anext__()
        except StopAsyncIteration:
            pass
        except TimeoutError:
            yield encode(gemini_error(job.deadline.exceeded("mid-stream")), sent)
            sent += 1
        except Exception as e:  # the status line is gone: the error travels as an event
            yield encode(gemini_error(as_api_error(e)), sent)
            sent += 1
        finally:
            await stream.aclose()
        if not sse:
            yield "]" if sent else "[]"

    media = "text/event-stream" if sse else "application/json"
    return StreamingResponse(events(), media_type=media, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@router.post("/models/{model}:countTokens", summary="Gemini countTokens")
async def count_tokens(model: str, request: Request, principal: Principal = Depends(authenticate)) -> Response:
    st = state_of(request)
    served = st.resolve(model, "gemini", api_version(request))
    mark_model(request, served)
    req = parse(await read_json(request), _types().CountTokensRequest)
    return JSONResponse(await count_tokens_result(st, served, req))


async def count_tokens_result(st: ServerState, served: ServedModel, req) -> dict:
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
        encoder = await st.encoder(served, st.config.server.engine_ready_timeout_s)
        total = sum(encoder.count_tokens(texts))
    else:
        messages = gemini_messages(contents, system, served.id)
        engine = served.engine
        if engine.tokenizer is None:
            raise APIError(503, "the model is still loading; retry shortly", retry_after_s=5)
        total = len(engine.tokenizer.encode_chat(messages, add_generation_prompt=True))
    return {"totalTokens": total, "promptTokensDetails": [{"modality": "TEXT", "tokenCount": total}]}


# -- embeddings ----------------------------------------------------------------------------
def _embed_text(req, where: str, model_id: str) -> str:
    if not req.HasField("content") or not req.content.parts:
        raise invalid(f"{where}content is not specified", param=f"{where}content")
    text = gemini_parts_text(req.content, f"{where}content", model_id)
    return text


def _dimensions(req, where: str, dims: int) -> int | None:
    if not req.HasField("output_dimensionality"):
        return None
    d = req.output_dimensionality
    if d < 1 or d > dims:
        raise invalid(f"{where}outputDimensionality must be between 1 and {dims} (got {d})", param=f"{where}outputDimensionality")
    return d


def _values(vec) -> list[float]:
    return [float(x) if math.isfinite(x) else 0.0 for x in vec.tolist()]


def check_batch_size(st: ServerState, req) -> None:
    if not req.requests:
        raise invalid("requests is not specified", param="requests")
    limit = st.config.embeddings.max_batch if st.config.embeddings else 100
    if len(req.requests) > limit:
        raise invalid(f"requests: at most {limit} requests are allowed in a batch (got {len(req.requests)})", param="requests")


def batch_embed_inputs(
    st: ServerState, served: ServedModel, req, dimensions: int, version: str, outer: str
) -> tuple[list[str], list[int | None]]:
    """The texts and output sizes of a BatchEmbedContentsRequest (REST and gRPC)."""
    texts, dims = [], []
    for i, r in enumerate(req.requests):
        where = f"requests[{i}]."
        if r.model and st.resolve(r.model, "gemini", version) is not served:
            raise invalid(f"{where}model: {r.model} differs from {outer}", param=f"{where}model")
        texts.append(_embed_text(r, where, served.id))
        dims.append(_dimensions(r, where, dimensions))
    return texts, dims


@router.post("/models/{model}:embedContent", summary="Gemini embedContent")
async def embed_content(model: str, request: Request, principal: Principal = Depends(authenticate)) -> Response:
    st = state_of(request)
    served = st.embedding(model, "gemini", api_version(request))
    mark_model(request, served)
    deadline = Deadline.from_request(request, st.config.server)
    req = parse(await read_json(request), _types().EmbedContentRequest)
    encoder = await guarded(request, st.encoder(served, deadline.remaining()), deadline)
    text = _embed_text(req, "", served.id)
    dims = _dimensions(req, "", encoder.dimensions)
    vectors = await guarded(request, st.embed(served, [text], deadline.remaining()), deadline)
    return JSONResponse({"embedding": {"values": _values(truncate(vectors, dims)[0])}})


@router.post("/models/{model}:batchEmbedContents", summary="Gemini batchEmbedContents")
async def batch_embed_contents(model: str, request: Request, principal: Principal = Depends(authenticate)) -> Response:
    st = state_of(request)
    served = st.embedding(model, "gemini", api_version(request), "batchEmbedContents")
    mark_model(request, served)
    deadline = Deadline.from_request(request, st.config.server)
    req = parse(await read_json(request), _types().BatchEmbedContentsRequest)
    check_batch_size(st, req)
    encoder = await guarded(request, st.encoder(served, deadline.remaining()), deadline)
    texts, dims = batch_embed_inputs(st, served, req, encoder.dimensions, api_version(request), f"the model in the URL (models/{model})")
    vectors = await guarded(request, st.embed(served, texts, deadline.remaining()), deadline)
    return JSONResponse({"embeddings": [{"values": _values(truncate(vectors[i : i + 1], d)[0])} for i, d in enumerate(dims)]})


@router.get("/tunedModels", summary="Gemini tunedModels.list (gemel serves none)")
async def tuned_models(principal: Principal = Depends(authenticate)) -> Response:
    return JSONResponse({})
