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
from joiner import reap, start_joiner

from nereus_rl.globalplan import GlobalPlan, StagePlan
from nereus_rl.report import RunLog
from nereus_rl.runtime import Driver
from nereus_rl.trainer import TrainConfig, Trainer, train

FAST = {"warm_steps": 30, "batch": 4, "group_size": 2}


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


def _stage_states(tr: Trainer) -> dict[str, dict[str, torch.Tensor]]:
    """Each stage's full state; every live unit of a stage must hold the same bytes."""
    m = tr.units.emus
    out: dict[str, dict[str, torch.Tensor]] = {}
    for u in m.units():
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

    def progress(step, m):
        if step in kills:
            victim = tr.device_worker[kills[step]]
            tag["before"].append(_stage_states(tr))
            tag["intact"].append(
                {u.uid: u.ranks for u in tr.units.emus.units() if victim not in u.ranks}
            )
            d.kill(victim)

    recover = tr.recover

    def recover_and_note(step, error):
        recover(step, error)
        tag["after"].append(_stage_states(tr))
        tag["live"] = {u.uid for u in tr.units.emus.units()}

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


def test_a_stage_with_no_intact_unit_left_stops_the_run_with_a_clear_message(tmp_path):
    # reference has one unit, on device 1: its death takes the reference model's state.
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
            seed=5,
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
                    driver.kill(tr.device_worker[1])
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
                    tr._all("rl.held_bytes")  # the boundary's next call meets the death
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
