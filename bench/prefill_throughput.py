"""Prompt tokens a second: a burst of prompts arriving together, each answered with one token.

What the first wave of a ``compare.py`` round costs before its decoding starts (C=32: 32
prompts of 128 tokens), in one process with the engine's defaults. Every repetition uses new
prompts (distinct starts, so the prefix cache never hits); the table gives the fastest and the
median repetition, since a shared machine only ever slows a run down.

    python bench/prefill_throughput.py
    python bench/prefill_throughput.py --model ~/.cache/gemel/models/gemma-3-270m-q4_k_m.gguf --prompts 32 --input-len 128
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=6)
    args = ap.parse_args()

    import torch

    from gemel import LLM, SamplingParams
    from gemel.layers.kernel_plan import cpu_info

    llm = LLM(args.model, max_num_seqs=args.prompts)
    vocab = llm.engine.core.loaded.arch.vocab_size
    rng = random.Random(0)
    one_token = SamplingParams(temperature=0, max_tokens=1)
    llm.generate(prompt_token_ids=[[7] * 16], sampling_params=one_token, use_tqdm=False)  # warm-up
    times = []
    for rep in range(args.reps):
        prompts = [[1000 + rep * args.prompts + i] + [rng.randrange(100, vocab - 100) for _ in range(args.input_len - 1)]
                   for i in range(args.prompts)]
        start = time.perf_counter()
        llm.generate(prompt_token_ids=prompts, sampling_params=one_token, use_tqdm=False)
        times.append(time.perf_counter() - start)
    tokens = args.prompts * args.input_len
    print(f"{cpu_info().describe()}, {torch.get_num_threads()} threads")
    print(f"model {llm.engine.core.loaded.path}\n")
    print(f"| {args.prompts} prompts x {args.input_len} tokens | fastest | median |\n|---|---|---|")
    print(f"| seconds | {min(times):.3f} | {statistics.median(times):.3f} |")
    print(f"| prompt tokens/s | {tokens / min(times):.0f} | {tokens / statistics.median(times):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
