"""The trainer's startup calibration: which probes it runs, what it feeds the cost model,
and that the run it precedes is the run without it."""

from __future__ import annotations

import pytest
import torch

from nereus_rl.core.globalplan import GlobalPlan, StagePlan
from nereus_rl.runtime import Driver
from nereus_rl.trainer.calibrate import (
    REPEATS,
    layouts,
    next_probe,
    probe_lengths,
    run_probe,
    stage_seconds,
)
from nereus_rl.trainer.trainer import TrainConfig, TrainConfigError, Trainer, train

# Multi-process: out of the fast lane (-m "not slow").
pytestmark = pytest.mark.slow

FAST = {"warm_steps": 30, "batch": 4, "group_size": 2}


def _plan(rollout, reference, actor) -> GlobalPlan:
    def sp(name, model, trains, dp, devs):
        units = tuple(tuple(devs[i::dp]) for i in range(dp))
        return StagePlan(name, model, trains, dp, 1, 1, units)

    return GlobalPlan(
        (
            sp("rollout", "actor", False, *rollout),
            sp("reference", "reference", False, *reference),
            sp("actor_train", "actor", True, *actor),
        )
    )


def test_next_probe_is_the_best_ranked_with_an_unmeasured_layout():
    a = _plan((1, (0,)), (2, (0, 1)), (2, (0, 1)))
    b = _plan((1, (1,)), (2, (0, 1)), (2, (0, 1)))  # the same layouts as a
    c = _plan((1, (0,)), (1, (3,)), (2, (0, 1)))  # a's, but the reference alone on 3
    d = _plan((2, (0, 1)), (1, (2,)), (1, (2,)))
    assert layouts(a) == {
        ("rollout", 1, 1, 1, True), ("reference", 2, 1, 1, True), ("actor_train", 2, 1, 1, True)
    }  # fmt: skip
    assert ("reference", 1, 1, 1, False) in layouts(c)
    short = {6: [a, b, c], 12: [b, d]}  # the model's ranking at each length
    assert next_probe(short, set(), pool=8) == (a, 6)
    # rank 0 of every length before rank 1 of any: 12's best before 6's second
    assert next_probe(short, layouts(a), pool=8) == (d, 12)
    assert next_probe(short, layouts(a) | layouts(d), pool=8) == (c, 6)  # b adds nothing
    assert next_probe(short, layouts(a) | layouts(d), pool=2) is None  # c is at rank 2
    assert next_probe({6: [a, b]}, layouts(a), pool=8) is None
    assert next_probe({}, set(), pool=1) is None
    with pytest.raises(ValueError, match="pool"):
        next_probe(short, set(), pool=0)


def test_probe_lengths_are_the_first_and_the_next_bucket_edges():
    assert probe_lengths(6, (8, 12, 16, 24), 2) == [6, 12, 16]
    assert probe_lengths(8, (8, 12, 16, 24), 2) == [8, 12, 16]
    assert probe_lengths(20, (8, 12, 16, 24), 2) == [20]  # nothing above 24 is known
    assert probe_lengths(6, (8, 12, 16), 0) == [6]


def test_bad_probe_count_raises_before_any_process():
    with pytest.raises(TrainConfigError, match="calibration_probes"):
        Trainer(TrainConfig(calibration_probes=-1))


@pytest.fixture(scope="module")
def driver():
    d = Driver(heartbeat_timeout=60.0, call_timeout=300.0)
    d.spawn_local(4)
    yield d
    d.shutdown()


def test_calibration_feeds_the_model_and_leaves_the_run_unchanged(driver):
    common = dict(algo="grpo", steps=3, seed=5, driver=driver, length_start=6,
                  length_end=10, **FAST)  # fmt: skip
    cal = train(adapt=False, plan="auto", calibration_probes=2, **common)
    assert cal.error is None, cal.error
    rec = cal.calibration
    assert rec is not None and len(rec["probes"]) == 2
    assert len(set(rec["probes"])) == 2  # each measured something new
    assert cal.timings["calibration_s"] == pytest.approx(rec["seconds"])
    observed = [r for r in rec["runs"] if r["observed"]]
    # every probe ran REPEATS times; all but the first of each were measured, and each
    # stage went to the model once per probe, at its least time over them
    assert len(rec["runs"]) == 2 * REPEATS and len(observed) == 2 * (REPEATS - 1)
    assert all(t > 0 for r in observed for t in r["stage_s"].values())
    # the model moved from its defaults to the measured times (the defaults are
    # deliberately optimistic: measured steps are slower than they predict)
    for p in rec["probes"]:
        assert rec["predicted_after_s"][p] != rec["predicted_before_s"][p]
    # The same run without calibration (a plan given and no adaptation: nothing for the
    # planner to decide, so none runs), on the plan the calibrated run started on: the
    # probes' prompts and training did not reach the run's prompts or state.
    plain = train(adapt=False, plan=cal.plans[0][1], **common)
    assert plain.calibration is None and "calibration_s" not in plain.timings
    assert plain.rewards == cal.rewards
    a = torch.tensor([m["loss"] for m in cal.metrics])
    b = torch.tensor([m["loss"] for m in plain.metrics])
    assert torch.equal(a, b)


