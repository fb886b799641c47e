"""GGUF checkpoints: metadata -> architecture config, tensors -> Hugging Face names.

The file is memory-mapped by ``gguf.GGUFReader``. F32/F16/BF16 tensors are wrapped
without copying; Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K (and the other types the ``gguf``
package knows) are dequantised to float32 when the model asks for them.
"""

from __future__ import annotations

import os
import re
import warnings

from typing import TYPE_CHECKING

import numpy as np

from gemel.models import registry
from gemel.models.config import ModelArchConfig

# torch is imported where tensors are made: the API process reads the metadata and the
# tokenizer from here and should not load it (model_loader.read_arch_and_tokenizer).
if TYPE_CHECKING:
    import torch

    from gemel.models.weights import Int4Groups, Int8Groups

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


class GGUFLoadError(ValueError):
    pass


def _checked_reader_class():
    """GGUFReader that checks every tensor's extent against the file before mapping it,
    so a truncated file is reported with the tensor's name, not a numpy reshape error,
    and reads metadata arrays in bulk.

    The stock reader makes a memory-mapped numpy view for every element of every array:
    for Gemma 3's 262,144-token vocabulary (tokens, scores, token types) that is 1.3
    million views and 25 s of a 2-core machine's start-up. Here a number array is one
    view, and a string array is walked with ``struct`` over plain (not memmap) views:
    ``field.contents()`` returns the same values, in well under a second."""
    import struct

    from gguf import GGUFReader, GGUFValueType
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    class CheckedReader(GGUFReader):
        def _get_field_parts(self, orig_offs, raw_type):
            if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            length = self._get(orig_offs + 4, np.uint64)
            count, item_type, offs = int(length[0]), int(raw_itype[0]), orig_offs + 12
            number_type = self.gguf_scalar_to_np.get(item_type)
            if count == 0 or (number_type is None and item_type != GGUFValueType.STRING):
                return super()._get_field_parts(orig_offs, raw_type)  # empty, or nested arrays
            types = [GGUFValueType.ARRAY, GGUFValueType(item_type)]
            if number_type is not None:
                values = self._get(offs, number_type, count)
                if len(values) != count:
                    raise ValueError(f"array at offset {orig_offs} runs past the end of the file")
                return 12 + int(values.nbytes), [raw_itype, length, values], [2], types
            raw = self.data.view(np.ndarray)  # slicing a memmap is what makes the stock reader slow
            size = len(raw)
            parts, data = [raw_itype, length], []
            for _ in range(count):
                if offs + 8 > size:
                    raise ValueError(f"string array at offset {orig_offs} runs past the end of the file")
                (text_len,) = struct.unpack_from("<Q", raw, offs)
                if offs + 8 + text_len > size:
                    raise ValueError(f"string array at offset {orig_offs} runs past the end of the file")
                parts.append(raw[offs : offs + 8].view(np.uint64))
                data.append(len(parts))
                parts.append(raw[offs + 8 : offs + 8 + text_len])
                offs += 8 + text_len
            return offs - orig_offs, parts, data, types

        def _build_tensors(self, start_offs, fields):
            size = self.data.nbytes
            for f in fields:
                _name_len, name_data, _n_dims, dims, raw_dtype, offset = f.parts
                name = bytes(name_data).decode("utf-8", "replace")
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(raw_dtype[0])]
                end = int(start_offs + offset[0]) + int(np.prod(dims)) * type_size // block
                if end > size:
                    raise GGUFLoadError(
                        f"{self.gemel_path}: tensor {name!r} is truncated (needs bytes up to {end}, file has {size})"
                    )
            return super()._build_tensors(start_offs, fields)

    return CheckedReader


