"""weight_quant=checkpoint on the real SmolLM2 GGUF (Q4_1 projections, Q8_0 embedding and LM head)."""

from __future__ import annotations

import pytest
import torch

from gemel import LLM, SamplingParams
from gemel.layers import cpu_kernels
from gemel.layers.linear import AMX_GATE_UP, AMX_INT8_ACT_MAX_ROWS, AMX_TILE_MAX_ROWS, Linear

pytestmark = pytest.mark.slow


def test_checkpoint_groups_serve_small_batches_with_the_files_weights():
    quant = LLM("smollm2-135m-instruct", dtype="bfloat16", weight_quant="checkpoint", packed_max_rows=4)
    model = quant.engine.core.loaded.model
    layer_projections = [m for layer in model.layers for m in layer.modules() if isinstance(m, Linear)]
    # Q4_1 groups: gemel's integer-dot-product kernel on AVX512-VNNI, PyTorch's int4 kernel elsewhere.
    int4_kind = "int4_groups" if cpu_kernels.has_vnni() else "int4"
    assert len(layer_projections) == 4 * 30 and all(m.quant == int4_kind for m in layer_projections)
    # The Q8_0 embedding doubles as the LM head: its own int8 groups serve small batches.
    assert model.lm_head.quant == "int8_groups" and model.lm_head.w_q8.shape == model.embed_tokens.shape
    assert all(m.checkpoint_int4 is None and m.checkpoint_int8 is None
               for m in model.modules() if isinstance(m, Linear))  # file let go

    dense = LLM("smollm2-135m-instruct", dtype="bfloat16", weight_quant="none")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[{"role": "user", "content": p}] for p in ("What is the capital of France?", "Name a colour.",
                                                           "Count to five.", "Say hello in German.")]
    for messages in prompts:  # one at a time, so every decode step takes the packed path
        a = quant.chat([messages], sampling_params=params)[0].outputs[0].token_ids
        b = dense.chat([messages], sampling_params=params)[0].outputs[0].token_ids
        assert a[:2] == b[:2], (messages, a, b)
    # Above packed_max_rows the dense weights serve: a batch of 8 equals the dense engine's.
    batch = [[{"role": "user", "content": f"Write the number {i} in words."}] for i in range(8)]
    first = SamplingParams(temperature=0, max_tokens=1)
    qa = [o.outputs[0].token_ids for o in quant.chat(batch, sampling_params=first)]
    qb = [o.outputs[0].token_ids for o in dense.chat(batch, sampling_params=first)]
    assert qa == qb


def test_auto_takes_the_checkpoint_groups_in_bf16_and_the_dense_weights_in_float32():
    """The default weight_quant (auto): a bf16 engine on CPU serves small batches from the
    file's own groups (same kernels as weight_quant=checkpoint); float32 keeps every
    projection dense, its sums exact."""
    bf16 = LLM("smollm2-135m-instruct", dtype="bfloat16")
    assert bf16.engine.core.weight_quant == "checkpoint"
    model = bf16.engine.core.loaded.model
    int4_kind = "int4_groups" if cpu_kernels.has_vnni() else "int4"
    assert all(m.quant == int4_kind for layer in model.layers for m in layer.modules() if isinstance(m, Linear))
    assert model.lm_head.quant == "int8_groups"
    fp32 = LLM("smollm2-135m-instruct", dtype="float32")
    assert fp32.engine.core.weight_quant == "none"
    assert all(m.quant is None for m in fp32.engine.core.loaded.model.modules() if isinstance(m, Linear))
    assert LLM("smollm2-135m-instruct", dtype="float32", weight_quant="checkpoint").engine.core.weight_quant == "checkpoint"


