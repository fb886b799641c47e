"""weight_quant=checkpoint on the real SmolLM2 GGUF (Q4_1 projections, Q8_0 embedding and LM head)."""

from __future__ import annotations

import pytest

from gemel import LLM, SamplingParams
from gemel.layers import cpu_kernels
from gemel.layers.linear import Linear

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

    dense = LLM("smollm2-135m-instruct", dtype="bfloat16")
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
