"""A worker that dies inside a collective: its peers are left waiting on it.

tests/rl/trainer/test_trainer_recovery.py kills a worker after a command ended (or between
commands), so no survivor is ever blocked on the dead one. Here the victim dies as
a command starts (``faults.die_before``), so a survivor is inside that command's
gloo collective with it: the gradient all-reduce of a dp=2 training stage. The
survivor's op fails when the dead peer's connection closes, or at the latest when
the group timeout (short here) runs out; either way the job must notice within a
bounded time, keep every intact unit's state, and go on without training a step
twice. The last test chains the wait: a survivor waits on another survivor that has
left the command, which only the stage groups' timeout ends.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from test_trainer_recovery import FAST, P4, _assert_same, _plan, _recoveries, _stage_states

from nereus_rl.core.globalplan import GlobalPlan, StagePlan
from nereus_rl.runtime import Driver
from nereus_rl.trainer.trainer import TrainConfig, Trainer

# Multi-process: out of the fast lane (-m "not slow").
pytestmark = pytest.mark.slow

GROUP_TIMEOUT_S = 10.0
# Long enough that a loaded machine's busy worker never looks dead (a 3 s timeout did
# at load 20, during rl.init); the death here is seen from the process's exit.
HEARTBEAT_S = 30.0


@contextmanager
def _workers(n: int) -> Iterator[Driver]:
    d = Driver(heartbeat_timeout=HEARTBEAT_S, call_timeout=300.0)
    try:
        d.spawn_local(n, method="forkserver", group_timeout=GROUP_TIMEOUT_S)
        yield d
    finally:
        d.shutdown()


# After device 2's loss: its reference unit is rebuilt on device 1, its actor_train
# unit on device 3.
AFTER = _plan((0, 1), (3, 1), (0, 3))


def _run_with_death_before(fn: str, plan: GlobalPlan = P4, after: GlobalPlan = AFTER) -> tuple:
    """Run 3 steps on ``plan``; device 2's worker dies as its first ``fn`` after step 0
    starts, and the recovery plans ``after``.

    Returns (the result, every stage's final state, tag: the state at the death, after
    the recovery, and when the death was armed, noticed and recovered from).
    """
    cfg = TrainConfig(steps=3, adapt=False, plan=plan, devices=4, seed=5, **FAST)
    tag: dict = {"before": [], "after": []}
    with _workers(4) as driver:
        tr = Trainer(cfg, driver=driver)
        try:
            tr.start()
            tr.adapter.best_plan = lambda rlen, devices=None: (after, 0.0)
            victim = tr.device_worker[2]

            def progress(step, m):
                if step == 0:
                    tag["before"].append(_stage_states(tr))
                    driver.call([victim], "import", "tests.support.worker_faults")
                    driver.call([victim], "faults.die_before", fn)
                    tag["armed"] = time.monotonic()

            recover = tr.recover

            def recover_and_note(step, error):
                tag["noticed"] = time.monotonic()
                resume = recover(step, error)
                tag["recovered"] = time.monotonic()
                tag["after"].append(_stage_states(tr))
                return resume

            tr.progress = progress
            tr.recover = recover_and_note
            res = tr.run()
            final = _stage_states(tr)
        finally:
            tr.close()
    assert res.error is None, res.error
    assert [m["step"] for m in res.metrics] == [0, 1, 2]
    return res, final, tag


def test_a_death_inside_the_gradient_allreduce_is_noticed_at_once_and_recovered():
    # actor_train is dp2 on devices 0 and 2. Device 2's worker dies as step 1's rl.train
    # starts, so device 0 runs its forward/backward and then waits in the gradient
    # all-reduce for a peer that is gone. Nothing was stepped (the optimizer runs after
    # the all-reduce), so step 1 is trained again on the plan recovery builds from the
    # intact units (device 0's actor_train, device 3's reference).
    res, final, tag = _run_with_death_before("rl.train")
    (rec,) = _recoveries(res)
    assert rec["trigger"].startswith("lost devices [2]") and rec["step"] == 1, rec
    assert res.plans[-1] == (1, AFTER)
    # Noticed within the bound: the dead peer's closed connection fails the survivor's
    # all-reduce at once (0.3 s measured from arming, step 1's rollout included), the
    # group timeout bounds it otherwise; room is left for a loaded machine's rollout.
    waited = tag["noticed"] - tag["armed"]
    assert waited < GROUP_TIMEOUT_S + 20.0, waited
    (before,), (after_state,) = tag["before"], tag["after"]
    _assert_same(before, after_state)  # the state at the death, bitwise
    assert final["actor_train"]["adam_step"].tolist() == [3.0]  # three steps, each once


def test_a_death_while_measuring_held_memory_after_training_does_not_train_twice():
    # Device 2's worker dies as rl.held_bytes starts, right after step 1 trained on every
    # unit: the step's update is in, so it is recorded once and recovered from at its
    # boundary, not run again (which would apply its update twice).
    res, final, _ = _run_with_death_before("rl.held_bytes")
    (rec,) = _recoveries(res)
    assert rec["trigger"].startswith("lost devices [2]") and rec["step"] == 2, rec
    assert res.plans[-1] == (2, AFTER)
    assert final["actor_train"]["adam_step"].tolist() == [3.0]  # three steps, each once


def _sp(stage, model, trains, pp, units) -> StagePlan:
    return StagePlan(stage, model, trains, len(units), 1, pp, tuple(units))


# actor_train is dp 2 x pp 2: unit A on devices (0, 1), unit B on (2, 3); the gradient
# all-reduce of pipeline stage 1 pairs device 1 with device 3.
CHAIN = GlobalPlan((
    _sp("rollout", "actor", False, 1, [(1,), (3,)]),
    _sp("reference", "reference", False, 1, [(0,), (3,)]),
    _sp("actor_train", "actor", True, 2, [(0, 1), (2, 3)]),
))  # fmt: skip
# After device 2's loss every stage keeps its intact units: unit A, rollout, reference.
CHAIN_AFTER = GlobalPlan((
    _sp("rollout", "actor", False, 1, [(1,), (3,)]),
    _sp("reference", "reference", False, 1, [(0,), (3,)]),
    _sp("actor_train", "actor", True, 2, [(0, 1)]),
))  # fmt: skip


def test_a_survivor_left_waiting_on_another_survivor_is_released_and_recovered():
    # Device 2's worker dies as step 1's rl.train starts. Device 3 (unit B's second
    # pipeline stage) fails at once: its activations were to come from device 2. Unit
    # A runs its pipeline, then device 0 fails in its all-reduce with device 2 (dead),
    # while device 1 waits in its all-reduce with device 3, a survivor that has
    # already left the command: no connection closes, so only the group timeout ends
    # that wait. The recovery must wait for it (its first calls queue behind it on
    # device 1), keep unit A's state bitwise, and train step 1 once.
    res, final, tag = _run_with_death_before("rl.train", CHAIN, CHAIN_AFTER)
    (rec,) = _recoveries(res)
    assert rec["trigger"].startswith("lost devices [2]") and rec["step"] == 1, rec
    # a death inside a step's update: rebuilt from the snapshot of step 0 (a survivor
    # might have stepped already), which is unit A's state at the death
    assert rec["recovery"] == "snapshot", rec
    assert res.plans[-1] == (1, CHAIN_AFTER)
    # Bounded: the death is seen from the process's exit, and device 1's wait ends at
    # the group timeout (room left for a loaded machine).
    assert tag["recovered"] - tag["armed"] < 2 * GROUP_TIMEOUT_S + 30.0, tag
    (before,), (after_state,) = tag["before"], tag["after"]
    _assert_same(before, after_state)
    assert final["actor_train"]["adam_step"].tolist() == [3.0]  # three steps, each once
