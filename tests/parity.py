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
