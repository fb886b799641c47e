"""The AMX tile kernel (``engine.amx_max_rows``, ``torch.ops.gemel.amx_bf16_gemm``) against
oneDNN's bf16 GEMM and int8_act_gemm, per projection and per decode step.

Projections: SmolLM2-135M's shapes (q/k/v 576 -> 960, o 576 -> 576, gate/up 576 -> 3072,
down 1536 -> 576, LM head 576 -> 49,152), random weights as 4-bit groups, calls of the three
kernels taking turns so that the machine's drift hits all alike; prints the median
microseconds per call.

Decode steps (``--engine-batch B``): one engine with the throughput settings and B
sequences of 128 prompt tokens decoding; every step switches all projections between the
tiles and int8_act_gemm (or, with ``--steps-compare fused-silu``, each MLP between the tile
kernel writing silu(gate) * up itself and the plain tiles followed by the silu_and_mul op),
so both see the same contexts and the same machine; prints the median step time of each.

    python bench/amx_gemm.py --rows 16 32 64 128
    python bench/amx_gemm.py --rows --engine-batch 32 64
    python bench/amx_gemm.py --rows --engine-batch 32 64 --steps-compare fused-silu
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from gemel.layers import cpu_kernels
from gemel.layers.linear import pack_amx_tiles, pack_group_codes

SHAPES = [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576), ("lm_head", 576, 49152)]


def median_us(fns: dict, rounds: int) -> dict[str, float]:
    """Median microseconds per call of each function, the functions taking turns."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def projections(rows_list: list[int]) -> None:
    print(f"{'rows':>5} {'projection':>10} {'amx tiles':>10} {'oneDNN':>10} {'int8_act':>10}   (us per call, medians)")
    for rows in rows_list:
        for name, k, n in SHAPES:
            g = torch.Generator().manual_seed(n)
            codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
            scale = (torch.rand(n, k // 32, generator=g) * 0.02 + 0.001).half().float()
            low = (-torch.rand(n, k // 32, generator=g) * 0.1).half().float()
            w = torch.addcmul(low.repeat_interleave(32, 1), scale.repeat_interleave(32, 1), codes.float()).bfloat16()
            tiles, onednn = pack_amx_tiles(w), torch.ops.mkldnn._reorder_linear_weight(w, 64)
            packed = pack_group_codes(codes, scale, low)
            x = torch.randn(rows, k, generator=g).bfloat16()
            us = median_us({
                "amx": lambda: torch.ops.gemel.amx_bf16_gemm(x, tiles, n),
                "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""),
                "int8": lambda: torch.ops.gemel.int8_act_gemm(x, *packed, n, False, 0),
            }, rounds=max(5, int(4e5 / (rows * n ** 0.5))))
            print(f"{rows:5d} {name:>10} {us['amx']:10.0f} {us['onednn']:10.0f} {us['int8']:10.0f}")


def engine_steps(batch: int, steps: int, compare: str) -> None:
    import gemel.models.llama as llama
    from gemel import LLM, SamplingParams
    from gemel.layers.linear import Linear, gated_mlp

    llm = LLM("smollm2-135m-instruct", dtype="bfloat16", num_threads=2, max_num_seqs=batch,
              max_num_batched_tokens=2048, weight_quant="checkpoint", int8_activations=True,
              kv_cache_dtype="int8", itl_target_ms=None, int8_act_max_rows=256)  # both kernels packed
    core = llm.engine.core
    linears = [m for m in core.loaded.model.modules() if isinstance(m, Linear)]
    tile_rows = linears[0].amx_max_rows
    rng = random.Random(0)
    for i in range(batch):
        prompt = [1000 + i] + [rng.randrange(100, 40000) for _ in range(127)]
        llm.engine.add_request(str(i), prompt_token_ids=prompt,
                               params=SamplingParams(temperature=0, max_tokens=2 * steps + 16, ignore_eos=True))
    while core.scheduler.waiting or any(s.num_output_tokens == 0 for s in core.scheduler.running):
        llm.engine.step()  # the prefill
    names = ["amx tiles", "int8_act"] if compare == "int8-act" else ["fused silu", "separate silu"]
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(2 * steps):
        name = names[i % 2]
        for m in linears:
            m.amx_max_rows = 0 if name == "int8_act" else tile_rows
        # the separate path: gate/up tiles in output order, then the silu_and_mul op
        llama.gated_mlp = (lambda g, d, h: d.forward_gated(g(h))) if name == "separate silu" else gated_mlp
        start = time.perf_counter()
        llm.engine.step()
        times[name].append((time.perf_counter() - start) * 1e3)
    print(f"batch {batch}: " + ", ".join(f"{k} {statistics.median(v):.1f} ms" for k, v in times.items())
          + " (median decode step)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, nargs="*", default=[16, 32, 64, 128], help="rows of x per projection call")
    p.add_argument("--engine-batch", type=int, nargs="*", default=[], help="decode batch sizes to time in the engine")
    p.add_argument("--steps", type=int, default=30, help="decode steps per kernel")
    p.add_argument("--steps-compare", choices=["int8-act", "fused-silu"], default="int8-act",
                   help="what the decode steps alternate: the tiles vs int8_act_gemm, or the MLP's silu fused into the tiles or not")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not cpu_kernels.amx_tiles_available():
        print("this CPU (or kernel build) has no AMX-BF16 tiles")
        return 1
    projections(args.rows)
    for batch in args.engine_batch:
        engine_steps(batch, args.steps, args.steps_compare)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
