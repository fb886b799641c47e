"""gemel serve through the official google-genai SDK (v1beta and the default v1)."""

from __future__ import annotations

import math

import httpx
import pytest
from google.genai import errors, types

pytestmark = pytest.mark.slow

MODEL = "gemini-2.0-flash"


def cfg(**kw) -> types.GenerateContentConfig:
    kw.setdefault("max_output_tokens", 12)
    return types.GenerateContentConfig(**kw)


@pytest.mark.parametrize("client_name", ["genai_client", "genai_client_v1"])
def test_generate_content(request, client_name):
    client = request.getfixturevalue(client_name)
    r = client.models.generate_content(model=MODEL, contents="Say hello.", config=cfg(temperature=0))
    assert r.text and isinstance(r.text, str)
    cand = r.candidates[0]
    assert cand.finish_reason in (types.FinishReason.STOP, types.FinishReason.MAX_TOKENS)
    u = r.usage_metadata
    assert u.prompt_token_count > 0 and 0 < u.candidates_token_count <= 12
    assert u.total_token_count == u.prompt_token_count + u.candidates_token_count
    assert r.model_version and r.response_id


def test_max_tokens_finish_reason(genai_client):
    r = genai_client.models.generate_content(
        model=MODEL, contents="Write a long story about a dragon.", config=cfg(temperature=0, max_output_tokens=5)
    )
    assert r.candidates[0].finish_reason == types.FinishReason.MAX_TOKENS
    assert r.usage_metadata.candidates_token_count == 5


def test_system_instruction_changes_answer(genai_client):
    plain = genai_client.models.generate_content(model=MODEL, contents="Who are you?", config=cfg(temperature=0))
    pirate = genai_client.models.generate_content(
        model=MODEL,
        contents="Who are you?",
        config=cfg(temperature=0, system_instruction="You are a pirate named Jack. Always say Arr."),
    )
    assert plain.text != pirate.text
    assert pirate.usage_metadata.prompt_token_count != plain.usage_metadata.prompt_token_count


def test_multi_turn_chat(genai_client):
    chat = genai_client.chats.create(model=MODEL, config=cfg(temperature=0))
    first = chat.send_message("My name is Alice.")
    second = chat.send_message("What is my name?")
    assert first.text and second.text
    # the whole history was sent: the second prompt is longer than the first
    assert second.usage_metadata.prompt_token_count > first.usage_metadata.prompt_token_count + 5
    history = chat.get_history()
    assert [c.role for c in history] == ["user", "model", "user", "model"]


def test_stop_sequences(genai_client):
    base = genai_client.models.generate_content(model=MODEL, contents="Count from 1 to 10.", config=cfg(temperature=0, max_output_tokens=24))
    words = base.text.split()
    assert len(words) >= 3, base.text
    stop = words[2]
    r = genai_client.models.generate_content(
        model=MODEL, contents="Count from 1 to 10.", config=cfg(temperature=0, max_output_tokens=24, stop_sequences=[stop])
    )
    assert stop not in r.text
    assert base.text.startswith(r.text)
    assert r.candidates[0].finish_reason == types.FinishReason.STOP


def test_seed_reproducible(genai_client):
    kw = dict(temperature=1.0, top_p=0.95, top_k=50, seed=1234, max_output_tokens=16)
    a = genai_client.models.generate_content(model=MODEL, contents="Invent a word.", config=cfg(**kw))
    b = genai_client.models.generate_content(model=MODEL, contents="Invent a word.", config=cfg(**kw))
    assert a.text == b.text


def test_candidate_count_and_logprobs(genai_client):
    r = genai_client.models.generate_content(
        model=MODEL,
        contents="Name a color.",
        config=cfg(candidate_count=2, temperature=1.0, seed=7, max_output_tokens=6, response_logprobs=True, logprobs=3),
    )
    assert len(r.candidates) == 2
    assert {c.index for c in r.candidates} == {0, 1}
    for c in r.candidates:
        chosen = c.logprobs_result.chosen_candidates
        assert 1 <= len(chosen) <= 6
        assert all(x.log_probability <= 0 for x in chosen)
        assert all(len(t.candidates) == 3 for t in c.logprobs_result.top_candidates)
        assert math.isclose(c.avg_logprobs, sum(x.log_probability for x in chosen) / len(chosen), rel_tol=1e-5)
    assert r.usage_metadata.candidates_token_count == sum(len(c.logprobs_result.chosen_candidates) for c in r.candidates)


def test_penalties_accepted(genai_client):
    r = genai_client.models.generate_content(
        model=MODEL, contents="Say hi.", config=cfg(presence_penalty=0.5, frequency_penalty=0.5, temperature=0.5, seed=1)
    )
    assert r.text


def test_count_tokens_matches_usage(genai_client):
    contents = "How many tokens is this?"
    counted = genai_client.models.count_tokens(model=MODEL, contents=contents)
    r = genai_client.models.generate_content(model=MODEL, contents=contents, config=cfg(max_output_tokens=2))
    assert counted.total_tokens == r.usage_metadata.prompt_token_count


