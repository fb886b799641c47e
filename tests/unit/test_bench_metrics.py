"""``gemel bench serve``: the metric math from synthetic timings, the datasets, and the client end to
end against a stub OpenAI-compatible streaming server (no model needed)."""

from __future__ import annotations

import asyncio
import json
import math
import threading

import numpy as np
import pytest

from gemel.benchmark import serve
from gemel.benchmark.serve import RequestResult, calculate_metrics, parse_goodput


# --------------------------------------------------------------------------- metric math


def _synthetic() -> list[RequestResult]:
    # request a: sent at 0, chunks at 100, 120, 150, 200 ms -> 4 tokens
    a = RequestResult(success=True, prompt_len=10, output_tokens=4, ttft=0.100, latency=0.200,
                      itl=[0.020, 0.030, 0.050])
    # request b: one token at 300 ms
    b = RequestResult(success=True, prompt_len=12, output_tokens=1, ttft=0.300, latency=0.300, itl=[])
    # request c: failed; must not count anywhere but "failed"
    c = RequestResult(success=False, prompt_len=99, output_tokens=0, error="boom")
    return [a, b, c]


def test_counts_and_throughput():
    m = calculate_metrics(_synthetic(), duration_s=2.0)
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_input_tokens"] == 22 and m["total_output_tokens"] == 5
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(2.5)
    assert m["total_token_throughput"] == pytest.approx(13.5)
    assert m["request_goodput"] is None


def test_ttft_tpot_itl_e2el():
    m = calculate_metrics(_synthetic(), duration_s=2.0)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["p99_ttft_ms"] == pytest.approx(np.percentile([100.0, 300.0], 99))
    # TPOT = (E2EL - TTFT) / (tokens - 1), only for requests with more than one token
    assert m["mean_tpot_ms"] == pytest.approx(100.0 / 3)
    assert m["median_tpot_ms"] == pytest.approx(100.0 / 3)
    # ITL: every gap, pooled
    assert m["mean_itl_ms"] == pytest.approx(100.0 / 3)
    assert m["median_itl_ms"] == pytest.approx(30.0)
    assert m["p90_itl_ms"] == pytest.approx(np.percentile([20.0, 30.0, 50.0], 90))
    assert m["p99_itl_ms"] == pytest.approx(np.percentile([20.0, 30.0, 50.0], 99))
    assert m["mean_e2el_ms"] == pytest.approx(250.0)
    assert m["std_e2el_ms"] == pytest.approx(50.0)


def test_tpot_from_chunk_timestamps():
    """Rebuild a request from raw chunk times and check TPOT/ITL agree with the definitions."""
    send = 10.0
    chunks = [10.5, 10.6, 10.65, 10.9, 11.0]
    r = RequestResult(success=True, output_tokens=len(chunks), ttft=chunks[0] - send, latency=chunks[-1] - send,
                      itl=[b - a for a, b in zip(chunks, chunks[1:])])
    m = calculate_metrics([r], duration_s=1.0)
    assert m["mean_ttft_ms"] == pytest.approx(500.0)
    assert m["mean_e2el_ms"] == pytest.approx(1000.0)
    assert m["mean_tpot_ms"] == pytest.approx(500.0 / 4)
    assert m["mean_itl_ms"] == pytest.approx(m["mean_tpot_ms"])  # one token per chunk: mean ITL == TPOT


def test_goodput():
    rs = _synthetic()
    # a: ttft 100, tpot 33.3, e2el 200; b: ttft 300, tpot 0 (one token), e2el 300
    assert calculate_metrics(rs, 2.0, {"ttft": 200})["request_goodput"] == pytest.approx(0.5)
    assert calculate_metrics(rs, 2.0, {"ttft": 300})["good_requests"] == 2  # the SLO is inclusive
    assert calculate_metrics(rs, 2.0, {"tpot": 30})["good_requests"] == 1  # only b (tpot 0)
    assert calculate_metrics(rs, 2.0, {"e2el": 250})["good_requests"] == 1  # only a
    assert calculate_metrics(rs, 2.0, {"ttft": 200, "tpot": 30})["good_requests"] == 0  # every SLO must hold
    assert calculate_metrics(rs, 2.0, {"ttft": 1000, "tpot": 40, "e2el": 1000})["request_goodput"] == pytest.approx(1.0)


