"""The kernel plan: instruction-set levels from CPU flags, the level a process may be forced
to, the compiler flags per level, and which kernel serves each call size for each CPU class."""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from gemel.layers import cpu_kernels, kernel_plan
from gemel.layers.kernel_plan import CpuInfo, plan_engine, resolve_isa

AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16"}
AMX = AVX512 | {"amx_tile", "amx_bf16", "amx_int8"}


@pytest.fixture(autouse=True)
def _kernels_of_this_cpu():
    """The process keeps the first level it loads: load the CPU's own before a plan asks for a
    lower one, so the tests after these still run this CPU's kernels."""
    cpu_kernels.load()


def cpu(flags: frozenset[str], machine: str = "x86_64") -> CpuInfo:
    return CpuInfo(model="test CPU", machine=machine, flags=frozenset(flags))


@pytest.mark.parametrize(
    "flags, machine, level",
    [
        (AMX, "x86_64", "amx"),
        (AVX512, "x86_64", "avx512"),
        (AVX512 - {"avx512_vnni", "avx512_bf16"}, "x86_64", "avx512"),  # Skylake-X
        (AVX2, "x86_64", "avx2"),  # AMD Zen 3
        (AVX2 - {"fma"}, "x86_64", "portable"),
        (frozenset({"sse2"}), "x86_64", "portable"),
        (frozenset({"fp", "asimd", "asimddp"}), "aarch64", "portable"),
        (AMX, "aarch64", "portable"),  # flags of another architecture never count
    ],
)
def test_best_level_from_the_flags(flags, machine, level):
    assert cpu(flags, machine).best_isa == level


def test_a_ceiling_lowers_the_level_and_more_than_the_cpu_has_is_refused(monkeypatch):
    monkeypatch.delenv("GEMEL_CPU_ISA", raising=False)
    amx = cpu(AMX)
    assert resolve_isa("auto", amx) == "amx"
    assert resolve_isa("avx2", amx) == "avx2"
    assert resolve_isa("portable", amx) == "portable"
    monkeypatch.setenv("GEMEL_CPU_ISA", "avx512")  # a process-wide cap, under the engine's own
    assert resolve_isa("auto", amx) == "avx512"
    assert resolve_isa("avx2", amx) == "avx2"
    monkeypatch.delenv("GEMEL_CPU_ISA")
    with pytest.raises(ValueError, match="cpu_isa=avx512 needs a CPU with AVX512.*runs up to avx2"):
        resolve_isa("avx512", cpu(AVX2))
    with pytest.raises(ValueError, match="cpu_isa must be one of"):
        resolve_isa("sse9", amx)
    monkeypatch.setenv("GEMEL_CPU_ISA", "amx")
    with pytest.raises(ValueError, match="GEMEL_CPU_ISA=amx"):
        resolve_isa("auto", cpu(AVX2))


def test_compile_flags_per_level():
    amx = cpu(AMX)
    assert kernel_plan.compile_flags("amx", amx) == ["-march=native"]  # the CPU's own level
    assert kernel_plan.compile_flags("avx512", amx) == ["-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"]
    assert kernel_plan.compile_flags("avx2", amx) == ["-march=x86-64-v3"]
    assert kernel_plan.compile_flags("portable", amx) == ["-march=x86-64", "-mtune=generic"]
    assert kernel_plan.compile_flags("portable", cpu(frozenset({"asimd"}), "aarch64")) == []
    assert kernel_plan.compile_flags("portable", cpu(frozenset({"asimd", "asimddp"}), "aarch64")) == [
        "-march=armv8.2-a+dotprod"]
    with pytest.raises(ValueError):
        kernel_plan.compile_flags("amx", cpu(AVX2))


ARM_CXX = shutil.which("aarch64-linux-gnu-g++")
EM_AARCH64 = 183  # an ELF header's e_machine for 64-bit ARM


