"""Pieces of gemel serve that need no model: configuration, input checks, error shapes."""

from __future__ import annotations

import argparse
import base64

import pytest

from gemel.api.errors import APIError, error_body, surface_of
from gemel.api.inputs import check_gemini_base64, decode_base64, openai_messages
from gemel.api.lifecycle import Deadline
from gemel.api.middleware import child_traceparent
from gemel.api.server import add_serve_arguments, apply_overrides
from gemel.config import GemelConfig, ServerConfig


def test_default_config_serves_default_model_with_aliases():
    c = GemelConfig()
    assert c.server.host == "127.0.0.1" and c.server.port == 8000
    assert [m.id for m in c.models] == ["smollm2-135m-instruct"]
    assert "gemini-2.0-flash" in c.models[0].aliases and "gpt-4o-mini" in c.models[0].aliases
    assert c.embeddings.id == "all-minilm-l6-v2"
    assert c.engine_config(c.models[0]).model == "smollm2-135m-instruct"


def test_catalogue_names_must_be_unique():
    with pytest.raises(ValueError, match="used twice"):
        GemelConfig.model_validate({"models": [{"id": "a", "source": "x"}, {"id": "b", "source": "y", "aliases": ["a"]}]})


def test_entry_overrides_engine_settings():
    c = GemelConfig.model_validate({"engine": {"dtype": "bfloat16"}, "models": [{"id": "m", "source": "s", "dtype": "float32", "max_context": 512}]})
    e = c.engine_config(c.models[0])
    assert (e.model, e.dtype, e.max_model_len) == ("s", "float32", 512)


def test_cli_overrides():
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--host", "0.0.0.0", "--port", "0", "--model", "gemma3-270m", "--dtype", "float32", "--no-embeddings"])
    c = apply_overrides(GemelConfig(), args)
    assert (c.server.host, c.server.port, c.engine.dtype) == ("0.0.0.0", 0, "float32")
    assert c.models[0].id == "gemma3-270m" and "gemini-2.0-flash" in c.models[0].aliases
    assert c.embeddings is None


def test_base64_checks():
    assert decode_base64(base64.b64encode(b"\x00\xffhi").decode(), "x") == b"\x00\xffhi"
    assert decode_base64(base64.urlsafe_b64encode(b"\xfb\xff").decode().rstrip("="), "x") == b"\xfb\xff"
    for bad in ("!!!", "abcde", "ab=c"):
        with pytest.raises(APIError) as e:
            decode_base64(bad, "contents[0].parts[0].inlineData.data")
        assert e.value.status == 400 and "contents[0].parts[0]" in e.value.message
    with pytest.raises(APIError):
        check_gemini_base64({"contents": [{"parts": [{"inline_data": {"mime_type": "image/png", "data": "%%"}}]}]})


def test_openai_messages():
    msgs = openai_messages([{"role": "developer", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}], "m")
    assert msgs == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    with pytest.raises(APIError, match=r"messages\[0\].content\[0\].*image"):
        openai_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}], "m")
    with pytest.raises(APIError, match="role"):
        openai_messages([{"role": "wizard", "content": "hi"}], "m")
    # null or missing content: an error for system, developer and user turns, an empty assistant turn
    for role in ("system", "developer", "user"):
        for msg in ({"role": role, "content": None}, {"role": role}):
            with pytest.raises(APIError, match=r"messages\[1\].content: .*null") as e:
                openai_messages([{"role": "user", "content": "hi"}, msg], "m")
            assert e.value.status == 400 and e.value.param == "messages[1].content"
    assert openai_messages([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}], "m")[1] == {
        "role": "assistant", "content": ""}


def test_openai_refuses_what_it_cannot_honour_by_name():
    from gemel.api import openai_api

    def refusal(**fields):
        body = openai_api.ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})
        try:
            openai_api._refuse(body)
        except APIError as e:
            assert e.status == 400
            return e.param
        return None

    assert refusal(stream_options={"include_usage": True}) == "stream_options"  # without stream
    assert refusal(stream=True, stream_options={"include_usage": True}) is None
    assert refusal(modalities=["text", "audio"]) == "modalities"
    assert refusal(modalities="audio") == "modalities"
    assert refusal(modalities=["text"]) is None
    assert refusal(audio={"voice": "alloy", "format": "wav"}) == "audio"
    assert refusal(logit_bias={"50256": -100}) == "logit_bias"
    assert refusal(user="u", metadata={"a": "b"}, store=False) is None
    completion = openai_api.CompletionRequest.model_validate({"model": "m", "prompt": "hi", "stream_options": {}})
    with pytest.raises(APIError, match="stream_options"):
        openai_api._refuse(completion)


