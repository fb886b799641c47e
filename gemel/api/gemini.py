"""Gemini REST surface, served under ``/v1beta`` and ``/v1``.

Request bodies are parsed with proto3 JSON rules into the official
``google.ai.generativelanguage`` messages (camelCase or snake_case names, enum names or
numbers, integral floats for integers), so anything the SDKs or curl send is read the way
Google reads it. Responses are plain JSON with the camelCase names the SDKs expect.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import uuid
from collections.abc import AsyncIterator
from functools import cache
from typing import Any

from fastapi import APIRouter, Depends, Request
from google.protobuf import json_format
from google.protobuf.message import Message
from starlette.responses import JSONResponse, Response

from gemel.api.auth import Principal, authenticate
from gemel.api.errors import APIError, gemini_error, invalid
from gemel.api.inputs import check_gemini_base64, gemini_messages, gemini_parts_text
from gemel.api.lifecycle import Deadline
from gemel.api.limits import (
    GEMINI_MAX_STOP_SEQUENCES, MAX_CONTENTS, MAX_PARTS, MAX_SCHEMA_VALUES, JsonShape, check_count, check_schema_size,
    count_values, too_large,
)
from gemel.api.params import camel, gemini_fields, make_params, plain_knobs
from gemel.api import pipeline
from gemel.api.pipeline import Generation, GenerationRequest, Guard, HttpCall
from gemel.api.state import ServedModel, ServerState
from gemel.api.structured import gemini_spec
from gemel.config import ServerConfig
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
OFF_LOOP_BYTES = 1 << 20  # a larger body is parsed on a worker thread


def _types():
    from google.ai.generativelanguage_v1beta import types

    return types


def api_version(request: Request) -> str:
    return "v1" if request.url.path.startswith("/v1/") else "v1beta"


async def read_json(request: Request) -> dict:
    """The body as a JSON object whatever the Content-Type (curl users often omit it). Its size
    and shape are checked before ``json.loads`` unless the limits middleware checked them."""
    raw = await request.body()
    if not getattr(request.state, "body_checked", False):
        state = getattr(request.app.state, "gemel", None)
        server = state.config.server if state is not None else ServerConfig()
        limit = int(server.max_body_mb * 1024 * 1024)
        if len(raw) > limit:
            raise too_large(limit, len(raw))
        shape = JsonShape(server.max_json_depth, server.max_json_values)
        if await shape.feed_yielding(raw) or shape.finish():
            raise invalid(shape.problem)
    try:
        body = json.loads(raw) if raw.strip() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise invalid(f"Invalid JSON payload received. {e}") from None
    except RecursionError:
        raise invalid("Invalid JSON payload received. Nesting too deep.") from None
    if not isinstance(body, dict):
        raise invalid("Invalid JSON payload received. Expected an object at the top level.")
    return body


def parse(body: dict, message_type) -> Message:
    """Proto3 JSON -> the official request message; wrong types answer 400 naming the field.
    Unknown fields are ignored (as Google does); unknown enum values are refused by name."""
    check_gemini_base64(body)
    walk = JsonWalk()
    walk.message(body, message_type.pb().DESCRIPTOR)
    try:
        message = json_format.ParseDict(body, message_type.pb()(), ignore_unknown_fields=True)
        walk.restore(message)
        return message
    except json_format.ParseError as e:
        raise invalid(f"Invalid JSON payload received. {e}") from None
    except (TypeError, ValueError) as e:
        raise invalid(f"Invalid JSON payload received. {e}") from None
    except RecursionError:
        raise invalid("Invalid JSON payload received. Nesting too deep.") from None


# -- checks on the decoded JSON, before protobuf parses it -------------------------------------
@cache
def _fields(descriptor) -> dict:
    """A message's fields by JSON name and by proto name (ParseDict accepts both)."""
    return {**{f.name: f for f in descriptor.fields}, **{f.json_name: f for f in descriptor.fields}}


