"""Worked examples of what the adaptation loop learns about its own predictions."""

import pytest

from nereus_rl.costmodel.calibration import ModelTolerance, StepNoise, TransitionCalibration


def test_transition_calibration_is_the_recent_median_excess():
    cal = TransitionCalibration(window=3)
    assert cal.excess_s == 0.0 and cal.price(0.05) == pytest.approx(0.05)  # model's own
    cal.observe(0.05, 3.95)  # one slow transition alone (a layout's first use) ...
    assert cal.excess_s == 0.0  # ... moves nothing: lower median of 0, 3.9
    cal.observe(0.01, 0.04)  # 0, 0.03, 3.9 -> 0.03
    assert cal.excess_s == pytest.approx(0.03)
    assert cal.price(0.01) == pytest.approx(0.04)  # a fixed part, not a ratio
    cal.observe(0.02, 0.07)  # 0, 0.03, 0.05, 3.9 -> lower median 0.03
    assert cal.excess_s == pytest.approx(0.03)
    cal.observe(0.02, 0.08)  # window 3 drops 3.9: 0, 0.03, 0.05, 0.06 -> 0.03
    cal.observe(0.02, 0.07)  # 0, 0.05, 0.05, 0.06 -> 0.05
    assert cal.excesses == pytest.approx([0.05, 0.06, 0.05])
    assert cal.excess_s == pytest.approx(0.05)
    cal.observe(0.1, 0.05)  # faster than priced: a negative excess counts too
    cal.observe(0.1, 0.04)  # -0.06, -0.05, 0, 0.05 -> -0.05
    assert cal.excess_s == pytest.approx(-0.05) and cal.price(0.01) == 0.0
    cal.observe(-1.0, 1.0)  # not a measurement: ignored
    assert len(cal.excesses) == 3
    with pytest.raises(ValueError, match="window"):
        TransitionCalibration(window=0)


def test_model_tolerance_is_the_recent_median_error():
    tol = ModelTolerance(prior=0.15, window=3)
    assert tol.value == pytest.approx(0.15)
    tol.observe(0.20, 0.25)  # +25%
    assert tol.value == pytest.approx(0.25)
    tol.observe(0.20, 0.18)  # -10%
    tol.observe(0.20, 0.21)  # +5%
    assert tol.value == pytest.approx(0.10)
    tol.observe(0.20, 0.60)  # +200%; window 3 drops the 25%: 10%, 5%, 200%
    assert tol.value == pytest.approx(0.10)
    tol.observe(0.0, 0.3)  # ignored
    assert len(tol.errors) == 3
    assert tol.margin == tol.value  # no cap
    with pytest.raises(ValueError, match="prior"):
        ModelTolerance(prior=-0.1)
    with pytest.raises(ValueError, match="cap"):
        ModelTolerance(prior=0.1, cap=-1.0)


def test_tie_margin_is_capped_at_the_band():
    # The trainer's tie band: the measured error, but never beyond the efficiency band
    # (15%): load noise of 40% must not make a 35% slower plan a "tie".
    tol = ModelTolerance(prior=0.15, cap=0.15)
    assert tol.margin == pytest.approx(0.15)
    tol.observe(0.20, 0.28)  # +40%
    assert tol.value == pytest.approx(0.40) and tol.margin == pytest.approx(0.15)
    tol.observe(0.20, 0.21)  # +5%
    tol.observe(0.20, 0.206)  # +3%
    assert tol.value == pytest.approx(0.05) and tol.margin == pytest.approx(0.05)
    with pytest.raises(ValueError, match="window"):
        ModelTolerance(prior=0.1, window=0)


def test_the_floor_is_the_lower_median_seconds_per_primitive_times_the_count():
    c = TransitionCalibration(window=3)
    assert c.floor_s(5) == 0.0  # nothing measured yet
    c.observe(0.05, 0.13, primitives=2)  # 0.065 s a primitive
    # one transition leaves the excess at its prior (0) but sets the floor
    assert c.excess_s == 0.0
    assert c.floor_s(5) == pytest.approx(5 * 0.065)
    assert c.floor_s(0) == 0.0
    c.observe(0.04, 0.58, primitives=5)  # 0.116 s a primitive
    assert c.floor_s(4) == pytest.approx(4 * 0.065)  # the lower median of two
    c.observe(0.1, 0.3, primitives=0)  # not counted per primitive
    assert len(c.per_primitive) == 2
    for _ in range(3):
        c.observe(0.01, 0.03, primitives=3)  # the window keeps the last 3
    assert c.floor_s(1) == pytest.approx(0.01)


def test_step_noise_is_the_robust_scatter_of_the_current_plans_residuals():
    n = StepNoise(window=6, min_steps=3)
    a, b = object(), object()
    n.observe(a, 1.0, 1.1)
    n.observe(a, 1.0, 1.3)
    assert n.noise_s(a) == 0.0 and not n.known(a)  # too few steps on the plan
    n.observe(b, 1.0, 9.0)  # another plan's steps do not count
    n.observe(a, 1.0, 1.2)
    n.observe(a, 1.0, 5.0)  # one slow step barely moves it (median absolute deviation)
    # residuals 0.1, 0.3, 0.2, 4.0: median 0.25, deviations 0.15 0.05 0.05 3.75
    assert n.noise_s(a) == pytest.approx(1.4826 * 0.1) and n.known(a) and not n.known(b)
    assert n.noise_s(b) == 0.0
    n.observe(a, 0.0, 1.0)  # ignored: no prediction
    assert len(n.obs) == 5
    with pytest.raises(ValueError, match="min_steps"):
        StepNoise(window=2, min_steps=3)
