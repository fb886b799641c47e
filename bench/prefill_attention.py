"""Prefill attention over the paged KV cache: the PyTorch path against the C++ kernel
(``engine.cpu_attention_kernel``), on a bf16 cache and an int8 one.

Each case is SEQUENCESxNEW[+CACHED]: that many sequences, each with NEW query tokens after
CACHED tokens already in the cache (a prefix-cache hit, or a later chunk of a chunked
prefill), every query token attending to its own causal prefix. SmolLM2-360M's shapes by
default (15 query heads, 5 KV heads, head_dim 64), bf16 queries, contexts on shuffled
16-slot blocks. Prints milliseconds per layer call.

    python bench/prefill_attention.py --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from gemel.layers import cpu_kernels
from gemel.layers.attention import AttentionMetadata, build_group, paged_attention
from gemel.layers.kv_cache import quantize_rows


def seconds_per_call(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cases", default="16x128,4x512,1x2048,4x256+1024", help="SEQSxNEW[+CACHED],...")
    p.add_argument("--heads", type=int, default=15)
    p.add_argument("--kv-heads", type=int, default=5)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--skip-torch", action="store_true", help="time the kernel only")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not cpu_kernels.load():
        print("the C++ kernels could not be built here (see the warning above)")
        return 1
    block, gen = 16, torch.Generator().manual_seed(0)
    print(f"threads {args.threads}; {args.heads} query heads, {args.kv_heads} KV heads, head_dim {args.head_dim}, "
          "bf16 queries")
    print(f"{'case':>12} {'tokens':>6} {'torch bf16 ms':>13} {'kernel bf16 ms':>14} {'kernel int8 ms':>14} "
          f"{'kernel/torch':>12}")
    for case in args.cases.split(","):
        seqs, rest = case.split("x")
        new, _, cached = rest.partition("+")
        seqs, new, cached = int(seqs), int(new), int(cached or 0)
        per_seq = -(-(cached + new) // block)
        num_slots = (seqs * per_seq + 1) * block
        k = torch.randn(args.kv_heads, num_slots, args.head_dim, generator=gen)
        v = torch.randn(args.kv_heads, num_slots, args.head_dim, generator=gen)
        caches = {"bf16": (k.bfloat16(), v.bfloat16()), "int8": (quantize_rows(k), quantize_rows(v))}
        blocks = torch.randperm(num_slots // block, generator=gen).tolist()
        contexts = [
            [b * block + i for b in blocks[s * per_seq : (s + 1) * per_seq] for i in range(block)][: cached + new]
            for s in range(seqs)
        ]
        group = build_group([range(s * new, (s + 1) * new) for s in range(seqs)],
                            [list(range(cached, cached + new))] * seqs, contexts, None, torch.device("cpu"))
        q = torch.randn(seqs * new, args.heads, args.head_dim, generator=gen).to(torch.bfloat16)
        slot_mapping = torch.tensor([c[p] for c in contexts for p in range(cached, cached + new)])
        times = []
        for kind, kernel in (("bf16", False), ("bf16", True), ("int8", True)):
            if args.skip_torch and not kernel:
                times.append(float("nan"))
                continue
            meta = AttentionMetadata(slot_mapping=slot_mapping, groups=[group], num_tokens=seqs * new,
                                     decode_kernel=kernel)

            def call() -> None:
                paged_attention(q, None, None, *caches[kind], meta, args.head_dim**-0.5)  # k, v stored already

            with torch.inference_mode():
                times.append(seconds_per_call(call, args.repeats))
        print(f"{case:>12} {seqs * new:>6} {times[0] * 1e3:>13.2f} {times[1] * 1e3:>14.2f} {times[2] * 1e3:>14.2f} "
              f"{times[0] / times[1]:>11.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
