"""The kernel plan: which CPU kernels serve each projection at each row count, and the dtype.

One place decides, from the CPU's features and the engine's configuration, what the engine
runs, so that the engine, the projections and the model files carry no instruction-set
conditions or row thresholds of their own. The plan is logged once at start-up and printed
by ``gemel info``.

Instruction-set levels, lowest first (each CPU runs its own level and every one below it):

- ``portable``: plain C++ (any x86-64 or ARM CPU; on 64-bit ARM int8_act_gemm has NEON tiles,
  on the dot-product extension where the CPU has it, and the plan then takes the integer kernels);
- ``avx2``: x86-64-v3 (AVX2, FMA, F16C), e.g. AMD Zen 1-3 and Intel Haswell to Comet Lake;
- ``avx512``: AVX-512 (with VNNI and BF16 where the CPU has them), e.g. Ice Lake, Zen 4/5;
- ``amx``: AVX-512 with AMX tiles (Sapphire Rapids and later Xeons).

``engine.cpu_isa`` (or ``$GEMEL_CPU_ISA``, which caps every engine of a process) forces a
lower level than the CPU's, so that the AVX2 plan can be run and measured on any x86 machine.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ISA_LEVELS = ("portable", "avx2", "avx512", "amx")
ISA_CHOICES = ("auto", *ISA_LEVELS)

# Row thresholds of the kernels, measured on the machines each note names (docs/performance.md).
# Where a CPU has AMX, int8_act_gemm serves calls up to this many rows and the bf16 GEMM larger
# ones: the 4-bit codes win decode steps (the weights stream from memory) and lose prefill
# chunks by 1.6-2.6x at 1,024 rows.
AMX_INT8_ACT_MAX_ROWS = 128
# Where a CPU has AMX, gemel's tile kernel serves calls up to this many rows and oneDNN's bf16
# GEMM larger ones (which it blocks better for prefill chunks).
AMX_TILE_MAX_ROWS = 128
# Where a projection also has AMX tiles, int8_group_mm (the checkpoint's Q8_0 groups, widened
# to float for every row of x) serves calls up to this many rows and the tiles larger ones.
AMX_INT8_GROUPS_MAX_ROWS = 2
# The most rows the weight-only kernels int4_group_mm and int8_group_mm take.
WEIGHT_ONLY_KERNEL_MAX_ROWS = 8
# PyTorch's packed int8/int4 kernels lose to the dense GEMM beyond this many rows.
ATEN_PACKED_MAX_ROWS = 4

# The CPU flags the plan reads, as /proc/cpuinfo names them (printed by `gemel info`).
RELEVANT_FLAGS = (
    "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16",
    "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "asimd", "asimddp", "sve",
)


@dataclass(frozen=True)
class CpuInfo:
    """What the plan needs to know about the CPU: model name, machine type and feature flags."""

    model: str
    machine: str
    flags: frozenset[str]

    @property
    def best_isa(self) -> str:
        """The highest instruction-set level this CPU executes."""
        f = self.flags
        if self.machine not in ("x86_64", "AMD64"):
            return "portable"
        avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= f
        if avx512 and {"amx_tile", "amx_bf16"} <= f:
            return "amx"
        if avx512:
            return "avx512"
        if {"avx2", "fma", "f16c"} <= f:
            return "avx2"
        return "portable"

    def has(self, flag: str) -> bool:
        return flag in self.flags

    def relevant_flags(self) -> list[str]:
        return [f for f in RELEVANT_FLAGS if f in self.flags]

    def describe(self) -> str:
        """One line for a benchmark's output: numbers mean little without the CPU they came from."""
        return f"CPU {self.model} ({self.machine}), flags {' '.join(self.relevant_flags()) or '-'}"


@functools.cache
def cpu_info() -> CpuInfo:
    """This CPU, read from /proc/cpuinfo (x86 ``flags``, ARM ``Features``)."""
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "Model") and model in ("unknown", "", platform.machine()):
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return CpuInfo(model=model, machine=platform.machine(), flags=frozenset(flags))


def isa_rank(level: str) -> int:
    return ISA_LEVELS.index(level)


