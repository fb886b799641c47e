"""The chunked-prefill budget logic of the step-time target (F13), on synthetic timings."""

from __future__ import annotations

from gemel.engine.step_budget import StepTimeModel


def fed(fixed: float, per_token: float, sizes) -> StepTimeModel:
    m = StepTimeModel()
    for n in sizes:
        m.observe(n, fixed + per_token * n)
    return m


def test_fit_recovers_a_linear_cost():
    fixed, per_token = fed(0.010, 0.0002, [1, 8, 32, 64, 128, 300]).fit()
    assert abs(fixed - 0.010) < 1e-9 and abs(per_token - 0.0002) < 1e-12


def test_budget_keeps_decode_steps_under_target():
    m = fed(0.010, 0.0002, [1, 8, 32, 64, 128, 300])
    # 50 ms target: (0.050 - 0.010) / 0.0002 = 200 tokens
    assert m.budget(0.050, num_decoding=16, max_tokens=512) == 200
    assert m.budget(0.500, num_decoding=16, max_tokens=512) == 512  # capped by the configured max


def test_no_decodes_means_full_budget_and_floor_guarantees_progress():
    m = fed(0.010, 0.0002, [1, 8, 32, 64, 128, 300])
    assert m.budget(0.050, num_decoding=0, max_tokens=512) == 512
    # A target the decodes alone cannot meet still lets prefills advance by a small chunk.
    assert m.budget(0.005, num_decoding=40, max_tokens=512) == 40 + m.min_prefill_chunk


def test_without_a_fit_decodes_get_the_floor():
    m = fed(0.010, 0.0002, [5, 5])
    assert m.fit() is None
    assert m.budget(0.050, num_decoding=4, max_tokens=512) == 4 + m.min_prefill_chunk
    # Only decode steps seen, all the same size: no slope to extrapolate from either.
    m = fed(0.010, 0.0002, [16] * 40)
    assert m.fit() is None
    assert m.budget(0.050, num_decoding=16, max_tokens=2048) == 16 + m.min_prefill_chunk
    assert m.budget(0.050, num_decoding=0, max_tokens=2048) == 2048  # nobody waits: everything


def test_budget_never_extrapolates_far_past_measured_steps():
    m = fed(0.010, 0.00002, [14, 15, 16, 15, 16])  # a cheap-looking slope from a narrow range
    # The fit would allow 2,000 tokens; twice the largest step seen is 32, so the floor wins.
    assert m.budget(0.050, num_decoding=16, max_tokens=2048) == 16 + m.min_prefill_chunk
    # As larger steps are measured the cap follows them.
    for n in (80, 160, 320):
        m.observe(n, 0.010 + 0.00002 * n)
    assert m.budget(0.050, num_decoding=16, max_tokens=2048) == 640
