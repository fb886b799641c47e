"""Weight-only int8/int4 projections: exact against their own dequantised weights,
and close to the dense model's greedy output."""

from __future__ import annotations

import pytest
import torch

from gemel import LLM, SamplingParams
from gemel.layers import cpu_kernels
from gemel.layers.kernel_plan import bf16_gemm_supported
from gemel.layers.linear import Linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_matches_explicit_dequantisation(dtype):
    torch.manual_seed(0)
    w, x = torch.randn(192, 128, dtype=dtype), torch.randn(3, 128, dtype=dtype)
    lin = Linear(w.clone())
    lin.quantize_("int8", packed_max_rows=8)
    s = w.float().abs().amax(1) / 127
    deq = (torch.round(w.float() / s[:, None]).clamp(-127, 127) * s[:, None]).to(dtype)
    torch.testing.assert_close(lin(x).float(), (x @ deq.T).float(), atol=0.25 if dtype == torch.bfloat16 else 1e-4, rtol=1e-2)  # bf16 output ulp is 0.125 at |y|~20


def test_int4_matches_explicit_dequantisation():
    torch.manual_seed(0)
    w, x = torch.randn(192, 128), torch.randn(3, 128)
    lin = Linear(w.clone())
    lin.quantize_("int4", packed_max_rows=8, group_size=64)
    g = w.view(192, 2, 64)
    lo, hi = g.amin(-1), g.amax(-1)
    s = (hi - lo) / 15
    deq = (torch.round((g - lo[..., None]) / s[..., None]).clamp(0, 15) * s[..., None] + lo[..., None]).view(192, 128)
    torch.testing.assert_close(lin(x), x @ deq.T, atol=1e-4, rtol=1e-4)


def test_rows_above_threshold_use_dense_weights():
    w, x = torch.randn(64, 64), torch.randn(9, 64)
    lin = Linear(w.clone())
    lin.quantize_("int8", packed_max_rows=8)
    torch.testing.assert_close(lin(x), x @ w.T)


def test_int8_engine_mostly_agrees_with_dense(tiny_llama_dir):
    prompts = [[5, 17, 33, 90], [200, 11, 4, 4, 4, 60, 7], [150] * 12]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    dense = LLM(tiny_llama_dir, dtype="float32", num_kv_blocks=64)
    quant = LLM(tiny_llama_dir, dtype="float32", num_kv_blocks=64, weight_quant="int8", packed_max_rows=64)
    a = [o.outputs[0].token_ids for o in dense.generate(prompt_token_ids=prompts, sampling_params=params)]
    b = [o.outputs[0].token_ids for o in quant.generate(prompt_token_ids=prompts, sampling_params=params)]
    first_tokens_equal = sum(x[0] == y[0] for x, y in zip(a, b))
    assert first_tokens_equal == len(prompts)
    assert quant.engine.core.loaded.model.layers[0].qkv_proj.quant == "int8"


needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available() or not bf16_gemm_supported(),
    reason="no oneDNN bf16 GEMM here (this torch build, or a CPU without AVX512-BW/VL/DQ)",
)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 5, 33, 130])
@pytest.mark.parametrize("with_bias", [False, True])
def test_prepacked_bf16_is_bitwise_dense(rows, with_bias):
    torch.manual_seed(rows)
    w = torch.randn(96, 64, dtype=torch.bfloat16)
    b = torch.randn(96, dtype=torch.bfloat16) if with_bias else None
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    lin = Linear(w.clone(), None if b is None else b.clone())
    assert lin.prepack_()
    assert lin.weight is None and lin.onednn_weight is not None
    assert torch.equal(lin(x), torch.nn.functional.linear(x, w, b))


def test_prepack_leaves_float32_alone():
    lin = Linear(torch.randn(8, 8))
    assert not lin.prepack_()
    assert lin.weight is not None


@needs_onednn
@needs_onednn
def test_bf16_engine_prepacked_matches_unpacked(tiny_llama_dir):
    """The engine prepacks its bf16 projections; logits equal a copy run without it."""
    from gemel.layers.linear import prepack_model_

    prompts = [[5, 17, 33, 90], [200, 11, 4, 4, 4, 60, 7]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    packed = LLM(tiny_llama_dir, dtype="bfloat16", num_kv_blocks=64)
    assert packed.engine.core.loaded.model.layers[0].gate_up_proj.onednn_weight is not None
    plain = LLM(tiny_llama_dir, dtype="bfloat16", num_kv_blocks=64)
    for module in plain.engine.core.loaded.model.modules():  # undo: dense weights from the blocked copies
        if isinstance(module, Linear) and module.onednn_weight is not None:
            module.weight = torch.nn.Parameter(module.onednn_weight.to_dense(), requires_grad=False)
            module.onednn_weight = None
    assert prepack_model_(torch.nn.Module()) == 0
    a = packed.generate(prompt_token_ids=prompts, sampling_params=params)
    b = plain.generate(prompt_token_ids=prompts, sampling_params=params)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].logprobs == y.outputs[0].logprobs


