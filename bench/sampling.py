"""Microseconds a call of the C++ sampler (``torch.ops.gemel.sample_rows``) on a model's own logits.

The logits are real: a batch of chat prompts is decoded at temperature 0.7 and top_p 0.9 and
the LM head's rows of a few decode steps are kept (random logits are flatter than a model's,
which changes how many tokens top-p has to order). Each setting is then timed at 1 row (each
kept row alone, averaged) and at all the batch's rows at once, and the tokens drawn for fixed
uniforms are hashed, so two builds can be compared for equal answers as well as for time.

    python bench/sampling.py
    python bench/sampling.py --model ~/.cache/gemel/models/gemma-3-270m-q4_k_m.gguf --batch 16
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time

PROMPTS = ["Write a short story about a robot.", "Explain photosynthesis.", "What is the capital of France?",
           "List three prime numbers.", "Describe the ocean.", "How do airplanes fly?",
           "Give me a recipe for pancakes.", "Why is the sky blue?"]
SETTINGS = [(0.7, 0.9, 0), (1.0, 0.95, 0), (1.0, 0.95, 64), (1.0, 1.0, 0)]  # temperature, top_p, top_k (0: off)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3, help="decode steps whose logits are kept")
    args = ap.parse_args()

    import torch

    import gemel.layers.sampler as sampler_module
    from gemel import LLM, SamplingParams
    from gemel.layers.kernel_plan import cpu_info

    llm = LLM(os.path.expanduser(args.model), max_num_seqs=args.batch)
    kept: list[torch.Tensor] = []
    sample = sampler_module.Sampler.__call__

    def keep(self, logits, batch):
        if logits.shape[0] == args.batch and len(kept) < args.steps + 2:
            kept.append(logits.detach().float().clone())
        return sample(self, logits, batch)

    sampler_module.Sampler.__call__ = keep
    chats = [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS))}]
             for i in range(args.batch)]
    llm.generate(chats, sampling_params=SamplingParams(temperature=0.7, top_p=0.9, max_tokens=16, ignore_eos=True))
    sampler_module.Sampler.__call__ = sample
    steps = kept[2:]  # past the first steps' prompt tails
    vocab = steps[0].shape[1]

    def call(rows: torch.Tensor, temperature: float, top_p: float, top_k: int):
        n = rows.shape[0]
        knobs = (torch.full((n,), temperature), torch.full((n,), top_k or vocab, dtype=torch.long),
                 torch.full((n,), top_p), torch.zeros(n))
        uniform = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        return lambda: torch.ops.gemel.sample_rows(rows, *knobs, uniform)

    def microseconds(fn, calls: int, runs: int = 5) -> float:
        fn()
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - start) / calls * 1e6)
        return sorted(times)[runs // 2]

    cpu = cpu_info()
    print(f"CPU {cpu.model} ({cpu.machine}), flags {' '.join(sorted(cpu.flags & {'avx2', 'avx512f', 'avx512_vnni', 'amx_tile', 'asimddp'}))}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {os.path.basename(args.model)}, vocabulary "
          f"{vocab:,}, {len(steps)} decode steps of {args.batch} rows")
    print()
    print(f"| temperature | top_p | top_k | 1 row, us | {args.batch} rows, us |")
    print("|---|---|---|---|---|")
    drawn = []
    for temperature, top_p, top_k in SETTINGS:
        one = [microseconds(call(step[r : r + 1].contiguous(), temperature, top_p, top_k), 20)
               for step in steps for r in range(0, args.batch, max(1, args.batch // 8))]
        many = [microseconds(call(step.contiguous(), temperature, top_p, top_k), 5) for step in steps]
        drawn += [call(step.contiguous(), temperature, top_p, top_k)().tolist() for step in steps]
        print(f"| {temperature} | {top_p} | {top_k or '-'} | {sum(one) / len(one):.1f} | {sum(many) / len(many):.0f} |")
    print()
    print("tokens drawn (md5):", hashlib.md5(str(drawn).encode()).hexdigest())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
