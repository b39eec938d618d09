"""Worker deaths in one trainer run: two in sequence, one during the recovery itself, and
a stage left with no intact unit. Each death is a SIGKILL of a local worker.

After every recovery each live unit's full state must equal, bitwise, the state its
stage had when the worker died (nothing lost, nothing reloaded from disk), the units
that lost no shard must still be live, and the run must go on to its last step.

Each test has its own local workers (forked, so they start in seconds), exactly as
many as its run's devices: a spare worker would be admitted in a lost one's place
(the last test does that with a worker started by ``nereus-rl worker --store``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from support.joiner import reap, start_joiner

from nereus_rl.core.globalplan import GlobalPlan, StagePlan
from nereus_rl.runtime import Driver, WorkerLostError
from nereus_rl.trainer.report import RunLog
from nereus_rl.trainer.trainer import TrainConfig, Trainer, train

# Multi-process: out of the fast lane (-m "not slow").
pytestmark = pytest.mark.slow

# A snapshot every step, whatever it costs here: spaced snapshots would roll a death back
# over steps that then run again, and the kills below are keyed to steps.
FAST = {"warm_steps": 30, "batch": 4, "group_size": 2, "snapshot_budget": float("inf")}


@contextmanager
def _workers(n: int) -> Iterator[Driver]:
    d = Driver(heartbeat_timeout=60.0, call_timeout=300.0)
    try:
        d.spawn_local(n, method="forkserver")
        yield d
    finally:
        d.shutdown()


def _plan(rollout, reference, actor_train) -> GlobalPlan:
    def sp(stage, model, trains, units):
        return StagePlan(stage, model, trains, len(units), 1, 1, tuple((d,) for d in units))

    return GlobalPlan((
        sp("rollout", "actor", False, rollout),
        sp("reference", "reference", False, reference),
        sp("actor_train", "actor", True, actor_train),
    ))  # fmt: skip


# dp 3 for every stage on 6 devices; device 1 holds a rollout unit, device 4 a reference
# and an actor_train unit. Each plan after a loss keeps every intact unit where it is.
P0 = _plan((0, 1, 2), (3, 4, 5), (0, 2, 4))
PLANS = {
    (0, 2, 3, 4, 5): _plan((0, 2, 3), (3, 4, 5), (0, 2, 4)),  # after device 1
    (0, 2, 3, 5): _plan((0, 2, 3), (3, 5, 0), (0, 2, 5)),  # after devices 1 and 4
}


def _stage_states(tr: Trainer, lost: tuple[int, ...] = ()) -> dict[str, dict[str, torch.Tensor]]:
    """Each stage's full state; every live unit of a stage (but those on ``lost``
    workers) must hold the same bytes."""
    m = tr.units.emus
    out: dict[str, dict[str, torch.Tensor]] = {}
    for u in m.units():
        if set(u.ranks) & set(lost):
            continue
        got = m.full_state(u)
        ref = out.setdefault(u.stage, got)
        for name, t in ref.items():
            assert torch.equal(got[name], t), f"{u!r} differs from its stage on {name}"
    return out


def _assert_same(before, after) -> None:
    assert sorted(before) == sorted(after)
    for stage, ref in before.items():
        refs = [ref]
        if stage == "rollout":
            # rollout holds a copy of actor_train's weights: the weight sync that opens
            # the next step may reach the survivors before the death shows (it is run
            # again on the new plan either way)
            refs.append({k: before["actor_train"][k] for k in ref})
        same = [all(torch.equal(after[stage][n], r[n]) for n in ref) for r in refs]
        assert any(same), f"{stage}: the state changed in recovery"


def _instrument(tr: Trainer, d: Driver, kills: dict[int, int], tag: dict) -> None:
    """Kill the worker of device ``kills[step]`` after that step (state and intact units
    noted first), and note the state after each recovery."""
    tag.update(before=[], after=[], intact=[])

    def kill(step):
        victim = tr.device_worker[kills[step]]
        tag["before"].append(_stage_states(tr))
        tag["intact"].append(
            {u.uid: u.ranks for u in tr.units.emus.units() if victim not in u.ranks}
        )
        tag["victim"] = victim
        d.kill(victim)

    def progress(step, m):
        if tr._boundary_loss is not None and "victim" in tag:
            # The step ran after the death (its rollout, sent ahead, finished before
            # it; the step's end found it): the state at the death is the one after
            # this step, read from the units on the survivors.
            tag["before"][-1] = _stage_states(tr, lost=(tag["victim"],))
        if step in kills:
            if tr._boundary_loss is None:
                kill(step)
            else:  # the earlier death is recovered from first
                tag["deferred"] = step

    recover = tr.recover

    def recover_and_note(step, error):
        resume = recover(step, error)
        tag["after"].append(_stage_states(tr))
        tag["live"] = {u.uid for u in tr.units.emus.units()}
        if tag.get("deferred") is not None:
            kill(tag.pop("deferred"))
        return resume

    tr.progress = progress
    tr.recover = recover_and_note
    tr.adapter.best_plan = lambda rlen, devices=None: (PLANS[tuple(devices)], 0.0)


def _recoveries(res) -> list[dict]:
    return [x for x in res.decisions if "lost devices" in x["trigger"]]


def test_two_deaths_in_sequence_recover_twice_from_the_intact_units(tmp_path):
    cfg = TrainConfig(steps=3, adapt=False, plan=P0, devices=6, seed=5, **FAST)
    tag: dict = {}
    with _workers(6) as driver:
        tr = Trainer(cfg, driver=driver, log=RunLog(tmp_path, cfg))
        try:
            tr.start()
            _instrument(tr, driver, {0: 1, 1: 4}, tag)
            res = tr.run()
        finally:
            tr.close()
    res.run_dir = tr.log.finish(res)
    assert res.error is None, res.error
    assert [m["step"] for m in res.metrics] == [0, 1, 2]
    rec = _recoveries(res)
    # The second death is told apart from the first (no stale device -> worker map).
    assert [r["trigger"].split(" (")[0] for r in rec] == ["lost devices [1]", "lost devices [4]"]
    for r in rec:
        assert r["recovery"] == "emu" and r["recovery_fallback"] is None, r
        assert any(p.startswith("extend:") for p in r["executed_primitives"]), r
        assert r["bytes_moved"] > 0 and len(r["recovery_rounds"]) == 1, r
    assert [p for _, p in res.plans] == [P0, *PLANS.values()]
    # Bitwise: every unit after each recovery holds what its stage held at the death.
    for before, after in zip(tag["before"], tag["after"], strict=True):
        _assert_same(before, after)
    assert tag["intact"][-1].keys() <= tag["live"]  # the units that lost no shard were kept
    # The run folder has every step and both recoveries.
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]
    assert (tmp_path / "decisions.jsonl").read_text().count("lost devices") == 2


@pytest.mark.parametrize("phase", ["world", "extended"])
def test_a_death_during_recovery_starts_it_over_the_survivors(phase):
    # Device 1 dies after step 0; device 4 dies while that recovery runs: after the new
    # default group formed ("world": the planned extends onto device 4 are refused), or
    # after the extends, before the rebind ("extended": the extended units are kept).
    cfg = TrainConfig(steps=2, adapt=False, plan=P0, devices=6, seed=5, **FAST)
    tag: dict = {}
    with _workers(6) as driver:
        tr = Trainer(cfg, driver=driver)
        try:
            tr.start()
            _instrument(tr, driver, {0: 1}, tag)
            second = tr.device_worker[4]

            def kill_second(at, attempt):
                if at == phase and attempt == 0:
                    driver.kill(second)

            tr.on_recovery_phase = kill_second
            res = tr.run()
        finally:
            tr.close()
    assert res.error is None, res.error
    assert [m["step"] for m in res.metrics] == [0, 1]
    (rec,) = _recoveries(res)
    assert rec["trigger"].startswith("lost devices [1, 4]"), rec
    rounds = rec["recovery_rounds"]
    assert [r["lost_devices"] for r in rounds] == [[1], [4]], rounds
    assert rounds[0]["error"] and rounds[1]["error"] is None, rounds
    assert rec["recovery"] == "emu" and rec["recovery_fallback"] is None, rec
    assert res.plans[-1][1] == PLANS[(0, 2, 3, 5)]
    (before,), (after,) = tag["before"], tag["after"]
    _assert_same(before, after)
    # Units that lost no shard in either death are still the same live units.
    assert {uid for uid, ranks in tag["intact"][0].items() if second not in ranks} <= tag["live"]


def test_without_the_mirror_a_stage_with_no_intact_unit_left_stops_the_run_with_a_clear_message(
    tmp_path,
):
    # reference has one unit, on device 1: its death takes the reference model's state
    # (with the mirror, the default, it is rebuilt: tests/rl/trainer/test_trainer_snapshot.py).
    plan = GlobalPlan((
        StagePlan("rollout", "actor", False, 2, 1, 1, ((0,), (1,))),
        StagePlan("reference", "reference", False, 1, 1, 1, ((1,),)),
        StagePlan("actor_train", "actor", True, 2, 1, 1, ((0,), (1,))),
    ))  # fmt: skip
    with _workers(2) as driver:

        def kill_after_step_one(step, m):
            if step == 1:
                driver.kill(sorted(driver.workers)[1])

        res = train(
            steps=3, driver=driver, devices=2, plan=plan, adapt=False, run_dir=tmp_path,
            seed=5, mirror=False,
            progress=kill_after_step_one, **FAST,
        )  # fmt: skip
    assert res.error is not None and "'reference'" in res.error, res.error
    assert "no unit left" in res.error and "dp >= 2" in res.error, res.error
    assert [m["step"] for m in res.metrics] == [0, 1]
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1]


def test_a_worker_joining_after_a_death_takes_the_lost_device_by_extend():
    # Device 1's worker dies after step 0 while a worker started by `nereus-rl worker
    # --store` has joined: recovery gives it device 1 and extends the lost rollout unit
    # onto it from an intact one; the plan keeps its four devices.
    p0 = _plan((0, 1), (2, 3), (0, 2))
    cfg = TrainConfig(steps=2, adapt=False, plan=p0, devices=4, seed=5, **FAST)
    tag: dict = {}
    joiner = None
    with _workers(4) as driver:
        tr = Trainer(cfg, driver=driver)
        try:
            tr.start()
            _instrument(tr, driver, {}, tag)
            tr.adapter.best_plan = lambda rlen, devices=None: (p0, 0.0)
            instrumented = tr.progress

            def join_then_kill(step, m):
                nonlocal joiner
                if step == 0:
                    joiner = start_joiner(driver.address)
                    assert driver.wait_for_workers(5, timeout=60)[-1] == 4
                    tag["before"].append(_stage_states(tr))
                    tag["victim"] = tr.device_worker[1]
                    driver.kill(tag["victim"])
                    return
                instrumented(step, m)

            tr.progress = join_then_kill
            res = tr.run()
            assert tr.device_worker == {0: 0, 1: 4, 2: 2, 3: 3}
        finally:
            tr.close()
            driver.shutdown()
            reap(joiner)
    assert res.error is None, res.error
    assert [m["step"] for m in res.metrics] == [0, 1]
    (rec,) = _recoveries(res)
    assert rec["recovery_rounds"] == [{"lost_devices": [1], "joined": {1: 4}, "error": None}]
    assert rec["recovery"] == "emu" and "extend:rollout" in rec["executed_primitives"], rec
    assert res.plans[-1][1] == p0
    (before,), (after,) = tag["before"], tag["after"]
    _assert_same(before, after)


def test_a_death_at_a_step_boundary_does_not_train_the_step_twice():
    # A worker dies at the safe boundary after step 0 (where a transition would run):
    # step 0 trained already, so it is recorded once and the run goes on from step 1.
    p0 = _plan((0, 1), (2, 3), (0, 2))
    p1 = _plan((0, 2), (2, 3), (0, 2))
    cfg = TrainConfig(steps=3, adapt=False, plan=p0, devices=4, seed=5, **FAST)
    with _workers(4) as driver:
        tr = Trainer(cfg, driver=driver)
        try:
            tr.start()
            tr.adapter.best_plan = lambda rlen, devices=None: (p1, 0.0)
            boundary = tr.adapter.boundary

            def kill_at_boundary(step, m):
                if step == 0 and 1 in tr.device_worker:  # once (step 0 might run twice)
                    driver.kill(tr.device_worker[1])
                    tr.group.call_all("rl.held_bytes")  # the boundary's next call meets the death
                return boundary(step, m)

            tr.adapter.boundary = kill_at_boundary
            res = tr.run()
            adam_step = _stage_states(tr)["actor_train"]["adam_step"]
        finally:
            tr.close()
    assert res.error is None, res.error
    assert [m["step"] for m in res.metrics] == [0, 1, 2]
    (rec,) = _recoveries(res)
    assert rec["step"] == 1 and res.plans[-1] == (1, p1), rec
    assert adam_step.tolist() == [3.0]  # three optimizer steps, not four


# ---------------------------------------------------------------- deaths mid-transition

P4 = _plan((0, 1), (2, 3), (0, 2))
# after device 3's loss: the reference unit it held is rebuilt on device 1
P4_AFTER = _plan((0, 1), (2, 1), (0, 2))


def _arm(driver: Driver, victim: int, fn: str, **match) -> None:
    """The victim worker SIGKILLs itself after its next ``fn`` (tests/support/worker_faults.py)."""
    driver.call([victim], "import", "tests.support.worker_faults")
    driver.call([victim], "faults.die_after", fn, match)


def _transition_at_step_0(tr: Trainer, target: GlobalPlan, arm, tag: dict):
    """A boundary that, after step 0, notes the state, arms a death and runs the
    transition to ``target`` (the real one, DAG and all)."""

    def boundary(step, m):
        if step == 0:
            tag["before"].append(_stage_states(tr))
            arm()
            dag, _ = tr.adapter.compile(tr.plan, target)
            tr.transition(target, dag, step + 1)
        return {}

    return boundary


def _run_with_transition_death(target, after, fn, live_kinds=None, transitions="emu", **match):
    cfg = TrainConfig(
        steps=2, adapt=False, plan=P4, devices=4, seed=5, transitions=transitions, **FAST
    )
    tag: dict = {}
    with _workers(4) as driver:
        tr = Trainer(cfg, driver=driver)
        try:
            tr.start()
            if live_kinds is not None:
                tr.units.live_kinds = frozenset(live_kinds)
            _instrument(tr, driver, {}, tag)
            tr.adapter.best_plan = lambda rlen, devices=None: (after, 0.0)
            victim = tr.device_worker[3]
            tr.adapter.boundary = _transition_at_step_0(
                tr, target, lambda: _arm(driver, victim, fn, **match), tag
            )
            res = tr.run()
            final = _stage_states(tr)
        finally:
            tr.close()
    assert res.error is None, res.error
    assert [m["step"] for m in res.metrics] == [0, 1]
    (rec,) = _recoveries(res)
    assert rec["trigger"].startswith("lost devices [3]") and rec["step"] == 1, rec
    assert rec["recovery"] == transitions, rec
    assert (rec["recovery_fallback"] is None) == (transitions == "emu"), rec
    assert res.plans[-1] == (1, after)
    (before,), (after_state,) = tag["before"], tag["after"]
    _assert_same(before, after_state)  # every stage's state as at the death, bitwise
    assert final["actor_train"]["adam_step"].tolist() == [2.0]  # two steps, each once
    return rec


def test_a_death_during_a_transitions_rebind_recovers_from_its_target_units():
    # rollout dp2 -> dp3 (an Extend onto device 2, then the rebind); device 3's worker
    # dies right after its rl.rebind, before replying: the survivors' rollout models are
    # the new layout's, and the driver never learned that the rebind ended. The units
    # the DAG left all hold the state, so recovery starts from them.
    target = _plan((0, 1, 2), (2, 3), (0, 2))
    after = _plan((0, 1, 2), (2, 1), (0, 2))
    rec = _run_with_transition_death(target, after, "rl.rebind")
    assert rec["interrupted"] == "transition rebind", rec
    assert rec["unsound_units"] == [] and rec["adopted_units"] == [], rec
    # the three rollout units of the target were kept: only the reference extends
    assert [p for p in rec["executed_primitives"] if p.startswith("extend")] == [
        "extend:reference"
    ], rec


@pytest.mark.parametrize("transitions", ["emu", "reshard"])
def test_a_death_during_a_transitions_fallback_reshard_recovers_from_the_new_layout(
    transitions,
):
    # rollout dp2 -> tp2 (a Merge, not run live here: the stage falls back to one
    # rl.move); device 3's worker dies right after that move, before replying. The
    # survivors' rollout models are tp2 now, so the two old tp1 units read tp2 shards:
    # they are forgotten, and the tp2 unit the models form is adopted and kept (EMU
    # recovery) or read by the per-stage reshard (transitions="reshard").
    target = GlobalPlan((
        StagePlan("rollout", "actor", False, 1, 2, 1, ((0, 1),)),
        *P4.stages[1:],
    ))  # fmt: skip
    after = GlobalPlan((target.stages[0], *P4_AFTER.stages[1:]))
    rec = _run_with_transition_death(
        target, after, "rl.move", transitions=transitions, replace=True,
        # (no Merge live; with transitions="reshard" none is)
        live_kinds={"extend", "destroy"} if transitions == "emu" else None,
    )  # fmt: skip
    assert rec["interrupted"] == "transition fallback reshard", rec
    assert len(rec["unsound_units"]) == 2 and all("rollout" in u for u in rec["unsound_units"])
    assert len(rec["adopted_units"]) == 1 and "rollout tp2" in rec["adopted_units"][0], rec


def test_async_a_partial_weight_sync_then_a_death_leaves_every_rollout_unit_synced():
    # Async: the weight sync after step 0 reaches the rollout unit on device 1 only, then
    # device 3's worker dies. Step 0 trained already (recorded once, not run again); the
    # rollout units survive holding different weights, and recovery gives each of them
    # actor_train's before the next rollout is generated.
    cfg = TrainConfig(steps=3, adapt=False, plan=P4, devices=4, seed=5, mode="async", **FAST)
    tag: dict = {}
    with _workers(4) as driver:
        ref = train(driver=driver, **{k: getattr(cfg, k) for k in ("steps", "plan", "devices",
                    "seed", "mode", "adapt")}, **FAST)  # fmt: skip
        tr = Trainer(cfg, driver=driver)
        try:
            tr.start()
            _instrument(tr, driver, {}, tag)
            tr.adapter.best_plan = lambda rlen, devices=None: (P4_AFTER, 0.0)
            real_sync, calls = tr.weight_sync, []

            def partial_sync():
                calls.append(len(calls))
                if len(calls) != 2:  # the 1st: before step 0; the 2nd: after it
                    return real_sync()
                one = StagePlan("rollout", "actor", False, 1, 1, 1, ((1,),))
                src = tr.group.desc(tr.plan.stage("actor_train"))
                dst = tr.group.desc(one)
                tr.group.call_all("rl.move", src, dst, params_only=True, replace=False)
                w0, w1 = (
                    driver.call([tr.device_worker[d]], "rl.shards", "rollout")[tr.device_worker[d]]
                    for d in (0, 1)
                )
                tag["mixed"] = any(not torch.equal(w0[k], w1[k]) for k in w0)
                victim = tr.device_worker[3]
                driver.kill(victim)
                raise WorkerLostError("killed during the weight sync", (victim,))

            tr.weight_sync = partial_sync
            res = tr.run()
            final = _stage_states(tr)
        finally:
            tr.close()
    assert res.error is None, res.error
    assert tag["mixed"], "the partial sync must leave the rollout units different"
    assert [m["step"] for m in res.metrics] == [0, 1, 2]
    (rec,) = _recoveries(res)
    assert rec["step"] == 1 and rec["recovery_rounds"][-1].get("weight_sync"), rec
    assert res.plans[-1] == (1, P4_AFTER)
    # _stage_states checked every rollout unit equal; they hold actor_train's weights
    (after,) = tag["after"]
    for k, t in after["rollout"].items():
        assert torch.equal(t, after["actor_train"][k]), k
    assert final["actor_train"]["adam_step"].tolist() == [3.0]  # three steps, each once
    # The same samples and updates as the run without the death: the rollout made before
    # it is kept, and the units after it compute as before (same layouts, same splits).
    assert ref.error is None and res.rewards == ref.rewards
    assert [m["loss"] for m in res.metrics] == [m["loss"] for m in ref.metrics]
