"""The chunked-prefill budget logic of the step-time target, on synthetic timings."""

from __future__ import annotations

import pytest

from gemel.engine.step_budget import StepTimeModel, prefill_keys


def fed(fixed: float, per_token: float, sizes, per_key: float = 0.0, contexts=None) -> StepTimeModel:
    """A model that saw steps of ``sizes`` tokens, each a prompt chunk after ``contexts[i]``
    cached tokens (keys > 0, so none counts as a decode-only step)."""
    m = StepTimeModel()
    for i, n in enumerate(sizes):
        keys = prefill_keys(contexts[i] if contexts else 0, n)
        m.observe(n, fixed + per_token * n + per_key * keys, keys)
    return m


def test_prefill_keys_counts_each_tokens_causal_prefix():
    assert prefill_keys(0, 1) == 1  # a one-token prompt attends to itself
    assert prefill_keys(0, 4) == 1 + 2 + 3 + 4
    assert prefill_keys(100, 3) == 101 + 102 + 103


def test_fit_recovers_a_linear_cost():
    fixed, per_token, per_key = fed(0.010, 0.0002, [1, 8, 32, 64, 128, 300]).fit()
    assert abs(fixed - 0.010) < 1e-9 and abs(per_token - 0.0002) < 1e-12
    assert abs(per_key) < 1e-12  # here keys follow tokens exactly (no context): nothing to split off


def test_fit_separates_the_cost_of_attended_keys():
    sizes = [16, 32, 64, 32, 16, 64, 48, 24]
    contexts = [0, 0, 0, 500, 1000, 1500, 2000, 1800]
    fit = fed(0.012, 0.0004, sizes, per_key=2e-8, contexts=contexts).fit()
    assert fit.fixed == pytest.approx(0.012, rel=1e-6)
    assert fit.per_token == pytest.approx(0.0004, rel=1e-6)
    assert fit.per_key == pytest.approx(2e-8, rel=1e-6)


def test_budget_keeps_decode_steps_under_target():
    m = fed(0.010, 0.0002, [1, 8, 32, 64, 128, 300])
    # 50 ms target: (0.050 - 0.010) / 0.0002 = 200 tokens
    assert m.budget(0.050, num_decoding=16, max_tokens=512) == 200
    assert m.budget(0.500, num_decoding=16, max_tokens=512) == 512  # capped by the configured max


def test_later_chunks_of_a_long_prompt_get_fewer_tokens():
    fixed, per_token, per_key = 0.012, 0.0004, 2e-8
    m = fed(fixed, per_token, [16, 32, 64, 32, 16, 64, 48, 24], per_key, [0, 0, 0, 500, 1000, 1500, 2000, 1800])
    budgets = [m.budget(0.050, num_decoding=16, max_tokens=2048, prefill_context=c) for c in (0, 1000, 2000)]
    assert budgets[0] > budgets[1] > budgets[2]
    for context, budget in zip((0, 1000, 2000), budgets):
        chunk = budget - 16

        def cost(x):
            return fixed + per_token * (16 + x) + per_key * prefill_keys(context, x)

        assert cost(chunk) <= 0.050 + 1e-12 < cost(chunk + 1)  # the largest chunk that fits


def test_no_decodes_means_full_budget_and_floor_guarantees_progress():
    m = fed(0.010, 0.0002, [1, 8, 32, 64, 128, 300])
    assert m.budget(0.050, num_decoding=0, max_tokens=512) == 512
    # A target the fit says the decodes alone cannot meet lets prefills advance by the larger
    # chunk, as measured decode-only steps over the target do (it is missed anyway).
    assert m.budget(0.005, num_decoding=40, max_tokens=512) == 40 + m.over_target_chunk
    # Where the decodes fit but nothing more does, prompts still advance by the floor.
    assert m.budget(0.010 + 0.0002 * 40 + 0.001, num_decoding=40, max_tokens=512) == 40 + m.min_prefill_chunk