def open_gguf(path: str):
    """Parse the header and tensor index, naming the file on any failure."""
    if not os.path.isfile(path):
        raise GGUFLoadError(f"{path}: no such GGUF file")
    reader_class = _checked_reader_class()
    reader_class.gemel_path = path
    try:
        reader = reader_class(path, "r")
    except GGUFLoadError:
        raise
    except Exception as exc:
        raise GGUFLoadError(f"{path}: not a readable GGUF file ({exc})") from exc
    size = os.path.getsize(path)
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != int(t.n_bytes):
            raise GGUFLoadError(
                f"{path}: tensor {t.name!r} is truncated (needs bytes up to {end}, file has {size})"
            )
    return reader


def field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def hf_name(gguf_name: str, architecture: str) -> str:
    """The Hugging Face name of a GGUF tensor of a model of family ``architecture``."""
    stem, _, suffix = gguf_name.rpartition(".")
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if m:
        part = m.group(2)
        if part == "ffn_norm":
            mapped = registry.family(architecture).gguf_ffn_norm
        else:
            mapped = _LAYER_NAMES.get(part)
        if mapped is None:
            return gguf_name
        return f"model.layers.{m.group(1)}.{mapped}.{suffix}"
    mapped = _GLOBAL_NAMES.get(stem)
    return f"{mapped}.{suffix}" if mapped else gguf_name


def arch_config(reader, path: str) -> ModelArchConfig:
    arch = field(reader, "general.architecture")
    try:
        family = registry.family_for_gguf(arch)
    except registry.UnsupportedArchitecture as exc:
        raise GGUFLoadError(f"{path}: {exc}") from exc

    def key(name, default=None):
        return field(reader, f"{arch}.{name}", default)

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", 0) or key("rope.dimension_count", 0) or hidden // heads)
    tokens = field(reader, "tokenizer.ggml.tokens")
    vocab = int(key("vocab_size", 0) or (len(tokens) if tokens is not None else 0))
    tensor_names = {t.name for t in reader.tensors}
    rope_scaling = None
    scaling_type = key("rope.scaling.type")
    if scaling_type == "linear" or key("rope.scaling.factor"):
        rope_scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor", 1.0))}
    layers = int(key("block_count"))
    cfg = ModelArchConfig(
        architecture=family.name,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        rope_scaling=rope_scaling,
    )
    family.gguf_config(key, cfg)
    return cfg


