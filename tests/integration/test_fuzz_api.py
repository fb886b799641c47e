"""Bad input costs a 4xx and nothing else, against a real ``gemel serve``: the inputs found
by hand (deep nesting, unknown enum values, too many stop sequences, a 60 MB body) each get
their 4xx within the client's timeout; /healthz answers while a huge request is handled; and
a bounded schemathesis run over gemel's own OpenAPI document finds no 5xx and no hang.

The server is this module's own, with a model that generates at most 4 tokens, so the fuzzed
requests that are valid stay cheap.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from conftest import start_server

pytestmark = pytest.mark.slow

FUZZ_CONFIG = """
models:
  - id: smollm2-135m-instruct
    source: smollm2-135m-instruct
    max_output_tokens: 4
    aliases: [gemini-2.0-flash, gpt-4o-mini, gpt-3.5-turbo-instruct]
"""
GEN = "/v1beta/models/gemini-2.0-flash:generateContent"
CHAT = "/v1/chat/completions"
HELLO = {"contents": [{"parts": [{"text": "Say hi"}]}]}
TIMEOUT = 30  # the client's timeout: every answer here must come well within it


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("fuzz"), name="fuzz", extra_config=FUZZ_CONFIG)
    yield srv
    srv.stop()


def assert_healthy(url: str) -> None:
    assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200
    ok = httpx.post(f"{url}{GEN}", json=HELLO, timeout=TIMEOUT)
    assert ok.status_code == 200 and ok.json()["candidates"][0]["content"]["parts"][0]["text"], ok.text


def gemini_field(resp: httpx.Response) -> str:
    err = resp.json()["error"]
    assert resp.status_code == 400 and err["code"] == 400 and err["status"] == "INVALID_ARGUMENT", resp.text
    (bad,) = [d for d in err["details"] if d["@type"] == "type.googleapis.com/google.rpc.BadRequest"]
    return bad["fieldViolations"][0]["field"]


def test_bad_inputs_get_their_4xx(fuzz_server):
    url = fuzz_server.url
    post = lambda path, **kw: httpx.post(f"{url}{path}", timeout=TIMEOUT, **kw)  # noqa: E731

    nested = post(GEN, content=b"[" * 100_000 + b"]" * 100_000)
    assert nested.status_code == 400 and "Nesting too deep" in nested.json()["error"]["message"]
    nested = post(CHAT, content=b'{"model": "gpt-4o-mini", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                  headers={"content-type": "application/json"})
    assert nested.status_code == 400 and nested.json()["error"]["type"] == "invalid_request_error"
    assert "Nesting too deep" in nested.json()["error"]["message"]

    banana = {"responseMimeType": "application/json", "responseSchema": {"type": "BANANA"}}
    assert gemini_field(post(GEN, json={**HELLO, "generationConfig": banana})) == "generationConfig.responseSchema.type"
    bad_schema = {"responseMimeType": "application/json", "responseJsonSchema": {"type": "object", "properties": {"a": {"type": 7}}}}
    resp = post(GEN, json={**HELLO, "generationConfig": bad_schema})
    assert gemini_field(resp) == "generationConfig.responseJsonSchema"
    assert "generationConfig.responseJsonSchema.properties.a.type" in resp.json()["error"]["message"]

    stops = {"stopSequences": [f"stop {i}" for i in range(10_000)]}
    assert gemini_field(post(GEN, json={**HELLO, "generationConfig": stops})) == "generationConfig.stopSequences"
    chat = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
    resp = post(CHAT, json={**chat, "stop": [f"stop {i}" for i in range(10_000)]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "stop"

    safety = [{"category": "HARM_CATEGORY_DANGEROUS_CONTENT", "threshold": "BLOCK_EVERYTHING_PLEASE"}]
    assert gemini_field(post(GEN, json={**HELLO, "safetySettings": safety})) == "safetySettings[0].threshold"

    body = b'{"contents": [{"parts": [{"text": "' + b"a" * 60_000_000 + b'"}]}]}'
    big = post(GEN, content=body)
    assert big.status_code == 413 and big.json()["error"]["code"] == 413
    big = post(CHAT, content=body, headers={"content-type": "application/json"})
    assert big.status_code == 413 and big.json()["error"]["type"] == "invalid_request_error"

    assert_healthy(url)


def test_healthz_answers_while_a_huge_request_is_handled(fuzz_server):
    url = fuzz_server.url
    text = "hello world " * 1_500_000  # 18 MB: under the body limit, far over the model's context
    bodies = [
        (GEN, json.dumps({"contents": [{"parts": [{"text": text}]}]}).encode()),
        (CHAT, json.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": text}]}).encode()),
    ]
    for path, body in bodies:
        answer: list[httpx.Response] = []
        worker = threading.Thread(
            target=lambda: answer.append(
                httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"}, timeout=120)
            )
        )
        worker.start()
        probes = 0
        while worker.is_alive() or probes == 0:
            assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200  # answered within 5 s
            probes += 1
        worker.join()
        (resp,) = answer
        assert resp.status_code == 400 and "context" in resp.text, resp.text
    assert_healthy(url)


FUZZED = r"(:generateContent|:streamGenerateContent|:countTokens|:embedContent|:batchEmbedContents|/completions|/embeddings|/models)"
MODEL_OF = {"embedContent": "text-embedding-004", "batchEmbedContents": "text-embedding-004", "embeddings": "text-embedding-004"}


def test_schemathesis_finds_no_server_error(fuzz_server):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable

    url = fuzz_server.url
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json").include(path_regex=FUZZED)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 15, [op.label for op in operations]

    for op in operations:
        kind = op.path.rsplit(":", 1)[-1].rsplit("/", 1)[-1]
        model = MODEL_OF.get(kind, "gemini-2.0-flash")
        named = {"model": model} if "{model}" in op.path else None

        def pin_model(case, model=model):
            if isinstance(case.body, dict) and "model" in case.body:  # the OpenAI body names the model
                case.body["model"] = model.replace("gemini-2.0-flash", "gpt-4o-mini")
            return case

        for mode in schemathesis.GenerationMode:
            strategy = op.as_strategy(mode, path_parameters=named).map(pin_model) if named else op.as_strategy(mode).map(pin_model)

            @settings(max_examples=15, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
                      suppress_health_check=list(HealthCheck))
            @given(case=strategy)
            def no_server_error(case):
                resp = case.call(base_url=url, timeout=TIMEOUT)
                assert resp.status_code < 500, f"{case.method} {case.formatted_path} {case.body!r:.300} -> {resp.status_code} {resp.text[:300]}"

            try:
                no_server_error()
            except Unsatisfiable:  # nothing to make invalid (e.g. no parameters at all)
                assert mode == schemathesis.GenerationMode.NEGATIVE, op.label
    assert_healthy(url)
