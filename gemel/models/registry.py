"""The model families gemel runs, one entry each.

An entry says which checkpoints a family serves (the Hugging Face ``architectures`` names
of a config.json, the ``general.architecture`` of a GGUF file), how its tensor names and
config keys differ from the common Llama-style case, and which model class builds it. The
loaders hold no family names of their own, so a new family is its model module plus one
entry in ``_FAMILIES``.

Nothing here imports torch or a model module when this module is imported: the API process
reads a checkpoint's config through this table without loading either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from gemel.models.config import ModelArchConfig

if TYPE_CHECKING:
    from torch import nn

# key(name, default=None) -> the value of the GGUF metadata key "<gguf architecture>.<name>"
GGUFKey = Callable[..., Any]


class UnsupportedArchitecture(ValueError):
    """No family serves the architecture asked for; the message lists the ones that are served."""


def _no_hf_config(config: dict, out: ModelArchConfig) -> None:
    """The common keys the loader reads are all there is to this family's config.json."""


def _no_gguf_config(key: GGUFKey, out: ModelArchConfig) -> None:
    """The common keys the loader reads are all there is to this family's GGUF metadata."""


@dataclass(frozen=True)
class ModelFamily:
    """One architecture family and what the loaders need to know about it."""

    name: str  # the ModelArchConfig.architecture of this family's checkpoints
    model_class: Callable[[], type[nn.Module]]  # imports the model module only when called
    hf_architectures: tuple[str, ...]  # config.json "architectures" entries served
    gguf_architecture: str  # GGUF "general.architecture", also the prefix of its metadata keys
    # What config.json means when it leaves these keys out.
    hf_tie_word_embeddings: bool = False
    hf_attention_bias: bool = False
    # Added to every "*norm.weight" of a safetensors checkpoint, so that the model sees one
    # convention whatever the file format (Gemma stores w and scales by 1 + w; GGUF stores 1 + w).
    hf_norm_weight_offset: float = 0.0
    # The Hugging Face name of llama.cpp's "blk.N.ffn_norm" (the norm in front of the MLP).
    gguf_ffn_norm: str = "post_attention_layernorm"
    # llama.cpp's converter interleaved the q/k projection rows for its RoPE (Llama only).
    gguf_rope_permuted: bool = False
    # Fill in the family's own fields of a config the loader built from the common keys.
    hf_config: Callable[[dict, ModelArchConfig], None] = _no_hf_config
    gguf_config: Callable[[GGUFKey, ModelArchConfig], None] = _no_gguf_config


def _llama_class() -> type[nn.Module]:
    from gemel.models.llama import LlamaForCausalLM

    return LlamaForCausalLM


def _gemma3_class() -> type[nn.Module]:
    from gemel.models.gemma3 import Gemma3ForCausalLM

    return Gemma3ForCausalLM


def _gemma3_hf_config(config: dict, out: ModelArchConfig) -> None:
    """Gemma 3's sliding-window layout (every sixth layer global unless config.json lists the
    layer types), local RoPE base, attention scale and logit soft-cap."""
    rope_params = config.get("rope_parameters") or {}
    local_rope = rope_params.get("sliding_attention", {}) if isinstance(rope_params, dict) else {}
    out.sliding_window = config.get("sliding_window", 512)
    pattern = config.get("sliding_window_pattern", 6)
    out.layer_types = config.get("layer_types") or [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(out.num_layers)
    ]
    out.rope_local_theta = float(config.get("rope_local_base_freq") or local_rope.get("rope_theta") or 10000.0)
    out.query_pre_attn_scalar = config.get("query_pre_attn_scalar", out.head_dim)
    out.final_logit_softcapping = config.get("final_logit_softcapping")


def _gemma3_gguf_config(key: GGUFKey, out: ModelArchConfig) -> None:
    """llama.cpp's Gemma 3 layout: every sixth layer global, the rest sliding; local RoPE base 10k."""
    out.sliding_window = int(key("attention.sliding_window", 512))
    out.layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(out.num_layers)]
    out.rope_local_theta = 10000.0
    out.query_pre_attn_scalar = float(out.head_dim)
    softcap = key("final_logit_softcapping")
    out.final_logit_softcapping = float(softcap) if softcap else None


_FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily(
        name="llama",  # Llama 2/3, SmolLM2; Mistral's dense models are the same decoder
        model_class=_llama_class,
        hf_architectures=("LlamaForCausalLM", "MistralForCausalLM"),
        gguf_architecture="llama",
        gguf_rope_permuted=True,
    ),
    ModelFamily(
        name="qwen2",  # the Llama decoder with q/k/v biases
        model_class=_llama_class,
        hf_architectures=("Qwen2ForCausalLM",),
        gguf_architecture="qwen2",
        hf_attention_bias=True,
    ),
    ModelFamily(
        name="gemma3",
        model_class=_gemma3_class,
        hf_architectures=("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
        gguf_architecture="gemma3",
        hf_tie_word_embeddings=True,
        hf_norm_weight_offset=1.0,
        gguf_ffn_norm="pre_feedforward_layernorm",  # Gemma 3 has a post-attention norm of its own
        hf_config=_gemma3_hf_config,
        gguf_config=_gemma3_gguf_config,
    ),
)


def families() -> tuple[ModelFamily, ...]:
    return _FAMILIES


def supported_names() -> tuple[str, ...]:
    return tuple(f.name for f in _FAMILIES)


def supported_hf_architectures() -> list[str]:
    return sorted(a for f in _FAMILIES for a in f.hf_architectures)


def supported_gguf_architectures() -> tuple[str, ...]:
    return tuple(f.gguf_architecture for f in _FAMILIES)


def family(name: str) -> ModelFamily:
    """The family of a ModelArchConfig.architecture."""
    for f in _FAMILIES:
        if f.name == name:
            return f
    raise UnsupportedArchitecture(f"architecture {name!r} is not supported (supported: {supported_names()})")


def family_for_hf(architectures: list[str]) -> ModelFamily:
    """The family of the first config.json ``architectures`` entry that one serves."""
    for arch in architectures:
        for f in _FAMILIES:
            if arch in f.hf_architectures:
                return f
    raise UnsupportedArchitecture(
        f"architectures {architectures} not supported (supported: {supported_hf_architectures()})"
    )


def family_for_gguf(name: str) -> ModelFamily:
    """The family of a GGUF file's ``general.architecture``."""
    for f in _FAMILIES:
        if f.gguf_architecture == name:
            return f
    raise UnsupportedArchitecture(
        f"architecture {name!r} is not supported (supported: {supported_gguf_architectures()})"
    )
