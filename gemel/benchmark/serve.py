"""``gemel bench serve``: an online serving benchmark for any OpenAI-compatible server.

The metrics follow ``vllm bench serve`` and are all measured at the client over streaming:

* TTFT: request sent -> first chunk carrying content;
* E2EL: request sent -> last chunk carrying content;
* TPOT (per request): (E2EL - TTFT) / (output tokens - 1), for requests with more than one token;
* ITL: every gap between consecutive content chunks, pooled over all requests;
* request throughput = completed / duration; output token throughput = sum(output) / duration;
* goodput = requests meeting every SLO given with ``--goodput ttft:MS tpot:MS e2el:MS``, per second.

Output tokens come from the server's ``usage`` (``stream_options.include_usage``), falling back
to the number of content chunks. A fixed number of requests is sent (not a fixed duration).

Datasets:

* ``random``: ``--num-prompts`` prompts of exactly ``--random-input-len`` tokens, each with a
  distinct first token (so no prefix-cache hits), ``--random-output-len`` tokens out with
  ``ignore_eos``. Without ``--tokenizer`` prompts are sent as token-id lists (OpenAI completions
  accepts ``prompt`` as a list of ints); with one, as text of exactly that many tokens.
* ``shared-prefix``: one system prompt of ``--prefix-len`` tokens shared by every request, plus a
  distinct suffix of ``--suffix-len`` tokens.

    gemel bench serve --max-concurrency 8 --num-prompts 64
    python -m gemel.benchmark.serve --base-url http://127.0.0.1:8081 --result-json out.json
    gemel bench serve --backend vllm --port 8000 --dataset-name random --save-result  # vllm's names

vllm bench serve's option names are accepted as well (``--host``/``--port``, ``--backend``,
``--dataset-name``, ``--ignore-eos``, ``--save-result``/``--result-dir``/``--result-filename``,
``--random-range-ratio``, ``--random-prefix-len``, ``--percentile-metrics``).

The same process can be driven from Python with :func:`execute` (returns the result dict).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, AsyncIterator, Protocol, Sequence

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
SLO_KEYS = ("ttft", "tpot", "e2el")
METRICS = (("ttft", "TTFT", "Time to First Token"),
           ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
           ("itl", "ITL", "Inter-token Latency"),
           ("e2el", "E2EL", "End-to-end Latency"))
DEFAULT_ID_RANGE = (100, 32000)  # token ids sent when no tokenizer says otherwise


# --------------------------------------------------------------------------- prompts


class TokenizerLike(Protocol):
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass
class BenchPrompt:
    prompt: str | list[int]  # completions prompt (text or token ids) or chat user message
    prompt_len: int  # tokens as the server will count them (chat: without the template)
    output_len: int
    system: str | None = None  # chat endpoint, shared-prefix dataset: the shared system message


def load_tokenizer(source: str) -> TokenizerLike:
    """gemel's tokenizer for a GGUF file, HF directory or packaged model name."""
    from gemel.loader.sources import resolve
    from gemel.loader.tokenizer import Tokenizer

    path = resolve(source)
    if os.path.isdir(path):
        return Tokenizer.from_pretrained_dir(path)
    from gemel.loader import gguf_loader

    return Tokenizer.from_gguf(gguf_loader.open_gguf(path), path)


def _id_range(tokenizer: TokenizerLike | None, vocab_size: int | None) -> tuple[int, int]:
    lo, hi = DEFAULT_ID_RANGE
    if vocab_size:
        hi = vocab_size
    elif tokenizer is not None:
        hi = int(tokenizer.vocab_size)
    if hi < 1000:  # a toy vocabulary: use all of it
        lo = 0
    return lo, max(hi, lo + 1)


def _special_count(tokenizer: TokenizerLike) -> int:
    """Tokens the server adds to a text prompt (e.g. BOS)."""
    return max(0, len(tokenizer.encode("hello", True)) - len(tokenizer.encode("hello", False)))


