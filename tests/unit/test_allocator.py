"""The engine process's memory allocator (gemel/engine/allocator.py): jemalloc preloaded for
the engine process alone where the machine has it, the front end's own environment untouched."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from gemel.config import EngineConfig
from gemel.engine import allocator
from gemel.engine.async_llm import AsyncLLM

JEMALLOC = allocator.find_jemalloc()
PRINT_ALLOCATOR = [sys.executable, "-c", "from gemel.engine.allocator import in_use; print(in_use())"]


def test_a_found_library_is_a_jemalloc_file():
    if JEMALLOC is None:
        pytest.skip("no jemalloc on this machine (nor in Ray's wheel)")
    assert os.path.isfile(JEMALLOC) and "jemalloc" in os.path.basename(JEMALLOC)


@pytest.mark.parametrize("before", [None, "/opt/other/libfoo.so"])
def test_the_preload_is_set_for_the_block_alone(monkeypatch, before):
    monkeypatch.setattr(allocator, "find_jemalloc", lambda: "/opt/je/libjemalloc.so.2")
    if before is None:
        monkeypatch.delenv("LD_PRELOAD", raising=False)
    else:
        monkeypatch.setenv("LD_PRELOAD", before)
    with allocator.preloaded_for_child("auto") as added:
        assert added == "/opt/je/libjemalloc.so.2"
        assert os.environ["LD_PRELOAD"] == (added if before is None else f"{added}:{before}")
    assert os.environ.get("LD_PRELOAD") == before
    with allocator.preloaded_for_child("system") as added:  # the C library's malloc asked for
        assert added is None and os.environ.get("LD_PRELOAD") == before


def test_an_allocator_the_user_preloaded_is_left_alone(monkeypatch):
    monkeypatch.setattr(allocator, "find_jemalloc", lambda: "/opt/je/libjemalloc.so.2")
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libtcmalloc_minimal.so.4")
    with allocator.preloaded_for_child("auto") as added:
        assert added is None and os.environ["LD_PRELOAD"] == "/usr/lib/libtcmalloc_minimal.so.4"


def test_a_child_started_in_the_block_runs_on_jemalloc(monkeypatch):
    if JEMALLOC is None:
        pytest.skip("no jemalloc on this machine (nor in Ray's wheel)")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    with allocator.preloaded_for_child("auto"):
        inside = subprocess.run(PRINT_ALLOCATOR, capture_output=True, text=True, timeout=120, check=True).stdout.strip()
    outside = subprocess.run(PRINT_ALLOCATOR, capture_output=True, text=True, timeout=120, check=True).stdout.strip()
    assert os.path.realpath(inside) == os.path.realpath(JEMALLOC)
    assert outside == "glibc malloc"


@pytest.mark.parametrize("setting", ["auto", "system"])
def test_the_served_engine_process_runs_on_the_allocator_asked_for(tiny_llama_dir, monkeypatch, setting):
    if JEMALLOC is None and setting == "auto":
        pytest.skip("no jemalloc on this machine (nor in Ray's wheel)")
    monkeypatch.delenv("LD_PRELOAD", raising=False)

    async def scenario() -> str:
        engine = AsyncLLM(EngineConfig(model=tiny_llama_dir, num_kv_blocks=64, memory_allocator=setting),
                          log_level="warning")
        await engine.start()
        try:
            await engine.wait_ready(120)
            with open(f"/proc/{engine.pid}/maps") as maps:
                return maps.read()
        finally:
            await engine.shutdown()

    maps = asyncio.run(scenario())
    assert ("jemalloc" in maps) == (setting == "auto")
    assert "LD_PRELOAD" not in os.environ  # the front end's own environment is as it was