def test_parse_goodput():
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    assert parse_goodput(["e2el:1000,ttft:2"]) == {"e2el": 1000.0, "ttft": 2.0}
    assert parse_goodput(None) == {}
    for bad, why in ((["itl:5"], "expected one of"), (["ttft"], "expected one of"), (["ttft:-1"], "0 ms or more"),
                     (["ttft:abc"], "must be a number"), (["ttft:nan"], "0 ms or more")):
        with pytest.raises(ValueError, match=why):
            parse_goodput(bad)


def test_percentiles_and_bad_arguments_are_refused_with_what_is_wrong(capsys):
    assert serve.parse_percentiles("50, 90,99.9") == [50.0, 90.0, 99.9]
    for bad, why in (("50,abc", "expected numbers"), ("0,99", r"in \(0, 100\]"), ("101", r"in \(0, 100\]")):
        with pytest.raises(ValueError, match=why):
            serve.parse_percentiles(bad)
    assert serve.parse_extra_body('{"top_p": 0.9}') == {"top_p": 0.9} and serve.parse_extra_body(None) is None
    for bad, why in (("{bad", "not JSON"), ("[1, 2]", "must be a JSON object")):
        with pytest.raises(ValueError, match=why):
            serve.parse_extra_body(bad)
    parser = serve.build_parser()
    assert parser.parse_args(["--request-rate", "inf"]).request_rate == math.inf
    assert parser.parse_args(["--request-rate", "2.5", "--max-concurrency", "4"]).max_concurrency == 4
    for argv, why in ((["--request-rate", "0"], "must be above 0"), (["--request-rate", "-1"], "must be above 0"),
                      (["--request-rate", "fast"], "invalid float value"), (["--max-concurrency", "0"], "at least 1"),
                      (["--num-prompts", "-3"], "at least 1"), (["--num-warmups", "-1"], "at least 0"),
                      (["--burstiness", "0"], "must be above 0"), (["--random-output-len", "0"], "at least 1")):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
        assert why in capsys.readouterr().err, argv


def test_empty_and_percentiles_match_numpy():
    m = calculate_metrics([], duration_s=1.0)
    assert m["completed"] == 0 and m["mean_ttft_ms"] == 0.0 and m["p99_itl_ms"] == 0.0
    xs = [0.013, 0.002, 0.5, 0.07, 0.07, 0.031, 0.9]
    s = serve.summarize(xs, (50, 90, 99, 99.9))
    ms = np.array(xs) * 1000
    for p in (50, 90, 99, 99.9):
        assert s[f"p{serve._pct_name(p)}"] == pytest.approx(np.percentile(ms, p))
    assert s["mean"] == pytest.approx(ms.mean()) and s["std"] == pytest.approx(ms.std())


def test_arrivals():
    assert serve._arrival_times(5, float("inf"), 1.0, 0) == [0.0] * 5
    a = serve._arrival_times(4000, 10.0, 1.0, 3)
    assert a == serve._arrival_times(4000, 10.0, 1.0, 3)  # seeded
    assert a != serve._arrival_times(4000, 10.0, 1.0, 4)
    gaps = np.diff(a)
    assert (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.1, rel=0.08)
    assert gaps.std() == pytest.approx(0.1, rel=0.1)  # exponential: std == mean


# --------------------------------------------------------------------------- datasets


class ToyTokenizer:
    """Greedy longest-match over letters and a few bigrams, so decode->encode rarely round-trips."""

    def __init__(self) -> None:
        letters = [chr(ord("a") + i) for i in range(26)]
        self.vocab = ["<s>"] + letters + ["ab", "cd", "ef", "gh", "th", "he", "in", "er", " "]
        self.ids = {t: i for i, t in enumerate(self.vocab)}
        self.vocab_size = len(self.vocab)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        out, i = ([0] if add_special_tokens else []), 0
        while i < len(text):
            if text[i:i + 2] in self.ids:
                out.append(self.ids[text[i:i + 2]])
                i += 2
            else:
                out.append(self.ids[text[i]])
                i += 1
        return out

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self.vocab[i] for i in ids if not (skip_special_tokens and i == 0))


def test_random_dataset_ids():
    ps = serve.random_dataset(50, 128, 32, seed=1)
    assert all(isinstance(p.prompt, list) and len(p.prompt) == 128 and p.prompt_len == 128 for p in ps)
    assert len({p.prompt[0] for p in ps}) == 50  # distinct starts: no prefix-cache hits
    assert all(100 <= t < 32000 for p in ps for t in p.prompt)
    assert [p.prompt for p in ps] == [p.prompt for p in serve.random_dataset(50, 128, 32, seed=1)]
    assert ps[0].prompt != serve.random_dataset(50, 128, 32, seed=2)[0].prompt