def text_of_length(
    tokenizer: TokenizerLike, ids: list[int], target: int, rng: random.Random, id_range: tuple[int, int]
) -> tuple[str, int]:
    """Text that encodes (without special tokens) to exactly ``target`` tokens, starting from ``ids``.

    Decoding random ids and re-encoding rarely round-trips, so re-encode, trim or pad with fresh
    random ids, and repeat until the length is exact. Returns the text and its token count (equal to
    ``target`` unless no exact text was found in a few tries).
    """
    target = max(1, target)
    lo, hi = id_range
    cur = list(ids[:target]) + [rng.randrange(lo, hi) for _ in range(target - len(ids))]
    text, n = "", 0
    for _ in range(16):
        text = tokenizer.decode(cur, skip_special_tokens=True)
        enc = tokenizer.encode(text, add_special_tokens=False)
        n = len(enc)
        if n == target:
            return text, n
        if n > target:
            cur = enc[:target]
        else:
            cur = enc + [rng.randrange(lo, hi) for _ in range(target - n)]
    return text, n


def _distinct_firsts(rng: random.Random, n: int, id_range: tuple[int, int]) -> list[int]:
    lo, hi = id_range
    if n <= hi - lo:
        return rng.sample(range(lo, hi), n)
    return [lo + (i % (hi - lo)) for i in range(n)]


