"""``engine.kv_cache_dtype: int8``: what it buys and what it costs, in one run.

1. Decode steps: two engines of the throughput configuration (``weight_quant: checkpoint``,
   ``int8_activations``), one with the bf16 cache and one with the int8 cache, each decoding
   a batch of random 128-token prompts; they take turns, 10 steps at a time, so both see the
   machine in the same state. Prints the median step time as the contexts grow.
2. Quality: next-token agreement under teacher forcing with the float32 model and the mean
   KL divergence from it (``gemel.benchmark.quality``), for bf16 and for bf16 with the int8
   cache, with and without int8 activations.

    python bench/kv_cache_int8.py --threads 2
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from gemel import LLM, SamplingParams
from gemel.benchmark.quality import print_forced_table



def decode_steps(threads: int, batch: int, steps: int, window: int) -> None:
    engines = {}
    for kv in ("auto", "int8"):
        llm = LLM("smollm2-135m-instruct", dtype="bfloat16", num_threads=threads, max_num_seqs=batch,
                  max_num_batched_tokens=8192, weight_quant="checkpoint", int8_activations=True, kv_cache_dtype=kv)
        rng = random.Random(0)  # the same prompts for both
        for i in range(batch):
            llm.engine.add_request(str(i), prompt_token_ids=[rng.randrange(100, 40000) for _ in range(128)],
                                   params=SamplingParams(temperature=0, max_tokens=steps + 10, ignore_eos=True))
        llm.engine.step()  # the prefill
        llm.engine.step()
        engines[kv] = llm
    times: dict[str, list[float]] = {kv: [] for kv in engines}
    for _ in range(0, steps, 10):
        for kv, llm in engines.items():
            for _ in range(10):
                start = time.perf_counter()
                llm.engine.step()
                times[kv].append(time.perf_counter() - start)
    print(f"\nbatch {batch}: median decode step (ms)")
    print(f"{'context':>11} {'bf16 cache':>10} {'int8 cache':>10} {'speed-up':>8}")
    for first in range(0, steps, window):
        a = statistics.median(times["auto"][first : first + window])
        b = statistics.median(times["int8"][first : first + window])
        print(f"{f'{129 + first}-{129 + first + window - 1}':>11} {a * 1e3:10.1f} {b * 1e3:10.1f} {a / b:7.2f}x")


def quality() -> None:
    variants = [
        ("bf16", {}),
        ("bf16 + int8 KV cache", {"kv_cache_dtype": "int8"}),
        ("bf16 + int8_activations", {"weight_quant": "checkpoint", "int8_activations": True}),
        ("bf16 + int8_activations + int8 KV cache",
         {"weight_quant": "checkpoint", "int8_activations": True, "kv_cache_dtype": "int8"}),
    ]
    print_forced_table("smollm2-135m-instruct", variants)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", default="32,64", help="decode batch sizes")
    p.add_argument("--steps", type=int, default=120, help="decode steps measured per engine")
    p.add_argument("--window", type=int, default=40, help="steps per reported context range")
    p.add_argument("--skip-steps", action="store_true")
    p.add_argument("--skip-quality", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not args.skip_steps:
        for batch in (int(b) for b in args.batches.split(",")):
            decode_steps(args.threads, batch, args.steps, args.window)
    if not args.skip_quality:
        quality()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
