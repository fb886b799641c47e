"""The response cache on a real ``gemel serve``: tenants made with ``gemel keys``, the Gemini
REST, OpenAI and gRPC surfaces through raw HTTP and the official SDKs, unary and streamed hits,
``Cache-Control``, the semantic match for an opted-in tenant, and the metric."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest

from conftest import free_port, start_server

pytestmark = pytest.mark.slow

MODEL = "gemini-2.0-flash"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = f"/v1beta/models/{MODEL}:generateContent"
STREAM = f"/v1beta/models/{MODEL}:streamGenerateContent"
SERVICE = "google.ai.generativelanguage.v1beta.GenerativeService"

CACHE_CONFIG = """
cache:
  response:
    ttl_s: 600
    max_entries: 1000
    semantic: {{enabled: true, threshold: 0.95, tenants: [alpha]}}
gateway:
  tenants_file: {tenants}
"""


def gemel_command() -> list[str]:
    script = Path(sys.executable).with_name("gemel")
    return [str(script)] if script.exists() else [sys.executable, "-m", "gemel.cli"]


def create_key(tenants: Path, tenant: str) -> str:
    r = subprocess.run(
        [*gemel_command(), "keys", "create", "--tenants", str(tenants), "--tenant", tenant],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("response-cache")
    tenants = tmp / "tenants.yaml"
    keys = {t: create_key(tenants, t) for t in ("alpha", "beta")}
    grpc_port = free_port()
    srv = start_server(tmp, name="cache", extra_config=CACHE_CONFIG.format(tenants=tenants), grpc_port=grpc_port)
    # the embedding model loads beside the engines; the semantic match needs it loaded
    r = httpx.post(f"{srv.url}/v1/embeddings", json={"model": "text-embedding-004", "input": "warm up"},
                   headers={"authorization": f"Bearer {keys['alpha']}"}, timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    yield {"server": srv, "url": srv.url, "keys": keys, "grpc_port": grpc_port}
    srv.stop()


def post(env, path: str, body: dict, tenant: str = "alpha", headers: dict | None = None, params: dict | None = None) -> httpx.Response:
    h = {"x-goog-api-key": env["keys"][tenant]} | (headers or {})
    r = httpx.post(env["url"] + path, json=body, headers=h, params=params, timeout=180)
    assert r.status_code == 200, r.text
    return r


def chat_body(content: str, **kw) -> dict:
    return {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 12} | kw


def gemini_body(text: str, **gen) -> dict:
    gen = {"temperature": 0, "maxOutputTokens": 12} | gen
    return {"contents": [{"role": "user", "parts": [{"text": text}]}], "generationConfig": gen}


def without(body: dict, *names: str) -> dict:
    return {k: v for k, v in body.items() if k not in names}


def sse(r: httpx.Response) -> list:
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def metric(env, kind: str, result: str) -> float:
    text = httpx.get(env["url"] + "/metrics", timeout=10).text
    m = re.search(rf'^gemel:response_cache_requests_total{{kind="{kind}",result="{result}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


# -- exact hits -------------------------------------------------------------------------------------
def test_openai_chat_repeat_is_answered_from_the_cache(env):
    body = chat_body("Name three colours.")
    first = post(env, CHAT, body)
    second = post(env, CHAT, body)
    assert first.headers["x-gemel-cache"] == "miss"
    assert second.headers["x-gemel-cache"] == "exact"
    a, b = first.json(), second.json()
    assert a["id"] != b["id"]
    assert without(a, "id", "created") == without(b, "id", "created")
    assert b["choices"][0]["message"]["content"] and b["usage"]["completion_tokens"] > 0


def test_gemini_repeat_is_answered_from_the_cache_also_through_the_sdk(env):
    from google import genai
    from google.genai import types

    body = gemini_body("Write one sentence about rivers.")
    first = post(env, GENERATE, body)
    second = post(env, GENERATE, body)
    assert (first.headers["x-gemel-cache"], second.headers["x-gemel-cache"]) == ("miss", "exact")
    a, b = first.json(), second.json()
    assert a["responseId"] != b["responseId"]
    assert without(a, "responseId") == without(b, "responseId")

    client = genai.Client(api_key=env["keys"]["alpha"], http_options=types.HttpOptions(base_url=env["url"], api_version="v1beta"))
    resp = client.models.generate_content(
        model=MODEL, contents="Write one sentence about rivers.",
        config=types.GenerateContentConfig(temperature=0, max_output_tokens=12),
    )  # fmt: skip
    assert resp.sdk_http_response.headers["x-gemel-cache"] == "exact"
    assert resp.text == a["candidates"][0]["content"]["parts"][0]["text"]


def test_completions_with_several_prompts_and_logprobs(env):
    body = {"model": "gpt-3.5-turbo-instruct", "prompt": ["The sky is", "Grass is"], "temperature": 0, "max_tokens": 6, "logprobs": 2}
    first = post(env, COMPLETIONS, body)
    second = post(env, COMPLETIONS, body)
    assert second.headers["x-gemel-cache"] == "exact"
    a, b = first.json(), second.json()
    assert without(a, "id", "created") == without(b, "id", "created")
    assert len(b["choices"]) == 2 and b["choices"][1]["logprobs"]["top_logprobs"]


def test_a_gemini_request_reads_the_answer_of_the_same_openai_request(env):
    """The key is the engine's request: the same messages, tokens and knobs from either surface."""
    text = "Say something about the sea."
    openai = post(env, CHAT, chat_body(text, max_tokens=10)).json()
    gemini = post(env, GENERATE, gemini_body(text, maxOutputTokens=10))
    assert gemini.headers["x-gemel-cache"] == "exact"
    got = gemini.json()
    assert got["candidates"][0]["content"]["parts"][0]["text"] == openai["choices"][0]["message"]["content"]
    assert got["usageMetadata"]["candidatesTokenCount"] == openai["usage"]["completion_tokens"]


