"""What the prefix cache costs when nothing hits (the aim: under 3% of throughput).

Starts two ``gemel serve`` instances on the same GGUF, one with ``enable_prefix_caching``
on (the default) and one with it off, and runs the random dataset (every prompt with a
distinct first token, so a 0% hit rate) against them alternately for ``--rounds`` rounds,
each round with its own seed shared by both. Only one server is measured at a time; the
other idles. Prints the median output throughput of each and the ratio.

    python bench/prefix_cache_cost.py --concurrency 32 --num-prompts 64 --rounds 3 --config /tmp/threads2.yaml
    python bench/prefix_cache_cost.py --offline --concurrency 32 --num-prompts 64 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))

import compare  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--config", default=None, help="base gemel.yaml for both; the switch is set on top of it")
    p.add_argument("--offline", action="store_true", help="measure the engine in-process instead of two servers")
    p.add_argument("--threads", type=int, default=2, help="engine threads with --offline")
    args = p.parse_args(argv)
    if args.model is None:
        from gemel.loader.sources import resolve

        args.model = resolve("smollm2-135m-instruct")
    if args.offline:
        return offline(args)
    log_dir = tempfile.mkdtemp(prefix="gemel-prefix-cost-")
    base = {}
    if args.config:
        with open(args.config) as f:
            base = yaml.safe_load(f) or {}
    servers = {}
    for name, enabled in (("cache on", True), ("cache off", False)):
        config = {**base, "engine": {**base.get("engine", {}), "enable_prefix_caching": enabled}}
        path = os.path.join(log_dir, name.replace(" ", "-") + ".yaml")
        with open(path, "w") as f:
            yaml.safe_dump(config, f)
        port = compare.free_port()
        cmd = compare.gemel_command(sys.executable, port, args.model, ["--config", path, "--no-grpc"])
        servers[name] = compare.Server(name.replace(" ", "-"), cmd, port, log_dir, "/readyz")
    results: dict[str, list[dict]] = {name: [] for name in servers}
    try:
        for server in servers.values():
            server.start(600)
        for r in range(args.rounds):
            for name, server in servers.items():
                results[name].append(compare.run_one(server.url, name.split()[1], args.concurrency, args, seed=1000 + r))
    finally:
        for server in servers.values():
            server.stop()
    print(f"served: random dataset, {args.input_len} in / {args.output_len} out, concurrency {args.concurrency}, "
          f"{args.num_prompts} prompts, {args.rounds} rounds")
    report({name: [x["output_throughput"] for x in runs] for name, runs in results.items()})
    return 0


def report(tput: dict[str, list[float]]) -> None:
    """Per-round ratios (each round's two runs are back to back, so drift mostly cancels)."""
    for name, runs in tput.items():
        print(f"{name:<10} out tok/s median {statistics.median(runs):7.1f}   rounds: " + ", ".join(f"{x:.1f}" for x in runs))
    ratios = [a / b for a, b in zip(tput["cache on"], tput["cache off"])]
    print("cache on / cache off per round: " + ", ".join(f"{r:.3f}" for r in ratios)
          + f"   median {statistics.median(ratios):.3f}")


def offline(args: argparse.Namespace) -> int:
    """The engine alone, in this process: both engines generate the same batch of prompts,
    alternately, ``--rounds`` times; no HTTP, so the scheduler and block manager's own cost shows."""
    import random
    import time

    from gemel import LLM, SamplingParams

    engines = {
        "cache on": LLM(args.model, num_threads=args.threads, enable_prefix_caching=True, max_num_seqs=args.concurrency),
        "cache off": LLM(args.model, num_threads=args.threads, enable_prefix_caching=False, max_num_seqs=args.concurrency),
    }
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    tput: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.rounds):
        rng = random.Random(1000 + r)
        prompts = [[100 + i] + [rng.randrange(100, args.vocab_size) for _ in range(args.input_len - 1)]
                   for i in range(args.num_prompts)]  # distinct first tokens: nothing can hit
        for name, llm in engines.items():
            t = time.perf_counter()
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            tput[name].append(tokens / (time.perf_counter() - t))
            print(f"[offline] round {r} {name}: {tput[name][-1]:.1f} tok/s", file=sys.stderr)
    print(f"offline: {args.num_prompts} prompts, {args.input_len} in / {args.output_len} out, "
          f"max_num_seqs {args.concurrency}, {args.threads} threads, {args.rounds} rounds")
    report(tput)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