@pytest.mark.slow
@pytest.mark.skipif(ARM_CXX is None, reason="no aarch64-linux-gnu-g++ (scripts/install.sh installs it as root)")
def test_the_portable_level_builds_for_arm(tmp_path):
    """Every kernel source compiles for 64-bit ARM at the portable level, with the flags a
    build on an ARM CPU uses (no x86 intrinsic, header or flag outside its guards), and the
    objects link into one library with the build's own system libraries (the link once asked
    for glibc's vector maths on every machine; Debian 12's ARM glibc, 2.36, has none). PyTorch's
    libraries are left out of the link (they would be ARM's), and nothing is run. A CPU with
    dot products gets int8_act_gemm's sdot tiles; an Armv8.0 one (its build compiled for that
    file alone, the only one whose code differs) the widening-multiply tiles."""
    arm = cpu(frozenset({"fp", "asimd", "asimddp"}), "aarch64")
    flags = cpu_kernels.source_flags("portable", arm)
    assert not any(f.startswith(("-march=x86", "-mtune", "-mavx")) for f in flags)
    assert "-march=armv8.2-a+dotprod" in flags

    def compile_one(source):
        obj = tmp_path / f"{source.stem}.o"
        result = subprocess.run([ARM_CXX, "-c", str(source), "-o", str(obj), *flags], capture_output=True, text=True)
        return source.name, result.returncode, result.stderr[-1500:], obj

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        built = list(pool.map(compile_one, cpu_kernels.SOURCES))
    failed = {name: err for name, code, err, _ in built if code != 0}
    assert not failed, failed
    for name, _, _, obj in built:
        header = obj.read_bytes()[:20]
        assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == EM_AARCH64, name
    library = tmp_path / "gemel_cpu_kernels.so"
    link = subprocess.run([ARM_CXX, *(str(obj) for *_, obj in built), "-o", str(library), "-shared", "-fopenmp",
                           *cpu_kernels.vector_math_flags(ARM_CXX)], capture_output=True, text=True)
    assert link.returncode == 0, link.stderr[-1500:]
    objdump = shutil.which("aarch64-linux-gnu-objdump")
    armv80_flags = cpu_kernels.source_flags("portable", cpu(frozenset({"fp", "asimd"}), "aarch64"))
    assert not any(f.startswith("-march") for f in armv80_flags)
    armv80 = tmp_path / "armv8.0"
    armv80.mkdir()
    gemm = next(source for source in cpu_kernels.SOURCES if source.name == "int8_act_gemm.cpp")
    result = subprocess.run([ARM_CXX, "-c", str(gemm), "-o", str(armv80 / "int8_act_gemm.o"), *armv80_flags],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-1500:]
    if objdump is not None:  # int8_act_gemm took the NEON tiles, not the portable loops
        for obj, dot_products in ((tmp_path / "int8_act_gemm.o", True), (armv80 / "int8_act_gemm.o", False)):
            code = subprocess.run([objdump, "-d", str(obj)], capture_output=True, text=True, check=True).stdout
            assert ("sdot" in code) == dot_products
            assert dot_products or ("smlal2" in code and "sadalp" in code)
    nm = shutil.which("aarch64-linux-gnu-nm")
    if nm is not None and not cpu_kernels.vector_math_flags(ARM_CXX):
        undefined = subprocess.run([nm, "-u", str(library)], capture_output=True, text=True, check=True).stdout
        assert "_ZGV" not in undefined  # no vector maths call left without its library


def test_native_bf16_only_where_the_level_computes_it():
    assert kernel_plan.native_bf16("amx", cpu(AMX))
    assert kernel_plan.native_bf16("avx512", cpu(AVX512))
    assert not kernel_plan.native_bf16("avx512", cpu(AVX512 - {"avx512_bf16"}))
    assert not kernel_plan.native_bf16("avx2", cpu(AMX))  # forced down: the AVX2 class has no bf16


