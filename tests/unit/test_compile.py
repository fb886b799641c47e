"""engine.compile: small decode steps run a torch.compile'd forward with the eager model's tokens."""

from __future__ import annotations

import pytest

from gemel import LLM, SamplingParams
from gemel.layers import cpu_kernels

pytestmark = pytest.mark.slow  # an inductor compile takes tens of seconds on two cores


def _same_until_tie(eager, compiled, tol: float) -> int:
    """Number of leading greedy tokens the two runs share. They may part only at a step whose
    two best tokens are within ``tol`` of each other in the eager run: rounding decides such a
    step (in bf16 two logits can even be equal), so either token is right there."""
    for i, (a, b) in enumerate(zip(eager.token_ids, compiled.token_ids)):
        if a != b:
            top = eager.logprobs[i].top
            assert top[0][1] - top[1][1] < tol, f"step {i}: {a} vs {b} without a near-tie"
            return i
    return len(eager.token_ids)


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
            tol = 1e-3 if dtype == "float32" else 5e-2
            n = _same_until_tie(x.outputs[0], y.outputs[0], tol)
            for lx, ly in zip(x.outputs[0].logprobs[:n], y.outputs[0].logprobs[:n]):
                assert abs(lx.logprob - ly.logprob) < tol
    assert calls["compiled"] == 2 * (params.max_tokens - 1)  # the decode steps of batches 1 and 2
    assert set(inner.replay) == {1, 2}  # after their first steps, both replay the compiled code directly


def test_one_token_context_stays_eager(tiny_llama_dir):
    """The prefill of a one-token prompt is a one-token step too, but PyTorch would compile a
    new graph for its size-1 context while the request waits: it runs eagerly instead."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    eager = LLM(tiny_llama_dir, dtype="float32", num_kv_blocks=64)
    compiled = LLM(tiny_llama_dir, dtype="float32", num_kv_blocks=64, compile=True, compile_max_batch_size=2)
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list as entries

    code = type(compiled.engine.core.loaded.model).forward.__code__
    before = len(entries(code))
    a = eager.generate(prompt_token_ids=[[42]], sampling_params=params)[0].outputs[0].token_ids
    b = compiled.generate(prompt_token_ids=[[42]], sampling_params=params)[0].outputs[0].token_ids
    assert a == b
    assert len(entries(code)) == before  # nothing compiled at request time


def test_compiled_decode_with_low_bit_weights_matches_eager(tiny_llama_dir):
    """The packed 4-bit copies (gemel's VNNI kernel where the CPU has it) inside the compiled
    graph give the eager engine's tokens and logprobs, for batch 1 and 2. In float32: in bf16
    the compiled graph's fused ops round differently from eager ones (covered above), and on
    this random model that drift, not the kernel, would set the tolerance."""
    prompts = [[5, 17, 33, 90], [200, 11, 4, 4, 4, 60, 7]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    kw = dict(dtype="float32", num_kv_blocks=64, weight_quant="int4", packed_max_rows=4)
    tol = 1e-3
    eager = LLM(tiny_llama_dir, **kw)
    compiled = LLM(tiny_llama_dir, **kw, compile=True, compile_max_batch_size=2)
    assert compiled.engine.core.loaded.model.layers[0].qkv_proj.quant in ("int4", "int4_groups")
    for batch in ([prompts[0]], prompts):
        a = eager.generate(prompt_token_ids=batch, sampling_params=params)
        b = compiled.generate(prompt_token_ids=batch, sampling_params=params)
        for x, y in zip(a, b):
            n = _same_until_tie(x.outputs[0], y.outputs[0], tol)
            for i, (lx, ly) in enumerate(zip(x.outputs[0].logprobs[:n], y.outputs[0].logprobs[:n])):
                assert abs(lx.logprob - ly.logprob) < tol, (batch, i, lx, ly)


def test_graph_batch_sizes_cover_each_compiled_graph(tiny_llama_dir):
    """Start-up compiles the first batch of every graph up to compile_max_batch_size: 1, 2,
    and past the low-bit copies' row limit (so no request waits on a compile); by default
    that limit is 8 rows with the VNNI kernel, 4 with PyTorch's."""
    from gemel.layers import cpu_kernels

    dense = LLM(tiny_llama_dir, dtype="float32", num_kv_blocks=16).engine.core.runner
    assert dense._graph_batch_sizes(8) == [1, 2] and dense._graph_batch_sizes(1) == [1]
    four = LLM(tiny_llama_dir, dtype="float32", num_kv_blocks=16, weight_quant="int4", packed_max_rows=4)
    assert four.engine.core.runner._graph_batch_sizes(8) == [1, 2, 5]
    assert four.engine.core.runner._graph_batch_sizes(4) == [1, 2]
    auto = LLM(tiny_llama_dir, dtype="float32", num_kv_blocks=16, weight_quant="int4")
    rows = 8 if cpu_kernels.has_vnni() else 4
    assert auto.engine.core.loaded.model.layers[0].qkv_proj.packed_max_rows == rows


def test_a_batch_size_not_warmed_up_reuses_the_start_up_graph(tiny_llama_dir):
    """Batch 3 was not run at start-up (1 and 2 were), but the batch-2 graph is dynamic in the
    batch size, so it must serve batch 3 without compiling again. It would recompile (tens of
    seconds, while requests wait) if the graph guarded on a step flag that the warm-up set
    differently from a real step, as it once did on the fused-ops flag."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list as entries

    compiled = LLM(tiny_llama_dir, dtype="float32", num_kv_blocks=64, compile=True, compile_max_batch_size=3)
    assert compiled.engine.core.runner.fused_ops == cpu_kernels.load()
    code = type(compiled.engine.core.loaded.model).forward.__code__
    before = len(entries(code))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    compiled.generate(prompt_token_ids=[[5, 17, 33, 90], [200, 11, 4, 4, 4, 60, 7], [150] * 12], sampling_params=params)
    assert 3 in compiled.engine.core.runner.compiled_forward.replay  # batch 3 took the compiled path
    assert len(entries(code)) == before


def test_cpp_wrapper_decode_matches_eager(tiny_llama_dir):
    """engine.compile_cpp_wrapper: the same generated kernels called from C++; same tokens."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    prompt = [[5, 17, 33, 90, 41]]
    eager = LLM(tiny_llama_dir, dtype="float32", num_kv_blocks=64)
    compiled = LLM(tiny_llama_dir, dtype="float32", num_kv_blocks=64, compile=True, compile_max_batch_size=1,
                   compile_cpp_wrapper=True)
    forward = compiled.engine.core.runner.compiled_forward
    assert forward.options["options"]["cpp_wrapper"] is True
    a = eager.generate(prompt_token_ids=prompt, sampling_params=params)[0].outputs[0]
    b = compiled.generate(prompt_token_ids=prompt, sampling_params=params)[0].outputs[0]
    n = _same_until_tie(a, b, 1e-3)
    assert n >= 1
    for la, lb in zip(a.logprobs[:n], b.logprobs[:n]):
        assert abs(la.logprob - lb.logprob) < 1e-3
    assert set(forward.replay) == {1}  # the decode steps replayed the C++-wrapped code
