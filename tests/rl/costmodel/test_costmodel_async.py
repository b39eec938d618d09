"""The asynchronous step's price: the next step's rollout beside this step's work."""

import dataclasses

import pytest

from nereus_rl.core.globalplan import GlobalPlan, StagePlan
from nereus_rl.core.spec import cluster_preset, local_cpu_cluster
from nereus_rl.core.workload import make_workload
from nereus_rl.costmodel.costmodel import CostModel, compose_step
from nereus_rl.costmodel.overlap import overlapped_step, own_seconds, rollout_slack

GPU = cluster_preset("h200x32")
CPU2 = local_cpu_cluster(4, workers_per_core=2.0)  # 4 workers on 2 cores
assert CPU2.cores == 2


def _sp(stage, model, trains, *devs):
    return StagePlan(stage, model, trains, len(devs), 1, 1, tuple((d,) for d in devs))


def _plan(rollout, reference, train) -> GlobalPlan:
    return GlobalPlan((
        _sp("rollout", "actor", False, *rollout),
        _sp("reference", "reference", False, *reference),
        _sp("actor_train", "actor", True, *train),
    ))  # fmt: skip


def _wl(algo="grpo", ahead=True):
    return make_workload(
        algo, actor="tiny", batch=4, group_size=4 if algo == "grpo" else 1, prompt_len=8,
        response_len=16, rollout_ahead=ahead,
    )  # fmt: skip


def _step(plan, secs, cluster):
    return overlapped_step(plan, _wl(), secs, SYNC, cluster, with_stretch=True)


SECS = {"rollout": 1.0 + 0.1, "reference": 0.3, "actor_train": 0.5}  # sync 0.1 in rollout
SYNC = 0.1


def test_disjoint_devices_hide_the_inference_and_training_behind_the_rollout():
    total, stretch = _step(_plan([0], [1], [2]), SECS, GPU)
    assert total == pytest.approx(max(1.0, 0.3 + 0.5) + SYNC)
    assert stretch == pytest.approx({"rollout": 1.0, "reference": 1.0, "actor_train": 1.0})
    # the training outlasts the rollout: it sets the step
    long = {**SECS, "actor_train": 1.2}
    assert overlapped_step(_plan([0], [1], [2]), _wl(), long, SYNC, GPU)[0] == pytest.approx(
        0.3 + 1.2 + SYNC
    )


def test_a_stage_on_the_rollouts_devices_waits_for_it():
    # the reference shares device 0 with the rollout: nothing overlaps
    total, _ = overlapped_step(_plan([0], [0], [1]), _wl(), SECS, SYNC, GPU)
    assert total == pytest.approx(1.0 + 0.3 + 0.5 + SYNC)
    # only the training shares it: the reference runs beside the rollout, the training
    # after both
    total, _ = overlapped_step(_plan([0], [1], [0]), _wl(), SECS, SYNC, GPU)
    assert total == pytest.approx(1.0 + 0.5 + SYNC)
    # a stage over two devices, one of them the rollout's, waits too
    total, _ = overlapped_step(_plan([0], [1, 0], [2]), _wl(), SECS, SYNC, GPU)
    assert total == pytest.approx(1.0 + 0.3 + 0.5 + SYNC)


def test_training_waits_for_every_inference_stage():
    # PPO: the critic inference (device 3) is long; the training (device 2) waits for it
    plan = GlobalPlan((
        _sp("rollout", "actor", False, 0),
        _sp("reference", "reference", False, 1),
        _sp("critic_inference", "critic", False, 3),
        _sp("actor_train", "actor", True, 2),
        _sp("critic_train", "critic", True, 1),
    ))  # fmt: skip
    secs = {**SECS, "critic_inference": 0.9, "critic_train": 0.2}
    total, _ = overlapped_step(plan, _wl("ppo"), secs, SYNC, GPU)
    assert total == pytest.approx(0.9 + 0.5 + SYNC)


def test_local_cpu_workers_share_the_cores_while_stages_run_at_once():
    # two 1-worker stages on 2 cores: each has a core, as alone
    total, stretch = _step(_plan([0], [1], [1]), SECS, CPU2)
    assert total == pytest.approx(max(1.0, 0.3 + 0.5) + SYNC)
    assert stretch == pytest.approx({"rollout": 1.0, "reference": 1.0, "actor_train": 1.0})
    # rollout (1 worker) beside a 2-worker training: 3 workers on 2 cores, each at 2/3
    # of a core while both run. Training alone: 0.5 s; beside the rollout it does 2/3 of
    # that per second: it ends at 0.75 s, then the rollout runs alone for its rest.
    secs = {"rollout": 1.0 + SYNC, "reference": 0.0, "actor_train": 0.5}
    total, stretch = _step(_plan([0], [1], [2, 3]), secs, CPU2)
    rollout_left = 1.0 - 0.75 * 2 / 3
    assert total == pytest.approx(0.75 + rollout_left + SYNC)
    assert stretch["actor_train"] == pytest.approx(1.5)
    assert stretch["rollout"] == pytest.approx((0.75 + rollout_left) / 1.0)
    # the same on GPUs: no sharing
    assert overlapped_step(_plan([0], [1], [2, 3]), _wl(), secs, SYNC, GPU)[0] == pytest.approx(
        1.0 + SYNC
    )