def _get(obj: Any, name: str) -> Any:
    """Field ``name`` (camelCase) of a JSON object, sent under either spelling."""
    if not isinstance(obj, dict):
        return None
    value = obj.get(name)
    return value if value is not None else obj.get(re.sub(r"([A-Z])", lambda m: "_" + m.group(1).lower(), name))


def _check_enum(value: Any, enum, where: str) -> None:
    if isinstance(value, bool):
        return  # not an enum value at all: ParseDict says so
    if isinstance(value, str):
        if value in enum.values_by_name:
            return
        number = int(value) if re.fullmatch(r"-?\d{1,10}", value) else None
    elif isinstance(value, int):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    else:
        return
    if number is None or number not in enum.values_by_number:
        raise invalid(
            f"Invalid value at '{where}' (type.googleapis.com/{enum.full_name}), {json.dumps(value)}", param=where
        )


class JsonWalk:
    """One walk over the known fields of a message's JSON, before protobuf parses it.

    Every enum value must be one of the enum's names or numbers (protobuf's parser, told to
    ignore unknown fields, would drop an unknown name silently and keep an unknown number);
    free-form JSON (Struct, Value) may hold at most ``MAX_SCHEMA_VALUES`` values in all, as
    parsing it is slow; long strings are set aside (``long``) and set on the message after
    parsing, as the parser's surrogate check scans them with a regular expression that holds
    the GIL (a second per 20 MB)."""

    LONG = 1 << 16

    def __init__(self) -> None:
        self.free_form = 0
        self.long: list[tuple[tuple, str, str]] = []  # (steps to the message, field name, text)

    def message(self, obj: Any, descriptor, path: str = "", steps: tuple = ()) -> None:
        if not isinstance(obj, dict):
            return
        fields = _fields(descriptor)
        for key, value in list(obj.items()):
            fd = fields.get(key)
            if fd is None or value is None:
                continue
            where = f"{path}.{fd.json_name}" if path else fd.json_name
            if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
                value_fd = fd.message_type.fields_by_name["value"]
                if isinstance(value, dict):
                    for k, item in value.items():
                        self.value(item, value_fd, f"{where}.{k}", (*steps, (fd.name, k)))
            elif _repeated(fd):
                if isinstance(value, list):
                    for i, item in enumerate(value):
                        self.value(item, fd, f"{where}[{i}]", (*steps, (fd.name, i)))
            elif fd.type == fd.TYPE_STRING and isinstance(value, str) and len(value) > self.LONG:
                if not value.isascii():
                    try:
                        value.encode("utf-8")
                    except UnicodeEncodeError:
                        raise invalid(f"{where} holds an unpaired surrogate", param=where) from None
                self.long.append((steps, fd.name, value))
                obj[key] = ""
            else:
                self.value(value, fd, where, (*steps, (fd.name, None)))

    def value(self, value: Any, fd, where: str, steps: tuple) -> None:
        if fd.enum_type is not None:
            _check_enum(value, fd.enum_type, where)
        elif fd.message_type is not None:
            if fd.message_type.full_name.startswith("google.protobuf."):
                self.free_form += count_values(value, MAX_SCHEMA_VALUES)
                if self.free_form > MAX_SCHEMA_VALUES:
                    raise invalid(
                        f"{where} is too large: free-form JSON fields may hold at most {MAX_SCHEMA_VALUES} values in all",
                        param=where,
                    )
            else:
                self.message(value, fd.message_type, where, steps)

    def restore(self, message: Message) -> None:
        """Set the long strings set aside on the parsed message."""
        for steps, name, text in self.long:
            target = message
            for field, index in steps:
                target = getattr(target, field)
                if index is not None:
                    target = target[index]
            setattr(target, name, text)


def check_values(obj: Any, descriptor) -> None:
    """The enum and free-form checks of ``JsonWalk`` alone (a message that came as protobuf)."""
    JsonWalk().message(obj, descriptor)


def _repeated(fd) -> bool:
    flag = getattr(fd, "is_repeated", None)  # newer protobuf; ``label`` is deprecated there
    return flag if flag is not None else fd.label == fd.LABEL_REPEATED


