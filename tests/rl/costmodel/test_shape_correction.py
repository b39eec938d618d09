"""ShapeCorrection: stage shapes priced at their measured ratio to the cost model."""

from __future__ import annotations

import math

import pytest

from nereus_rl.core.globalplan import GlobalPlan, StagePlan
from nereus_rl.core.spec import local_cpu_cluster, model_preset
from nereus_rl.core.workload import make_workload
from nereus_rl.costmodel.costmodel import CostModel
from nereus_rl.costmodel.shape_correction import ShapeCorrection, shape
from nereus_rl.costmodel.step_overhead import PricedModel, StepOverhead


def _plan(train_dp: int, ref_devs=(1,)) -> GlobalPlan:
    units = tuple((d,) for d in range(2, 2 + train_dp))
    return GlobalPlan(
        (
            StagePlan("rollout", "actor", False, 1, 1, 1, ((0,),)),
            StagePlan("reference", "reference", False, 1, 1, 1, (ref_devs,)),
            StagePlan("actor_train", "actor", True, train_dp, 1, 1, units),
        )
    )


@pytest.fixture
def cm_wl():
    cm = CostModel(local_cpu_cluster(4, 1.0))
    wl = make_workload(
        "grpo", actor=model_preset("tiny"), batch=4, prompt_len=8, response_len=8,
        group_size=2, micro_batch=2, dtype="fp32",
    )  # fmt: skip
    return cm, wl


def test_unmeasured_shapes_keep_the_models_price(cm_wl):
    cm, wl = cm_wl
    sc = ShapeCorrection()
    est = cm.step_latency(_plan(1), wl)
    assert sc.correct(cm, _plan(1), wl, est) == est
    assert sc.ratios(cm) == {}
    assert sc.record(cm) == {"shape_ratio": {}, "shape_regime_factor": 1.0}


def test_a_measured_shape_is_priced_at_its_median_ratio(cm_wl):
    cm, wl = cm_wl
    sc = ShapeCorrection(window=3)
    p1, p2 = _plan(1), _plan(2)
    raw = cm.step_latency(p1, wl)
    t = raw.stages["actor_train"].seconds
    for f in (0.25, 0.3, 5.0):  # the median ignores one outlier
        sc.observe(p1, wl, {"actor_train": t * f, "bogus": 1.0, "reference": -1.0})
    assert set(sc.ratios(cm)) == {shape(p1.stage("actor_train"))}
    assert math.isclose(sc.ratios(cm)[("actor_train", 1, 1, 1)], 0.3)
    got = sc.correct(cm, p1, wl, raw)
    # training is the last phase and runs alone on its devices: the total drops by 0.7 t
    assert math.isclose(got.phase_s[2], raw.phase_s[2] - 0.7 * t)
    assert math.isclose(got.total_s, raw.total_s - 0.7 * t)
    assert got.phase_s[:2] == raw.phase_s[:2]
    # the estimate's stage entry says the corrected price too, each class scaled alike
    st = got.stages["actor_train"]
    assert math.isclose(st.seconds, 0.3 * t)
    raw_parts = raw.stages["actor_train"].by_class
    assert all(math.isclose(v, 0.3 * raw_parts[c]) for c, v in st.by_class.items())
    assert got.stages["rollout"] == raw.stages["rollout"]
    # another shape of the same stage (dp 2) keeps the model's price
    raw2 = cm.step_latency(p2, wl)
    assert sc.correct(cm, p2, wl, raw2).total_s == raw2.total_s
    # the window keeps the last 3: two more small ratios move the median
    sc.observe(p1, wl, {"actor_train": t * 0.5})
    sc.observe(p1, wl, {"actor_train": t * 0.5})
    assert math.isclose(sc.ratios(cm)[("actor_train", 1, 1, 1)], 0.5)


def test_the_ratio_follows_the_model_as_it_refines(cm_wl):
    cm, wl = cm_wl
    sc = ShapeCorrection()
    p = _plan(1)
    t = cm.step_latency(p, wl).stages["actor_train"].seconds
    sc.observe(p, wl, {"actor_train": 0.5 * t})
    before = sc.ratios(cm)[("actor_train", 1, 1, 1)]
    cm.observe(p, wl, {"actor_train": 0.5 * t})  # the model moves towards the measurement
    after = sc.ratios(cm)[("actor_train", 1, 1, 1)]
    assert math.isclose(before, 0.5) and after > before
    with pytest.raises(ValueError, match="window"):
        ShapeCorrection(window=0)


