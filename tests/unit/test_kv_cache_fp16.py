"""float16 KV caches under a float32 model: what the AVX2 plan stores by default (half the
bytes of a float32 cache for decode attention to read), written by the fused rotary op and the
PyTorch store alike and read by the kernels and the PyTorch path."""

from __future__ import annotations

import pytest
import torch

from gemel.layers import cpu_kernels, fused
from gemel.layers.kernel_plan import plan_engine, resolve_isa
from gemel.layers.rotary_embedding import RotaryEmbedding

kernels = pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ kernels could not be built")


@kernels
def test_rotary_q_store_kv_rounds_as_the_pytorch_store_does():
    heads, kv_heads, dim, tokens, num_slots = 4, 2, 32, 5, 64
    torch.manual_seed(3)
    rotary = RotaryEmbedding(dim, 512, 10000.0, torch.device("cpu"))
    cos, sin = rotary.cos_sin(torch.tensor([0, 1, 2, 40, 41]), torch.float32)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim) * 3
    slots = torch.tensor([7, 8, 9, 33, 60])
    k_cache = torch.randn(kv_heads, num_slots, dim).half()
    v_cache = torch.randn(kv_heads, num_slots, dim).half()
    want_k_cache, want_v_cache = k_cache.clone(), v_cache.clone()
    want_q, want_k = fused.rotary_qk(qkv, cos, sin, heads, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    want_k_cache.index_copy_(1, slots, want_k.half().transpose(0, 1))
    want_v_cache.index_copy_(1, slots, v.half().transpose(0, 1))
    q = fused.rotary_q_store_kv(qkv, cos, sin, (k_cache, v_cache), slots, heads, kv_heads, dim)
    assert q.dtype == torch.float32 and torch.equal(q, want_q)
    assert torch.equal(k_cache, want_k_cache) and torch.equal(v_cache, want_v_cache)  # others untouched too
    with pytest.raises(RuntimeError, match="float16 under float32"):  # float16 caches need float32 rows
        fused.rotary_q_store_kv(qkv.bfloat16(), cos.bfloat16(), sin.bfloat16(), (k_cache, v_cache), slots, heads,
                                kv_heads, dim)


@kernels
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 6])  # query heads per KV head
@pytest.mark.parametrize("dim", [40, 64, 256])
def test_decode_and_prefill_kernels_read_float16_rows_as_the_pytorch_path(window, group, dim):
    """The kernel over a float16 cache equals softmax attention on the cache's values widened
    to float32 (decode: one query per sequence; prefill: several, causal). The AVX2 loops
    widen each row once for 1-4 query heads a KV head (more take the general loops), and a
    decode's tasks ask for the next one's rows as they go: contexts of different lengths, some
    shorter than a step of the loop."""
    torch.manual_seed(0)
    kv_heads, num_slots = 2, 256
    heads = group * kv_heads
    k_cache = torch.randn(kv_heads, num_slots, dim).half()
    v_cache = torch.randn(kv_heads, num_slots, dim).half()
    lens = torch.tensor([1, 17, 40, 3, 29])
    kv_slots = torch.stack([torch.randperm(num_slots)[:40] for _ in lens])
    scale = dim**-0.5

    def reference(q, b, n):
        keys = k_cache[:, kv_slots[b, :n]].float().repeat_interleave(heads // kv_heads, 0)  # [H, n, D]
        values = v_cache[:, kv_slots[b, :n]].float().repeat_interleave(heads // kv_heads, 0)
        start = max(0, n - window) if window else 0
        scores = (keys[:, start:] @ q.unsqueeze(-1)).squeeze(-1) * scale
        return (torch.softmax(scores, -1).unsqueeze(1) @ values[:, start:]).squeeze(1)

    q = torch.randn(len(lens), heads, dim)
    out = torch.ops.gemel.paged_decode_attention(q, k_cache, v_cache, kv_slots, lens, scale, window)
    for b, n in enumerate(lens.tolist()):
        torch.testing.assert_close(out[b], reference(q[b], b, n), atol=1e-4, rtol=1e-4)
    # prefill: sequence 2's last 6 positions as 6 query tokens, each seeing its own prefix
    token_seq = torch.full((6,), 2)
    ctx = torch.arange(35, 41)
    qp = torch.randn(6, heads, dim)
    out = torch.ops.gemel.paged_prefill_attention(qp, k_cache, v_cache, kv_slots, token_seq, ctx, scale, window)
    for t, n in enumerate(ctx.tolist()):
        torch.testing.assert_close(out[t], reference(qp[t], 2, n), atol=1e-4, rtol=1e-4)


def test_float16_cache_needs_a_float32_model(tiny_llama_dir):
    from gemel import LLM

    with pytest.raises(ValueError, match="kv_cache_dtype float16 needs dtype float32"):
        LLM(tiny_llama_dir, dtype="bfloat16", num_kv_blocks=16, kv_cache_dtype="float16")


def test_the_float32_integer_plan_stores_float16_and_others_their_dtype():
    """kv_cache_dtype auto: float16 only where the plan computes in float32 on the integer
    kernels (dtype auto on a CPU without native bf16, here forced with cpu_isa avx2)."""
    cpu = torch.device("cpu")
    common = dict(device=cpu, weight_quant="auto")
    bf16, _ = plan_engine(dtype=torch.bfloat16, dtype_requested="auto", **common)
    named, _ = plan_engine(dtype=torch.float32, dtype_requested="float32", **common)
    assert bf16.kv_dtype is None and named.kv_dtype is None
    try:
        avx2 = resolve_isa("avx2") == "avx2" and cpu_kernels.load("avx2")
    except ValueError:  # a CPU without AVX2
        avx2 = False
    if not avx2:
        pytest.skip("no AVX2 kernels in this process")
    plan, _ = plan_engine(dtype=torch.float32, dtype_requested="auto", cpu_isa="avx2", **common)
    assert plan.int8_activations and plan.kv_dtype == torch.float16
    assert "KV cache: float16" in plan.describe()
