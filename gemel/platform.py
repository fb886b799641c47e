"""Device and dtype choice: CUDA with bf16 when present; on CPU, bf16 only where the hardware
computes it natively (AMX or AVX512-BF16, at the instruction-set level the engine runs) and the
integer kernels do not serve the checkpoint better (``kernel_plan.auto_dtype_is_bf16``), else
float32. A bf16 asked for by name on a CPU without it is computed by PyTorch's portable kernels:
correct, and slower than float32."""

from __future__ import annotations

from collections.abc import Callable

import torch

from gemel.layers import kernel_plan

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_native_bf16(cpu_isa: str = "auto") -> bool:
    return kernel_plan.native_bf16(kernel_plan.resolve_isa(cpu_isa))


def select_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but no CUDA device is available")
    return torch.device(name)


def select_dtype(
    name: str, device: torch.device, cpu_isa: str = "auto", weight_groups: Callable[[], bool] = lambda: False
) -> torch.dtype:
    """``weight_groups``: whether the checkpoint stores its projections in quantised groups
    (``model_loader.stores_weight_groups``), asked only where the answer decides (a CPU with
    native bf16 below AMX): reading a GGUF's index takes about half a second."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16
    isa = kernel_plan.resolve_isa(cpu_isa)
    if not kernel_plan.native_bf16(isa):
        return torch.float32
    if isa == "amx":  # bf16 whatever the checkpoint (kernel_plan.auto_dtype_is_bf16): not read
        return torch.bfloat16
    from gemel.layers import cpu_kernels

    groups = weight_groups()
    integer_kernels = groups and bool(cpu_kernels.load(isa))
    return torch.bfloat16 if kernel_plan.auto_dtype_is_bf16(isa, groups, integer_kernels) else torch.float32
