"""A real ``gemel serve`` subprocess on a free loopback port, shared by the serve tests.

Started once per test session (model load takes seconds); tests drive it with the official
google-genai and openai SDKs through ``base_url``. Tests that kill the engine start their
own instance with ``start_server``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

# Small engine so start-up and the suite stay fast on two cores.
TEST_CONFIG = """
engine:
  dtype: float32
  kv_cache_memory_mb: 128
  max_num_seqs: 64
  max_num_batched_tokens: 512
server:
  stats_interval_s: 0.2
  log_level: warning
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log_path: Path

    def stats(self) -> dict:
        body = httpx.get(f"{self.url}/internal/stats", timeout=5).json()
        return body["engines"][body["default_model"]]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def serve_command() -> list[str]:
    """The `gemel serve` console script beside this interpreter, else the CLI module."""
    script = Path(sys.executable).with_name("gemel")
    if script.exists():
        return [str(script), "serve"]
    return [sys.executable, "-m", "gemel.cli", "serve"]


def start_server(
    tmp: Path, name: str = "server", extra_config: str = "", ready_timeout: float = 240, grpc_port: int | None = None
) -> Server:
    """``grpc_port``: also serve gRPC there; without it the server runs with ``--no-grpc`` so
    several test servers never compete for the default gRPC port."""
    config = tmp / f"{name}.yaml"
    config.write_text(TEST_CONFIG + extra_config)
    port = free_port()
    log_path = tmp / f"{name}.log"
    grpc_args = ["--grpc-port", str(grpc_port)] if grpc_port is not None else ["--no-grpc"]
    return launch(
        ["--config", str(config), "--host", "127.0.0.1", "--port", str(port), *grpc_args], port, log_path, ready_timeout
    )


def launch(args: list[str], port: int, log_path: Path, ready_timeout: float = 240) -> Server:
    """Start ``gemel serve ARGS`` (listening on ``port``) and wait until /readyz is green."""
    proc = subprocess.Popen(
        [*serve_command(), *args],
        stdout=log_path.open("w"),
        stderr=subprocess.STDOUT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        start_new_session=True,
    )
    server = Server(f"http://127.0.0.1:{port}", proc, log_path)
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gemel serve exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.url}/readyz", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    server.stop()
    raise RuntimeError(f"gemel serve not ready after {ready_timeout}s:\n{server.log()}")


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Server:
    srv = start_server(tmp_path_factory.mktemp("serve"))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def genai_client(server):
    from google import genai
    from google.genai import types

    return genai.Client(api_key="x", http_options=types.HttpOptions(base_url=server.url, api_version="v1beta"))


@pytest.fixture(scope="session")
def genai_client_v1(server):
    """google-genai's default API version (v1 in releases >= 3)."""
    from google import genai
    from google.genai import types

    return genai.Client(api_key="x", http_options=types.HttpOptions(base_url=server.url))


@pytest.fixture(scope="session")
def openai_client(server):
    from openai import OpenAI

    return OpenAI(api_key="x", base_url=f"{server.url}/v1", max_retries=0, timeout=120)


# Observability tests (test_metrics, test_tracing, test_dashboard) share their own server, so
# counters they compare are not disturbed by other tests' traffic, with the test-only switch
# that keeps finished spans in memory and serves them at /internal/traces.
OBS_CONFIG = """
observability:
  trace_memory_exporter: true
  log_stats_interval_s: 1
embeddings: null
"""


@pytest.fixture(scope="session")
def obs_server(tmp_path_factory) -> Server:
    srv = start_server(tmp_path_factory.mktemp("obs"), name="obs", extra_config=OBS_CONFIG)
    yield srv
    srv.stop()
