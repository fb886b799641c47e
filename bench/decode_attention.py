"""Decode attention over the paged KV cache: the PyTorch path (gather + two batched matmuls)
against the C++ kernel that reads the cache in place (``engine.cpu_attention_kernel``).

One layer's call, SmolLM2-135M's shapes (9 query heads, 3 KV heads, head_dim 64), bf16, each
sequence's context on its own shuffled 16-slot blocks of a large cache, as the block manager
hands them out. Prints microseconds per call and the speed-up for each (batch, context).

    python bench/decode_attention.py --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from gemel.layers import cpu_kernels
from gemel.layers.attention import AttentionMetadata, build_group, paged_attention


def time_call(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cases", default="1x256,8x256,32x192,32x512,64x256", help="BATCHxCONTEXT,...")
    p.add_argument("--num-slots", type=int, default=32768, help="cache slots per layer")
    p.add_argument("--iters", type=int, default=100)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not cpu_kernels.load():
        print("the C++ kernels could not be built here (see the warning above)")
        return 1
    num_kv, num_heads, head_dim, block = 3, 9, 64, 16
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(num_kv, args.num_slots, head_dim, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(num_kv, args.num_slots, head_dim, generator=gen).to(torch.bfloat16)
    print(f"threads {args.threads}; {num_heads} query heads, {num_kv} KV heads, head_dim {head_dim}, bf16")
    print(f"{'batch':>5} {'context':>7} {'torch us':>9} {'kernel us':>9} {'speed-up':>8}")
    for case in args.cases.split(","):
        batch, context = (int(x) for x in case.split("x"))
        blocks = torch.randperm(args.num_slots // block, generator=gen).tolist()
        per_seq = -(-context // block)
        contexts = [
            [b * block + i for b in blocks[s * per_seq : (s + 1) * per_seq] for i in range(block)][:context]
            for s in range(batch)
        ]
        group = build_group([range(s, s + 1) for s in range(batch)], [[context - 1]] * batch, contexts, None,
                            torch.device("cpu"))
        q = torch.randn(batch, num_heads, head_dim, generator=gen).to(torch.bfloat16)
        k_new = torch.randn(batch, num_kv, head_dim, generator=gen).to(torch.bfloat16)
        v_new = torch.randn(batch, num_kv, head_dim, generator=gen).to(torch.bfloat16)
        slot_mapping = torch.tensor([c[-1] for c in contexts])
        times = []
        for kernel in (False, True):
            meta = AttentionMetadata(slot_mapping=slot_mapping, groups=[group], num_tokens=batch, decode_kernel=kernel)
            with torch.inference_mode():
                times.append(time_call(lambda: paged_attention(q, k_new, v_new, k_cache, v_cache, meta, 0.125),
                                       args.iters))
        print(f"{batch:>5} {context:>7} {times[0] * 1e6:>9.1f} {times[1] * 1e6:>9.1f} {times[0] / times[1]:>7.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
