"""The batched sampler's rules, checked on hand-made logits."""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch

from gemel.layers import cpu_kernels
from gemel.layers.sampler import Sampler, SamplingBatch, _inverse_cdf, _top_k_top_p


def _kernels() -> bool:
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler: the PyTorch sampling path is used instead")
    assert cpu_kernels.load(), "a C++ compiler is present but the CPU kernels did not build"
    return True


@pytest.fixture(params=["torch", "kernel"])
def make_sampler(request):
    """Samplers on the PyTorch path and on the C++ kernel (sample_rows): each rule holds on both."""
    kernel = request.param == "kernel" and _kernels()

    def make(generator=None):
        s = Sampler(generator)
        s.cpu_argmax = s.cpu_sample = kernel
        return s

    return make


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


def test_greedy_and_top_k_1_pick_argmax(make_sampler):
    s = make_sampler(torch.Generator().manual_seed(0))
    assert s(LOGITS, batch(1, 5, temperature=0)).token_ids == [0]
    assert all(s(LOGITS, batch(1, 5, top_k=1)).token_ids == [0] for _ in range(20))


def test_sampling_follows_softmax(make_sampler):
    s = make_sampler(torch.Generator().manual_seed(0))
    logits = LOGITS.repeat(4000, 1)
    toks = torch.tensor(s(logits, batch(4000, 5)).token_ids)
    freq = torch.bincount(toks, minlength=5).float() / 4000
    expected = torch.softmax(LOGITS[0], -1)
    chi2 = float((((freq - expected) ** 2) / expected).sum() * 4000)
    assert chi2 < 18.5  # 4 degrees of freedom, p = 0.001


def test_top_p_and_min_p_cut_the_tail(make_sampler):
    s = make_sampler(torch.Generator().manual_seed(0))
    logits = LOGITS.repeat(2000, 1)
    p = torch.softmax(LOGITS[0], -1)
    toks = set(s(logits, batch(2000, 5, top_p=float(p[0] + 0.01))).token_ids)
    assert toks == {0, 1}
    toks = set(s(logits, batch(2000, 5, min_p=float(p[2] / p[0]) + 1e-3)).token_ids)
    assert toks == {0, 1}


def test_penalties(make_sampler):
    s = make_sampler()
    b = batch(1, 5, temperature=0, frequency=1.5)
    b.output_counts = torch.tensor([[1.0, 0, 0, 0, 0]])
    assert s(LOGITS, b).token_ids == [1]
    b = batch(1, 5, temperature=0, repetition=3.0)
    b.seen_mask = torch.tensor([[True, False, False, False, False]])
    assert s(LOGITS, b).token_ids == [1]  # 2.0 / 3 < 1.0


def test_seeded_rows_do_not_depend_on_neighbours(make_sampler):
    s = make_sampler(torch.Generator().manual_seed(0))
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


def test_temperature_sharpens_and_flattens(make_sampler):
    """T < 1 moves mass to the top token, T > 1 away from it, in the softmax(logits / T) ratio."""
    s = make_sampler(torch.Generator().manual_seed(1))
    for temperature in (0.5, 2.0):
        toks = torch.tensor(s(LOGITS.repeat(4000, 1), batch(4000, 5, temperature=temperature)).token_ids)
        freq = torch.bincount(toks, minlength=5).float() / 4000
        expected = torch.softmax(LOGITS[0] / temperature, -1)
        chi2 = float((((freq - expected) ** 2) / expected).sum() * 4000)
        assert chi2 < 18.5, (temperature, freq, expected)


def test_sampling_reaches_tokens_across_a_long_vocabulary(make_sampler):
    """Mass spread over tokens far apart in a 12,000-entry row (the kernel's rows are walked in
    chunks of 2,048): each is drawn at its probability, the masked rest never."""
    vocab = 12_000
    picks = torch.tensor([0, 2047, 2048, 4095, 8191, 11_999])
    logits = torch.full((1, vocab), float("-inf"))
    logits[0, picks] = torch.tensor([0.5, 1.0, -0.5, 0.0, 1.5, 0.2])
    s = make_sampler(torch.Generator().manual_seed(2))
    n = 2000
    toks = torch.tensor(s(logits.repeat(n, 1), batch(n, vocab)).token_ids)
    assert set(toks.tolist()) <= set(picks.tolist())
    freq = torch.stack([(toks == p).float().mean() for p in picks])
    expected = torch.softmax(logits[0, picks], -1)
    chi2 = float((((freq - expected) ** 2) / expected).sum() * n)
    assert chi2 < 20.5  # 5 degrees of freedom, p = 0.001


