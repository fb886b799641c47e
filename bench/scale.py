"""Engine replicas on Ray Serve: prefix-aware routing against round robin, and 2 replicas against 1.

The shared-prefix workload: ``--system-prompts`` system prompts of about ``--prefix-tokens``
tokens each, ``--requests`` chat requests over them (a distinct short question each, the order
shuffled with a fixed seed so that round robin mixes the prompts on each replica), at most
``--concurrency`` in flight, ``--max-tokens`` greedy tokens each, streamed. For each
configuration it starts its own ``gemel serve`` (fresh prefix caches) and reports the time to
first token (request sent -> first content chunk), output tokens per second over the whole
run, the prefix-cache hit rate of the run (hit / looked-up prompt tokens, from
``/internal/stats``), and how the requests spread over the replicas (``x-gemel-replica``).

Then the routing overhead: the front end's work per request (the prompt's block hashes, the
choice, the release) timed in this process over the workload's own prompts, and the whole
path's cost, the median server latency (``x-inference-latency-ms``) of 20 sequential one-token
requests with 2 replicas against 1 engine in-process.

    python bench/scale.py                       # every configuration: prefix routing (margin 8, the default, and 4),
                                                # round robin (2 replicas), and 1 engine without Ray
    python bench/scale.py --runs prefix one     # some of them
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

CONFIG = """
engine:
  kv_cache_memory_mb: 1024{engine}
server:
  log_level: warning
embeddings: null
"""
RUNS = {  # name: (flags, more engine settings, more configuration)
    "prefix": (["--replicas", "2", "--routing", "prefix"], "", ""),
    "prefix_margin4": (["--replicas", "2", "--routing", "prefix"], "", "scale: {load_margin_requests: 4}\n"),
    "round_robin": (["--replicas", "2", "--routing", "round_robin"], "", ""),
    "one": ([], "", ""),  # the engine's threads follow the load (2, or 1 while other processes are busy)
    "one_2_threads": ([], "\n  num_threads: 2", ""),
}
WORDS = ("harbour lighthouse ferry tide archive ledger captain net salt rope lantern keel dock gull storm anchor "
         "chart compass beacon pier market bakery bell square winter spring record clerk mayor council").split()  # fmt: skip


def system_prompts(n: int, tokens: int, seed: int = 0) -> list[str]:
    """``n`` distinct system prompts of about ``tokens`` tokens (a word is about one token here)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        body = " ".join(rng.choice(WORDS) for _ in range(tokens - 12))
        out.append(f"Archive volume {i}. You answer from these notes only: {body}.")
    return out


