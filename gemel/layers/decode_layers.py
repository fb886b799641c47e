"""A decode step's layers in one C++ call (``csrc/decode_layers.cpp``).

At batch 1 a step of a small model is about 250 kernel calls of a few to a few tens of
microseconds each, and calling each from Python (the module call, PyTorch's dispatcher, the
layer's glue) costs 3-4 us more: on an AVX2 CPU over a millisecond of a ~7 ms SmolLM2 step.
The C++ object runs the same kernels in the same order as the models' fused eager path
(``forward_fused``), so its results are that path's, bit for bit.

It serves the steps it can: every projection on ``int8_act_gemm`` with no bias (the AVX2
class's plan), caches the kernels take, and a step of decodes alone in one attention group
(no prefix shared by the whole batch). Any other step, and any model or plan it does not
cover, runs the Python path.
"""

from __future__ import annotations

import torch

from gemel.layers.attention import AttentionMetadata
from gemel.layers.kv_cache import kernels_take


class DecodeLayers:
    """One model's layers and KV cache handed to the C++ ``torch.classes.gemel.DecodeLayers``
    once; each step then passes only its own inputs. ``gemma``: Gemma 3's layer (post-norms,
    QK-norm, GeGLU, sliding windows) instead of Llama's."""

    def __init__(self, model: torch.nn.Module, kv_caches, gemma: bool):
        cfg = model.cfg
        self.k_caches = [k for k, _ in kv_caches]
        norms: list[torch.Tensor] = []
        codes: list[torch.Tensor] = []
        scales: list[torch.Tensor] = []
        lows: list[torch.Tensor] = []
        out_features: list[int] = []
        zero_points: list[int] = []
        self.sliding: list[bool] = []
        for layer in model.layers:
            if gemma:
                norms += [layer.input_norm, layer.post_attn_norm, layer.pre_ffn_norm, layer.post_ffn_norm,
                          layer.q_norm, layer.k_norm]
                self.sliding.append(layer.sliding)
            else:
                norms += [layer.input_norm, layer.post_attn_norm]
                self.sliding.append(False)
            for proj in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
                c, scale, low = proj._int8_act_args
                codes.append(c)
                scales.append(scale)
                lows.append(low)
                out_features.append(proj.int8_act_out_features)
                zero_points.append(proj.int8_act_zero_point)
        rope_index = [int(sliding) for sliding in self.sliding]  # rotary table 0: global, 1: local
        self.program = torch.classes.gemel.DecodeLayers(
            norms, model.norm, codes, scales, lows, out_features, zero_points, self.k_caches,
            [v for _, v in kv_caches], rope_index, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps,
            cfg.attn_scale, gemma,
        )

    @staticmethod
    def supports(model: torch.nn.Module, kv_caches, dtype: torch.dtype, gemma: bool) -> bool:
        """Whether every layer of ``model`` is what the C++ object computes: projections all on
        int8_act_gemm without bias, caches the kernels take (Gemma 3: in float32 only, where
        its norms are the fused ops' arithmetic)."""
        if not _has_class() or (gemma and dtype != torch.float32):
            return False
        if not all(kernels_take(dtype, k) for k, _ in kv_caches):
            return False
        projections = [p for layer in model.layers
                       for p in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]
        return all(p._every_call_int8_act() and p.bias is None for p in projections)

    def serves(self, kv_caches) -> bool:
        """Whether this was gathered for these caches (the runner's list is rebuilt per step)."""
        return len(kv_caches) == len(self.k_caches) and kv_caches[0][0] is self.k_caches[0]

    @staticmethod
    def takes(meta: AttentionMetadata) -> bool:
        """Whether the step is decodes alone, read in place as one attention group."""
        if not meta.decode_kernel or len(meta.groups) != 1:
            return False
        group = meta.groups[0]
        return group.is_decode and group.shared_slots is None and group.token_slice == (0, meta.num_tokens)

    def __call__(self, x: torch.Tensor, rope: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """The final norm of the residual stream after every layer, as the model's forward returns it.
        ``rope``: the step's (cos, sin) tables, global then (Gemma 3) local; a sliding layer uses the local one."""
        group = meta.groups[0]
        windows = [group.sliding_window if sliding else 0 for sliding in self.sliding]
        return self.program.run(x.contiguous(), [c for c, _ in rope], [s for _, s in rope], windows,
                                meta.slot_mapping, group.kv_slots, group.context_lens)


def _has_class() -> bool:
    """Whether the loaded kernels define the C++ class (a kernel library built before it did not)."""
    try:
        torch.classes.gemel.DecodeLayers  # noqa: B018 (a lookup that raises when absent)
    except (AttributeError, RuntimeError):
        return False
    return True


def for_step(model: torch.nn.Module, x: torch.Tensor, meta: AttentionMetadata, kv_caches, gemma: bool) -> DecodeLayers | None:
    """The model's DecodeLayers where this step can take it, else None (the Python path).
    Gathered on first use and kept on the model (``model._decode_layers``; False: never)."""
    if not DecodeLayers.takes(meta) or len(kv_caches) != len(model.layers):  # e.g. a draft of the first layers
        return None
    program = getattr(model, "_decode_layers", None)
    if program is None or (program is not False and not program.serves(kv_caches)):
        program = DecodeLayers(model, kv_caches, gemma) if DecodeLayers.supports(model, kv_caches, x.dtype, gemma) else False
        model._decode_layers = program
    return program or None
