"""gemel against llama.cpp's server, alternately, in one run.

Starts (or is given the URLs of) gemel and the llama.cpp peer on the same GGUF file, then runs the
same ``gemel.benchmark.serve`` workload against each in turn (gemel, peer, gemel, peer, ... for
``--rounds``) at each ``--concurrency``: the random dataset, ``--input-len`` prompt tokens (each
prompt with a distinct start), ``--output-len`` tokens out ignoring EOS, all requests released at
t=0 and at most ``concurrency`` in flight. Prints output throughput, TTFT p50/p99 and ITL p50/p99
for both and the ratios gemel/peer, plus each server's peak RSS (VmHWM over its process tree).

    nice -n 19 .venv/bin/python bench/compare.py --concurrency 1 8 32 64 --json artifacts/compare.json
    nice -n 19 .venv/bin/python bench/compare.py --concurrency 1 8 --num-prompts 16 --output-len 32   # smoke
    .venv/bin/python bench/compare.py --gemel-url http://127.0.0.1:8000 --gemel-pid 1234 --skip-peer

Every round uses its own seed, shared by both servers, so the two see the same prompts but no
round hits a prefix cache filled by an earlier one. The peer is started with as many slots as the
concurrency (``-np C -cb -t 2``, ``-c`` C x 512 tokens, more where a prompt and its output need
it), restarted for each concurrency level unless ``--peer-url`` is given. The machine drifts, so
only ratios from one run mean much. Each run starts after ``--settle`` seconds of quiet (default
1.5): gemel's engine gives up a core while another process keeps one busy and takes it back a
quarter second after it stops, so a run started the moment the other server's run ends would begin
on one thread (its first prompts' TTFT then measures the benchmark's alternation, not the server).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from gemel.benchmark import serve as bench  # noqa: E402

PEER_SCRIPT = os.path.join(REPO, "bench", "peers", "llama_cpp.sh")
KEYS = (("output_throughput", "out tok/s", True), ("p50_ttft_ms", "TTFT p50", False),
        ("p99_ttft_ms", "TTFT p99", False), ("p50_itl_ms", "ITL p50", False), ("p99_itl_ms", "ITL p99", False))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def peak_rss_mib(pid: int | None) -> float | None:
    """Sum of VmHWM (peak resident set) over the process and its descendants, MiB."""
    if not pid:
        return None
    total, seen = 0, False
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        total += int(line.split()[1])
                        seen = True
        except OSError:
            continue
    return total / 1024 if seen else None


class Server:
    def __init__(self, name: str, cmd: list[str], port: int, log_dir: str, ready_path: str):
        self.name, self.cmd, self.port, self.ready_path = name, cmd, port, ready_path
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = os.path.join(log_dir, f"{name}-{port}.log")
        self.proc: subprocess.Popen | None = None
        self.peak_rss: float | None = None

    def start(self, timeout: float) -> None:
        print(f"[compare] starting {self.name}: {' '.join(self.cmd)}  (log: {self.log_path})", file=sys.stderr)
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        with httpx.Client(trust_env=False, timeout=5) as c:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}")
                try:
                    if c.get(self.url + self.ready_path).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f}s; see {self.log_path}")

    def sample_rss(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            rss = peak_rss_mib(self.proc.pid)
            if rss is not None:
                self.peak_rss = max(self.peak_rss or 0.0, rss)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.sample_rss()
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: the server and its children only
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        except ProcessLookupError:
            pass


def gemel_command(python: str, port: int, model: str, extra: list[str]) -> list[str]:
    gemel_bin = os.path.join(os.path.dirname(python), "gemel")
    ok = os.path.exists(gemel_bin) and subprocess.run(
        [gemel_bin, "serve", "--help"], capture_output=True, cwd=REPO).returncode == 0
    base = [gemel_bin, "serve"] if ok else [python, "-m", "gemel.api.server"]
    return base + ["--port", str(port), "--model", model, "--no-embeddings", *extra]


def run_one(url: str, label: str, conc: int, args: argparse.Namespace, seed: int) -> dict:
    argv = ["--base-url", url, "--label", label, "--dataset", "random", "--num-prompts", str(args.num_prompts or max(16, 4 * conc)),
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
            "--max-concurrency", str(conc), "--request-rate", "inf", "--seed", str(seed),
            "--vocab-size", str(args.vocab_size), "--temperature", str(args.temperature)]
    if args.tokenizer:
        argv += ["--tokenizer", args.tokenizer]
    r = bench.execute(bench.build_parser().parse_args(argv))
    print(f"[compare] c={conc:<3} {label:<6} seed={seed}: {r['output_throughput']:8.1f} tok/s  "
          f"TTFT p50 {r['p50_ttft_ms']:8.1f} p99 {r['p99_ttft_ms']:8.1f} ms  ITL p50 {r['p50_itl_ms']:7.1f} "
          f"p99 {r['p99_itl_ms']:7.1f} ms  ok {r['completed']}/{r['completed'] + r['failed']}", file=sys.stderr)
    return r


def _median(runs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get("completed")]
    return statistics.median(vals) if vals else None


def summarize(results: dict) -> list[dict]:
    rows = []
    for conc, by_server in results.items():
        row = {"concurrency": int(conc)}
        for name, runs in by_server.items():
            row[name] = {k: _median(runs, k) for k, _, _ in KEYS}
        if "gemel" in row and "peer" in row:
            row["ratio"] = {k: (row["gemel"][k] / row["peer"][k] if row["gemel"][k] and row["peer"][k] else None)
                            for k, _, _ in KEYS}
        rows.append(row)
    return rows


def format_summary(rows: list[dict], rss: dict) -> str:
    def cell(v: float | None, ratio: bool = False) -> str:
        if v is None:
            return f"{'-':>10}"
        return f"{v:>9.2f}x" if ratio else f"{v:>10.1f}"

    head = f"{'conc':>4}  {'server':<12}" + "".join(f"{title:>10}" for _, title, _ in KEYS)
    lines = [head + "   (latencies in ms)", "-" * len(head)]
    for row in rows:
        for name in ("gemel", "peer", "ratio"):
            if name not in row:
                continue
            label = {"gemel": "gemel", "peer": "llama.cpp", "ratio": "gemel/peer"}[name]
            lines.append(f"{row['concurrency']:>4}  {label:<12}" + "".join(cell(row[name][k], name == "ratio") for k, _, _ in KEYS))
    lines.append("-" * len(head))
    for name, label in (("gemel", "gemel"), ("peer", "llama.cpp")):
        if name in rss:
            v = rss[name]
            lines.append(f"peak RSS {label:<10} {'unknown (pass --' + name + '-pid)' if v is None else f'{v:.0f} MiB'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    positive = bench.bounded(int, 1)
    p.add_argument("--model", default=None, help="GGUF file served by both (default: the packaged SmolLM2)")
    p.add_argument("--concurrency", type=positive, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--rounds", type=positive, default=1, help="gemel/peer alternations per concurrency")
    p.add_argument("--settle", type=bench.bounded(float, 0), default=1.5,
                   help="seconds of quiet before each run, so that neither server starts its run beside the other's tail")
    p.add_argument("--num-prompts", type=positive, default=None, help="per run (default: max(16, 4 x concurrency))")
    p.add_argument("--input-len", type=positive, default=128)
    p.add_argument("--output-len", type=positive, default=128)
    p.add_argument("--vocab-size", type=bench.bounded(int, 101), default=32000, help="prompt token ids are drawn from [100, this)")
    p.add_argument("--tokenizer", default=None, help="send text prompts made with this tokenizer instead of token ids")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=bench.bounded(float, 0), default=0.0,
                   help="sent with every request (default 0: greedy); other sampling settings stay each server's own")
    p.add_argument("--gemel-url", default=None, help="use this running gemel instead of starting one")
    p.add_argument("--gemel-pid", type=int, default=None, help="its pid, for peak RSS")
    p.add_argument("--gemel-port", type=int, default=None, help="port for the gemel it starts (default: a free one)")
    p.add_argument("--gemel-arg", action="append", default=[], help="extra argument for gemel serve (repeatable)")
    p.add_argument("--peer-url", default=None, help="use this running llama.cpp server instead of starting one")
    p.add_argument("--peer-pid", type=int, default=None, help="its pid, for peak RSS")
    p.add_argument("--peer-port", type=int, default=None, help="port for the peer it starts (default: a free one)")
    p.add_argument("--peer-threads", type=positive, default=2)
    p.add_argument("--skip-gemel", action="store_true")
    p.add_argument("--skip-peer", action="store_true")
    p.add_argument("--start-timeout", type=bench.bounded(float, 0, inclusive=False), default=600.0, help="seconds to wait for a server (the peer may build)")
    p.add_argument("--log-dir", default=None, help="server logs (default: a temporary directory)")
    p.add_argument("--json", default=None, help="write all results here")
    p.add_argument("--isa", choices=["auto", "avx2"], default="auto",
                   help="avx2: both servers as an AVX2-only CPU runs them, on any x86 machine: gemel with "
                        "GEMEL_CPU_ISA=avx2 (and PyTorch's and oneDNN's own kernels capped at AVX2), the peer "
                        "built with LLAMA_CPP_ISA=avx2 (AVX/AVX2/FMA/F16C, no AVX-512)")
    args = p.parse_args(argv)
    if args.isa == "avx2":  # inherited by the servers started below
        os.environ.update(GEMEL_CPU_ISA="avx2", ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2",
                          LLAMA_CPP_ISA="avx2")
        # torch.compile's cache of its own: code it built for the machine's own level, loaded
        # beside PyTorch's AVX2 kernels, computed wrong results (PyTorch 2.13).
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "gemel-inductor-avx2"))

    python = sys.executable
    if args.model is None:
        from gemel.loader.sources import resolve

        args.model = resolve("smollm2-135m-instruct")
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="gemel-compare-")
    os.makedirs(log_dir, exist_ok=True)
    names = [n for n, skip in (("gemel", args.skip_gemel), ("peer", args.skip_peer)) if not skip]
    results: dict[str, dict[str, list[dict]]] = {}
    gemel: Server | None = None
    peer: Server | None = None
    peer_rss: float | None = None
    started = time.time()
    try:
        if "gemel" in names and args.gemel_url is None:
            port = args.gemel_port or free_port()
            gemel = Server("gemel", gemel_command(python, port, args.model, args.gemel_arg), port, log_dir, "/readyz")
            gemel.start(args.start_timeout)
        if "peer" in names and args.peer_url is None and not shutil.which("bash"):
            raise RuntimeError("bash is needed to start the peer")
        gemel_url = args.gemel_url or (gemel.url if gemel else None)
        for ci, conc in enumerate(args.concurrency):
            if "peer" in names and args.peer_url is None:
                port = args.peer_port or free_port()
                # every slot holds a whole request: 512 tokens, or prompt + output rounded up to 256
                per_slot = max(512, -(-(args.input_len + args.output_len + 16) // 256) * 256)
                cmd = ["bash", PEER_SCRIPT, "start", "--port", str(port), "--parallel", str(conc),
                       "--threads", str(args.peer_threads), "--model", args.model, "--ctx", str(conc * per_slot)]
                peer = Server("peer", cmd, port, log_dir, "/health")
                peer.start(args.start_timeout)
            peer_url = args.peer_url or (peer.url if peer else None)
            by_server = results.setdefault(str(conc), {n: [] for n in names})
            for r in range(args.rounds):
                seed = args.seed + 1000 * ci + r
                for name in names:
                    url = gemel_url if name == "gemel" else peer_url
                    time.sleep(args.settle)
                    by_server[name].append(run_one(url, name, conc, args, seed))
                    srv = gemel if name == "gemel" else peer
                    if srv:
                        srv.sample_rss()
            if peer is not None:
                peer.stop()
                peer_rss = max(peer_rss or 0.0, peer.peak_rss or 0.0) or None
                peer = None
    finally:
        if gemel:
            gemel.stop()
        if peer:
            peer.stop()
            peer_rss = max(peer_rss or 0.0, peer.peak_rss or 0.0) or None

    rss = {}
    if "gemel" in names:
        rss["gemel"] = gemel.peak_rss if gemel else peak_rss_mib(args.gemel_pid)
    if "peer" in names:
        rss["peer"] = peer_rss if args.peer_url is None else peak_rss_mib(args.peer_pid)
    rows = summarize(results)
    from gemel.layers.kernel_plan import cpu_info

    cpu = cpu_info()
    print(f"\n{cpu.describe()}; "
          f"servers run as: {'AVX2 only (--isa avx2)' if args.isa == 'avx2' else 'this CPU'}")
    print(f"model {args.model}; random dataset, {args.input_len} in / {args.output_len} out (ignore_eos), "
          f"temperature {args.temperature:g}, "
          f"rate inf, {args.rounds} round(s), medians over rounds")
    print(format_summary(rows, rss))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"date": datetime.now().isoformat(timespec="seconds"), "model": args.model,
                       "input_len": args.input_len, "output_len": args.output_len, "rounds": args.rounds,
                       "elapsed_s": time.time() - started, "log_dir": log_dir, "peak_rss_mib": rss,
                       "summary": rows, "runs": results, "isa": args.isa, "cpu": {"model": cpu.model,
                       "flags": cpu.relevant_flags()}}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
