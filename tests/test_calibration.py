"""Worked examples of what the adaptation loop learns about its own predictions."""

import pytest

from nereus_rl.calibration import ModelTolerance, TransitionCalibration


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
