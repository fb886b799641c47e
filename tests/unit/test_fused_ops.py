"""The fused C++ element-wise ops (RMSNorm, SiLU-and-mul, rotary) and the greedy argmax
against the PyTorch code they replace, one op at a time and in the whole engine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gemel.layers import cpu_kernels, fused
from gemel.layers.layernorm import rms_norm_gemma, rms_norm_llama
from gemel.layers.rotary_embedding import RotaryEmbedding, apply_rotary


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    if not cpu_kernels.load():
        pytest.skip("no C++ compiler for the CPU kernels")


def _assert_close_in(dtype: torch.dtype, actual: torch.Tensor, expected: torch.Tensor) -> None:
    """float32: to rounding; bf16: equal except for rare one-unit differences, where the two
    float32 intermediates fall on either side of a bf16 rounding boundary."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
        return
    a, e = actual.float(), expected.float()
    ulp = e.abs().clamp(min=2**-126) * 2**-7  # one unit in the last place of bf16, or less
    assert bool(((a - e).abs() <= ulp).all())
    assert (a != e).float().mean().item() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_matches_pytorch(dtype, rows):
    torch.manual_seed(rows)
    base = (torch.randn(rows, 100) * 4).to(dtype)
    weight = (torch.randn(72) * 0.3 + 1).to(dtype)
    x = base[:, 10:82]  # rows with a stride other than their length
    _assert_close_in(dtype, fused.rms_norm_llama(x, weight, 1e-5), rms_norm_llama(x, weight, 1e-5))
    zero = torch.zeros(3, 72, dtype=dtype)
    assert bool((fused.rms_norm_llama(zero, weight, 1e-5) == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_add_rms_norm_matches_pytorch(dtype, rows):
    """The residual add (rounded as PyTorch's add) and the norm of the sum."""
    torch.manual_seed(rows)
    x, delta = (torch.randn(rows, 72) * 4).to(dtype), (torch.randn(rows, 72) * 2).to(dtype)
    weight = (torch.randn(72) * 0.3 + 1).to(dtype)
    total, normed = fused.add_rms_norm_llama(x, delta, weight, 1e-5)
    assert torch.equal(total, x + delta)
    _assert_close_in(dtype, normed, rms_norm_llama(x + delta, weight, 1e-5))
    zero = torch.zeros(3, 72, dtype=dtype)
    assert bool((fused.add_rms_norm_llama(zero, zero, weight, 1e-5)[1] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 200])
def test_silu_and_mul_matches_pytorch(dtype, rows):
    torch.manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 96) * 5).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    _assert_close_in(dtype, fused.silu_and_mul(gate_up), F.silu(gate) * up)
    extreme = torch.tensor([[-100.0, 0.0, 100.0, 1.0, 2.0, 3.0]], dtype=dtype)  # gates, then ups
    assert fused.silu_and_mul(extreme).float()[0].tolist() == pytest.approx([0.0, 0.0, 300.0], abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 9, 257])