def _rope_permuted_heads(cfg: ModelArchConfig, gguf_name: str) -> int | None:
    """Heads of a q/k projection whose rows llama.cpp stored permuted, else None."""
    if not registry.family(cfg.architecture).gguf_rope_permuted or not gguf_name.startswith("blk."):
        return None
    if ".attn_q." in gguf_name:
        return cfg.num_heads
    if ".attn_k." in gguf_name:
        return cfg.num_kv_heads
    return None


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp stores Llama q/k rows interleaved for its RoPE; undo to the HF half-split layout."""
    shape = w.shape
    return w.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def tensor_factories(reader, cfg: ModelArchConfig) -> dict:
    """HF name -> zero-argument function producing the tensor (float32 for quantised types)."""
    import torch
    from gguf import GGMLQuantizationType, quants

    plain = {
        GGMLQuantizationType.F32: torch.float32,
        GGMLQuantizationType.F16: torch.float16,
        GGMLQuantizationType.BF16: torch.bfloat16,
    }

    def make(t):
        def load() -> torch.Tensor:
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            if t.tensor_type in plain:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # read-only mmap: we never write weights
                    if t.tensor_type == GGMLQuantizationType.BF16:
                        arr = torch.from_numpy(np.asarray(t.data).view(np.int16)).view(torch.bfloat16)
                    else:
                        arr = torch.from_numpy(np.asarray(t.data))
                    tensor = arr.reshape(shape)
            else:
                tensor = torch.from_numpy(quants.dequantize(t.data, t.tensor_type)).reshape(shape)
            heads = _rope_permuted_heads(cfg, t.name)
            if heads is not None:
                tensor = torch.from_numpy(_unpermute_rope(tensor.float().numpy(), heads).copy())
            return tensor

        return load

    return {hf_name(t.name, cfg.architecture): make(t) for t in reader.tensors}


def _stored_group_factories(reader, cfg: ModelArchConfig, block_bytes: dict, decode) -> dict:
    """HF name -> function reading a tensor's blocks (GGML types in ``block_bytes``, with the
    weights and bytes of one block) and turning them into groups with ``decode(type, blocks)``,
    blocks shaped [out, in / weights, bytes]; q/k rows are un-permuted as for the dense weights."""
    import torch

    def make(t):
        def load():
            out_features, in_features = (int(x) for x in reversed(t.shape.tolist()))
            weights, size = block_bytes[t.tensor_type]
            blocks = np.asarray(t.data).reshape(out_features, in_features // weights, size)
            groups = decode(t.tensor_type, blocks)
            heads = _rope_permuted_heads(cfg, t.name)
            if heads is not None:
                groups = groups.map_rows(lambda a: torch.from_numpy(_unpermute_rope(a.numpy(), heads).copy()))
            return groups

        return load

    return {
        hf_name(t.name, cfg.architecture): make(t)
        for t in reader.tensors
        if t.tensor_type in block_bytes and len(t.shape) == 2 and int(t.shape[0]) % block_bytes[t.tensor_type][0] == 0
    }


def _block_scales(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The float16 field at byte ``offset`` of every block, as float32 [out, in / 32]."""
    return blocks[..., offset : offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def int4_group_factories(reader, cfg: ModelArchConfig) -> dict:
    """HF name -> function producing the tensor's own 4-bit groups, for Q4_0 and Q4_1
    tensors (blocks of 32 along the input dimension with one scale, and a minimum for Q4_1)
    and Q4_K (super-blocks of 256 with a scale and a minimum for each 32).

    A packed int4 kernel fed these computes with exactly the file's weights, which is what
    llama.cpp does with them, instead of re-quantising a dequantised copy.
    """
    import torch
    from gguf import GGMLQuantizationType

    from gemel.models.weights import Int4Groups

    def decode(kind, blocks: np.ndarray) -> Int4Groups:
        if kind == GGMLQuantizationType.Q4_K:
            return _q4_k_groups(blocks)
        scale = _block_scales(blocks, 0)
        if kind == GGMLQuantizationType.Q4_1:  # w = d * q + m  ==  (q - 8) * d + (m + 8 d)
            zero = _block_scales(blocks, 2) + 8.0 * scale
        else:  # w = (q - 8) * d
            zero = np.zeros_like(scale)
        packed = blocks[..., -16:]  # element j in the low nibble of byte j, j + 16 in the high
        q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(blocks.shape[0], -1)
        return Int4Groups(torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(zero))

    kinds = {GGMLQuantizationType.Q4_0: (32, 18), GGMLQuantizationType.Q4_1: (32, 20), GGMLQuantizationType.Q4_K: (256, 144)}
    return _stored_group_factories(reader, cfg, kinds, decode)


def _q4_k_groups(blocks: np.ndarray) -> "Int4Groups":
    """Q4_K super-blocks of 256 weights ([out, in / 256, 144] bytes: float16 d and dmin, twelve
    bytes of eight 6-bit scales and mins, 128 bytes of 4-bit codes) as groups of 32:
    w = d sc q - dmin m = (q - 8) (d sc) + (8 d sc - dmin m). d sc is exact in float32 (an
    11-bit mantissa times a 6-bit integer), so the groups carry the file's exact weights."""
    import torch

    from gemel.models.weights import Int4Groups

    rows, supers, _ = blocks.shape
    d, dmin = _block_scales(blocks, 0), _block_scales(blocks, 2)
    packed = blocks[..., 4:16].astype(np.uint8)
    sc, m = np.empty((rows, supers, 8), np.float32), np.empty((rows, supers, 8), np.float32)
    # llama.cpp's get_scale_min_k4: groups 0-3 in the low 6 bits of bytes 0-3 (scale) and 4-7
    # (min); groups 4-7 from bytes 8-11's nibbles plus the top 2 bits of bytes 0-3 and 4-7.
    sc[..., :4], m[..., :4] = packed[..., 0:4] & 63, packed[..., 4:8] & 63
    sc[..., 4:] = (packed[..., 8:12] & 0x0F) | ((packed[..., 0:4] >> 6) << 4)
    m[..., 4:] = (packed[..., 8:12] >> 4) | ((packed[..., 4:8] >> 6) << 4)
    qs = blocks[..., 16:144].reshape(rows, supers, 4, 32)  # 32 bytes per pair of groups
    q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(rows, supers * 256)  # low nibbles first
    scale = (d[..., None] * sc).reshape(rows, supers * 8)
    low = (dmin[..., None] * m).reshape(rows, supers * 8)
    return Int4Groups(torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(8.0 * scale - low))


def int8_group_factories(reader, cfg: ModelArchConfig) -> dict:
    """HF name -> function producing the tensor's own int8 groups, for Q8_0 tensors (blocks
    of 32 along the input dimension: one float16 scale d, 32 int8 q, w = d q) and Q5_0 ones
    (5-bit codes u, w = d (u - 16), held as q = u - 16)."""
    import torch
    from gguf import GGMLQuantizationType

    from gemel.models.weights import Int8Groups

    def decode(kind, blocks: np.ndarray) -> Int8Groups:
        if kind == GGMLQuantizationType.Q6_K:
            return _q6_k_groups(blocks)
        if kind == GGMLQuantizationType.Q5_0:
            # float16 d, 32 high bits, 16 bytes of low nibbles (j low, j + 16 high); w = d (q - 16)
            high = blocks[..., 2:6].copy().view(np.uint32)  # [out, groups, 1], bit j is weight j's
            bits = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
            low = blocks[..., 6:22]
            q = np.concatenate([low & 0x0F, low >> 4], axis=-1) | bits
            q = (q.astype(np.int16) - 16).astype(np.int8).reshape(blocks.shape[0], -1)
        else:
            q = blocks[..., 2:].copy().view(np.int8).reshape(blocks.shape[0], -1)
        return Int8Groups(torch.from_numpy(q), torch.from_numpy(_block_scales(blocks, 0)))

    kinds = {GGMLQuantizationType.Q8_0: (32, 34), GGMLQuantizationType.Q5_0: (32, 22), GGMLQuantizationType.Q6_K: (256, 210)}
    return _stored_group_factories(reader, cfg, kinds, decode)


def _q6_k_groups(blocks: np.ndarray) -> "Int8Groups":
    """Q6_K super-blocks of 256 weights ([out, in / 256, 210] bytes: 128 bytes of low 4 bits, 64
    of high 2 bits, 16 int8 scales, float16 d) as int8 groups of 16: w = (d sc) (q - 32), q in
    0..63, held as q - 32. d sc is exact in float32 (an 11-bit mantissa times an 8-bit integer)."""
    import torch

    from gemel.models.weights import Int8Groups

    rows, supers, _ = blocks.shape
    ql = blocks[..., 0:128].reshape(rows, supers, 2, 64)  # per half of 128 weights
    qh = blocks[..., 128:192].reshape(rows, supers, 2, 32)
    sc = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)
    d = blocks[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float32)
    # llama.cpp's dequantize_row_q6_K: in each half, weights l, l + 32, l + 64, l + 96 (l < 32) take
    # ql[l] low, ql[l + 32] low, ql[l] high, ql[l + 32] high nibbles, with qh[l]'s bit pairs 0-3 on top.
    low = np.stack([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=3)
    high = np.stack([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], axis=3)
    q = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(rows, supers * 256)
    scale = (d[..., None] * sc).reshape(rows, supers * 16)
    return Int8Groups(torch.from_numpy(q), torch.from_numpy(scale))
