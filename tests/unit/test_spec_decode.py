"""Speculative decoding: n-gram proposals, verification, and the target distribution."""

from __future__ import annotations

import pytest
import torch

from gemel import LLM, SamplingParams
from gemel.engine.spec_decode import NgramProposer, verify

REPETITIVE = [[7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8], [20, 21, 22] * 6, list(range(30, 70)) + list(range(30, 40))]


def test_ngram_proposer_finds_latest_match():
    p = NgramProposer(k=3, n_max=3)
    assert p.propose([1, 2, 3, 4, 5, 1, 2]) == [3, 4, 5]
    assert p.propose([9, 9, 9]) == [9]  # n=2 match at 0 ("9 9") is followed by one token
    assert p.propose([1, 2, 3]) == []


def test_verify_greedy_keeps_agreeing_prefix_plus_one():
    logits = torch.full((4, 6), -5.0)
    for row, tok in enumerate([2, 3, 1, 5]):
        logits[row, tok] = 5.0
    params = SamplingParams(temperature=0)
    assert verify(logits, [2, 3, 1], params, None) == [2, 3, 1, 5]
    assert verify(logits, [2, 4, 1], params, None) == [2, 3]


def test_verify_preserves_the_target_distribution():
    """Chi-square: the first emitted token follows p whatever the (deterministic) draft."""
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(8) * 1.5, dim=0)
    probs = p.repeat(3, 1)
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=1.0)
    n = 20000
    counts = torch.zeros(8)
    for _ in range(n):
        counts[verify(probs, [int(p.argmax()), 3], params, gen)[0]] += 1
    expected = p * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 24.3, (chi2, counts, expected)  # 7 degrees of freedom, p = 0.001


@pytest.fixture(scope="module")
def pair(tiny_llama_dir):
    base = LLM(tiny_llama_dir, dtype="float32", block_size=4, num_kv_blocks=512)
    spec = LLM(tiny_llama_dir, dtype="float32", block_size=4, num_kv_blocks=512, speculative_method="ngram",
               num_speculative_tokens=4)
    return base, spec


def test_greedy_output_identical_with_ngram_speculation(pair):
    base, spec = pair
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    a = [o.outputs[0].token_ids for o in base.generate(prompt_token_ids=REPETITIVE, sampling_params=params)]
    b = [o.outputs[0].token_ids for o in spec.generate(prompt_token_ids=REPETITIVE, sampling_params=params)]
    assert a == b
    stats = spec.engine.core.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens > 0
    core = spec.engine.core
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


def test_sampled_second_token_keeps_target_marginal(pair):
    """Exact marginal of the 2nd output token under the target vs samples drawn with
    speculation, on the tiny (320-token) model. Every token occurs in the prompt, so the
    n-gram proposer drafts at every step."""
    base, spec = pair
    prompt = list(range(3, 320)) + [5, 6]
    core = base.engine.core
    p1 = torch.softmax(core.prompt_logits(prompt)[-1], dim=-1)
    support = [int(t) for t in torch.nonzero(p1 > 1e-4).flatten()]
    marginal = torch.zeros(p1.shape[0])
    for t1 in support:
        marginal += p1[t1] * torch.softmax(core.prompt_logits(prompt + [t1])[-1], dim=-1)
    n = 1500
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=4, ignore_eos=True) for i in range(n)]
    drafts_before = spec.engine.core.spec_stats.num_drafts
    outs = spec.generate(prompt_token_ids=[prompt] * n, sampling_params=params)
    assert spec.engine.core.spec_stats.num_drafts - drafts_before >= n  # every 2nd token came from verify()
    counts = torch.zeros_like(marginal)
    for o in outs:
        counts[o.outputs[0].token_ids[1]] += 1
    assert spec.engine.core.spec_stats.num_draft_tokens > 0
    expected = marginal * n
    big = expected >= 5  # merge rare tokens into one bin, as chi-square needs
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    chi2 = float(((obs - exp) ** 2 / exp.clamp(min=1e-9)).sum())
    dof = int(big.sum())
    # chi-square critical value at p = 0.001 is below dof + 4.5 * sqrt(2 dof) + 10 for these dof
    assert chi2 < dof + 4.5 * (2 * dof) ** 0.5 + 10, (chi2, dof)


def test_greedy_output_identical_with_self_speculative_draft(tiny_llama_dir, pair):
    base, _ = pair
    spec = LLM(tiny_llama_dir, dtype="float32", block_size=4, num_kv_blocks=512, speculative_method="draft_layers",
               draft_layers=1, num_speculative_tokens=3)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = REPETITIVE + [[5, 6, 7]]
    a = [o.outputs[0].token_ids for o in base.generate(prompt_token_ids=prompts, sampling_params=params)]
    b = [o.outputs[0].token_ids for o in spec.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert a == b
    stats = spec.engine.core.spec_stats
    assert stats.num_draft_tokens > 0
    core = spec.engine.core
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