def test_rotary_qk_matches_pytorch(dtype, tokens):
    heads, kv_heads, dim = 6, 2, 32
    torch.manual_seed(tokens)
    rotary = RotaryEmbedding(dim, 4096, 10000.0, torch.device("cpu"))
    cos, sin = rotary.cos_sin(torch.randint(0, 4096, (tokens,)), dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    got_q, got_k = fused.rotary_qk(qkv, cos, sin, heads, kv_heads, dim)
    want_q = apply_rotary(q.view(tokens, heads, dim), cos, sin)
    want_k = apply_rotary(k.view(tokens, kv_heads, dim), cos, sin)
    if dtype == torch.bfloat16:  # every product and sum rounded where PyTorch rounds: bitwise equal
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    else:
        _assert_close_in(dtype, got_q, want_q)
        _assert_close_in(dtype, got_k, want_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_q_store_kv_writes_the_cache_as_index_copy_does(dtype):
    heads, kv_heads, dim, tokens, num_slots = 4, 2, 32, 5, 64
    torch.manual_seed(3)
    rotary = RotaryEmbedding(dim, 512, 10000.0, torch.device("cpu"))
    cos, sin = rotary.cos_sin(torch.tensor([0, 1, 2, 40, 41]), dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    slots = torch.tensor([7, 8, 9, 33, 60])
    k_cache, v_cache = torch.randn(kv_heads, num_slots, dim).to(dtype), torch.randn(kv_heads, num_slots, dim).to(dtype)
    want_k_cache, want_v_cache = k_cache.clone(), v_cache.clone()
    want_q, want_k = fused.rotary_qk(qkv, cos, sin, heads, kv_heads, dim)
    want_k_cache.index_copy_(1, slots, want_k.transpose(0, 1))
    want_v_cache.index_copy_(1, slots, qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim).transpose(0, 1))
    q = fused.rotary_q_store_kv(qkv, cos, sin, (k_cache, v_cache), slots, heads, kv_heads, dim)
    assert torch.equal(q, want_q)
    assert torch.equal(k_cache, want_k_cache) and torch.equal(v_cache, want_v_cache)  # other slots untouched
    with pytest.raises(RuntimeError, match="slot out of range"):
        fused.rotary_q_store_kv(qkv, cos, sin, (k_cache, v_cache), slots + num_slots, heads, kv_heads, dim)


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_norm_add_rms_norm_matches_gemmas_pytorch_ops(rows):
    """Gemma 3's post-norm of a sublayer's output, the residual add and the next pre-norm, in
    float32 (the only dtype it takes: elsewhere the norms round in other places)."""
    torch.manual_seed(rows)
    x, delta = torch.randn(rows, 72) * 4, torch.randn(rows, 72) * 2
    post, pre = torch.randn(72) * 0.3 + 1, torch.randn(72) * 0.3 + 1
    total, normed = fused.norm_add_rms_norm(x, delta, post, pre, 1e-6)
    want_total = x + rms_norm_gemma(delta, post, 1e-6)
    torch.testing.assert_close(total, want_total, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(normed, rms_norm_gemma(want_total, pre, 1e-6), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="delta_weight needs float32"):
        fused.norm_add_rms_norm(x.bfloat16(), delta.bfloat16(), post.bfloat16(), pre.bfloat16(), 1e-6)


@pytest.mark.parametrize("rows", [1, 5, 200])
def test_gelu_tanh_and_mul_matches_pytorch(rows):
    torch.manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 96) * 5
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(fused.gelu_tanh_and_mul(gate_up), want, rtol=1e-5, atol=1e-5)
    extreme = torch.tensor([[-100.0, 0.0, 100.0, 1.0, 2.0, 3.0]])  # gates, then ups
    assert fused.gelu_tanh_and_mul(extreme)[0].tolist() == pytest.approx([0.0, 0.0, 300.0], abs=1e-6)
    with pytest.raises(RuntimeError, match="float32"):
        fused.gelu_tanh_and_mul(gate_up.bfloat16())


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_rotary_q_store_kv_with_qk_norm_matches_gemmas_pytorch_ops(cache_dtype):
    """QK-norm, rotary and the KV store in one op: q and the stored k as Gemma's per-head
    RMSNorm then apply_rotary give them, v stored as it comes."""
    heads, kv_heads, dim, tokens, num_slots = 4, 1, 32, 5, 64
    torch.manual_seed(4)
    rotary = RotaryEmbedding(dim, 512, 10000.0, torch.device("cpu"))
    cos, sin = rotary.cos_sin(torch.tensor([0, 1, 2, 40, 41]), torch.float32)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim) * 3
    q_norm, k_norm = torch.randn(dim) * 0.3 + 1, torch.randn(dim) * 0.3 + 1
    slots = torch.tensor([7, 8, 9, 33, 60])
    k_cache = torch.zeros(kv_heads, num_slots, dim, dtype=cache_dtype)
    v_cache = torch.zeros(kv_heads, num_slots, dim, dtype=cache_dtype)
    q = fused.rotary_q_store_kv(qkv, cos, sin, (k_cache, v_cache), slots, heads, kv_heads, dim,
                                qk_norm=(q_norm, k_norm), norm_eps=1e-6)
    q_in, k_in, v_in = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    want_q = apply_rotary(rms_norm_gemma(q_in.reshape(tokens, heads, dim), q_norm, 1e-6), cos, sin)
    want_k = apply_rotary(rms_norm_gemma(k_in.reshape(tokens, kv_heads, dim), k_norm, 1e-6), cos, sin)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
    tol = 1e-5 if cache_dtype == torch.float32 else 2e-3  # float16 rows: rounded once
    torch.testing.assert_close(k_cache[:, slots].float(), want_k.transpose(0, 1), rtol=tol, atol=tol)
    assert torch.equal(v_cache[:, slots], v_in.view(tokens, kv_heads, dim).transpose(0, 1).to(cache_dtype))
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slots] = False
    assert bool((k_cache[:, untouched] == 0).all()) and bool((v_cache[:, untouched] == 0).all())
    with pytest.raises(RuntimeError, match="need float32 qkv"):
        fused.rotary_q_store_kv(qkv.bfloat16(), cos.bfloat16(), sin.bfloat16(),
                                (k_cache.bfloat16(), v_cache.bfloat16()), slots, heads, kv_heads, dim,
                                qk_norm=(q_norm, k_norm), norm_eps=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_with_fused_ops_matches_pytorch_ops(tiny_llama_dir, dtype):
    """Whole engine on the tiny Llama: the same greedy tokens with the fused ops as with the
    PyTorch ops, logprobs to rounding (prefill and decode steps, batched and alone)."""
    from gemel import LLM, SamplingParams

    prompts = [[5, 17, 33, 90], [200, 11, 4, 4, 4, 60, 7] * 5, [150] * 12]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    outs = []
    for on in (False, True):
        llm = LLM(tiny_llama_dir, dtype=dtype, num_kv_blocks=64, cpu_fused_ops=on)
        assert llm.engine.core.runner.fused_ops is on and llm.engine.core.runner.sampler.cpu_argmax is on
        outs.append(llm.generate(prompt_token_ids=prompts, sampling_params=params))
    tol = 1e-4 if dtype == "float32" else 0.05
    for a, b in zip(*outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert abs(la.logprob - lb.logprob) < tol


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gemma_takes_the_fused_norms_in_float32_only(tiny_gemma3_dir, dtype, monkeypatch):
    """Gemma's norms (scale by 1 + w in float32, then round) are Llama's arithmetic in float32,
    so float32 eager steps take the fused C++ layer (norms, QK-norm with rotary and the KV
    store, GeGLU): same tokens and log-probabilities as the PyTorch ops; in bf16, where the
    rounding orders differ, the C++ norm is never called."""
    from gemel import LLM, SamplingParams

    calls = []
    real = torch.ops.gemel.rms_norm

    class Counting:
        def __call__(self, *args):
            calls.append(args[0].dtype)
            return real(*args)

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompts = [[5, 17, 33, 90, 2], [200, 11, 4]]
    outs = []
    for on in (False, True):
        llm = LLM(tiny_gemma3_dir, dtype=dtype, num_kv_blocks=32, cpu_fused_ops=on)
        assert llm.engine.core.runner.fused_ops is on and llm.engine.core.runner.sampler.cpu_argmax is on
        monkeypatch.setattr(torch.ops.gemel, "rms_norm", Counting())
        outs.append(llm.generate(prompt_token_ids=prompts, sampling_params=params))
        monkeypatch.undo()
    assert bool(calls) == (dtype == "float32") and set(calls) <= {torch.float32}
    tol = 1e-4 if dtype == "float32" else 0.0
    for a, b in zip(*outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert abs(la.logprob - lb.logprob) <= tol


@pytest.mark.parametrize("vocab", [1, 15, 16, 100, 49152])
def test_argmax_rows_matches_torch(vocab):
    """The first index of the largest value (ties included), the first NaN where a row has
    one (PyTorch ranks NaN highest), index 0 for a row of -inf; row tails off the 16-lane
    vectors; a non-contiguous input."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=g)
    x[1] = -float("inf")
    if vocab > 1:
        x[2, vocab // 3] = x[2, vocab - 1] = 1e9  # a tie: the first one wins
        x[3, vocab - 1] = float("nan")
        x[4, vocab // 2] = float("nan")
        x[4, 0] = float("inf")
        x[5] = 0.5  # all equal
        x[6, vocab - 1] = 1e9  # the maximum in the last (partial) vector
        x[7, vocab - 1] = x[7, vocab // 4] = float("inf")
    for logits in (x, x[:, : max(1, vocab - 1)], x[::2]):
        torch.testing.assert_close(torch.ops.gemel.argmax_rows(logits), logits.argmax(dim=-1), rtol=0, atol=0)
