"""C++ CPU kernels, built on first use with the machine's C++ compiler and cached on disk.

All under ``torch.ops.gemel``: decode and prefill attention that read the paged KV cache in place
(``csrc/paged_attention.cpp``), small-batch projections on a weight's own int8 groups
(``csrc/int8_group_mm.cpp``, GGUF Q8_0) and on 4-bit groups with integer dot products
(``csrc/int4_group_mm.cpp``, AVX512-VNNI), larger projections on those groups with int8
activations (``csrc/int8_act_gemm.cpp``, AVX512-VNNI) and on bf16 weights laid out as AMX tiles
(``csrc/amx_bf16_gemm.cpp``), and fused RMSNorm, SiLU-and-mul and rotary
embedding for eager steps (``csrc/fused_ops.cpp``), and greedy sampling's argmax
(``csrc/argmax.cpp``). They are compiled (one compiler process per source, in parallel) into one library
against the installed PyTorch's headers and libraries (with the compiler ``torch.compile``
also needs on CPU), once per source, PyTorch version and CPU, and cached under
``$GEMEL_KERNEL_CACHE`` (default ``~/.cache/gemel/kernels``). Where that fails, :func:`load`
returns False and callers keep their pure PyTorch paths. ``$GEMEL_KERNEL_MARCH`` (default
``native``) is the ``-march`` they are built for: ``x86-64-v3``, for instance, builds the
plain C++ paths that CPUs without AVX-512 run, which a test checks.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))
HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))
_loaded: bool | None = None  # None: not tried yet


def _march() -> str:
    return os.environ.get("GEMEL_KERNEL_MARCH", "native")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def has_vnni() -> bool:
    """Whether this CPU has the AVX512-VNNI dot products that make int4_group_mm fast (it
    has a plain C++ loop elsewhere, correct but slower than PyTorch's int4 kernel)."""
    flags = _cpu_flags().split()
    return "avx512_vnni" in flags and "avx512bw" in flags


def has_amx() -> bool:
    """Whether this CPU has AMX tiles for bf16, where oneDNN's bf16 GEMMs outrun int8_act_gemm."""
    return "amx_bf16" in _cpu_flags().split()


def amx_tiles_available() -> bool:
    """Whether ``torch.ops.gemel.amx_bf16_gemm`` runs here: a CPU with AMX-BF16, kernels built
    for it, and the tile state granted to this process by the OS."""
    return has_amx() and load() and bool(torch.ops.gemel.amx_bf16_gemm_available())


def _cache_dir() -> Path:
    return Path(os.environ.get("GEMEL_KERNEL_CACHE", Path.home() / ".cache" / "gemel" / "kernels"))


def _build(target: Path) -> None:
    """Compile the sources into ``target`` (written atomically, so concurrent builds are safe).

    One compiler process per source, as many at once as there are cores, then one link: most
    of each source's time is parsing PyTorch's headers, so a single compiler invocation over
    all of them leaves every core but one idle."""
    from torch.utils.cpp_extension import include_paths, library_paths

    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler found")
    torch_lib = library_paths()[0]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = ["-fPIC", "-std=c++17", "-O3", f"-march={_march()}", "-fopenmp", "-ffast-math",
             f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *[f"-I{p}" for p in include_paths()]]
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
            f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-lc10", "-ltorch_cpu", "-ltorch", "-lmvec",
        ])
        os.replace(out, target)


def load() -> bool:
    """Make ``torch.ops.gemel.*`` available on CPU; False (logged once) where it cannot be built."""
    global _loaded
    if _loaded is not None:
        return _loaded
    key = hashlib.sha256(
        b"".join(p.read_bytes() for p in SOURCES + HEADERS)
        + torch.__version__.encode() + sys.version.encode() + _cpu_flags().encode() + _march().encode()
    ).hexdigest()[:16]
    target = _cache_dir() / key / "gemel_cpu_kernels.so"
    try:
        if not target.exists():
            log.info("building the C++ CPU kernels (once; cached in %s)", target.parent)
            _build(target)
        torch.ops.load_library(str(target))
        _register_fake()
        _loaded = True
    except Exception as exc:  # noqa: BLE001 - any build or load failure means "use the fallback"
        log.warning("C++ CPU kernels unavailable, using the PyTorch path: %s", exc)
        _loaded = False
    return _loaded


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

    @torch.library.register_fake("gemel::argmax_rows")
    def _(logits):
        return logits.new_empty(logits.shape[0], dtype=torch.long)

    @torch.library.register_fake("gemel::int4_group_mm")
    def _(x, packed, out_features):
        return x.new_empty(x.shape[0], out_features)