@pytest.mark.skipif(not cpu_kernels.has_vnni(), reason="int8_activations needs AVX512-VNNI")
def test_int8_activations_serve_every_projection_close_to_the_dense_model():
    """int8_activations on the real GGUF: all 121 projections (Q4_1 layers, the Q8_0 LM head)
    run on the file's groups with no dense copy left, and the next-token choice under teacher
    forcing mostly agrees with the dense bf16 model (x rounded to int8 is llama.cpp's own
    arithmetic: measured 96% against float32, where bf16 reaches 98%)."""
    # amx_max_rows=0: on CPUs with AMX the tile kernel would otherwise take every call up to 128 rows
    fast = LLM("smollm2-135m-instruct", dtype="bfloat16", weight_quant="checkpoint", int8_activations=True, amx_max_rows=0)
    model = fast.engine.core.loaded.model
    projections = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(projections) == 4 * 30 + 1
    assert all(m.int8_act_out_features and m.weight is None for m in projections)
    # on CPUs with AMX, calls of more than 128 rows (prefill chunks) take the bf16 tiles instead
    amx = cpu_kernels.has_amx()
    assert all(m.int8_act_max_rows == (AMX_INT8_ACT_MAX_ROWS if amx else None) for m in projections)
    assert all((m.onednn_weight is not None) == amx for m in projections)
    # the tied LM head reads only its Q8_0 codes now, and so do the token lookups: no dense table
    assert model.embed_tokens is None

    dense = LLM("smollm2-135m-instruct", dtype="bfloat16", weight_quant="none")
    table = dense.engine.core.loaded.model.embed_tokens
    assert table.shape == (49152, 576) and torch.equal(model.lm_head.embedding_rows(torch.arange(49152)), table)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[{"role": "user", "content": p}] for p in ("Why is the sky blue?", "Describe a cat.",
                                                           "Give me a tip for learning Python.", "Who wrote Hamlet?")]
    agree = total = 0
    for out in dense.chat(prompts, sampling_params=params):  # a batch of 4: the packed path
        prompt, tokens = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
        logits = fast.engine.core.prompt_logits(prompt + tokens)[len(prompt) - 1 : -1]  # one prefill: the GEMM
        agree += (logits.argmax(-1) == torch.tensor(tokens)).sum().item()
        total += len(tokens)
    assert agree / total >= 0.85, (agree, total)
    batch = [[{"role": "user", "content": f"Write the number {i} in words."}] for i in range(12)]
    outs = fast.chat(batch, sampling_params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)  # decode steps of 12 rows take the GEMM


@pytest.mark.skipif(not cpu_kernels.amx_tiles_available(), reason="needs a CPU with AMX-BF16")
def test_amx_tiles_serve_decode_sized_calls_like_the_bf16_gemm():
    """On CPUs with AMX every projection gets its tile copy by default, and int8_activations
    (whose calls up to 128 rows the tiles now take) packs nothing; the logits of calls of up
    to 128 rows are the bf16 GEMM's up to the order of the sums."""
    tiles = LLM("smollm2-135m-instruct", dtype="bfloat16", weight_quant="checkpoint", int8_activations=True)
    projections = [m for m in tiles.engine.core.loaded.model.modules() if isinstance(m, Linear)]
    assert len(projections) == 4 * 30 + 1
    assert all(m.amx_max_rows == AMX_TILE_MAX_ROWS and m.int8_act_out_features == 0 for m in projections)
    # each MLP's gate/up tiles pair gate and up blocks, so its kernel writes silu(gate) * up itself
    layers = tiles.engine.core.loaded.model.layers
    assert all(layer.gate_up_proj.amx_layout == AMX_GATE_UP for layer in layers)
    assert sum(m.amx_layout == AMX_GATE_UP for m in projections) == len(layers) == 30
    dense = LLM("smollm2-135m-instruct", dtype="bfloat16", weight_quant="none", amx_max_rows=0)
    assert all(m.amx_max_rows == 0 for m in dense.engine.core.loaded.model.modules() if isinstance(m, Linear))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[{"role": "user", "content": p}] for p in ("Why is the sky blue?", "Who wrote Hamlet?")]
    agree = total = 0
    for out in dense.chat(prompts, sampling_params=params):
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        assert len(ids) <= AMX_TILE_MAX_ROWS
        a, b = tiles.engine.core.prompt_logits(ids), dense.engine.core.prompt_logits(ids)
        torch.testing.assert_close(a, b, rtol=0, atol=0.05 * b.abs().max().item())
        agree += (a.argmax(-1) == b.argmax(-1)).sum().item()
        total += len(ids)
    assert agree / total >= 0.95, (agree, total)
