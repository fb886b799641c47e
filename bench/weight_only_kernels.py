"""Weight-only kernels at decode batch sizes: one pass of x through every 4-bit projection of
SmolLM2's 30 layers (gemel's int4_group_mm on the GGUF's Q4_1 groups) and through the Q8_0
LM head (int8_group_mm; on CPUs with AMX also its bf16 tiles, amx_bf16_gemm), with the caches flushed before each pass as a decode step's other
work would. At one row these kernels should run at the memory's rate: the table gives the
bytes each pass reads and the rate it reached.

    python bench/weight_only_kernels.py --threads 2 --rows 1 4 8
    python bench/weight_only_kernels.py --threads 2 --engine-steps 80

To compare two versions of the kernels, run the script from a worktree of each.
--engine-steps instead times whole batch-1 decode steps (eager) of two engines in this
process, taking turns: the dense weights (weight_quant none) and the file's groups (auto,
which is checkpoint in bf16 on CPU).
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--passes", type=int, default=40)
    ap.add_argument("--engine-steps", type=int, default=0, help="time this many decode steps of each engine instead")
    args = ap.parse_args()
    if args.engine_steps:
        return engine_steps(args)

    import torch

    from gemel import LLM
    from gemel.layers.linear import Linear

    llm = LLM(args.model, dtype="bfloat16", weight_quant="checkpoint", num_threads=args.threads, num_kv_blocks=16)
    model = llm.engine.core.loaded.model
    int4 = [m for m in model.modules() if isinstance(m, Linear) and m.quant == "int4_groups"]
    int8 = [m for m in model.modules() if isinstance(m, Linear) and m.quant == "int8_groups"]
    if not int4 or not int8:
        raise SystemExit("needs a GGUF with 4-bit and Q8_0 groups and a CPU with AVX512-VNNI")
    flush = torch.empty(64 << 20, dtype=torch.uint8)  # larger than the CPU's caches here

    def timed(calls) -> float:
        times = []
        for _ in range(args.passes):
            flush.add_(1)
            start = time.perf_counter()
            for call in calls:
                call()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    print(f"\n{args.model}, {args.threads} threads, median of {args.passes} passes, caches flushed before each\n")
    print("| kernel | rows | MB read | ms | GB/s |")
    print("|---|---|---|---|---|")
    for rows in args.rows:
        xs4 = [torch.randn(rows, m.w_q4.shape[1] * 32, dtype=torch.bfloat16) for m in int4]
        calls4 = [lambda x=x, m=m: torch.ops.gemel.int4_group_mm(x, m.w_q4, m.w_q4_rows) for x, m in zip(xs4, int4)]
        bytes4 = sum(m.w_q4.numel() for m in int4)
        xs8 = [torch.randn(rows, m.w_q8.shape[1], dtype=torch.bfloat16) for m in int8]
        calls8 = [lambda x=x, m=m: torch.ops.gemel.int8_group_mm(x, m.w_q8, m.w_q8_scales) for x, m in zip(xs8, int8)]
        bytes8 = sum(m.w_q8.numel() + 4 * m.w_q8_scales.numel() for m in int8)
        kernels = [("int4_group_mm, 120 layer projections", calls4, bytes4), ("int8_group_mm, LM head", calls8, bytes8)]
        if all(m.amx_max_rows for m in int8):  # the LM head's bf16 AMX tiles, which take calls of more rows
            calls_tiles = [lambda x=x, m=m: torch.ops.gemel.amx_bf16_gemm(x, m.amx_tiles, m.amx_out_features, m.amx_layout)
                           for x, m in zip(xs8, int8)]
            kernels.append(("amx_bf16_gemm, LM head tiles", calls_tiles, sum(m.amx_tiles.numel() * 2 for m in int8)))
        for name, calls, nbytes in kernels:
            seconds = timed(calls)
            print(f"| {name} | {rows} | {nbytes / 1e6:.1f} | {1000 * seconds:.2f} | {nbytes / seconds / 1e9:.1f} |")
    return 0


def engine_steps(args) -> int:
    from gemel import LLM, SamplingParams
    from gemel.benchmark.steps import print_step_table, steps_in_turns

    engines = {mode: LLM(args.model, dtype="bfloat16", weight_quant=mode, num_threads=args.threads, num_kv_blocks=64)
               for mode in ("none", "auto")}
    params = SamplingParams(temperature=0, max_tokens=args.engine_steps + 40, ignore_eos=True)
    for llm in engines.values():
        llm.engine.add_request("one", prompt_token_ids=list(range(1000, 1100)), params=params)
        for _ in range(16):  # prefill and warm-up
            llm.engine.step()
    times = steps_in_turns({mode: llm.engine for mode, llm in engines.items()}, args.engine_steps)
    print(f"\n{args.model}, bf16, {args.threads} threads, batch-1 decode steps (eager), engines taking turns\n")
    print_step_table("weight_quant", times)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
