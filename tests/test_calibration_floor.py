"""TransitionCalibration.floor_s: a move priced at no less than this job's measured
seconds per primitive."""

import pytest

from nereus_rl.calibration import TransitionCalibration


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
