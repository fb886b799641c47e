"""The KV tier behind the prefix cache: evicted blocks kept in host memory and on disk, loaded
back instead of recomputed, valid across engine restarts, and never served when stale or
corrupt."""

from __future__ import annotations

import random

import pytest
import torch

from gemel import SamplingParams
from gemel.config import EngineConfig, KVOffloadConfig
from gemel.engine.core import EngineCore
from gemel.engine.kv_tier import KVTier
from gemel.engine.protocol import EngineCoreRequest


def _block(seed: int) -> torch.Tensor:
    return torch.randn(2, 2, 1, 4, 8, generator=torch.Generator().manual_seed(seed))  # 512 bytes of float32


def test_host_tier_writes_through_to_disk_and_both_stay_bounded(tmp_path):
    tier = KVTier(cpu_bytes=2 * 512, disk_dir=str(tmp_path), disk_bytes=3 * 700, model_fingerprint="m1")  # a file: 512 bytes and its header
    for i in range(8):
        tier.put(100 + i, (i,), _block(i))
    tier.flush()
    assert list(tier.host) == [106, 107]  # the two most recent stay in memory
    assert len(tier.disk) == 3 and tier.disk_used <= 3 * 700  # the disk keeps the newest spills only
    assert tier.get(101, (1,)) is None  # evicted from both
    data, source = tier.get(105, (5,))
    assert source == "disk" and torch.equal(data, _block(5))
    data, source = tier.get(107, (7,))
    assert source == "host" and torch.equal(data, _block(7))
    assert tier.get(107, (8,)) is None  # other tokens under the same hash: a collision, not a hit


def test_disk_tier_survives_a_new_process_and_rejects_bad_files(tmp_path):
    tier = KVTier(cpu_bytes=0, disk_dir=str(tmp_path), disk_bytes=1 << 20, model_fingerprint="m1")
    for i in range(3):
        tier.put(-5 - i, (i, i), _block(i))  # negative hashes too: Python hashes are signed
    tier.flush()
    again = KVTier(cpu_bytes=0, disk_dir=str(tmp_path), disk_bytes=1 << 20, model_fingerprint="m1")
    assert torch.equal(again.get(-5, (0, 0))[0], _block(0))
    # a flipped payload byte, a truncated file: ignored and deleted
    paths = sorted(again.dir.iterdir())
    raw = bytearray(paths[1].read_bytes())
    raw[-3] ^= 0xFF
    paths[1].write_bytes(bytes(raw))
    paths[2].write_bytes(paths[2].read_bytes()[:40])
    hashes = {p: h for h in (-5, -6, -7) for p in paths if p == again._path(h)}
    for p in paths[1:]:
        h = hashes[p]
        assert again.get(h, (-h - 5, -h - 5)) is None and not p.exists()
    assert again.stats.rejected_files == 2
    # another model's tier never sees these files
    other = KVTier(cpu_bytes=0, disk_dir=str(tmp_path), disk_bytes=1 << 20, model_fingerprint="m2")
    assert not other.has(-5)


# -- the engine loads tier hits instead of recomputing ------------------------------------------------
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
_rng = random.Random(5)
LONG = [_rng.randrange(3, 300) for _ in range(200)]
OTHERS = [[_rng.randrange(3, 300) for _ in range(120)] for _ in range(4)]


def _core(tiny_llama_dir, offload: KVOffloadConfig | None) -> EngineCore:
    # 64 blocks of 4 tokens: the long prompt's 50 blocks are evicted by the other prompts
    return EngineCore(EngineConfig(model=tiny_llama_dir, dtype="float32", block_size=4, num_kv_blocks=64, kv_offload=offload))


def _generate(core: EngineCore, rid: str, prompt: list[int]) -> tuple[list[int], int, int]:
    core.add_request(EngineCoreRequest(rid, prompt, GREEDY, 0.0))
    tokens, cached, tier = [], 0, 0
    while core.has_unfinished():
        for out in core.step():
            tokens += out.new_token_ids
            cached, tier = max(cached, out.num_cached_tokens), max(tier, out.num_tier_tokens)
    return tokens, cached, tier


def _evict_long(core: EngineCore) -> None:
    for i, p in enumerate(OTHERS):
        _generate(core, f"other{i}", p)


@pytest.fixture(scope="module")
def cold(tiny_llama_dir) -> list[int]:
    tokens, cached, _ = _generate(_core(tiny_llama_dir, None), "cold", LONG)
    assert cached == 0
    return tokens


def test_host_tier_hit_after_eviction(tiny_llama_dir, cold):
    core = _core(tiny_llama_dir, KVOffloadConfig(cpu_mb=64))
    assert _generate(core, "first", LONG)[0] == cold
    _evict_long(core)
    tokens, cached, tier = _generate(core, "again", LONG)
    assert tokens == cold  # greedy output identical to the cold run
    assert cached >= 192 and tier > 0  # most of the prompt came back, some of it from host memory
    stats = core.stats()
    assert stats.kv_tier_host_hits > 0 and stats.kv_tier_bytes_loaded > 0 and stats.kv_tier_bytes_saved > 0


def test_without_the_tier_eviction_means_recompute(tiny_llama_dir, cold):
    core = _core(tiny_llama_dir, None)
    _generate(core, "first", LONG)
    _evict_long(core)
    tokens, cached, tier = _generate(core, "again", LONG)
    assert tokens == cold and tier == 0 and cached < 192


def test_disk_tier_serves_a_restarted_engine(tiny_llama_dir, cold, tmp_path):
    offload = KVOffloadConfig(cpu_mb=0, disk_dir=str(tmp_path), disk_gb=1)
    core = _core(tiny_llama_dir, offload)
    _generate(core, "first", LONG)
    _evict_long(core)
    core.kv_tier.flush()
    del core
    restarted = _core(tiny_llama_dir, offload)  # a new engine: empty pool, the files on disk
    tokens, cached, tier = _generate(restarted, "again", LONG)
    assert tokens == cold
    assert tier >= 192 and restarted.stats().kv_tier_disk_hits >= 48
    # another tenant's prompt with the same tokens never reads these blocks
    restarted.add_request(EngineCoreRequest("tenant-b", LONG, GREEDY, 0.0, tenant="b"))
    hits = restarted.kv_tier.stats.disk_hits
    while restarted.has_unfinished():
        restarted.step()
    assert restarted.kv_tier.stats.disk_hits == hits
