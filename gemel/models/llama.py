"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2 with its q/k/v bias)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemel.layers import decode_layers, fused
from gemel.layers.attention import AttentionMetadata, paged_attention
from gemel.layers.layernorm import rms_norm_llama
from gemel.layers.kv_cache import kernels_take
from gemel.layers.linear import Linear, gated_mlp
from gemel.layers.output_rows import keep_rows
from gemel.layers.rotary_embedding import RotaryEmbedding, apply_rotary
from gemel.models.config import ModelArchConfig
from gemel.models.weights import WeightSource


class LlamaLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, w: WeightSource, i: int):
        super().__init__()
        p = f"model.layers.{i}."
        self.cfg = cfg
        self.input_norm = nn.Parameter(w.get(p + "input_layernorm.weight"), requires_grad=False)
        self.post_attn_norm = nn.Parameter(w.get(p + "post_attention_layernorm.weight"), requires_grad=False)
        names = ["q_proj", "k_proj", "v_proj"]
        biases = [p + f"self_attn.{n}.bias" for n in names] if cfg.attention_bias else None
        self.qkv_proj = Linear.load(w, [p + f"self_attn.{n}.weight" for n in names], biases)
        self.o_proj = Linear.load(w, [p + "self_attn.o_proj.weight"])
        self.gate_up_proj = Linear.load(w, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])
        self.gate_up_proj.gate_up = True  # silu(gate) * up follows: its AMX tiles can fuse it
        self.down_proj = Linear.load(w, [p + "mlp.down_proj.weight"])

    def forward(self, x, cos, sin, meta: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor],
                rows: torch.Tensor | None = None):
        """``rows``: only these rows of the output are wanted (the model's last layer in a
        step with prompt tokens); every row's K and V still reach the cache."""
        cfg = self.cfg
        h = rms_norm_llama(x, self.input_norm, cfg.rms_norm_eps)
        q, k, v = self.qkv_proj(h).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = apply_rotary(q.view(-1, cfg.num_heads, cfg.head_dim), cos, sin)
        k = apply_rotary(k.view(-1, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        attn = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, cfg.attn_scale)
        x, attn = keep_rows(x, attn, rows)
        x = x + self.o_proj(attn)
        h = rms_norm_llama(x, self.post_attn_norm, cfg.rms_norm_eps)
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)

    def forward_fused(
        self, x, mlp_out, cos, sin, meta: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor],
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same layer with the element-wise ops fused (CPU, eager; see layers/fused.py).

        ``mlp_out`` is the previous layer's MLP output (None for the first layer), not yet
        added to the residual stream ``x``: the add is fused with this layer's input norm.
        Returns the residual stream and this layer's MLP output, likewise pending."""
        cfg = self.cfg
        if mlp_out is None:
            h = fused.rms_norm_llama(x, self.input_norm, cfg.rms_norm_eps)
        else:
            x, h = fused.add_rms_norm_llama(x, mlp_out, self.input_norm, cfg.rms_norm_eps)
        qkv = self.qkv_proj(h)
        if kernels_take(qkv.dtype, kv_cache[0]):
            q = fused.rotary_q_store_kv(qkv, cos, sin, kv_cache, meta.slot_mapping, cfg.num_heads, cfg.num_kv_heads,
                                        cfg.head_dim)
            k = v = None  # already in the cache
        else:
            q, k = fused.rotary_qk(qkv, cos, sin, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
            v = qkv[:, cfg.q_size + cfg.kv_size :].view(-1, cfg.num_kv_heads, cfg.head_dim)
        attn = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, cfg.attn_scale)
        x, attn = keep_rows(x, attn, rows)
        x, h = fused.add_rms_norm_llama(x, self.o_proj(attn), self.post_attn_norm, cfg.rms_norm_eps)
        return x, gated_mlp(self.gate_up_proj, self.down_proj, h)


class LlamaForCausalLM(nn.Module):
    supports_fused_ops = True  # layers/fused.py

    def __init__(self, cfg: ModelArchConfig, w: WeightSource, device: torch.device, max_positions: int):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Parameter(w.get("model.embed_tokens.weight"), requires_grad=False)
        self.layers = nn.ModuleList(LlamaLayer(cfg, w, i) for i in range(cfg.num_layers))
        self.norm = nn.Parameter(w.get("model.norm.weight"), requires_grad=False)
        if not cfg.tie_word_embeddings and "lm_head.weight" in w:
            self.lm_head = Linear.load(w, ["lm_head.weight"])
        else:
            self.lm_head = Linear.tied(self.embed_tokens, w, "model.embed_tokens.weight")
        scaling = cfg.rope_scaling or {}
        self.rotary = RotaryEmbedding(
            cfg.head_dim,
            max_positions,
            cfg.rope_theta,
            device,
            linear_factor=scaling.get("factor", 1.0) if scaling.get("rope_type") == "linear" else 1.0,
            llama3_scaling=scaling if scaling.get("rope_type") == "llama3" else None,
        )

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches,
                output_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states of every row, or of ``output_rows`` alone (in that order):
        then the last layer's attention output, MLP and the final norm run for those rows only."""
        last = min(len(self.layers), len(kv_caches)) - 1
        if self.embed_tokens is not None:
            x = F.embedding(input_ids, self.embed_tokens)
        else:  # the table was handed to the tied LM head's codes (linear.share_tied_table_)
            x = self.lm_head.embedding_rows(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        if fused.use_fused(meta):
            whole_step = decode_layers.for_step(self, x, meta, kv_caches, gemma=False)
            if whole_step is not None:
                return whole_step(x, [(cos, sin)], meta)
            mlp_out = None
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
                x, mlp_out = layer.forward_fused(x, mlp_out, cos, sin, meta, kv_cache, output_rows if i == last else None)
            return fused.add_rms_norm_llama(x, mlp_out, self.norm, self.cfg.rms_norm_eps)[1]
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x = layer(x, cos, sin, meta, kv_cache, output_rows if i == last else None)
        return rms_norm_llama(x, self.norm, self.cfg.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The logits' argmax per row where the LM head can find it without writing the
        logits; None where it cannot."""
        return self.lm_head.argmax(hidden)
