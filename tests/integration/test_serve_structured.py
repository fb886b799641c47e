"""Structured output through both SDKs: Gemini responseSchema / responseJsonSchema /
text/x.enum and OpenAI response_format, plus schema errors as 400s."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from google.genai import errors, types

pytestmark = pytest.mark.slow

MODEL = "gemini-2.0-flash"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_gemini_response_schema_openapi_subset(genai_client):
    schema = types.Schema(
        type=types.Type.OBJECT,
        properties={
            "city": types.Schema(type=types.Type.STRING, max_length=12),
            "sunny": types.Schema(type=types.Type.BOOLEAN),
            "tags": types.Schema(type=types.Type.ARRAY, max_items=2,
                                 items=types.Schema(type=types.Type.STRING, enum=["warm", "cold"])),
        },
        required=["city", "sunny", "tags"],
    )
    r = genai_client.models.generate_content(
        model=MODEL,
        contents="Describe the weather as JSON.",
        config=types.GenerateContentConfig(response_mime_type="application/json", response_schema=schema,
                                           max_output_tokens=80, temperature=0),
    )
    data = json.loads(r.text)
    assert isinstance(data["city"], str) and isinstance(data["sunny"], bool)
    assert set(data["tags"]) <= {"warm", "cold"}


def test_gemini_response_json_schema_and_enum(genai_client):
    r = genai_client.models.generate_content(
        model=MODEL,
        contents="Give a person as JSON.",
        config=types.GenerateContentConfig(response_mime_type="application/json", response_json_schema=PERSON,
                                           max_output_tokens=60, temperature=0),
    )
    jsonschema.validate(json.loads(r.text), PERSON)
    r = genai_client.models.generate_content(
        model=MODEL,
        contents="Is the sky blue?",
        config=types.GenerateContentConfig(
            response_mime_type="text/x.enum",
            response_schema=types.Schema(type=types.Type.STRING, format="enum", enum=["yes", "no"]),
            max_output_tokens=8,
        ),
    )
    assert r.text in ("yes", "no")


def test_gemini_invalid_schema_is_400(genai_client):
    with pytest.raises(errors.ClientError) as err:
        genai_client.models.generate_content(
            model=MODEL,
            contents="x",
            config=types.GenerateContentConfig(response_mime_type="application/json",
                                               response_json_schema={"type": "nonsense"}),
        )
    assert err.value.code == 400 and "responseJsonSchema" in str(err.value)


def test_openai_json_schema_and_json_object(openai_client):
    r = openai_client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": "Give a person as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
        max_tokens=60,
        temperature=0,
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = openai_client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": "Reply with a JSON object with a key 'a'."}],
        response_format={"type": "json_object"},
        max_tokens=40,
        temperature=0,
    )
    content = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:
        assert content.startswith("{")


def test_openai_invalid_schema_is_400(openai_client):
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        )
    assert "json_schema" in str(err.value)
