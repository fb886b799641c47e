"""Whether int8_act_gemm's tiles ask for a decode step's weights ahead of use: decided by timing.

A decode step of one or two sequences reads every projection's weights from memory once, and
the AVX2 and AVX-512 (VNNI) tiles of ``int8_act_gemm`` ask for them ahead of use
(``_mm_prefetch``: the AVX2 tiles a few KB on, the VNNI tiles the next tile's blocks). A Zen 4
and a Zen 5 capped at AVX2 rewarded that, and so did the Zen 4's VNNI tiles; a real AVX2-only
CPU, an AMD Zen 2, punishes it for 8-bit codes (Gemma 3's 178 MB Q8_0 LM head at one row: 7.3 ms
with the asking, 6.25 without) while its 4-bit layers still gain from it. How a CPU's own
prefetchers handle these streams is not in its feature flags, so an engine on the AVX2 or
AVX-512 build times one-row passes over its model's own weights both ways at start-up and keeps
the faster, for 8-bit and for 4-/5-bit codes apart. The outputs are the same either way, bit for
bit; only the time changes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from gemel.layers.kernel_plan import KernelPlan, isa_rank

# The C++ switch's kinds (int8_act_gemm.cpp, stream_prefetch_kinds) and their defaults (both on).
BYTE_CODES, NIBBLE_CODES = 1, 2
KIND_NAMES = {BYTE_CODES: "8-bit codes", NIBBLE_CODES: "4-/5-bit codes"}
# Fewer bytes than this may be read from the caches, where asking ahead changes nothing to time.
MIN_STREAM_BYTES = 48 << 20
ROUNDS = 5  # passes each way, alternated; the fastest of each way are compared (noise only adds time)
MARGIN = 0.03  # a kind's setting changes only where the other way is this much faster


@dataclass(frozen=True)
class PrefetchChoice:
    """The kinds of codes asked for ahead, and the fastest pass times that decided each."""

    kinds: int
    pass_ms: dict[str, tuple[float, float]] = field(default_factory=dict)  # kind -> (asking, not)

    def describe(self) -> str:
        said = [f"{name} {'yes' if self.kinds & kind else 'no'}" for kind, name in KIND_NAMES.items()
                if name in self.pass_ms]
        times = "; ".join(f"{name}: {on:.2f} ms asking, {off:.2f} not" for name, (on, off) in self.pass_ms.items())
        return f"weights asked for ahead at 1-2 rows: {', '.join(said)} (one-row passes over each kind's weights: {times})"


def set_kinds(kinds: int) -> int:
    """Sets the kinds of codes the tiles ask for ahead; returns the previous ones."""
    return int(torch.ops.gemel.set_stream_prefetch(kinds))


def current_kinds() -> int:
    return int(torch.ops.gemel.set_stream_prefetch(-1))


def code_kind(codes: torch.Tensor) -> int:
    """BYTE_CODES for 8-bit (and Q6_K's 6-bit) codes, 512 bytes a group and block; NIBBLE_CODES else."""
    return BYTE_CODES if codes.shape[-1] == 512 else NIBBLE_CODES


def applies(plan: KernelPlan) -> bool:
    """Whether an engine on this plan times the asking ahead: int8_act_gemm's AVX2 or AVX-512 tiles."""
    return plan.kernels and plan.int8_activations and isa_rank(plan.isa) >= isa_rank("avx2")


def tune(model: nn.Module, plan: KernelPlan, min_bytes: int = MIN_STREAM_BYTES) -> PrefetchChoice | None:
    """Times the model's int8_act_gemm weights at one row with and without asking ahead, per kind
    of codes, and sets the faster. None (nothing changed) off int8_act_gemm's AVX2 and AVX-512
    builds, or where the weights are too few to stream from memory."""
    from gemel.layers.linear import Linear

    if not applies(plan):
        return None
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.int8_act_codes is not None]
    if sum(m.int8_act_codes.numel() for m in linears) < min_bytes:
        return None
    inputs = [torch.randn(1, m.int8_act_codes.shape[1] * 32, dtype=plan.dtype) for m in linears]
    code_kinds = [code_kind(m.int8_act_codes) for m in linears]

    def one_pass(kind: int | None = None) -> float:
        """One row through every projection, as a decode step reads them (so each kind's weights
        come from memory, not from a cache the others left them in); the time of only those whose
        codes are of ``kind``, so that a small kind's difference is not lost in the noise of a
        larger one's (Gemma 3's 4-/5-bit layers beside its 8-bit LM head)."""
        total = 0.0
        for linear, x, linear_kind in zip(linears, inputs, code_kinds):
            timed_call = kind is None or linear_kind == kind
            start = time.perf_counter()
            linear(x)
            if timed_call:
                total += time.perf_counter() - start
        return total

    kinds, timed = current_kinds(), {}
    with torch.inference_mode():
        one_pass()  # warm-up: first-touch of the inputs, the thread pool awake
        for kind, name in KIND_NAMES.items():
            if kind not in code_kinds:
                continue
            asking, not_asking = [], []
            for _ in range(ROUNDS):
                for on, times in ((True, asking), (False, not_asking)):
                    set_kinds(kinds | kind if on else kinds & ~kind)
                    times.append(one_pass(kind))
            on_s, off_s = min(asking), min(not_asking)
            if off_s < on_s * (1 - MARGIN):
                kinds &= ~kind
            elif on_s < off_s * (1 - MARGIN):
                kinds |= kind
            timed[name] = (on_s * 1e3, off_s * 1e3)
    set_kinds(kinds)
    return PrefetchChoice(kinds, timed)
