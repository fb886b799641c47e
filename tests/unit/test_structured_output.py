"""Grammar-constrained decoding (JSON mode, JSON schema) with llguidance, on the tiny random model: outputs
parse and validate, free requests are unaffected by constrained neighbours, and the token mask
holds on PyTorch's AVX2 kernels too."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from gemel import LLM, SamplingParams
from gemel.engine.structured_output import StructuredOutputSpec, validate
from gemel.layers import kernel_plan

SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "c": {"enum": ["red", "green"]}},
        "required": ["n", "c"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "inner": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "s": {"type": "string", "maxLength": 5}},
                "required": ["x", "s"],
                "additionalProperties": False,
            }
        },
        "required": ["inner"],
        "additionalProperties": False,
    },
]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, dtype="float32", block_size=4, num_kv_blocks=512)


@pytest.mark.parametrize("schema", SCHEMAS, ids=["bool", "int-enum", "array", "nested"])
def test_sampled_outputs_validate(llm, schema):
    spec = StructuredOutputSpec("json_schema", json.dumps(schema))
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=200, structured_output=spec) for i in range(5)
    ]
    outs = llm.generate(prompt_token_ids=[[5, 6, 7 + i] for i in range(5)], sampling_params=params)
    for out in outs:
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)


def test_json_object_mode(llm):
    spec = StructuredOutputSpec("json_object")
    outs = llm.generate(
        prompt_token_ids=[[9, 9, 9]],
        sampling_params=SamplingParams(temperature=0.8, seed=3, max_tokens=300, structured_output=spec),
    )
    text = outs[0].outputs[0].text
    if outs[0].outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # a random model may keep an object open until max_tokens; it must still be a JSON prefix
        assert text.lstrip().startswith("{")


def test_free_requests_unaffected_by_constrained_neighbours(llm):
    free = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [[11, 12, 13], [40, 41], [100, 7, 7, 7]]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=free)]
    spec = StructuredOutputSpec("json_schema", json.dumps(SCHEMAS[1]))
    constrained = SamplingParams(temperature=0, max_tokens=40, structured_output=spec)
    mixed = llm.generate(
        prompt_token_ids=[prompts[0], [5, 5], prompts[1], [6, 6], prompts[2]],
        sampling_params=[free, constrained, free, constrained, free],
    )
    assert [mixed[i].outputs[0].token_ids for i in (0, 2, 4)] == alone
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), SCHEMAS[1])


def test_invalid_schema_is_reported():
    assert validate(StructuredOutputSpec("json_schema", '{"type": "nonsense"}'))
    assert validate(StructuredOutputSpec("json_schema", "{not json"))
    assert validate(StructuredOutputSpec("json_schema", json.dumps(SCHEMAS[0]))) is None


def test_gemini_openapi_schema_translation():
    from gemel.api.structured import openapi_to_json_schema

    gemini = {
        "type": "OBJECT",
        "properties": {
            "name": {"type": "STRING", "maxLength": "10"},
            "kind": {"type": "STRING", "format": "enum", "enum": ["a", "b"]},
            "n": {"type": "INTEGER", "nullable": True, "minimum": 1},
            "xs": {"type": "ARRAY", "items": {"type": "NUMBER"}, "maxItems": "3"},
        },
        "required": ["name", "kind"],
        "propertyOrdering": ["kind", "name"],
    }
    out = openapi_to_json_schema(gemini)
    assert out["type"] == "object" and list(out["properties"])[:2] == ["kind", "name"]
    assert out["properties"]["name"] == {"type": "string", "maxLength": 10}
    assert out["properties"]["kind"] == {"enum": ["a", "b"]}
    assert out["properties"]["n"] == {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}]}
    assert out["properties"]["xs"] == {"type": "array", "items": {"type": "number"}, "maxItems": 3}
    jsonschema.validate({"name": "x", "kind": "a", "n": None, "xs": [1.5]}, out)


@pytest.mark.parametrize("path", ["cpp", "torch"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bitmask_forbids_exactly_the_tokens_whose_bit_is_clear(dtype, path, monkeypatch):
    """Token 32 w + j is allowed when bit j of word w is set; ids past the grammar's vocabulary
    (padding rows of the LM head) never are; rows without a grammar are left alone. Both the
    C++ op and the PyTorch ops that serve where it does not."""
    import torch

    from gemel.engine.structured_output import apply_bitmask_
    from gemel.layers import cpu_kernels

    if path == "torch":
        monkeypatch.setattr(cpu_kernels, "load", lambda *a, **k: False)
    else:
        assert cpu_kernels.load()
    vocab, width = 1000, 1010
    gen = torch.Generator().manual_seed(0)
    words = torch.randint(-(2**31), 2**31 - 1, (2, (vocab + 31) // 32), dtype=torch.int32, generator=gen)
    words[0, 3] = 0
    words[0, 4] = -1
    logits = torch.randn(3, width, generator=gen).to(getattr(torch, dtype))
    before = logits.clone()
    apply_bitmask_(logits, words, [2, 0], vocab)
    assert torch.equal(logits[1], before[1])  # no grammar: untouched
    for row, k in ((2, 0), (0, 1)):
        allowed = [(int(words[k, t // 32]) >> (t % 32)) & 1 == 1 for t in range(vocab)] + [False] * (width - vocab)
        assert torch.isfinite(logits[row]).tolist() == allowed
        assert torch.equal(logits[row][torch.tensor(allowed)], before[row][torch.tensor(allowed)])


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or "avx2" not in kernel_plan.cpu_info().flags,
                    reason="needs an x86 CPU with AVX2")
def test_constrained_sampling_on_pytorchs_avx2_kernels():
    """The tests above again with PyTorch's AVX2 kernels (what an AVX2-only CPU runs, and what
    `bench/compare.py --isa avx2` sets), in a process of its own: llguidance's torch.compile'd
    mask helper, which gemel used before, loaded its AVX-512 build from Inductor's cache there
    and left tokens allowed that the grammar forbids."""
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"{Path(__file__).relative_to(root)}::test_sampled_outputs_validate",
         f"{Path(__file__).relative_to(root)}::test_json_object_mode",
         f"{Path(__file__).relative_to(root)}::test_bitmask_forbids_exactly_the_tokens_whose_bit_is_clear"],
        cwd=root, env=dict(os.environ, ATEN_CPU_CAPABILITY="avx2"), capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0 and " passed" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]