def resolve_isa(requested: str = "auto", cpu: CpuInfo | None = None) -> str:
    """The level to run: the CPU's best, capped by ``$GEMEL_CPU_ISA`` and by ``requested``.
    Asking for more than the CPU has is an error (its kernels would not run here)."""
    cpu = cpu or cpu_info()
    level = cpu.best_isa
    for source, value in (("GEMEL_CPU_ISA", os.environ.get("GEMEL_CPU_ISA", "auto")), ("cpu_isa", requested)):
        value = (value or "auto").strip().lower()
        if value == "auto":
            continue
        if value not in ISA_LEVELS:
            raise ValueError(f"{source} must be one of {', '.join(ISA_CHOICES)}; got {value!r}")
        if isa_rank(value) > isa_rank(cpu.best_isa):
            raise ValueError(
                f"{source}={value} needs a CPU with {value.upper()}; this CPU ({cpu.model}) runs up to {cpu.best_isa}"
            )
        level = min(level, value, key=isa_rank)
    return level


def native_bf16(isa: str, cpu: CpuInfo | None = None) -> bool:
    """Whether the CPU computes bf16 natively at this level (AMX or AVX512-BF16)."""
    cpu = cpu or cpu_info()
    return isa == "amx" or (isa == "avx512" and cpu.has("avx512_bf16"))


def auto_dtype_is_bf16(isa: str, weight_groups: bool, integer_kernels: bool, cpu: CpuInfo | None = None) -> bool:
    """What ``dtype: auto`` computes in on CPU: bf16 where the CPU computes it natively, except
    below AMX for a checkpoint whose projections are stored in groups (``weight_groups``) when
    the integer kernels are loaded: float32 then, with every projection call on
    ``int8_act_gemm`` (x rounded to int8, llama.cpp's arithmetic). On AVX512-VNNI CPUs without
    AMX (AMD Zen 4/5) that beats bf16 at every batch measured (SmolLM2 on a Zen 5: a batch-32
    decode step 17-18 ms against 26-29, batch 1 2.8-3.5 against 4.0-4.1); with AMX the bf16
    tiles win prefill chunks, and the plan gives the integer kernel the smaller calls itself."""
    if not native_bf16(isa, cpu):
        return False
    return isa == "amx" or not (weight_groups and integer_kernels)


def compile_flags(isa: str, cpu: CpuInfo | None = None) -> list[str]:
    """Compiler flags that build the C++ kernels for ``isa``. The CPU's own best level is built
    for the CPU itself (``-march=native``, what the published numbers used); a lower level is
    built for its generic x86-64 level, so it runs on every CPU of that class."""
    cpu = cpu or cpu_info()
    x86 = cpu.machine in ("x86_64", "AMD64")
    if isa == "portable":
        if x86:
            return ["-march=x86-64", "-mtune=generic"]
        # 64-bit ARM: the dot-product extension where the CPU has it (int8_act_gemm's sdot tiles)
        return ["-march=armv8.2-a+dotprod"] if cpu.machine in ("aarch64", "arm64") and cpu.has("asimddp") else []
    if isa == cpu.best_isa:
        return ["-march=native"]
    if isa == "avx2":
        return ["-march=x86-64-v3"]
    if isa == "avx512":  # below an AMX CPU's own level: AVX-512 and its integer/bf16 dot products, no tiles
        return ["-march=x86-64-v4", *(f"-m{f.replace('_', '')}" for f in ("avx512_vnni", "avx512_bf16") if cpu.has(f))]
    raise ValueError(f"cannot build kernels for {isa!r} on this CPU (runs up to {cpu.best_isa})")


