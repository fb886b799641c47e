"""Every instruction-set level of the C++ kernels that this CPU executes, tested here: the
kernels are built for each level below the CPU's own (``$GEMEL_CPU_ISA``: x86-64-v3 for
``avx2``, the plain C++ loops for ``portable``, AVX-512 without tiles on an AMX CPU) and the
kernel equivalence tests run against that build in a fresh process (a process holds one level).
The CPU's own level is what the rest of the suite runs. So no kernel ships untested on the
machine type it was measured on: an AVX-512 host also runs the AVX2 and portable builds, and
the variants of a level that other CPUs of it build (the AVX2 level with and without AVX-VNNI,
the AVX-512 level without VNNI and BF16) where this CPU can run them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gemel.layers import kernel_plan

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BEST = kernel_plan.cpu_info().best_isa
LOWER_LEVELS = list(kernel_plan.ISA_LEVELS[: kernel_plan.isa_rank(BEST)])

KERNEL_TESTS = [
    "tests/unit/test_int8_activations.py::test_int8_activation_gemm_equals_the_arithmetic_written_out",
    "tests/unit/test_int8_activations.py::test_gated_input_equals_silu_and_mul_first",
    "tests/unit/test_int8_activations.py::test_weight_only_kernels_keep_the_small_calls",
    "tests/unit/test_int8_activations.py::test_scales_per_16_codes_take_the_integer_kernel_where_it_serves_them",
    "tests/unit/test_int8_activations.py::test_five_bit_codes_are_packed_as_nibbles_and_fifth_bits",
    "tests/unit/test_int8_activations.py::test_calls_of_many_rows_of_long_inputs",
    "tests/unit/test_int8_activations.py::test_8_bit_codes_at_full_scale",
    "tests/unit/test_int8_activations.py::test_argmax_without_the_outputs_is_the_argmax_of_the_outputs",
    "tests/unit/test_int8_activations.py::test_asking_ahead_for_the_weights_changes_no_output",
    "tests/unit/test_stream_prefetch.py",
    "tests/unit/test_linear_quant.py::test_checkpoint_int8_groups_are_used_exactly",
    "tests/unit/test_fused_ops.py",
    "tests/unit/test_attention.py::test_decode_kernel_equals_torch_decode_attention",
    "tests/unit/test_attention.py::test_few_long_decodes_split_their_keys_across_threads",
    "tests/unit/test_attention.py::test_prefill_kernel_equals_torch_prefill_attention",
    "tests/unit/test_kv_cache_fp16.py::test_decode_and_prefill_kernels_read_float16_rows_as_the_pytorch_path",
    "tests/unit/test_kernel_plan.py",
    "tests/unit/test_sampler.py",
    "tests/unit/test_structured_output.py::test_bitmask_forbids_exactly_the_tokens_whose_bit_is_clear",
]
# Cross-compiles for ARM whatever level this process holds: the suite runs it once, not per level.
LEVEL_FREE = ["--deselect", "tests/unit/test_kernel_plan.py::test_the_portable_level_builds_for_arm"]


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler")
@pytest.mark.parametrize("level", LOWER_LEVELS or ["none below this CPU's"])
def test_kernels_of_each_lower_level_give_the_same_results(level):
    if level not in kernel_plan.ISA_LEVELS:
        pytest.skip("this CPU runs only the portable level, which the rest of the suite tests")
    env = dict(os.environ, GEMEL_CPU_ISA=level)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS, *LEVEL_FREE],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout, run.stdout[-1000:]
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; from gemel.layers import cpu_kernels; assert cpu_kernels.load(); "
         "print(torch.ops.gemel.kernel_isa())"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    built = probe.stdout.split()
    assert built and built[0] == level, probe.stdout + probe.stderr[-2000:]
    assert ("avx512f" in built) == (kernel_plan.isa_rank(level) >= kernel_plan.isa_rank("avx512"))
    assert ("avx2" in built) == (level != "portable")


# The AVX2 level has two builds: with AVX-VNNI's 256-bit dot products where the CPU has them and
# AVX2 is its own level (-march=native: Intel Alder Lake and later, Sierra Forest), without them
# elsewhere (x86-64-v3). A CPU with AVX-VNNI runs both: the one its avx2 level does not build is
# built here by changing the compiler flags in a fresh process.
CPU = kernel_plan.cpu_info()


def built_with(level: str, flags: list[str]) -> str:
    """Python code to run first in a fresh process, so that it builds ``level`` with ``flags``
    (and every other level as this machine does)."""
    return ("import sys; from gemel.layers import kernel_plan as kp; orig = kp.compile_flags; "
            f"kp.compile_flags = lambda isa, cpu=None: {flags!r} if isa == {level!r} else orig(isa, cpu); ")


OWN_AVX2_HAS_VNNI = BEST == "avx2"  # -march=native on a CPU with avx_vnni
OTHER_AVX2_FLAGS = ["-march=x86-64-v3"] if OWN_AVX2_HAS_VNNI else ["-march=x86-64-v3", "-mavxvnni"]
OTHER_AVX2_PRELUDE = built_with("avx2", OTHER_AVX2_FLAGS)
# int8_act_gemm on every kind of code it takes, at row counts that take each tile shape.
SAME_SUMS_SCRIPT = """
import sys, torch
from gemel.layers import cpu_kernels
assert cpu_kernels.load()
g = torch.Generator().manual_seed(0)
f = torch.ops.gemel.int8_act_gemm
outs = {}
for rows in (1, 3, 4, 9, 37):
    for n in (24, 300):
        k = 640
        blocks, groups = (n + 15) // 16, k // 32
        x = torch.randn(rows, k, generator=g)
        d = torch.rand(blocks, groups, 16, generator=g) * 0.01
        d32 = torch.rand(blocks, groups, 32, generator=g) * 0.01
        low = torch.rand(blocks, groups, 16, generator=g) * -0.01
        c4 = torch.randint(0, 256, (blocks, groups, 256), dtype=torch.uint8, generator=g)
        c5 = torch.randint(0, 256, (blocks, groups, 320), dtype=torch.uint8, generator=g)
        c6 = torch.randint(0, 64, (blocks, groups, 512), dtype=torch.uint8, generator=g)
        c8 = torch.randint(1, 256, (blocks, groups, 512), dtype=torch.uint8, generator=g)
        outs[f"q4_1 {rows} {n}"] = f(x, c4, d, low, n)
        outs[f"q4_0 {rows} {n}"] = f(x, c4, d, torch.empty(0), n, False, 8)
        outs[f"q5_0 {rows} {n}"] = f(x, c5, d, torch.empty(0), n, False, 16)
        outs[f"q8_0 {rows} {n}"] = f(x, c8, d, torch.empty(0), n, False, 128)
        outs[f"q8 per 16 {rows} {n}"] = f(x, c8, d32, torch.empty(0), n, False, 128)
        outs[f"q6_k {rows} {n}"] = f(x, c6, d32, torch.empty(0), n, False, 32)