def check_contents(contents: Any, system_instruction: Any = None, where: str = "contents") -> None:
    """How many contents and parts a request may send (each becomes work before the engine);
    ``where`` names the list (``requests`` holds one content per request)."""
    check_count(contents, MAX_CONTENTS, where)
    parts = _get(system_instruction, "parts")
    total = len(parts) if isinstance(parts, list) else 0
    for i, content in enumerate(contents if isinstance(contents, list) else []):
        parts = _get(content, "parts")
        total += len(parts) if isinstance(parts, list) else 0
        if total > MAX_PARTS:
            at = f"{where}[{i}].content.parts" if where == "requests" else f"{where}[{i}].parts"
            raise invalid(f"{at} takes the request over {MAX_PARTS} parts, the most one may hold", param=at)


def check_generate_body(body: dict) -> None:
    """The limits of a GenerateContentRequest's JSON, checked before anything parses it."""
    for name in ("tools", "toolConfig", "cachedContent"):  # refused anyway: before parsing them
        if _get(body, name):
            raise invalid(f"{name} is not supported by gemel yet", param=name)
    check_contents(_get(body, "contents"), _get(body, "systemInstruction"))
    check_count(_get(body, "safetySettings"), len(_types().HarmCategory), "safetySettings")
    gc = _get(body, "generationConfig")
    check_count(_get(gc, "stopSequences"), GEMINI_MAX_STOP_SEQUENCES, "generationConfig.stopSequences", "stop sequences")
    check_count(_get(gc, "responseModalities"), len(_types().GenerationConfig.Modality), "generationConfig.responseModalities")
    for name in ("responseSchema", "responseJsonSchema", "responseJsonSchemaOrdered"):
        schema = _get(gc, name)
        if schema is not None:
            check_schema_size(schema, f"generationConfig.{name}")


def wants_schema(body: dict) -> bool:
    gc = _get(body, "generationConfig")
    return any(_get(gc, name) is not None for name in ("responseSchema", "responseJsonSchema"))


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


# -- request bodies in the OpenAPI document ------------------------------------------------------
_WELL_KNOWN = {
    "google.protobuf.Struct": {"type": "object"},
    "google.protobuf.Value": {},
    "google.protobuf.ListValue": {"type": "array"},
    "google.protobuf.Duration": {"type": "string"},
    "google.protobuf.Timestamp": {"type": "string", "format": "date-time"},
    "google.protobuf.FieldMask": {"type": "string"},
}
_INT64 = {"type": ["integer", "string"]}  # proto3 JSON writes 64-bit integers as strings, reads both
_SCALARS = {
    1: {"type": "number"}, 2: {"type": "number"}, 3: _INT64, 4: _INT64, 5: {"type": "integer"}, 6: _INT64,
    7: {"type": "integer"}, 8: {"type": "boolean"}, 9: {"type": "string"}, 12: {"type": "string", "format": "byte"},
    13: {"type": "integer"}, 15: {"type": "integer"}, 16: _INT64, 17: {"type": "integer"}, 18: _INT64,
}


# Fields gemel refuses whatever they hold (tools, cached contents, non-text parts) or does
# not read: left out of the document, which describes what gemel serves.
UNDOCUMENTED = {
    "tools", "tool_config", "cached_content", "function_call", "function_response", "executable_code",
    "code_execution_result", "video_metadata", "part_metadata", "thought_signature", "thought", "file_data",
}


