"""Bad input costs a 4xx and nothing else: body size and JSON shape limits (middleware and
Gemini's own reader), per-field limits and enum/schema checks of both surfaces, and property
tests that the request parsers raise nothing but 4xx errors on arbitrary JSON."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from gemel.api import gemini, openai_api
from gemel.api.errors import APIError, install_error_handlers
from gemel.api.limits import JsonShape, RequestLimitsMiddleware, json_problem
from gemel.api.lifecycle import Deadline
from gemel.api.state import ServedModel
from gemel.config import GemelConfig, ServerConfig

GEN = "/v1beta/models/gemini-2.0-flash:generateContent"
CHAT = "/v1/chat/completions"
HELLO = {"contents": [{"parts": [{"text": "hi"}]}]}


def run(coro):
    return asyncio.run(coro)


# -- the JSON shape scan ----------------------------------------------------------------------
def true_depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max((true_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((true_depth(v) for v in value), default=0)
    return 0


# Strings full of what could fool a scanner: brackets, quotes, backslashes.
tricky_text = st.text(alphabet='[]{}",\\\\ab\u00e9', max_size=8)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | tricky_text,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(tricky_text, children, max_size=3),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(value=json_values, cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=6))
def test_depth_scan_matches_the_parsed_depth_wherever_the_body_is_cut(value, cuts):
    raw = json.dumps(value, ensure_ascii=False).encode()
    depth = true_depth(value)
    bounds = sorted({0, len(raw), *(c for c in cuts if c < len(raw))})
    for limit in {max(depth - 1, 0), depth}:
        shape = JsonShape(limit, 10**9)
        for a, b in zip(bounds, bounds[1:]):
            shape.feed(raw[a:b])
        assert (shape.finish() is None) == (depth <= limit), (raw, depth, limit)


def test_shape_limits():
    assert json_problem(b"[" * 64 + b"]" * 64, 64, 10**6) is None
    assert "Nesting too deep" in json_problem(b"[" * 65 + b"]" * 65, 64, 10**6)
    assert json_problem(b'["' + b"[" * 1000 + b'"]', 64, 10**6) is None  # inside a string
    assert "more than 1000 values" in json_problem(b"[" + b"1," * 1000 + b"1]", 64, 1000)
    assert "UTF-8" in json_problem(json.dumps(HELLO).encode("utf-16"), 64, 10**6)


# -- the middleware, in front of a bare app -------------------------------------------------------
def bare_app(**limits) -> tuple[FastAPI, list[bytes]]:
    app = FastAPI()
    install_error_handlers(app)
    seen: list[bytes] = []

    async def echo(request: Request):
        body = await request.body()
        seen.append(body)
        return {"size": len(body), "checked": getattr(request.state, "body_checked", False)}

    app.add_api_route(GEN, echo, methods=["POST"])
    app.add_api_route(CHAT, echo, methods=["POST"])
    app.add_api_route("/healthz", lambda: {"status": "OK"}, methods=["GET"])
    app.add_middleware(RequestLimitsMiddleware, **limits)
    return app, seen


async def post(app, path: str, **kw) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        return await client.post(path, **kw)


def test_oversized_body_is_413_in_each_surfaces_format_and_never_reaches_the_app():
    app, seen = bare_app(max_body_mb=1)
    big = b"x" * (1024 * 1024 + 1)
    g = run(post(app, GEN, content=big))
    assert g.status_code == 413 and g.json()["error"]["code"] == 413 and "larger than the limit" in g.json()["error"]["message"]
    o = run(post(app, CHAT, content=big))
    assert o.status_code == 413 and o.json()["error"]["type"] == "invalid_request_error"

    async def chunks():  # no Content-Length: refused as it passes the limit
        for _ in range(3):
            yield b" " * (512 * 1024)

    c = run(post(app, GEN, content=chunks()))
    assert c.status_code == 413 and seen == []


def test_deep_or_huge_json_is_400_and_a_good_body_is_replayed_whole():
    app, seen = bare_app(max_body_mb=1, max_json_depth=8, max_json_values=1000)
    deep = run(post(app, CHAT, content=b'{"messages":' + b"[" * 9 + b"]" * 9 + b"}"))
    assert deep.status_code == 400 and "Nesting too deep" in deep.json()["error"]["message"]
    wide = run(post(app, GEN, content=b"[" + b"0," * 2000 + b"0]"))
    assert wide.status_code == 400 and wide.json()["error"]["status"] == "INVALID_ARGUMENT"
    assert seen == []
    body = json.dumps({"a": [[["[[[[[[[[[["]]], "b": "x" * 200_000}).encode()

    async def chunked():
        for i in range(0, len(body), 4096):
            yield body[i : i + 4096]

    ok = run(post(app, GEN, content=chunked()))
    assert ok.status_code == 200 and ok.json() == {"size": len(body), "checked": True} and seen == [body]


# -- the real surfaces, without engines (every request here fails before one is needed) ------------
@pytest.fixture(scope="module")
def api():
    from gemel.api.app import create_app

    app = create_app(GemelConfig.model_validate({"embeddings": None}))
    if not any(m.cls is RequestLimitsMiddleware for m in app.user_middleware):
        app.add_middleware(RequestLimitsMiddleware)
    return app


@pytest.fixture(scope="module")
def api_without_middleware():
    from gemel.api.app import create_app

    app = create_app(GemelConfig.model_validate({"embeddings": None, "server": {"max_body_mb": 1}}))
    app.user_middleware = [m for m in app.user_middleware if m.cls is not RequestLimitsMiddleware]
    return app


def call(app, path: str, **kw) -> httpx.Response:
    return run(asyncio.wait_for(post(app, path, **kw), 30))


def gemini_violation(resp: httpx.Response) -> tuple[str, str]:
    err = resp.json()["error"]
    assert resp.status_code == 400 and err["status"] == "INVALID_ARGUMENT", resp.text
    (violation,) = [d for d in err["details"] if d["@type"].endswith("BadRequest")]
    return violation["fieldViolations"][0]["field"], err["message"]


def test_the_reported_bad_inputs_get_their_4xx(api):
    nested = call(api, GEN, content=b"[" * 100_000 + b"]" * 100_000)
    assert nested.status_code == 400 and "Nesting too deep" in nested.json()["error"]["message"]
    schema = {"responseMimeType": "application/json", "responseSchema": {"type": "BANANA"}}
    field, message = gemini_violation(call(api, GEN, json={**HELLO, "generationConfig": schema}))
    assert field == "generationConfig.responseSchema.type" and "BANANA" in message
    stops = {"stopSequences": [f"s{i}" for i in range(10_000)]}
    field, message = gemini_violation(call(api, GEN, json={**HELLO, "generationConfig": stops}))
    assert field == "generationConfig.stopSequences" and "at most 5" in message
    safety = [{"category": "HARM_CATEGORY_HARASSMENT", "threshold": "BLOCK_NONE"}, {"category": "FOO", "threshold": "BAR"}]
    field, message = gemini_violation(call(api, GEN, json={**HELLO, "safetySettings": safety}))
    assert field == "safetySettings[1].category" and "FOO" in message
    big = call(api, GEN, content=b'{"contents": [{"parts": [{"text": "' + b"a" * 60_000_000 + b'"}]}]}')
    assert big.status_code == 413 and big.json()["error"]["code"] == 413


def test_gemini_field_checks(api):
    cases = [
        ({"safetySettings": [{"category": "HARM_CATEGORY_HARASSMENT", "threshold": 99}]}, "safetySettings[0].threshold"),
        ({"generationConfig": {"responseMimeType": "application/json",
                               "responseSchema": {"type": "OBJECT", "properties": {"a": {"type": "NOPE"}}}}},
         "generationConfig.responseSchema.properties.a.type"),
        ({"generationConfig": {"responseMimeType": "application/json", "responseJsonSchema": {"type": "banana"}}},
         "generationConfig.responseJsonSchema"),
        ({"generationConfig": {"responseMimeType": "application/json", "responseJsonSchema": {"required": "a"}}},
         "generationConfig.responseJsonSchema"),
        ({"generation_config": {"stop_sequences": ["a"] * 6}}, "generationConfig.stopSequences"),
        ({"tools": [{"functionDeclarations": [{"name": "f"}]}] * 1000}, "tools"),
        ({"contents": [{"parts": [{"text": "x"}] * 10_001}]}, "contents[0].parts"),
        ({"contents": [{"parts": [{"text": "x"}], "role": "user"}] * 10_001}, "contents"),
    ]
    for extra, expected in cases:
        field, _ = gemini_violation(call(api, GEN, json={**HELLO, **extra}))
        assert field == expected
    # Unknown fields stay ignored (the request then waits for the engine, which never starts
    # here): only their parse is asked for.
    req = gemini.parse({**HELLO, "someFutureField": {"x": 1}}, gemini._types().GenerateContentRequest)
    assert req.contents[0].parts[0].text == "hi"


def test_long_texts_parse_fast_and_whole():
    text = "hello world " * 200_000
    body = {"contents": [{"parts": [{"text": "a"}, {"text": text}]}], "systemInstruction": {"parts": [{"text": text}]}}
    req = gemini.parse(body, gemini._types().GenerateContentRequest)
    assert req.contents[0].parts[1].text == text and req.system_instruction.parts[0].text == text
    with pytest.raises(APIError) as e:
        gemini.parse({"contents": [{"parts": [{"text": "a" * 100_000 + "\ud800"}]}]}, gemini._types().GenerateContentRequest)
    assert e.value.status == 400 and e.value.param == "contents[0].parts[0].text"


def test_openai_field_checks(api):
    chat = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
    cases = [
        ({"stop": ["a"] * 5}, "stop"),
        ({"messages": [{"role": "user", "content": "hi"}] * 10_001}, "messages"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "banana"}}}},
         "response_format.json_schema"),
    ]
    for extra, expected in cases:
        resp = call(api, CHAT, json={**chat, **extra})
        err = resp.json()["error"]
        assert resp.status_code == 400 and err["param"] == expected and err["type"] == "invalid_request_error", resp.text
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "required": "a"}}}
    resp = call(api, CHAT, json={**chat, "response_format": schema})
    assert "response_format.json_schema.schema.required: invalid JSON Schema" in resp.json()["error"]["message"]
    nested = call(api, CHAT, content=b'{"model": "x", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert nested.status_code == 400 and "Nesting too deep" in nested.json()["error"]["message"]
    many = {**chat, "prompt": ["a"] * 65}
    resp = call(api, "/v1/completions", json=many)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"


def test_gemini_reader_checks_without_the_middleware(api_without_middleware):
    nested = call(api_without_middleware, GEN, content=b"[" * 100_000 + b"]" * 100_000)
    assert nested.status_code == 400 and "Nesting too deep" in nested.json()["error"]["message"]
    big = call(api_without_middleware, GEN, content=b'{"x": "' + b"a" * 2_000_000 + b'"}')
    assert big.status_code == 413


def test_openapi_documents_gemini_bodies(api):
    doc = api.openapi()
    body = doc["paths"]["/v1beta/models/{model}:generateContent"]["post"]["requestBody"]
    schema = body["content"]["application/json"]["schema"]
    assert schema["title"] == "GenerateContentRequest" and "contents" in schema["properties"]
    gc = schema["properties"]["generationConfig"]["properties"]
    assert "STRING" in gc["responseSchema"]["properties"]["type"]["enum"]
    assert "requestBody" in doc["paths"]["/v1/models/{model}:batchEmbedContents"]["post"]


# -- property tests: arbitrary JSON through the parsers -------------------------------------------
MODEL = ServedModel("m", "generate", "1", [], "m", "", 64, "src")


def junk() -> st.SearchStrategy:
    scalar = st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats() | st.text(max_size=6)
    return st.recursive(scalar, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3), max_leaves=8)


def mostly(good: st.SearchStrategy, weight: int = 3) -> st.SearchStrategy:
    """Usually (``weight`` to 1) a well-formed value, sometimes anything at all."""
    return st.sampled_from([True] * weight + [False]).flatmap(lambda ok: good if ok else junk())


SCALARS = {
    1: st.floats(), 2: st.floats(), 3: st.integers(-(2**63), 2**63), 5: st.integers(-(2**31), 2**31), 8: st.booleans(),
    9: st.text(max_size=20), 12: st.sampled_from(["aGk=", "aGk", "!!", "dGV4dA=="]), 13: st.integers(-5, 2**32),
}


def proto_json(descriptor, depth: int = 0) -> st.SearchStrategy:
    """Proto3 JSON of a message type, names and value types mostly right (the parsers' input)."""
    if descriptor.full_name.startswith("google.protobuf.") or depth > 3:
        return junk()
    fields = {}
    for fd in filter(gemini._documented, descriptor.fields):  # what gemel reads; the rest is refused unparsed
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            one = st.dictionaries(st.text(max_size=4), field_json(fd.message_type.fields_by_name["value"], depth), max_size=3)
        elif gemini._repeated(fd):
            one = st.lists(field_json(fd, depth), max_size=7)
        else:
            one = field_json(fd, depth)
        fields[fd.json_name] = mostly(one)
    return st.fixed_dictionaries({}, optional=fields)


def field_json(fd, depth: int) -> st.SearchStrategy:
    if fd.enum_type is not None:
        return st.sampled_from([v.name for v in fd.enum_type.values]) | st.integers(-2, 40) | st.text(max_size=5)
    if fd.message_type is not None:
        return st.deferred(lambda: proto_json(fd.message_type, depth + 1))
    return SCALARS.get(fd.type, st.integers())


TEXT_PART = st.fixed_dictionaries({"text": st.text(max_size=20)})
GEMINI_BODIES = st.fixed_dictionaries(
    {"contents": mostly(st.lists(st.fixed_dictionaries({"parts": st.lists(TEXT_PART, min_size=1, max_size=3)},
                                                       optional={"role": st.sampled_from(["user", "model", "x"])}),
                                 min_size=1, max_size=3))},
) | proto_json(gemini._types().GenerateContentRequest.pb().DESCRIPTOR)

CHAT_MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": mostly(st.sampled_from(["system", "developer", "user", "assistant", "tool"])),
         "content": mostly(st.text(max_size=20) | st.lists(
             st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "file"]), "text": mostly(st.text(max_size=9))}),
             max_size=3))},
    ),
    min_size=1, max_size=4,
)
SCHEMAS = st.sampled_from([{"type": "object"}, {"type": "banana"}, {"required": "a"}, {"type": "string", "pattern": "("}]) | junk()
CHAT_FIELDS = {
    "max_tokens": st.integers(-5, 100), "max_completion_tokens": st.integers(-5, 100), "temperature": st.floats(),
    "top_p": st.floats(), "n": st.integers(-1, 20), "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=6),
    "seed": st.integers(), "presence_penalty": st.floats(), "frequency_penalty": st.floats(), "top_k": st.integers(-3, 100),
    "min_p": st.floats(), "repetition_penalty": st.floats(), "min_tokens": st.integers(-3, 100), "priority": st.integers(-1, 4),
    "logprobs": st.booleans(), "top_logprobs": st.integers(-1, 25), "logit_bias": st.dictionaries(st.text(max_size=3), st.floats(), max_size=2),
    "tools": st.lists(junk(), max_size=2), "tool_choice": st.sampled_from(["none", "auto", "required"]),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "yaml"}])
    | st.builds(lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}, SCHEMAS),
}
CHAT_BODIES = st.fixed_dictionaries({"model": st.just("m"), "messages": CHAT_MESSAGES}, optional={k: mostly(v, 30) for k, v in CHAT_FIELDS.items()})


