"""int8_act_gemm's tiles for 64-bit ARM (gemel/layers/csrc/int8_act_neon.h), run on an x86 test
machine: tests/csrc/neon_tiles_check.cpp is built with the ARM cross compiler, once for a CPU with
the dot-product extension (`sdot` tiles) and once for plain Armv8.0 (widening multiplies), and
run under QEMU's user-mode emulator, the Armv8.0 build on an emulated Cortex-A72, which has no
`sdot`. It checks every kind of codes the kernel takes against the packed layout written out
(see that file); scripts/install.sh installs both tools where it runs as root."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARM_CXX = shutil.which("aarch64-linux-gnu-g++")
QEMU = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")


@pytest.mark.skipif(ARM_CXX is None or QEMU is None, reason="needs aarch64-linux-gnu-g++ and qemu-aarch64")
@pytest.mark.parametrize(("march", "emulated_cpu"), [("armv8.2-a+dotprod", "max"), ("armv8-a", "cortex-a72")],
                         ids=["dot-products", "armv8.0"])
def test_arm_tiles_equal_the_layout_written_out(tmp_path, march, emulated_cpu):
    binary = tmp_path / "neon_tiles_check"
    build = subprocess.run([ARM_CXX, "-O2", "-std=c++17", f"-march={march}", "-static", "-Wall", "-Werror",
                            str(ROOT / "tests" / "csrc" / "neon_tiles_check.cpp"), "-o", str(binary)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([QEMU, "-cpu", emulated_cpu, str(binary)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert run.stdout.startswith("ok ") and int(run.stdout.split()[1]) == 980, run.stdout