# What the document says beyond the message types: the values gemel accepts.
FIELD_DOC = {
    "GenerateContentRequest.contents": {"minItems": 1, "maxItems": MAX_CONTENTS},
    "Content.role": {"enum": ["user", "model"]},
    "Content.parts": {"minItems": 1},
    "GenerationConfig.stopSequences": {"maxItems": GEMINI_MAX_STOP_SEQUENCES},
    "GenerationConfig.candidateCount": {"minimum": 1, "maximum": 16},
    "GenerationConfig.maxOutputTokens": {"minimum": 1},
    "GenerationConfig.temperature": {"minimum": 0, "maximum": 2},
    "GenerationConfig.topP": {"exclusiveMinimum": 0, "maximum": 1},
    "GenerationConfig.topK": {"minimum": 0},
    "GenerationConfig.presencePenalty": {"minimum": -2, "maximum": 2},
    "GenerationConfig.frequencyPenalty": {"minimum": -2, "maximum": 2},
    "GenerationConfig.logprobs": {"minimum": 0, "maximum": 20},
    "GenerationConfig.responseMimeType": {"enum": ["text/plain", "application/json", "text/x.enum"]},
}
REQUIRED = {"GenerateContentRequest": ["contents"], "Content": ["parts"]}
MESSAGE_DOC = {"Part": {"minProperties": 1, "maxProperties": 1}}  # one data field (text, inlineData, ...)


def _documented(fd) -> bool:
    if fd.containing_type.name == "GenerationConfig":
        return fd.name in HONOURED or fd.name in IGNORED
    return fd.name not in UNDOCUMENTED


def proto_schema(descriptor, seen: tuple[str, ...] = ()) -> dict:
    """JSON Schema of a message's proto3 JSON form (the fields gemel reads); a message inside
    itself (a Schema's ``items``) is left a plain object, so the document stays finite."""
    name = descriptor.full_name
    if name in _WELL_KNOWN:
        return dict(_WELL_KNOWN[name])
    if name.startswith("google.protobuf.") and "value" in descriptor.fields_by_name:  # wrappers
        return _field_schema(descriptor.fields_by_name["value"], seen)
    if name in seen:
        return {"type": "object"}
    seen = (*seen, name)
    properties = {}
    for fd in filter(_documented, descriptor.fields):
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            item = {"type": "object", "additionalProperties": _field_schema(fd.message_type.fields_by_name["value"], seen)}
        elif _repeated(fd):
            item = {"type": "array", "items": _field_schema(fd, seen)}
        else:
            item = _field_schema(fd, seen)
        properties[fd.json_name] = item | FIELD_DOC.get(f"{descriptor.name}.{fd.json_name}", {})
    schema = {"type": "object", "properties": properties, **MESSAGE_DOC.get(descriptor.name, {})}
    if descriptor.name in REQUIRED:
        schema["required"] = REQUIRED[descriptor.name]
    return schema


def _field_schema(fd, seen: tuple[str, ...]) -> dict:
    if fd.enum_type is not None:
        return {"type": "string", "enum": [v.name for v in fd.enum_type.values]}
    if fd.message_type is not None:
        return proto_schema(fd.message_type, seen)
    return dict(_SCALARS.get(fd.type, {}))


class BodyDoc(dict):
    """``openapi_extra`` that documents a route's body as the Gemini message ``message``. Built
    when FastAPI first writes the OpenAPI document (it reads ``items()``), as the generated
    message types take a second to import."""

    def __init__(self, message: str):
        super().__init__(requestBody=None)
        self.message = message

    def items(self):
        schema = proto_schema(getattr(_types(), self.message).pb().DESCRIPTOR)
        body = {"required": True, "content": {"application/json": {"schema": {"title": self.message, **schema}}}}
        return {"requestBody": body}.items()


# -- the generation routes ---------------------------------------------------------------
def generation_request(model: ServedModel, req, deadline: Deadline, checked: bool = False) -> GenerationRequest:
    """A GenerateContentRequest (the protobuf; REST and gRPC alike) -> the shared request.
    ``checked``: its JSON passed ``check_generate_body`` and ``parse`` (REST); else (gRPC) the
    same limits and enum checks are applied to the message here."""
    if not checked:
        body = json_format.MessageToDict(req)
        check_generate_body(body)
        check_values(body, req.DESCRIPTOR)
    refuse_unsupported(req)
    params = sampling_params(req, model)
    system = req.system_instruction if req.HasField("system_instruction") else None
    messages = gemini_messages(req.contents, system, model.id)
    return GenerationRequest(
        model, params, deadline, pipeline.chat_prompt(messages), prompt_chars=pipeline.message_chars(messages)
    )