def only_4xx(fn) -> None:
    try:
        fn()
    except APIError as e:
        assert 400 <= e.status < 500, e
    except ValidationError:
        pass  # rendered as a 400 naming the field by the app's handler


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(body=GEMINI_BODIES)
def test_gemini_parsing_raises_only_4xx(body):
    deadline = Deadline(30, time.monotonic() + 30)

    def parse_generate():
        gemini.check_generate_body(body)
        req = gemini.parse(json.loads(json.dumps(body)), gemini._types().GenerateContentRequest)
        gemini.generation_request(MODEL, req, deadline, checked=True)

    only_4xx(parse_generate)
    only_4xx(lambda: gemini.parse(json.loads(json.dumps(body)), gemini._types().CountTokensRequest))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(body=CHAT_BODIES)
def test_openai_chat_parsing_raises_only_4xx(body):
    def parse_chat():
        req = openai_api.ChatCompletionRequest.model_validate(body)
        openai_api.check_limits(req)
        openai_api._refuse(req)
        openai_api._params(req, MODEL, req.max_tokens, openai_api._logprobs_count(req), {})
        openai_api.openai_messages(req.messages, "m")
        openai_api.openai_spec(req.response_format)

    only_4xx(parse_chat)


def test_config_defaults():
    s = ServerConfig()
    assert (s.max_body_mb, s.max_json_depth, s.max_json_values) == (20.0, 64, 1_000_000)