@dataclass(frozen=True)
class KernelPlan:
    """Which kernel serves each projection call, by its number of rows, and the dtype."""

    device: str
    dtype: "torch.dtype"
    isa: str  # the level the C++ kernels are built for ("" on CUDA)
    kernels: bool  # gemel's C++ kernels built and loaded
    weight_quant: str  # none | checkpoint | int8 | int4 (weight-only copies for small calls)
    packed_max_rows: int  # calls of up to this many rows take the weight-only copies
    int4_integer_kernel: bool  # 4-bit groups through gemel's int4_group_mm (else PyTorch's int4 kernel)
    int8_groups_max_rows: int  # the most rows int8_group_mm serves
    int8_activations: bool  # the checkpoint's groups with x rounded to int8 (int8_act_gemm)
    int8_act_max_rows: int | None  # ... up to this many rows (None: all)
    amx_max_rows: int  # AMX bf16 tiles up to this many rows (0: none)
    prepack_bf16: bool  # oneDNN-blocked bf16 weights for the dense GEMM
    kv_dtype: "torch.dtype | None" = None  # the KV cache's element type under kv_cache_dtype auto (None: dtype)
    avx_vnni: bool = False  # the AVX2 build has AVX-VNNI's 256-bit dot products (built for a CPU that has them)
    arm_dot: bool = False  # the portable build on 64-bit ARM with the dot-product extension (sdot tiles)
    arm_neon: bool = False  # the portable build on 64-bit ARM without it (widening-multiply tiles)

    def rows_table(self) -> list[tuple[str, str]]:
        """(rows, kernel) for each range of call sizes, smallest first, for a projection that has
        the checkpoint's groups (others take the dense GEMM at every size)."""
        ranges: list[tuple[int | None, str]] = []  # (last row of the range or None for all, kernel)
        if self.weight_quant != "none" and self.packed_max_rows:
            if self.weight_quant == "checkpoint":
                four = "int4_group_mm" if self.int4_integer_kernel else "aten int4pack"
                both = min(self.packed_max_rows, self.int8_groups_max_rows)
                ranges.append((both, f"weight-only: 4-bit {four}, 8-bit int8_group_mm"))
                ranges.append((self.packed_max_rows, f"weight-only: 4-bit {four}"))
            else:
                ranges.append((self.packed_max_rows, f"weight-only, re-quantised {self.weight_quant}"))
        if self.amx_max_rows:
            ranges.append((self.amx_max_rows, "amx_bf16_gemm (AMX bf16 tiles)"))
        if self.int8_activations:
            level = f"{self.isa} + AVX-VNNI" if self.avx_vnni else self.isa
            if self.arm_dot:
                level = f"{self.isa} + Arm dot products"
            elif self.arm_neon:
                level = f"{self.isa} + Arm NEON"
            ranges.append((self.int8_act_max_rows, f"int8_act_gemm ({level}: integer dot products, x as int8)"))
        dense = "oneDNN prepacked bf16" if self.prepack_bf16 else str(self.dtype).removeprefix("torch.")
        ranges.append((None, f"dense GEMM ({dense})"))
        table, first = [], 1
        for last, kernel in ranges:
            if last is None:
                table.append((f"{first}+", kernel))
                break
            if last >= first:
                table.append((f"{first}" if last == first else f"{first}-{last}", kernel))
                first = last + 1
        return table

    def describe(self) -> str:
        lines = [f"device={self.device} dtype={str(self.dtype).removeprefix('torch.')} "
                 f"isa={self.isa or '-'} kernels={'built' if self.kernels else 'PyTorch only'}"]
        lines += [f"  rows {rows:>7}: {kernel}" for rows, kernel in self.rows_table()]
        if self.kv_dtype is not None and self.kv_dtype != self.dtype:
            lines.append(f"  KV cache: {str(self.kv_dtype).removeprefix('torch.')} (kv_cache_dtype auto)")
        if self.kernels and self.int8_activations and self.int8_act_max_rows is None and not self.amx_max_rows \
                and not self.packed_max_rows:
            lines.append("  decode steps: all layers in one C++ call (Llama and Gemma 3 layers without bias)")
        return "\n".join(lines)


