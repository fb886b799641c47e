"""Tiny random-weight Llama, Gemma 3 (sliding window 8) and Qwen2 against Hugging Face transformers."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from parity import check_greedy, hf_greedy, hf_logits, write_gguf

from gemel import LLM, SamplingParams
from gemel.engine.scheduler import SchedulerOutput
from gemel.engine.sequence import Sequence
from gemel.loader import model_loader

LOGITS_ATOL = 1e-4  # float32, same weights; observed differences are ~1e-6

_rng = random.Random(0)
PROMPTS = [[_rng.randrange(3, 300) for _ in range(n)] for n in (1, 3, 7, 9, 16, 23, 40, 61)]


@pytest.fixture(scope="module", params=["llama", "gemma3", "qwen2"])
def pair(request):
    from transformers import AutoModelForCausalLM

    model_dir = request.getfixturevalue(f"tiny_{request.param}_dir")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(model_dir, dtype="float32", block_size=4, num_kv_blocks=256)
    return llm, hf


def test_logits_close_to_transformers(pair):
    llm, hf = pair
    for ids in PROMPTS:
        ours = llm.engine.core.prompt_logits(ids)
        ref = hf_logits(hf, ids)
        assert ours.shape == ref.shape
        torch.testing.assert_close(ours, ref, atol=LOGITS_ATOL, rtol=0)


def test_greedy_tokens_equal_transformers(pair):
    llm, hf = pair
    outs = llm.generate(
        prompt_token_ids=PROMPTS, sampling_params=SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    )
    near_ties = []
    for i, (ids, out) in enumerate(zip(PROMPTS, outs)):
        ours = out.outputs[0].token_ids
        assert len(ours) == 32
        result = check_greedy(i, ids, ours, hf_greedy(hf, ids, 32), llm.engine.core.prompt_logits, hf)
        if not result.equal:
            near_ties.append((i, result.near_tie_step))
    print("near-ties (prompt, step):", near_ties)
    assert len(near_ties) <= 1, f"too many near-tie divergences: {near_ties}"


@pytest.mark.parametrize("fused_ops", [True, False])
def test_last_layer_on_the_rows_read_out_alone(pair, fused_ops):
    """A step with prompt tokens finishes its last layer on the rows it reads out: those rows'
    final hidden states are the full forward's, and every token's keys and values still reach
    the cache."""
    llm, _ = pair
    core, runner = llm.engine.core, llm.engine.core.runner
    rng = random.Random(7)
    seqs = [Sequence(seq_id=f"rows-{i}", token_ids=[rng.randrange(3, 300) for _ in range(n)], params=SamplingParams())
            for i, n in enumerate((5, 1, 12, 9))]
    for seq in seqs:
        assert core.block_manager.allocate_slots(seq, seq.num_tokens)
    try:
        ids, pos, meta, rows = runner.prepare(SchedulerOutput(scheduled=[(s, s.num_tokens) for s in seqs]))
        meta = dataclasses.replace(meta, fused_ops=fused_ops and meta.fused_ops)
        assert rows == [4, 5, 17, 26]  # each prompt's last token
        with torch.inference_mode():
            full = runner.model(ids, pos, meta, runner.kv_caches)
            written = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
            for k, v in runner.kv_caches:  # forget this step's keys and values
                k.index_fill_(1, meta.slot_mapping, 0)
                v.index_fill_(1, meta.slot_mapping, 0)
            picked = runner.model(ids, pos, meta, runner.kv_caches, output_rows=torch.tensor(rows))
        assert picked.shape == (len(rows), full.shape[1])
        torch.testing.assert_close(picked, full[rows], atol=1e-5, rtol=0)
        slots = meta.slot_mapping
        for (k, v), (k_full, v_full) in zip(runner.kv_caches, written):
            assert torch.equal(k[:, slots], k_full[:, slots]) and torch.equal(v[:, slots], v_full[:, slots])
    finally:
        for seq in seqs:
            core.block_manager.free(seq)


def test_sliding_window_is_applied(tiny_gemma3_dir):
    """With the window ignored, logits past position 8 would differ from HF's: guard against that."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32).eval()
    llm = LLM(tiny_gemma3_dir, dtype="float32", block_size=4, num_kv_blocks=64)
    ids = PROMPTS[-1]
    ours = llm.engine.core.prompt_logits(ids)
    torch.testing.assert_close(ours, hf_logits(hf, ids), atol=LOGITS_ATOL, rtol=0)
    llm.engine.core.runner.sliding_window = None  # drop the window: must now disagree
    try:
        wrong = llm.engine.core.prompt_logits(ids)
    finally:
        llm.engine.core.runner.sliding_window = 8
    assert (wrong[10:] - hf_logits(hf, ids)[10:]).abs().max() > 1e-2


def test_qwen2_gguf_close_to_transformers(tiny_qwen2_dir, tmp_path):
    """The same Qwen2 weights read from GGUF: the q/k/v biases are found among the tensors and
    the q/k rows are taken as stored."""
    from transformers import AutoModelForCausalLM

    path = write_gguf(tiny_qwen2_dir, str(tmp_path / "tiny-qwen2.gguf"), "qwen2")
    assert not model_loader.stores_weight_groups(path)  # float tensors: dtype auto keeps bf16 where native
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32", block_size=4, num_kv_blocks=256)
    arch = llm.engine.core.loaded.arch
    assert (arch.architecture, arch.attention_bias, arch.tie_word_embeddings) == ("qwen2", True, False)
    for ids in PROMPTS:
        torch.testing.assert_close(llm.engine.core.prompt_logits(ids), hf_logits(hf, ids), atol=LOGITS_ATOL, rtol=0)
