"""A long prompt evicted from the KV pool by other traffic comes back from the KV tier, and
from the disk tier after `gemel serve` restarts, with the same greedy answer as the cold run."""

from __future__ import annotations

import random

import httpx
import pytest

from conftest import start_server

pytestmark = pytest.mark.slow

WORDS = "river stone lantern orchard harbor meadow quartz violet ember canyon willow signal".split()


def _text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _complete(url: str, prompt: str) -> tuple[str, int]:
    body = {"model": "gpt-4o-mini", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["choices"][0]["text"], out["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)


def test_long_prompt_returns_from_host_and_disk_tiers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kvtier")
    disk = tmp / "kv"
    # a pool of about 4,400 tokens (float32 SmolLM2: 45 KiB a token): the long prompt fits, then others push it out
    config = f"engine:\n  kv_cache_memory_mb: 192\n  kv_offload: {{cpu_mb: 64, disk_dir: '{disk}', disk_gb: 1}}\n"
    long_prompt = _text(1, 2500)
    srv = start_server(tmp, name="tier1", extra_config=config + "embeddings: null\n")
    try:
        cold, cached = _complete(srv.url, long_prompt)
        assert cached == 0
        for seed in range(2, 6):  # other long prompts evict the first one's blocks
            _complete(srv.url, _text(seed, 2500))
        again, cached = _complete(srv.url, long_prompt)
        assert again == cold and cached > 2000  # most of the prompt came back instead of being recomputed
        metrics = httpx.get(f"{srv.url}/metrics", timeout=10).text
        assert 'gemel:kv_tier_hits_total{model_name="smollm2-135m-instruct",tier="host"}' in metrics
    finally:
        srv.stop()
    assert any(disk.rglob("*.kvb"))  # what host memory could not hold went to disk
    srv = start_server(tmp, name="tier2", extra_config=config + "embeddings: null\n")
    try:
        after_restart, cached = _complete(srv.url, long_prompt)
        assert after_restart == cold and cached > 2000
    finally:
        srv.stop()
