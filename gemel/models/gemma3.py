"""Gemma 3 text decoder: sliding-window and global layers, QK-norm, GeGLU, scaled tied embeddings.

Norm weights arrive with the 1 already added (the GGUF convention; the safetensors loader
adds it), so every RMSNorm here is a plain float32 scale.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemel.layers import decode_layers, fused
from gemel.layers.attention import AttentionMetadata, paged_attention
from gemel.layers.kv_cache import kernels_take
from gemel.layers.layernorm import rms_norm_gemma
from gemel.layers.linear import Linear
from gemel.layers.output_rows import keep_rows
from gemel.layers.rotary_embedding import RotaryEmbedding, apply_rotary
from gemel.models.config import ModelArchConfig
from gemel.models.weights import WeightSource


def _norm(w: WeightSource, name: str) -> nn.Parameter:
    return nn.Parameter(w.get(name, dtype=torch.float32), requires_grad=False)


def _fused_norm(x: torch.Tensor, weight_plus_one: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm_gemma`` for float32 x as one C++ op: in float32 Gemma's and Llama's rounding
    orders are the same arithmetic, so the fused Llama norm serves (rows of the last dimension)."""
    return torch.ops.gemel.rms_norm(x.reshape(-1, x.shape[-1]), weight_plus_one, eps).view(x.shape)


class Gemma3Layer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, w: WeightSource, i: int):
        super().__init__()
        p = f"model.layers.{i}."
        self.cfg = cfg
        self.sliding = cfg.is_sliding(i)
        self.input_norm = _norm(w, p + "input_layernorm.weight")
        self.post_attn_norm = _norm(w, p + "post_attention_layernorm.weight")
        self.pre_ffn_norm = _norm(w, p + "pre_feedforward_layernorm.weight")
        self.post_ffn_norm = _norm(w, p + "post_feedforward_layernorm.weight")
        self.q_norm = _norm(w, p + "self_attn.q_norm.weight")
        self.k_norm = _norm(w, p + "self_attn.k_norm.weight")
        self.qkv_proj = Linear.load(w, [p + f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj")])
        self.o_proj = Linear.load(w, [p + "self_attn.o_proj.weight"])
        self.gate_up_proj = Linear.load(w, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])
        self.down_proj = Linear.load(w, [p + "mlp.down_proj.weight"])

    def forward(self, x, rope, meta: AttentionMetadata, kv_cache, rows: torch.Tensor | None = None):
        """``rows``: only these rows of the output are wanted (the model's last layer in a
        step with prompt tokens); every row's K and V still reach the cache."""
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        cos, sin = rope[self.sliding]
        # float32 eager steps with the C++ kernels: each norm one op instead of five
        norm = _fused_norm if x.dtype == torch.float32 and fused.use_fused(meta) else rms_norm_gemma
        h = norm(x, self.input_norm, eps)
        q, k, v = self.qkv_proj(h).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = norm(q.reshape(-1, cfg.num_heads, cfg.head_dim), self.q_norm, eps)
        k = norm(k.reshape(-1, cfg.num_kv_heads, cfg.head_dim), self.k_norm, eps)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        attn = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, cfg.attn_scale, self.sliding)
        x, attn = keep_rows(x, attn, rows)
        x = x + norm(self.o_proj(attn), self.post_attn_norm, eps)
        h = norm(x, self.pre_ffn_norm, eps)
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        h = self.down_proj(F.gelu(gate, approximate="tanh") * up)
        return x + norm(h, self.post_ffn_norm, eps)

    def forward_fused(self, x, mlp_out, prev_post_ffn_norm, rope, meta: AttentionMetadata, kv_cache,
                      rows: torch.Tensor | None = None):
        """The same layer in float32 with the C++ fused ops: the post-norms, residual adds and
        pre-norms one op each, QK-norm and rotary with the KV store one op, GeGLU one op (caches
        the kernels take: every float32 one).

        ``mlp_out`` is the previous layer's MLP output (None for the first layer), not yet
        normed by ``prev_post_ffn_norm`` nor added to the residual stream ``x``. Returns the
        residual stream and this layer's MLP output, likewise pending."""
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        cos, sin = rope[self.sliding]
        if mlp_out is None:
            h = _fused_norm(x, self.input_norm, eps)
        else:
            x, h = fused.norm_add_rms_norm(x, mlp_out, prev_post_ffn_norm, self.input_norm, eps)
        q = fused.rotary_q_store_kv(self.qkv_proj(h), cos, sin, kv_cache, meta.slot_mapping, cfg.num_heads,
                                    cfg.num_kv_heads, cfg.head_dim, qk_norm=(self.q_norm, self.k_norm), norm_eps=eps)
        attn = paged_attention(q, None, None, kv_cache[0], kv_cache[1], meta, cfg.attn_scale, self.sliding)
        x, attn = keep_rows(x, attn, rows)
        x, h = fused.norm_add_rms_norm(x, self.o_proj(attn), self.post_attn_norm, self.pre_ffn_norm, eps)
        return x, self.down_proj(fused.gelu_tanh_and_mul(self.gate_up_proj(h)))