def test_error_shapes():
    err = APIError(429, "slow down", retry_after_s=3)
    g = error_body(err, "gemini")["error"]
    assert g["code"] == 429 and g["status"] == "RESOURCE_EXHAUSTED"
    assert g["details"][0]["@type"].endswith("RetryInfo") and g["details"][0]["retryDelay"] == "3s"
    o = error_body(APIError(404, "nope", code="model_not_found"), "openai")["error"]
    assert o == {"message": "nope", "type": "invalid_request_error", "param": None, "code": "model_not_found"}
    both = error_body(APIError(404, "nope"), "both")["error"]
    assert both["code"] == 404 and both["status"] == "NOT_FOUND" and both["type"] == "invalid_request_error"
    assert surface_of("/v1/models") == "both" and surface_of("/v1/chat/completions") == "openai"
    assert surface_of("/v1/models/x") == "both"
    assert surface_of("/v1/models/x:generateContent") == "gemini"
    assert surface_of("/v1beta/models/x:generateContent") == "gemini"


def test_deadline_headers():
    class R:
        def __init__(self, headers):
            self.headers = headers

    cfg = ServerConfig(request_timeout_s=10, max_request_timeout_s=60)
    assert Deadline.from_request(R({}), cfg).timeout_s == 10
    assert Deadline.from_request(R({"x-gemel-timeout-ms": "1500"}), cfg).timeout_s == 1.5
    assert Deadline.from_request(R({"x-server-timeout": "600"}), cfg).timeout_s == 60
    with pytest.raises(APIError):
        Deadline.from_request(R({"x-server-timeout": "soon"}), cfg)


def test_traceparent_continues_trace():
    tp = child_traceparent("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    assert tp.startswith("00-0af7651916cd43dd8448eb211c80319c-") and not tp.endswith("b7ad6b7169203331-01")
    assert len(child_traceparent(None).split("-")[1]) == 32


# -- decoding knobs: one table, errors that carry their field ---------------------------------
BAD_VALUES = {
    "n": 0, "temperature": -1.0, "top_p": 0.0, "top_k": 1.5, "min_p": 2.0, "presence_penalty": 3.0,
    "frequency_penalty": -3.0, "repetition_penalty": 0.0, "seed": 1.5, "max_tokens": 0, "min_tokens": -1,
    "stop": [""], "logprobs": 21, "priority": 7,
}


@pytest.mark.parametrize("field", sorted(BAD_VALUES))
def test_sampling_param_error_names_its_field(field):
    from gemel.sampling_params import SamplingParamError, SamplingParams

    with pytest.raises(SamplingParamError) as info:
        SamplingParams(**{field: BAD_VALUES[field]})
    assert info.value.field == field
    assert str(info.value).startswith(field + " ")  # a plain ValueError still reads well offline


@pytest.mark.parametrize("field", sorted(BAD_VALUES))
def test_each_surface_names_a_bad_knob_its_own_way(field):
    from gemel.api.params import KNOBS, make_params

    knob = next(k for k in KNOBS if k.name == field)
    for surface, expected in (("openai", knob.openai), ("gemini", knob.gemini)):
        with pytest.raises(APIError) as info:
            make_params({field: BAD_VALUES[field]}, surface)
        err = info.value
        assert err.status == 400
        if surface == "gemini" and expected:
            head, *rest = expected.split("_")
            expected = "generationConfig." + head + "".join(w.title() for w in rest)
        assert err.param == (expected or field)
        assert err.message.startswith(err.param + " ")


def test_a_knob_sent_under_another_name_is_named_so():
    from gemel.api.params import make_params

    with pytest.raises(APIError) as info:
        make_params({"max_tokens": 0}, "openai", {"max_tokens": "max_completion_tokens"})
    assert info.value.param == "max_completion_tokens" and "max_completion_tokens must be" in info.value.message


def test_knob_table_covers_every_decoding_field():
    """A SamplingParams field a client can set appears in the table, once."""
    import dataclasses

    from gemel.api.params import KNOBS
    from gemel.sampling_params import SamplingParams

    names = [k.name for k in KNOBS]
    assert len(names) == len(set(names))
    internal_only = {"stop_token_ids", "include_stop_str_in_output", "structured_output"}
    fields = {f.name for f in dataclasses.fields(SamplingParams)} - internal_only
    assert set(names) == fields
