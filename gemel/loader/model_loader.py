"""One entry point: a source (path or packaged name) -> model, tokenizer, architecture config."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gemel.loader import sources
from gemel.loader.tokenizer import Tokenizer
from gemel.models import registry
from gemel.models.config import ModelArchConfig

if TYPE_CHECKING:  # torch loads with the weights (load_model), not with the metadata
    import torch


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Tokenizer
    arch: ModelArchConfig
    path: str


def model_class(architecture: str) -> type[torch.nn.Module]:
    """The model class of a family (a ModelArchConfig.architecture); ValueError if none."""
    return registry.family(architecture).model_class()


def load_arch_and_tokenizer(path: str) -> tuple[ModelArchConfig, Tokenizer, dict, dict, dict]:
    """Architecture, tokenizer, dense tensor factories and (GGUF only) the factories of the
    tensors stored as 4-bit and as int8 groups."""
    return _read(path, with_weights=True)


def read_arch_and_tokenizer(path: str) -> tuple[ModelArchConfig, Tokenizer]:
    """Architecture and tokenizer only: what the API process needs, read without the weights'
    factories and without loading torch (about 180 MB of the process's memory)."""
    arch, tokenizer, *_ = _read(path, with_weights=False)
    return arch, tokenizer


def _read(path: str, with_weights: bool) -> tuple[ModelArchConfig, Tokenizer, dict, dict, dict]:
    if os.path.isdir(path):
        from gemel.loader import safetensors_loader

        arch = safetensors_loader.arch_config(path)
        factories = safetensors_loader.tensor_factories(path, arch) if with_weights else {}
        return arch, Tokenizer.from_pretrained_dir(path), factories, {}, {}
    from gemel.loader import gguf_loader

    reader = gguf_loader.open_gguf(path)
    arch = gguf_loader.arch_config(reader, path)
    tokenizer = Tokenizer.from_gguf(reader, path)
    if not with_weights:
        return arch, tokenizer, {}, {}, {}
    return (
        arch,
        tokenizer,
        gguf_loader.tensor_factories(reader, arch),
        gguf_loader.int4_group_factories(reader, arch),
        gguf_loader.int8_group_factories(reader, arch),
    )


def stores_weight_groups(source: str) -> bool:
    """Whether a checkpoint keeps projections in quantised groups (a GGUF's Q4_0, Q4_1, Q4_K,
    Q5_0, Q6_K or Q8_0 blocks), which the CPU's integer kernels compute with as they are; reads
    the file's metadata only."""
    path = sources.resolve(source)
    if os.path.isdir(path):
        return False
    from gemel.loader import gguf_loader

    reader = gguf_loader.open_gguf(path)
    arch = gguf_loader.arch_config(reader, path)
    return bool(gguf_loader.int4_group_factories(reader, arch) or gguf_loader.int8_group_factories(reader, arch))


def load_model(source: str, dtype: torch.dtype, device: torch.device, max_model_len: int | None = None) -> LoadedModel:
    import torch

    from gemel.models.weights import WeightSource

    path = sources.resolve(source)
    arch, tokenizer, factories, int4_factories, int8_factories = load_arch_and_tokenizer(path)
    weights = WeightSource(factories, dtype, device, origin=path, int4_factories=int4_factories,
                           int8_factories=int8_factories)
    max_positions = min(max_model_len or arch.max_position_embeddings, arch.max_position_embeddings)
    with torch.inference_mode():
        model = model_class(arch.architecture)(arch, weights, device, max_positions).eval()
    return LoadedModel(model=model, tokenizer=tokenizer, arch=arch, path=path)