def test_random_dataset_text_exact_length():
    tok = ToyTokenizer()
    ps = serve.random_dataset(20, 40, 8, seed=0, tokenizer=tok, as_text=True)
    for p in ps:
        assert isinstance(p.prompt, str)
        assert len(tok.encode(p.prompt, add_special_tokens=True)) == 40 == p.prompt_len  # counts the BOS the server adds
    assert len({p.prompt for p in ps}) == 20


def test_shared_prefix_dataset():
    ps = serve.shared_prefix_dataset(8, 200, 10, 16, seed=0)
    assert all(p.prompt[:200] == ps[0].prompt[:200] and len(p.prompt) == 210 for p in ps)
    assert len({p.prompt[200] for p in ps}) == 8
    tok = ToyTokenizer()
    chat = serve.shared_prefix_dataset(4, 60, 5, 16, seed=0, tokenizer=tok, as_text=True, chat=True)
    assert len({p.system for p in chat}) == 1 and len({p.prompt for p in chat}) == 4
    assert len(tok.encode(chat[0].system, add_special_tokens=False)) == 60


# --------------------------------------------------------------------------- end to end against a stub


class StubServer:
    """A minimal OpenAI-compatible server streaming SSE completions chunks, on a free loopback port.

    Emits ``max_tokens`` tokens, ``tokens_per_chunk`` per content chunk, ``delay`` seconds apart,
    then (with ``stream_options.include_usage``, unless ``usage`` is False) a usage chunk.
    """

    def __init__(self, delay: float = 0.002, tokens_per_chunk: int = 1, usage: bool = True, status: int = 200):
        self.delay, self.tokens_per_chunk, self.usage, self.status = delay, tokens_per_chunk, usage, status
        self.requests: list[dict] = []
        self.in_flight = self.max_in_flight = self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> StubServer:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _shutdown(self) -> None:
        self._server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._server.wait_closed()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                method, path, _ = line.decode().split(" ", 2)
                length = 0
                while (h := await reader.readline()) not in (b"\r\n", b""):
                    name, _, value = h.decode().partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                body = json.loads(await reader.readexactly(length)) if length else None
                if method == "GET" and path == "/v1/models":
                    self._json(writer, 200, {"object": "list", "data": [{"id": "stub-model", "object": "model"}]})
                elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
                    self.requests.append(body)
                    if self.status != 200:
                        self._json(writer, self.status, {"error": {"message": "stub failure"}})
                    else:
                        await self._stream(writer, body, chat=path.endswith("chat/completions"))
                else:
                    self._json(writer, 404, {"error": {"message": "not found"}})
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            return
        finally:
            writer.close()

    @staticmethod
    def _json(writer: asyncio.StreamWriter, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
                     + data)

    async def _stream(self, writer: asyncio.StreamWriter, body: dict, chat: bool) -> None:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")

        def event(obj) -> None:
            data = f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        n = int(body["max_tokens"])
        obj = "chat.completion.chunk" if chat else "text_completion"
        if chat:  # the role chunk carries no content and must not count as the first token
            event({"object": obj, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        sent = 0
        while sent < n:
            k = min(self.tokens_per_chunk, n - sent)
            sent += k
            text = "tok " * k
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            choice["finish_reason"] = "length" if sent == n else None
            event({"object": obj, "choices": [choice], **({"usage": None} if include_usage else {})})
            await writer.drain()
            await asyncio.sleep(self.delay)
        if include_usage and self.usage:
            prompt_tokens = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 7
            event({"object": obj, "choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                                          "total_tokens": prompt_tokens + n}})
        event("[DONE]")
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        self.in_flight -= 1


def _args(url: str, *extra: str):
    return serve.build_parser().parse_args(["--base-url", url, *extra])


def test_end_to_end_random_ids(tmp_path):
    out = tmp_path / "r.json"
    with StubServer(delay=0.003) as stub:
        rc = serve.main(["--base-url", stub.url, "--num-prompts", "6", "--max-concurrency", "2",
                         "--random-input-len", "20", "--random-output-len", "5", "--result-json", str(out),
                         "--label", "stub", "--goodput", "ttft:60000", "tpot:60000", "--save-detailed"])
        assert rc == 0
        reqs = stub.requests
        assert stub.max_in_flight == 2  # the semaphore holds
        assert stub.connections == 8  # a fresh connection per request (models, warm-up, 6 measured)
    assert len(reqs) == 7  # 1 warm-up + 6 measured
    measured = reqs[1:]
    for body in measured:
        assert body["model"] == "stub-model"  # discovered from /v1/models
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["max_tokens"] == 5
        assert isinstance(body["prompt"], list) and len(body["prompt"]) == 20
    assert len({b["prompt"][0] for b in measured}) == 6
    r = json.loads(out.read_text())
    assert r["label"] == "stub" and r["completed"] == 6 and r["failed"] == 0
    assert r["total_output_tokens"] == 30 and r["total_input_tokens"] == 120
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])
    assert r["output_throughput"] == pytest.approx(30 / r["duration"])
    assert r["mean_ttft_ms"] > 0 and r["p99_e2el_ms"] >= r["median_e2el_ms"] > 0
    assert r["median_itl_ms"] >= 2.0  # the stub sleeps 3 ms between chunks
    assert len(r["requests"]) == 6 and all(len(q["itl"]) == 4 for q in r["requests"])
    table = serve.format_table(r)
    assert "Serving Benchmark Result" in table and "P99 ITL (ms):" in table and "Request goodput" in table


def test_an_unwritable_result_json_is_reported_after_the_table(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with StubServer() as stub:
        rc = serve.main(["--base-url", stub.url, "--num-prompts", "2", "--random-output-len", "2",
                         "--result-json", str(blocker / "r.json")])  # a directory that is a file
    assert rc == 2
    captured = capsys.readouterr()
    assert "Serving Benchmark Result" in captured.out and "could not write --result-json" in captured.err


def test_keep_alive_reuses_connections():
    with StubServer() as stub:
        r = serve.execute(_args(stub.url, "--num-prompts", "6", "--max-concurrency", "2", "--random-output-len", "3",
                                "--random-input-len", "4", "--keep-alive"))
        assert stub.connections <= 2  # one connection per concurrent request, reused
    assert r["completed"] == 6


def test_usage_preferred_over_chunks_and_fallback():
    with StubServer(tokens_per_chunk=2) as stub:
        r = serve.execute(_args(stub.url, "--num-prompts", "3", "--random-output-len", "6", "--random-input-len", "4"))
    assert r["total_output_tokens"] == 18  # from usage, though only 3 chunks each
    assert r["mean_tpot_ms"] > 0
    with StubServer(usage=False) as stub:
        r = serve.execute(_args(stub.url, "--num-prompts", "3", "--random-output-len", "6", "--random-input-len", "4"))
    assert r["total_output_tokens"] == 18  # one token per chunk, counted


def test_chat_endpoint_text_prompts(monkeypatch):
    tok = ToyTokenizer()
    monkeypatch.setattr(serve, "load_tokenizer", lambda source: tok)
    with StubServer() as stub:
        r = serve.execute(_args(stub.url, "--endpoint", "/v1/chat/completions", "--tokenizer", "toy",
                                "--dataset", "shared-prefix", "--prefix-len", "50", "--suffix-len", "4",
                                "--num-prompts", "4", "--random-output-len", "3", "--model", "m"))
        bodies = stub.requests[1:]
    assert r["completed"] == 4 and r["total_output_tokens"] == 12 and r["prompt_format"] == "text"
    assert all(b["model"] == "m" and b["messages"][0]["role"] == "system" for b in bodies)
    assert len({b["messages"][0]["content"] for b in bodies}) == 1
    assert len({b["messages"][1]["content"] for b in bodies}) == 4


def test_a_vllm_bench_serve_command_line_runs_as_written(tmp_path, monkeypatch, capsys):
    """vllm's option names: --host/--port, --backend openai-chat, --dataset-name, --ignore-eos,
    --save-result with --result-dir, --percentile-metrics, --disable-tqdm."""
    tok = ToyTokenizer()
    monkeypatch.setattr(serve, "load_tokenizer", lambda source: tok)
    with StubServer() as stub:
        rc = serve.main(["--backend", "openai-chat", "--host", "127.0.0.1", "--port", str(stub.port),
                         "--model", "m", "--tokenizer", "toy", "--dataset-name", "random", "--random-input-len", "12",
                         "--random-output-len", "3", "--num-prompts", "4", "--max-concurrency", "2", "--ignore-eos",
                         "--request-rate", "inf", "--save-result", "--result-dir", str(tmp_path / "results"),
                         "--percentile-metrics", "ttft,itl", "--metric-percentiles", "99", "--disable-tqdm"])
        bodies = stub.requests[1:]
    assert rc == 0
    assert len(bodies) == 4 and all(b["ignore_eos"] is True and "messages" in b for b in bodies)
    [saved] = list((tmp_path / "results").iterdir())
    assert saved.name.startswith("openai-chat-infqps-concurrency2-m-") and saved.suffix == ".json"
    r = json.loads(saved.read_text())
    assert r["completed"] == 4 and r["base_url"] == stub.url and r["endpoint"] == "/v1/chat/completions"
    assert "p99_tpot_ms" in r and "p99_e2el_ms" in r  # the JSON keeps every metric
    table = capsys.readouterr().out
    assert "P99 TTFT (ms):" in table and "P99 ITL (ms):" in table
    assert "TPOT" not in table and "E2EL" not in table  # the table shows the ones asked for
    with StubServer() as stub:
        rc = serve.main(["--port", str(stub.port), "--num-prompts", "2", "--random-output-len", "2",
                         "--save-result", "--result-dir", str(tmp_path), "--result-filename", "named.json"])
    assert rc == 0 and json.loads((tmp_path / "named.json").read_text())["endpoint"] == "/v1/completions"
    parser = serve.build_parser()
    for argv, why in ((["--percentile-metrics", "ttft,latency"], "bad --percentile-metrics item 'latency'"),):
        with StubServer() as stub:
            assert serve.main(["--base-url", stub.url, *argv]) == 2
        assert why in capsys.readouterr().err
    for argv, why in ((["--random-range-ratio", "1"], "must be below 1"), (["--random-range-ratio", "-0.1"], "at least 0"),
                      (["--ignore-eos", "--no-ignore-eos"], "not allowed with"), (["--port", "0"], "at least 1")):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
        assert why in capsys.readouterr().err, argv


def test_random_range_ratio_and_prefix_len():
    exact = serve.random_dataset(40, 100, 20, seed=3)
    assert [p.prompt for p in exact] == [p.prompt for p in serve.random_dataset(40, 100, 20, seed=3, range_ratio=0.0)]
    varied = serve.random_dataset(40, 100, 20, seed=3, range_ratio=0.5)
    ins, outs = [p.prompt_len for p in varied], [p.output_len for p in varied]
    assert all(50 <= n <= 150 for n in ins) and all(10 <= n <= 30 for n in outs)
    assert len(set(ins)) > 10 and len(set(outs)) > 5  # they do vary
    assert all(len(p.prompt) == p.prompt_len for p in varied)
    assert len({p.prompt[0] for p in varied}) == 40
    prefixed = serve.random_dataset(6, 30, 8, seed=0, prefix_len=64)
    assert all(len(p.prompt) == 94 == p.prompt_len and p.prompt[:64] == prefixed[0].prompt[:64] for p in prefixed)
    assert len({p.prompt[64] for p in prefixed}) == 6  # then distinct
    tok = ToyTokenizer()
    text = serve.random_dataset(5, 20, 8, seed=0, tokenizer=tok, as_text=True, range_ratio=0.4)
    assert all(len(tok.encode(p.prompt, add_special_tokens=True)) == p.prompt_len for p in text)


def test_poisson_rate_and_failures():
    with StubServer() as stub:
        r = serve.execute(_args(stub.url, "--num-prompts", "5", "--random-output-len", "2", "--random-input-len", "4",
                                "--request-rate", "200", "--seed", "5"))
    assert r["completed"] == 5 and r["request_rate"] == 200.0
    with StubServer(status=500) as stub:
        assert serve.main(["--base-url", stub.url, "--num-prompts", "2"]) == 2  # the warm-up fails: stop early
        r = serve.execute(_args(stub.url, "--num-prompts", "3", "--num-warmups", "0"))
    assert r["completed"] == 0 and r["failed"] == 3 and "HTTP 500" in r["errors"][0]
    assert not math.isnan(r["mean_ttft_ms"])


def test_sse_data_across_network_chunks():
    """Events split anywhere by the network, long lines and CRLF endings all parse."""

    class Body:
        def __init__(self, blocks):
            self.blocks = blocks

        async def iter_any(self):
            for b in self.blocks:
                yield b

    class Resp:
        def __init__(self, blocks):
            self.content = Body(blocks)

    long = json.dumps({"choices": [{"text": "x" * 200_000}]}).encode()
    raw = b"data: {\"a\": 1}\r\n\r\n: comment\n\ndata: " + long + b"\n\ndata: [DONE]"
    blocks = [raw[i:i + 7] for i in range(0, len(raw), 7)]

    async def collect():
        return [d async for d in serve._sse_data(Resp(blocks))]

    assert asyncio.run(collect()) == [b'{"a": 1}', long, b"[DONE]"]
