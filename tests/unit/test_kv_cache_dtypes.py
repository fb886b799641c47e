"""The KV cache's element types other than the model's own (int8 rows with a scale, float16
under a float32 model), end to end in an engine: the C++ kernels and fused ops give the
PyTorch path's tokens, the prefix cache changes nothing, and the outputs stay within the
type's rounding of a cache in the model's dtype."""

from __future__ import annotations

import pytest
import torch

from gemel.layers import cpu_kernels

# kv_cache_dtype: (element type, largest logprob difference between the kernel and PyTorch
# paths over 16 steps, largest difference of the first token's logprob from the float cache's)
KV_TYPES = {
    # int8: the same codes on both paths; only the sums' order differs
    "int8": (torch.int8, 1e-4, 0.05),
    # float16: the same values on both paths (the stores round alike); float32 sums in another
    # order over 16 steps, and 11 significant bits against float32's 24
    "float16": (torch.float16, 3e-4, 0.01),
}


@pytest.mark.parametrize("path", ["kernels", "pytorch"])
@pytest.mark.parametrize("kv", list(KV_TYPES))
def test_engine_with_the_cache_is_consistent(tiny_model_dir, kv, path):
    """Tiny Llama and Gemma 3 (sliding window), float32."""
    from gemel import LLM, SamplingParams

    element, path_bound, first_bound = KV_TYPES[kv]
    prompts = [[5, 17, 33, 90], [200, 11, 4, 4, 4, 60, 7] * 5, [150] * 12, [200, 11, 4, 4, 4, 60, 7] * 5 + [9]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    on = path == "kernels"
    if on and not cpu_kernels.load():
        pytest.skip("the C++ kernels could not be built")

    def run(**kwargs):
        llm = LLM(tiny_model_dir, dtype="float32", num_kv_blocks=64, **kwargs)
        return llm, llm.generate(prompt_token_ids=prompts, sampling_params=params)

    llm, typed = run(kv_cache_dtype=kv, cpu_attention_kernel=on, cpu_fused_ops=on)
    assert all(c.dtype == element for layer in llm.engine.core.runner.kv_caches for c in layer)
    _, reference = run(kv_cache_dtype=kv, cpu_attention_kernel=False, cpu_fused_ops=False)
    _, uncached = run(kv_cache_dtype=kv, cpu_attention_kernel=on, cpu_fused_ops=on, enable_prefix_caching=False)
    _, floats = run(cpu_attention_kernel=on, cpu_fused_ops=on)
    for a, b, c, f in zip(typed, reference, uncached, floats):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert abs(la.logprob - lb.logprob) < path_bound
        # Teacher-forced against the float cache: the first token (only the prompt's own
        # keys, rounded once) is the same and its logprob within the type's rounding.
        assert a.outputs[0].token_ids[0] == f.outputs[0].token_ids[0]
        assert abs(a.outputs[0].logprobs[0].logprob - f.outputs[0].logprobs[0].logprob) < first_bound
