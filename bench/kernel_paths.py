"""Greedy agreement of each CPU kernel path with Hugging Face transformers in float32.

For each packaged model and each path this CPU runs, N prompts (chat-formatted for SmolLM2)
are continued greedily for T tokens by gemel and by transformers (float32, the same GGUF
weights dequantised by transformers' own loader), and the table gives, per path: sequences
identical over all T tokens, the mean number of tokens before the first difference, and at
first differences the reference's own top-2 log-probability gap (a near-tie when small).

    python bench/kernel_paths.py                      # 50 prompts x 64 tokens, both models
    python bench/kernel_paths.py --prompts 8 --tokens 16 --models smollm2-135m-instruct

Paths: ``float32`` (dense weights, exact sums), ``avx2-int8`` (``cpu_isa: avx2``: every
projection on int8_act_gemm, what AVX2-only CPUs run by default), ``bf16`` (the default where
the CPU computes bf16 natively), ``bf16-int8`` (bf16 with ``int8_activations``, AVX-512).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))

TOPICS = [
    "the ocean", "a lighthouse keeper", "prime numbers", "bread baking", "the moon landing", "a lost umbrella",
    "volcanoes", "chess openings", "a robot learning to paint", "the water cycle", "Roman roads", "honeybees",
    "a train journey", "black holes", "origami", "the French revolution", "a city at night", "photosynthesis",
    "jazz music", "a mountain village", "sorting algorithms", "the first computer", "desert animals", "tea",
    "a friendly dragon", "rainbows", "the printing press", "coral reefs", "a detective story", "wind turbines",
]
TEMPLATES = ["Write a short paragraph about {}.", "Explain {} to a child.", "List three facts about {}:",
             "Tell me a story about {}.", "What is interesting about {}?"]


def prompts(n: int) -> list[str]:
    return [TEMPLATES[i % len(TEMPLATES)].format(TOPICS[(i * 7) % len(TOPICS)]) for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma3-270m"])
    p.add_argument("--prompts", type=int, default=50)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--paths", nargs="+", default=None, help="default: every path this CPU runs")
    args = p.parse_args(argv)

    import torch
    from parity import hf_greedy, hf_logits, hf_model_from_gguf

    from gemel import LLM, SamplingParams
    from gemel.layers import kernel_plan

    level = kernel_plan.resolve_isa()
    paths = {"float32": dict(dtype="float32")}
    if kernel_plan.isa_rank(level) >= kernel_plan.isa_rank("avx2"):
        paths["avx2-int8"] = dict(cpu_isa="avx2")
    if kernel_plan.native_bf16(level):
        paths["bf16"] = dict(dtype="bfloat16")
        paths["bf16-int8"] = dict(dtype="bfloat16", int8_activations=True)
    if args.paths:
        paths = {name: paths[name] for name in args.paths}
    cpu = kernel_plan.cpu_info()
    print(f"CPU {cpu.model}, flags {' '.join(cpu.relevant_flags())}; level {level}")
    rows = []
    for model in args.models:
        chat = "smollm2" in model
        first = LLM(model, dtype="float32", num_kv_blocks=256)
        texts = prompts(args.prompts)
        ids = [first.tokenizer.encode_chat([{"role": "user", "content": t}]) if chat else first.tokenizer.encode(t)
               for t in texts]
        path = first.engine.core.loaded.path
        del first
        with tempfile.TemporaryDirectory() as scratch:
            hf = hf_model_from_gguf(path, torch.float32, scratch)
            t0 = time.time()
            reference = [hf_greedy(hf, prompt, args.tokens) for prompt in ids]
            print(f"{model}: transformers greedy in {time.time() - t0:.0f} s", file=sys.stderr)
            params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
            for name, settings in paths.items():
                llm = LLM(model, kv_cache_memory_mb=512, **settings)
                outs = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=ids, sampling_params=params)]
                same, before, gaps = 0, [], []
                for prompt, ours, theirs in zip(ids, outs, reference):
                    if ours == theirs:
                        same += 1
                        before.append(len(ours))
                        continue
                    j = next(k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b)
                    before.append(j)
                    ref = torch.log_softmax(hf_logits(hf, prompt + ours[:j])[-1], -1)
                    gaps.append(float(ref[theirs[j]] - ref[ours[j]]))
                gaps.sort()
                median_gap = gaps[len(gaps) // 2] if gaps else 0.0
                rows.append((model, name, f"{same}/{len(ids)}", sum(before) / len(before),
                             f"{median_gap:.3f}", f"{max(gaps, default=0.0):.3f}"))
                print(f"{model} {name}: {rows[-1][2:]}", file=sys.stderr)
                del llm
    print(f"\n{args.prompts} prompts x {args.tokens} tokens, greedy, against transformers float32")
    print("| model | path | identical | mean tokens before the first difference | median top-2 gap at it | largest |")
    print("|---|---|---|---|---|---|")
    for model, name, same, mean_before, median_gap, largest in rows:
        print(f"| {model} | {name} | {same} | {mean_before:.1f} | {median_gap} | {largest} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
