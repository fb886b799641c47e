"""The C++ kernels' plain paths, which CPUs without AVX-512 run: the kernels are rebuilt for
``x86-64-v3`` (AVX2) and the same equivalence tests run against that build in a fresh
process. On this project's AVX-512 machines nothing else compiles or runs those paths."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 builds only")
@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler")
def test_kernels_built_without_avx512_give_the_same_results(tmp_path):
    env = dict(os.environ, GEMEL_KERNEL_MARCH="x86-64-v3", GEMEL_KERNEL_CACHE=str(tmp_path))
    tests = [
        "tests/unit/test_int8_activations.py::test_int8_activation_gemm_equals_the_arithmetic_written_out",
        "tests/unit/test_int8_activations.py::test_gated_input_equals_silu_and_mul_first",
        "tests/unit/test_fused_ops.py",
        "tests/unit/test_attention.py::test_decode_kernel_equals_torch_decode_attention",
        "tests/unit/test_attention.py::test_prefill_kernel_equals_torch_prefill_attention",
    ]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], run.stdout[-1000:]
    built = list(tmp_path.glob("*/gemel_cpu_kernels.so"))
    assert len(built) == 1  # the AVX2 build, not the machine's cached native one
