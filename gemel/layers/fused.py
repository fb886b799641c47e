"""Fused CPU versions of the small element-wise ops of a layer (``csrc/fused_ops.cpp``).

An eager CPU step runs each PyTorch op as its own pass over memory with a few microseconds
of dispatch: at batch 32 about 45 small ops per layer, a fifth of the step. The fused ops
do RMSNorm, SiLU-and-multiply and the rotary embedding of q and k in one pass each, rounding
where the PyTorch code does. They are used when the step's metadata asks for them
(``AttentionMetadata.fused_ops``, set by the runner once the kernels are built) and the
step is not being traced by torch.compile, whose own fusion covers the PyTorch versions.
"""

from __future__ import annotations

import torch

from gemel.layers.attention import AttentionMetadata


def use_fused(meta: AttentionMetadata) -> bool:
    # is_compiling() first: under torch.compile it is a constant True, so Dynamo never reads
    # (and never guards on) the flag, and a step compiled at start-up stays valid.
    return not torch.compiler.is_compiling() and meta.fused_ops


def rms_norm_llama(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.gemel.rms_norm(x, weight, eps)


def add_rms_norm_llama(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x + delta`` and its RMSNorm, in one pass: the residual add fused with the next norm."""
    return torch.ops.gemel.add_rms_norm(x, delta, weight, eps)


def norm_add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, delta_weight: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + rms_norm(delta) * delta_weight`` and ``rms_norm(s) * weight`` in one pass
    (float32): Gemma 3's post-norm, residual add and the next pre-norm."""
    return torch.ops.gemel.add_rms_norm(x, delta, weight, eps, delta_weight)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up for a GeGLU's fused gate/up projection output [T, 2 * I] (float32)."""
    return torch.ops.gemel.gelu_tanh_and_mul(gate_up)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for the fused gate/up projection's output [T, 2 * I]."""
    return torch.ops.gemel.silu_and_mul(gate_up)


def rotary_qk(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] and k [T, Hkv, D] with the rotary embedding applied, read from the fused
    q/k/v projection's output [T, (Hq + 2 Hkv) D]."""
    return torch.ops.gemel.rotary_qk(qkv, cos, sin, num_heads, num_kv_heads, head_dim)


def rotary_q_store_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None,
    norm_eps: float = 0.0,
) -> torch.Tensor:
    """``rotary_qk`` that writes the rotated k, and v, straight into the KV cache at the
    step's slots (caches of qkv's dtype) and returns q: no k/v tensors, no index_copy_.
    ``qk_norm``: the (q, k) weights of a per-head RMSNorm applied before the rotation
    (Gemma 3, float32)."""
    q_norm, k_norm = qk_norm if qk_norm is not None else (None, None)
    return torch.ops.gemel.rotary_q_store_kv(
        qkv, cos, sin, kv_cache[0], kv_cache[1], slot_mapping, num_heads, num_kv_heads, head_dim, q_norm, k_norm, norm_eps
    )