def test_decode_steps_over_the_target_let_prompts_take_a_larger_chunk():
    m = fed(0.010, 0.0002, [1, 8, 32, 64, 128, 300])
    for _ in range(5):
        m.observe(40, 0.060)  # decodes alone (no prompt keys): 60 ms against a 50 ms target
    assert m.budget(0.050, num_decoding=40, max_tokens=512) == 40 + m.over_target_chunk
    for _ in range(8):  # decodes got cheaper again: the recent ones decide
        m.observe(40, 0.030)
    assert m.budget(0.050, num_decoding=40, max_tokens=512) != 40 + m.over_target_chunk


def test_without_a_fit_decodes_get_the_floor():
    m = fed(0.010, 0.0002, [5, 5])
    assert m.fit() is None
    assert m.budget(0.050, num_decoding=4, max_tokens=512) == 4 + m.min_prefill_chunk
    # Only decode steps seen, all the same size: no slope to extrapolate from either.
    m = StepTimeModel()
    for _ in range(40):
        m.observe(16, 0.0132)
    assert m.fit() is None
    assert m.budget(0.050, num_decoding=16, max_tokens=2048) == 16 + m.min_prefill_chunk
    assert m.budget(0.050, num_decoding=0, max_tokens=2048) == 2048  # nobody waits: everything


def test_budget_never_extrapolates_far_past_measured_steps():
    m = fed(0.010, 0.00002, [14, 15, 16, 15, 16])  # a cheap-looking slope from a narrow range
    # The fit would allow 2,000 tokens; twice the largest step seen is 32, so that caps it.
    assert m.budget(0.050, num_decoding=8, max_tokens=2048) == 32
    # As larger steps are measured the cap follows them.
    for n in (80, 160, 320):
        m.observe(n, 0.010 + 0.00002 * n, prefill_keys(0, n))
    assert m.budget(0.050, num_decoding=16, max_tokens=2048) == 640



def test_budget_plans_for_the_fits_usual_overshoot_not_its_mean():
    """Steps of the same size scatter around the fit: half of them run 4 ms over it. A budget
    planned on the fit alone would put every other step 4 ms past the target; the budget
    keeps the planned step plus that overshoot under it."""
    fixed, per_token, scatter = 0.010, 0.0002, 0.004
    m = StepTimeModel()
    for n in (16, 32, 64, 128, 256) * 4:
        for noise in (scatter, -scatter):
            m.observe(n, fixed + per_token * n + noise, prefill_keys(0, n))
    fit = m.fit()
    assert fit.fixed == pytest.approx(fixed) and fit.per_token == pytest.approx(per_token)
    assert m.overshoot(fit) == pytest.approx(scatter)
    budget = m.budget(0.050, num_decoding=16, max_tokens=2048)
    # (0.050 - 0.004 - 0.010) / 0.0002 = 180 tokens, against 200 for the mean
    assert budget == 180
    assert fixed + per_token * budget + scatter <= 0.050 + 1e-12


def test_an_exact_fit_has_no_overshoot():
    m = fed(0.010, 0.0002, [1, 8, 32, 64, 128, 300])
    assert m.overshoot(m.fit()) == pytest.approx(0.0, abs=1e-12)


def test_steps_that_all_carry_a_chunk_still_reveal_decodes_over_the_target():
    """30 streams behind a long shared prompt: every step also prefills a newcomer's chunk, so
    no step runs decodes alone; the fit says they alone take ~95 ms against a 50 ms target, so
    newcomers are admitted by the larger chunk instead of crawling in by the floor."""
    m = StepTimeModel()
    for decoding in range(1, 31):
        tokens = decoding + 16
        keys = prefill_keys(1000, 16)
        m.observe(tokens, 0.005 + 0.003 * tokens + 1e-8 * keys, keys)
    assert not m.decode_steps
    assert m.budget(0.050, num_decoding=30, max_tokens=2048, prefill_context=1000) == 30 + m.over_target_chunk


