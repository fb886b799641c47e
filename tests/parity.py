"""Comparing gemel with Hugging Face transformers on the same weights (the correctness oracle).

Greedy tokens must be equal. A divergence is accepted only at a genuine near-tie, the
rule vLLM's logprob-closeness check uses: at the first differing step each side's token
is within the other's top-2 and the two tokens' logits are within 1e-3 on both sides.
In bfloat16 the rule is top-5 containment (bf16 logits are only good to ~1e-2).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch


@dataclass
class ParityResult:
    prompt_index: int
    equal: bool
    near_tie_step: int | None = None


# The tokenizer's vocabulary arrays: the model never reads them, and transformers' GGUF loader
# parses them element by element twice per load (over 40 s for Gemma 3's 262,144 tokens).
_VOCABULARY_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                    "tokenizer.ggml.merges")


def hf_model_from_gguf(path: str, dtype: torch.dtype, scratch_dir: str):
    """Transformers' own GGUF loader and dequantiser on ``path``'s weights: the file is copied
    byte for byte to ``scratch_dir`` without the vocabulary arrays (the vocabulary size is
    written as the architecture's ``vocab_size`` key where the file has none), every other
    key and tensor kept."""
    import os

    import gguf
    from transformers import AutoModelForCausalLM

    from gemel.loader import gguf_loader

    reader = gguf_loader.open_gguf(path)
    architecture = reader.fields["general.architecture"].contents()
    copy_path = os.path.join(scratch_dir, os.path.basename(path))
    writer = gguf.GGUFWriter(copy_path, architecture)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture" or field.name in _VOCABULARY_KEYS:
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    if f"{architecture}.vocab_size" not in reader.fields:
        writer.add_uint32(f"{architecture}.vocab_size", len(reader.fields["tokenizer.ggml.tokens"].data))
    for tensor in reader.tensors:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        writer.write_tensor_data(tensor.data)
    writer.close()
    return AutoModelForCausalLM.from_pretrained(scratch_dir, gguf_file=os.path.basename(path), dtype=dtype).eval()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Transformers' own greedy ``generate``, with EOS disabled like gemel's ``ignore_eos``."""
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = None
    config.do_sample = False
    config.max_new_tokens = max_new_tokens
    config.pad_token_id = 0
    for name in ("temperature", "top_p", "top_k"):
        setattr(config, name, None)
    saved = model.config.eos_token_id, model.generation_config.eos_token_id
    # generate() falls back to the model's own configs for EOS: clear them for the call.
    model.config.eos_token_id = model.generation_config.eos_token_id = None
    try:
        with torch.no_grad():
            ids = torch.tensor([prompt_ids])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    finally:
        model.config.eos_token_id, model.generation_config.eos_token_id = saved
    return out[0, len(prompt_ids) :].tolist()


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def check_greedy(
    index: int,
    prompt_ids: list[int],
    ours: list[int],
    theirs: list[int],
    our_logits_fn,
    hf_model,
    bf16: bool = False,
    tie_tol: float = 1e-3,
) -> ParityResult:
    if ours == theirs:
        return ParityResult(index, True)
    j = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b) if len(ours) == len(theirs) else min(
        len(ours), len(theirs)
    )
    prefix = prompt_ids + ours[:j]
    mine = our_logits_fn(prefix)[-1].float()
    ref = hf_logits(hf_model, prefix)[-1]
    a, b = ours[j], theirs[j]
    k = 5 if bf16 else 2
    contained = b in mine.topk(k).indices.tolist() and a in ref.topk(k).indices.tolist()
    close = bf16 or (abs(float(mine[a] - mine[b])) <= tie_tol and abs(float(ref[a] - ref[b])) <= tie_tol)
    assert contained and close, (
        f"prompt {index}: greedy diverged at step {j} (gemel {a}, HF {b}) without a near-tie: "
        f"gemel logits {float(mine[a]):.5f}/{float(mine[b]):.5f}, HF {float(ref[a]):.5f}/{float(ref[b]):.5f}"
    )
    return ParityResult(index, False, j)


def write_gguf(hf_dir: str, path: str, architecture: str, permute_qk: bool = False, q8_0: bool = False) -> str:
    """A tiny Hugging Face checkpoint as a GGUF file laid out as llama.cpp's converter lays it
    out: the ``gguf`` package's own tensor-name map (not gemel's), the architecture's metadata
    keys, tokenizer.json embedded. ``permute_qk``: q/k rows permuted for llama.cpp's rotary
    convention, as the converter does for Llama (not for Qwen2). ``q8_0``: every matrix whose
    rows are whole groups of 32 stored as Q8_0 blocks (the rest float32)."""
    import json
    import os

    import gguf
    import numpy as np
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer

    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[architecture.upper()], cfg["num_hidden_layers"])
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    writer.add_vocab_size(cfg["vocab_size"])
    tokenizer_file = os.path.join(hf_dir, "tokenizer.json")
    vocab = Tokenizer.from_file(tokenizer_file).get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens + [f"[PAD{i}]" for i in range(len(tokens), cfg["vocab_size"])])
    with open(tokenizer_file) as f:
        writer.add_string("tokenizer.huggingface.json", f.read())

    def permute(w, n_head):  # llama.cpp's convert_hf_to_gguf.py, LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    for name, tensor in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        if permute_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
            tensor = permute(tensor, heads if name.endswith("q_proj.weight") else kv_heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        if q8_0 and tensor.ndim == 2 and tensor.shape[1] % 32 == 0:
            blocks = gguf.quants.quantize(np.ascontiguousarray(tensor, dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name, blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
