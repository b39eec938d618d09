"""Worked examples of the payback rule."""

import pytest

from nereus_rl.core.globalplan import GlobalPlan, StagePlan
from nereus_rl.core.spec import cluster_preset
from nereus_rl.core.workload import make_workload
from nereus_rl.costmodel.costmodel import CostModel
from nereus_rl.planner.planner import plan
from nereus_rl.policy.admission import Admission, AdmissionError
from nereus_rl.policy.controller import Forecast


def _sp(stage, model, trains, dp, tp, pp, start=0):
    n = tp * pp
    units = tuple(tuple(range(start + u * n, start + (u + 1) * n)) for u in range(dp))
    return StagePlan(stage, model, trains, dp, tp, pp, units)


@pytest.fixture
def setup():
    c = cluster_preset("h200x16")
    cm = CostModel(c)
    w = make_workload("grpo", batch=128, group_size=4, response_len=2048)
    slow = GlobalPlan(tuple(_sp(s.stage, s.model, s.trains, 1, 8, 1) for s in w.planned_stages))
    best = plan(w, c, cm).plan
    return cm, w, slow, best


def test_opportunistic_worked_example(setup):
    cm, w, slow, best = setup
    adm = Admission(cm)
    t_slow = cm.step_latency(slow, w).total_s
    t_best = cm.step_latency(best, w).total_s
    saving = t_slow - t_best
    assert saving > 0
    cost = 10 * saving  # repaid after exactly 10 steps
    d = adm.decide(slow, best, w, forecast_steps=9, transition_cost=cost, trigger="seq_len")
    assert not d.taken and d.path == "opportunistic" and "<" in d.reason
    assert d.payback_steps == pytest.approx(10)
    d = adm.decide(
        slow,
        best,
        w,
        forecast_steps=Forecast("seq_len", 10, 0.0, None),
        transition_cost=lambda cur, cand: cost,
    )
    assert d.taken and d.saving_per_step_s == pytest.approx(saving)
    d = adm.decide(best, slow, w, forecast_steps=1e6, transition_cost=0.0)
    assert not d.taken and "not faster" in d.reason
    assert len(adm.history) == 3


def test_urgent_ignores_payback(setup):
    cm, w, slow, best = setup
    adm = Admission(cm)
    lost = set(range(16)) - {0}  # device 0 died; the slow plan uses it
    cand = plan(w, cm.cluster, cm, devices=lost).plan
    d = adm.decide(slow, cand, w, forecast_steps=0, transition_cost=1e9, available_devices=lost)
    assert d.taken and d.path == "urgent" and "unavailable devices [0]" in d.reason
    # Memory: the same plan under a much longer response no longer fits.
    long = w.with_response_len(16384)
    assert cm.memory_violations(best, long)
    cand = plan(long, cm.cluster, cm).plan
    d = adm.decide(best, cand, long, forecast_steps=0, transition_cost=1e9)
    assert d.taken and d.path == "urgent" and "over memory" in d.reason
    # An infeasible candidate is never taken, even urgently.
    d = adm.decide(best, best, long, forecast_steps=5, transition_cost=0.0)
    assert not d.taken and "candidate cannot run" in d.reason


def test_bad_input(setup):
    cm, w, slow, best = setup
    with pytest.raises(AdmissionError, match="transition cost"):
        Admission(cm).decide(slow, best, w, forecast_steps=3, transition_cost=-1)
    with pytest.raises(AdmissionError, match="forecast_steps"):
        Admission(cm).decide(slow, best, w, forecast_steps=-3, transition_cost=1)


def test_candidate_that_goes_over_soon_is_priced_with_the_forced_move(setup):
    cm, w, slow, best = setup
    adm = Admission(cm)
    saving = cm.step_latency(slow, w).total_s - cm.step_latency(best, w).total_s
    cost = 10 * saving
    # Over a flat 200-step forecast the move repays itself (200 x saving >= 10 x saving).
    d = adm.decide(slow, best, w, forecast_steps=200, transition_cost=cost)
    assert d.taken and d.over_in_steps is None and d.forced_move_s == 0.0
    # The length forecast puts the candidate over memory 3 steps after the move (the
    # current plan holds): savings count for 3 steps, and the forced move's cost is
    # added: 3 x saving < 10 x saving + 5 x saving.
    d = adm.decide(slow, best, w, forecast_steps=200, transition_cost=cost,
                   candidate_over_in=3, current_over_in=None, forced_move_s=5 * saving)  # fmt: skip
    assert not d.taken and d.forecast_steps == 3 and d.over_in_steps == 3
    assert d.transition_cost_s == pytest.approx(15 * saving)
    assert "over memory 3 step(s) after the move" in d.reason
    # The current plan goes over sooner (2 steps): the candidate forces nothing extra.
    d = adm.decide(slow, best, w, forecast_steps=200, transition_cost=cost,
                   candidate_over_in=3, current_over_in=2, forced_move_s=5 * saving)  # fmt: skip
    assert d.taken and d.forecast_steps == 200 and d.transition_cost_s == pytest.approx(cost)
    # 20 steps of saving repay 10 + 5: taken, the reason says what was included.
    d = adm.decide(slow, best, w, forecast_steps=200, transition_cost=cost,
                   candidate_over_in=20, forced_move_s=5 * saving)  # fmt: skip
    assert d.taken and d.forecast_steps == 20 and "included" in d.reason


def test_bad_horizon_input(setup):
    cm, w, slow, best = setup
    adm = Admission(cm)
    for kw, msg in (
        ({"forced_move_s": -1.0}, "forced_move_s"),
        ({"candidate_over_in": -1}, "candidate_over_in"),
        ({"current_over_in": -2}, "current_over_in"),
    ):
        with pytest.raises(AdmissionError, match=msg):
            adm.decide(slow, best, w, forecast_steps=1, transition_cost=0.0, **kw)
    assert adm.history == []  # nothing recorded for bad input


def test_a_saving_within_the_step_noise_is_declined(setup):
    cm, w, slow, best = setup
    adm = Admission(cm)
    saving = cm.step_latency(slow, w).total_s - cm.step_latency(best, w).total_s
    assert saving > 0
    kw = dict(forecast_steps=100, transition_cost=0.0)
    # a free move over 100 steps: taken on payback alone, and with noise below the saving
    assert adm.decide(slow, best, w, **kw).taken
    assert adm.decide(slow, best, w, noise_s=0.9 * saving, **kw).taken
    d = adm.decide(slow, best, w, noise_s=saving, **kw)
    assert not d.taken and d.path == "opportunistic" and "noise" in d.reason, d
    # the urgent path ignores it (the current plan cannot run: devices gone)
    d = adm.decide(slow, best, w, noise_s=1e9, available_devices=[], **kw)
    assert d.path == "urgent" and "cannot run" in d.reason
    # noise not measured yet (a fresh plan): no opportunistic move, the urgent path as ever
    d = adm.decide(slow, best, w, noise_s=None, **kw)
    assert not d.taken and d.path == "opportunistic" and "not measured yet" in d.reason, d
    d = adm.decide(slow, best, w, noise_s=None, available_devices=[], **kw)
    assert d.path == "urgent" and "cannot run" in d.reason
    with pytest.raises(AdmissionError, match="noise_s"):
        adm.decide(slow, best, w, noise_s=-1.0, **kw)
