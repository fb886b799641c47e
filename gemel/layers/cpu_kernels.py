"""C++ CPU kernels, built on first use with the machine's C++ compiler and cached on disk.

All under ``torch.ops.gemel``: decode and prefill attention that read the paged KV cache in place
(``csrc/paged_attention.cpp``), small-batch projections on a weight's own int8 groups
(``csrc/int8_group_mm.cpp``, GGUF Q8_0) and on 4-bit groups with integer dot products
(``csrc/int4_group_mm.cpp``, AVX512-VNNI), larger projections on those groups with int8
activations (``csrc/int8_act_gemm.cpp``, AVX512-VNNI) and on bf16 weights laid out as AMX tiles
(``csrc/amx_bf16_gemm.cpp``), and fused RMSNorm, SiLU-and-mul and rotary
embedding for eager steps (``csrc/fused_ops.cpp``), greedy sampling's argmax
(``csrc/argmax.cpp``; over an int8-activation LM head's outputs without writing them,
``int8_act_gemm_argmax``), random sampling's draw (``csrc/sample.cpp``) and structured output's token
mask (``csrc/token_mask.cpp``). They are compiled (one compiler process per source, in parallel) into one library
against the installed PyTorch's headers and libraries (with the compiler ``torch.compile``
also needs on CPU), once per source, PyTorch version and instruction-set level, and cached
under ``$GEMEL_KERNEL_CACHE`` (default ``~/.cache/gemel/kernels``); ``scripts/install.sh``
builds them ahead (``python -m gemel.layers.cpu_kernels``), so the first ``gemel serve`` starts
in seconds. Where building fails, :func:`load` returns False and callers keep their pure
PyTorch paths.

A process runs one level (``gemel.layers.kernel_plan``): the CPU's own (built with
``-march=native``), or a lower one asked for with ``engine.cpu_isa`` or ``$GEMEL_CPU_ISA``,
built for that level's generic x86-64 target; the tests run every level the CPU executes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from gemel.layers import kernel_plan

log = logging.getLogger(__name__)

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))
HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))
_loaded: bool | None = None  # None: not tried yet
_loaded_isa: str | None = None  # the level of the library loaded


def _cpu_flags() -> str:
    return " ".join(sorted(kernel_plan.cpu_info().flags))


def has_vnni() -> bool:
    """Whether the loaded kernels (or, before loading, this CPU's level) run AVX512-VNNI dot
    products, which make int4_group_mm fast (it has a plain C++ loop elsewhere)."""
    level = _loaded_isa or kernel_plan.resolve_isa()
    return kernel_plan.isa_rank(level) >= kernel_plan.isa_rank("avx512") and kernel_plan.cpu_info().has("avx512_vnni")


def has_amx() -> bool:
    """Whether this process runs the AMX level, where oneDNN's bf16 GEMMs outrun int8_act_gemm."""
    return (_loaded_isa or kernel_plan.resolve_isa()) == "amx"


def built_features() -> list[str]:
    """The instruction-set extensions the loaded kernels were compiled with (``avx2``,
    ``avxvnni``, ``avx512vnni``, ...); empty without kernels."""
    return torch.ops.gemel.kernel_isa().split()[1:] if load() else []


def amx_tiles_available() -> bool:
    """Whether ``torch.ops.gemel.amx_bf16_gemm`` runs here: a CPU with AMX-BF16, kernels built
    for it, and the tile state granted to this process by the OS."""
    return has_amx() and load() and bool(torch.ops.gemel.amx_bf16_gemm_available())


def _cache_dir() -> Path:
    return Path(os.environ.get("GEMEL_KERNEL_CACHE", Path.home() / ".cache" / "gemel" / "kernels"))


def source_flags(isa: str, cpu: kernel_plan.CpuInfo | None = None) -> list[str]:
    """The compiler's flags for each source of the kernels built for ``isa`` on ``cpu`` (this
    one by default; another architecture's to check that the portable level builds there)."""
    from torch.utils.cpp_extension import include_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return ["-fPIC", "-std=c++17", "-O3", *kernel_plan.compile_flags(isa, cpu), "-fopenmp", "-ffast-math",
            f'-DGEMEL_ISA="{isa}"', "-fvisibility=hidden", "-fvisibility-inlines-hidden",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *[f"-I{p}" for p in include_paths()]]


def vector_math_flags(compiler: str) -> list[str]:
    """glibc's vector maths (libmvec) for the link, where the C library has it. Under
    -ffast-math GCC vectorises the kernels' exp through libmvec where the C library's headers
    declare its vector variants: always on x86-64, on 64-bit ARM only from glibc 2.38 (Debian
    12 and Ubuntu 22.04 have none; GCC then emits no such calls, and asking for the library
    would only fail the link)."""
    found = subprocess.run([compiler, "-print-file-name=libmvec.so"], capture_output=True, text=True).stdout.strip()
    return ["-lmvec"] if os.path.isabs(found) else []


def _build(target: Path, isa: str) -> None:
    """Compile the sources into ``target`` (written atomically, so concurrent builds are safe).

    One compiler process per source, as many at once as there are cores, then one link: most
    of each source's time is parsing PyTorch's headers, so a single compiler invocation over
    all of them leaves every core but one idle."""
    from torch.utils.cpp_extension import library_paths

    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler found")
    torch_lib = library_paths()[0]
    flags = source_flags(isa)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name

        def run(cmd: list[str]) -> None:
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd[:3])} ... failed:\n{result.stderr[-2000:]}")

        objects = [Path(tmp) / f"{source.stem}.o" for source in SOURCES]
        with ThreadPoolExecutor(max_workers=max(1, min(len(SOURCES), os.cpu_count() or 1))) as pool:
            for done in [pool.submit(run, [compiler, "-c", str(source), "-o", str(obj), *flags])
                         for source, obj in zip(SOURCES, objects)]:
                done.result()
        run([
            compiler, *map(str, objects), "-o", str(out), "-shared", "-fopenmp",
            # libgomp is PyTorch's own copy (same soname), so the kernel shares its thread pool.
            f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-lc10", "-ltorch_cpu", "-ltorch",
            *vector_math_flags(compiler),
        ])
        os.replace(out, target)


