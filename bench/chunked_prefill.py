"""Step-time target and chunked prefill: inter-token latency of running decodes while a long prompt
arrives. 16 requests decode; after a few steps a 2,000-token prompt joins. Reports the ITL
p50/p99 of the 16 during the rest of the run, with the adaptive budget (itl_target_ms) and
without it (every step may take the whole prompt, up to max_num_batched_tokens), and for
scale their ITL p50 before it came (what decodes alone cost on the machine at the time) and
the long prompt's time to first token (what the smaller chunks cost it).

    python bench/chunked_prefill.py --target-ms 50
    python bench/chunked_prefill.py --target-ms 50 --floor-only
    python bench/chunked_prefill.py --target-ms 50 --config bench/configs/latency-int8.yaml

--floor-only adds a third run whose every step carries the decodes and only the budget's floor
chunk (16 tokens): what the machine allows, since no budget that still advances the long prompt
gives a lower ITL there.

--config takes the engine section of a gemel.yaml (its itl_target_ms and
max_num_batched_tokens are set by this script's own flags).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time


def run(target_ms: float | None, args, floor_only: bool = False) -> dict:
    from gemel import LLM, SamplingParams

    engine_kwargs = {"dtype": args.dtype, "kv_cache_memory_mb": 512, **args.engine}
    engine_kwargs.update(max_num_batched_tokens=args.max_batched_tokens, itl_target_ms=target_ms)
    llm = LLM(args.model, **engine_kwargs)
    engine = llm.engine
    if floor_only:  # a target no step meets, and the floor kept where decodes alone miss it too
        model = engine.core.step_time_model
        model.over_target_chunk = model.min_prefill_chunk
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    for i in range(args.decoders):
        engine.add_request(f"d{i}", prompt_token_ids=[1000 + i] + [rng.randrange(100, 30000) for _ in range(63)], params=params)
    last_seen: dict[str, float] = {}
    gaps: list[float] = []
    gaps_before: list[float] = []  # decodes alone: the least a step costs on this machine now
    steps = 0
    arrived = first_token = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        steps += 1
        for out in outs:
            if out.request_id == "long" and first_token is None and out.outputs[0].delta_token_ids:
                first_token = now
            if not out.request_id.startswith("d") or not out.outputs[0].delta_token_ids:
                continue
            if out.request_id in last_seen:
                (gaps if arrived is not None else gaps_before).append(now - last_seen[out.request_id])
            last_seen[out.request_id] = now
        if steps == 8 and arrived is None:  # decodes are running: the long prompt arrives
            engine.add_request("long", prompt_token_ids=[rng.randrange(100, 30000) for _ in range(args.long_prompt)],
                               params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
            arrived = time.perf_counter()
    gaps.sort()
    return {
        "before_p50_ms": 1000 * statistics.median(gaps_before),
        "itl_p50_ms": 1000 * statistics.median(gaps),
        "itl_p99_ms": 1000 * gaps[int(0.99 * (len(gaps) - 1))],
        "itl_max_ms": 1000 * gaps[-1],
        "long_ttft_s": first_token - arrived,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--target-ms", type=float, default=50.0)
    ap.add_argument("--decoders", type=int, default=16)
    ap.add_argument("--decode-tokens", type=int, default=96)
    ap.add_argument("--long-prompt", type=int, default=2000)
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument("--config", default=None, help="gemel.yaml whose engine section the engine starts from")
    ap.add_argument("--floor-only", action="store_true",
                    help="also run the schedule whose every step carries only the floor chunk: the least ITL any "
                         "budget that still advances the prompt gives on this machine at the time")
    args = ap.parse_args()
    args.engine = {}
    if args.config:
        import yaml

        with open(args.config) as f:
            args.engine = (yaml.safe_load(f) or {}).get("engine", {})
        args.engine.pop("model", None)
    rows = {
        f"adaptive budget (target {args.target_ms:g} ms)": run(args.target_ms, args),
        f"fixed budget ({args.max_batched_tokens} tokens)": run(None, args),
    }
    if args.floor_only:
        rows["floor only (every step: the decodes + the 16-token floor chunk)"] = run(0.001, args, floor_only=True)
    print(f"\n{args.decoders} decoding requests, a {args.long_prompt}-token prompt arrives\n")
    print("| scheduler | ITL p50 before it (ms) | ITL p50 (ms) | ITL p99 (ms) | ITL max (ms) | its TTFT (s) |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['before_p50_ms']:.1f} | {r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} "
              f"| {r['itl_max_ms']:.1f} | {r['long_ttft_s']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
