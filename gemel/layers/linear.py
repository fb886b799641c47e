"""Dense projection, optionally with a weight-only int8/int4 copy for small batches (F19).

At one or a few rows a decode step is bound by reading weights, so PyTorch's packed
low-bit CPU kernels (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``) win; at many
rows the bf16/fp32 GEMM wins. A quantised ``Linear`` keeps both and picks per call by the
number of rows (``packed_max_rows``).

On a CPU with oneDNN, bf16 weights are also reordered once into oneDNN's blocked layout
(``prepack_``): the same kernel family as ``F.linear`` with bitwise-equal results, but
without re-laying-out the weight on every call, which is 1.2-2x faster at decode sizes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T (+ b)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.quant: str | None = None
        self.packed_max_rows = 0
        self.onednn_weight: torch.Tensor | None = None  # blocked copy from prepack_()

    @classmethod
    def fused(cls, weights: list[torch.Tensor], biases: list[torch.Tensor] | None = None) -> "Linear":
        """One matrix for q/k/v or gate/up: fewer, larger matmuls per step."""
        weight = weights[0] if len(weights) == 1 else torch.cat(weights, dim=0)
        bias = None
        if biases is not None:
            bias = biases[0] if len(biases) == 1 else torch.cat(biases, dim=0)
        return cls(weight, bias)

    def prepack_(self, batch_hint: int = 64) -> bool:
        """Replace a CPU bf16 weight by its oneDNN blocked copy. Returns whether it did."""
        w = self.weight
        if w is None or w.device.type != "cpu" or w.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
            return False
        self.onednn_weight = torch.ops.mkldnn._reorder_linear_weight(w.detach(), batch_hint)
        self.weight = None  # the blocked copy replaces it (a tied embedding keeps its own reference)
        return True

    def quantize_(self, mode: str, packed_max_rows: int, group_size: int = 32) -> None:
        """Add a weight-only low-bit copy used for calls with at most ``packed_max_rows`` rows."""
        if self.weight is None:
            raise RuntimeError("quantize_ needs the dense weight: call it before prepack_")
        w = self.weight.detach().float()
        if mode == "int8":
            scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8)
            self.w_int8 = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
            self.w_scales = scales.to(self.weight.dtype)
        elif mode == "int4":
            out_features, in_features = w.shape
            if in_features % group_size:
                return  # the packed int4 kernel needs whole groups; stay dense
            groups = w.view(out_features, in_features // group_size, group_size)
            lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
            scales = ((hi - lo) / 15.0).clamp(min=1e-8)
            zeros = lo + scales * 8.0  # the kernel computes (q - 8) * scale + zero
            q = torch.round((groups - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.int32)
            self.w_int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.view(out_features, in_features), 1)
            self.w_scales_zeros = (
                torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(self.weight.dtype)
            )
            self.group_size = group_size
        else:
            raise ValueError(f"unknown weight quantisation {mode!r} (use int8 or int4)")
        self.quant = mode
        self.packed_max_rows = packed_max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None and x.shape[0] <= self.packed_max_rows:
            if self.quant == "int8":
                y = torch.ops.aten._weight_int8pack_mm(x, self.w_int8, self.w_scales)
            else:
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.w_int4, self.group_size, self.w_scales_zeros)
            return y if self.bias is None else y + self.bias
        if self.onednn_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.onednn_weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def quantize_model_(model: nn.Module, mode: str, packed_max_rows: int) -> int:
    """Give every projection of ``model`` a low-bit copy; returns how many were quantised."""
    count = 0
    for module in model.modules():
        if isinstance(module, Linear):
            module.quantize_(mode, packed_max_rows)
            count += module.quant is not None
    return count


def prepack_model_(model: nn.Module) -> int:
    """oneDNN-blocked weights for every bf16 projection on CPU; returns how many."""
    return sum(module.prepack_() for module in model.modules() if isinstance(module, Linear))
