"""StepOverhead: the measured unpriced rest of a step, per worker call."""

from __future__ import annotations

import math

import pytest

from nereus_rl.core.globalplan import GlobalPlan, StagePlan
from nereus_rl.costmodel.step_overhead import StepOverhead, worker_calls


def _plan(ref_dp: int) -> GlobalPlan:
    return GlobalPlan(
        (
            StagePlan("rollout", "actor", False, 1, 1, 1, ((0,),)),
            StagePlan("reference", "reference", False, ref_dp, 1, 1,
                      tuple((d,) for d in range(1, 1 + ref_dp))),
            StagePlan("actor_train", "actor", True, 1, 1, 2, ((0, 3),)),
        )
    )  # fmt: skip


def test_worker_calls_counts_each_stage_worker():
    assert worker_calls(_plan(1)) == 4 and worker_calls(_plan(2)) == 5


def test_fit_separates_plans_by_calls_and_starts_at_zero():
    ov = StepOverhead()
    assert ov.coef == (0.0, 0.0) and ov.spread(_plan(2)) == 0.0
    for _ in range(3):
        ov.observe(_plan(1), 0.10, 0.10 + 0.01 + 0.02 * 4)
        ov.observe(_plan(2), 0.10, 0.10 + 0.01 + 0.02 * 5)
    a, b = ov.coef
    assert math.isclose(a, 0.01, abs_tol=1e-9) and math.isclose(b, 0.02)
    assert math.isclose(ov.spread(_plan(2)) - ov.spread(_plan(1)), 0.02)
    assert math.isclose(ov.predict(_plan(1)), 0.09)


def test_one_call_count_or_negative_slope_gives_no_spread():
    ov = StepOverhead()
    ov.observe(_plan(1), 0.1, 0.3)
    ov.observe(_plan(1), 0.1, 0.1)
    assert ov.coef == (pytest.approx(0.1), 0.0)
    ov.observe(_plan(2), 0.1, 0.1)  # more calls, smaller residual
    assert ov.coef[1] == 0.0
    ov.observe(_plan(2), -1.0, 0.1)  # ignored
    assert len(ov.obs) == 3


def test_window_must_hold_a_line():
    with pytest.raises(ValueError, match="window"):
        StepOverhead(window=1)


def test_priced_model_adds_the_spread_only_to_the_total():
    from nereus_rl.costmodel.step_overhead import PricedModel
    from nereus_rl.trainer.trainer import TrainConfig, Trainer

    tr = Trainer(TrainConfig(algo="remax", devices=4, steps=2, calibration_probes=0))
    try:
        ad = tr.adapter
        wl = ad.workload(8)
        ov = StepOverhead()
        ov.observe(_plan(1), 0.1, 0.2)
        ov.observe(_plan(2), 0.1, 0.3)
        pm = PricedModel(ad.cm, ov)
        raw, priced = ad.cm.step_latency(_plan(2), wl), pm.step_latency(_plan(2), wl)
        assert math.isclose(priced.total_s - raw.total_s, 0.1 * 5)
        assert priced.phase_s == raw.phase_s
        assert pm.peak_memory(_plan(2), wl) == ad.cm.peak_memory(_plan(2), wl)
    finally:
        tr.driver.shutdown()


def test_priced_model_memo_follows_the_model_the_fit_and_the_shapes():
    # The memo (one boundary's decisions price the same pairs again) must never serve an
    # estimate made before the model, the overhead fit or the shape ratios changed.
    from nereus_rl.costmodel.shape_correction import ShapeCorrection
    from nereus_rl.costmodel.step_overhead import PricedModel
    from nereus_rl.trainer.trainer import TrainConfig, Trainer

    tr = Trainer(TrainConfig(algo="remax", devices=4, steps=2, calibration_probes=0))
    try:
        ad = tr.adapter
        wl, p = ad.workload(8), _plan(2)
        ov, shapes = StepOverhead(), ShapeCorrection()
        pm = PricedModel(ad.cm, ov, shapes)
        first = pm.step_latency(p, wl)
        assert pm.step_latency(p, wl) is first  # the memo
        ad.cm.observe(p, wl, {"actor_train": 3 * first.stages["actor_train"].seconds})
        after_model = pm.step_latency(p, wl)
        assert after_model.total_s != first.total_s
        assert after_model == PricedModel(ad.cm, ov, shapes).step_latency(p, wl)
        ov.observe(_plan(1), 0.1, 0.2)
        ov.observe(_plan(2), 0.1, 0.3)
        after_fit = pm.step_latency(p, wl)
        assert math.isclose(after_fit.total_s - after_model.total_s, 0.1 * 5)
        shapes.observe(p, wl, {"reference": 5 * after_fit.stages["reference"].seconds})
        after_shapes = pm.step_latency(p, wl)
        assert after_shapes.stages["reference"].seconds > after_fit.stages["reference"].seconds
        # the per-class shares are the stage's seconds split, scaled with a measured shape
        ref = after_shapes.stages["reference"]
        assert math.isclose(sum(ref.by_class.values()), ref.seconds, rel_tol=1e-9)
    finally:
        tr.driver.shutdown()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_step_total_is_the_estimates_total_bit_for_bit_and_follows_its_memo(mode):
    # Ranking and the lookahead read step_total, which builds no estimate: it must be
    # the very float step_latency's total is, with measured shapes (and an unmeasured
    # shape's factor) and the overhead fit, and forget what a change made stale.
    from nereus_rl.costmodel.shape_correction import ShapeCorrection
    from nereus_rl.costmodel.step_overhead import PricedModel
    from nereus_rl.trainer.trainer import TrainConfig, Trainer

    tr = Trainer(TrainConfig(algo="remax", mode=mode, devices=4, steps=2, calibration_probes=0))
    try:
        ad = tr.adapter
        wl, p = ad.workload(8), _plan(2)
        ov, shapes = StepOverhead(), ShapeCorrection()
        pm = PricedModel(ad.cm, ov, shapes)
        plans = [*[q for _, q in ad.ranked_plans(8)][:8], p]

        def fresh(q):  # each figure from an empty memo
            return PricedModel(ad.cm, ov, shapes).step_latency(q, wl).total_s

        for q in plans:
            assert ad.cm.step_total(q, wl) == ad.cm.step_latency(q, wl).total_s
            assert pm.step_total(q, wl) == fresh(q)
        first = pm.step_total(p, wl)
        ad.cm.observe(p, wl, {"actor_train": 0.5})
        ov.observe(_plan(1), 0.1, 0.2)
        ov.observe(_plan(2), 0.1, 0.3)
        shapes.observe(p, wl, {"reference": 0.25})
        shapes.unmeasured_factor = 1.3
        assert pm.step_total(p, wl) != first
        for q in plans:
            assert pm.step_total(q, wl) == fresh(q)
    finally:
        tr.driver.shutdown()


