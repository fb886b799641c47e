"""Speculative decoding benchmark: single-stream decode speed and acceptance rate with no
speculation, n-gram prompt lookup, and the self-speculative first-layers draft, on
(a) rewrite/summarise prompts that quote a passage (n-gram lookup should shine) and
(b) free generation.

    python bench/spec_decode.py --max-tokens 96
"""

from __future__ import annotations

import argparse
import json
import sys
import time

PASSAGE = (
    "The Industrial Revolution began in Great Britain in the late eighteenth century. Steam engines, "
    "mechanised spinning and new ways of making iron changed how goods were produced. Factories grew "
    "around coal fields and rivers, railways connected cities, and millions of people moved from farms "
    "to towns in search of work."
)
REWRITE = [
    f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    f"Rewrite this paragraph, keeping every sentence but fixing nothing:\n\n{PASSAGE}",
    f"Copy this text and then add one sentence at the end:\n\n{PASSAGE}",
    "Repeat this list exactly: apples, bananas, cherries, dates, elderberries, figs, grapes, honeydew, "
    "kiwis, lemons, mangoes, nectarines, oranges, papayas.",
]
FREE = [
    "Write a short story about a lighthouse keeper.",
    "Explain how vaccines work to a ten-year-old.",
    "What are three tips for learning a new language?",
    "Describe your ideal weekend.",
]


def run(llm, prompts, max_tokens: int) -> tuple[float, int]:
    from gemel import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    total_tokens, total_time = 0, 0.0
    for p in prompts:  # one stream at a time: the single-stream decode case
        start = time.perf_counter()
        out = llm.chat([{"role": "user", "content": p}], params)[0]
        total_time += time.perf_counter() - start
        total_tokens += len(out.outputs[0].token_ids)
    return total_tokens / total_time, total_tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4, help="speculative tokens per step")
    ap.add_argument("--draft-layers", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args()

    from gemel import LLM

    settings = {
        "none": {},
        "ngram": {"speculative_method": "ngram", "num_speculative_tokens": args.k},
        "draft_layers": {"speculative_method": "draft_layers", "num_speculative_tokens": args.k,
                         "draft_layers": args.draft_layers},
    }
    results = {}
    for name, extra in settings.items():
        llm = LLM(args.model, dtype=args.dtype, **extra)
        llm.chat([{"role": "user", "content": "hi"}])  # warm-up
        row = {}
        for set_name, prompts in (("rewrite", REWRITE), ("free", FREE)):
            stats = llm.engine.core.spec_stats
            before = (stats.num_draft_tokens, stats.num_accepted_tokens)
            tps, n = run(llm, prompts, args.max_tokens)
            drafted = stats.num_draft_tokens - before[0]
            accepted = stats.num_accepted_tokens - before[1]
            row[set_name] = {"tok_s": tps, "tokens": n, "acceptance": accepted / drafted if drafted else None}
            print(f"{name} {set_name}: {tps:.1f} tok/s, acceptance {row[set_name]['acceptance']}", file=sys.stderr)
        results[name] = row
        del llm

    print(f"\nsingle-stream decode, greedy, up to {args.max_tokens} new tokens, k = {args.k}\n")
    print("| method | rewrite tok/s | rewrite acceptance | rewrite speed-up | free tok/s | free acceptance | free speed-up |")
    print("|---|---|---|---|---|---|---|")
    for name, row in results.items():
        cells = []
        for set_name in ("rewrite", "free"):
            r = row[set_name]
            acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
            cells += [f"{r['tok_s']:.1f}", acc, f"{r['tok_s'] / results['none'][set_name]['tok_s']:.2f}x"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
