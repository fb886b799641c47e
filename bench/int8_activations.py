"""``engine.int8_activations``: what it buys and what it costs, in one run.

1. Speed of one projection: ``torch.ops.gemel.int8_act_gemm`` (the checkpoint's 4-bit groups,
   x rounded to int8 per group of 32, AVX512-VNNI) against the bf16 GEMM the engine otherwise
   uses (oneDNN on a pre-packed weight), at SmolLM2-135M's shapes.
2. Engine steps: prefill of 32 random 128-token prompts and the median batch-32 decode step,
   with the option off and on.
3. Quality: next-token agreement under teacher forcing with the float32 model on the same
   GGUF, and the mean KL divergence from it, over the greedy float32 continuations of 16 chat
   prompts (64 tokens each): bf16 as it runs by default, and bf16 with int8 activations.

    python bench/int8_activations.py --threads 2
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from gemel import LLM, SamplingParams
from gemel.benchmark.quality import print_forced_table
from gemel.layers import cpu_kernels
from gemel.layers.linear import pack_group_codes

SHAPES = [(32, 576, 960), (32, 576, 576), (32, 576, 3072), (32, 1536, 576), (32, 576, 49152), (512, 576, 3072)]


def median_time(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[iters // 2]


def projections(iters: int) -> None:
    print(f"{'rows x in x out':>18} {'bf16 us':>9} {'int8 us':>9} {'bf16 GFLOP/s':>12} {'int8 GOP/s':>10} {'speed-up':>8}")
    gen = torch.Generator().manual_seed(0)
    for rows, in_f, out_f in SHAPES:
        codes = torch.randint(0, 16, (out_f, in_f), dtype=torch.uint8, generator=gen)
        scale = torch.rand(out_f, in_f // 32, generator=gen) * 0.01
        low = -8 * scale
        weight = (codes.float().view(out_f, -1, 32) * scale[..., None] + low[..., None]).view(out_f, in_f)
        packed = pack_group_codes(codes, scale, low)
        blocked = torch.ops.mkldnn._reorder_linear_weight(weight.bfloat16(), 64)
        x = torch.randn(rows, in_f, generator=gen).bfloat16()
        t_bf16 = median_time(lambda: torch.ops.mkldnn._linear_pointwise(x, blocked, None, "none", [], ""), iters)
        t_int8 = median_time(lambda: torch.ops.gemel.int8_act_gemm(x, *packed, out_f), iters)
        ops = 2 * rows * in_f * out_f
        print(f"{f'{rows}x{in_f}x{out_f}':>18} {t_bf16 * 1e6:9.0f} {t_int8 * 1e6:9.0f} {ops / t_bf16 / 1e9:12.0f} "
              f"{ops / t_int8 / 1e9:10.0f} {t_bf16 / t_int8:7.2f}x")


def engine_steps(threads: int) -> None:
    print(f"\n{'int8_activations':>16} {'prefill 32x128 s':>16} {'decode step ms (batch 32)':>26}")
    for on in (False, True):
        llm = LLM("smollm2-135m-instruct", dtype="bfloat16", num_threads=threads, max_num_seqs=32,
                  max_num_batched_tokens=8192, weight_quant="checkpoint" if on else "none", int8_activations=on)
        rng = random.Random(0)
        for i in range(32):
            llm.engine.add_request(str(i), prompt_token_ids=[rng.randrange(100, 40000) for _ in range(128)],
                                   params=SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
        start = time.perf_counter()
        llm.engine.step()  # the whole prefill in one step
        prefill = time.perf_counter() - start
        for _ in range(3):
            llm.engine.step()
        step = median_time(llm.engine.step, 30)
        print(f"{str(on):>16} {prefill:16.2f} {step * 1e3:26.1f}")
        del llm


def quality() -> None:
    print_forced_table("smollm2-135m-instruct", [("bf16", {}), ("bf16 + int8_activations", {"int8_activations": True})])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--skip-quality", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not (cpu_kernels.has_vnni() and cpu_kernels.load()):
        print("needs AVX512-VNNI and the C++ kernels")
        return 1
    print(f"threads {args.threads}; AMX: {cpu_kernels.has_amx()}")
    projections(args.iters)
    if not args.skip_engine:
        engine_steps(args.threads)
    if not args.skip_quality:
        quality()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
