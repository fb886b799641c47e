"""BERT encoder in plain torch (the architecture of all-MiniLM-L6-v2), inference only.

Post-LayerNorm transformer with absolute position and token-type embeddings and GELU
(erf) feed-forward, as in Hugging Face's ``BertModel``, whose weight names it loads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"

    @classmethod
    def from_dict(cls, d: dict) -> BertConfig:
        if d.get("model_type", "bert") != "bert":
            raise ValueError(f"embedding model type {d.get('model_type')!r} is not supported (only BERT)")
        if d.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("only absolute position embeddings are supported")
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in names})


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        h = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.qkv = nn.Linear(h, 3 * h)  # query, key and value fused into one matmul
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.up = nn.Linear(h, cfg.intermediate_size)
        self.down = nn.Linear(cfg.intermediate_size, h)
        self.out_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.gelu_approx = "tanh" if cfg.hidden_act in ("gelu_new", "gelu_pytorch_tanh") else "none"

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, h // self.num_heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        x = self.attn_norm(x + self.attn_out(a.transpose(1, 2).reshape(b, t, h)))
        return self.out_norm(x + self.down(F.gelu(self.up(x), approximate=self.gelu_approx)))


class BertEncoder(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.cfg = cfg
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Last hidden states [batch, tokens, hidden]; padded positions are masked out of attention."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        types = token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
        x = self.norm(self.word(input_ids) + self.position(positions)[None] + self.token_type(types))
        mask = attention_mask[:, None, None, :].bool()  # [b, 1, 1, t]: keys that may be attended
        for layer in self.layers:
            x = layer(x, mask)
        return x

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face ``BertModel`` weight names (with or without the ``bert.`` prefix)."""
        sd = {k.removeprefix("bert."): v for k, v in sd.items()}
        own = {
            "word.weight": sd["embeddings.word_embeddings.weight"],
            "position.weight": sd["embeddings.position_embeddings.weight"],
            "token_type.weight": sd["embeddings.token_type_embeddings.weight"],
            "norm.weight": sd["embeddings.LayerNorm.weight"],
            "norm.bias": sd["embeddings.LayerNorm.bias"],
        }
        for i in range(self.cfg.num_hidden_layers):
            p = f"encoder.layer.{i}."
            for kind in ("weight", "bias"):
                own[f"layers.{i}.qkv.{kind}"] = torch.cat(
                    [sd[f"{p}attention.self.{n}.{kind}"] for n in ("query", "key", "value")]
                )
                own[f"layers.{i}.attn_out.{kind}"] = sd[f"{p}attention.output.dense.{kind}"]
                own[f"layers.{i}.attn_norm.{kind}"] = sd[f"{p}attention.output.LayerNorm.{kind}"]
                own[f"layers.{i}.up.{kind}"] = sd[f"{p}intermediate.dense.{kind}"]
                own[f"layers.{i}.down.{kind}"] = sd[f"{p}output.dense.{kind}"]
                own[f"layers.{i}.out_norm.{kind}"] = sd[f"{p}output.LayerNorm.{kind}"]
        self.load_state_dict(own, strict=True)