def sampled_lengths(rng: random.Random, n: int, length: int, range_ratio: float) -> list[int]:
    """``n`` lengths uniform in [length (1 - r), length (1 + r)] (at least 1), as vllm's random
    dataset draws them; all ``length`` when r = 0 (and then no draws, so r = 0 keeps the prompts
    a seed gave before the option existed)."""
    if range_ratio <= 0:
        return [length] * n
    lo, hi = max(1, math.floor(length * (1 - range_ratio))), max(1, math.ceil(length * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def random_dataset(
    num_prompts: int,
    input_len: int,
    output_len: int,
    seed: int,
    tokenizer: TokenizerLike | None = None,
    as_text: bool = False,
    vocab_size: int | None = None,
    chat: bool = False,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
) -> list[BenchPrompt]:
    """Prompts of ``input_len`` tokens, each with a distinct first token, ``output_len`` tokens
    out; with ``range_ratio`` both lengths vary per request, and with ``prefix_len`` every
    prompt starts with the same ``prefix_len`` tokens (vllm's ``--random-prefix-len``)."""
    rng = random.Random(seed)
    id_range = _id_range(tokenizer, vocab_size)
    lo, hi = id_range
    firsts = _distinct_firsts(rng, num_prompts, id_range)
    input_lens = sampled_lengths(rng, num_prompts, input_len, range_ratio)
    output_lens = sampled_lengths(rng, num_prompts, output_len, range_ratio)
    if prefix_len > 0:
        return shared_prefix_dataset(num_prompts, prefix_len, input_lens, output_lens, seed + 1, tokenizer, as_text,
                                     vocab_size, chat, firsts=firsts)
    prompts = []
    for i in range(num_prompts):
        n_in = input_lens[i]
        ids = [firsts[i]] + [rng.randrange(lo, hi) for _ in range(n_in - 1)]
        if as_text:
            assert tokenizer is not None
            special = 0 if chat else _special_count(tokenizer)
            text, n = text_of_length(tokenizer, ids, n_in - special, rng, id_range)
            prompts.append(BenchPrompt(text, n + special, output_lens[i]))
        else:
            prompts.append(BenchPrompt(ids, n_in, output_lens[i]))
    return prompts


def shared_prefix_dataset(
    num_prompts: int,
    prefix_len: int,
    suffix_len: int | Sequence[int],
    output_len: int | Sequence[int],
    seed: int,
    tokenizer: TokenizerLike | None = None,
    as_text: bool = False,
    vocab_size: int | None = None,
    chat: bool = False,
    firsts: Sequence[int] | None = None,
) -> list[BenchPrompt]:
    """``num_prompts`` requests sharing one ``prefix_len``-token system prompt, distinct suffixes
    (``suffix_len`` and ``output_len`` each one length for all, or one per request)."""
    rng = random.Random(seed)
    id_range = _id_range(tokenizer, vocab_size)
    lo, hi = id_range
    suffix_lens = [suffix_len] * num_prompts if isinstance(suffix_len, int) else list(suffix_len)
    output_lens = [output_len] * num_prompts if isinstance(output_len, int) else list(output_len)
    prefix = [rng.randrange(lo, hi) for _ in range(prefix_len)]
    firsts = list(firsts) if firsts is not None else _distinct_firsts(rng, num_prompts, id_range)
    suffixes = [[firsts[i]] + [rng.randrange(lo, hi) for _ in range(suffix_lens[i] - 1)] for i in range(num_prompts)]
    if not as_text:
        return [BenchPrompt(prefix + s, prefix_len + len(s), n_out) for s, n_out in zip(suffixes, output_lens)]
    assert tokenizer is not None
    special = 0 if chat else _special_count(tokenizer)
    prefix_text, _ = text_of_length(tokenizer, prefix, prefix_len - special, rng, id_range)
    prompts = []
    for s, n_suffix, n_out in zip(suffixes, suffix_lens, output_lens):
        suffix_text, n = text_of_length(tokenizer, s, n_suffix, rng, id_range)
        if chat:
            n_prefix = len(tokenizer.encode(prefix_text, add_special_tokens=False))
            prompts.append(BenchPrompt(suffix_text, n_prefix + n, n_out, system=prefix_text))
        else:
            text = prefix_text + "\n" + suffix_text
            prompts.append(BenchPrompt(text, len(tokenizer.encode(text, add_special_tokens=True)), n_out))
    return prompts


# --------------------------------------------------------------------------- requests


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0  # from usage, else the number of content chunks
    requested_tokens: int = 0
    chunks: int = 0
    ttft: float = 0.0  # seconds
    latency: float = 0.0  # E2EL, seconds
    itl: list[float] = field(default_factory=list)  # gaps between content chunks, seconds
    start: float = 0.0  # perf_counter at send, for timelines
    error: str = ""


def build_payload(endpoint: str, model: str, p: BenchPrompt, ignore_eos: bool, temperature: float,
                  extra_body: dict | None = None) -> dict:
    payload: dict[str, Any] = {
        "model": model,
        "max_tokens": p.output_len,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == CHAT:
        if not isinstance(p.prompt, str):
            raise ValueError("the chat endpoint needs text prompts: pass --tokenizer")
        messages = [{"role": "system", "content": p.system}] if p.system else []
        payload["messages"] = messages + [{"role": "user", "content": p.prompt}]
    else:
        payload["prompt"] = p.prompt
    if ignore_eos:
        payload["ignore_eos"] = True
    if extra_body:
        payload.update(extra_body)
    return payload


async def _sse_data(resp: Any) -> AsyncIterator[bytes]:
    """The ``data:`` payloads of an SSE body, whatever their length or the network's chunking."""
    pending = bytearray()
    async for block in resp.content.iter_any():
        pending += block
        if b"\n" not in block:
            continue
        *lines, rest = pending.split(b"\n")
        pending = bytearray(rest)
        for line in lines:
            if line.startswith(b"data:"):
                yield bytes(line[5:].strip())
    if pending.startswith(b"data:"):
        yield bytes(pending[5:].strip())


async def send_request(client: Any, url: str, payload: dict, chat: bool, prompt_len: int = 0) -> RequestResult:
    """One streaming request (``client``: an ``aiohttp.ClientSession``); timestamps every chunk
    that carries content."""
    res = RequestResult(prompt_len=prompt_len, requested_tokens=int(payload.get("max_tokens") or 0))
    usage_tokens: int | None = None
    st = time.perf_counter()
    res.start = st
    last = st
    try:
        async with client.post(url, json=payload) as resp:
            if resp.status != 200:
                body = (await resp.read()).decode(errors="replace")
                res.error = f"HTTP {resp.status}: {body[:300]}"
                return res
            async for data in _sse_data(resp):
                if not data or data == b"[DONE]":
                    continue
                ts = time.perf_counter()
                obj = json.loads(data)
                if isinstance(obj, dict) and obj.get("error"):
                    res.error = f"stream error: {json.dumps(obj['error'])[:300]}"
                    return res
                usage = obj.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
                choices = obj.get("choices") or []
                if not choices:
                    continue
                c = choices[0]
                text = (c.get("delta") or {}).get("content") if chat else c.get("text")
                if text:
                    if res.chunks == 0:
                        res.ttft = ts - st
                    else:
                        res.itl.append(ts - last)
                    last = ts
                    res.chunks += 1
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = last - st
    res.output_tokens = usage_tokens if usage_tokens is not None else res.chunks
    res.success = res.chunks > 0
    if not res.success:
        res.error = "no content in the stream"
    return res


# --------------------------------------------------------------------------- metrics


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        for part in item.replace(",", " ").split():
            key, sep, value = part.partition(":")
            key = key.strip().lower()
            if not sep or key not in SLO_KEYS:
                raise ValueError(f"bad --goodput item {part!r}: expected one of {', '.join(SLO_KEYS)} as KEY:MS")
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"bad --goodput item {part!r}: MS must be a number of milliseconds") from None
            if ms < 0 or math.isnan(ms):
                raise ValueError(f"bad --goodput item {part!r}: the SLO must be 0 ms or more")
            slos[key] = ms
    return slos


def parse_extra_body(text: str | None) -> dict[str, Any] | None:
    """``--extra-body``: a JSON object merged into every request body."""
    if not text:
        return None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--extra-body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise ValueError(f"--extra-body must be a JSON object, got {type(body).__name__}")
    return body


def parse_percentiles(text: str) -> list[float]:
    """``"50,90,99"`` -> ``[50.0, 90.0, 99.0]``; each in (0, 100]."""
    out = []
    for part in str(text).split(","):
        if not part.strip():
            continue
        try:
            p = float(part)
        except ValueError:
            raise ValueError(f"bad --metric-percentiles item {part.strip()!r}: expected numbers such as 50,90,99") from None
        if not 0 < p <= 100:
            raise ValueError(f"bad --metric-percentiles item {part.strip()!r}: percentiles lie in (0, 100]")
        out.append(p)
    return out


def parse_percentile_metrics(text: str) -> list[str]:
    """``"ttft,tpot,itl"`` -> the metrics the table shows (the JSON keeps all four)."""
    keys = [part.strip() for part in str(text).split(",") if part.strip()]
    known = [key for key, _, _ in METRICS]
    for key in keys:
        if key not in known:
            raise ValueError(f"bad --percentile-metrics item {key!r}: choose from {','.join(known)}")
    if not keys:
        raise ValueError(f"--percentile-metrics names none of {','.join(known)}")
    return keys


def _percentile(values: Sequence[float], p: float) -> float:
    """numpy's default (linear) percentile."""
    xs = sorted(values)
    if not xs:
        return 0.0
    k = (len(xs) - 1) * p / 100.0
    f = math.floor(k)
    c = min(f + 1, len(xs) - 1)
    return xs[f] + (xs[c] - xs[f]) * (k - f)


def summarize(values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean, median, std and percentiles, in milliseconds (0 when there are no values, like vllm)."""
    ms = [v * 1000.0 for v in values_s]
    n = len(ms)
    mean = sum(ms) / n if n else 0.0
    std = math.sqrt(sum((x - mean) ** 2 for x in ms) / n) if n else 0.0
    out = {"mean": mean, "median": _percentile(ms, 50), "std": std}
    for p in percentiles:
        out[f"p{_pct_name(p)}"] = _percentile(ms, p)
    return out


def _pct_name(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def calculate_metrics(
    results: Sequence[RequestResult],
    duration_s: float,
    goodput: dict[str, float] | None = None,
    percentiles: Sequence[float] = (50, 90, 99),
) -> dict[str, Any]:
    """vllm's metrics from per-request timings. Flat keys: ``mean_ttft_ms``, ``p99_itl_ms``, ..."""
    ok = [r for r in results if r.success]
    ttfts, tpots, all_tpots, itls, e2els = [], [], [], [], []
    for r in ok:
        tpot = 0.0
        if r.output_tokens > 1:
            tpot = (r.latency - r.ttft) / (r.output_tokens - 1)
            tpots.append(tpot)
        all_tpots.append(tpot)
        ttfts.append(r.ttft)
        itls.extend(r.itl)
        e2els.append(r.latency)
    good = 0
    if goodput:
        for r, tpot in zip(ok, all_tpots):
            measured = {"ttft": r.ttft, "tpot": tpot, "e2el": r.latency}
            if all(measured[k] * 1000.0 <= slo for k, slo in goodput.items()):
                good += 1
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    dur = duration_s if duration_s > 0 else float("nan")
    m: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "short_outputs": sum(1 for r in ok if r.requested_tokens and r.output_tokens < r.requested_tokens),
        "request_throughput": len(ok) / dur,
        "request_goodput": (good / dur) if goodput else None,
        "good_requests": good if goodput else None,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
    }
    for key, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        for stat, v in summarize(values, percentiles).items():
            m[f"{stat}_{key}_ms"] = v
    return m


# --------------------------------------------------------------------------- the run


def _arrival_times(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Offsets (s) at which each request is released: all 0 for rate=inf, else a gamma process
    with mean 1/rate (burstiness 1 = Poisson arrivals)."""
    if math.isinf(rate) or rate <= 0:
        return [0.0] * n
    rng = random.Random(seed ^ 0x5EED)
    theta = 1.0 / (rate * burstiness)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, theta)
    return out


async def _discover_model(client: Any, base_url: str) -> str:
    try:
        async with client.get(base_url + "/v1/models") as r:
            data = (await r.json(content_type=None)).get("data") or []
        if data and data[0].get("id"):
            return str(data[0]["id"])
    except Exception:  # noqa: BLE001
        pass
    return "default"


async def run_benchmark(
    prompts: Sequence[BenchPrompt],
    base_url: str = "http://127.0.0.1:8000",
    endpoint: str = COMPLETIONS,
    model: str | None = None,
    max_concurrency: int | None = None,
    request_rate: float = float("inf"),
    burstiness: float = 1.0,
    seed: int = 0,
    goodput: dict[str, float] | None = None,
    percentiles: Sequence[float] = (50, 90, 99),
    ignore_eos: bool = True,
    temperature: float = 0.0,
    extra_body: dict | None = None,
    warmup_prompts: Sequence[BenchPrompt] = (),
    timeout_s: float = 600.0,
    keep_alive: bool = False,
) -> tuple[dict[str, Any], list[RequestResult]]:
    # aiohttp, as vllm's client: it spends about half the CPU per streamed chunk of httpx, and
    # on a small machine the client's CPU is taken from the server it measures.
    import aiohttp

    base_url = base_url.rstrip("/")
    url = base_url + endpoint
    chat = endpoint == CHAT
    conns = max(1, max_concurrency or len(prompts))
    # One connection per request in flight. Without keep-alive by default: servers close idle or
    # much-used keep-alive connections (llama.cpp's cpp-httplib does), and a request sent on a
    # connection the server just closed would fail, since nothing is retried.
    connector = aiohttp.TCPConnector(limit=conns, force_close=not keep_alive)
    timeout = aiohttp.ClientTimeout(total=timeout_s, connect=30.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as client:
        model = model or await _discover_model(client, base_url)
        for w in warmup_prompts:
            r = await send_request(client, url, build_payload(endpoint, model, w, ignore_eos, temperature, extra_body),
                                   chat, w.prompt_len)
            if not r.success:
                raise RuntimeError(f"warm-up request to {url} failed: {r.error}")

        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        arrivals = _arrival_times(len(prompts), request_rate, burstiness, seed)
        payloads = [build_payload(endpoint, model, p, ignore_eos, temperature, extra_body) for p in prompts]

        async def one(i: int, t0: float) -> RequestResult:
            delay = t0 + arrivals[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                return await send_request(client, url, payloads[i], chat, prompts[i].prompt_len)
            async with sem:
                return await send_request(client, url, payloads[i], chat, prompts[i].prompt_len)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(i, t0) for i in range(len(prompts))))
        duration = time.perf_counter() - t0

    metrics = calculate_metrics(results, duration, goodput, percentiles)
    metrics["model"] = model
    errors = [r.error for r in results if not r.success]
    metrics["errors"] = errors[:10]
    return metrics, list(results)


def make_prompts(args: argparse.Namespace, tokenizer: TokenizerLike | None) -> tuple[list[BenchPrompt], list[BenchPrompt]]:
    """The measured prompts and one warm-up prompt (never sharing a prefix with them)."""
    chat = args.endpoint == CHAT
    as_text = args.prompt_format == "text" or (args.prompt_format == "auto" and (tokenizer is not None or chat))
    if as_text and tokenizer is None:
        raise ValueError("text prompts (or the chat endpoint) need --tokenizer (GGUF file, HF dir or packaged model name)")
    common = dict(tokenizer=tokenizer, as_text=as_text, vocab_size=args.vocab_size, chat=chat)
    if args.dataset == "random":
        prompts = random_dataset(args.num_prompts, args.random_input_len, args.random_output_len, args.seed,
                                 range_ratio=args.random_range_ratio, prefix_len=args.random_prefix_len, **common)
    else:
        prompts = shared_prefix_dataset(args.num_prompts, args.prefix_len, args.suffix_len, args.random_output_len,
                                        args.seed, **common)
    warm = random_dataset(args.num_warmups, 16, 4, args.seed + 7919, **common) if args.num_warmups > 0 else []
    return prompts, warm


def execute(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark the arguments describe; return the result dict (also what --result-json holds)."""
    resolve_target(args)
    goodput = parse_goodput(args.goodput)
    percentiles = parse_percentiles(args.metric_percentiles)
    parse_percentile_metrics(args.percentile_metrics)
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    prompts, warm = make_prompts(args, tokenizer)
    extra = parse_extra_body(args.extra_body)
    metrics, results = asyncio.run(run_benchmark(
        prompts,
        base_url=args.base_url,
        endpoint=args.endpoint,
        model=args.model,
        max_concurrency=args.max_concurrency,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        seed=args.seed,
        goodput=goodput,
        percentiles=percentiles,
        ignore_eos=not args.no_ignore_eos,
        temperature=args.temperature,
        extra_body=extra,
        warmup_prompts=warm,
        timeout_s=args.timeout,
        keep_alive=args.keep_alive,
    ))
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "label": args.label,
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "dataset": args.dataset,
        "prompt_format": "text" if prompts and isinstance(prompts[0].prompt, str) else "token_ids",
        "num_prompts": args.num_prompts,
        "input_len": (args.random_prefix_len + args.random_input_len if args.dataset == "random"
                      else args.prefix_len + args.suffix_len),
        "prefix_len": args.prefix_len if args.dataset == "shared-prefix" else args.random_prefix_len or None,
        "output_len": args.random_output_len,
        "range_ratio": args.random_range_ratio if args.dataset == "random" else None,
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "seed": args.seed,
        "goodput_slos_ms": goodput or None,
        "percentiles": percentiles,
        "percentile_metrics": parse_percentile_metrics(args.percentile_metrics),
    }
    result.update(metrics)
    if args.save_detailed:
        result["requests"] = [
            {"prompt_len": r.prompt_len, "output_tokens": r.output_tokens, "ttft": r.ttft, "e2el": r.latency,
             "itl": r.itl, "start": r.start, "error": r.error}
            for r in results
        ]
        # the per-request lists of vllm bench serve's JSON, under its names (seconds)
        result["input_lens"] = [r.prompt_len for r in results]
        result["output_lens"] = [r.output_tokens for r in results]
        result["ttfts"] = [r.ttft for r in results]
        result["itls"] = [r.itl for r in results]
    return result


def format_table(result: dict[str, Any]) -> str:
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(name: str, value: Any, fmt: str = "") -> None:
        lines.append(("{:<40} {:<10" + fmt + "}").format(name, value))

    if result.get("label"):
        row("Label:", result["label"])
    row("Successful requests:", result["completed"])
    if result.get("failed"):
        row("Failed requests:", result["failed"])
    row("Maximum request concurrency:", result.get("max_concurrency") or "unlimited")
    row("Request rate (req/s):", result.get("request_rate"))
    row("Benchmark duration (s):", result["duration"], ".2f")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"], ".2f")
    if result.get("request_goodput") is not None:
        row("Request goodput (req/s):", result["request_goodput"], ".2f")
    row("Output token throughput (tok/s):", result["output_throughput"], ".2f")
    row("Total token throughput (tok/s):", result["total_token_throughput"], ".2f")
    pcts = [f"p{_pct_name(p)}" for p in result.get("percentiles", [])]
    shown = result.get("percentile_metrics") or [key for key, _, _ in METRICS]
    for key, short, title in METRICS:
        if key not in shown:
            continue
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        row(f"Mean {short} (ms):", result[f"mean_{key}_ms"], ".2f")
        row(f"Median {short} (ms):", result[f"median_{key}_ms"], ".2f")
        for p in pcts:
            row(f"{p.upper()} {short} (ms):", result[f"{p}_{key}_ms"], ".2f")
    lines.append("=" * 50)
    if result.get("short_outputs"):
        lines.append(f"note: {result['short_outputs']} requests returned fewer tokens than asked (ignore_eos unsupported?)")
    for err in result.get("errors") or []:
        lines.append(f"error: {err}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- CLI


def bounded(kind: type, low: float, inclusive: bool = True, what: str = ""):
    """An argparse type: ``kind`` values of at least ``low`` (above it when not inclusive)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if math.isnan(value) or value < low or (not inclusive and value == low):
            raise argparse.ArgumentTypeError(f"must be {'at least' if inclusive else 'above'} {low}{what}, got {text}")
        return value

    return parse


def add_bench_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The options, named as ``vllm bench serve`` names them where it has them (``--dataset-name``,
    ``--host``/``--port``, ``--backend``, ``--save-result``, ...), so its command lines run here."""
    positive, count = bounded(int, 1), bounded(int, 0)
    parser.add_argument("--base-url", default=None, help="server root (default http://HOST:PORT)")
    parser.add_argument("--host", default="127.0.0.1", help="server host when no --base-url (default %(default)s)")
    parser.add_argument("--port", type=bounded(int, 1), default=8000, help="server port when no --base-url (default %(default)s)")
    parser.add_argument("--backend", default="openai", choices=["openai", "vllm", "openai-chat"],
                        help="openai and vllm: /v1/completions; openai-chat: /v1/chat/completions (unless --endpoint)")
    parser.add_argument("--endpoint", default=None, choices=[COMPLETIONS, CHAT])
    parser.add_argument("--model", default=None, help="model id to request (default: the first of GET /v1/models)")
    parser.add_argument("--label", default=None, help="a name for this run, kept in the results")
    parser.add_argument("--dataset", "--dataset-name", dest="dataset", default="random", choices=["random", "shared-prefix"])
    parser.add_argument("--num-prompts", type=positive, default=100)
    parser.add_argument("--random-input-len", type=positive, default=128, help="random: prompt tokens")
    parser.add_argument("--random-output-len", type=positive, default=128, help="output tokens (both datasets)")
    parser.add_argument("--random-range-ratio", type=_range_ratio, default=0.0,
                        help="random: lengths drawn uniformly from [len (1 - r), len (1 + r)] (default 0: exact)")
    parser.add_argument("--random-prefix-len", type=count, default=0,
                        help="random: tokens every prompt starts with, before its own --random-input-len")
    parser.add_argument("--prefix-len", type=count, default=1000, help="shared-prefix: shared system prompt tokens")
    parser.add_argument("--suffix-len", type=positive, default=16, help="shared-prefix: distinct tokens per request")
    parser.add_argument("--tokenizer", default=None,
                        help="GGUF file, HF dir or packaged model name; prompts are then text of exact length")
    parser.add_argument("--prompt-format", default="auto", choices=["auto", "ids", "text"],
                        help="auto: text with --tokenizer or the chat endpoint, else token-id lists")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="token ids are drawn from [100, this) (default: the tokenizer's, else 32000)")
    parser.add_argument("--max-concurrency", type=positive, default=None, help="requests in flight at most")
    parser.add_argument("--request-rate", type=bounded(float, 0, inclusive=False, what=" (inf: all at once)"),
                        default=float("inf"),
                        help="requests/s: inf sends all at t=0, else Poisson arrivals (default inf)")
    parser.add_argument("--burstiness", type=bounded(float, 0, inclusive=False), default=1.0, help="gamma shape of the arrivals (1 = Poisson)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000")
    parser.add_argument("--metric-percentiles", default="50,90,99", help="comma-separated percentiles")
    parser.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                        help="metrics the table shows (the JSON has all): comma-separated ttft,tpot,itl,e2el")
    parser.add_argument("--temperature", type=float, default=0.0)
    eos = parser.add_mutually_exclusive_group()
    eos.add_argument("--ignore-eos", dest="no_ignore_eos", action="store_false", default=False,
                     help="send ignore_eos, so every request runs to its output length (the default)")
    eos.add_argument("--no-ignore-eos", dest="no_ignore_eos", action="store_true", help="do not send ignore_eos")
    parser.add_argument("--extra-body", default=None, help="JSON merged into every request body")
    parser.add_argument("--num-warmups", type=count, default=1, help="short unmeasured requests sent first")
    parser.add_argument("--timeout", type=bounded(float, 0, inclusive=False), default=600.0, help="per-request timeout, seconds")
    parser.add_argument("--keep-alive", action="store_true",
                        help="reuse connections between requests (default: a fresh connection per request)")
    parser.add_argument("--result-json", default=None, help="write the results here")
    parser.add_argument("--save-result", action="store_true",
                        help="write the results to --result-dir/--result-filename (vllm's names)")
    parser.add_argument("--result-dir", default=None, help="with --save-result: the directory (default: the current one)")
    parser.add_argument("--result-filename", default=None,
                        help="with --save-result: the file name (default BACKEND-RATEqps-concurrencyN-MODEL-DATE.json)")
    parser.add_argument("--save-detailed", action="store_true", help="keep per-request timings in the JSON")
    parser.add_argument("--disable-tqdm", action="store_true", help="accepted for vllm's command lines (no progress bar here)")


def _range_ratio(text: str) -> float:
    value = bounded(float, 0)(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be below 1 (lengths would reach 0), got {text}")
    return value


def resolve_target(args: argparse.Namespace) -> None:
    """Fill ``base_url`` from ``--host``/``--port`` and ``endpoint`` from ``--backend`` where
    they were not given."""
    if not args.base_url:
        args.base_url = f"http://{args.host}:{args.port}"
    if not args.endpoint:
        args.endpoint = CHAT if args.backend == "openai-chat" else COMPLETIONS


def result_path(args: argparse.Namespace, result: dict[str, Any]) -> str | None:
    """Where the JSON goes: --result-json, else with --save-result --result-dir/--result-filename
    (by default named as vllm names it: backend, rate, concurrency, model, date)."""
    if args.result_json:
        return args.result_json
    if not args.save_result:
        return None
    name = args.result_filename
    if not name:
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        model = str(result.get("model") or "model").split("/")[-1]
        name = f"{args.backend}-{result['request_rate']}qps{concurrency}-{model}-{result['date']}.json"
    return os.path.join(args.result_dir or ".", name)


def run_bench_serve(args: argparse.Namespace) -> int:
    try:
        result = execute(args)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"gemel bench serve: {e}", file=sys.stderr)
        return 2
    print(format_table(result))
    path = result_path(args, result)
    if path:
        try:
            d = os.path.dirname(os.path.abspath(path))
            os.makedirs(d, exist_ok=True)
            with open(path, "w") as f:
                json.dump(result, f, indent=2)
        except OSError as e:  # the table above still holds the results
            flag = "--result-json" if args.result_json else "--save-result"
            print(f"gemel bench serve: could not write {flag} to {path}: {e}", file=sys.stderr)
            return 2
    return 0 if result["completed"] > 0 else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gemel bench serve",
                                     description="Benchmark an OpenAI-compatible server over streaming.")
    add_bench_serve_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_bench_serve(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