def response_builder(gen: Generation) -> ResponseBuilder:
    req = gen.request
    return ResponseBuilder(req.model, gen.prompt_tokens, req.params.logprobs, req.model.engine.tokenizer)


async def off_loop(request: Request, fn, *args, heavy: bool = False):
    """``fn(*args)``, on a worker thread for a large body or when ``heavy`` (schemas to
    validate), so one request's parsing never stalls the others."""
    if heavy or len(await request.body()) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


async def _start(request: Request, model: str, method: str, principal: Principal) -> tuple[HttpCall, Generation]:
    call = pipeline.http_call(request, model, "gemini", api_version(request), "generate", method)
    body = await read_json(request)
    check_generate_body(body)

    def build() -> GenerationRequest:
        return generation_request(call.model, parse(body, _types().GenerateContentRequest), call.deadline, checked=True)

    req = await off_loop(request, build, heavy=wants_schema(body))
    req.route = call.route  # a routed name: the route learns how its target answered
    return call, await pipeline.start_http_generation(request, call, req, principal)


@router.post("/models/{model}:generateContent", summary="Gemini generateContent", openapi_extra=BodyDoc("GenerateContentRequest"))
async def generate_content(model: str, request: Request, principal: Principal = Depends(authenticate)) -> Response:
    call, gen = await _start(request, model, "generateContent", principal)
    (out,) = await pipeline.finish(gen, call.guard)
    return JSONResponse(response_builder(gen).unary(out))


@router.post("/models/{model}:streamGenerateContent", summary="Gemini streamGenerateContent (SSE or JSON array)", openapi_extra=BodyDoc("GenerateContentRequest"))
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


@router.post("/models/{model}:countTokens", summary="Gemini countTokens", openapi_extra=BodyDoc("CountTokensRequest"))
async def count_tokens(model: str, request: Request, principal: Principal = Depends(authenticate)) -> Response:
    call = pipeline.http_call(request, model, "gemini", api_version(request), "any")
    body = await read_json(request)
    check_contents(_get(body, "contents"))
    inner = _get(body, "generateContentRequest")
    if inner is not None:
        check_generate_body(inner)
    req = await off_loop(request, parse, body, _types().CountTokensRequest)
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


@router.post("/models/{model}:embedContent", summary="Gemini embedContent", openapi_extra=BodyDoc("EmbedContentRequest"))
async def embed_content(model: str, request: Request, principal: Principal = Depends(authenticate)) -> Response:
    call = pipeline.http_call(request, model, "gemini", api_version(request), "embed", "embedContent")
    body = await read_json(request)
    check_count(_get(_get(body, "content"), "parts"), MAX_PARTS, "content.parts", "parts")
    req = await off_loop(request, parse, body, _types().EmbedContentRequest)
    return JSONResponse(await embed_content_result(call.state, call.model, req, call.deadline, call.guard))


@router.post("/models/{model}:batchEmbedContents", summary="Gemini batchEmbedContents", openapi_extra=BodyDoc("BatchEmbedContentsRequest"))
async def batch_embed_contents(model: str, request: Request, principal: Principal = Depends(authenticate)) -> Response:
    version = api_version(request)
    call = pipeline.http_call(request, model, "gemini", version, "embed", "batchEmbedContents")
    body = await read_json(request)
    requests = _get(body, "requests")
    check_count(requests, call.state.config.embeddings.max_batch if call.state.config.embeddings else 100, "requests", "requests")
    check_contents([_get(r, "content") for r in requests] if isinstance(requests, list) else None, where="requests")
    req = await off_loop(request, parse, body, _types().BatchEmbedContentsRequest)
    outer = f"the model in the URL (models/{model})"
    return JSONResponse(await batch_embed_result(call.state, call.model, req, call.deadline, call.guard, version, outer))


@router.get("/tunedModels", summary="Gemini tunedModels.list (gemel serves none)")
async def tuned_models(principal: Principal = Depends(authenticate)) -> Response:
    return JSONResponse({})
