"""The packaged real models (SmolLM2 Q4_1, Gemma 3 270M Q4_K_M) against Hugging Face
transformers on the same dequantised GGUF weights, float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch
from parity import check_greedy, hf_greedy, hf_model_from_gguf

from gemel import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Write a Python function that reverses a string.",
    "List three colours of the rainbow:",
    "Once upon a time, in a small village by the sea,",
    "Translate to French: 'Good morning, how are you?'",
    "What is 17 multiplied by 23?",
    "Explain photosynthesis in one sentence.",
    "def quicksort(arr):",
    "The three laws of thermodynamics are",
    "Q: Who wrote Pride and Prejudice?\nA:",
    "🙂 Emoji and ünïcödé: 東京は",
    "Summarise: The meeting was moved from Tuesday to Thursday because the projector was broken.",
]
NEW_TOKENS = 32


def _prompt_ids(llm: LLM, text: str, chat: bool) -> list[int]:
    if chat:
        return llm.tokenizer.encode_chat([{"role": "user", "content": text}])
    return llm.tokenizer.encode(text)


class Reference:
    """One model's prompts and transformers' float32 greedy continuations, computed once."""

    def __init__(self, model: str, chat: bool, scratch_dir: str):
        self.model = model
        tokenizer_llm = LLM(model, dtype="float32", num_kv_blocks=64)
        self.path = tokenizer_llm.engine.core.loaded.path
        self.prompts = [_prompt_ids(tokenizer_llm, p, chat) for p in PROMPTS]
        del tokenizer_llm
        self.hf = hf_model_from_gguf(self.path, torch.float32, scratch_dir)
        self.greedy = [hf_greedy(self.hf, ids, NEW_TOKENS) for ids in self.prompts]


@pytest.fixture(scope="module", params=[("smollm2-135m-instruct", True), ("gemma3-270m", False)], ids=["smollm2", "gemma3"])
def reference(request, tmp_path_factory) -> Reference:
    return Reference(*request.param, str(tmp_path_factory.mktemp("hf-gguf")))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_matches_transformers(reference: Reference, dtype: str):
    """float32: equal tokens (near-ties aside) and logits within 2e-3 (quantised weights are
    dequantised identically, so only summation order differs). bfloat16 against the float32
    reference: top-5 containment at any divergence."""
    llm = LLM(reference.model, dtype=dtype, kv_cache_memory_mb=256)
    outs = llm.generate(
        prompt_token_ids=reference.prompts,
        sampling_params=SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
    )
    if dtype == "float32":
        ids = reference.prompts[0] + outs[0].outputs[0].token_ids
        with torch.no_grad():
            ref = reference.hf(torch.tensor([ids])).logits[0].float()
        torch.testing.assert_close(llm.engine.core.prompt_logits(ids), ref, atol=2e-3, rtol=0)
    near_ties = []
    for i, (ids, out) in enumerate(zip(reference.prompts, outs)):
        result = check_greedy(
            i, ids, out.outputs[0].token_ids, reference.greedy[i], llm.engine.core.prompt_logits, reference.hf,
            bf16=dtype == "bfloat16",
        )
        if not result.equal:
            near_ties.append((PROMPTS[i], result.near_tie_step))
    print(f"{reference.model} {dtype}: divergences at near-ties (prompt, step): {near_ties}")
    if dtype == "float32":
        assert len(near_ties) <= 2, near_ties  # genuine near-ties are rare in float32
    else:
        # bf16 rounding legitimately flips close calls as a continuation grows; a broken bf16
        # path diverges at once. Most prompts must agree on their first 8 tokens.
        early = [(p, step) for p, step in near_ties if step < 8]
        assert len(early) <= len(PROMPTS) // 3, early


def test_smollm2_batch_invariance_and_preemption():
    prompts_text = PROMPTS + ["Hi", "Tell me a long story about dragons and castles and knights, with many details."] * 2
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM("smollm2-135m-instruct", dtype="float32", kv_cache_memory_mb=256)
    prompts = [_prompt_ids(llm, p, True) for p in prompts_text][:16]
    alone = [llm.generate(prompt_token_ids=[p], sampling_params=params)[0].outputs[0].token_ids for p in prompts]
    together = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert together == alone
    small = LLM("smollm2-135m-instruct", dtype="float32", num_kv_blocks=40, block_size=16)
    squeezed = [o.outputs[0].token_ids for o in small.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert small.engine.core.scheduler.num_preemptions > 0
    assert squeezed == alone
