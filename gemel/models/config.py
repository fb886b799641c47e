"""Architecture hyper-parameters, one dataclass for every supported family."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelArchConfig:
    architecture: str  # a family name in gemel.models.registry
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    rope_scaling: dict | None = None  # {"rope_type": "llama3"|"linear", ...}
    # Gemma 3
    rope_local_theta: float = 10000.0
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)  # "sliding_attention" | "full_attention"
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    @property
    def attn_scale(self) -> float:
        if self.query_pre_attn_scalar:
            return self.query_pre_attn_scalar**-0.5
        return self.head_dim**-0.5

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim
