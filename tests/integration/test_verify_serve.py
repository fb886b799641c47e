"""`gemel serve` checks weights before a model's engine starts: a corrupted model is refused
with 503 naming the file and the bad byte range, while an intact one serves beside it.

Its own server: the catalogue holds the packaged default model and a copy of its GGUF with
one byte changed after its manifest was written.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import httpx
import pytest
import yaml
from conftest import TEST_CONFIG, Server, free_port, serve_command

from gemel.loader import integrity, sources

pytestmark = pytest.mark.slow

BAD_OFFSET = 70_000_000  # inside the second 64 MiB chunk of the 98 MB GGUF


def wait_for(server: Server, model: str, timeout: float = 120) -> None:
    """Until ``model`` is loaded. /readyz stays red while a model is refused, so /healthz's
    list of loaded models is what says the server is up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"gemel serve exited with {server.proc.returncode}:\n{server.log()}")
        try:
            if model in httpx.get(f"{server.url}/healthz", timeout=2).json()["models_loaded"]:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    server.stop()
    raise RuntimeError(f"{model} not loaded after {timeout}s:\n{server.log()}")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("verify")
    broken = tmp / "broken.gguf"
    shutil.copyfile(sources.resolve(sources.SMOLLM2), broken)
    integrity.write_manifest(str(broken))
    with open(broken, "r+b") as f:
        f.seek(BAD_OFFSET)
        byte = f.read(1)[0]
        f.seek(BAD_OFFSET)
        f.write(bytes([byte ^ 0x01]))
    config = yaml.safe_load(TEST_CONFIG)
    config["server"]["verify_weights"] = "fast"
    config["models"] = [
        {"id": "good", "source": sources.SMOLLM2},
        {"id": "broken", "source": str(broken)},
    ]
    config["embeddings"] = None
    path = tmp / "verify.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    log_path = tmp / "verify.log"
    proc = subprocess.Popen(
        [*serve_command(), "--config", str(path), "--host", "127.0.0.1", "--port", str(port), "--no-grpc"],
        stdout=log_path.open("w"),
        stderr=subprocess.STDOUT,
        env=dict(os.environ, PYTHONUNBUFFERED="1", GEMEL_VERIFY_CACHE=str(tmp / "cache")),
        start_new_session=True,
    )
    server = Server(f"http://127.0.0.1:{port}", proc, log_path)
    wait_for(server, "good")
    yield server, broken
    server.stop()


def test_intact_model_serves_and_corrupted_one_is_refused(mixed):
    server, broken = mixed
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    ok = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "good", **chat}, timeout=120)
    assert ok.status_code == 200, ok.text

    bad_range = f"{broken}: bytes 67108864-98362431 (chunk 2 of 2) differ from the manifest {broken}.gemel-verify.json"
    refused = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "broken", **chat}, timeout=30)
    assert refused.status_code == 503
    assert refused.json()["error"]["message"] == f"model broken is unavailable: weights differ: {bad_range}"

    gemini = httpx.post(
        f"{server.url}/v1beta/models/broken:generateContent",
        json={"contents": [{"role": "user", "parts": [{"text": "Hi"}]}]},
        timeout=30,
    )
    assert gemini.status_code == 503
    assert gemini.json()["error"]["status"] == "UNAVAILABLE"
    assert bad_range in gemini.json()["error"]["message"]

    assert "broken" not in httpx.get(f"{server.url}/healthz", timeout=5).json()["models_loaded"]
    assert "model broken will not serve" in server.log()
