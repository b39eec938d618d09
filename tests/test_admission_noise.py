"""Admission declines a saving inside the measured step noise; StepNoise measures it."""

import pytest

from nereus_rl.admission import Admission, AdmissionError
from nereus_rl.calibration import StepNoise
from nereus_rl.costmodel import CostModel
from nereus_rl.globalplan import GlobalPlan, StagePlan
from nereus_rl.planner import plan
from nereus_rl.spec import cluster_preset
from nereus_rl.workload import make_workload


def _sp(stage, model, trains, dp, tp, pp):
    n = tp * pp
    units = tuple(tuple(range(u * n, (u + 1) * n)) for u in range(dp))
    return StagePlan(stage, model, trains, dp, tp, pp, units)


@pytest.fixture
def setup():
    c = cluster_preset("h200x16")
    cm = CostModel(c)
    w = make_workload("grpo", batch=128, group_size=4, response_len=2048)
    slow = GlobalPlan(tuple(_sp(s.stage, s.model, s.trains, 1, 8, 1) for s in w.planned_stages))
    return cm, w, slow, plan(w, c, cm).plan


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
    with pytest.raises(AdmissionError, match="noise_s"):
        adm.decide(slow, best, w, noise_s=-1.0, **kw)


def test_step_noise_is_the_robust_scatter_of_the_current_plans_residuals():
    n = StepNoise(window=6, min_steps=3)
    a, b = object(), object()
    n.observe(a, 1.0, 1.1)
    n.observe(a, 1.0, 1.3)
    assert n.noise_s(a) == 0.0  # too few steps on the plan
    n.observe(b, 1.0, 9.0)  # another plan's steps do not count
    n.observe(a, 1.0, 1.2)
    n.observe(a, 1.0, 5.0)  # one slow step barely moves it (median absolute deviation)
    # residuals 0.1, 0.3, 0.2, 4.0: median 0.25, deviations 0.15 0.05 0.05 3.75
    assert n.noise_s(a) == pytest.approx(1.4826 * 0.1)
    assert n.noise_s(b) == 0.0
    n.observe(a, 0.0, 1.0)  # ignored: no prediction
    assert len(n.obs) == 5
    with pytest.raises(ValueError, match="min_steps"):
        StepNoise(window=2, min_steps=3)