def plan_engine(
    *,
    device: "torch.device",
    dtype: "torch.dtype",
    dtype_requested: str,
    weight_quant: str,
    cpu_isa: str = "auto",
    packed_max_rows: int | None = None,
    int8_activations: bool = False,
    int8_act_max_rows: int | None = None,
    amx_max_rows: int | None = None,
) -> tuple[KernelPlan, list[str]]:
    """The plan for one engine and the warnings about settings it could not honour.

    ``weight_quant: auto`` resolves to the checkpoint's own groups: in bf16 on CPU as weight-only
    copies for small calls; in float32 chosen automatically (``auto_dtype_is_bf16``) with int8
    activations for every call, llama.cpp's arithmetic on the file's exact weights, which is what
    makes such CPUs fast. A float32 asked for by name keeps the dense weights and their exact sums."""
    import torch

    from gemel.layers import cpu_kernels

    warnings: list[str] = []
    if device.type != "cpu":
        resolved = "none" if weight_quant == "auto" else weight_quant
        return KernelPlan(str(device.type), dtype, "", False, resolved, 0, False, 0, False, None, 0, False), warnings
    isa = resolve_isa(cpu_isa)
    kernels = cpu_kernels.load(isa)
    if kernels and cpu_kernels.loaded_isa() != isa:
        warnings.append(f"this process already runs kernels built for {cpu_kernels.loaded_isa()}; cpu_isa={isa} "
                        "applies to the plan only")
    cpu = cpu_info()
    vnni = kernels and isa_rank(isa) >= isa_rank("avx512") and cpu.has("avx512_vnni")
    # int8_act_gemm's fast paths: x86's AVX2 and AVX-512 tiles, or 64-bit ARM's NEON tiles (with
    # sdot where the build has dot products). Even without sdot those read the file's 4-bit codes,
    # an eighth of float32's bytes, where a decode step is bound by the memory.
    built = cpu_kernels.built_features() if kernels else []
    arm_tiles = isa == "portable" and "neon" in built and cpu.machine in ("aarch64", "arm64")
    integer_dots = kernels and (isa_rank(isa) >= isa_rank("avx2") or arm_tiles)
    amx = isa == "amx"
    # float32 chosen by dtype auto on a CPU with the integer kernels: every call on int8_act_gemm
    every_call_int8 = weight_quant == "auto" and dtype == torch.float32 and dtype_requested == "auto" and integer_dots

    resolved = weight_quant
    if weight_quant == "auto":
        resolved = "checkpoint" if dtype == torch.bfloat16 or every_call_int8 else "none"
    if every_call_int8:
        # Every call on int8_act_gemm: no weight-only copies, no dense weights left to read.
        int8_activations, packed_rows, int8_act_max_rows = True, 0, None
    else:
        packed_rows = packed_max_rows
        if packed_rows is None:
            packed_rows = WEIGHT_ONLY_KERNEL_MAX_ROWS if resolved != "none" and vnni else ATEN_PACKED_MAX_ROWS
        if int8_activations and not integer_dots:
            warnings.append("int8_activations needs the C++ kernels on a CPU with AVX2 or on 64-bit ARM; using the dense weights")
            int8_activations = False
        if int8_act_max_rows is None and amx:
            int8_act_max_rows = AMX_INT8_ACT_MAX_ROWS
    amx_ok = amx and dtype == torch.bfloat16 and kernels and cpu_kernels.amx_tiles_available()
    if amx_max_rows is None:
        amx_max_rows = AMX_TILE_MAX_ROWS if amx_ok else 0
    elif amx_max_rows and not amx_ok:
        warnings.append("amx_max_rows needs a CPU with AMX-BF16, bf16 weights and the C++ kernels; not used")
        amx_max_rows = 0
    if amx_max_rows and int8_act_max_rows is not None and int8_act_max_rows <= amx_max_rows:
        int8_activations = False  # every call it would take goes to the AMX tiles
    prepack = dtype == torch.bfloat16 and torch.backends.mkldnn.is_available() and bf16_gemm_supported()
    plan = KernelPlan(
        device="cpu",
        dtype=dtype,
        isa=isa,
        kernels=kernels,
        weight_quant=resolved,
        packed_max_rows=packed_rows,
        int4_integer_kernel=vnni,
        int8_groups_max_rows=min(packed_rows, AMX_INT8_GROUPS_MAX_ROWS if amx_max_rows else WEIGHT_ONLY_KERNEL_MAX_ROWS),
        int8_activations=int8_activations,
        int8_act_max_rows=int8_act_max_rows,
        amx_max_rows=amx_max_rows,
        prepack_bf16=prepack,
        # float32 on the integer kernels: the KV cache in float16 (the kernels widen its rows as
        # they read them), half the bytes a decode step's attention reads, as llama.cpp's f16 cache
        kv_dtype=torch.float16 if every_call_int8 else None,
        avx_vnni=kernels and isa == "avx2" and "avxvnni" in built,
        arm_dot=arm_tiles and "neondot" in built,
        arm_neon=arm_tiles and "neondot" not in built,
    )
    return plan, warnings


def plan_for_config(engine, device: "torch.device", dtype: "torch.dtype") -> tuple[KernelPlan, list[str]]:
    """``plan_engine`` for an engine configuration (``gemel.config.EngineConfig``)."""
    return plan_engine(
        device=device,
        dtype=dtype,
        dtype_requested=engine.dtype,
        weight_quant=engine.weight_quant,
        cpu_isa=engine.cpu_isa,
        packed_max_rows=engine.packed_max_rows,
        int8_activations=engine.int8_activations,
        int8_act_max_rows=engine.int8_act_max_rows,
        amx_max_rows=engine.amx_max_rows,
    )


@functools.cache
def bf16_gemm_supported() -> bool:
    """Whether oneDNN computes bf16 GEMMs on this CPU (it needs AVX512-BW/VL/DQ or AVX-NE-CONVERT;
    elsewhere its weight reorder raises, and PyTorch's own bf16 kernels serve)."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False