def test_count_tokens_generate_content_request_form(server):
    body = {"generateContentRequest": {"model": f"models/{MODEL}", "contents": [{"parts": [{"text": "hi"}]}],
                                       "systemInstruction": {"parts": [{"text": "Be brief."}]}}}
    r = httpx.post(f"{server.url}/v1beta/models/{MODEL}:countTokens", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["totalTokens"] > 3
    assert r.json()["promptTokensDetails"][0]["modality"] == "TEXT"


@pytest.mark.parametrize("client_name", ["genai_client", "genai_client_v1"])
def test_embed(request, client_name):
    client = request.getfixturevalue(client_name)
    r = client.models.embed_content(
        model="text-embedding-004", contents=["The cat sits on the mat.", "A cat is sitting on a mat.", "Stock markets fell."]
    )
    vecs = [e.values for e in r.embeddings]
    assert len(vecs) == 3 and all(len(v) == 384 for v in vecs)
    dot = lambda a, b: sum(x * y for x, y in zip(a, b))  # noqa: E731
    assert abs(dot(vecs[0], vecs[0]) - 1) < 1e-4
    assert dot(vecs[0], vecs[1]) > dot(vecs[0], vecs[2]) + 0.2
    small = client.models.embed_content(
        model="text-embedding-004", contents="hello", config=types.EmbedContentConfig(output_dimensionality=64)
    )
    assert len(small.embeddings[0].values) == 64


def test_embed_content_rest(server):
    r = httpx.post(
        f"{server.url}/v1beta/models/all-minilm-l6-v2:embedContent?key=abc",
        json={"content": {"parts": [{"text": "hello world"}]}, "taskType": "RETRIEVAL_QUERY"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert len(r.json()["embedding"]["values"]) == 384


@pytest.mark.parametrize("client_name", ["genai_client", "genai_client_v1"])
def test_models_list_and_get(request, client_name):
    client = request.getfixturevalue(client_name)
    names = [m.name for m in client.models.list()]
    assert f"models/{MODEL}" in names and "models/smollm2-135m-instruct" in names
    assert "models/all-minilm-l6-v2" in names
    m = client.models.get(model=MODEL)
    assert m.name == f"models/{MODEL}"
    assert m.input_token_limit > 1000 and m.output_token_limit > 0
    assert "generateContent" in m.supported_actions


def test_models_paging(server):
    first = httpx.get(f"{server.url}/v1beta/models", params={"pageSize": 2}, timeout=10).json()
    assert len(first["models"]) == 2 and first["nextPageToken"]
    second = httpx.get(f"{server.url}/v1beta/models", params={"pageSize": 2, "pageToken": first["nextPageToken"]}, timeout=10).json()
    assert {m["name"] for m in first["models"]}.isdisjoint({m["name"] for m in second["models"]})
    assert httpx.get(f"{server.url}/v1beta/tunedModels", timeout=10).json() == {}


def test_proto3_json_shapes(server):
    """snake_case names, integral floats for integers, enum names: all read as Google does."""
    body = {
        "contents": [{"role": "user", "parts": [{"text": "Say hi."}]}],
        "generation_config": {"max_output_tokens": 4.0, "topK": 40.0, "temperature": 0, "thinkingConfig": {"thinkingBudget": 0}},
        "safetySettings": [{"category": "HARM_CATEGORY_HARASSMENT", "threshold": "BLOCK_NONE"}],
    }
    r = httpx.post(f"{server.url}/v1beta/models/{MODEL}:generateContent", json=body, headers={"x-goog-api-key": "k"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usageMetadata"]["candidatesTokenCount"] <= 4


def test_inline_text_part_is_used(server):
    import base64

    data = base64.b64encode(b"The secret word is banana.").decode()
    body = {"contents": [{"parts": [{"inlineData": {"mime_type": "text/plain", "data": data}}, {"text": "Repeat it."}]}],
            "generationConfig": {"maxOutputTokens": 2}}
    r = httpx.post(f"{server.url}/v1beta/models/{MODEL}:generateContent", json=body, timeout=60)
    assert r.status_code == 200, r.text


def test_response_headers(server):
    r = httpx.post(
        f"{server.url}/v1beta/models/{MODEL}:generateContent",
        json={"contents": [{"parts": [{"text": "hi"}]}], "generationConfig": {"maxOutputTokens": 2}},
        headers={"x-request-id": "req-123", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
        timeout=60,
    )
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "req-123"
    assert r.headers["x-model-id"] == "smollm2-135m-instruct"
    assert r.headers["x-model-version"] == "1"
    assert float(r.headers["x-inference-latency-ms"]) > 0
    assert r.headers["traceparent"].startswith("00-0af7651916cd43dd8448eb211c80319c-")
    h = httpx.get(f"{server.url}/healthz", timeout=10)
    assert h.json()["status"] == "OK" and "smollm2-135m-instruct" in h.json()["models_loaded"]
    assert h.headers["x-request-id"] and h.headers["x-model-id"]
    assert httpx.get(f"{server.url}/readyz", timeout=10).status_code == 200
    assert "/v1beta/models/{model}:generateContent" in httpx.get(f"{server.url}/openapi.json", timeout=10).json()["paths"]


# -- errors ---------------------------------------------------------------------------------
def _post(server, path: str, body, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60, **kw)


def _google_error(r: httpx.Response, code: int) -> dict:
    assert r.status_code == code, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["status"] and err["message"]
    return err


def test_unknown_model_is_404(genai_client):
    with pytest.raises(errors.ClientError) as e:
        genai_client.models.generate_content(model="no-such-model", contents="hi")
    assert e.value.code == 404 and e.value.status == "NOT_FOUND"
    with pytest.raises(errors.ClientError) as e:
        genai_client.models.get(model="no-such-model")
    assert e.value.code == 404


def test_bad_max_output_tokens(genai_client):
    for value in (-5, 10**6):
        with pytest.raises(errors.ClientError) as e:
            genai_client.models.generate_content(model=MODEL, contents="hi", config=cfg(max_output_tokens=value))
        assert e.value.code == 400 and e.value.status == "INVALID_ARGUMENT"
        assert "maxOutputTokens" in e.value.message


def test_unsupported_generation_config_named(genai_client):
    with pytest.raises(errors.ClientError) as e:
        genai_client.models.generate_content(model=MODEL, contents="hi", config=cfg(response_mime_type="text/csv"))
    assert e.value.code == 400 and "responseMimeType" in e.value.message
    with pytest.raises(errors.ClientError) as e:  # a schema needs a JSON (or enum) response type
        genai_client.models.generate_content(
            model=MODEL, contents="hi", config=cfg(response_schema={"type": "OBJECT", "properties": {"a": {"type": "STRING"}}})
        )
    assert e.value.code == 400 and "responseMimeType" in e.value.message
    with pytest.raises(errors.ClientError) as e:
        genai_client.models.generate_content(
            model=MODEL, contents="hi", config=cfg(response_modalities=["AUDIO"])
        )
    assert e.value.code == 400 and "responseModalities" in e.value.message


def test_image_part_refused_by_name(genai_client):
    png = bytes.fromhex("89504e470d0a1a0a0000000d49484452000000010000000108060000001f15c4890000000d4944415478da63f8cf00000301010018dd8db00000000049454e44ae426082")
    with pytest.raises(errors.ClientError) as e:
        genai_client.models.generate_content(
            model=MODEL, contents=["Describe this.", types.Part.from_bytes(data=png, mime_type="image/png")]
        )
    assert e.value.code == 400
    assert "contents[0].parts[1]" in e.value.message and "image" in e.value.message


def test_raw_bad_inputs(server):
    path = f"/v1beta/models/{MODEL}:generateContent"
    r = httpx.post(f"{server.url}{path}", content=b'{"contents": [', headers={"content-type": "application/json"}, timeout=30)
    assert "Invalid JSON" in _google_error(r, 400)["message"]
    assert "contents" in _google_error(_post(server, path, {"contents": []}), 400)["message"]
    err = _google_error(_post(server, path, {"contents": [{"parts": [{"text": "hi"}]}], "generationConfig": {"temperature": "hot"}}), 400)
    assert "temperature" in err["message"]
    for config, field in (
        ({"topP": 0}, "generationConfig.topP"), ({"candidateCount": 99}, "generationConfig.candidateCount"),
        ({"stopSequences": ["a"] * 17}, "generationConfig.stopSequences"), ({"presencePenalty": 9}, "generationConfig.presencePenalty"),
    ):
        err = _google_error(_post(server, path, {"contents": [{"parts": [{"text": "hi"}]}], "generationConfig": config}), 400)
        assert err["message"].startswith(field + " ")
        violations = [v for d in err["details"] if d["@type"].endswith("BadRequest") for v in d["fieldViolations"]]
        assert violations == [{"field": field, "description": err["message"]}]
    err = _google_error(_post(server, path, {"contents": "not a list"}), 400)
    assert "contents" in err["message"]
    bad_b64 = {"contents": [{"parts": [{"inlineData": {"mimeType": "image/png", "data": "!!!not base64!!!"}}]}]}
    err = _google_error(_post(server, path, bad_b64), 400)
    assert "base64" in err["message"] and "contents[0].parts[0]" in err["message"]
    err = _google_error(_post(server, path, {"contents": [{"role": "robot", "parts": [{"text": "hi"}]}]}), 400)
    assert "role" in err["message"]
    huge = {"contents": [{"parts": [{"text": "hello " * 9000}]}]}
    err = _google_error(_post(server, path, huge), 400)
    assert "context" in err["message"]
    err = _google_error(_post(server, f"/v1beta/models/{MODEL}:embedContent", {"content": {"parts": [{"text": "x"}]}}), 400)
    assert "embedContent" in err["message"]
    _google_error(httpx.get(f"{server.url}/v1beta/nothing-here", timeout=10), 404)
    # the server keeps serving
    assert _post(server, path, {"contents": [{"parts": [{"text": "hi"}]}], "generationConfig": {"maxOutputTokens": 2}}).status_code == 200
