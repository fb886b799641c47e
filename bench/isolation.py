"""Noisy-neighbour benchmark (priority classes, tenant quotas): does a batch tenant's flood hurt a critical one?

A P0 tenant sends a steady stream of short streaming chat requests (one every
``--p0-interval`` seconds, open loop) and we measure its time to first token (TTFT, request
sent -> first chunk with content), first alone, then while a P2 tenant floods the server with
``--flood`` concurrent long generations (``--flood-tokens`` tokens each, ``ignore_eos``).
Reported: P0 TTFT p50/p99 in both phases and the p99 ratio (target: under the flood within
2x of alone), plus how many flood requests were admitted (200) or turned away (503/429).

Without ``--url`` it starts its own ``gemel serve`` with a temporary tenants file: ``p0``
(P0) and ``p2`` (P2, engine quota ``--p2-max-running-seqs`` / ``--p2-kv-share``). With
``--url`` it drives an existing server with ``--p0-key`` and ``--p2-key``.

    python bench/isolation.py                               # ~2 minutes on a small CPU box
    python bench/isolation.py --p2-max-running-seqs 0       # no engine quota for P2
    python bench/isolation.py --url http://host:8000 --p0-key ... --p2-key ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

SERVER_CONFIG = """
engine:
  kv_cache_memory_mb: {kv_mb}
  max_num_seqs: {max_num_seqs}
server:
  log_level: warning
