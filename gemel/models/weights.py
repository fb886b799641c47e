"""Named checkpoint tensors handed to a model, converted to its dtype and device on request."""

from __future__ import annotations

from collections.abc import Callable

import torch

TensorFactory = Callable[[], torch.Tensor]


class WeightSource:
    """Lazy name -> tensor map. Factories run on first use so quantised tensors are
    dequantised one at a time; memory-mapped tensors already in the target dtype and
    device are returned as they are (no copy)."""

    def __init__(self, factories: dict[str, TensorFactory], dtype: torch.dtype, device: torch.device, origin: str):
        self.factories = factories
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
