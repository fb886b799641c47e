"""The batched sampler's rules, checked on hand-made logits."""

from __future__ import annotations

import math

import torch

from gemel.layers.sampler import Sampler, SamplingBatch


def batch(n, vocab, **kw) -> SamplingBatch:
    def full(v, dtype=torch.float32):
        return torch.full((n,), v, dtype=dtype)

    b = SamplingBatch(
        temperature=full(kw.get("temperature", 1.0)),
        top_k=full(kw.get("top_k", vocab), torch.long),
        top_p=full(kw.get("top_p", 1.0)),
        min_p=full(kw.get("min_p", 0.0)),
        presence_penalty=full(kw.get("presence", 0.0)),
        frequency_penalty=full(kw.get("frequency", 0.0)),
        repetition_penalty=full(kw.get("repetition", 1.0)),
        generators=kw.get("generators", [None] * n),
        num_logprobs=kw.get("num_logprobs"),
    )
    b.all_greedy = kw.get("temperature", 1.0) == 0
    return b


LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])


def test_greedy_and_top_k_1_pick_argmax():
    s = Sampler(torch.Generator().manual_seed(0))
    assert s(LOGITS, batch(1, 5, temperature=0)).token_ids == [0]
    assert all(s(LOGITS, batch(1, 5, top_k=1)).token_ids == [0] for _ in range(20))


def test_sampling_follows_softmax():
    s = Sampler(torch.Generator().manual_seed(0))
    logits = LOGITS.repeat(4000, 1)
    toks = torch.tensor(s(logits, batch(4000, 5)).token_ids)
    freq = torch.bincount(toks, minlength=5).float() / 4000
    expected = torch.softmax(LOGITS[0], -1)
    chi2 = float((((freq - expected) ** 2) / expected).sum() * 4000)
    assert chi2 < 18.5  # 4 degrees of freedom, p = 0.001


def test_top_p_and_min_p_cut_the_tail():
    s = Sampler(torch.Generator().manual_seed(0))
    logits = LOGITS.repeat(2000, 1)
    p = torch.softmax(LOGITS[0], -1)
    toks = set(s(logits, batch(2000, 5, top_p=float(p[0] + 0.01))).token_ids)
    assert toks == {0, 1}
    toks = set(s(logits, batch(2000, 5, min_p=float(p[2] / p[0]) + 1e-3)).token_ids)
    assert toks == {0, 1}


def test_penalties():
    s = Sampler()
    b = batch(1, 5, temperature=0, frequency=1.5)
    b.output_counts = torch.tensor([[1.0, 0, 0, 0, 0]])
    assert s(LOGITS, b).token_ids == [1]
    b = batch(1, 5, temperature=0, repetition=3.0)
    b.seen_mask = torch.tensor([[True, False, False, False, False]])
    assert s(LOGITS, b).token_ids == [1]  # 2.0 / 3 < 1.0


def test_seeded_rows_do_not_depend_on_neighbours():
    s = Sampler(torch.Generator().manual_seed(0))
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(3))
    solo = s(logits, batch(1, 50, generators=[torch.Generator().manual_seed(42)])).token_ids[0]
    crowd = torch.cat([torch.randn(3, 50), logits, torch.randn(2, 50)])
    gens = [None, None, None, torch.Generator().manual_seed(42), None, None]
    assert s(crowd, batch(6, 50, generators=gens)).token_ids[3] == solo


def test_logprobs_top_and_chosen():
    s = Sampler()
    out = s(LOGITS, batch(1, 5, temperature=0, num_logprobs=[2]))
    lsm = torch.log_softmax(LOGITS[0], -1)
    assert math.isclose(out.logprobs[0], float(lsm[0]), abs_tol=1e-6)
    assert [t for t, _ in out.top_logprobs[0]] == [0, 1]