def test_next_probe_prefers_a_new_stage_shape_over_new_sharing():
    a = _plan((1, (0,)), (2, (0, 1)), (2, (0, 1)))
    f = _plan((1, (2,)), (2, (0, 1)), (2, (0, 1)))  # a's shapes, the rollout alone on 2
    e = _plan((1, (2,)), (1, (3,)), (1, (0,)))  # trains on dp 1: a shape a never ran
    assert next_probe({6: [a, f, e]}, layouts(a), pool=8) == (e, 6)
    # with no new shape among them, a new sharing is still probed
    assert next_probe({6: [a, f]}, layouts(a), pool=8) == (f, 6)


def test_next_probe_weighs_new_shapes_by_their_predicted_seconds():
    a = _plan((1, (0,)), (2, (0, 1)), (2, (0, 1)))
    r = _plan((1, (0,)), (1, (3,)), (2, (0, 1)))  # a new reference shape (dp 1), ranked first
    t = _plan((1, (2,)), (2, (0, 1)), (1, (3,)))  # a new training shape (dp 1)
    secs = {"rollout": 0.05, "reference": 0.02, "actor_train": 0.15}
    # without prices, rank order; with them, the shape holding more predicted seconds
    assert next_probe({6: [r, t]}, layouts(a), pool=8) == (r, 6)
    assert next_probe({6: [r, t]}, layouts(a), pool=8, stage_s=lambda p, n: secs) == (t, 6)
    # nothing new in shape: back to new sharing, weights or not
    f = _plan((1, (2,)), (2, (0, 1)), (2, (0, 1)))
    assert next_probe({6: [a, f]}, layouts(a), pool=8, stage_s=lambda p, n: secs) == (f, 6)


class _FakeProbe:
    """Just what run_probe calls: each step's stage seconds come from ``times`` in turn."""

    def __init__(self, times):
        self.plan, self.setups, self.rlens = None, 0, []
        self._times = iter(times)

    def setup(self, plan):
        self.plan = plan
        self.setups += 1

    def step(self, rlen):
        self.rlens.append(rlen)
        r, i, t = next(self._times)
        return {"stage_s": {"rollout": r, "inference": i, "train": t}, "sync_s": 0.0}


def test_run_probe_takes_each_stage_at_its_least_after_the_warm_up():
    p = _plan((1, (0,)), (1, (1,)), (1, (2,)))
    # the first (warm-up) repeat is fastest everywhere and must not count
    fake = _FakeProbe([(0.01, 0.01, 0.01), (0.5, 0.2, 0.9), (0.3, 0.4, 0.7), (0.6, 0.3, 0.8)])
    out = run_probe(fake.setup, fake.step, p, 6, repeats=4, algo="grpo")
    assert fake.setups == 1 and fake.plan is p and fake.rlens == [6] * 4
    assert out["stage_s"] == {"rollout": 0.3, "reference": 0.2, "actor_train": 0.7}
    assert [r["observed"] for r in out["runs"]] == [False, True, True, True]
    assert out["step_s"] == min(r["step_s"] for r in out["runs"][1:])
    # one repeat: nothing measured
    one = _FakeProbe([(0.1, 0.1, 0.1)])
    out = run_probe(one.setup, one.step, p, 6, repeats=1, algo="grpo")
    assert out["stage_s"] is None and out["step_s"] is None


def test_stage_seconds_reads_the_inference_as_the_driver_or_the_workers_time_it():
    m = {
        "stage_s": {"rollout": 0.5, "inference": 0.4, "train": 0.3},
        "sync_s": 0.1,
        "inference_work_s": {"reference": 0.15, "critic_inference": 0.2},
    }
    # by default the driver's time (it holds the calls' overhead); PPO's is not the
    # reference's alone
    assert stage_seconds("grpo", m) == {"rollout": 0.6, "reference": 0.4, "actor_train": 0.3}
    assert stage_seconds("ppo", m) == {"rollout": 0.6, "actor_train": 0.3}
    # an async run's: each inference stage as its workers time it (the driver's time
    # holds the wait behind the next step's rollout on shared workers)
    got = stage_seconds("ppo", m, worker_inference=True)
    assert got == {"rollout": 0.6, "actor_train": 0.3, "reference": 0.15, "critic_inference": 0.2}
