import pytest

from nereus_rl.policy.controller import Controller, LevelSignal, SignalError


def test_seq_len_hysteresis_and_trigger():
    c = Controller(buckets=(512, 1024, 2048), hysteresis=0.1)
    assert c.update(0, seq_len=900) == [] and c.seq_len.bucket == 1024
    # Hovering just above 1024 stays inside the band: no trigger.
    assert c.update(1, seq_len=1100) == [] and c.update(2, seq_len=1000) == []
    (t,) = c.update(3, seq_len=1200)
    assert t.signal == "seq_len" and (t.old_level, t.new_level) == (1, 2)
    assert c.seq_len.bucket == 2048
    # Going down needs <= 1024 * 0.9.
    assert c.update(4, seq_len=1000) == []
    (t,) = c.update(5, seq_len=900)
    assert t.new_level == 1 and c.seq_len.bucket == 1024


def test_forecast_from_trend():
    s = LevelSignal("x", (1000.0,), hysteresis=0.1, window=5)
    for i in range(5):
        s.update(i, 800 + 10 * i)  # 800..840, +10/step
    f = s.forecast()
    assert f.slope_per_step == pytest.approx(10)
    assert f.threshold == pytest.approx(1100)
    assert f.steps == pytest.approx((1100 - 840) / 10)
    flat = LevelSignal("y", (10.0,), horizon=123)
    for i in range(4):
        flat.update(i, 5)
    assert flat.forecast().steps == 123


def test_devices_memory_efficiency():
    c = Controller()
    assert c.update(0, available_devices=range(8), in_use=range(8)) == []
    (t,) = c.update(1, available_devices=range(7), in_use=range(8))
    assert t.urgent and "lost 1 device" in t.reason
    (t,) = c.update(2, available_devices=range(8), in_use=range(7))
    assert not t.urgent and "gained" in t.reason
    assert c.forecast("devices").steps == pytest.approx(1.5)
    c.update(3, peak_memory_fraction=0.7)
    (t,) = c.update(4, peak_memory_fraction=1.05)
    assert t.urgent
    c.update(5, efficiency_ratio=1.0)
    (t,) = c.update(6, efficiency_ratio=1.4)
    assert t.signal == "efficiency"
    with pytest.raises(SignalError, match="unknown signal"):
        c.forecast("temperature")
    with pytest.raises(SignalError, match="increasing"):
        LevelSignal("z", (3, 2))
    with pytest.raises(SignalError, match=">= 0"):
        c.update(7, seq_len=-5)


def test_plan_change_restarts_the_memory_trend():
    # Memory rose under the old plan, a transition dropped it to 0.83, and under the new
    # plan it climbs 0.83 -> 0.94 towards the 0.95 edge: the forecast must come from
    # the new plan's values alone (a line through both plans' values says "much later").
    c = Controller(memory_edges=(0.5, 0.95), window=5)
    for step, v in enumerate([0.9, 0.93, 0.96, 1.12]):
        c.update(step, peak_memory_fraction=v)
    c.plan_changed()
    c.update(4, peak_memory_fraction=0.83)
    c.update(5, peak_memory_fraction=0.94)
    fc = c.forecast("memory")
    assert fc.steps <= 2.0, fc
    assert c.memory.level == 1  # levels are kept: only the trend restarts
    stale = Controller(memory_edges=(0.5, 0.95), window=5)
    for step, v in enumerate([0.9, 0.93, 0.96, 1.12, 0.83, 0.94]):
        stale.update(step, peak_memory_fraction=v)
    assert stale.forecast("memory").steps > fc.steps


def test_seq_len_forecast_lengths_from_its_own_trend():
    c = Controller(buckets=(8, 12, 16, 24, 32), hysteresis=0.0, window=5)
    with pytest.raises(SignalError, match="no value recorded"):
        c.seq_len.forecast_lengths(2)
    c.update(0, seq_len=10)
    assert c.seq_len.forecast_lengths(3) == (12, 12, 12)  # one value: flat
    c.update(1, seq_len=13)  # +3 per step: 16, 19, 22
    assert c.seq_len.project(2) == pytest.approx(19)
    assert c.seq_len.forecast_lengths(3) == (16, 24, 24)
    c.update(2, seq_len=9)  # falling trend: hold the last value's bucket
    c.update(3, seq_len=5)
    assert c.seq_len.forecast_lengths(2) == (8, 8)
    with pytest.raises(SignalError, match="horizon"):
        c.seq_len.forecast_lengths(-1)
    with pytest.raises(SignalError, match="steps_ahead"):
        c.seq_len.project(-1)


