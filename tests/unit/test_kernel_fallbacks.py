"""Every instruction-set level of the C++ kernels that this CPU executes, tested here: the
kernels are built for each level below the CPU's own (``$GEMEL_CPU_ISA``: x86-64-v3 for
``avx2``, the plain C++ loops for ``portable``, AVX-512 without tiles on an AMX CPU) and the
kernel equivalence tests run against that build in a fresh process (a process holds one level).
The CPU's own level is what the rest of the suite runs. So no kernel ships untested on the
machine type it was measured on: an AVX-512 host also runs the AVX2 and portable builds."""

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
    "tests/unit/test_linear_quant.py::test_checkpoint_int8_groups_are_used_exactly",
    "tests/unit/test_fused_ops.py",
    "tests/unit/test_attention.py::test_decode_kernel_equals_torch_decode_attention",
    "tests/unit/test_attention.py::test_prefill_kernel_equals_torch_prefill_attention",
    "tests/unit/test_kv_cache_fp16.py::test_decode_and_prefill_kernels_read_float16_rows_as_the_pytorch_path",
    "tests/unit/test_kernel_plan.py",
    "tests/unit/test_sampler.py",
    "tests/unit/test_structured_output.py::test_bitmask_forbids_exactly_the_tokens_whose_bit_is_clear",
]


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler")
@pytest.mark.parametrize("level", LOWER_LEVELS or ["none below this CPU's"])
def test_kernels_of_each_lower_level_give_the_same_results(level):
    if level not in kernel_plan.ISA_LEVELS:
        pytest.skip("this CPU runs only the portable level, which the rest of the suite tests")
    env = dict(os.environ, GEMEL_CPU_ISA=level)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=900)
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