# -- who is answered from the cache -----------------------------------------------------------------
def test_another_tenant_never_reads_an_entry(env):
    body = chat_body("Give me a fruit name.")
    assert post(env, CHAT, body, "alpha").headers["x-gemel-cache"] == "miss"
    assert post(env, CHAT, body, "alpha").headers["x-gemel-cache"] == "exact"
    assert post(env, CHAT, body, "beta").headers["x-gemel-cache"] == "miss"
    assert post(env, CHAT, body, "beta").headers["x-gemel-cache"] == "exact"  # its own entry now


def test_no_cache_asks_for_a_fresh_answer(env):
    body = chat_body("Name an animal.")
    post(env, CHAT, body)
    bypassed = metric(env, "exact", "bypass")
    fresh = post(env, CHAT, body, headers={"Cache-Control": "no-cache"})
    assert fresh.headers["x-gemel-cache"] == "miss"
    assert metric(env, "exact", "bypass") == bypassed + 1
    assert post(env, CHAT, body).headers["x-gemel-cache"] == "exact"


def test_sampled_requests_are_never_cached_seeded_ones_are(env):
    sampled = chat_body("Invent a word.", temperature=0.9)
    for _ in range(2):
        assert post(env, CHAT, sampled).headers["x-gemel-cache"] == "miss"
    seeded = chat_body("Invent a word.", temperature=0.9, seed=3)
    first = post(env, CHAT, seeded)
    second = post(env, CHAT, seeded)
    assert second.headers["x-gemel-cache"] == "exact"
    assert second.json()["choices"] == first.json()["choices"]


# -- streamed hits ------------------------------------------------------------------------------------
def test_openai_stream_hit_replays_as_a_stream(env):
    from openai import OpenAI

    body = chat_body("Describe a mountain.")
    unary = post(env, CHAT, body).json()["choices"][0]["message"]["content"]
    r = post(env, CHAT, body | {"stream": True, "stream_options": {"include_usage": True}})
    assert r.headers["x-gemel-cache"] == "exact" and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == unary
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] in ("stop", "length")
    assert chunks[-1]["usage"]["completion_tokens"] > 0

    client = OpenAI(api_key=env["keys"]["alpha"], base_url=env["url"] + "/v1", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(**body, stream=True)
    assert raw.headers["x-gemel-cache"] == "exact"
    assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices) == unary