print(torch.ops.gemel.kernel_isa())
torch.save(outs, sys.argv[1])
"""


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler")
@pytest.mark.skipif(not (CPU.has("avx_vnni") and kernel_plan.isa_rank(BEST) >= kernel_plan.isa_rank("avx2")),
                    reason="this CPU has no AVX-VNNI: its avx2 level has one build")
def test_avx2_builds_with_and_without_avx_vnni_give_the_same_results(tmp_path):
    env = dict(os.environ, GEMEL_CPU_ISA="avx2")
    script = tmp_path / "same_sums.py"
    script.write_text(SAME_SUMS_SCRIPT)
    isa = {}
    for name, prelude in (("own", ""), ("other", OTHER_AVX2_PRELUDE)):
        run = subprocess.run(
            [sys.executable, "-c", prelude + f"import runpy, sys; sys.argv = ['x', {str(tmp_path / name)!r}]; "
             f"runpy.run_path({str(script)!r}, run_name='__main__')"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
        )
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
        isa[name] = run.stdout.split()
    assert ("avxvnni" in isa["own"]) == OWN_AVX2_HAS_VNNI and ("avxvnni" in isa["other"]) != OWN_AVX2_HAS_VNNI
    import torch

    own, other = torch.load(tmp_path / "own"), torch.load(tmp_path / "other")
    assert own.keys() == other.keys() and len(own) == 5 * 2 * 6
    differ = [key for key in own if not torch.equal(own[key], other[key])]
    assert not differ, differ  # the same integer sums, so the same floats
    # and the other build passes the kernel tests on its own
    run = subprocess.run(
        [sys.executable, "-c", OTHER_AVX2_PRELUDE + "import pytest; sys.exit(pytest.main(sys.argv[1:]))",
         "-q", "-p", "no:cacheprovider", *KERNEL_TESTS[:6]],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout, run.stdout[-1000:]


# The avx512 level on a CPU with AVX-512 but neither VNNI nor BF16 (Intel Skylake-SP/X): its
# build (x86-64-v4) takes the AVX2 tiles in int8_act_gemm and the plain AVX-512 loops elsewhere.
# Any AVX-512 host that has VNNI or BF16 builds the avx512 level with them, so it builds this one
# here too.
SKYLAKE_PRELUDE = built_with("avx512", ["-march=x86-64-v4"])


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler")
@pytest.mark.skipif(kernel_plan.isa_rank(BEST) < kernel_plan.isa_rank("avx512")
                    or not (CPU.has("avx512_vnni") or CPU.has("avx512_bf16")),
                    reason="this CPU's avx512 level (if any) is already the build without VNNI and BF16")
def test_avx512_build_without_vnni_and_bf16_gives_the_same_results():
    env = dict(os.environ, GEMEL_CPU_ISA="avx512")
    probe = subprocess.run(
        [sys.executable, "-c", SKYLAKE_PRELUDE + "import torch; from gemel.layers import cpu_kernels; "
         "assert cpu_kernels.load(); print(torch.ops.gemel.kernel_isa())"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    built = probe.stdout.split()
    assert built[:3] == ["avx512", "avx2", "avx512f"] and "avx512vnni" not in built and "avx512bf16" not in built, \
        probe.stdout + probe.stderr[-2000:]
    run = subprocess.run(
        [sys.executable, "-c", SKYLAKE_PRELUDE + "import pytest; sys.exit(pytest.main(sys.argv[1:]))",
         "-q", "-p", "no:cacheprovider", *[t for t in KERNEL_TESTS if "kernel_plan" not in t]],  # (flags patched)
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout, run.stdout[-1000:]
