"""Could a 4-bit copy of the Q8_0 LM head screen the greedy argmax, the Q8_0 codes scoring only
the candidates? Only if a rigorous bound on what the re-quantisation moves each logit leaves
few of them. This collects real final hidden states (greedy decoding of random prompts), rounds
them to int8 per group of 32 as int8_act_gemm does, and for Q4_0 and Q4_1 copies of the head
prints how many vocabulary rows the bound keeps, how loose it is, and how often the 4-bit head's
own argmax is the Q8_0 head's.

    python bench/head_screen_bound.py                    # SmolLM2
    python bench/head_screen_bound.py --model ~/.cache/gemel/models/gemma-3-270m-q4_k_m.gguf

The bound for token v and row x: |x . (w_v - w4_v)| <= ||x|| ||w_v - w4_v|| (Cauchy-Schwarz over
the row), or the sum over groups of 32 of the same (tighter). A token stays a candidate while
its 4-bit logit plus its bound reaches the largest 4-bit logit less its bound.
"""

from __future__ import annotations

import argparse
import os
import random

import numpy as np
import torch


def rounded_rows(x: torch.Tensor) -> torch.Tensor:
    """x rounded to int8 per group of 32 (unit max|x| / 127) and scaled back: what the kernels multiply."""
    groups = x.view(x.shape[0], -1, 32)
    unit = groups.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127
    return ((groups / unit).round() * unit).view_as(x)


def q4_1(w: torch.Tensor) -> torch.Tensor:
    groups = w.view(w.shape[0], -1, 32)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    d = ((high - low) / 15).clamp_min(1e-30)
    return (((groups - low) / d).round().clamp(0, 15) * d + low).view_as(w)


def q4_0(w: torch.Tensor) -> torch.Tensor:
    groups = w.view(w.shape[0], -1, 32)
    d = (groups.abs().amax(-1, keepdim=True) / 8).clamp_min(1e-30)
    return ((groups / d).round().clamp(-8, 7) * d).view_as(w)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()

    import gguf

    from gemel import LLM, SamplingParams
    from gemel.layers.kernel_plan import cpu_info
    from gemel.loader.sources import resolve

    path = resolve(os.path.expanduser(args.model))
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    head = tensors.get("output.weight") or tensors["token_embd.weight"]
    weight = torch.from_numpy(gguf.quants.dequantize(head.data, head.tensor_type).astype(np.float32))

    llm = LLM(path, num_threads=2)
    model = llm.engine.core.runner.model
    caught: list[torch.Tensor] = []
    greedy = model.greedy_tokens

    def keep(hidden: torch.Tensor):
        caught.append(hidden.detach().float().clone())
        return greedy(hidden)

    model.greedy_tokens = keep
    rng = random.Random(0)
    vocab = weight.shape[0]
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(64)] for _ in range(args.prompts)]
    llm.generate(prompt_token_ids=prompts,
                 sampling_params=SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True))
    x = rounded_rows(torch.cat(caught))
    exact = x @ weight.T

    cpu = cpu_info()
    print(f"CPU {cpu.model}; {os.path.basename(path)}, head {head.tensor_type.name} {vocab} x {weight.shape[1]}, "
          f"{x.shape[0]} decode rows")
    print()
    print("| 4-bit copy | bound | candidates: median | p90 | max | bound / largest error | 4-bit argmax = Q8_0 argmax |")
    print("|---|---|---|---|---|---|---|")
    for name, requantise in (("Q4_0", q4_0), ("Q4_1", q4_1)):
        four = requantise(weight)
        moved = weight - four
        approx = x @ four.T
        per_row = x.norm(dim=1, keepdim=True) * moved.norm(dim=1)[None]
        per_group = x.view(x.shape[0], -1, 32).norm(dim=-1) @ moved.view(vocab, -1, 32).norm(dim=-1).T
        error = (exact - approx).abs().amax(1)
        agree = (exact.argmax(1) == approx.argmax(1)).float().mean()
        for label, bound in (("row", per_row), ("per group", per_group)):
            floor = (approx - bound).amax(1, keepdim=True)
            candidates = (approx + bound >= floor).sum(1).float()
            loose = (bound.amax(1) / error).median()
            print(f"| {name} | {label} | {candidates.median():.0f} | {candidates.quantile(0.9):.0f} | "
                  f"{candidates.max():.0f} | {loose:.1f} | {agree:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