def test_requests_waiting_for_a_first_token_weigh_against_the_streams_next_one():
    fixed, per_token = 0.010, 0.0002
    m = fed(fixed, per_token, [1, 8, 32, 64, 128, 300])
    alone = m.budget(0.050, num_decoding=4, max_tokens=4096)
    assert alone == 200  # (0.050 - 0.010) / 0.0002
    assert m.budget(0.050, num_decoding=4, max_tokens=4096, num_waiting=4) == alone  # no more than decode
    # 28 requests wait behind 4 streams: the step may take 7 x 50 ms, capped by what was measured
    assert m.budget(0.050, num_decoding=4, max_tokens=4096, num_waiting=28) == 2 * 300
    m.observe(2000, fixed + per_token * 2000, prefill_keys(0, 2000))
    assert m.budget(0.050, num_decoding=4, max_tokens=4096, num_waiting=28) == 1700  # (0.350 - 0.010) / 0.0002


def test_measured_decode_steps_of_the_batch_outrank_the_fits_prediction():
    """16 streams decode in 30 ms alone; then each step also carries a 16-token chunk of a long
    prompt at 55-60 ms, from which a plane predicts decodes alone over the 50 ms target. The
    measured steps decide (no 64-token chunk, which would spike the streams' ITL); steps
    measured at another batch size do not."""
    m = StepTimeModel()
    for _ in range(8):
        m.observe(16, 0.030)
    for i in range(40):
        tokens, keys = 32, prefill_keys(100 + 16 * i, 16)
        m.observe(tokens, 0.055 + 0.005 * (i % 2), keys)
        m.observe(33, 0.062 + 0.005 * (i % 2), keys)
    fit = m.fit()
    assert fit.fixed + fit.per_token * 16 > 0.050  # the plane alone would say "over"
    assert m.budget(0.050, num_decoding=16, max_tokens=2048, prefill_context=800) == 16 + m.min_prefill_chunk
    assert m.budget(0.050, num_decoding=40, max_tokens=2048, prefill_context=800) == 40 + m.over_target_chunk


def test_short_prompts_in_line_are_taken_whole():
    """32 streams whose decodes alone fill the 50 ms target: without the whole-prompt floor a
    128-token newcomer would get 16 tokens a step (8 steps to its first token); with it, the
    next prompts go in whole, as many as whole_prompt_tokens hold together. A long prompt is
    still chunked, and its last short piece taken whole."""
    fixed, per_token = 0.010, 0.00125  # 32 decodes: 50 ms
    m = fed(fixed, per_token, [8, 16, 32, 64])
    assert m.budget(0.050, num_decoding=32, max_tokens=512) == 32 + m.min_prefill_chunk
    assert m.budget(0.050, num_decoding=32, max_tokens=512, prompts_in_line=[128]) == 32 + 128
    assert m.budget(0.050, num_decoding=32, max_tokens=512, prompts_in_line=[128, 128, 128]) == 32 + 256
    assert m.budget(0.050, num_decoding=32, max_tokens=512, prompts_in_line=[100, 200]) == 32 + 100
    assert m.budget(0.050, num_decoding=32, max_tokens=512, prompts_in_line=[4000, 128]) == 32 + m.min_prefill_chunk
    assert m.budget(0.050, num_decoding=32, max_tokens=512, prompts_in_line=[90]) == 32 + 90
    assert m.budget(0.050, num_decoding=32, max_tokens=100, prompts_in_line=[128]) == 100  # never past the budget
    # decodes alone over the target: the larger of the over-target chunk and the whole prompts
    slow = fed(0.030, per_token, [8, 16, 32, 64])
    assert slow.budget(0.050, num_decoding=32, max_tokens=512, prompts_in_line=[40]) == 32 + slow.over_target_chunk
    assert slow.budget(0.050, num_decoding=32, max_tokens=512, prompts_in_line=[128, 128]) == 32 + 256
