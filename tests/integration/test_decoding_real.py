"""Decoding features on the real models: structured output across 10 schemas, speculative
decoding's greedy identity, and logprobs against transformers' log-softmax."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from parity import hf_model_from_gguf

from gemel import LLM, SamplingParams
from gemel.engine.structured_output import StructuredOutputSpec

pytestmark = pytest.mark.slow

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                "minItems": 1, "maxItems": 3}}, "required": ["items"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "score": {"type": "number", "minimum": 0, "maximum": 100}}, "required": ["ok", "score"]},
    {"type": "object", "properties": {"address": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 15}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["city", "zip"]}}, "required": ["address"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 10}}, "required": ["n"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
                                      "count": {"type": "integer", "minimum": 0, "maximum": 100}}, "required": ["tags", "count"]},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 30},
                                      "year": {"type": "integer", "minimum": 1900, "maximum": 2030}},
     "required": ["title", "year"]},
    {"type": "object", "properties": {"points": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": -999, "maximum": 999}, "y": {"type": "integer", "minimum": -999, "maximum": 999}}, "required": ["x", "y"]}}},
     "required": ["points"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "reason": {"type": "string", "maxLength": 40}},
     "required": ["answer", "reason"]},
]


def _closed(schema):
    """additionalProperties: false on every object, as OpenAI's strict mode requires: without it
    a small model may keep inventing keys until max_tokens."""
    if isinstance(schema, dict):
        schema = {k: _closed(v) for k, v in schema.items()}
        if schema.get("type") == "object":
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [_closed(v) for v in schema]
    return schema


SCHEMAS = [_closed(s) for s in SCHEMAS]
PROMPT = "Reply with a JSON object that fits this request: describe something interesting."


@pytest.mark.parametrize("model,dtype", [("smollm2-135m-instruct", "auto"), ("gemma3-270m", "auto")])
def test_200_structured_generations_validate(model, dtype):
    """Every generation the grammar ends validates against its schema. One that reaches
    max_tokens first (a sampled number's digits can run on: JSON numbers have no length
    bound) must still be a prefix the grammar accepts, token by token, and such are rare."""
    import llguidance

    llm = LLM(model, dtype=dtype, kv_cache_memory_mb=256)
    prompt = [{"role": "user", "content": PROMPT}] if llm.tokenizer.chat_template else PROMPT
    failures, cut = [], []
    for s_index, schema in enumerate(SCHEMAS):
        spec = StructuredOutputSpec("json_schema", json.dumps(schema))
        params = [
            SamplingParams(temperature=0.8, seed=100 * s_index + i, max_tokens=160, structured_output=spec)
            for i in range(10)
        ]
        for out in llm.generate([prompt] * 10, params):
            text = out.outputs[0].text
            if out.outputs[0].finish_reason == "length":
                matcher = llguidance.LLMatcher(llm.engine.core.structured.tokenizer, spec.grammar())
                if not matcher.consume_tokens(list(out.outputs[0].token_ids)) or matcher.is_error():
                    failures.append((s_index, "length", text, matcher.get_error()))
                cut.append((s_index, text[:80]))
                continue
            try:
                jsonschema.validate(json.loads(text), schema)
            except Exception as exc:  # collect them all, then fail with every case listed
                failures.append((s_index, out.outputs[0].finish_reason, text, str(exc)[:100]))
    assert not failures, failures
    assert len(cut) <= 2, cut


def test_ngram_speculation_greedy_identical_on_gemma3():
    prompts = ["Repeat exactly: one two three four five six seven eight. One two three four",
               "The quick brown fox jumps over the lazy dog. The quick brown fox"]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base = LLM("gemma3-270m", dtype="float32", kv_cache_memory_mb=128)
    ref = [o.outputs[0].token_ids for o in base.generate(prompts, params)]
    del base
    spec = LLM("gemma3-270m", dtype="float32", kv_cache_memory_mb=128, speculative_method="ngram")
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    assert spec.engine.core.spec_stats.num_draft_tokens > 0
    assert got == ref


@pytest.mark.parametrize("method", ["ngram", "draft_layers"])
def test_speculative_greedy_identical_on_smollm2(method):
    prompts = [
        [{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the lazy dog. The quick brown fox."}],
        [{"role": "user", "content": "Write a haiku about autumn."}],
        [{"role": "user", "content": "List the numbers from one to ten in words."}],
    ]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    base = LLM("smollm2-135m-instruct", dtype="float32", kv_cache_memory_mb=128)
    ref = [o.outputs[0].token_ids for o in base.generate(prompts, params)]
    del base
    spec = LLM("smollm2-135m-instruct", dtype="float32", kv_cache_memory_mb=128, speculative_method=method,
               num_speculative_tokens=4, draft_layers=10)
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    assert spec.engine.core.spec_stats.num_draft_tokens > 0
    assert got == ref


def test_logprobs_match_transformers_log_softmax(tmp_path):
    llm = LLM("smollm2-135m-instruct", dtype="float32", kv_cache_memory_mb=128)
    out = llm.generate(
        [[{"role": "user", "content": "Name a colour."}]],
        SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True),
    )[0]
    hf = hf_model_from_gguf(llm.engine.core.loaded.path, torch.float32, str(tmp_path))
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    start = len(out.prompt_token_ids) - 1
    for step, lp in enumerate(out.outputs[0].logprobs):
        assert abs(lp.logprob - float(ref[start + step, lp.token_id])) < 2e-3
        for tok, value in lp.top:
            assert abs(value - float(ref[start + step, tok])) < 2e-3
