"""A long prompt evicted from the KV pool by other traffic comes back from the KV tier, and
from the disk tier after `gemel serve` restarts, with the same greedy answer as the cold run."""

from __future__ import annotations

import random

import httpx
import pytest

from conftest import start_server

pytestmark = pytest.mark.slow

SENTENCES = [
    "The harbor town woke early, and the fishing boats left before the sun was up.",
    "Maria kept a small bakery on the corner, famous for its rye bread and honey cakes.",
    "Every spring the river flooded the lower fields, so the farmers planted late.",
    "The old lighthouse had been automated decades ago, but a keeper still lived there.",
    "Children walked to the school on the hill along a path lined with chestnut trees.",
    "On market days the square filled with stalls selling cheese, apples and wool.",
    "The mayor, a patient man, spent most evenings answering letters by hand.",
    "A new railway line reached the town in the autumn and changed its rhythm.",
    "Tourists came for the cliffs, the seabirds and the long walks along the coast.",
    "In winter the storms were strong enough to keep every boat in the harbor for days.",
]


def _text(seed: int, sentences: int) -> str:
    """A long, natural prompt (a greedy answer to it has clear margins), different per seed."""
    rng = random.Random(seed)
    story = " ".join(rng.choice(SENTENCES) for _ in range(sentences))
    return f"Story {seed}: {story}\n\nQuestion: what is the name of the baker in the story?\nAnswer:"


def _complete(url: str, prompt: str) -> tuple[str, int]:
    body = {"model": "gpt-4o-mini", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["choices"][0]["text"], out["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)


def test_long_prompt_returns_from_host_and_disk_tiers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kvtier")
    disk = tmp / "kv"
    # a pool of about 2,200 tokens (float32 SmolLM2: 45 KiB a token): the long prompt fits, then others push it out
    config = f"engine:\n  dtype: float32\n  max_num_batched_tokens: 512\n  kv_cache_memory_mb: 96\n  kv_offload: {{cpu_mb: 64, disk_dir: '{disk}', disk_gb: 1}}\n"
    long_prompt = _text(1, 80)
    srv = start_server(tmp, name="tier1", extra_config=config + "embeddings: null\n")
    try:
        cold, cached = _complete(srv.url, long_prompt)
        assert cached == 0
        for seed in range(2, 5):  # other long prompts evict the first one's blocks
            _complete(srv.url, _text(seed, 80))
        again, cached = _complete(srv.url, long_prompt)
        assert again == cold and cached > 1000  # most of the prompt came back instead of being recomputed
        metrics = httpx.get(f"{srv.url}/metrics", timeout=10).text
        assert 'gemel:kv_tier_hits_total{model_name="smollm2-135m-instruct",tier="host"}' in metrics
    finally:
        srv.stop()
    assert any(disk.rglob("*.kvb"))  # what host memory could not hold went to disk
    srv = start_server(tmp, name="tier2", extra_config=config + "embeddings: null\n")
    try:
        after_restart, cached = _complete(srv.url, long_prompt)
        assert after_restart == cold and cached > 1000
    finally:
        srv.stop()