def test_over_capacity_is_urgent_even_without_a_level_change():
    # 0.98 is already the "high" level; climbing past 1.0 does not change the level,
    # but the plan no longer fits: that must still raise an urgent trigger, every step
    # it stays over (and also on the very first observation).
    c = Controller()
    (t,) = c.update(0, peak_memory_fraction=1.2)
    assert t.urgent and "no longer fits" in t.reason
    c = Controller()
    assert c.update(0, peak_memory_fraction=0.7) == []
    (t,) = c.update(1, peak_memory_fraction=0.98)
    assert not t.urgent
    (t,) = c.update(2, peak_memory_fraction=1.1)
    assert t.urgent and t.signal == "memory" and t.old_level == t.new_level
    (t,) = c.update(3, peak_memory_fraction=1.15)
    assert t.urgent
    assert c.update(4, peak_memory_fraction=0.97) == []


def test_first_boundary_seeds_the_running_steps_length():
    # The trainer's first boundary knows two lengths: the step that ran (6) and the next
    # one (10). Seeded, the first forecast has the trend +4/step: 14, 18, 22, 26, 30.
    c = Controller(buckets=(8, 12, 16, 24, 32, 48), hysteresis=0.0, window=5)
    (t,) = c.update(0, seq_len=10, current_seq_len=6)
    assert t.signal == "seq_len" and (t.old_level, t.new_level) == (0, 1)
    assert list(c.seq_len.history) == [(-1, 6.0), (0, 10.0)]
    assert c.seq_len.forecast_lengths(5) == (16, 24, 24, 32, 32)
    # Later boundaries do not seed again (the signal has its own history).
    c.update(1, seq_len=13, current_seq_len=10)
    assert list(c.seq_len.history) == [(-1, 6.0), (0, 10.0), (1, 13.0)]
    # Unseeded (as before), one value: flat.
    c = Controller(buckets=(8, 12, 16, 24, 32, 48), hysteresis=0.0, window=5)
    assert c.update(0, seq_len=10) == []
    assert c.seq_len.forecast_lengths(5) == (12,) * 5


def test_model_tolerance_is_the_efficiency_band():
    assert Controller().model_tolerance == pytest.approx(0.15)
    assert Controller(efficiency_edges=(0.9, 1.3)).model_tolerance == pytest.approx(0.3)
    assert Controller(efficiency_edges=(0.7, 1.1)).model_tolerance == pytest.approx(0.3)


def test_efficiency_level_follows_the_median_of_three_steps():
    # One step slowed by something else on shared cores moves no level; a model that
    # stays off moves it at the second slow step; a transition (plan_changed) starts
    # the median afresh, so the new plan's first ratios are not outvoted by the old's.
    c = Controller()
    for i, r in enumerate([1.0, 1.0, 1.0]):
        assert c.update(i, efficiency_ratio=r) == []
    assert c.update(3, efficiency_ratio=1.6) == []  # a spike: median 1.0
    assert c.update(4, efficiency_ratio=1.0) == []
    assert c.update(5, efficiency_ratio=1.0) == []
    assert c.update(6, efficiency_ratio=1.4) == []  # one slow step of the last three
    (t,) = c.update(7, efficiency_ratio=1.5)  # two of three: the median 1.4 is slow
    assert t.signal == "efficiency" and t.value == pytest.approx(1.4)
    assert "median of the last 3" in t.reason
    c.plan_changed()
    (t,) = c.update(8, efficiency_ratio=0.7)  # the new plan's first ratio alone
    assert t.new_level == 0 and t.value == pytest.approx(0.7)
    raw = Controller(efficiency_smooth=1)
    for i, r in enumerate([1.0, 1.0, 1.0]):
        raw.update(i, efficiency_ratio=r)
    (t,) = raw.update(3, efficiency_ratio=1.6)  # unsmoothed, the spike triggers
    assert t.value == pytest.approx(1.6) and "median" not in t.reason
    with pytest.raises(SignalError, match="smooth=0"):
        LevelSignal("z", (1, 2), smooth=0)
