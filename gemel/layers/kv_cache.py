"""The int8 KV cache (``engine.kv_cache_dtype: int8``): one row per token and KV head, the
head's values as int8 codes followed by their float32 scale (4 bytes), so a cache tensor is
int8 ``[num_kv_heads, num_slots, head_dim + 4]``.

Each row is scaled on its own (scale = max|x| / 127, codes = round(x / scale)), as
llama.cpp's q8_0 cache does per 32 values. Decode attention on CPU reads every cached key
and value of every running sequence once per layer, and with bf16 caches that read, not the
arithmetic, sets its time; int8 rows are 68 bytes instead of 128 for a head size of 64.
Keeping the scale inside the row leaves the cache one tensor per K and V, so everything that
handles caches by slot (the block manager, the prefix cache, the compiled step) is unchanged.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # one float32 per row


def is_int8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def kernels_take(q_dtype: torch.dtype, cache: torch.Tensor) -> bool:
    """Whether the C++ kernels read and write ``cache`` for queries of ``q_dtype``: the same
    dtype, int8 rows, or float16 under float32 (the AVX2 plan's cache)."""
    return (
        cache.dtype == q_dtype or is_int8(cache) or (cache.dtype == torch.float16 and q_dtype == torch.float32)
    )


def row_width(head_dim: int, kv_dtype: torch.dtype) -> int:
    """Last dimension of a cache tensor: the head size, plus the scale's bytes for int8."""
    return head_dim + SCALE_BYTES if kv_dtype == torch.int8 else head_dim


def bytes_per_value(kv_dtype: torch.dtype, head_dim: int) -> float:
    """Cache bytes per cached value (head_dim values share one int8 row's scale)."""
    return row_width(head_dim, kv_dtype) * torch.empty((), dtype=kv_dtype).element_size() / head_dim


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float -> [..., D + 4] int8: codes round(x / scale), then the float32 scale's bytes."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / 127.0
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    codes = torch.round(xf * inverse).clamp_(-127, 127).to(torch.int8)
    return torch.cat([codes, scale.view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 4] int8 rows -> [..., D] values (codes times scale) in ``dtype``."""
    codes = rows[..., :-SCALE_BYTES]
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return (codes.float() * scale).to(dtype)