def library_path(isa: str) -> Path:
    """Where the kernels built for ``isa`` are cached (the key covers their sources, the compiler
    flags, PyTorch and Python, and for a native build the CPU's flags)."""
    flags = kernel_plan.compile_flags(isa)
    key = hashlib.sha256(
        b"".join(p.read_bytes() for p in SOURCES + HEADERS)
        + torch.__version__.encode() + sys.version.encode() + " ".join(flags).encode()
        + (_cpu_flags().encode() if "-march=native" in flags else b"")
    ).hexdigest()[:16]
    return _cache_dir() / f"{isa}-{key}" / "gemel_cpu_kernels.so"


def build(isa: str) -> Path:
    """Build (if not cached) the kernels for ``isa`` and return the library's path."""
    target = library_path(isa)
    if not target.exists():
        log.info("building the C++ CPU kernels for %s (once; cached in %s)", isa, target.parent)
        _build(target, isa)
    return target


def loaded_isa() -> str | None:
    """The level of the kernels this process loaded, None before (or without) them."""
    return _loaded_isa


def load(isa: str | None = None) -> bool:
    """Make ``torch.ops.gemel.*`` available on CPU, built for ``isa`` (default: the CPU's level
    capped by ``$GEMEL_CPU_ISA``); False (logged once) where it cannot be built. A process holds
    one level: a later call for another level keeps the loaded one (see :func:`loaded_isa`)."""
    global _loaded, _loaded_isa
    if _loaded is not None:
        return _loaded
    try:
        level = isa or kernel_plan.resolve_isa()
        torch.ops.load_library(str(build(level)))
        _register_fake()
        _loaded, _loaded_isa = True, level
    except Exception as exc:  # noqa: BLE001 - any build or load failure means "use the fallback"
        log.warning("C++ CPU kernels unavailable, using the PyTorch path: %s", exc)
        _loaded = False
    return _loaded


def cached_levels() -> dict[str, bool]:
    """For each level this CPU runs: whether its kernels are built and cached."""
    best = kernel_plan.isa_rank(kernel_plan.cpu_info().best_isa)
    return {level: library_path(level).exists() for level in kernel_plan.ISA_LEVELS[: best + 1]}


def _register_fake() -> None:
    """Shape-only versions for ``torch.compile`` tracing: new contiguous tensors, as the
    kernels return (``empty_like`` would copy the strides of a strided input)."""

    @torch.library.register_fake("gemel::paged_decode_attention")
    def _(q, k_cache, v_cache, kv_slots, context_lens, scale, window):
        return q.new_empty(q.shape)

    @torch.library.register_fake("gemel::paged_prefill_attention")
    def _(q, k_cache, v_cache, kv_slots, token_seq, context_lens, scale, window):
        return q.new_empty(q.shape)

    @torch.library.register_fake("gemel::int8_group_mm")
    def _(x, q, scales):
        return x.new_empty(x.shape[0], q.shape[0])

    @torch.library.register_fake("gemel::int8_act_gemm")
    def _(x, codes, d, low, out_features, gated=False, zero_point=0):
        return x.new_empty(x.shape[0], out_features)

    @torch.library.register_fake("gemel::embedding_rows")
    def _(codes, scale, ids, rows):
        return codes.new_empty(*ids.shape, codes.shape[1] * 32, dtype=torch.float32)

    @torch.library.register_fake("gemel::argmax_rows")
    def _(logits):
        return logits.new_empty(logits.shape[0], dtype=torch.long)

    @torch.library.register_fake("gemel::sample_rows")
    def _(logits, temperature, top_k, top_p, min_p, uniform):
        return logits.new_empty(logits.shape[0], dtype=torch.long)

    @torch.library.register_fake("gemel::int4_group_mm")
    def _(x, packed, out_features):
        return x.new_empty(x.shape[0], out_features)


def main(argv: list[str] | None = None) -> int:
    """``python -m gemel.layers.cpu_kernels [LEVEL ...]``: build the kernels ahead of use, for the
    given levels (default: every level this CPU runs, its own first)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("levels", nargs="*", metavar="LEVEL", help=", ".join(kernel_plan.ISA_LEVELS))
    args = parser.parse_args(argv)
    unknown = [level for level in args.levels if level not in kernel_plan.ISA_LEVELS]
    if unknown:
        parser.error(f"unknown level(s) {unknown}; choose from {', '.join(kernel_plan.ISA_LEVELS)}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    best = kernel_plan.cpu_info().best_isa
    levels = args.levels or [best, *reversed(kernel_plan.ISA_LEVELS[: kernel_plan.isa_rank(best)])]
    failed = 0
    for level in levels:
        try:
            print(f"{level}: {build(level)}")
        except Exception as exc:  # noqa: BLE001 - report each level, keep building the others
            print(f"{level}: not built ({exc})", file=sys.stderr)
            failed += 1
    return 1 if failed == len(levels) else 0


if __name__ == "__main__":
    sys.exit(main())
