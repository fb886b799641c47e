"""A decode step's layers in one C++ call (``layers/decode_layers.py``) against the Python
fused path it replaces, on both packaged models with the plan of the AVX2 class and of
AVX-512 CPUs without AMX (every projection on int8_act_gemm over the file's own blocks, float16
KV cache; Gemma 3 with its sliding windows), on this process's build and on the AVX2 one: the
same kernels in the same order, so the same tokens and log-probabilities bit for bit. Agreement with transformers is test_real_models' kernel-path test, which takes it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gemel import LLM, SamplingParams
from gemel.engine.model_runner import ModelRunner
from gemel.layers import cpu_kernels, decode_layers, kernel_plan

PROMPTS = [[1000 + i] + list(range(200 + 7 * i, 240 + 7 * i)) for i in range(3)] + [[1000] + list(range(200, 240)) + [5]]


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    if kernel_plan.isa_rank(kernel_plan.resolve_isa()) < kernel_plan.isa_rank("avx2") or not cpu_kernels.load():
        pytest.skip("needs an AVX2 CPU and the C++ kernels")


def count_whole_steps(monkeypatch) -> list[bool]:
    """From now on, whether each step took the layers' one C++ call, appended step by step."""
    taken: list[bool] = []
    real = decode_layers.for_step

    def counting(*args, **kwargs):
        program = real(*args, **kwargs)
        taken.append(program is not None)
        return program

    monkeypatch.setattr(decode_layers, "for_step", counting)
    return taken


def assert_python_path_equal(llm, prompts, params, whole, monkeypatch) -> None:
    """The same requests on the Python path (the C++ layers refused): the same tokens and
    log-probabilities bit for bit as ``whole``."""
    counting = decode_layers.for_step
    monkeypatch.setattr(decode_layers, "for_step", lambda *a, **k: None)
    python = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    monkeypatch.setattr(decode_layers, "for_step", counting)
    for a, b in zip(whole, python):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [lp.logprob for lp in a.outputs[0].logprobs] == [lp.logprob for lp in b.outputs[0].logprobs]


@pytest.mark.parametrize("model", ["smollm2-135m-instruct", "gemma3-270m"])
def test_whole_step_equals_the_python_path(model, monkeypatch):
    llm = LLM(model, cpu_isa="avx2", kv_cache_memory_mb=128)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    taken = count_whole_steps(monkeypatch)
    whole = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    assert any(taken), "no decode step took the C++ layers"
    assert not all(taken), "steps with a prompt chunk take the Python path"
    assert_python_path_equal(llm, PROMPTS, params, whole, monkeypatch)


def test_decodes_of_very_different_contexts_take_it(monkeypatch):
    """A 900-token context among short ones stays in the step's one attention group (the
    kernel reads each context to its own length), so the step still takes the C++ layers,
    with the Python path's tokens and log-probabilities bit for bit."""
    prompts = [list(range(200, 1100))] + PROMPTS[:3]
    llm = LLM("smollm2-135m-instruct", cpu_isa="avx2", kv_cache_memory_mb=128)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    taken = count_whole_steps(monkeypatch)
    whole = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert sum(taken) >= 8, taken  # the steps after the long prompt's prefill
    assert_python_path_equal(llm, prompts, params, whole, monkeypatch)


def test_whole_step_on_the_avx2_build():
    """Where this process runs a higher build (the AVX-512 tiles), the test above once more
    against the AVX2 build, whose 5- and 6-bit tiles Gemma 3's blocks take, in a process of its
    own (a process holds one build)."""
    if cpu_kernels.loaded_isa() == "avx2":
        pytest.skip("this process runs the AVX2 build: the test above covered it")
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"{Path(__file__).relative_to(root)}::test_whole_step_equals_the_python_path"],
        cwd=root, env=dict(os.environ, GEMEL_CPU_ISA="avx2"), capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0 and "2 passed" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]


def test_other_plans_and_steps_take_the_python_path(monkeypatch):
    """Dense float32 projections never build it. With the AVX2 plan, a batch sharing a cached
    prefix of 256 tokens or more takes it too (the decode kernel reads the shared blocks in
    place; nothing is cascaded), with the same tokens and log-probabilities bit for bit as the
    Python path on the same batch; with the decode kernel off the batch is cascaded and every
    step takes the Python path. (Against each prompt run alone the tokens may part at a near-tie:
    one sequence's decode attention alone splits its keys across the threads.)"""
    dense = LLM("smollm2-135m-instruct", dtype="float32", weight_quant="none", kv_cache_memory_mb=128)
    dense.generate(prompt_token_ids=PROMPTS[:1], sampling_params=SamplingParams(max_tokens=3))
    assert getattr(dense.engine.core.runner.model, "_decode_layers", None) in (None, False)
    shared = [list(range(300, 300 + 288)) + [7 + i] for i in range(4)]  # 18 full blocks in common
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    taken, cascaded = count_whole_steps(monkeypatch), []
    real_group = ModelRunner._decode_group

    def recording(self, *args, **kwargs):
        group = real_group(self, *args, **kwargs)
        cascaded.append(group.shared_slots is not None)
        return group

    monkeypatch.setattr(ModelRunner, "_decode_group", recording)
    for kernel in (True, False):
        llm = LLM("smollm2-135m-instruct", cpu_isa="avx2", kv_cache_memory_mb=128, cpu_attention_kernel=kernel)
        llm.generate(prompt_token_ids=shared[:1], sampling_params=params)  # caches the prefix
        taken.clear()
        cascaded.clear()
        together = llm.generate(prompt_token_ids=shared, sampling_params=params)
        assert any(taken) == kernel and any(cascaded) != kernel
        if kernel:
            assert_python_path_equal(llm, shared, params, together, monkeypatch)


@pytest.mark.parametrize("dot_products", [True, False], ids=["dot-products", "armv8.0"])
def test_the_arm_plan_runs_the_same_engine(monkeypatch, dot_products):
    """What a 64-bit ARM CPU runs (the portable level with its NEON tiles, on sdot where the CPU
    has dot products: every projection on int8_act_gemm, the float16 KV cache, the layers in one
    C++ call), here with this process's kernels in place of the ARM build's: the same tokens and
    log-probabilities bit for bit as this CPU's own plan, so nothing above the kernels depends on
    the x86 levels. The tiles themselves are tests/unit/test_neon_tiles.py's."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    own = LLM("smollm2-135m-instruct", kv_cache_memory_mb=128).generate(prompt_token_ids=PROMPTS, sampling_params=params)
    monkeypatch.delenv("GEMEL_CPU_ISA", raising=False)
    flags = {"fp", "asimd", "asimddp"} if dot_products else {"fp", "asimd"}
    arm = kernel_plan.CpuInfo(model="an ARM CPU", machine="aarch64", flags=frozenset(flags))
    monkeypatch.setattr(kernel_plan, "cpu_info", lambda: arm)
    monkeypatch.setattr(cpu_kernels, "built_features", lambda: ["neon", "neondot"] if dot_products else ["neon"])
    llm = LLM("smollm2-135m-instruct", kv_cache_memory_mb=128)
    plan = llm.engine.core.plan
    assert plan.isa == "portable" and plan.int8_activations and plan.int8_act_max_rows is None
    assert (plan.arm_dot, plan.arm_neon) == (dot_products, not dot_products)
    ran = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    assert isinstance(llm.engine.core.runner.model._decode_layers, decode_layers.DecodeLayers)
    for a, b in zip(ran, own):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [lp.logprob for lp in a.outputs[0].logprobs] == [lp.logprob for lp in b.outputs[0].logprobs]
