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


def test_too_few_samples_fall_back_to_max():
    m = fed(0.010, 0.0002, [5, 5])
    assert m.fit() is None
    assert m.budget(0.050, num_decoding=4, max_tokens=512) == 512
