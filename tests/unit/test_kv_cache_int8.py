"""engine.kv_cache_dtype=int8: rows of int8 codes with their float32 scale, written by the
PyTorch store and by the fused rotary op alike, read by the kernels and the PyTorch path."""

from __future__ import annotations

import pytest
import torch

from gemel.layers import cpu_kernels, fused
from gemel.layers.kv_cache import dequantize_rows, quantize_rows, row_width
from gemel.layers.rotary_embedding import RotaryEmbedding


def test_rows_round_trip_within_half_a_step():
    torch.manual_seed(0)
    x = torch.randn(7, 3, 64) * torch.logspace(-3, 2, 7).view(7, 1, 1)  # rows of very different sizes
    x[2, 1] = 0.0
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (7, 3, 64 + 4) and row_width(64, torch.int8) == 68
    scale = rows[..., 64:].contiguous().view(torch.float32)
    torch.testing.assert_close(scale, x.abs().amax(-1, keepdim=True) / 127)
    codes = rows[..., :64]
    assert codes.abs().max() <= 127 and (codes.abs().amax(-1) == 127)[scale[..., 0] > 0].all()
    back = dequantize_rows(rows, torch.float32)
    assert ((back - x).abs() <= scale / 2 * (1 + 1e-5)).all()
    assert torch.equal(back[2, 1], torch.zeros(64))  # an all-zero row: scale 0, no NaN
    assert dequantize_rows(rows, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ kernels could not be built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_q_store_kv_quantizes_as_the_pytorch_store_does(dtype):
    heads, kv_heads, dim, tokens, num_slots = 4, 2, 32, 5, 64
    torch.manual_seed(3)
    rotary = RotaryEmbedding(dim, 512, 10000.0, torch.device("cpu"))
    cos, sin = rotary.cos_sin(torch.tensor([0, 1, 2, 40, 41]), dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    slots = torch.tensor([7, 8, 9, 33, 60])
    k_cache = quantize_rows(torch.randn(kv_heads, num_slots, dim))
    v_cache = quantize_rows(torch.randn(kv_heads, num_slots, dim))
    want_k_cache, want_v_cache = k_cache.clone(), v_cache.clone()
    want_q, want_k = fused.rotary_qk(qkv, cos, sin, heads, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    want_k_cache.index_copy_(1, slots, quantize_rows(want_k).transpose(0, 1))
    want_v_cache.index_copy_(1, slots, quantize_rows(v).transpose(0, 1))
    q = fused.rotary_q_store_kv(qkv, cos, sin, (k_cache, v_cache), slots, heads, kv_heads, dim)
    assert torch.equal(q, want_q)
    others = torch.ones(num_slots, dtype=torch.bool)
    others[slots] = False
    assert torch.equal(k_cache[:, others], want_k_cache[:, others])  # other slots untouched
    assert torch.equal(v_cache[:, others], want_v_cache[:, others])
    for got, want in ((k_cache, want_k_cache), (v_cache, want_v_cache)):
        # Same codes (a tie may round the other way) and the same scale.
        assert (got[:, slots, :dim].int() - want[:, slots, :dim].int()).abs().max() <= 1
        torch.testing.assert_close(dequantize_rows(got[:, slots], torch.float32),
                                   dequantize_rows(want[:, slots], torch.float32), atol=0.02, rtol=0)
    with pytest.raises(RuntimeError, match="slot out of range"):
        fused.rotary_q_store_kv(qkv, cos, sin, (k_cache, v_cache), slots + num_slots, heads, kv_heads, dim)


def test_engine_allocates_int8_rows_and_fits_more_tokens(tiny_llama_dir):
    from gemel import LLM

    auto = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_mb=4)
    int8 = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_mb=4, kv_cache_dtype="int8")
    arch = int8.engine.core.loaded.arch
    k, v = int8.engine.core.runner.kv_caches[0]
    assert k.dtype == v.dtype == torch.int8 and k.shape[-1] == arch.head_dim + 4
    assert auto.engine.core.runner.kv_caches[0][0].dtype == torch.float32
    ratio = int8.engine.core.block_manager.num_blocks / auto.engine.core.block_manager.num_blocks
    assert abs(ratio - 4 * arch.head_dim / (arch.head_dim + 4)) < 0.1  # float32 -> int8 + scale


def test_compiled_steps_use_the_int8_cache_as_eager_steps_do(tiny_llama_dir):
    """engine.compile: the compiled decode step stores k and v through the PyTorch
    quantisation and reads the cache with the kernel; same tokens as eager steps."""
    from gemel import LLM, SamplingParams

    prompts = [[5, 17, 33, 90], [200, 11, 4, 4, 4, 60, 7] * 5, [150] * 12]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    outs = []
    for compile_ in (False, True):
        llm = LLM(tiny_llama_dir, dtype="float32", num_kv_blocks=64, kv_cache_dtype="int8", compile=compile_)
        assert (llm.engine.core.runner.compiled_forward is not None) is compile_
        outs.append(llm.generate(prompt_token_ids=prompts, sampling_params=params))
    for a, b in zip(*outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert abs(la.logprob - lb.logprob) < 1e-4