def test_dtype_auto_per_cpu_class_and_checkpoint():
    """bf16 where the CPU computes it natively, except below AMX for a checkpoint stored in
    groups with the integer kernels loaded: float32 then, every call on int8_act_gemm."""
    auto = kernel_plan.auto_dtype_is_bf16
    assert auto("amx", weight_groups=True, integer_kernels=True, cpu=cpu(AMX))  # AMX tiles for prefill
    assert not auto("avx512", weight_groups=True, integer_kernels=True, cpu=cpu(AVX512))  # Zen 4/5
    assert auto("avx512", weight_groups=False, integer_kernels=True, cpu=cpu(AVX512))  # dense weights
    assert auto("avx512", weight_groups=True, integer_kernels=False, cpu=cpu(AVX512))  # no kernels built
    assert auto("amx", weight_groups=False, integer_kernels=False, cpu=cpu(AMX))
    assert not auto("avx512", weight_groups=False, integer_kernels=True, cpu=cpu(AVX512 - {"avx512_bf16"}))
    assert not auto("avx2", weight_groups=False, integer_kernels=False, cpu=cpu(AVX2))


def test_engines_choose_the_dtype_from_the_checkpoint(tiny_llama_dir, monkeypatch):
    """On this CPU, at its own level and at AVX2: a GGUF of quantised groups (SmolLM2) computes
    in float32 on the integer kernel below AMX; dense weights (an HF directory) in bf16 where
    the CPU has it natively."""
    import gemel.platform as platform_
    from gemel.loader.model_loader import stores_weight_groups

    monkeypatch.delenv("GEMEL_CPU_ISA", raising=False)
    assert stores_weight_groups("smollm2-135m-instruct") and not stores_weight_groups(tiny_llama_dir)
    level = resolve_isa()
    native = kernel_plan.native_bf16(level)
    cpu_device = torch.device("cpu")
    dense = platform_.select_dtype("auto", cpu_device, weight_groups=lambda: False)
    assert dense == (torch.bfloat16 if native else torch.float32)
    grouped = platform_.select_dtype("auto", cpu_device, weight_groups=lambda: True)
    kernels = kernel_plan.isa_rank(level) >= kernel_plan.isa_rank("avx2") and cpu_kernels.load()
    assert grouped == (torch.bfloat16 if native and (level == "amx" or not kernels) else torch.float32)
    assert platform_.select_dtype("bfloat16", cpu_device, weight_groups=lambda: True) == torch.bfloat16  # as asked

    def unread():
        raise AssertionError("the checkpoint is read only where it decides the dtype")

    if kernel_plan.isa_rank(level) >= kernel_plan.isa_rank("avx2"):
        assert platform_.select_dtype("auto", cpu_device, "avx2", weight_groups=unread) == torch.float32
    if level == "amx":
        assert platform_.select_dtype("auto", cpu_device, weight_groups=unread) == torch.bfloat16


def _plan(dtype, dtype_requested="auto", weight_quant="auto", cpu_isa="auto", **kw):
    return plan_engine(device=torch.device("cpu"), dtype=dtype, dtype_requested=dtype_requested,
                       weight_quant=weight_quant, cpu_isa=cpu_isa, **kw)


def test_the_avx2_plan_runs_every_call_on_the_integer_kernel():
    """float32 chosen automatically (a CPU without native bf16): the checkpoint's groups with x
    as int8 at every call size, nothing else; float32 asked for by name keeps the exact dense sums."""
    if kernel_plan.isa_rank(resolve_isa()) < kernel_plan.isa_rank("avx2"):
        pytest.skip("needs an AVX2 CPU (or a process not capped below it)")
    plan, _ = _plan(torch.float32, cpu_isa="avx2")
    assert cpu_kernels.load()
    assert plan.isa == "avx2" and plan.kernels
    assert plan.weight_quant == "checkpoint" and plan.packed_max_rows == 0
    assert plan.int8_activations and plan.int8_act_max_rows is None
    assert not plan.int4_integer_kernel and plan.amx_max_rows == 0 and not plan.prepack_bf16
    assert [(rows, kernel.split()[0]) for rows, kernel in plan.rows_table()] == [("1+", "int8_act_gemm")]
    assert "decode steps: all layers in one C++ call" in plan.describe()
    exact, _ = _plan(torch.float32, dtype_requested="float32", cpu_isa="avx2")
    assert "one C++ call" not in exact.describe()
    assert exact.weight_quant == "none" and not exact.int8_activations
    assert [r for r, _ in exact.rows_table()] == ["1+"]
    portable, _ = _plan(torch.float32, cpu_isa="portable")  # no fast integer path: the dense weights
    assert portable.weight_quant == "none" and not portable.int8_activations


