"""Decode attention over the paged KV cache: the PyTorch path (gather + two batched matmuls)
against the C++ kernel that reads the cache in place (``engine.cpu_attention_kernel``), on a
bf16 cache, on an int8 one (``engine.kv_cache_dtype: int8``), and on the float16 cache under
float32 queries that the AVX2 plan keeps (``GEMEL_CPU_ISA=avx2`` runs the AVX2 build).

SmolLM2-135M's shapes by default (9 query heads, 3 KV heads, head_dim 64; Gemma 3 270M's:
``--num-heads 4 --num-kv-heads 1 --head-dim 256``), bf16 queries (float32 for the float16 cache), each
sequence's context on its own shuffled 16-slot blocks of a large cache, as the block manager
hands them out; the attention alone (the new token's k and v are taken as stored). With ``--layers 1`` every call reads the same cache, which then stays in the
CPU's caches; the default, one cache per layer of the model (30), reads them in turn as a
decode step does, so the contexts come from memory. Prints microseconds per layer call.

    python bench/decode_attention.py --threads 2
    python bench/decode_attention.py --cases 1x256,1x2048,1x8192 --num-heads 4 --num-kv-heads 1 --head-dim 256
"""

from __future__ import annotations

import argparse
import time

import torch

from gemel.layers import cpu_kernels
from gemel.layers.attention import AttentionMetadata, build_group, paged_attention
from gemel.layers.kv_cache import quantize_rows


def time_per_layer(fn, layers: int, passes: int) -> float:
    """Seconds per call, calling fn(layer) for every layer in turn, ``passes`` times."""
    for layer in range(layers):
        fn(layer)
    start = time.perf_counter()
    for _ in range(passes):
        for layer in range(layers):
            fn(layer)
    return (time.perf_counter() - start) / (passes * layers)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cases", default="1x256,8x256,32x192,32x512,64x256", help="BATCHxCONTEXT,...")
    p.add_argument("--num-slots", type=int, default=32768, help="cache slots per layer")
    p.add_argument("--layers", type=int, default=30, help="caches read in turn (1: one cache, kept in CPU caches)")
    p.add_argument("--passes", type=int, default=5, help="passes over the layers per timing")
    p.add_argument("--num-heads", type=int, default=9)
    p.add_argument("--num-kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not cpu_kernels.load():
        print("the C++ kernels could not be built here (see the warning above)")
        return 1
    num_kv, num_heads, head_dim, block = args.num_kv_heads, args.num_heads, args.head_dim, 16
    gen = torch.Generator().manual_seed(0)
    caches = {"bf16": [], "int8": [], "float16": []}
    for _ in range(args.layers):
        k = torch.randn(num_kv, args.num_slots, head_dim, generator=gen)
        v = torch.randn(num_kv, args.num_slots, head_dim, generator=gen)
        caches["bf16"].append((k.bfloat16(), v.bfloat16()))
        caches["int8"].append((quantize_rows(k), quantize_rows(v)))
        caches["float16"].append((k.half(), v.half()))
    print(f"threads {args.threads}; {num_heads} query heads, {num_kv} KV heads, head_dim {head_dim}, bf16 queries; "
          f"{args.layers} layer cache(s) of {args.num_slots} slots")
    print(f"{'batch':>5} {'context':>7} {'torch bf16 us':>13} {'kernel bf16 us':>14} {'kernel int8 us':>14} "
          f"{'kernel f16 us':>13} {'kernel/torch':>12} {'int8/bf16':>9}")
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
        slot_mapping = torch.tensor([c[-1] for c in contexts])
        times = []
        for kind, kernel in (("bf16", False), ("bf16", True), ("int8", True), ("float16", True)):
            meta = AttentionMetadata(slot_mapping=slot_mapping, groups=[group], num_tokens=batch, decode_kernel=kernel)
            layers = caches[kind]
            queries = q.float() if kind == "float16" else q

            def call(layer: int) -> None:
                paged_attention(queries, None, None, *layers[layer], meta, head_dim**-0.5)  # the step's k, v: stored already

            with torch.inference_mode():
                times.append(time_per_layer(call, args.layers, args.passes))
        print(f"{batch:>5} {context:>7} {times[0] * 1e6:>13.1f} {times[1] * 1e6:>14.1f} {times[2] * 1e6:>14.1f} "
              f"{times[3] * 1e6:>13.1f} {times[0] / times[1]:>11.2f}x {times[1] / times[2]:>8.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
