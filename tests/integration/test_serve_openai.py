"""gemel serve through the official openai SDK."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "gpt-4o-mini"
MSGS = [{"role": "user", "content": "Say hello."}]


def test_chat_completion(openai_client):
    r = openai_client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=10, temperature=0)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content
    assert c.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.model == MODEL and r.id.startswith("chatcmpl-")


def test_chat_system_and_multi_turn(openai_client):
    messages = [
        {"role": "system", "content": "You are a pirate. Always say Arr."},
        {"role": "user", "content": "My name is Bob."},
        {"role": "assistant", "content": "Arr, hello Bob!"},
        {"role": "user", "content": [{"type": "text", "text": "What is my name?"}]},
    ]
    r = openai_client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=8, temperature=0)
    short = openai_client.chat.completions.create(model=MODEL, messages=messages[-1:], max_completion_tokens=8, temperature=0)
    assert r.choices[0].message.content
    assert r.usage.prompt_tokens > short.usage.prompt_tokens + 10


def test_stop_and_seed(openai_client):
    base = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count from 1 to 10."}], max_tokens=24, temperature=0
    ).choices[0].message.content
    words = base.split()
    assert len(words) >= 3, base
    r = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count from 1 to 10."}], max_tokens=24, temperature=0, stop=[words[2]]
    )
    assert words[2] not in r.choices[0].message.content and r.choices[0].finish_reason == "stop"
    assert base.startswith(r.choices[0].message.content)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Invent a word."}], max_tokens=12, temperature=1.0, seed=99)
    a = openai_client.chat.completions.create(**kw).choices[0].message.content
    b = openai_client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def test_n_and_logprobs(openai_client):
    r = openai_client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=5, n=2, seed=3, temperature=1.0, logprobs=True, top_logprobs=2
    )
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert c.logprobs.content and all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in c.logprobs.content)
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)


def test_extra_sampling_params(openai_client):
    r = openai_client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=6, seed=5,
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True, "priority": 0},
    )
    assert r.usage.completion_tokens == 6  # ignore_eos: runs to max_tokens


def test_completions(openai_client):
    r = openai_client.completions.create(
        model="gpt-3.5-turbo-instruct", prompt=["Once upon a time", "The capital of France is"], max_tokens=6, temperature=0, logprobs=2
    )
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert c.text and len(c.logprobs.tokens) == len(c.logprobs.token_logprobs)
        assert all(len(t) <= 2 for t in c.logprobs.top_logprobs)
    assert "".join(r.choices[0].logprobs.tokens) == r.choices[0].text
    stream = openai_client.completions.create(
        model="gpt-3.5-turbo-instruct", prompt="Once upon a time", max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == 6


def test_chat_stream_matches_unary(openai_client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a fact."}], max_tokens=16, temperature=0.8, seed=11)
    unary = openai_client.chat.completions.create(**kw)
    chunks = list(openai_client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == unary.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [unary.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == unary.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.parametrize("fmt", ["base64", "float"])
def test_embeddings(openai_client, genai_client, fmt):
    texts = ["The cat sits on the mat.", "Stock markets fell."]
    r = openai_client.embeddings.create(model="text-embedding-3-small", input=texts, encoding_format=fmt)
    if fmt == "base64":  # asked for explicitly, the SDK hands the string over undecoded
        vecs = np.array([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in r.data])
    else:
        vecs = np.array([d.embedding for d in r.data])
    default = openai_client.embeddings.create(model="text-embedding-3-small", input=texts)  # base64 on the wire, decoded
    assert np.allclose(vecs, np.array([d.embedding for d in default.data]), atol=1e-6)
    assert vecs.shape == (2, 384)
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1, atol=1e-4)
    assert r.usage.prompt_tokens > 0
    g = genai_client.models.embed_content(model="text-embedding-004", contents=texts)
    assert np.allclose(vecs, np.array([e.values for e in g.embeddings]), atol=1e-6)


def test_embeddings_raw_base64(server):
    r = httpx.post(f"{server.url}/v1/embeddings", json={"model": "all-minilm-l6-v2", "input": "hi", "encoding_format": "base64", "dimensions": 32}, timeout=30)
    vec = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    assert vec.shape == (32,) and abs(np.linalg.norm(vec) - 1) < 1e-4


def test_models(openai_client):
    ids = [m.id for m in openai_client.models.list()]
    assert MODEL in ids and "smollm2-135m-instruct" in ids and "text-embedding-3-small" in ids
    m = openai_client.models.retrieve(MODEL)
    assert m.id == MODEL and m.object == "model" and m.owned_by


def test_errors(openai_client, server):
    with pytest.raises(openai.NotFoundError):
        openai_client.chat.completions.create(model="no-such-model", messages=MSGS)
    with pytest.raises(openai.NotFoundError):
        openai_client.models.retrieve("no-such-model")
    cases = [
        (dict(temperature=5), "temperature"),
        (dict(n=0), "n"),
        (dict(max_tokens=-1), "max_tokens"),
        (dict(max_tokens=10**7), "max_tokens"),
        (dict(top_p=0), "top_p"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), "tools"),
        (dict(response_format={"type": "xml"}), "response_format.type"),
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
         "response_format.json_schema"),
        (dict(stream_options={"include_usage": True}), "stream_options"),  # without stream
        (dict(modalities=["text", "audio"]), "modalities"),
        (dict(messages=[{"role": "user", "content": None}]), "messages[0].content"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            openai_client.chat.completions.create(**{"model": MODEL, "messages": MSGS} | kw)
        assert e.value.body["param"] == param, (kw, e.value.body)
    for prompt, words in (([[]], "must not be empty"), ([[7, -1]], "token ids"), ([[7], [10**9]], "prompt[1]")):
        with pytest.raises(openai.BadRequestError) as e:
            openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert words in e.value.message, (prompt, e.value.message)
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello " * 9000}])
    assert "context" in e.value.message
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}])
    assert "messages[0].content[1]" in e.value.message
    bad_b64 = {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [bad_b64]}])
    assert "base64" in e.value.message
    # malformed JSON and wrong types, in OpenAI's error format (not FastAPI's 422)
    r = httpx.post(f"{server.url}/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": "hi"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": []}, timeout=10)
    assert r.status_code == 400
    with pytest.raises(openai.BadRequestError):
        openai_client.embeddings.create(model=MODEL, input="hi")
    # a bad decoding knob names the field as the caller sent it
    for extra, param in (
        ({"top_p": 0}, "top_p"), ({"n": 0}, "n"), ({"stop": [""]}, "stop"), ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"presence_penalty": 5}, "presence_penalty"), ({"extra_body": {"min_p": 3}}, "min_p"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            openai_client.chat.completions.create(model=MODEL, messages=MSGS, **extra)
        assert e.value.body["param"] == param and e.value.body["message"].startswith(param + " ")
    # still serving
    assert openai_client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2).choices[0].message.content is not None