def test_a_64_bit_arm_cpu_runs_every_call_on_the_integer_kernel(monkeypatch):
    """64-bit ARM runs the portable level, whose int8_act_gemm has NEON tiles: on the dot-product
    extension where the build has it (kernel_isa names "neondot"), on widening multiplies on an
    Armv8.0 core; the plan takes them at every call size either way, as the AVX2 plan does.
    32-bit ARM (NEON, but no such tiles) and an x86 portable build keep the dense weights."""
    monkeypatch.delenv("GEMEL_CPU_ISA", raising=False)
    arm = cpu(frozenset({"fp", "asimd", "asimddp"}), "aarch64")
    monkeypatch.setattr(kernel_plan, "cpu_info", lambda: arm)
    monkeypatch.setattr(cpu_kernels, "built_features", lambda: ["neon", "neondot"])
    plan, _ = _plan(torch.float32)
    assert plan.isa == "portable" and plan.arm_dot and not plan.avx_vnni
    assert plan.weight_quant == "checkpoint" and plan.int8_activations and plan.int8_act_max_rows is None
    assert plan.kv_dtype == torch.float16 and not plan.int4_integer_kernel
    assert plan.rows_table() == [("1+", "int8_act_gemm (portable + Arm dot products: integer dot products, x as int8)")]
    monkeypatch.setattr(cpu_kernels, "built_features", lambda: ["neon"])  # an Armv8.0 core: no sdot
    plain, _ = _plan(torch.float32)
    assert plain.arm_neon and not plain.arm_dot and plain.int8_activations and plain.int8_act_max_rows is None
    assert plain.weight_quant == "checkpoint" and plain.kv_dtype == torch.float16
    assert plain.rows_table() == [("1+", "int8_act_gemm (portable + Arm NEON: integer dot products, x as int8)")]
    monkeypatch.setattr(kernel_plan, "cpu_info", lambda: cpu(frozenset({"neon", "vfpv4"}), "armv7l"))
    arm32, _ = _plan(torch.float32)
    assert not arm32.arm_neon and arm32.weight_quant == "none" and not arm32.int8_activations


def test_bf16_plans_per_level():
    if kernel_plan.isa_rank(resolve_isa()) < kernel_plan.isa_rank("avx512"):
        pytest.skip("needs an AVX-512 CPU (or a process not capped below it)")
    plan, _ = _plan(torch.bfloat16, cpu_isa="avx512")
    vnni = kernel_plan.cpu_info().has("avx512_vnni")
    assert plan.weight_quant == "checkpoint" and plan.int4_integer_kernel == vnni
    assert plan.packed_max_rows == (8 if vnni else 4) and plan.amx_max_rows == 0
    assert plan.rows_table()[-1][1].startswith("dense GEMM")
    # bf16 on the AVX2 level: PyTorch's int4 kernel for the smallest calls, and int8_activations
    # (opt-in) on the AVX2 integer kernel
    low, warnings = _plan(torch.bfloat16, cpu_isa="avx2", int8_activations=True)
    assert low.packed_max_rows == 4 and not low.int4_integer_kernel and low.int8_activations
    assert low.int8_act_max_rows is None and not warnings or "already runs" in warnings[0]


def test_settings_the_cpu_cannot_honour_are_warned_about():
    _, warnings = _plan(torch.bfloat16, cpu_isa="portable", int8_activations=True, amx_max_rows=16)
    assert any("int8_activations needs" in w for w in warnings)
    assert any("amx_max_rows needs" in w for w in warnings)


def test_cuda_plans_no_cpu_kernels():
    plan, _ = plan_engine(device=torch.device("cuda"), dtype=torch.bfloat16, dtype_requested="auto",
                          weight_quant="auto")
    assert plan.weight_quant == "none" and not plan.kernels and not plan.int8_activations


