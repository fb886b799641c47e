"""Named checkpoint tensors handed to a model, converted to its dtype and device on request."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

TensorFactory = Callable[[], torch.Tensor]


@dataclass
class Int4Groups:
    """A weight stored as 4-bit groups of 32 along the input dimension, in the convention of
    PyTorch's packed int4 kernel: ``w = (q - 8) * scale + zero`` per group."""

    q: torch.Tensor  # [out, in] uint8 in 0..15
    scale: torch.Tensor  # [out, in / 32] float32
    zero: torch.Tensor  # [out, in / 32] float32

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Int4Groups":
        return Int4Groups(fn(self.q), fn(self.scale), fn(self.zero))

    def dequantize(self) -> torch.Tensor:
        out_features, in_features = self.q.shape
        q = self.q.float().view(out_features, in_features // 32, 32)
        return ((q - 8.0) * self.scale[..., None] + self.zero[..., None]).view(out_features, in_features)

    @staticmethod
    def cat(parts: list["Int4Groups"]) -> "Int4Groups":
        return Int4Groups(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "scale", "zero")))


@dataclass
class Int8Groups:
    """A weight stored as int8 groups along the input dimension, ``w = q * scale`` per group:
    groups of 32 (GGUF Q8_0, and Q5_0 as q - 16) or of 16 (GGUF Q6_K, as q - 32)."""

    q: torch.Tensor  # [out, in] int8
    scale: torch.Tensor  # [out, in / group_size] float32

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Int8Groups":
        return Int8Groups(fn(self.q), fn(self.scale))

    def dequantize(self) -> torch.Tensor:
        out_features, in_features = self.q.shape
        group = self.group_size
        return (self.q.float().view(out_features, in_features // group, group) * self.scale[..., None]).view(
            out_features, in_features
        )

    def with_group_size(self, group: int) -> "Int8Groups":
        """The same weights with each scale repeated over groups of ``group`` (a divisor of this one's)."""
        return Int8Groups(self.q, self.scale.repeat_interleave(self.group_size // group, dim=1))

    @staticmethod
    def cat(parts: list["Int8Groups"]) -> "Int8Groups":
        finest = min(p.group_size for p in parts)  # a fused projection takes its finest parts' groups
        parts = [p.with_group_size(finest) if p.group_size != finest else p for p in parts]
        return Int8Groups(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))


Int4Factory = Callable[[], Int4Groups]
Int8Factory = Callable[[], Int8Groups]


class WeightSource:
    """Lazy name -> tensor map. Factories run on first use so quantised tensors are
    dequantised one at a time; memory-mapped tensors already in the target dtype and
    device are returned as they are (no copy)."""

    def __init__(
        self,
        factories: dict[str, TensorFactory],
        dtype: torch.dtype,
        device: torch.device,
        origin: str,
        int4_factories: dict[str, Int4Factory] | None = None,
        int8_factories: dict[str, Int8Factory] | None = None,
    ):
        self.factories = factories
        self.int4_factories = int4_factories or {}
        self.int8_factories = int8_factories or {}
        self.dtype = dtype
        self.device = device
        self.origin = origin
        self.used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.factories

    def get(self, name: str, dtype: torch.dtype | None = None, required: bool = True) -> torch.Tensor | None:
        factory = self.factories.get(name)
        if factory is None:
            if required:
                raise KeyError(f"{self.origin}: tensor {name!r} is missing from the checkpoint")
            return None
        self.used.add(name)
        try:
            tensor = factory()
        except Exception as exc:  # name the file and tensor, whatever went wrong underneath
            raise ValueError(f"{self.origin}: cannot read tensor {name!r}: {exc}") from exc
        return tensor.to(device=self.device, dtype=dtype or self.dtype)

    def int4_groups(self, names: list[str]) -> Int4Groups | None:
        """The checkpoint's own 4-bit groups of these tensors (stacked along the output
        dimension), or None unless every one of them is stored that way."""
        return self._stored_groups(self.int4_factories, Int4Groups.cat, names, "4-bit")

    def int8_groups(self, names: list[str]) -> Int8Groups | None:
        """Likewise for int8 groups (GGUF Q8_0)."""
        return self._stored_groups(self.int8_factories, Int8Groups.cat, names, "int8")

    def _stored_groups(self, factories: dict, cat: Callable, names: list[str], kind: str):
        if not names or any(n not in factories for n in names):
            return None
        try:
            return cat([factories[n]() for n in names])
        except Exception as exc:
            raise ValueError(f"{self.origin}: cannot read the {kind} groups of {names}: {exc}") from exc
