"""Hugging Face checkpoint directories: config.json + *.safetensors, memory-mapped.

The safetensors header is parsed here and each tensor is a ``torch.frombuffer`` view of
a copy-on-write mmap of the file, so unquantised weights are used without copying.
"""

from __future__ import annotations

import json
import mmap
import os
import struct

from gemel.models import registry
from gemel.models.config import ModelArchConfig

# safetensors dtype -> torch dtype name; torch itself is imported where tensors are made, so
# that reading a checkpoint's config (the API process) does not load it.
_DTYPES = {
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F64": "float64",
    "I64": "int64",
    "I32": "int32",
}


class SafetensorsLoadError(ValueError):
    pass


def arch_config(directory: str) -> ModelArchConfig:
    path = os.path.join(directory, "config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise SafetensorsLoadError(f"{path}: cannot read model config ({exc})") from exc
    try:
        family = registry.family_for_hf(cfg.get("architectures") or [])
    except registry.UnsupportedArchitecture as exc:
        raise SafetensorsLoadError(f"{path}: {exc}") from exc
    if "text_config" in cfg:  # multimodal wrapper: the decoder's settings live here
        cfg = {**cfg, **cfg["text_config"]}
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope_params = cfg.get("rope_parameters") or {}
    full_rope = rope_params.get("full_attention", rope_params) if isinstance(rope_params, dict) else {}
    rope_theta = cfg.get("rope_theta") or full_rope.get("rope_theta") or 10000.0
    rope_scaling = cfg.get("rope_scaling")
    if rope_scaling is None and full_rope.get("rope_type", "default") != "default":
        rope_scaling = full_rope
    if rope_scaling is not None and "rope_type" not in rope_scaling and "type" in rope_scaling:
        rope_scaling = {**rope_scaling, "rope_type": rope_scaling["type"]}
    out = ModelArchConfig(
        architecture=family.name,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=cfg.get("tie_word_embeddings", family.hf_tie_word_embeddings),
        attention_bias=cfg.get("attention_bias", family.hf_attention_bias),
        rope_scaling=rope_scaling,
    )
    family.hf_config(cfg, out)
    return out


def _index_file(path: str) -> dict:
    """name -> factory for one .safetensors file."""
    import torch

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        try:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        except (struct.error, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise SafetensorsLoadError(f"{path}: not a safetensors file ({exc})") from exc
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    base = 8 + header_len
    factories = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        if base + end > size:
            raise SafetensorsLoadError(f"{path}: tensor {name!r} is truncated (needs {base + end} bytes, file has {size})")
        if info["dtype"] not in _DTYPES:
            raise SafetensorsLoadError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        dtype = getattr(torch, _DTYPES[info["dtype"]])

        def load(start=start, end=end, dtype=dtype, shape=tuple(info["shape"])):
            count = (end - start) // torch.empty((), dtype=dtype).element_size()
            if count == 0:
                return torch.empty(shape, dtype=dtype)
            return torch.frombuffer(mm, dtype=dtype, count=count, offset=base + start).reshape(shape)

        factories[name] = load
    return factories


def tensor_factories(directory: str, cfg: ModelArchConfig) -> dict:
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise SafetensorsLoadError(f"{directory}: no .safetensors files")
    factories: dict = {}
    for name in files:
        factories.update(_index_file(os.path.join(directory, name)))
    norm_offset = registry.family(cfg.architecture).hf_norm_weight_offset
    out = {}
    for name, factory in factories.items():
        name = name.replace("model.language_model.", "model.").replace("language_model.model.", "model.")
        if norm_offset and name.endswith("norm.weight"):
            # e.g. Gemma scales by (1 + w): store the sum, as GGUF does, so the model has one convention.
            factory = (lambda f: (lambda: f().float() + norm_offset))(factory)
        out[name] = factory
    return out
