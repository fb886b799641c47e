"""engine.compile: small decode steps run a torch.compile'd forward with the eager model's tokens."""

from __future__ import annotations

import pytest

from gemel import LLM, SamplingParams

pytestmark = pytest.mark.slow  # an inductor compile takes tens of seconds on two cores


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16: the oneDNN-prepacked projections
def test_compiled_decode_matches_eager(tiny_llama_dir, dtype):
    prompts = [[5, 17, 33, 90], [200, 11, 4, 4, 4, 60, 7], [150] * 12]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    eager = LLM(tiny_llama_dir, dtype=dtype, num_kv_blocks=64)
    compiled = LLM(tiny_llama_dir, dtype=dtype, num_kv_blocks=64, compile=True, compile_max_batch_size=2)
    runner = compiled.engine.core.runner
    calls = {"compiled": 0}
    inner = runner.compiled_forward

    def counting(*args):
        calls["compiled"] += 1
        return inner(*args)

    runner.compiled_forward = counting
    for batch in ([prompts[0]], prompts[:2], prompts):  # batch 1 and 2 compiled, 3 eager
        a = eager.generate(prompt_token_ids=batch, sampling_params=params)
        b = compiled.generate(prompt_token_ids=batch, sampling_params=params)
        for x, y in zip(a, b):
            assert x.outputs[0].token_ids == y.outputs[0].token_ids
            for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
                assert abs(lx.logprob - ly.logprob) < (1e-3 if dtype == "float32" else 5e-2)
    assert calls["compiled"] == 2 * (params.max_tokens - 1)  # the decode steps of batches 1 and 2
