"""The response cache: what a hit saves, and how often the semantic match is right.

Two parts (``--part latency``, ``--part semantic``, or both by default):

* latency: starts ``gemel serve`` with ``cache.response`` on (memory backend, the semantic
  match for the anonymous tenant), sends ``--requests`` distinct greedy OpenAI chat requests
  (``--max-tokens`` each: misses, answered by the engine), then the same requests again
  (exact hits), then a paraphrase of each (semantic hits or misses). Reports the server's
  ``x-inference-latency-ms`` (arrival to response headers; a unary answer is complete by
  then) and the client's wall time on loopback, median and p90.
* semantic: the packaged all-MiniLM-L6-v2 in this process, ``PAIRS`` below (paraphrases that
  should share an answer, and near-misses that must not: another entity, number, direction
  or a negation). Every first prompt is indexed in one partition, every second one is looked
  up; a hit on its own pair's first prompt is a true positive, any other hit a false positive.
  Precision and recall per threshold, with and without the ``same_question`` guards.

    python bench/response_cache.py
    python bench/response_cache.py --part semantic
    python bench/response_cache.py --part latency --requests 20 --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

# (cached prompt, later prompt, should the later one get the cached answer)
PAIRS = [
    # paraphrases: the same question
    ("What is the capital of France?", "What's the capital of France?", True),
    ("What is the capital of France?", "Which city is the capital of France?", True),
    ("How do I reverse a list in Python?", "How can I reverse a list in Python?", True),
    ("How do I reverse a list in Python?", "What is the way to reverse a Python list?", True),
    ("Translate 'good morning' into Spanish.", "Translate 'good morning' to Spanish.", True),
    ("What is the boiling point of water?", "At what temperature does water boil?", True),
    ("Who wrote Pride and Prejudice?", "Who is the author of Pride and Prejudice?", True),
    ("Give me a recipe for pancakes.", "Can you give me a pancake recipe?", True),
    ("How many days are in a leap year?", "How many days does a leap year have?", True),
    ("Explain what photosynthesis is.", "Explain photosynthesis.", True),
    ("What is the speed of light?", "How fast does light travel?", True),
    ("Summarize the plot of Hamlet.", "Give me a summary of the plot of Hamlet.", True),
    ("What is the tallest mountain in the world?", "Which mountain is the highest in the world?", True),
    ("How do I make a cup of tea?", "How do you make a cup of tea?", True),
    ("What does HTTP stand for?", "What is HTTP short for?", True),
    ("Write a haiku about autumn.", "Write an autumn haiku.", True),
    ("What are the symptoms of the flu?", "What symptoms does the flu cause?", True),
    ("How do I convert Celsius to Fahrenheit?", "How can I convert Celsius into Fahrenheit?", True),
    ("What is the population of Japan?", "How many people live in Japan?", True),
    ("Tell me a joke about cats.", "Tell me a cat joke.", True),
    # near-misses: another question
    ("What is the capital of France?", "What is the capital of Germany?", False),
    ("What is the capital of France?", "What is the population of France?", False),
    ("How do I reverse a list in Python?", "How do I sort a list in Python?", False),
    ("How do I reverse a list in Python?", "How do I reverse a string in JavaScript?", False),
    ("Translate 'good morning' into Spanish.", "Translate 'good morning' into French.", False),
    ("What is the boiling point of water?", "What is the freezing point of water?", False),
    ("Who wrote Pride and Prejudice?", "Who wrote Sense and Sensibility?", False),
    ("Give me a recipe for pancakes.", "Give me a recipe for waffles.", False),
    ("How many days are in a leap year?", "How many weeks are in a year?", False),
    ("What is 12 times 13?", "What is 12 times 14?", False),
    ("Is Python faster than C?", "Is C faster than Python?", False),
    ("What is the speed of light?", "What is the speed of sound?", False),
    ("Convert 10 miles to kilometers.", "Convert 10 kilometers to miles.", False),
    ("Write a haiku about autumn.", "Write a haiku about spring.", False),
    ("What are the symptoms of the flu?", "What is the treatment for the flu?", False),
    ("How do I convert Celsius to Fahrenheit?", "How do I convert Fahrenheit to Celsius?", False),
    ("Tell me a joke about cats.", "Tell me a joke about dogs.", False),
    ("Should I take the job offer?", "Should I not take the job offer?", False),
    ("What year did World War II end?", "What year did World War I end?", False),
    ("Name three primary colors.", "Name three secondary colors.", False),
]

THRESHOLDS = [0.85, 0.90, 0.93, 0.95, 0.97, 0.99]


# -- semantic precision and recall ---------------------------------------------------------------
def semantic(args) -> None:
    from gemel.cache.semantic import SemanticIndex
    from gemel.embeddings import SentenceEncoder
    from gemel.loader.sources import resolve

    encoder = SentenceEncoder(resolve("all-minilm-l6-v2"))
    cached = sorted({a for a, _, _ in PAIRS})
    vectors = dict(zip(cached, encoder.embed(cached).numpy()))
    later = [b for _, b, _ in PAIRS]
    later_vectors = encoder.embed(later).numpy()
    positives = sum(same for _, _, same in PAIRS)
    print(f"{len(PAIRS)} pairs: {positives} paraphrases, {len(PAIRS) - positives} near-misses; {len(cached)} prompts indexed")
    print(f"{'threshold':>9} {'guards':>6} {'TP':>3} {'FP':>3} {'FN':>3} {'precision':>9} {'recall':>6}")
    for threshold in THRESHOLDS:
        for guards in (False, True):
            index = SemanticIndex(encoder.dimensions, ttl_s=3600, max_entries=1000)
            for text in cached:
                index.add("p", vectors[text], text, text)  # the entry key is the prompt itself here
            tp = fp = fn = 0
            for (a, b, same), v in zip(PAIRS, later_vectors):
                found = index.search("p", v, threshold, b if guards else None)
                hit = found[0][0] if found else None
                if hit is not None and same and hit == a:
                    tp += 1
                elif hit is not None:
                    fp += 1
                elif same:
                    fn += 1
            precision = tp / (tp + fp) if tp + fp else 1.0
            print(f"{threshold:>9.2f} {'on' if guards else 'off':>6} {tp:>3} {fp:>3} {fn:>3} {precision:>9.2f} {tp / positives:>6.2f}")


# -- latency through a real server ---------------------------------------------------------------
SERVER_CONFIG = """
server:
  log_level: warning
