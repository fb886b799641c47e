"""Rotary position embedding (the half-rotation layout used by Hugging Face checkpoints)."""

from __future__ import annotations

import torch


class RotaryEmbedding:
    """Precomputed cos/sin tables; ``linear_factor`` divides positions (Gemma 3 global layers)."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        device: torch.device,
        linear_factor: float = 1.0,
        llama3_scaling: dict | None = None,
    ):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if llama3_scaling:
            inv_freq = _llama3_inv_freq(inv_freq, llama3_scaling)
        inv_freq = inv_freq / linear_factor
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.cos = freqs.cos().to(device)  # [max_positions, head_dim / 2]
        self.sin = freqs.sin().to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-step tables for the step's tokens, shaped to broadcast over heads: [T, 1, D]."""
        cos = self.cos[positions]
        sin = self.sin[positions]
        cos = torch.cat((cos, cos), dim=-1).unsqueeze(1).to(dtype)
        sin = torch.cat((sin, sin), dim=-1).unsqueeze(1).to(dtype)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    import math

    factor = scaling.get("factor", 8.0)
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)
