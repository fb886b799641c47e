"""What AMX tile instructions cost on this CPU: compiles ``bench/amx_tile_rates.c`` with the
system's C compiler (``-march=native``) and prints nanoseconds per ``tdpbf16ps`` for the loop
shapes a bf16 GEMM can use, one thread, operands in L1/L2 (the C file says what each shape
does). The gap between "tdp only" and "2x2 (the kernel)" is what loading operand tiles adds;
with 8 tile registers a 2x2 loop already has the fewest loads per product (one), so that
row bounds any bf16 tile GEMM here (docs/performance.md, "The floor under any tile kernel on the Xeon").

    python bench/amx_tile_rates.py --rounds 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("amx_tile_rates.c")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="rounds of all shapes, taking turns")
    args = p.parse_args(argv)
    if "amx_bf16" not in Path("/proc/cpuinfo").read_text():
        print("this CPU has no AMX-BF16")
        return 1
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        print("no C compiler found (set CC)")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "amx_tile_rates"
        subprocess.run([compiler, "-O2", "-march=native", str(SOURCE), "-o", str(binary)], check=True)
        result = subprocess.run([str(binary), str(args.rounds)], capture_output=True, text=True)
    if result.returncode != 0:
        print(result.stderr.strip())
        return result.returncode
    print(f"{'loop shape':<22} {'best ns/tdp':>11} {'worst':>7} {'TFLOP/s (best)':>15}   one thread, {args.rounds} rounds")
    for line in result.stdout.strip().splitlines():
        name, best, worst, tflops = line.split("\t")
        print(f"{name:<22} {float(best):11.1f} {float(worst):7.1f} {float(tflops):15.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
