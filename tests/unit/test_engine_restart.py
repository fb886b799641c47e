"""A dead or stalled engine is started again and its requests go on where they stopped.

The core takes a request's produced tokens as output (greedy and seeded sampling continue
exactly, penalties and grammars see them); ``AsyncLLM`` restarts its engine process after a
crash, a kill or a stall, within its restart budget, and resubmits every unfinished request.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from gemel import SamplingParams
from gemel.config import EngineConfig
from gemel.engine.async_llm import AsyncLLM, EngineDeadError
from gemel.engine.core import EngineCore
from gemel.engine.protocol import EngineCoreRequest
from gemel.engine.supervisor import RestartBudget, RestartPolicy, exit_reason

PROMPTS = [[5, 17, 33, 2, 9], [101, 7, 7, 64, 12, 3, 250, 8], [42] * 3, [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]


# -- the policy ---------------------------------------------------------------------------------------
def test_restart_budget_backs_off_and_runs_out():
    budget = RestartBudget(RestartPolicy(max_restarts=3, window_s=100, first_delay_s=0.5, max_delay_s=1.5))
    assert [budget.next_delay(t) for t in (0, 1, 2)] == [0.5, 1.0, 1.5]
    assert budget.next_delay(3) is None  # three in the window already
    assert budget.next_delay(101) == 1.5  # the first one has left the window: two remain in it
    assert RestartBudget(RestartPolicy(max_restarts=0)).next_delay(0) is None


def test_exit_reasons_name_the_signal():
    assert exit_reason(-signal.SIGKILL)[0] == "killed" and "kill -9" in exit_reason(-signal.SIGKILL)[1]
    assert exit_reason(-signal.SIGSEGV) == ("crash", "the engine process died of SIGSEGV")
    assert exit_reason(3) == ("crash", "the engine process exited with code 3")


# -- the core resumes a request from its produced tokens ---------------------------------------------
def _run(core: EngineCore, requests: list[EngineCoreRequest]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for r in requests:
        core.add_request(r)
    while core.has_unfinished():
        for o in core.step():
            out[o.request_id].extend(o.new_token_ids)
    return out


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, frequency_penalty=0.5, presence_penalty=0.3, max_tokens=20, ignore_eos=True),
    ],
    ids=["greedy", "seeded", "seeded-penalties"],
)
def test_a_resumed_request_continues_as_if_uninterrupted(tiny_llama_dir, params):
    config = EngineConfig(model=tiny_llama_dir, dtype="float32", block_size=4, num_kv_blocks=256)
    core = EngineCore(config)
    whole = _run(core, [EngineCoreRequest(f"r{i}", p, params, 0.0) for i, p in enumerate(PROMPTS)])
    assert all(len(t) == 20 for t in whole.values())
    fresh = EngineCore(config, loaded=core.loaded)  # a new engine: no KV, no generators
    cut = {f"r{i}": 3 + 4 * i for i in range(len(PROMPTS))}
    resumed = _run(
        fresh,
        [EngineCoreRequest(f"r{i}", p, params, 0.0, output_token_ids=whole[f"r{i}"][: cut[f"r{i}"]]) for i, p in enumerate(PROMPTS)],
    )
    for rid, tokens in whole.items():
        assert whole[rid][: cut[rid]] + resumed[rid] == tokens  # max_tokens counted the resumed tokens too


# -- AsyncLLM restarts its engine process ------------------------------------------------------------
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


async def _collect(engine: AsyncLLM, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    last = None
    async for out in engine.generate(rid, None, prompt, params):
        last = out
    return last.outputs[0].token_ids


async def _serve(config: EngineConfig, policy: RestartPolicy, during=None) -> tuple[AsyncLLM, list]:
    engine = AsyncLLM(config, stats_interval_s=0.1, log_level="warning", restart=policy)
    await engine.start()
    try:
        await engine.wait_ready(120)
        tasks = [asyncio.ensure_future(_collect(engine, f"q{i}", p, GREEDY)) for i, p in enumerate(PROMPTS)]
        if during is not None:
            await during(engine)
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 180)
        return engine, results
    finally:
        await engine.shutdown()


def _config(tiny_llama_dir, **kw) -> EngineConfig:
    return EngineConfig(model=tiny_llama_dir, dtype="float32", block_size=4, num_kv_blocks=256, num_threads=1, **kw)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> list[list[int]]:
    _, results = asyncio.run(_serve(_config(tiny_llama_dir), RestartPolicy(max_restarts=0)))
    assert all(len(r) == 40 for r in results)
    return results


@pytest.mark.parametrize("fault", ["crash_after_steps=6", "stall_after_steps=6"])
def test_injected_fault_is_survived_with_exact_outputs(tiny_llama_dir, reference, monkeypatch, fault):
    monkeypatch.setenv("GEMEL_FAULT_INJECTION", "1")
    # a short stall bound only where a stall is the fault: a slow step on a busy machine is not one
    policy = RestartPolicy(max_restarts=3, stall_s=3.0 if fault.startswith("stall") else 60.0, first_delay_s=0.1)
    engine, results = asyncio.run(_serve(_config(tiny_llama_dir, fault_injection=fault), policy))
    assert results == reference
    assert engine.restarts == ({"killed": 1} if fault.startswith("crash") else {"stall": 1})


def test_engine_process_backs_large_tensors_with_huge_pages(tiny_llama_dir, reference, monkeypatch):
    """PyTorch's CPU allocator is asked for huge pages in the engine process: fresh logits of
    tens of MB are otherwise faulted in 4 KB at a time every step."""
    if not os.path.exists("/proc/self/environ"):
        pytest.skip("reads the engine process's environment from /proc (Linux)")
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "unset")  # so that the test's end restores the variable's absence
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE")
    seen: dict[bytes, bytes] = {}

    async def read_environment(engine: AsyncLLM) -> None:
        with open(f"/proc/{engine._proc.pid}/environ", "rb") as f:
            seen.update(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)

    _, results = asyncio.run(_serve(_config(tiny_llama_dir), RestartPolicy(max_restarts=0), during=read_environment))
    assert results == reference
    assert seen.get(b"THP_MEM_ALLOC_ENABLE") == b"1"


def test_fault_injection_needs_its_environment_variable(tiny_llama_dir, reference, monkeypatch):
    monkeypatch.delenv("GEMEL_FAULT_INJECTION", raising=False)
    engine, results = asyncio.run(_serve(_config(tiny_llama_dir, fault_injection="crash_after_steps=2"), RestartPolicy()))
    assert results == reference and engine.restarts == {}


def test_kill_9_then_give_up_past_the_budget(tiny_llama_dir, reference):
    """The first death is restarted; a second within the window (budget 1) fails the model and
    the request held for it, at once, instead of hanging. (The tiny model decodes thousands of
    tokens a second, so the request is submitted while the engine restarts: it cannot finish
    before the second kill.)"""
    long = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)

    async def scenario():
        engine = AsyncLLM(_config(tiny_llama_dir, max_model_len=4096), stats_interval_s=0.1, log_level="warning",
                          restart=RestartPolicy(max_restarts=1, first_delay_s=0.5))
        await engine.start()
        try:
            await engine.wait_ready(120)
            first = engine.pid
            os.kill(first, signal.SIGKILL)
            while engine.state != "restarting":
                await asyncio.sleep(0.01)
            task = asyncio.ensure_future(_collect(engine, "long", PROMPTS[0], long))  # held for the new engine
            while engine.pid == first:  # a new engine process started
                await asyncio.sleep(0.01)
            os.kill(engine.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="restarted 1 times"):
                await asyncio.wait_for(task, 60)
            assert engine.state == "failed" and engine.restarts == {"killed": 1}
            with pytest.raises(EngineDeadError):
                await engine.wait_ready(1)
        finally:
            await engine.shutdown()

    asyncio.run(scenario())
