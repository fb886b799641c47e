"""Rate of ``int8_act_gemm`` on random Q8_0-, Q4_1- or Q5_0-like groups at given shapes, as a decode
step calls it: ``--copies`` distinct weights of each shape called in turn, so that their codes
come from memory rather than from cache (thirty of SmolLM2's 3,072 x 576 gate_up are 27 MB).

    GEMEL_CPU_ISA=avx2 python bench/int8_act_rates.py 262144x640:int8 49152x576:int8 --rows 32
    GEMEL_CPU_ISA=avx2 python bench/int8_act_rates.py 3072x576:int4 576x1536:int4 --rows 32 --copies 30
    GEMEL_CPU_ISA=avx2 python bench/int8_act_rates.py 3072x576:int4 --avx-vnni   # the AVX-VNNI build
    python bench/int8_act_rates.py 4096x640:five 1536x640:five --rows 1 32 --copies 18   # Gemma 3's Q5_0
    python bench/int8_act_rates.py 262144x640:int8 49152x576:int8 --rows 1 32 --argmax   # greedy heads

Prints, per shape and row count, the median time of a call and its multiply-adds per second;
with ``--argmax`` also a greedy head's two ways to its tokens: the call then ``argmax_rows`` over
its outputs, and ``Linear.argmax`` (``int8_act_gemm_argmax``, the outputs never all written).
The machine's speed drifts; compare builds by alternating whole runs.
"""

from __future__ import annotations

import argparse
import time

import torch

from gemel.layers import cpu_kernels, kernel_plan
from gemel.layers.linear import Linear
from gemel.models.weights import Int4Groups, Int8Groups


def groups_for(kind: str, out_f: int, in_f: int) -> Int4Groups | Int8Groups:
    g = torch.Generator().manual_seed(0)
    if kind == "int4":  # Q4_1-like: w = scale * q + low, float16 scales as a GGUF stores them
        scale = (torch.rand(out_f, in_f // 32, generator=g) * 0.1 + 0.01).half().float()
        low = (torch.randn(out_f, in_f // 32, generator=g) * 0.1).half().float()
        return Int4Groups(torch.randint(0, 16, (out_f, in_f), dtype=torch.uint8, generator=g), scale, low + 8 * scale)
    if kind == "five":  # Q5_0-like: w = scale * q, q in -16..15
        scale = (torch.rand(out_f, in_f // 32, generator=g) * 0.01).half().float()
        return Int8Groups(torch.randint(-16, 16, (out_f, in_f), dtype=torch.int8, generator=g), scale)
    scale = (torch.rand(out_f, in_f // 32, generator=g) * 0.01).half().float()  # Q8_0-like: w = scale * q
    return Int8Groups(torch.randint(-127, 128, (out_f, in_f), dtype=torch.int8, generator=g), scale)


def packed_linear(groups: Int4Groups | Int8Groups) -> Linear:
    lin = Linear(groups.dequantize())
    if isinstance(groups, Int4Groups):
        lin.checkpoint_int4 = lambda: groups
    else:
        lin.checkpoint_int8 = lambda: groups
    assert lin.add_int8_activation_gemm_()
    return lin


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shapes", nargs="+", help="OUTxIN:int8, OUTxIN:int4 or OUTxIN:five (Q5_0-like)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    p.add_argument("--copies", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--argmax", action="store_true", help="also time the argmax of the outputs, both ways")
    p.add_argument("--avx-vnni", action="store_true",
                   help="build the avx2 level with AVX-VNNI, as a CPU that has it without AVX-512 runs it "
                        "(Intel Alder Lake and later), to measure that build on a CPU that has both")
    args = p.parse_args()
    if args.avx_vnni:
        generic = kernel_plan.compile_flags
        kernel_plan.compile_flags = lambda isa, cpu=None: (
            ["-march=x86-64-v3", "-mavxvnni"] if isa == "avx2" else generic(isa, cpu))
    torch.set_num_threads(args.threads)
    assert cpu_kernels.load(), "the C++ kernels did not build"
    cpu = kernel_plan.cpu_info()
    print(f"CPU {cpu.model}, flags {' '.join(cpu.relevant_flags())}; kernels {cpu_kernels.loaded_isa()} "
          f"({' '.join(cpu_kernels.built_features())}), "
          f"{args.threads} threads, {args.copies} copies of each weight")
    extra = " ms + argmax_rows | ms int8_act_gemm_argmax |" if args.argmax else ""
    print("| shape | kind | rows | ms a call | GMAC/s |" + extra)
    print("|---|---|---|---|---|" + ("---|---|" if args.argmax else ""))
    for spec in args.shapes:
        shape, _, kind = spec.partition(":")
        out_f, in_f = map(int, shape.split("x"))
        groups = groups_for(kind or "int8", out_f, in_f)
        lins = [packed_linear(groups) for _ in range(args.copies)]
        for rows in args.rows:
            x = torch.randn(rows, in_f)
            ways = [lambda lin: lin(x)]
            if args.argmax:
                ways += [lambda lin: torch.ops.gemel.argmax_rows(lin(x)), lambda lin: lin.argmax(x)]
                assert torch.equal(ways[1](lins[0]), ways[2](lins[0]))
            medians = []
            for way in ways:
                way(lins[0])
                times = []
                for _ in range(args.iters):
                    start = time.perf_counter()
                    for lin in lins:
                        way(lin)
                    times.append((time.perf_counter() - start) / len(lins))
                medians.append(sorted(times)[len(times) // 2])
            t = medians[0]
            extra = "".join(f" {m * 1e3:.2f} |" for m in medians[1:])
            print(f"| {out_f} x {in_f} | {kind or 'int8'} | {rows} | {t * 1e3:.2f} | {rows * out_f * in_f / t / 1e9:.1f} |"
                  + extra)


if __name__ == "__main__":
    main()