class Gemma3ForCausalLM(nn.Module):
    supports_fused_ops = True  # its norms in float32 (layers/fused.py)

    def __init__(self, cfg: ModelArchConfig, w: WeightSource, device: torch.device, max_positions: int):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Parameter(w.get("model.embed_tokens.weight"), requires_grad=False)
        self.layers = nn.ModuleList(Gemma3Layer(cfg, w, i) for i in range(cfg.num_layers))
        self.norm = _norm(w, "model.norm.weight")
        if not cfg.tie_word_embeddings and "lm_head.weight" in w:
            self.lm_head = Linear.load(w, ["lm_head.weight"])
        else:
            self.lm_head = Linear.tied(self.embed_tokens, w, "model.embed_tokens.weight")
        scaling = cfg.rope_scaling or {}
        factor = scaling.get("factor", 1.0) if scaling.get("rope_type") == "linear" else 1.0
        self.global_rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, device, linear_factor=factor)
        self.local_rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_local_theta, device)
        self.embed_scale = cfg.hidden_size**0.5

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches,
                output_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states of every row, or of ``output_rows`` alone (in that order):
        then the last layer's attention output, MLP and the final norm run for those rows only."""
        last = min(len(self.layers), len(kv_caches)) - 1
        if self.embed_tokens is not None:
            x = F.embedding(input_ids, self.embed_tokens)
        else:  # the table was handed to the tied LM head's codes (linear.share_tied_table_)
            x = self.lm_head.embedding_rows(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        rope = {
            False: self.global_rope.cos_sin(positions, x.dtype),
            True: self.local_rope.cos_sin(positions, x.dtype),
        }
        if x.dtype == torch.float32 and fused.use_fused(meta) and kernels_take(x.dtype, kv_caches[0][0]):
            whole_step = decode_layers.for_step(self, x, meta, kv_caches, gemma=True)
            if whole_step is not None:
                return whole_step(x, [rope[False], rope[True]], meta)
            mlp_out, post_ffn_norm = None, None
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
                rows = output_rows if i == last else None
                x, mlp_out = layer.forward_fused(x, mlp_out, post_ffn_norm, rope, meta, kv_cache, rows)
                post_ffn_norm = layer.post_ffn_norm
            return fused.norm_add_rms_norm(x, mlp_out, post_ffn_norm, self.norm, self.cfg.rms_norm_eps)[1]
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x = layer(x, rope, meta, kv_cache, output_rows if i == last else None)
        norm = _fused_norm if x.dtype == torch.float32 and fused.use_fused(meta) else rms_norm_gemma
        return norm(x, self.norm, self.cfg.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.cfg.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The logits' argmax per row where the LM head can find it without writing the
        logits; None where it cannot. Not under a soft cap: tanh keeps the order of the
        logits, but its rounding can tie two of them that were not tied."""
        return None if self.cfg.final_logit_softcapping else self.lm_head.argmax(hidden)
