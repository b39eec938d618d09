"""The trainer's startup calibration: which probes it runs, what it feeds the cost model,
and that the run it precedes is the run without it."""

from __future__ import annotations

import pytest
import torch

from nereus_rl.globalplan import GlobalPlan, StagePlan
from nereus_rl.runtime import Driver
from nereus_rl.trainer import TrainConfig, TrainConfigError, Trainer, train
from nereus_rl.trainer_calibrate import choose_probes, layouts

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


def test_probes_cover_the_most_new_layouts_best_first():
    a = _plan((1, (0,)), (2, (0, 1)), (2, (0, 1)))  # the best
    b = _plan((1, (1,)), (2, (0, 1)), (2, (0, 1)))  # same layouts as a: adds nothing
    c = _plan((1, (0,)), (1, (3,)), (2, (0, 1)))  # the reference alone: adds 1
    d = _plan((2, (0, 1)), (1, (2,)), (1, (2,)))  # adds 3
    assert layouts(a) == {
        ("rollout", 1, 1, 1, True), ("reference", 2, 1, 1, True), ("actor_train", 2, 1, 1, True)
    }  # fmt: skip
    assert choose_probes([a, b, c, d], 3) == [a, d, c]
    assert choose_probes([a, b, c, d], 2) == [a, d]
    # nothing new left to cover: fewer probes than asked
    assert choose_probes([a, b], 3) == [a]
    assert choose_probes([a, b], 0) == [] and choose_probes([], 3) == []
    with pytest.raises(ValueError, match="num_probes"):
        choose_probes([a], -1)


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
    assert cal.timings["calibration_s"] == pytest.approx(rec["seconds"])
    observed = [r for r in rec["runs"] if r["observed"]]
    # every probe ran twice; the second run of each was fed to the model
    assert len(rec["runs"]) == 4 and len(observed) == 2
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