def test_priced_model_adds_the_overhead_spread_to_the_corrected_price(cm_wl):
    cm, wl = cm_wl
    sc, ov = ShapeCorrection(), StepOverhead()
    p1, p2 = _plan(1), _plan(2)
    t = cm.step_latency(p1, wl).stages["actor_train"].seconds
    sc.observe(p1, wl, {"actor_train": 0.5 * t})
    ov.observe(p1, 0.1, 0.2)
    ov.observe(p2, 0.1, 0.3)  # 0.1 s per extra call
    pm = PricedModel(cm, ov, sc)
    corrected = pm.stage_price(p1, wl)
    assert math.isclose(corrected.total_s, cm.step_latency(p1, wl).total_s - 0.5 * t)
    assert math.isclose(pm.step_latency(p1, wl).total_s, corrected.total_s + ov.spread(p1))
    assert pm.peak_memory(p1, wl) == cm.peak_memory(p1, wl)


def test_probed_shapes_are_priced_under_the_running_plans_regime(cm_wl):
    # The probes measured dp 1 and dp 2 training at 1x and 1.2x the model; the run
    # measures dp 1 at 3x (load, an async rollout beside it). Without the regime
    # factor dp 2 kept its probe ratio (1.2x) beside dp 1's 3x and looked 2.5x cheaper;
    # anchored on the running plan, both are priced under the run's conditions and
    # keep the probes' relative price (dp 2 is 1.2x dp 1).
    cm, wl = cm_wl
    sc = ShapeCorrection()
    p1, p2 = _plan(1), _plan(2)
    t1 = cm.step_latency(p1, wl).stages["actor_train"].seconds
    t2 = cm.step_latency(p2, wl).stages["actor_train"].seconds
    sc.observe(p1, wl, {"actor_train": t1 * 1.0}, startup=True)
    sc.observe(p2, wl, {"actor_train": t2 * 1.2}, startup=True)
    for _ in range(3):
        sc.observe(p1, wl, {"actor_train": t1 * 3.0})
    assert math.isclose(sc.ratios(cm)[("actor_train", 2, 1, 1)], 1.2)  # not anchored yet
    assert math.isclose(sc.anchor(cm, p1, wl), 3.0)
    r = sc.ratios(cm)
    assert math.isclose(r[("actor_train", 1, 1, 1)], 3.0)
    assert math.isclose(r[("actor_train", 2, 1, 1)], 3.6)
    assert sc.record(cm)["shape_regime_factor"] == 3.0
    # a plan none of whose shapes was probed anchors at 1 (run ratios stand as measured)
    p3 = _plan(1, ref_devs=(0,))
    sc2 = ShapeCorrection()
    sc2.observe(p3, wl, {"actor_train": t1 * 3.0})
    assert sc2.anchor(cm, p3, wl) == 1.0
    assert math.isclose(sc2.ratios(cm)[("actor_train", 1, 1, 1)], 3.0)


def test_an_unmeasured_shape_is_priced_at_the_factor_once_some_shape_is_measured(cm_wl):
    cm, wl = cm_wl
    sc = ShapeCorrection()
    sc.unmeasured_factor = 1.15
    p1, p2 = _plan(1), _plan(2)
    raw2 = cm.step_latency(p2, wl)
    # nothing measured: every shape alike, the model's prices stand
    assert sc.correct(cm, p2, wl, raw2) == raw2
    t = cm.step_latency(p1, wl).stages["actor_train"].seconds
    sc.observe(p1, wl, {"actor_train": t, "rollout": 2.0, "reference": 1.0})
    got = sc.correct(cm, p2, wl, raw2)
    # p2's dp 2 training was never measured: 1.15x the model; its rollout and reference
    # shapes were (p1 has the same), at their measured ratios
    assert math.isclose(
        got.stages["actor_train"].seconds, 1.15 * raw2.stages["actor_train"].seconds
    )
    measured = sc.ratios(cm)
    r = measured[shape(p2.stage("rollout"))]
    assert math.isclose(got.stages["rollout"].seconds, r * raw2.stages["rollout"].seconds)
    # the measured plan's own training is at its ratio (1.0), not the factor
    assert math.isclose(
        sc.correct(cm, p1, wl, cm.step_latency(p1, wl)).stages["actor_train"].seconds, t
    )
