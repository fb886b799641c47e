"""Offline throughput: gemel's LLM.generate against Hugging Face transformers' batched
``generate`` on the same GGUF weights, in the same run.

Random prompts of --input-len tokens (each with a distinct start, so no prefix sharing),
--output-len new tokens ignoring EOS, one batch of B prompts per setting.

    python bench/offline_throughput.py --batch-sizes 1 8 32 64
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1000 + i] + [rng.randrange(100, vocab - 100) for _ in range(length - 1)] for i in range(n)]


def bench_gemel(llm, prompts, output_len: int) -> float:
    from gemel import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompt_token_ids=[p[:16] for p in prompts[:2]], sampling_params=SamplingParams(max_tokens=4))
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    return produced / elapsed


def bench_hf(model, prompts, output_len: int) -> float:
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        model.generate(ids[:1, :16], attention_mask=mask[:1, :16], max_new_tokens=2, do_sample=False)
        start = time.perf_counter()
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False
        )
        elapsed = time.perf_counter() - start
    produced = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return produced / elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="auto", help="gemel's dtype (auto: bf16 where the CPU has it)")
    ap.add_argument("--hf-dtypes", nargs="*", default=["float32", "bfloat16"], help="empty to skip transformers")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    from gemel import LLM

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=max(args.batch_sizes),
              max_num_batched_tokens=max(2048, args.input_len * 4))
    path = llm.engine.core.loaded.path
    vocab = llm.engine.core.loaded.arch.vocab_size
    print(f"model {path}\ngemel dtype {llm.engine.core.dtype}, threads {torch.get_num_threads()}", file=sys.stderr)
    results: dict[str, dict[int, float]] = {"gemel": {}}
    for b in args.batch_sizes:
        llm.engine.core.scheduler.config.max_num_seqs = b
        results["gemel"][b] = bench_gemel(llm, random_prompts(b, args.input_len, vocab, b), args.output_len)
        print(f"gemel batch {b}: {results['gemel'][b]:.1f} tok/s", file=sys.stderr)
    del llm
    if args.hf_dtypes:
        from transformers import AutoModelForCausalLM

        directory, name = os.path.split(path)
        for dt in args.hf_dtypes:
            model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=getattr(torch, dt)).eval()
            key = f"hf-{dt}"
            results[key] = {}
            for b in args.batch_sizes:
                results[key][b] = bench_hf(model, random_prompts(b, args.input_len, vocab, b), args.output_len)
                print(f"{key} batch {b}: {results[key][b]:.1f} tok/s", file=sys.stderr)
            del model

    print(f"\noutput tokens/s, {args.input_len}-token prompts, {args.output_len} new tokens (ignore EOS)\n")
    header = "| engine | " + " | ".join(f"batch {b}" for b in args.batch_sizes) + " |"
    print(header)
    print("|" + "---|" * (len(args.batch_sizes) + 1))
    for name, row in results.items():
        print(f"| {name} | " + " | ".join(f"{row[b]:.1f}" for b in args.batch_sizes) + " |")
    hf_rows = [v for k, v in results.items() if k.startswith("hf-")]
    if hf_rows:
        best = {b: max(r[b] for r in hf_rows) for b in args.batch_sizes}
        print("| gemel / best HF | " + " | ".join(f"{results['gemel'][b] / best[b]:.2f}x" for b in args.batch_sizes) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
