"""Worked examples of what the adaptation loop learns about its own predictions."""

import pytest

from nereus_rl.calibration import ModelTolerance, TransitionCalibration


def test_transition_calibration_is_the_recent_median_ratio():
    cal = TransitionCalibration(window=3)
    assert cal.scale == 1.0  # no transition yet: the model's own prices
    cal.observe(0.05, 0.10)
    assert cal.scale == pytest.approx(2.0)
    cal.observe(0.05, 0.50)  # a slow outlier (a layout's first communicators)
    assert cal.scale == pytest.approx(6.0)  # median of 2 and 10
    cal.observe(0.10, 0.30)
    assert cal.scale == pytest.approx(3.0)  # median of 2, 10, 3
    cal.observe(0.02, 0.04)  # window 3: the first ratio (2) drops out -> 10, 3, 2
    cal.observe(0.02, 0.06)  # -> 3, 2, 3
    assert cal.ratios == pytest.approx([3.0, 2.0, 3.0]) and cal.scale == pytest.approx(3.0)
    cal.observe(0.0, 1.0)  # unpriced or unmeasured: ignored
    cal.observe(0.1, -1.0)
    assert len(cal.ratios) == 3
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
    with pytest.raises(ValueError, match="prior"):
        ModelTolerance(prior=-0.1)
    with pytest.raises(ValueError, match="window"):
        ModelTolerance(prior=0.1, window=0)
