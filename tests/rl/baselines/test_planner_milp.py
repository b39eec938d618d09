import pytest

from nereus_rl.baselines.planner_milp import solve_cpsat, solve_scip
from nereus_rl.core.spec import cluster_preset
from nereus_rl.core.workload import make_workload
from nereus_rl.costmodel.costmodel import CostModel
from nereus_rl.planner.planner import plan


def test_scip_and_cpsat_agree_with_planner():
    c = cluster_preset("h200x16")
    cm = CostModel(c)
    w = make_workload("grpo", batch=128, group_size=4, response_len=2048)
    res = plan(w, c, cm)
    scip = solve_scip(w, c, cm, time_limit_s=60)
    sat = solve_cpsat(w, c, cm, time_limit_s=60)
    assert scip.proven and sat.proven, (scip, sat)
    assert scip.objective_s == pytest.approx(res.latency_s, rel=1e-6)
    # CP-SAT works in integer microseconds; its plan's exact latency is within rounding.
    assert sat.objective_s == pytest.approx(res.latency_s, abs=1e-5 * len(w.planned_stages))
    assert not cm.memory_violations(scip.plan, w)


def test_time_limit_reports_unproven():
    c = cluster_preset("h200x64")
    cm = CostModel(c)
    w = make_workload("ppo", reward="llama-3.1-8b", batch=256)
    r = solve_scip(w, c, cm, time_limit_s=0.01)
    assert not r.proven and r.status != "optimal"