def test_gemini_stream_hit_replays_as_a_stream(env):
    from google import genai
    from google.genai import types

    text = "Describe a forest."
    unary = post(env, GENERATE, gemini_body(text)).json()["candidates"][0]["content"]["parts"][0]["text"]
    r = post(env, STREAM, gemini_body(text), params={"alt": "sse"})
    assert r.headers["x-gemel-cache"] == "exact"
    chunks = sse(r)
    assert len(chunks) >= 1
    assert "".join(p["text"] for c in chunks for p in c["candidates"][0]["content"]["parts"]) == unary
    assert chunks[-1]["candidates"][0]["finishReason"] in ("STOP", "MAX_TOKENS")

    client = genai.Client(api_key=env["keys"]["alpha"], http_options=types.HttpOptions(base_url=env["url"], api_version="v1beta"))
    streamed = client.models.generate_content_stream(
        model=MODEL, contents=text, config=types.GenerateContentConfig(temperature=0, max_output_tokens=12)
    )
    assert "".join(c.text or "" for c in streamed) == unary


def test_grpc_hits_unary_and_streamed_say_so_in_initial_metadata(env):
    from google.ai.generativelanguage_v1beta import types

    def request() -> types.GenerateContentRequest:
        return types.GenerateContentRequest(
            model=f"models/{MODEL}",
            contents=[types.Content(role="user", parts=[types.Part(text="Name a planet.")])],
            generation_config=types.GenerationConfig(temperature=0, max_output_tokens=12),
        )

    md = [("x-goog-api-key", env["keys"]["alpha"])]
    with grpc.insecure_channel(f"127.0.0.1:{env['grpc_port']}") as channel:
        unary = channel.unary_unary(
            f"/{SERVICE}/GenerateContent",
            request_serializer=types.GenerateContentRequest.serialize,
            response_deserializer=types.GenerateContentResponse.deserialize,
        )
        first, c1 = unary.with_call(request(), metadata=md, timeout=120)
        second, c2 = unary.with_call(request(), metadata=md, timeout=120)
        assert dict(c1.initial_metadata())["x-gemel-cache"] == "miss"
        assert dict(c2.initial_metadata())["x-gemel-cache"] == "exact"
        assert dict(c2.initial_metadata())["x-model-id"] == "smollm2-135m-instruct"
        text = first.candidates[0].content.parts[0].text
        assert second.candidates[0].content.parts[0].text == text

        stream = channel.unary_stream(
            f"/{SERVICE}/StreamGenerateContent",
            request_serializer=types.GenerateContentRequest.serialize,
            response_deserializer=types.GenerateContentResponse.deserialize,
        )
        call = stream(request(), metadata=md, timeout=120)
        chunks = list(call)
        assert dict(call.initial_metadata())["x-gemel-cache"] == "exact"
        assert "".join(p.text for c in chunks for p in c.candidates[0].content.parts) == text

        fresh = unary.with_call(request(), metadata=[*md, ("cache-control", "no-cache")], timeout=120)[1]
        assert dict(fresh.initial_metadata())["x-gemel-cache"] == "miss"


# -- semantic -----------------------------------------------------------------------------------------
def test_semantic_hit_for_the_opted_in_tenant_only(env):
    asked = chat_body("What is the capital of France?")
    paraphrase = chat_body("What's the capital of France?")
    other_question = chat_body("What is the capital of Germany?")

    original = post(env, CHAT, asked, "alpha")
    hit = post(env, CHAT, paraphrase, "alpha")
    assert hit.headers["x-gemel-cache"] == "semantic"
    assert hit.json()["choices"] == original.json()["choices"]
    assert post(env, CHAT, other_question, "alpha").headers["x-gemel-cache"] == "miss"

    post(env, CHAT, asked, "beta")
    assert post(env, CHAT, paraphrase, "beta").headers["x-gemel-cache"] == "miss"  # beta did not opt in


def test_metric_counts_hits_misses_and_bypasses(env):
    post(env, CHAT, chat_body("Count to three."))
    post(env, CHAT, chat_body("Count to three."))
    post(env, CHAT, chat_body("Count to three.", temperature=1.0))
    for result in ("hit", "miss", "bypass"):
        assert metric(env, "exact", result) >= 1, result
    assert metric(env, "semantic", "miss") >= 1


def test_no_header_while_the_cache_is_off(server):
    r = httpx.post(server.url + CHAT, json=chat_body("Hi.", max_tokens=2), timeout=120)
    assert r.status_code == 200 and "x-gemel-cache" not in r.headers