def test_own_seconds_undoes_the_stretch():
    plan, wl = _plan([0], [1], [2, 3]), _wl()
    cm = CostModel(CPU2)
    est = cm.step_latency(plan, wl)
    secs = {n: e.seconds for n, e in est.stages.items()}
    _, stretch = overlapped_step(plan, wl, secs, est.sync_s, CPU2, with_stretch=True)
    assert max(stretch.values()) > 1.0  # the check below must be able to fail
    gen = secs["rollout"] - est.sync_s
    measured = {
        "rollout": gen * stretch["rollout"] + est.sync_s,
        "reference": secs["reference"] * stretch["reference"],
        "actor_train": secs["actor_train"] * stretch["actor_train"],
    }
    assert own_seconds(plan, wl, measured, est, CPU2) == pytest.approx(secs)


def test_the_cost_model_prices_the_overlap_only_when_the_rollout_runs_ahead():
    cm = CostModel(CPU2)
    wl_async, wl_sync = _wl(ahead=True), _wl(ahead=False)
    assert wl_async != wl_sync and hash(wl_async) != hash(wl_sync)
    assert dataclasses.replace(wl_async, rollout_ahead=False) == wl_sync
    disjoint, colocated = _plan([0], [1], [2, 3]), _plan([0, 1], [0, 1], [2, 3])
    a, s = cm.step_latency(disjoint, wl_async), cm.step_latency(disjoint, wl_sync)
    assert a.phase_s == s.phase_s and s.total_s == pytest.approx(sum(s.phase_s))
    assert a.total_s < 0.95 * s.total_s  # the rollout hides the rest
    # every stage waits for a rollout on its devices, or for the reference that does
    a, s = cm.step_latency(colocated, wl_async), cm.step_latency(colocated, wl_sync)
    assert a.total_s == pytest.approx(s.total_s)
    # compose_step is what both the model and the shape correction use
    secs = {n: e.seconds for n, e in s.stages.items()}
    assert compose_step(colocated, wl_sync, secs, s.sync_s, CPU2)[0] == pytest.approx(s.total_s)


def test_the_shape_corrected_price_composes_the_overlap_once_and_the_same():
    from nereus_rl.costmodel.shape_correction import ShapeCorrection

    cm = CostModel(CPU2)
    plan = _plan([0], [1], [2, 3])
    sc = ShapeCorrection()
    for wl in (_wl(ahead=True), _wl(ahead=False)):
        est = cm.step_latency(plan, wl)
        secs = {n: e.seconds for n, e in est.stages.items()}
        sc.observe(plan, wl, {"rollout": 1.5 * secs["rollout"], "actor_train": secs["actor_train"]})
        got, ref = sc.price(cm, plan, wl), sc.correct(cm, plan, wl, est)
        assert got.total_s != est.total_s  # the ratio moved it
        assert got.total_s == pytest.approx(ref.total_s) and got.phase_s == ref.phase_s


def test_the_drivers_rest_is_hidden_behind_a_rollout_of_its_own_not_behind_a_shared_one():
    # rollout 1.0 alone on device 0; the chain (reference 0.3, training 0.5) ends at 0.8:
    # up to 0.2 s of the driver's rest hides behind the rollout, the rest of it shows
    own = _plan([0], [1], [2])
    assert rollout_slack(own, _wl(), SECS, SYNC, GPU) == pytest.approx(0.2)
    for rest, step in [(0.0, 1.0), (0.15, 1.0), (0.5, 1.3)]:
        total, _ = overlapped_step(own, _wl(), SECS, SYNC, GPU, rest_s=rest)
        assert total == pytest.approx(step + SYNC)
    # the reference on the rollout's device: the chain runs after the rollout, so the
    # whole rest is on the step (the model that added the rest beside the overlap
    # priced both plans alike)
    shared = _plan([0], [0], [1])
    assert rollout_slack(shared, _wl(), SECS, SYNC, GPU) == pytest.approx(-0.8)
    total, _ = overlapped_step(shared, _wl(), SECS, SYNC, GPU, rest_s=0.15)
    assert total == pytest.approx(1.0 + 0.3 + 0.5 + 0.15 + SYNC)
    # no rest: the very floats of the step without one
    for plan in (own, shared):
        assert (
            overlapped_step(plan, _wl(), SECS, SYNC, CPU2, rest_s=0.0)[0]
            == overlapped_step(plan, _wl(), SECS, SYNC, CPU2)[0]
        )