def _rollout_own_and_shared():
    """ReMax plans on one device per stage: the rollout on a device of its own (``own``)
    or sharing it with the reference (``shared``); a GPU cost model; the workload."""
    from nereus_rl.core.spec import cluster_preset
    from nereus_rl.core.workload import make_workload
    from nereus_rl.costmodel.costmodel import CostModel

    def sp(stage, model, trains, d):
        return StagePlan(stage, model, trains, 1, 1, 1, ((d,),))

    own = GlobalPlan((sp("rollout", "actor", False, 0), sp("reference", "reference", False, 1),
                      sp("actor_train", "actor", True, 2)))  # fmt: skip
    shared = GlobalPlan((sp("rollout", "actor", False, 0), sp("reference", "reference", False, 0),
                         sp("actor_train", "actor", True, 1)))  # fmt: skip

    def wl(ahead: bool):
        return make_workload("remax", actor="tiny", batch=4, prompt_len=8, response_len=64,
                             rollout_ahead=ahead)  # fmt: skip

    return own, shared, CostModel(cluster_preset("h200x32")), wl


def test_an_async_step_holds_the_whole_rest_on_its_chain_where_the_rollout_may_hide_it():
    # Both plans make 3 worker calls, so the fit's spread (b) is 0 and only its common
    # part a is left: a synchronous price ignores it (common to every plan), an async
    # one hides it behind a rollout on a device of its own and pays it where the chain
    # of stages runs after the rollout (reference on the rollout's device).
    from nereus_rl.costmodel.overlap import rollout_slack
    from nereus_rl.costmodel.step_overhead import PricedModel

    own, shared, cm, wl = _rollout_own_and_shared()

    est = cm.step_latency(own, wl(True))
    slack = rollout_slack(own, wl(True), {k: v.seconds for k, v in est.stages.items()},
                          est.sync_s, cm.cluster)  # fmt: skip
    assert slack > 0  # the tiny model's rollout outlasts its chain
    ov = StepOverhead()
    a = slack / 2  # hidden on ``own``
    ov.observe(own, 1.0, 1.0 + a)
    ov.observe(shared, 1.0, 1.0 + a)
    assert ov.coef == pytest.approx((a, 0.0))
    pm = PricedModel(cm, ov)
    assert pm.chain_rest(own, wl(False)) is None
    for p in (own, shared):  # synchronous: no spread, a is common
        assert pm.step_total(p, wl(False)) == cm.step_total(p, wl(False))
    assert pm.step_total(own, wl(True)) == pytest.approx(cm.step_total(own, wl(True)))
    assert pm.step_total(shared, wl(True)) == pytest.approx(cm.step_total(shared, wl(True)) + a)
    for p in (own, shared):  # the estimate's total and the total alone agree
        assert pm.step_total(p, wl(True)) == PricedModel(cm, ov).step_latency(p, wl(True)).total_s
        # the efficiency signal's whole step: a included (sync: beside; async: on the chain)
        assert pm.step_whole(p, wl(False)) == pytest.approx(cm.step_total(p, wl(False)) + a)
        assert pm.step_whole(p, wl(True)) == pm.step_total(p, wl(True))


def test_a_step_whose_rollout_outlasts_its_chain_does_not_feed_the_rest():
    from nereus_rl.trainer.adapt.adapter import rest_observable

    own, shared, cm, wl = _rollout_own_and_shared()
    for ahead, p, seen in [(True, own, False), (True, shared, True), (False, own, True)]:
        w = wl(ahead)
        assert rest_observable(p, w, cm.step_latency(p, w), cm.cluster) is seen
