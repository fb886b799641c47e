"""Dense projection whose weight may be fused from several checkpoint tensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T (+ b). Kept as its own module so weight-only quantised variants can replace it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    @classmethod
    def fused(cls, weights: list[torch.Tensor], biases: list[torch.Tensor] | None = None) -> "Linear":
        """One matrix for q/k/v or gate/up: fewer, larger matmuls per step."""
        weight = weights[0] if len(weights) == 1 else torch.cat(weights, dim=0)
        bias = None
        if biases is not None:
            bias = biases[0] if len(biases) == 1 else torch.cat(biases, dim=0)
        return cls(weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