def _kept_weights(logits, temperature, top_k, top_p, min_p):
    """One row's sampling weights in float64, by the rules written out: tempered, top-k, top-p
    (a token stays while the mass strictly before it is under top_p), min-p."""
    w = torch.exp((logits.double() - logits.max()) / temperature)
    order = torch.argsort(logits.double(), descending=True)
    keep = torch.zeros_like(w, dtype=torch.bool)
    keep[order[:top_k]] = True
    w = torch.where(keep, w, torch.zeros_like(w))
    sorted_w = w[order]
    before = sorted_w.cumsum(0) - sorted_w
    cut = before >= top_p * sorted_w.sum()
    cut[0] = False
    w[order[cut]] = 0
    return torch.where(w >= min_p, w, torch.zeros_like(w)), before / sorted_w.sum(), order


def test_sampling_kernel_equals_the_rules_written_out():
    """sample_rows against the rules in float64 with the same uniform draws, over vocabularies
    shorter and longer than a chunk, temperatures, top-k, top-p, min-p, masked entries and greedy
    rows: the same token, or one that only a rounding at a boundary separates (the draw lying on
    a token's edge, or a token's mass before it lying on top_p)."""
    _kernels()
    g = torch.Generator().manual_seed(5)
    for vocab in (7, 2048, 2049, 49_152, 70_001):
        rows = 24
        logits = torch.randn(rows, vocab, generator=g) * 4
        logits[3, : vocab // 2] = float("-inf")  # half the row masked (structured output, top-k)
        logits[4, 1:] = float("-inf")  # one token left
        temperature = torch.tensor([0.0, 0.3, 1.0, 1.0, 1.0, 1.7] * 4)
        min_p = torch.tensor([0.0] * 12 + [0.05] * 6 + [0.5] * 6)
        top_k = torch.tensor([vocab] * 6 + [1, 5, 40, vocab, vocab, 3] * 2 + [vocab, 40] * 3)
        top_p = torch.tensor([1.0] * 9 + [0.9, 0.5, 0.95] + [1.0, 0.8] * 6)
        uniform = torch.rand(rows, generator=g, dtype=torch.float64)
        uniform[5], uniform[7] = 0.0, 1.0 - 2**-53  # the two ends
        got = torch.ops.gemel.sample_rows(logits, temperature, top_k, top_p, min_p, uniform)
        assert got[4] == 0
        for r in range(rows):
            if temperature[r] == 0:  # greedy
                assert got[r] == logits[r].argmax()
                continue
            if r == 4:
                continue
            w, before, order = _kept_weights(logits[r], float(temperature[r]), int(top_k[r]), float(top_p[r]), float(min_p[r]))
            assert w[got[r]] > 0, f"vocab {vocab} row {r}: a cut token was drawn"
            running = w.cumsum(0)
            want = int(torch.searchsorted(running, uniform[r] * running[-1], right=True).clamp(max=vocab - 1))
            if int(got[r]) == want:
                continue
            edge = running[min(int(got[r]), want)]
            on_edge = abs(float(uniform[r] * running[-1] - edge)) < 1e-5 * float(running[-1])
            on_top_p = bool(((before - float(top_p[r])).abs() < 1e-5).any())
            assert on_edge or on_top_p, (vocab, r, int(got[r]), want)


def _draws_in_kept_shares(logits, w, temperature, top_k, top_p, g, lightest):
    """sample_rows with a draw in the middle of the share of each probed kept token (w > 0: the
    ``lightest`` lightest, the 10 heaviest, 30 at random, each holding over 1e-7 of the mass).
    Returns (tokens drawn, tokens probed); equal when the kernel keeps exactly w's tokens."""
    kept = torch.nonzero(w > 0).view(-1)
    total = float(w.sum())
    ends = w.cumsum(0) / total
    by_weight = kept[torch.argsort(w[kept])]  # lightest first
    probe = torch.cat([by_weight[:lightest], by_weight[-10:], kept[torch.randperm(len(kept), generator=g)[:30]]]).unique()
    probe = probe[w[probe] / total > 1e-7]
    uniform = (ends[probe] - w[probe] / (2 * total)).double()
    n = len(probe)
    got = torch.ops.gemel.sample_rows(logits.repeat(n, 1), torch.full((n,), temperature), torch.full((n,), top_k),
                                      torch.full((n,), top_p), torch.zeros(n), uniform)
    return got.tolist(), probe.tolist()


def test_sampling_kernel_keeps_the_lightest_tokens_top_p_needs():
    """Top-p over a long vocabulary where thousands of tokens are heavy enough to matter (the
    kernel drops the octaves of weight below the crossing before ordering the rest): a draw in
    the middle of each kept token's share, the lightest ones (about the crossing) included, gives
    that token, so none is lost and none of the cut ones came in between."""
    _kernels()
    g = torch.Generator().manual_seed(21)
    vocab = 49_152
    cases = [(torch.randn(vocab, generator=g) * scale, temperature, top_p)
             for scale, temperature in ((1.0, 1.0), (3.0, 0.7), (6.0, 1.0)) for top_p in (0.5, 0.9, 0.95, 0.99)]
    checked = 0
    for logits, temperature, top_p in cases:
        w, before, order = _kept_weights(logits, temperature, vocab, top_p, 0.0)
        kept = torch.nonzero(w > 0).view(-1)
        crossing = len(kept) - 1  # in descending order: the last kept token, then the first cut
        if abs(float(before[crossing]) - top_p) < 2e-6 or abs(float(before[crossing + 1]) - top_p) < 2e-6:
            continue  # the crossing lies on top_p: either answer is right
        checked += 1
        got, probe = _draws_in_kept_shares(logits, w, temperature, vocab, top_p, g, lightest=40)
        assert got == probe, (temperature, top_p, len(kept))
    assert checked >= 8


def test_sampling_kernel_keeps_exactly_the_top_k():
    """Top-k over long rows (the kernel looks only at the blocks of 64 logits whose largest reaches
    the k-th largest of the blocks' largest): masked stretches, ties at the k-th value (all kept,
    as vLLM keeps them), k of 1 to more than the masked rows' blocks; a draw in the middle of a
    kept token's share gives that token."""
    _kernels()
    g = torch.Generator().manual_seed(23)
    vocab = 131_072
    checked = tied = 0
    for k in (1, 40, 64, 1_000, 3_000):
        for shape in ("plain", "masked", "ties"):
            logits = torch.randn(vocab, generator=g) * 3
            if shape == "masked":
                logits[: vocab // 2] = float("-inf")
                logits[vocab // 2 + 5_000 : vocab // 2 + 40_000] = float("-inf")
            elif shape == "ties":
                logits = (logits * 2).round() / 2  # a few dozen distinct values, so ties at the k-th
            # every logit at or above the k-th largest, ties included; a high temperature keeps the shares wide
            floor = logits[torch.isfinite(logits)].topk(k).values[-1]
            w = torch.where(logits >= floor, torch.exp((logits.double() - logits.max()) / 50.0), torch.zeros(()))
            kept = torch.nonzero(w > 0).view(-1)
            assert len(kept) >= k
            tied += len(kept) > k
            got, probe = _draws_in_kept_shares(logits, w, 50.0, k, 1.0, g, lightest=30)
            assert got == probe, (k, shape, len(kept))
            checked += 1
    assert checked == 15 and tied >= 3


def test_sampling_kernel_cuts_to_top_k_and_top_p_as_the_pytorch_path():
    """The kernel's floor from top-k and top-p keeps the tokens PyTorch's sort keeps: drawn
    many times, each row's set of tokens is the sorted path's."""
    _kernels()
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(1, 5000, generator=g) * 2
    for top_k, top_p in ((7, 1.0), (5000, 0.3), (50, 0.6)):
        n = 3000
        b = batch(n, 5000, top_k=top_k, top_p=top_p)
        kernel = Sampler(torch.Generator().manual_seed(0))
        kernel.cpu_argmax = kernel.cpu_sample = True
        got = set(kernel(logits.repeat(n, 1), b).token_ids)
        kept = _top_k_top_p(logits, torch.tensor([top_k]), torch.tensor([top_p]))
        allowed = set(torch.nonzero(torch.isfinite(kept[0])).view(-1).tolist())
        assert got <= allowed and len(got) >= min(len(allowed), 3), (top_k, top_p, len(got), len(allowed))


def test_sampling_kernel_answers_rows_without_a_distribution_as_argmax():
    """NaN and +inf rows get torch.argmax's token (first NaN, else first +inf); a row with no
    finite logit its first entry; so a bad row never crashes the batch or leaves the vocabulary."""
    _kernels()
    logits = torch.randn(4, 3000)
    logits[0, 1234], logits[0, 2000] = float("nan"), float("inf")
    logits[1, 2500], logits[1, 2600] = float("inf"), float("inf")
    logits[2] = float("-inf")
    off_k, off_p = torch.full((4,), 3000), torch.ones(4)
    got = torch.ops.gemel.sample_rows(logits, torch.ones(4), off_k, off_p, torch.zeros(4), torch.full((4,), 0.5, dtype=torch.float64))
    assert got[:3].tolist() == [1234, 2500, 0]
    assert got[:3].tolist() == _inverse_cdf(logits, torch.ones(4), torch.zeros(4), torch.full((4,), 0.5, dtype=torch.float64))[:3].tolist()
    assert 0 <= int(got[3]) < 3000


def test_sampling_kernel_is_the_same_on_any_number_of_threads():
    """Rows are summed in fixed chunks: one thread or two give the same tokens (top-p on)."""
    _kernels()
    logits = torch.randn(3, 100_000, generator=torch.Generator().manual_seed(9)) * 3
    uniform = torch.rand(3, dtype=torch.float64, generator=torch.Generator().manual_seed(10))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        off_k, off_p = torch.full((3,), 100_000), torch.full((3,), 0.9)
        one = torch.ops.gemel.sample_rows(logits, torch.ones(3), off_k, off_p, torch.zeros(3), uniform)
        torch.set_num_threads(max(2, threads))
        many = torch.ops.gemel.sample_rows(logits, torch.ones(3), off_k, off_p, torch.zeros(3), uniform)
    finally:
        torch.set_num_threads(threads)
    assert one.tolist() == many.tolist()