def workload(args) -> list[list[dict]]:
    systems = system_prompts(args.system_prompts, args.prefix_tokens)
    convs = [
        [{"role": "system", "content": systems[i % len(systems)]}, {"role": "user", "content": f"Question {i}: what happened in year {1800 + i}?"}]
        for i in range(args.requests)
    ]  # fmt: skip
    random.Random(1).shuffle(convs)
    return convs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(flags: list[str], engine: str, extra: str, tmp: Path, name: str) -> tuple[subprocess.Popen, str]:
    config = tmp / "bench.yaml"
    config.write_text(CONFIG.format(engine=engine) + extra)
    port = free_port()
    script = Path(sys.executable).with_name("gemel")
    cmd = [str(script), "serve"] if script.exists() else [sys.executable, "-m", "gemel.cli", "serve"]
    log = (tmp / f"{name}.log").open("w")
    proc = subprocess.Popen(
        [*cmd, "--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--no-grpc", *flags],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gemel serve exited: see {tmp / f'{name}.log'}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("gemel serve did not get ready")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def prefix_counts(url: str) -> tuple[int, int, dict]:
    e = next(iter(httpx.get(f"{url}/internal/stats", timeout=10).json()["engines"].values()))
    return e["prefix_cache_queries"], e["prefix_cache_hits"], e


async def one(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int) -> tuple[float, int, str | None, float]:
    body = {"model": "gpt-4o-mini", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        replica = r.headers.get("x-gemel-replica")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if ttft is None and any(c["delta"].get("content") for c in event.get("choices", [])):
                ttft = time.perf_counter() - t0
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return ttft if ttft is not None else time.perf_counter() - t0, tokens, replica, t0


async def drive(url: str, convs: list[list[dict]], concurrency: int, max_tokens: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:

        async def bounded(messages):
            async with sem:
                return await one(client, url, messages, max_tokens)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(bounded(m) for m in convs))
        wall = time.perf_counter() - t0
    ttfts = sorted(r[0] for r in results)
    spread: dict[str, int] = {}
    for _, _, replica, _ in results:
        spread[replica or "-"] = spread.get(replica or "-", 0) + 1
    return {
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "output_tok_s": sum(r[1] for r in results) / wall,
        "wall_s": wall,
        "spread": spread,
        "requests": [  # each request in arrival order: (sent at, s since the start; TTFT, s; replica; system prompt)
            (round(r[3] - t0, 3), round(r[0], 3), r[2], m[0]["content"][:16]) for r, m in sorted(zip(results, convs), key=lambda x: x[0][3])
        ],
    }


def overhead_latency(url: str, n: int = 20) -> float:
    """Median server latency (ms) of sequential one-token completions of a short prompt."""
    lat = []
    with httpx.Client(timeout=120) as c:
        for i in range(n + 2):
            r = c.post(f"{url}/v1/completions", json={"model": "gpt-4o-mini", "prompt": f"Hello {i}", "max_tokens": 1})
            if i >= 2:  # the first two warm up
                lat.append(float(r.headers["x-inference-latency-ms"]))
    return statistics.median(lat)


def router_cost(convs: list[list[dict]]) -> dict:
    """The front end's routing work per request, in this process (no Ray)."""
    from gemel.engine.async_llm import load_tokenizer
    from gemel.scale.router import PrefixRouter

    tok, _ = load_tokenizer("smollm2-135m-instruct")
    prompts = [tok.encode_chat(m, True) for m in convs]
    router = PrefixRouter(16, seed=0)
    router.set_replicas(["a", "b"])
    reps = 20
    t0 = time.perf_counter()
    for k in range(reps):
        for i, ids in enumerate(prompts):
            rid = f"{k}-{i}"
            router.choose(router.prefix_hashes(ids, ""), ["a", "b"], request_id=rid)
            router.release(rid)
    per = (time.perf_counter() - t0) / (reps * len(prompts))
    return {"prompt_tokens_mean": statistics.mean(len(p) for p in prompts), "router_us_per_request": per * 1e6}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    p.add_argument("--system-prompts", type=int, default=4)
    p.add_argument("--prefix-tokens", type=int, default=600)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    convs = workload(args)
    out: dict = {"router": router_cost(convs)}
    print(f"router: {out['router']['router_us_per_request']:.1f} us per request "
          f"({out['router']['prompt_tokens_mean']:.0f} prompt tokens)", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="gemel-bench-scale-") as tmp:
        for name in args.runs:
            proc, url = start(*RUNS[name], Path(tmp), name)
            try:
                q0, h0, _ = prefix_counts(url)
                result = asyncio.run(drive(url, convs, args.concurrency, args.max_tokens))
                time.sleep(1.0)  # the replicas' last counts reach the front end with its next poll
                q1, h1, engine = prefix_counts(url)
                result["prefix_hit_rate"] = (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0
                result["latency_1_token_ms"] = overhead_latency(url)
                if "scale" in engine:
                    result["decisions"] = engine["scale"]["router"]["decisions"]
            finally:
                stop(proc)
            out[name] = result
            print(f"{name}: TTFT p50 {result['ttft_p50_s']:.2f} s p99 {result['ttft_p99_s']:.2f} s, "
                  f"{result['output_tok_s']:.1f} output tok/s ({result['wall_s']:.1f} s), prefix hit rate "
                  f"{100 * result['prefix_hit_rate']:.1f}%, 1-token latency {result['latency_1_token_ms']:.1f} ms, "
                  f"spread {result['spread']} {result.get('decisions', '')}", flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