def test_checkpoint_groups_are_used_exactly(monkeypatch):
    """weight_quant=checkpoint feeds the stored groups to PyTorch's int4 kernel (on CPUs without
    AVX512-VNNI): the product equals x @ W^T with W the stored weights (bf16 output rounding
    only), and it never re-quantises."""
    from gemel.models.weights import Int4Groups

    monkeypatch.setattr(cpu_kernels, "has_vnni", lambda: False)
    torch.manual_seed(0)
    out_f, in_f = 64, 96
    groups = Int4Groups(torch.randint(0, 16, (out_f, in_f), dtype=torch.uint8),
                        torch.rand(out_f, in_f // 32) * 0.1 + 0.01, torch.randn(out_f, in_f // 32) * 0.1)
    groups = Int4Groups(groups.q, groups.scale.bfloat16().float(), groups.zero.bfloat16().float())  # kernel keeps bf16
    exact = groups.dequantize()
    lin = Linear(exact.bfloat16())
    lin.checkpoint_int4 = lambda: groups
    lin.quantize_("checkpoint", packed_max_rows=4)
    assert lin.quant == "int4" and lin.checkpoint_int4 is None
    x = torch.randn(3, in_f).bfloat16()
    torch.testing.assert_close(lin(x).float(), x.float() @ exact.T, atol=0.05, rtol=1e-2)
    plain = Linear(torch.randn(8, 64).bfloat16())
    plain.quantize_("checkpoint", packed_max_rows=4)  # nothing stored as 4-bit: stays dense
    assert plain.quant is None


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_checkpoint_int8_groups_are_used_exactly(rows):
    """Q8_0 groups (the usual GGUF LM head) go to gemel's C++ kernel as they are: the product
    equals x @ W^T with W the stored weights; above packed_max_rows the dense weight serves."""
    from gemel.models.weights import Int8Groups

    assert cpu_kernels.load()
    torch.manual_seed(0)
    out_f, in_f = 300, 96  # out_f not a multiple of the kernel's row chunk
    groups = Int8Groups(torch.randint(-127, 128, (out_f, in_f), dtype=torch.int8), torch.rand(out_f, in_f // 32) * 0.01)
    exact = groups.dequantize()
    lin = Linear(exact.bfloat16())
    lin.checkpoint_int8 = lambda: groups
    lin.quantize_("checkpoint", packed_max_rows=rows)
    assert lin.quant == "int8_groups" and lin.checkpoint_int8 is None
    x = torch.randn(rows, in_f)
    torch.testing.assert_close(lin(x), x @ exact.T, atol=1e-4, rtol=1e-4)  # float32 in, float32 out
    wide = torch.randn(rows + 1, in_f).bfloat16()
    torch.testing.assert_close(lin(wide), torch.nn.functional.linear(wide, exact.bfloat16()))  # dense path
    other = Linear(exact.bfloat16())
    other.checkpoint_int8 = lambda: groups
    other.quantize_("int8", packed_max_rows=4)
    assert other.quant == "int8"  # the lossy int8 mode re-quantises per channel, as it promises


def _quantised_activation_product(x: torch.Tensor, groups) -> torch.Tensor:
    """What int4_group_mm computes, written out: per group of 32, x as a coarse int8 code
    (unit max|x|/127) plus a fine one for the rest (unit 1/254 of that), integer dot
    products with the 4-bit codes, then w = scale * q + low."""
    rows, in_f = x.shape
    xg = x.float().view(rows, in_f // 32, 32)
    dx = xg.abs().amax(-1) / 127
    unit = torch.where(dx > 0, dx, 1)[..., None]
    coarse = torch.round(xg / unit)
    fine = torch.round((xg - coarse * unit) / unit * 254)
    q = groups.q.float().view(-1, in_f // 32, 32)
    dots = torch.einsum("mgk,ngk->mng", coarse * 254 + fine, q) / 254  # integers well inside float32's range
    low = groups.zero - 8 * groups.scale
    return (dots * groups.scale[None] * dx[:, None]).sum(-1) + xg.sum(-1) @ low.T


needs_vnni = pytest.mark.skipif(not cpu_kernels.has_vnni(), reason="no AVX512-VNNI on this CPU")


@needs_vnni
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_int4_groups_with_integer_dot_products(rows, dtype, scale_dtype):
    """4-bit groups run through gemel's VNNI kernel: it equals the same arithmetic written
    out in PyTorch and x @ W^T to within bf16-level rounding, and leaves larger batches dense."""
    from gemel.models.weights import Int4Groups

    assert cpu_kernels.load()
    torch.manual_seed(rows)
    out_f, in_f = 40, 96  # out_f not a multiple of the kernel's 16-row blocks; 3 groups
    # float16 scales and lows (as in Q4_1) are streamed as float16; any others as float32
    scale = (torch.rand(out_f, in_f // 32) * 0.1 + 0.01).to(scale_dtype).float()
    low = (torch.randn(out_f, in_f // 32) * 0.1).to(scale_dtype).float()
    groups = Int4Groups(torch.randint(0, 16, (out_f, in_f), dtype=torch.uint8), scale, low + 8 * scale)
    exact = groups.dequantize()
    lin = Linear(exact.to(dtype))
    lin.checkpoint_int4 = lambda: groups
    lin.quantize_("checkpoint", packed_max_rows=8)
    assert lin.quant == "int4_groups" and lin.packed_max_rows == 8
    assert lin.w_q4.shape[-1] == 256 + 32 * scale_dtype.itemsize  # codes, then 16 scales and 16 lows
    x = torch.randn(rows, in_f).to(dtype)
    y = lin(x)
    assert y.dtype == dtype and y.shape == (rows, out_f)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.02, rtol=1e-2)
    torch.testing.assert_close(y.float(), _quantised_activation_product(x, groups), **tol)
    reference = x.float() @ exact.T
    if dtype == torch.float32:  # x's two int8 codes lose less than rounding x to bf16 would
        assert (y - reference).norm() < (x.bfloat16().float() @ exact.T - reference).norm()
    else:
        torch.testing.assert_close(y.float(), reference, **tol)
    wide = torch.randn(9, in_f).to(dtype)
    torch.testing.assert_close(lin(wide), torch.nn.functional.linear(wide, exact.to(dtype)))  # dense path


@needs_vnni
def test_int4_groups_re_quantised_and_zero_rows():
    """weight_quant=int4 (groups made from the dense weight) takes the same kernel; a row of
    zeros gives zeros, not NaN (its int8 scale is 0)."""
    torch.manual_seed(0)
    w = torch.randn(64, 128)
    lin = Linear(w.clone())
    lin.quantize_("int4", packed_max_rows=4)
    assert lin.quant == "int4_groups"
    x = torch.randn(2, 128)
    x[1] = 0
    y = lin(x)
    assert torch.all(y[1] == 0)
    ref = x[:1] @ w.T
    assert ((y[:1] - ref).norm() / ref.norm()).item() < 0.1  # 4-bit weights


@pytest.mark.slow
def test_int4_kernel_portable_loop_matches(tmp_path):
    """The kernel's plain C++ loop (what a compiler without AVX512-VNNI builds) computes the
    same as the written-out arithmetic: built here for x86-64-v3 and run in a fresh process,
    since its op names are those of the library already loaded in this one."""
    import platform
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from torch.utils.cpp_extension import include_paths, library_paths

    compiler = shutil.which("c++")
    if compiler is None or platform.machine() != "x86_64":
        pytest.skip("needs an x86-64 C++ compiler")
    source = next(p for p in cpu_kernels.SOURCES if p.name == "int4_group_mm.cpp")
    lib, torch_lib = tmp_path / "portable.so", library_paths()[0]
    subprocess.run([compiler, str(source), "-o", str(lib), "-shared", "-fPIC", "-std=c++17", "-O1", "-march=x86-64-v3",
                    f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                    *[f"-I{p}" for p in include_paths()], f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}",
                    "-lc10", "-ltorch_cpu", "-ltorch"], check=True, capture_output=True)
    script = f"""
import sys, torch
sys.path.insert(0, {str(Path(__file__).parent)!r})
torch.ops.load_library({str(lib)!r})
from gemel.layers.linear import pack_int4_rows
from gemel.models.weights import Int4Groups
from test_linear_quant import _quantised_activation_product
torch.manual_seed(0)
for scale_dtype in (torch.float16, torch.float32):
    scale = (torch.rand(40, 3) * 0.1 + 0.01).to(scale_dtype).float()
    low = (torch.randn(40, 3) * 0.1).to(scale_dtype).float()
    groups = Int4Groups(torch.randint(0, 16, (40, 96), dtype=torch.uint8), scale, low + 8 * scale)
    x = torch.randn(5, 96)
    y = torch.ops.gemel.int4_group_mm(x, pack_int4_rows(groups), 40)
    torch.testing.assert_close(y, _quantised_activation_product(x, groups), atol=1e-4, rtol=1e-4)
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
