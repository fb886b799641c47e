"""TTFT of a long prompt from each place its KV can come from, and what the KV tier costs
when nothing hits.

Engine-level (server time, no HTTP): one ``EngineCore`` with a pool smaller than the traffic,
the host-memory tier and a disk tier in a temporary directory.

* cold: the prompt computed from scratch;
* pool: asked again at once (the prefix cache in the pool);
* host: asked again after other prompts pushed it out of the pool;
* disk: the same, with host memory emptied first;
* restart: a new engine (empty pool and host memory) over the same disk directory.

Then throughput of distinct random prompts (0% hits, so every evicted block is saved for
nothing) with the tier on and off, alternately.

    python bench/kv_tier.py
    python bench/kv_tier.py --prompt-len 4000 --rounds 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

from gemel import SamplingParams
from gemel.config import EngineConfig, KVOffloadConfig
from gemel.engine.core import EngineCore
from gemel.engine.protocol import EngineCoreRequest
from gemel.layers.kernel_plan import cpu_info


def ttft(core: EngineCore, rid: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first output token, and the prompt tokens served from a cache."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    t0 = time.perf_counter()
    core.add_request(EngineCoreRequest(rid, prompt, params, time.monotonic()))
    first, cached = None, 0
    while core.has_unfinished():
        for out in core.step():
            cached = max(cached, out.num_cached_tokens)
            if out.new_token_ids and first is None:
                first = time.perf_counter() - t0
    return first, cached


def fill(core: EngineCore, prompts: list[list[int]], tag: str) -> None:
    for i, p in enumerate(prompts):
        ttft(core, f"{tag}{i}", p)


def throughput(core: EngineCore, prompts: list[list[int]], tag: str) -> float:
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"{tag}{i}", p, params, time.monotonic()))
    tokens = 0
    while core.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in core.step())
    return tokens / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompt-len", type=int, default=4000)
    ap.add_argument("--pool-tokens", type=int, default=8192, help="KV pool size in tokens")
    ap.add_argument("--rounds", type=int, default=2, help="tier on/off alternations of the throughput run")
    args = ap.parse_args()
    rng = random.Random(0)
    vocab = 40000
    long_prompt = [rng.randrange(100, vocab) for _ in range(args.prompt_len)]
    others = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(3)]
    disk = tempfile.mkdtemp(prefix="gemel-kv-tier-")
    block = 16
    config = EngineConfig(
        model=args.model, num_kv_blocks=args.pool_tokens // block, block_size=block, itl_target_ms=None,
        max_num_batched_tokens=2048, kv_offload=KVOffloadConfig(cpu_mb=2048, disk_dir=disk, disk_gb=8),
    )  # fmt: skip
    core = EngineCore(config)
    rows = []
    t, c = ttft(core, "cold", long_prompt)
    rows.append(("cold", t, c))
    print(f"cold: {t:.2f} s", flush=True)
    rows.append(("pool", *ttft(core, "pool", long_prompt)))
    fill(core, others, "a")
    rows.append(("host memory", *ttft(core, "host", long_prompt)))
    fill(core, others, "b")
    core.kv_tier.host.clear()
    core.kv_tier.host_used = 0
    core.kv_tier.flush()
    rows.append(("disk", *ttft(core, "disk", long_prompt)))
    fill(core, others, "c")
    core.kv_tier.flush()
    del core
    restarted = EngineCore(config)  # loads the model again, as a restarted engine does
    rows.append(("disk, after a restart", *ttft(restarted, "restart", long_prompt)))
    del restarted

    print(cpu_info().describe())
    print(f"model {args.model}, prompt {args.prompt_len} tokens, pool {args.pool_tokens} tokens, disk {disk}")
    print(f"{'KV from':24} {'TTFT ms':>9} {'cached':>7} {'vs cold':>8}")
    cold = rows[0][1]
    for name, t, c in rows:
        print(f"{name:24} {t * 1e3:9.1f} {c:7d} {t / cold:7.2f}x")

    # 0% hits: distinct prompts through a small pool, so blocks are evicted (and saved) all along
    prompts = [[rng.randrange(100, vocab) for _ in range(512)] for _ in range(48)]
    small = dict(num_kv_blocks=2048 // block, max_num_batched_tokens=512)
    engines = {
        "tier on": EngineCore(config.model_copy(update=small | {"kv_offload": KVOffloadConfig(cpu_mb=512)})),
        "tier off": EngineCore(config.model_copy(update=small | {"kv_offload": None})),
    }
    # The time the engine spends saving evicted blocks, measured where it is spent: a direct
    # figure for the tier's cost, steadier than the difference of two noisy throughputs.
    offload = engines["tier on"].block_manager.offload
    save, in_save = offload.save, [0.0, 0]

    def timed_save(*a) -> None:
        t0 = time.perf_counter()
        save(*a)
        in_save[0] += time.perf_counter() - t0
        in_save[1] += 1

    offload.save = timed_save
    results: dict[str, list[float]] = {k: [] for k in engines}
    elapsed_on = 0.0
    for r in range(args.rounds + 1):  # round 0 warms both engines up and is not counted
        order = list(engines.items()) if r % 2 else list(engines.items())[::-1]  # alternate who goes first
        for name, eng in order:
            shifted = [[(t + 7 * r + 1) % vocab for t in p] for p in prompts]  # no hits across rounds either
            if r == 0:
                in_save[:] = [0.0, 0]
            t0 = time.perf_counter()
            tok_s = throughput(eng, shifted, f"{name}{r}-")
            if r > 0:
                results[name].append(tok_s)
                elapsed_on += (time.perf_counter() - t0) if name == "tier on" else 0.0
        if r == 0:
            in_save[:] = [0.0, 0]
    on, off = statistics.median(results["tier on"]), statistics.median(results["tier off"])
    ratios = sorted(a / b for a, b in zip(results["tier on"], results["tier off"]))
    fmt = ", ".join
    print(f"\n0% hits, 48 prompts x 512 tokens, 32 out, pool 2048 tokens, {args.rounds} rounds after a warm-up round:")
    print(f"  tier on  {on:.1f} tok/s (rounds {fmt(f'{x:.1f}' for x in results['tier on'])})")
    print(f"  tier off {off:.1f} tok/s (rounds {fmt(f'{x:.1f}' for x in results['tier off'])})")
    print(f"  on / off per round: median {statistics.median(ratios):.3f} (range {ratios[0]:.3f}-{ratios[-1]:.3f})")
    print(f"  time spent saving evicted blocks: {in_save[0]:.2f} s of {elapsed_on:.1f} s with the tier on "
          f"({in_save[0] / elapsed_on * 100:.1f}%), {in_save[1]} blocks, {in_save[0] / max(in_save[1], 1) * 1e6:.0f} us a block")
    print(f"saved by the tier in that run: {engines['tier on'].kv_tier.stats.bytes_saved / 1e6:.0f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