"""


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


async def stream_chat(client: httpx.AsyncClient, url: str, key: str, prompt: str, max_tokens: int,
                      ignore_eos: bool = False) -> tuple[int, float | None, float, int]:
    """(status, TTFT s or None, total s, content chunks) of one streaming chat request."""
    body = {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": ignore_eos,
    }
    t0 = time.perf_counter()
    ttft = None
    chunks = 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                             headers={"authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, None, time.perf_counter() - t0, 0
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            try:
                obj = json.loads(line[6:])
            except json.JSONDecodeError:
                continue
            for choice in obj.get("choices", []):
                if choice.get("delta", {}).get("content"):
                    chunks += 1
                    if ttft is None:
                        ttft = time.perf_counter() - t0
    return 200, ttft, time.perf_counter() - t0, chunks


async def p0_stream(client, url, key, n, interval, max_tokens, tag) -> list[float]:
    """Open-loop arrivals: request i starts at i * interval, whatever the others do."""
    async def one(i: int):
        await asyncio.sleep(i * interval)
        return await stream_chat(client, url, key, f"{tag} request {i}: name one colour.", max_tokens)

    results = await asyncio.gather(*(one(i) for i in range(n)))
    bad = [r[0] for r in results if r[0] != 200]
    if bad:
        print(f"  P0 {tag}: {len(bad)} requests failed: {bad}", file=sys.stderr)
    return [r[1] for r in results if r[1] is not None]


async def engine_stats(client, url, key) -> dict:
    try:
        body = (await client.get(f"{url}/internal/stats", headers={"authorization": f"Bearer {key}"})).json()
        return body["engines"][body["default_model"]]
    except (httpx.HTTPError, KeyError, ValueError):
        return {}


async def run(args) -> dict:
    limits = httpx.Limits(max_connections=args.flood + 64, max_keepalive_connections=args.flood + 64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30), limits=limits) as client:
        url = args.url
        for i in range(2):  # warm-up (not measured)
            await stream_chat(client, url, args.p0_key, f"warm-up {i}", args.p0_max_tokens)

        print(f"phase 1: P0 alone, {args.p0_requests} requests every {args.p0_interval}s", file=sys.stderr)
        alone = await p0_stream(client, url, args.p0_key, args.p0_requests, args.p0_interval, args.p0_max_tokens, "alone")

        print(f"phase 2: P2 floods {args.flood} x {args.flood_tokens} tokens; P0 as before", file=sys.stderr)
        flood = [
            asyncio.ensure_future(stream_chat(client, url, args.p2_key, f"Flood {i}: write a very long story about the sea.",
                                              args.flood_tokens, ignore_eos=True))
            for i in range(args.flood)
        ]
        # let the flood fill the engine before P0 starts
        t0 = time.monotonic()
        stats = {}
        while time.monotonic() - t0 < args.flood_settle_s:
            await asyncio.sleep(0.5)
            stats = await engine_stats(client, url, args.p0_key)
            if stats.get("num_running", 0) + stats.get("num_waiting", 0) >= min(args.flood, 8) and time.monotonic() - t0 > 2:
                break
        print(f"  engine before P0: running={stats.get('num_running')} waiting={stats.get('num_waiting')}", file=sys.stderr)
        flooded = await p0_stream(client, url, args.p0_key, args.p0_requests, args.p0_interval, args.p0_max_tokens, "flood")
        stats_after = await engine_stats(client, url, args.p0_key)
        done = [f for f in flood if f.done()]
        for f in flood:
            f.cancel()
        outcomes = await asyncio.gather(*flood, return_exceptions=True)
        statuses: dict[str, int] = {}
        for o in outcomes:
            key = "cancelled" if isinstance(o, BaseException) else str(o[0])
            statuses[key] = statuses.get(key, 0) + 1

    def summary(xs: list[float]) -> dict:
        return {"n": len(xs), "p50_ms": percentile(xs, 50) * 1000, "p99_ms": percentile(xs, 99) * 1000,
                "mean_ms": statistics.fmean(xs) * 1000 if xs else float("nan")}

    result = {
        "alone": summary(alone),
        "flood": summary(flooded),
        "p99_ratio": percentile(flooded, 99) / percentile(alone, 99) if alone and flooded else float("nan"),
        "p50_ratio": percentile(flooded, 50) / percentile(alone, 50) if alone and flooded else float("nan"),
        "flood_requests": args.flood,
        "flood_tokens": args.flood_tokens,
        "flood_finished_during_p0": len(done),
        "flood_outcomes": statuses,
        "engine_during_flood": {k: stats.get(k) for k in ("num_running", "num_waiting", "kv_cache_usage")},
        "engine_after_p0": {k: stats_after.get(k) for k in ("num_running", "num_waiting", "num_preemptions")},
        "p2_engine_quota": {"max_running_seqs": args.p2_max_running_seqs or None, "max_kv_blocks_share": args.p2_kv_share},
    }
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, tmp: Path) -> subprocess.Popen:
    from gemel.gateway.tenants import TenantsFile, add_api_key, save_tenants

    tf = TenantsFile()
    args.p0_key = add_api_key(tf, "p0")
    args.p2_key = add_api_key(tf, "p2")
    tf.tenants["p0"].priority = "P0"
    tf.tenants["p2"].priority = "P2"
    if args.p2_max_running_seqs:
        tf.tenants["p2"].engine.max_running_seqs = args.p2_max_running_seqs
    if args.p2_kv_share:
        tf.tenants["p2"].engine.max_kv_blocks_share = args.p2_kv_share
    tenants = tmp / "tenants.yaml"
    save_tenants(tenants, tf)
    config = tmp / "gemel.yaml"
    config.write_text(SERVER_CONFIG.format(kv_mb=args.kv_cache_memory_mb, max_num_seqs=args.max_num_seqs) + (args.extra_config or ""))
    port = free_port()
    args.url = f"http://127.0.0.1:{port}"
    gemel = Path(sys.executable).with_name("gemel")
    cmd = [str(gemel)] if gemel.exists() else [sys.executable, "-m", "gemel.cli"]
    log = (tmp / "server.log").open("w")
    proc = subprocess.Popen(
        [*cmd, "serve", "--config", str(config), "--tenants", str(tenants), "--port", str(port), "--no-embeddings", "--no-grpc"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"gemel serve exited: {(tmp / 'server.log').read_text()[-3000:]}")
        try:
            if httpx.get(f"{args.url}/readyz", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("gemel serve did not become ready")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="an existing server (else one is started)")
    p.add_argument("--p0-key", help="API key of a P0 tenant (with --url)")
    p.add_argument("--p2-key", help="API key of a P2 tenant (with --url)")
    p.add_argument("--flood", type=int, default=64, help="concurrent P2 generations")
    p.add_argument("--flood-tokens", type=int, default=256, help="tokens per P2 generation")
    p.add_argument("--flood-settle-s", type=float, default=10.0, help="most time to let the flood fill the engine")
    p.add_argument("--p0-requests", type=int, default=20, help="P0 requests per phase")
    p.add_argument("--p0-interval", type=float, default=0.5, help="seconds between P0 requests")
    p.add_argument("--p0-max-tokens", type=int, default=8)
    p.add_argument("--p2-max-running-seqs", type=int, default=8, help="engine quota of the P2 tenant (0: none)")
    p.add_argument("--p2-kv-share", type=float, default=None, help="engine KV-block share of the P2 tenant")
    p.add_argument("--max-num-seqs", type=int, default=64, help="engine.max_num_seqs of the started server")
    p.add_argument("--kv-cache-memory-mb", type=int, default=1024, help="engine KV budget of the started server")
    p.add_argument("--extra-config", help="YAML appended to the started server's config")
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)

    proc = None
    with tempfile.TemporaryDirectory(prefix="gemel-isolation-") as tmp:
        if args.url is None:
            proc = start_server(args, Path(tmp))
        elif not (args.p0_key and args.p2_key):
            p.error("--url needs --p0-key and --p2-key")
        try:
            result = asyncio.run(run(args))
        finally:
            if proc is not None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
    a, f = result["alone"], result["flood"]
    print(f"P0 TTFT alone:       p50 {a['p50_ms']:.0f} ms   p99 {a['p99_ms']:.0f} ms   (n={a['n']})")
    print(f"P0 TTFT under flood: p50 {f['p50_ms']:.0f} ms   p99 {f['p99_ms']:.0f} ms   (n={f['n']})")
    print(f"p99 ratio {result['p99_ratio']:.2f}x (target <= 2x); p50 ratio {result['p50_ratio']:.2f}x")
    print(f"flood: {result['flood_outcomes']}, engine during flood {result['engine_during_flood']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
