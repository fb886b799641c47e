"""A tenant's limits hold across front ends: two `gemel serve` processes sharing one tenants
file and one real Redis grant a 30 rpm tenant 30 requests in all, not 30 each."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import free_port, launch

pytestmark = pytest.mark.slow

COUNT = "/v1beta/models/gemini-2.0-flash:countTokens"
BODY = json.dumps({"contents": [{"role": "user", "parts": [{"text": "Hello there"}]}]}).encode()


def _key(tenants: Path, tenant: str, *limits: str) -> str:
    gemel = Path(sys.executable).with_name("gemel")
    cmd = [str(gemel)] if gemel.exists() else [sys.executable, "-m", "gemel.cli"]
    r = subprocess.run([*cmd, "keys", "create", "--tenants", str(tenants), "--tenant", tenant, *limits],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_rpm_holds_across_two_front_ends(tmp_path, redis_url):
    tenants = tmp_path / "tenants.yaml"
    key = _key(tenants, "shared", "--rpm", "30")
    other = _key(tenants, "other", "--rpm", "30")
    config = tmp_path / "gemel.yaml"
    config.write_text(
        "engine: {dtype: float32, kv_cache_memory_mb: 64}\n"
        "server: {stats_interval_s: 0.2, log_level: warning}\n"
        f"gateway: {{redis_url: '{redis_url}'}}\n"
    )
    servers = []
    try:
        for name in ("a", "b"):
            port = free_port()
            args = ["--config", str(config), "--tenants", str(tenants), "--host", "127.0.0.1", "--port", str(port),
                    "--no-embeddings", "--no-grpc"]
            servers.append(launch(args, port, tmp_path / f"{name}.log"))
        statuses = []
        start = time.monotonic()
        for i in range(60):
            r = httpx.post(servers[i % 2].url + COUNT, content=BODY, timeout=30,
                           headers={"x-goog-api-key": key, "content-type": "application/json"})
            statuses.append(r.status_code)
            if r.status_code == 429:
                refused = r
        elapsed = time.monotonic() - start
        # 30 at once, plus what the bucket refilled meanwhile (0.5 a second), not 30 per front end
        assert statuses[:30] == [200] * 30
        assert statuses.count(200) <= 30 + int(elapsed * 0.5) + 1 and statuses.count(429) >= 25, (elapsed, statuses)
        assert int(refused.headers["retry-after"]) >= 1 and refused.json()["error"]["status"] == "RESOURCE_EXHAUSTED"
        # another tenant's bucket is its own
        r = httpx.post(servers[1].url + COUNT, content=BODY, timeout=30,
                       headers={"x-goog-api-key": other, "content-type": "application/json"})
        assert r.status_code == 200
    finally:
        for s in servers:
            s.stop()
