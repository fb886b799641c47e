"""Dense projection, optionally with a weight-only int8/int4 copy for small batches.

At one or a few rows a decode step is bound by reading weights, so PyTorch's packed
low-bit CPU kernels (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``) win; at many
rows the bf16/fp32 GEMM wins. A quantised ``Linear`` keeps both and picks per call by the
number of rows (``packed_max_rows``). Weights the checkpoint stores as int8 groups (GGUF
Q8_0, typically the embedding that doubles as the LM head) use gemel's own C++ kernel on
those groups instead (``torch.ops.gemel.int8_group_mm``). On CPUs with AVX512-VNNI, 4-bit
groups go through gemel's integer-dot-product kernel (``torch.ops.gemel.int4_group_mm``,
x carried as two int8 codes per value, finer than bf16): 2-3x faster than PyTorch's int4
kernel at one row.

On a CPU with oneDNN, bf16 weights are also reordered once into oneDNN's blocked layout
(``prepack_``): the same kernel family as ``F.linear`` with bitwise-equal results, but
without re-laying-out the weight on every call, which is 1.2-2x faster at decode sizes.
On CPUs with AMX, decode-sized calls take gemel's own tile kernel on a copy of the weight
in AMX's tile layout (``add_amx_tiles_``, ``torch.ops.gemel.amx_bf16_gemm``): the same
bf16 arithmetic, faster where the weight streams from memory for a few dozen rows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gemel.layers import cpu_kernels
from gemel.layers.kernel_plan import (  # noqa: F401 - the row thresholds, re-exported for callers
    bf16_gemm_supported,
    AMX_INT8_ACT_MAX_ROWS,
    AMX_INT8_GROUPS_MAX_ROWS,
    AMX_TILE_MAX_ROWS,
    WEIGHT_ONLY_KERNEL_MAX_ROWS,
    KernelPlan,
)
from gemel.models.weights import Int4Groups, Int8Groups, WeightSource


# amx_bf16_gemm's `gated` argument: what the tiles' output pairs hold and what a call writes.
AMX_PLAIN, AMX_GATE_UP, AMX_SILU_MUL = 0, 1, 2


class Linear(nn.Module):
    """y = x W^T (+ b)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.quant: str | None = None
        self.packed_max_rows = 0
        self.onednn_weight: torch.Tensor | None = None  # blocked copy from prepack_()
        # Reads the checkpoint's own 4-bit groups of this weight, when it stores them (GGUF Q4_0/Q4_1).
        self.checkpoint_int4: Callable[[], Int4Groups | None] | None = None
        # Likewise for int8 groups (GGUF Q8_0).
        self.checkpoint_int8: Callable[[], Int8Groups | None] | None = None
        self.int8_act_out_features = 0  # > 0 once add_int8_activation_gemm_() packed the groups
        self._int8_act_args: tuple[torch.Tensor, ...] = ()  # act_codes, act_scale, act_low
        self.int8_act_zero_point = 0  # w = scale * (codes - this) when > 0 (Q4_0, Q8_0); else low is used
        self.int8_act_max_rows: int | None = None  # larger calls take the bf16 GEMM (None: no limit)
        self.amx_max_rows = 0  # > 0 once add_amx_tiles_() laid the weight out as AMX tiles
        self.amx_out_features = 0
        self.amx_layout = AMX_PLAIN  # AMX_GATE_UP: tiles pair each gate block with its up block
        # Set by a model whose output is a gated MLP's [gate | up] halves (silu(gate) * up follows).
        self.gate_up = False
        # An LM head that shares the input embedding's table (``tied``); once its every call takes
        # int8_act_gemm on 8-bit codes, token lookups read those codes (``embedding_rows``) in
        # this dtype and the model lets go of the dense table.
        self.tied_embedding = False
        self.embedding_dtype: torch.dtype | None = None

    @classmethod
    def load(cls, w: WeightSource, names: list[str], bias_names: list[str] | None = None) -> "Linear":
        """The named checkpoint tensors as one projection (fused when several)."""
        lin = cls.fused([w.get(n) for n in names], [w.get(b) for b in bias_names] if bias_names else None)
        if all(n in w.int4_factories for n in names):
            lin.checkpoint_int4 = functools.partial(w.int4_groups, names)
        if all(n in w.int8_factories for n in names):
            lin.checkpoint_int8 = functools.partial(w.int8_groups, names)
        return lin

    @classmethod
    def tied(cls, embedding: torch.Tensor, w: WeightSource, name: str) -> "Linear":
        """The LM head that shares the input embedding's weight (``name`` in the checkpoint)."""
        lin = cls(embedding)
        lin.tied_embedding = True
        if name in w.int8_factories:
            lin.checkpoint_int8 = functools.partial(w.int8_groups, [name])
        return lin

    @property
    def int8_act_codes(self) -> torch.Tensor | None:
        """int8_act_gemm's packed codes, [blocks of 16 outputs, groups of 32 inputs, bytes a group
        and block] (512: 8-bit codes, 320: 5-bit, 256: 4-bit); None before add_int8_activation_gemm_."""
        return self._int8_act_args[0] if self._int8_act_args else None

    def serves_embedding_rows(self) -> bool:
        """Whether ``embedding_rows`` can read this weight's rows: 8-bit codes packed for
        int8_act_gemm (GGUF Q8_0, one scale per 32) and no dense weight kept beside them."""
        codes, scale = self._int8_act_args[:2] if self._int8_act_args else (None, None)
        return (self.weight is None and codes is not None and self.int8_act_zero_point == 128
                and codes.shape[-1] == 512 and scale.shape[-1] == 16)

    def embedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight, read from int8_act_gemm's packed codes: the values the
        dense table held (each code times its group's scale), without keeping that table (Gemma 3's
        262,144 x 640 in float32 is 671 MB; its Q8_0 codes, which the LM head reads anyway, 168).
        One C++ call (the codes exist only where the kernels are loaded); an id outside the
        vocabulary raises."""
        codes, scale = self._int8_act_args[:2]
        rows = torch.ops.gemel.embedding_rows(codes, scale, ids, self.int8_act_out_features)
        return rows.to(self.embedding_dtype or torch.float32)  # no copy when already float32

    @classmethod
    def fused(cls, weights: list[torch.Tensor], biases: list[torch.Tensor] | None = None) -> "Linear":
        """One matrix for q/k/v or gate/up: fewer, larger matmuls per step."""
        weight = weights[0] if len(weights) == 1 else torch.cat(weights, dim=0)
        bias = None
        if biases is not None:
            bias = biases[0] if len(biases) == 1 else torch.cat(biases, dim=0)
        return cls(weight, bias)

    def prepack_(self, batch_hint: int = 64, keep_dense: bool = False) -> bool:
        """Add the oneDNN blocked copy of a CPU bf16 weight; it replaces the dense weight unless
        ``keep_dense`` (a torch.compile'd graph needs the dense one: inductor freezes and packs
        it itself, and cannot take an already packed tensor). Returns whether it did."""
        w = self.weight
        if w is None or w.device.type != "cpu" or w.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
            return False
        if not bf16_gemm_supported():  # oneDNN has no bf16 GEMM on this CPU; PyTorch's own kernels serve
            return False
        self.onednn_weight = torch.ops.mkldnn._reorder_linear_weight(w.detach(), batch_hint)
        if not keep_dense:
            self.weight = None  # a tied embedding keeps its own reference
        return True

    def add_int8_activation_gemm_(self, max_rows: int | None = None) -> bool:
        """Pack the checkpoint's weight groups (GGUF Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q6_K) for
        ``torch.ops.gemel.int8_act_gemm``, which then serves every call that the weight-only
        kernels do not, up to ``max_rows`` rows (None: all): integer dot products on the file's
        exact weights with x rounded to int8 per group of 32, llama.cpp's arithmetic, 1.35-1.65x
        the bf16 GEMM on AVX512-VNNI CPUs without AMX. Returns whether this projection has such
        groups."""
        if self.weight is None or self.weight.device.type != "cpu":
            return False
        int4 = self._checkpoint_groups("checkpoint_int4")
        int8 = None if int4 is not None else self._checkpoint_groups("checkpoint_int8")
        five_bit = int8 is not None and _five_bit_codes(int8)
        if int4 is not None:  # w = (q - 8) * scale + zero; Q4_0 has zero = 0
            codes, scale, low = int4.q.to(torch.uint8), int4.scale.float(), int4.zero.float() - 8.0 * int4.scale.float()
            zero_point = 8 if not bool(int4.zero.any()) else 0
        elif five_bit:  # Q5_0: w = q * scale = (q + 16) * scale - 16 * scale
            codes, scale, low, zero_point = (int8.q + 16).to(torch.uint8), int8.scale.float(), None, 16
        elif int8 is not None:  # w = q * scale = (q + 128) * scale - 128 * scale
            if bool((int8.q == -128).any()):
                return False  # the AVX2 tiles take 8-bit codes as u - 128 in a signed byte (llama.cpp's files have none)
            if int8.group_size not in (16, 32):
                return False
            scale, low = int8.scale.float(), None
            if int8.group_size == 16 and int(int8.q.min()) >= -32 and int(int8.q.max()) < 32:
                # Q6_K's 6-bit codes as 0-63: the AVX2 tiles multiply them without the sign trick
                codes, zero_point = (int8.q + 32).to(torch.uint8), 32
            else:
                codes, zero_point = (int8.q.to(torch.int16) + 128).to(torch.uint8), 128
        else:
            return False
        out_features = codes.shape[0]
        packed = pack_group_codes(codes, scale, low, zero_point, five_bit)
        if scale.shape[1] * 16 == codes.shape[1]:  # a scale per 16 codes (Q6_K): [blocks, groups, 2 x 16]
            packed = (packed[0], _sub16_by_block(scale, packed[0].shape[0]).to(packed[1].dtype), packed[2])
        self._keep(**dict(zip(("act_codes", "act_scale", "act_low"), packed)))
        # The same tensors as a plain attribute: an eager call reads them without nn.Module's
        # __getattr__ (about 0.3 ms of a batch-1 SmolLM2 step that calls this 121 times).
        self._int8_act_args = packed
        self.int8_act_out_features = out_features
        self.int8_act_zero_point = zero_point
        self.int8_act_max_rows = max_rows
        return True

    def add_amx_tiles_(self, max_rows: int) -> bool:
        """Lay a CPU bf16 weight out as AMX tiles (``pack_amx_tiles``) for
        ``torch.ops.gemel.amx_bf16_gemm``, which then serves calls of more rows than the
        weight-only kernels take, up to ``max_rows``. A gated MLP's gate/up projection pairs
        each gate block with its up block, so that ``gated_mlp`` gets silu(gate) * up from the
        kernel itself. Returns whether it did."""
        w = self.weight
        if w is None or w.device.type != "cpu" or w.dtype != torch.bfloat16 or w.shape[1] % 32 or max_rows <= 0:
            return False
        gate_up = self.gate_up and self.bias is None and w.shape[0] % 32 == 0
        self._keep(amx_tiles=pack_amx_tiles(w.detach(), gate_up=gate_up))
        self.amx_max_rows, self.amx_out_features = max_rows, w.shape[0]
        self.amx_layout = AMX_GATE_UP if gate_up else AMX_PLAIN
        return True

    def _checkpoint_groups(self, name: str) -> Int4Groups | Int8Groups | None:
        """The checkpoint's groups behind factory ``name``, read once: the factory is replaced
        by one that returns them, so ``quantize_`` does not read the checkpoint again."""
        factory = getattr(self, name)
        if factory is None:
            return None
        groups = factory()
        setattr(self, name, lambda: groups)
        return groups

    def quantize_(
        self,
        mode: str,
        packed_max_rows: int,
        group_size: int = 32,
        int4_integer_kernel: bool | None = None,
        int8_groups_max_rows: int | None = None,
    ) -> None:
        """Add a weight-only low-bit copy used for calls with at most ``packed_max_rows`` rows.

        ``checkpoint``: only where the checkpoint stores 4-bit or int8 groups, used as they
        are (the file's exact weights); ``int4``: the 4-bit groups, else groups re-quantised
        from the dense weight (lossy); ``int8``: per-channel int8 re-quantised from the dense
        weight (lossy). ``int4_integer_kernel`` (default: whether the kernels run AVX512-VNNI) serves
        4-bit groups with gemel's int4_group_mm instead of PyTorch's int4 kernel;
        ``int8_groups_max_rows`` caps the rows int8_group_mm serves (default: fewer where AMX tiles
        take the larger calls). The engine passes both from its kernel plan.
        """
        if self.weight is None:
            raise RuntimeError("quantize_ needs the dense weight: call it before prepack_")
        if mode not in ("checkpoint", "int4", "int8"):
            raise ValueError(f"unknown weight quantisation {mode!r} (use checkpoint, int8 or int4)")
        if self.weight.device.type != "cpu":  # these packed kernels are CPU kernels; stay dense elsewhere
            self.checkpoint_int4 = self.checkpoint_int8 = None
            return
        int8_groups = self.checkpoint_int8() if self.checkpoint_int8 is not None and mode == "checkpoint" else None
        if int8_groups is not None and int8_groups.group_size != 32:
            int8_groups = None  # int8_group_mm takes groups of 32 (Q6_K's 16 stay dense here)
        self.checkpoint_int8 = None
        if int8_groups is not None and cpu_kernels.load():
            self._keep(w_q8=int8_groups.q.contiguous(), w_q8_scales=int8_groups.scale.contiguous())
            self.checkpoint_int4 = None
            self.quant = "int8_groups"
            if int8_groups_max_rows is None:  # where tiles exist they win from 3 rows on
                int8_groups_max_rows = AMX_INT8_GROUPS_MAX_ROWS if self.amx_max_rows else WEIGHT_ONLY_KERNEL_MAX_ROWS
            self.packed_max_rows = min(packed_max_rows, int8_groups_max_rows)
            return
        groups = self.checkpoint_int4() if self.checkpoint_int4 is not None and group_size == 32 else None
        self.checkpoint_int4 = None  # read once; drops the reference to the checkpoint
        if mode == "checkpoint" and groups is None:
            return
        w = self.weight.detach().float()
        if mode == "int8":
            scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8)
            self._keep(w_int8=torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8),
                       w_scales=scales.to(self.weight.dtype))
        else:
            out_features, in_features = w.shape
            if groups is None:
                if in_features % group_size:
                    return  # the packed int4 kernel needs whole groups; stay dense
                grouped = w.view(out_features, in_features // group_size, group_size)
                lo, hi = grouped.amin(dim=-1), grouped.amax(dim=-1)
                scales = ((hi - lo) / 15.0).clamp(min=1e-8)
                q = torch.round((grouped - lo[..., None]) / scales[..., None]).clamp(0, 15)
                groups = Int4Groups(q.view(out_features, in_features), scales, lo + scales * 8.0)
            if int4_integer_kernel is None:
                int4_integer_kernel = cpu_kernels.has_vnni()
            if group_size == 32 and int4_integer_kernel and cpu_kernels.load():
                self._keep(w_q4=pack_int4_rows(groups))
                self.w_q4_rows = out_features
                self.quant = "int4_groups"
                self.packed_max_rows = min(packed_max_rows, WEIGHT_ONLY_KERNEL_MAX_ROWS)
                return
            self._keep(
                w_int4=torch.ops.aten._convert_weight_to_int4pack_for_cpu(groups.q.to(torch.int32), 1),
                w_scales_zeros=torch.stack([groups.scale, groups.zero], dim=-1)
                .transpose(0, 1)
                .contiguous()
                .to(self.weight.dtype),
            )
            self.group_size = group_size
            mode = "int4"
        self.quant = mode
        self.packed_max_rows = packed_max_rows

    def _keep(self, **tensors: torch.Tensor) -> None:
        """Hold low-bit copies as (unsaved) buffers: torch.compile then treats their shapes
        as fixed, where plain tensor attributes would get symbolic shapes under
        ``dynamic=True`` and a Python shape check of every one on every call (~1 ms a step)."""
        for name, tensor in tensors.items():
            self.register_buffer(name, tensor, persistent=False)

    def _weight_only(self, rows: int) -> bool:
        """Whether a call of this many rows takes the weight-only low-bit kernels."""
        return self.quant is not None and rows <= self.packed_max_rows

    def _amx_rows(self, rows: int) -> bool:
        """Whether a call of this many rows takes amx_bf16_gemm."""
        return rows <= self.amx_max_rows and not self._weight_only(rows)

    def _int8_act_rows(self, rows: int) -> bool:
        """Whether a call of this many rows takes int8_act_gemm."""
        if not self.int8_act_out_features or self._amx_rows(rows):
            return False
        return self.int8_act_max_rows is None or rows <= self.int8_act_max_rows

    def _int8_act(self, x: torch.Tensor, gated: bool) -> torch.Tensor:
        if torch.compiler.is_compiling():  # the buffers: fixed shapes for the compiled graph
            codes, scale, low = self.act_codes, self.act_scale, self.act_low
        else:
            codes, scale, low = self._int8_act_args
        y = torch.ops.gemel.int8_act_gemm(x, codes, scale, low, self.int8_act_out_features, gated, self.int8_act_zero_point)
        return y if self.bias is None else y + self.bias

    def _every_call_int8_act(self) -> bool:
        """Whether int8_act_gemm serves calls of every size (the float32 plan below AMX)."""
        return (self.int8_act_out_features > 0 and self.int8_act_max_rows is None and self.quant is None
                and not self.amx_max_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._every_call_int8_act():
            return self._int8_act(x, gated=False)
        if self._weight_only(x.shape[0]):
            if self.quant == "int4_groups":
                y = torch.ops.gemel.int4_group_mm(x, self.w_q4, self.w_q4_rows)
            elif self.quant == "int8_groups":
                y = torch.ops.gemel.int8_group_mm(x, self.w_q8, self.w_q8_scales)
            elif self.quant == "int8":  # PyTorch's packed kernels take x in their scales' dtype
                y = torch.ops.aten._weight_int8pack_mm(x.to(self.w_scales.dtype), self.w_int8, self.w_scales).to(x.dtype)
            else:
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                    x.to(self.w_scales_zeros.dtype), self.w_int4, self.group_size, self.w_scales_zeros
                ).to(x.dtype)
            return y if self.bias is None else y + self.bias
        # A torch.compile'd graph keeps the dense weight and inductor's own packed GEMM, which it
        # fuses with the ops around it (as it does for the oneDNN copy below).
        if self._amx_rows(x.shape[0]) and not torch.compiler.is_compiling():
            y = torch.ops.gemel.amx_bf16_gemm(x, self.amx_tiles, self.amx_out_features, self.amx_layout)
            return y if self.bias is None else y + self.bias
        if self._int8_act_rows(x.shape[0]):
            return self._int8_act(x, gated=False)
        if self.onednn_weight is not None and not (self.weight is not None and torch.compiler.is_compiling()):
            return torch.ops.mkldnn._linear_pointwise(x, self.onednn_weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """``self(x).argmax(-1)`` without writing ``self(x)`` (greedy sampling's LM head, whose
        [rows, vocab] logits were most of the head's memory traffic), where this call takes
        int8_act_gemm; None where it does not (the caller computes the outputs instead)."""
        rows = x.shape[0]
        takes_int8_act = self._every_call_int8_act() or (self._int8_act_rows(rows) and not self._weight_only(rows))
        if not takes_int8_act or self.bias is not None or rows == 0:
            return None
        codes, scale, low = self._int8_act_args
        return torch.ops.gemel.int8_act_gemm_argmax(x, codes, scale, low, self.int8_act_out_features,
                                                    self.int8_act_zero_point)

    def forward_gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``self(silu(gate) * up)`` for a gated MLP's fused gate/up output ``[T, 2 I]`` (fused
        CPU path). The int8-activation GEMM computes the product while it rounds its input, one
        op fewer a layer; other calls take the fused silu_and_mul op first."""
        if self._every_call_int8_act() or (self._int8_act_rows(gate_up.shape[0]) and not self._weight_only(gate_up.shape[0])):
            return self._int8_act(gate_up, gated=True)
        return self(torch.ops.gemel.silu_and_mul(gate_up))


def gated_mlp(gate_up: Linear, down: Linear, h: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate) * up)`` with ``gate, up`` the halves of ``gate_up(h)`` (fused CPU
    path). Where the call takes gate_up's AMX tiles, the tile kernel writes silu(gate) * up
    itself (the same bits as the silu_and_mul op on its output, one op and one pass over
    [rows, 2 I] fewer); elsewhere ``down.forward_gated`` fuses what its kernel can."""
    if gate_up.amx_layout == AMX_GATE_UP and gate_up._amx_rows(h.shape[0]) and not torch.compiler.is_compiling():
        return down(torch.ops.gemel.amx_bf16_gemm(h, gate_up.amx_tiles, gate_up.amx_out_features, AMX_SILU_MUL))
    return down.forward_gated(gate_up(h))


def pack_int4_rows(groups: Int4Groups) -> torch.Tensor:
    """4-bit groups in the layout of ``torch.ops.gemel.int4_group_mm`` (see its source):
    rows in blocks of 16; per block and group one record of 4 vectors of 64 bytes whose
    32-bit lanes are the 16 rows, then the rows' 16 scales and 16 lows (``w = scale * q + low``)."""
    out_features, in_features = groups.q.shape
    num_groups, blocks = in_features // 32, -(-out_features // 16)
    pad = blocks * 16 - out_features
    q = F.pad(groups.q.to(torch.uint8), (0, 0, 0, pad)).view(blocks, 16, num_groups, 4, 2, 4)
    codes = (q[..., 0, :] | (q[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).reshape(blocks, num_groups, 256)
    scale, low = groups.scale.float(), groups.zero.float() - 8.0 * groups.scale.float()
    dtype = _scale_dtype(scale, low)
    as_bytes = [_by_block(t, blocks, dtype).view(torch.uint8) for t in (scale, low)]
    return torch.cat([codes, *as_bytes], dim=-1).contiguous()


def pack_group_codes(
    codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor | None, zero_point: int = 0, five_bit: bool = False
) -> tuple[torch.Tensor, ...]:
    """Weight groups ``w = scale * codes + low`` (codes uint8 [out, in], scale and low
    [out, in / 32]) in the layout of ``torch.ops.gemel.int8_act_gemm`` (see its source): rows
    in blocks of 16; per block and group 8 vectors of 64 bytes whose 32-bit lanes are the 16
    rows, each lane 4 consecutive codes; scale and low as [blocks, groups, 16], float16 where
    that holds them exactly, else float32.
    Codes that all fit in 4 bits are stored two a byte (vectors 0-3 in the low nibbles, 4-7
    in the high ones): half the bytes to stream per step. With ``five_bit``, codes that fit in
    5 bits are stored so too, followed by a plane of their fifth bits (64 bytes per block and
    group: bit p of byte i is vector p's byte i's), 320 bytes against 512. With an integer
    ``zero_point`` z (``w = scale * (codes - z)``: Q4_0, Q5_0, Q6_K, Q8_0) ``low`` is not needed
    and comes back empty."""
    out_features, in_features = codes.shape
    num_groups, blocks = in_features // 32, -(-out_features // 16)
    pad = blocks * 16 - out_features
    packed = F.pad(codes, (0, 0, 0, pad)).view(blocks, 16, num_groups, 8, 4).permute(0, 2, 3, 1, 4)
    packed = packed.reshape(blocks, num_groups, 512)
    top = int(codes.max())
    if top < 16 or (five_bit and top < 32):
        nibbles = (packed[..., :256] & 0x0F) | ((packed[..., 256:] & 0x0F) << 4)
        if top < 16:
            packed = nibbles
        else:
            fifth = ((packed.view(blocks, num_groups, 8, 64) >> 4) & 1).to(torch.int32)
            plane = (fifth << torch.arange(8, dtype=torch.int32).view(8, 1)).sum(2).to(torch.uint8)
            packed = torch.cat([nibbles, plane], dim=-1)

    kept = [scale.float()] + ([] if zero_point else [low.float()])
    dtype = _scale_dtype(*kept)
    low_by_block = torch.empty(0, 0, 0, dtype=dtype) if zero_point else _by_block(kept[1], blocks, dtype)
    return packed.contiguous(), _by_block(kept[0], blocks, dtype), low_by_block


def _five_bit_codes(groups: Int8Groups) -> bool:
    """Whether int8 groups are 5-bit codes (GGUF Q5_0: q in -16..15, one scale per 32), which
    int8_act_gemm takes as nibbles plus a plane of fifth bits on every build: 62.5% of the bytes
    of 8-bit codes, and fewer ops on the AVX2 tiles."""
    return groups.group_size == 32 and int(groups.q.min()) >= -16 and int(groups.q.max()) < 16


def _scale_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float16 where it holds every value to float32 precision, else float32: half the scale
    bytes the kernels stream (GGUF stores float16; a Q4_1 ``low`` comes back through float32
    arithmetic, hence a tolerance rather than equality)."""
    fits = all(bool(torch.allclose(t.half().float(), t, rtol=2**-20, atol=0.0)) for t in tensors)
    return torch.float16 if fits else torch.float32


def _sub16_by_block(scale: torch.Tensor, blocks: int) -> torch.Tensor:
    """Per-row scales of 16 codes [out, in / 16] as [blocks, in / 32, 32]: for each block and
    group of 32, the 16 rows' scales of its first 16 codes, then of its last 16."""
    out_features, halves = scale.shape
    padded = F.pad(scale.float(), (0, 0, 0, blocks * 16 - out_features)).view(blocks, 16, halves // 2, 2)
    return padded.permute(0, 2, 3, 1).reshape(blocks, halves // 2, 32).contiguous()


def _by_block(t: torch.Tensor, blocks: int, dtype: torch.dtype) -> torch.Tensor:
    """Per-row, per-group values [out, groups] as [blocks, groups, 16] (rows padded to whole blocks)."""
    out_features, num_groups = t.shape
    padded = F.pad(t, (0, 0, 0, blocks * 16 - out_features))
    return padded.view(blocks, 16, num_groups).permute(0, 2, 1).to(dtype).contiguous()


def quantize_model_(
    model: nn.Module,
    mode: str,
    packed_max_rows: int,
    int8_activations: bool = False,
    int8_act_max_rows: int | None = None,
    amx_max_rows: int = 0,
    int4_integer_kernel: bool | None = None,
    int8_groups_max_rows: int | None = None,
) -> int:
    """Give every projection of ``model`` a low-bit copy (``mode`` as in ``Linear.quantize_``;
    ``none`` only lets go of the checkpoint), with ``amx_max_rows`` its AMX tile copy for calls
    up to that many rows (``Linear.add_amx_tiles_``), and with ``int8_activations`` the packed
    groups for larger calls, up to ``int8_act_max_rows`` rows (``Linear.add_int8_activation_gemm_``).
    Returns how many were quantised."""
    count = 0
    for module in model.modules():
        if isinstance(module, Linear):
            module.add_amx_tiles_(amx_max_rows)
            packed_groups = int8_activations and module.add_int8_activation_gemm_(int8_act_max_rows)
            if mode == "none":
                module.checkpoint_int4 = module.checkpoint_int8 = None
            else:
                module.quantize_(mode, packed_max_rows, int4_integer_kernel=int4_integer_kernel,
                                 int8_groups_max_rows=int8_groups_max_rows)
                count += module.quant is not None
            if packed_groups and int8_act_max_rows is None:
                module.weight = None  # every call now takes a packed kernel (a tied embedding keeps its own)
    return count


def apply_plan_(model: nn.Module, plan: KernelPlan, keep_dense: bool = False) -> None:
    """Give every projection of ``model`` the copies the kernel plan calls for. ``keep_dense``:
    keep the dense weights a torch.compile'd graph needs."""
    mode = plan.weight_quant if plan.packed_max_rows else "none"
    quantize_model_(
        model,
        mode,
        plan.packed_max_rows,
        int8_activations=plan.int8_activations,
        int8_act_max_rows=plan.int8_act_max_rows,
        amx_max_rows=plan.amx_max_rows,
        int4_integer_kernel=plan.int4_integer_kernel,
        int8_groups_max_rows=plan.int8_groups_max_rows,
    )
    if plan.prepack_bf16:
        prepack_model_(model, keep_dense=keep_dense)
    share_tied_table_(model)


def share_tied_table_(model: nn.Module) -> bool:
    """Where a model's tied LM head now reads only its packed 8-bit codes, let its token lookups
    read them too and drop the dense embedding table (it is the only reader left). Returns
    whether it did."""
    head, table = getattr(model, "lm_head", None), getattr(model, "embed_tokens", None)
    if not (isinstance(head, Linear) and head.tied_embedding and table is not None and head.serves_embedding_rows()):
        return False
    head.embedding_dtype = table.dtype
    model.embed_tokens = None
    return True


def prepack_model_(model: nn.Module, keep_dense: bool = False) -> int:
    """oneDNN-blocked weights for every bf16 projection on CPU; returns how many."""
    return sum(module.prepack_(keep_dense=keep_dense) for module in model.modules() if isinstance(module, Linear))


def pack_amx_tiles(weight: torch.Tensor, gate_up: bool = False) -> torch.Tensor:
    """A bf16 weight [out, in] as AMX tiles for ``torch.ops.gemel.amx_bf16_gemm``: rows in
    blocks of 16 (the last zero-padded), inputs in groups of 32; per block and group one tile
    of 16 rows x 32 values, row r holding inputs 2r and 2r + 1 of each of the 16 outputs
    (the pair format of ``tdpbf16ps``). With ``gate_up`` (a gated MLP's [gate | up] weight,
    out a multiple of 32) the blocks go gate 0, up 0, gate 1, up 1, ..."""
    out_features, in_features = weight.shape
    if gate_up:
        if out_features % 32:
            raise ValueError(f"gate/up tiles need out_features a multiple of 32, got {out_features}")
        weight = weight.view(2, out_features // 32, 16, in_features).transpose(0, 1).reshape(out_features, in_features)
    blocks, groups = -(-out_features // 16), in_features // 32
    w = F.pad(weight.to(torch.bfloat16), (0, 0, 0, blocks * 16 - out_features))
    return w.view(blocks, 16, groups, 16, 2).permute(0, 2, 3, 1, 4).reshape(blocks, groups, 512).contiguous()