cache:
  response:
    semantic: {{enabled: true, threshold: {threshold}, tenants: [anonymous]}}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tmp: Path, threshold: float) -> tuple[subprocess.Popen, str]:
    config = tmp / "gemel.yaml"
    config.write_text(SERVER_CONFIG.format(threshold=threshold))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    gemel = Path(sys.executable).with_name("gemel")
    cmd = [str(gemel)] if gemel.exists() else [sys.executable, "-m", "gemel.cli"]
    log = (tmp / "server.log").open("w")
    proc = subprocess.Popen(
        [*cmd, "serve", "--config", str(config), "--port", str(port), "--no-grpc"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"gemel serve exited: {(tmp / 'server.log').read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("gemel serve did not become ready")


async def one(client: httpx.AsyncClient, url: str, content: str, max_tokens: int) -> tuple[str, float, float]:
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": max_tokens}
    start = time.perf_counter()
    r = await client.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    wall = (time.perf_counter() - start) * 1000
    r.raise_for_status()
    return r.headers["x-gemel-cache"], float(r.headers["x-inference-latency-ms"]), wall


def summary(name: str, rows: list[tuple[str, float, float]]) -> None:
    if not rows:
        print(f"{name:<16} none")
        return
    server = sorted(r[1] for r in rows)
    wall = sorted(r[2] for r in rows)

    def p90(xs: list[float]) -> float:
        return xs[min(len(xs) - 1, int(round(0.9 * (len(xs) - 1))))]

    print(
        f"{name:<16} n={len(rows):<3} server median {statistics.median(server):8.1f} ms  p90 {p90(server):8.1f} ms   "
        f"client median {statistics.median(wall):8.1f} ms  p90 {p90(wall):8.1f} ms"
    )


async def latency(args) -> None:
    with tempfile.TemporaryDirectory(prefix="gemel-response-cache-") as tmp:
        proc, url = start_server(Path(tmp), args.threshold)
        try:
            async with httpx.AsyncClient() as client:
                await client.post(f"{url}/v1/embeddings", json={"model": "text-embedding-004", "input": "warm"}, timeout=300)
                await one(client, url, "Warm up.", 4)
                pairs = list({a: (a, b) for a, b, same in reversed(PAIRS) if same}.values())[::-1][: args.requests]
                asked, paraphrases = [a for a, _ in pairs], [b for _, b in pairs]
                misses = [await one(client, url, q, args.max_tokens) for q in asked]
                hits = [await one(client, url, q, args.max_tokens) for q in asked]
                near = [await one(client, url, q, args.max_tokens) for q in paraphrases]
        finally:
            proc.terminate()
            proc.wait(30)
    assert {r[0] for r in misses} == {"miss"} and {r[0] for r in hits} == {"exact"}, (misses, hits)
    print(f"OpenAI chat, greedy, max_tokens {args.max_tokens}, one request at a time, loopback")
    summary("miss (engine)", misses)
    summary("exact hit", hits)
    summary("semantic hit", [r for r in near if r[0] == "semantic"])
    summary("semantic miss", [r for r in near if r[0] == "miss"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["latency", "semantic", "both"], default="both")
    p.add_argument("--requests", type=int, default=18, help="distinct prompts (at most the 18 paraphrased in PAIRS)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threshold", type=float, default=0.95, help="semantic threshold of the started server")
    args = p.parse_args(argv)
    if args.part in ("semantic", "both"):
        semantic(args)
    if args.part in ("latency", "both"):
        asyncio.run(latency(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
