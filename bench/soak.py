"""Soak test of ``gemel serve``: minutes of mixed traffic, one engine kill, every answer checked.

``--clients`` loops each send one request after another, picked at random among Gemini
generateContent and streamGenerateContent (SSE), OpenAI chat completions (unary and streamed)
and OpenAI completions, over ~40 fixed prompts (a few of several hundred tokens) with output
caps from 8 to 128 tokens, all greedy and with top-2 log-probabilities. A share of requests
(``--disconnect-ratio``) is abandoned on purpose: streams are closed after the first content,
unary calls get a client timeout under a second. Half-way (``--kill-at-minute``) the engine
process gets SIGKILL; the server restarts it and resubmits what was running, so nothing may be
lost.

Before the soak every (prompt, surface, max tokens) combination is answered once at low
concurrency. Each answer of the soak is compared with that reference: the same text is
"exact"; a first differing token where the reference's top-2 log-probabilities lie within
``--tie-nats`` is a "near-tie" (batch composition changes float rounding, so greedy may flip
there); any other difference is "corrupted". A non-200 status, an in-band error event, an
answer without a finish reason or one not done within ``--request-timeout`` is "lost".
Exit status 0 only when nothing was lost or corrupted.

    .venv/bin/python bench/soak.py                                   # 64 clients, 10 minutes
    .venv/bin/python bench/soak.py --clients 8 --minutes 1.5 --kill-at-minute 0.75   # short check
    .venv/bin/python bench/soak.py --url http://127.0.0.1:8000 --no-kill --json artifacts/soak.json

Also reported: p50/p99 end-to-end latency per minute and the resident memory of the server's
process tree (VmRSS, sampled every 5 s), split into the engine and the rest (the API process),
at the end of warm-up (the first minute, or 10% of a shorter run) and at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from compare import free_port, process_tree  # noqa: E402  (bench/ is this script's directory)

from gemel.benchmark.serve import bounded  # noqa: E402

GEMINI, OPENAI = "gemini-2.0-flash", "gpt-4o-mini"
KINDS = ("gemini", "gemini-stream", "chat", "chat-stream", "completions")
MAX_TOKENS = (8, 16, 24, 32, 48, 64, 96, 128)
VERDICTS = ("exact", "near-tie", "corrupted", "lost", "abandoned")

PASSAGE = (
    "The lighthouse keeper's log for the winter of 1887 records forty-one days of fog, eleven storms and a "
    "single visitor, a surveyor from the coastal authority who arrived by mail boat and stayed three nights. "
    "He measured the tower, counted the steps (one hundred and twelve), tested the lamp's clockwork and noted "
    "that the lens, made in Paris, had a crack along its lower prism that let the beam waver on calm nights. "
    "The keeper, a widower named Tobias Merrow, wrote that the surveyor ate little, asked many questions about "
    "the currents off the northern reef and left behind a pencil drawing of the island seen from the east. "
    "In spring the authority sent a new lens, a barrel of paraffin and a letter ordering the keeper to record "
    "the tide every four hours. Merrow did so for nine years, until the station was automated, and his tide "
    "tables were later used to chart the slow silting of the harbour mouth, which by 1920 had closed to all "
    "but the smallest fishing boats. The drawing now hangs in the village hall, beside a photograph of Merrow "
    "holding the cracked prism, which he kept on his mantelpiece for the rest of his life."
)
CODE = (
    "def merge(intervals):\n    intervals.sort(key=lambda x: x[0])\n    out = []\n    for start, end in intervals:\n"
    "        if out and start <= out[-1][1]:\n            out[-1][1] = max(out[-1][1], end)\n        else:\n"
    "            out.append([start, end])\n    return out\n\n\ndef total_covered(intervals):\n"
    "    return sum(end - start for start, end in merge([list(i) for i in intervals]))\n"
)
PROMPTS = [
    "What is the capital of France?", "Name three primary colours.", "Write a haiku about autumn leaves.",
    "Explain in two sentences why the sky is blue.", "What is 17 times 23?", "Translate 'good morning' into Spanish.",
    "List five animals that live in the ocean.", "Give me a name for a pet goldfish.", "What does a compiler do?",
    "Write one sentence describing a busy market.", "Summarise the plot of Cinderella in three sentences.",
    "Why do we have seasons on Earth?", "Suggest a title for a mystery novel set on a train.",
    "What is the boiling point of water at sea level in Fahrenheit?", "Describe the taste of a lemon to someone who has never had one.",
    "Write a short limerick about a cat who loves cheese.", "What are the three states of matter?",
    "Give two tips for sleeping better.", "Explain recursion to a ten-year-old.", "What is the opposite of 'ancient'?",
    "Write a polite email declining a meeting invitation.", "Count from one to ten in French.",
    "What is photosynthesis?", "Invent a new ice cream flavour and describe it.", "Who wrote Romeo and Juliet?",
    "Give a one-line definition of democracy.", "Write the first line of a fairy tale.",
    "What is the difference between weather and climate?", "List the planets of the solar system in order.",
    "Describe a sunrise over the mountains in vivid detail, with colours, sounds and the feeling of the cold air.",
    "You are a travel guide. A visitor has one rainy afternoon in an old harbour town with a maritime museum, "
    "two bakeries, a lighthouse and a second-hand bookshop. Plan their afternoon hour by hour and explain each choice.",
    "A recipe calls for 250 grams of flour, 2 eggs, 300 millilitres of milk and a pinch of salt and makes 8 pancakes. "
    "How much of each ingredient is needed for 20 pancakes? Show the working.",
    f"Read this passage and answer: how many steps does the lighthouse have?\n\n{PASSAGE}",
    f"Read this passage and summarise it in two sentences.\n\n{PASSAGE}",
    f"{PASSAGE}\n\nWhat happened to the harbour mouth, according to the passage?",
    f"{PASSAGE}\n\nWrite a short diary entry by Tobias Merrow on the day the new lens arrived.",
    f"Explain what this Python code does and give an example input and output.\n\n{CODE}",
    f"{CODE}\nWhat is the time complexity of total_covered, and why?",
    f"Here is a story opening: {PASSAGE[:600]}\n\nContinue the story.",
    "Question: " + " ".join(f"Item {i} costs {i * 3 + 1} dollars." for i in range(1, 31)) + " What do items 4 and 7 cost together?",
]  # fmt: skip


@dataclass
class Answer:
    """One answer: the verdict-relevant text, its tokens and, per token, the top-2 log-probability gap."""

    text: str = ""
    tokens: list[str] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    finish: str | None = None

    def add(self, token: str, alternatives: list[float]) -> None:
        top = sorted(alternatives, reverse=True)
        self.tokens.append(token)
        self.gaps.append(top[0] - top[1] if len(top) >= 2 else math.inf)


class Lost(Exception):
    """The server failed the request: a status other than 200, an error event, no finish reason."""


def request_of(kind: str, prompt: str, max_tokens: int) -> tuple[str, dict]:
    """URL path and JSON body: greedy, with the top-2 alternatives of every token."""
    if kind.startswith("gemini"):
        method = "streamGenerateContent?alt=sse" if kind.endswith("stream") else "generateContent"
        return f"/v1beta/models/{GEMINI}:{method}", {
            "contents": [{"role": "user", "parts": [{"text": prompt}]}],
            "generationConfig": {"temperature": 0, "maxOutputTokens": max_tokens, "responseLogprobs": True, "logprobs": 2}}
    if kind == "completions":
        return "/v1/completions", {"model": OPENAI, "prompt": prompt, "temperature": 0, "max_tokens": max_tokens, "logprobs": 2}
    return "/v1/chat/completions", {
        "model": OPENAI, "messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": max_tokens,
        "logprobs": True, "top_logprobs": 2, "stream": kind.endswith("stream")}


def absorb(obj: dict, ans: Answer) -> None:
    """Add one response body or stream event (either API) to ``ans``."""
    if "error" in obj:
        raise Lost(f"error event: {json.dumps(obj['error'])[:300]}")
    for cand in obj.get("candidates", [])[:1]:  # Gemini
        ans.text += "".join(p.get("text", "") for p in cand.get("content", {}).get("parts", []))
        result = cand.get("logprobsResult") or {}
        tops = result.get("topCandidates", [])
        for i, chosen in enumerate(result.get("chosenCandidates", [])):
            ans.add(chosen["token"], [c["logProbability"] for c in tops[i]["candidates"]] if i < len(tops) else [])
        ans.finish = cand.get("finishReason") or ans.finish
    for choice in obj.get("choices", [])[:1]:  # OpenAI
        if "message" in choice:
            ans.text += choice["message"].get("content") or ""
        elif "delta" in choice:
            ans.text += choice["delta"].get("content") or ""
        else:
            ans.text += choice.get("text") or ""
        lp = choice.get("logprobs") or {}
        for entry in lp.get("content") or []:  # chat
            ans.add(entry["token"], [t["logprob"] for t in entry["top_logprobs"]])
        for token, top in zip(lp.get("tokens") or [], lp.get("top_logprobs") or []):  # completions
            ans.add(token, list(top.values()))
        ans.finish = choice.get("finish_reason") or ans.finish


async def call(client: httpx.AsyncClient, url: str, kind: str, prompt: str, max_tokens: int,
               timeout: float, abandon_after: float | None = None) -> Answer | None:
    """One request; None when it was abandoned on purpose (``abandon_after`` set). Raises Lost."""
    path, body = request_of(kind, prompt, max_tokens)
    ans = Answer()
    try:
        async with asyncio.timeout(timeout):
            if body.get("stream") or kind == "gemini-stream":
                async with client.stream("POST", url + path, json=body) as r:
                    if r.status_code != 200:
                        raise Lost(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            absorb(json.loads(line[6:]), ans)
                            if abandon_after is not None and ans.text and ans.finish is None:
                                return None  # leaving the block closes the connection mid-stream
            else:
                try:
                    async with asyncio.timeout(abandon_after):
                        r = await client.post(url + path, json=body)
                except TimeoutError:
                    if abandon_after is None:
                        raise
                    return None
                if r.status_code != 200:
                    raise Lost(f"HTTP {r.status_code}: {r.text[:300]}")
                absorb(r.json(), ans)
    except TimeoutError:
        raise Lost(f"no answer within {timeout:.0f}s") from None
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        raise Lost(f"{type(e).__name__}: {e}") from None
    if ans.finish is None:
        raise Lost("answer ended without a finish reason")
    return ans


def judge(ref: Answer, ans: Answer, tie_nats: float) -> tuple[str, str]:
    """exact / near-tie / corrupted, and where the answer left the reference."""
    if ans.text == ref.text:
        return "exact", ""
    i = next((k for k, (a, b) in enumerate(zip(ref.tokens, ans.tokens)) if a != b), min(len(ref.tokens), len(ans.tokens)))
    # The reference's gap where the paths part; past its end (it stopped there), the answer's own.
    gap = ref.gaps[i] if i < len(ref.tokens) else ans.gaps[i] if i < len(ans.tokens) else math.inf
    got = ans.tokens[i] if i < len(ans.tokens) else None
    want = ref.tokens[i] if i < len(ref.tokens) else None
    detail = f"token {i}: reference {want!r}, got {got!r}, top-2 gap {gap:.3f} nats"
    if got == want:  # same tokens, different text: the text itself was damaged
        detail = f"same {len(ans.tokens)} tokens, text differs: {ans.text[:120]!r} vs {ref.text[:120]!r}"
    return ("near-tie" if gap < tie_nats else "corrupted"), detail


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def rss_mib(pids: list[int]) -> float:
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                total += next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
        except OSError:
            pass
    return total / 1024


def parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


class Soak:
    def __init__(self, args: argparse.Namespace, url: str, api_pid: int | None):
        self.args, self.url, self.api_pid = args, url, api_pid
        self.records: list[dict] = []
        self.rss: list[dict] = []
        self.kill: dict = {}
        self.t0 = 0.0
        limits = httpx.Limits(max_connections=2 * args.clients + 8, max_keepalive_connections=args.clients + 8)
        self.client = httpx.AsyncClient(trust_env=False, limits=limits, timeout=httpx.Timeout(args.request_timeout, connect=30))

    async def engine(self) -> dict:
        body = (await self.client.get(self.url + "/internal/stats", timeout=10)).json()
        return body["engines"][body["default_model"]]

    async def reference(self, combos: list[tuple[int, str, int]]) -> dict:
        """Every combination answered once, ``--reference-concurrency`` at a time."""
        gate, refs = asyncio.Semaphore(self.args.reference_concurrency), {}

        async def one(combo):
            async with gate:
                p, kind, n = combo
                try:
                    refs[combo] = await call(self.client, self.url, kind, PROMPTS[p], n, self.args.request_timeout)
                except Lost as e:
                    raise RuntimeError(f"reference answer failed ({kind}, prompt {p}, max {n}): {e}") from None

        started = time.monotonic()
        await asyncio.gather(*(one(c) for c in combos))
        print(f"[soak] reference pass: {len(combos)} answers in {time.monotonic() - started:.0f}s", file=sys.stderr)
        return refs

    async def client_loop(self, i: int, combos: list, refs: dict, end: float) -> None:
        rng = random.Random(self.args.seed * 100003 + i)
        while time.monotonic() < end:
            combo = rng.choice(combos)
            p, kind, n = combo
            abandon = rng.random() < self.args.disconnect_ratio
            start = time.monotonic()
            rec = {"t": round(start - self.t0, 3), "wall": datetime.now().strftime("%H:%M:%S.%f")[:-3], "client": i,
                   "kind": kind, "prompt": p, "max_tokens": n}
            try:
                ans = await call(self.client, self.url, kind, PROMPTS[p], n, self.args.request_timeout,
                                 rng.uniform(0.1, 1.0) if abandon else None)
                verdict, detail = ("abandoned", "") if ans is None else judge(refs[combo], ans, self.args.tie_nats)
            except Lost as e:
                verdict, detail = "lost", str(e)
            rec.update(verdict=verdict, detail=detail, latency_s=round(time.monotonic() - start, 4),
                       end=round(time.monotonic() - self.t0, 3))
            self.records.append(rec)
            if verdict in ("lost", "corrupted"):
                print(f"[soak] {rec['wall']} {verdict}: {kind} prompt {p} max {n}: {detail}", file=sys.stderr)

    async def sample_rss(self, stop: asyncio.Event) -> None:
        """Every 5 s: RSS of the engine's process tree and of the rest of the server's tree."""
        engine_pid = None
        while True:
            try:
                engine_pid = (await self.engine()).get("pid") or engine_pid
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            api_pid = self.api_pid or (parent_of(engine_pid) if engine_pid else None)
            if api_pid:
                engine_tree = set(process_tree(engine_pid)) if engine_pid else set()
                everything = process_tree(api_pid)
                engine = rss_mib([p for p in everything if p in engine_tree])
                api = rss_mib([p for p in everything if p not in engine_tree])
                self.rss.append({"t": round(time.monotonic() - self.t0, 1), "engine_pid": engine_pid, "api_mib": round(api, 1),
                                 "engine_mib": round(engine, 1), "total_mib": round(api + engine, 1)})
            try:
                await asyncio.wait_for(stop.wait(), 5)
                return
            except TimeoutError:
                pass

    async def kill_engine(self, at: float) -> None:
        """SIGKILL the engine once, then time how long until a new one is ready."""
        await asyncio.sleep(max(0.0, self.t0 + at - time.monotonic()))
        old = (await self.engine())["pid"]
        os.kill(old, signal.SIGKILL)
        killed = time.monotonic()
        self.kill = {"t": round(killed - self.t0, 1), "wall": datetime.now().strftime("%H:%M:%S.%f")[:-3], "old_pid": old}
        print(f"[soak] {self.kill['wall']} SIGKILL engine pid {old}", file=sys.stderr)
        while time.monotonic() - killed < 300:
            await asyncio.sleep(0.2)
            try:
                e = await self.engine()
            except (httpx.HTTPError, KeyError, ValueError):
                continue
            if e.get("pid") not in (None, old) and e.get("state") == "ready":
                self.kill.update(new_pid=e["pid"], restart_s=round(time.monotonic() - killed, 1))
                print(f"[soak] new engine pid {e['pid']} ready after {self.kill['restart_s']}s", file=sys.stderr)
                return

    async def run(self) -> dict:
        a = self.args
        rng = random.Random(a.seed)
        combos = [(p, k, rng.choice(MAX_TOKENS)) for p in range(len(PROMPTS)) for k in KINDS]
        if a.combos:
            combos = rng.sample(combos, min(a.combos, len(combos)))
        async with self.client:
            refs = await self.reference(combos)
            duration = a.minutes * 60
            self.t0 = time.monotonic()
            stop = asyncio.Event()
            sampler = asyncio.create_task(self.sample_rss(stop))
            killer = asyncio.create_task(self.kill_engine(a.kill_at_minute * 60)) if not a.no_kill else None
            await asyncio.gather(*(self.client_loop(i, combos, refs, self.t0 + duration) for i in range(a.clients)))
            if killer is not None and not killer.done():
                killer.cancel()  # the restart took longer than the soak
            elif killer is not None and killer.exception():
                print(f"[soak] the engine kill failed: {killer.exception()!r}", file=sys.stderr)
            stop.set()
            await sampler
        return {"combos": len(combos), "duration_s": round(time.monotonic() - self.t0, 1)}


def rss_summary(samples: list[dict], warmup_s: float) -> dict | None:
    if not samples:
        return None
    warm = next((s for s in samples if s["t"] >= warmup_s), samples[0])
    end = samples[-1]
    growth = {k: (end[k] / warm[k] - 1) * 100 if warm[k] else math.nan for k in ("total_mib", "api_mib", "engine_mib")}
    # Each engine process separately, from its own warm-up (the same delay after its first
    # sample) to its last sample: a restart resets the engine's memory, which would hide a leak
    # in the whole run's growth.
    lives = []
    for pid in dict.fromkeys(s["engine_pid"] for s in samples):
        own = [s for s in samples if s["engine_pid"] == pid]
        start = next((s for s in own if s["t"] >= own[0]["t"] + warmup_s), None)
        if start is not None and start is not own[-1] and start["engine_mib"]:
            lives.append({"engine_pid": pid, "from_t": start["t"], "to_t": own[-1]["t"], "from_mib": start["engine_mib"],
                          "to_mib": own[-1]["engine_mib"], "growth_pct": (own[-1]["engine_mib"] / start["engine_mib"] - 1) * 100})
    return {"warmup": warm, "end": end, "growth_pct": growth, "engine_lives": lives}


def report(soak: Soak, info: dict, args: argparse.Namespace, log_path: str | None) -> dict:
    recs = soak.records
    counts = {v: sum(r["verdict"] == v for r in recs) for v in VERDICTS}
    print(f"\nrequests {len(recs)}: completed {counts['exact'] + counts['near-tie'] + counts['corrupted']} "
          f"(exact {counts['exact']}, near-tie divergences {counts['near-tie']}, corrupted {counts['corrupted']}), "
          f"abandoned {counts['abandoned']}, lost {counts['lost']}")
    print(f"\n{'surface':<14}" + "".join(f"{v:>11}" for v in VERDICTS))
    for kind in (*KINDS, "all"):
        rows = [r for r in recs if kind in ("all", r["kind"])]
        print(f"{kind:<14}" + "".join(f"{sum(r['verdict'] == v for r in rows):>11}" for v in VERDICTS))
    kill_minute = int(soak.kill["t"] // 60) if soak.kill else None
    print(f"\n{'minute':>6} {'completed':>10} {'abandoned':>10} {'lost':>6} {'p50 ms':>9} {'p99 ms':>9}")
    per_minute = []
    for m in range(int(max((r["end"] for r in recs), default=0) // 60) + 1):
        rows = [r for r in recs if int(r["end"] // 60) == m]
        lat = [r["latency_s"] * 1000 for r in rows if r["verdict"] in ("exact", "near-tie", "corrupted")]
        row = {"minute": m, "completed": len(lat), "abandoned": sum(r["verdict"] == "abandoned" for r in rows),
               "lost": sum(r["verdict"] == "lost" for r in rows), "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99)}
        per_minute.append(row)
        print(f"{m:>6} {row['completed']:>10} {row['abandoned']:>10} {row['lost']:>6} {row['p50_ms']:>9.0f} {row['p99_ms']:>9.0f}"
              + ("   <- engine killed" if m == kill_minute else ""))
    if soak.kill:
        print(f"\nengine SIGKILL at {soak.kill['t']}s ({soak.kill['wall']}), pid {soak.kill['old_pid']} -> "
              f"{soak.kill.get('new_pid', 'none')}, ready again after {soak.kill.get('restart_s', '?')}s")
    rss = rss_summary(soak.rss, min(60.0, 0.1 * args.minutes * 60))
    if rss:
        w, e, g = rss["warmup"], rss["end"], rss["growth_pct"]
        print(f"\nRSS (MiB)       warm-up t={w['t']:.0f}s    end t={e['t']:.0f}s    growth")
        for key, label in (("total_mib", "server tree"), ("api_mib", "API process"), ("engine_mib", "engine")):
            print(f"{label:<14}{w[key]:>14.0f}{e[key]:>14.0f}{g[key]:>+9.1f}%")
        if w["engine_pid"] != e["engine_pid"]:
            print(f"(engine: pid {w['engine_pid']} at warm-up, pid {e['engine_pid']} at the end, its restarted process)")
        for life in rss["engine_lives"]:
            print(f"engine pid {life['engine_pid']:<7} t={life['from_t']:.0f}s {life['from_mib']:>7.0f}  t={life['to_t']:.0f}s "
                  f"{life['to_mib']:>7.0f}  {life['growth_pct']:>+6.1f}%  (its own life, after its warm-up)")
    else:
        print("\nRSS: not measured (no server process found on this machine; pass --pid)")
    for verdict in ("lost", "corrupted", "near-tie"):
        shown = [r for r in recs if r["verdict"] == verdict][:10]
        if shown:
            print(f"\n{verdict} (first {len(shown)}):")
            for r in shown:
                print(f"  {r['wall']} t={r['t']:.1f}s {r['kind']} prompt {r['prompt']} max {r['max_tokens']}: {r['detail']}")
    if log_path:
        print(f"\nserver log: {log_path}")
    return {"counts": counts, "requests": len(recs), "per_minute": per_minute, "kill": soak.kill, "rss": rss,
            "rss_samples": soak.rss, "records": recs, **info}


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str, str]:
    """``gemel serve`` on a free loopback port, logging to a kept file; waits for /readyz."""
    port = free_port()
    gemel = os.path.join(os.path.dirname(sys.executable), "gemel")
    cmd = [gemel, "serve"] if os.path.exists(gemel) else [sys.executable, "-m", "gemel.cli", "serve"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--no-grpc", "--no-embeddings", *args.server_arg]
    if args.config:
        cmd += ["--config", args.config]
    log_path = os.path.join(args.log_dir or tempfile.mkdtemp(prefix="gemel-soak-"), f"gemel-{port}.log")
    print(f"[soak] starting: {shlex.join(cmd)}  (log: {log_path})", file=sys.stderr)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + args.start_timeout
    with httpx.Client(trust_env=False, timeout=5) as c:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"gemel serve exited with {proc.returncode}; see {log_path}")
            try:
                if c.get(url + "/readyz").status_code == 200:
                    return proc, url, log_path
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"gemel serve not ready after {args.start_timeout:.0f}s; see {log_path}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # its own session: the server and its children only
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    positive = bounded(float, 0, inclusive=False)
    p.add_argument("--clients", type=bounded(int, 1), default=64, help="concurrent client loops")
    p.add_argument("--minutes", type=positive, default=10.0)
    p.add_argument("--kill-at-minute", type=bounded(float, 0), default=None, help="SIGKILL the engine then (default: half-way)")
    p.add_argument("--no-kill", action="store_true", help="do not kill the engine")
    p.add_argument("--disconnect-ratio", type=bounded(float, 0), default=0.1, help="share of requests abandoned mid-way")
    p.add_argument("--tie-nats", type=positive, default=0.5, help="top-2 gap under which a divergence is a near-tie")
    p.add_argument("--combos", type=bounded(int, 1), default=None,
                   help="use only this many (prompt, surface, max tokens) combinations (default: all, 5 per prompt)")
    p.add_argument("--reference-concurrency", type=bounded(int, 1), default=4)
    p.add_argument("--request-timeout", type=positive, default=600.0, help="seconds before a request counts as lost")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", default=None, help="use this running server (loopback) instead of starting one")
    p.add_argument("--pid", type=int, default=None, help="with --url: the server's pid (default: the engine's parent)")
    p.add_argument("--config", default=None, help="gemel.yaml for the server it starts (default: none)")
    p.add_argument("--server-arg", action="append", default=[], help="extra argument for gemel serve (repeatable)")
    p.add_argument("--start-timeout", type=positive, default=600.0)
    p.add_argument("--log-dir", default=None, help="where the server's log goes (default: a new temporary directory)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.kill_at_minute is None:
        args.kill_at_minute = args.minutes / 2
    if not args.no_kill and args.kill_at_minute >= args.minutes:
        p.error("--kill-at-minute must fall within --minutes")

    from gemel.layers.kernel_plan import cpu_info

    cpu = cpu_info()
    proc, log_path = None, None
    try:
        if args.url:
            url, api_pid = args.url.rstrip("/"), args.pid
        else:
            proc, url, log_path = start_server(args)
            api_pid = proc.pid
        soak = Soak(args, url, api_pid)
        info = asyncio.run(soak.run())
    except RuntimeError as e:
        print(f"[soak] {e}" + (f"; server log: {log_path}" if log_path else ""), file=sys.stderr)
        return 2
    finally:
        if proc is not None:
            stop_server(proc)
    print(f"\n{cpu.describe()}")
    print(f"command: {shlex.join(['bench/soak.py', *(sys.argv[1:] if argv is None else argv)])}")
    print(f"{args.clients} clients for {args.minutes:g} min, {info['combos']} combinations over {len(PROMPTS)} prompts, "
          f"disconnect ratio {args.disconnect_ratio:g}, engine kill {'none' if args.no_kill else f'at {args.kill_at_minute:g} min'}")
    result = report(soak, info, args, log_path)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"date": datetime.now().isoformat(timespec="seconds"), "url": url, "log": log_path,
                       "settings": vars(args), "cpu": {"model": cpu.model, "flags": cpu.relevant_flags()}, **result},
                      f, indent=2, default=str)
    return 0 if result["counts"]["lost"] == 0 and result["counts"]["corrupted"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
