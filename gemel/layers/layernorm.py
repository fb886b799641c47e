"""RMSNorm in the two rounding orders the supported checkpoints were trained with."""

from __future__ import annotations

import torch


def rms_norm_llama(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama: normalise in float32, cast back, then scale (weight in the model dtype)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rms_norm_gemma(x: torch.Tensor, weight_plus_one: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma: scale by (1 + w) in float32, then cast. The weight is stored with the 1 added."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight_plus_one).to(x.dtype)