def test_engine_logs_and_keeps_its_plan(tiny_llama_dir):
    from gemel import LLM

    llm = LLM(tiny_llama_dir, num_kv_blocks=16, cpu_isa="portable")
    plan = llm.engine.core.plan
    assert plan.isa == "portable" and plan.dtype == torch.float32  # no native bf16 at that level
    with pytest.raises(ValueError, match="cpu_isa"):
        LLM(tiny_llama_dir, num_kv_blocks=16, cpu_isa="no-such-level")


def test_bf16_without_onednn_support_runs_on_pytorch_kernels(tiny_llama_dir, monkeypatch):
    """A CPU whose oneDNN has no bf16 GEMM (AVX2 only): bf16 asked for by name is not prepacked
    and computes through PyTorch's own kernels, with the same tokens as a prepacked engine."""
    from gemel import LLM, SamplingParams
    from gemel.layers import linear

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 17, 33, 90], [200, 11, 4]]
    monkeypatch.setattr(linear, "bf16_gemm_supported", lambda: False)
    monkeypatch.setattr(kernel_plan, "bf16_gemm_supported", lambda: False)
    plain = LLM(tiny_llama_dir, dtype="bfloat16", num_kv_blocks=64)
    assert not plain.engine.core.plan.prepack_bf16
    assert all(m.onednn_weight is None for m in plain.engine.core.loaded.model.modules()
               if isinstance(m, linear.Linear))
    a = [o.outputs[0].token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)]
    monkeypatch.undo()
    b = [o.outputs[0].token_ids for o in LLM(tiny_llama_dir, dtype="bfloat16", num_kv_blocks=64)
         .generate(prompt_token_ids=prompts, sampling_params=params)]
    assert a == b


def test_gemel_info_prints_the_cpu_the_level_and_the_plan(capsys, monkeypatch):
    import json

    from gemel.cli import main

    monkeypatch.delenv("GEMEL_CPU_ISA", raising=False)
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    cpu = kernel_plan.cpu_info()
    assert info["cpu"]["model"] == cpu.model and info["cpu"]["best_isa"] == cpu.best_isa
    assert set(info["cpu"]["flags"]) <= cpu.flags
    assert info["isa"] == resolve_isa() and info["threads"] >= 1
    assert info["plan"] and info["plan"][-1]["rows"].endswith("+")
    assert set(info["kernel_cache"]) == set(kernel_plan.ISA_LEVELS[: kernel_plan.isa_rank(cpu.best_isa) + 1])
    assert info["kernel_cache"][info["kernels_loaded"]] is not None  # the loaded build is cached
    if kernel_plan.isa_rank(resolve_isa()) >= kernel_plan.isa_rank("avx2"):
        assert main(["info", "--cpu-isa", "avx2"]) == 0
        text = capsys.readouterr().out
        assert "level:    avx2" in text and "int8_act_gemm" in text and "dtype float32" in text
        assert "prefetch: timed at engine start" in text  # the AVX2 tiles' asking ahead (stream_prefetch)
    if kernel_plan.isa_rank(resolve_isa()) >= kernel_plan.isa_rank("avx512") and "avx512_vnni" in cpu.flags:
        assert main(["info", "--cpu-isa", "avx512"]) == 0
        text = capsys.readouterr().out
        assert "level:    avx512" in text and "int8_act_gemm" in text
        assert "prefetch: timed at engine start" in text  # the VNNI tiles ask ahead too
    assert main(["info", "--dtype", "float32"]) == 0
    assert "weight_quant none" in capsys.readouterr().out  # float32 by name: the exact dense sums


def test_gemel_info_refuses_a_level_the_cpu_lacks(capsys, monkeypatch):
    from gemel.cli import main

    monkeypatch.setattr(kernel_plan, "cpu_info", lambda: cpu(AVX2))
    assert main(["info", "--cpu-isa", "amx"]) == 2
    assert "needs a CPU with AMX" in capsys.readouterr().err
