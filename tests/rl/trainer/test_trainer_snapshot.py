"""The in-memory snapshot that keeps a run alive when a stage's only copy dies.

Unit tests of the buddy choice and of the reassembly (against slicing written out
here); then runs where a SIGKILL takes the only copy of a stage (actor_train's, the
reference's), comes in the middle of a step's update, or during start-up: each run
must finish every step once, with the state the snapshot held.
"""

from __future__ import annotations

import time

import pytest
import torch
from test_trainer_recovery import FAST, _arm, _plan, _recoveries, _workers

from nereus_rl.core.globalplan import StagePlan
from nereus_rl.core.spec import local_cpu_cluster
from nereus_rl.models.model import get_preset, state_specs
from nereus_rl.trainer.snapshot import (
    Held,
    SnapshotLostError,
    Snapshots,
    assemble,
    buddies,
    exposed,
    node_map,
    snapshot_interval,
    snapshot_seconds,
)
from nereus_rl.trainer.trainer import TrainConfig, TrainConfigError, Trainer, check_config

# ---------------------------------------------------------------- pure parts


def _sp(units, tp=1, pp=1):
    return StagePlan("actor_train", "actor", True, len(units), tp, pp, tuple(units))


def test_a_stage_is_exposed_when_one_worker_or_node_meets_every_unit():
    one_node = node_map([0, 1, 2, 3], 4, 1)
    two_nodes = node_map([0, 1, 2, 3], 4, 2)
    assert two_nodes == {0: 0, 1: 0, 2: 1, 3: 1}
    assert exposed(_sp([(0,)]), one_node)
    assert not exposed(_sp([(0,), (1,)]), one_node)
    assert exposed(_sp([(0,), (1,)]), two_nodes)  # both units on node 0
    assert not exposed(_sp([(0,), (2,)]), two_nodes)


def test_buddies_are_distinct_never_the_device_itself_and_on_another_node():
    devs = [0, 1, 2, 3]
    two = node_map(devs, 4, 2)
    assert buddies((0, 1), devs, two) == [2, 3]
    assert buddies((1, 2), devs, two) == [3, 0]  # off the node, and outside the unit first
    one = node_map(devs, 4, 1)
    b = buddies((0, 1, 2, 3), devs, one)  # no device outside the unit: a rotation
    assert sorted(b) == devs and all(x != d for x, d in zip(b, (0, 1, 2, 3)))
    assert buddies((0,), [0], {0: 0}) is None
    # after a loss: node sizes differ, the buddy still avoids its device's node
    assert buddies((3,), [0, 2, 3], node_map([0, 2, 3], 4, 2)) == [0]


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_assemble_puts_each_shard_where_the_layout_slices_it(tp, pp):
    mc = get_preset("tiny")
    g = torch.Generator().manual_seed(tp * 10 + pp)
    params = {s.name: (s, torch.randn(s.shape, generator=g)) for s in state_specs(mc)}
    full = {n: t for n, (_, t) in params.items()}
    for k in ("exp_avg", "exp_avg_sq"):
        full.update({f"{k}.{n}": torch.randn(s.shape, generator=g) for n, (s, _) in params.items()})
    full["adam_step"] = torch.tensor([7.0])
    # the shards, sliced here: pipeline stage p holds layer p (tiny has 2 layers), tp
    # rank t holds chunk t of the split dim; position = p * tp + t
    shards = []
    for p in range(pp):
        for t in range(tp):
            mine = {"adam_step": full["adam_step"].clone()}
            for name, (spec, _) in params.items():
                if pp == 2 and spec.layer != p:
                    continue
                for key in (name, f"exp_avg.{name}", f"exp_avg_sq.{name}"):
                    x = full[key]
                    if spec.split_dim is not None:
                        x = torch.chunk(x, tp, dim=spec.split_dim)[t]
                    mine[key] = x.clone()
            shards.append(mine)
    h = Held("actor_train", "actor", tp, pp, tuple(range(tp * pp)), None)
    out = assemble(mc, h, shards)
    assert sorted(out) == sorted(full)
    for name, t in full.items():
        assert torch.equal(out[name], t), name
    shards[0].pop("embed.weight")
    with pytest.raises(KeyError):
        assemble(mc, h, shards)


def test_a_shard_that_lost_its_holder_and_its_mirror_is_reported():
    s = Snapshots(group=None, mc=get_preset("tiny"), num_devices=2)
    s.version = 3
    s.held = {"actor_train": Held("actor_train", "actor", 1, 1, (10,), (11,))}
    with pytest.raises(SnapshotLostError, match="worker 10 and its mirror on worker 11"):
        s.full_states({10, 11}, {"reference": {}})
    s.held = {"actor_train": Held("actor_train", "actor", 1, 1, (10,), None)}
    with pytest.raises(SnapshotLostError, match="with no mirror"):
        s.full_states({10}, {"reference": {}})


def test_the_snapshot_is_priced_and_spaced_to_stay_within_its_budget():
    mc = get_preset("tiny")
    cluster = local_cpu_cluster(4)
    alone = _plan((0,), (1,), (2,))  # actor_train exposed: host copy and mirror
    spread = _plan((0,), (1,), (2, 3))  # dp 2 on one node: host copy only
    node_of = node_map([0, 1, 2, 3], 4, 1)
    t_alone = snapshot_seconds(alone, mc, cluster, node_of)
    t_spread = snapshot_seconds(spread, mc, cluster, node_of)
    assert 0 < t_spread < t_alone
    assert snapshot_interval(0.01, 1.0, 0.05) == 1
    assert snapshot_interval(0.12, 1.0, 0.05) == 3  # 0.12 s every 3rd step: 4% a step
    assert snapshot_interval(0.5, 0.0, 0.05) == 1


@pytest.mark.parametrize(
    "options,match",
    [
        ({"checkpoint_every": -1}, "checkpoint_every=-1 must be an int >= 0"),
        ({"checkpoint_every": 2, "mirror": False}, "mirror=False turns off"),
        ({"nodes": 3}, "do not split into nodes=3"),
        ({"nodes": 0}, "nodes=0 must be an int in 1..devices"),
        ({"heartbeat_timeout": 0}, "heartbeat_timeout=0 must be positive seconds"),
    ],
)
def test_fault_tolerance_options_are_checked_before_anything_starts(options, match):
    with pytest.raises(TrainConfigError, match=match):
        check_config(TrainConfig(devices=4, **options))


def test_a_measured_snapshot_dearer_than_its_price_spaces_the_snapshots_out():
    from types import SimpleNamespace

    snaps = Snapshots(SimpleNamespace(device_worker={0: 0, 1: 1, 2: 2}), get_preset("tiny"), 3)
    plan, cluster = _plan((0,), (1,), (2,)), local_cpu_cluster(3)
    assert snaps.price(plan, cluster, step_s=0.06, budget=0.05) == 1  # priced: bytes only
    snaps.observe(0.007)  # 7 ms measured: over 5% of a 60 ms step
    assert snaps.price(plan, cluster, step_s=0.06, budget=0.05) == 3
    assert snaps.due(2) and not snaps.due(1)  # version -1: every third step from step 2


# ---------------------------------------------------------------- runs with a death


def _full(tr: Trainer, stage: str) -> dict[str, torch.Tensor]:
    """A stage's full state read from one of its units (dp units, tp = pp = 1)."""
    (d,) = tr.plan.stage(stage).units[0]
    w = tr.device_worker[d]
    return tr.driver.call([w], "rl.shards", stage)[w]


@pytest.mark.slow
@pytest.mark.parametrize("victim_device", [2, 1], ids=["actor_train", "reference"])
def test_the_only_copy_of_a_stage_dies_and_the_run_finishes_from_the_snapshot(victim_device):
    # dp 1 everywhere: device 2 holds actor_train's only copy, device 1 the reference's.
    # The death comes after the fourth snapshot: from the third on, each is written into
    # the tensors of the one it drops, so this also checks that reuse never touches
    # the committed copy.
    plan = _plan((0,), (1,), (2,))
    cfg = TrainConfig(steps=5, adapt=False, plan=plan, devices=3, seed=5, **FAST)
    tag: dict = {}
    with _workers(3) as driver:
        tr = Trainer(cfg, driver=driver)
        try:
            tr.start()

            def progress(step, m):
                if step == 3:
                    tag["actor"] = _full(tr, "actor_train")
                    driver.kill(tr.device_worker[victim_device])

            recover = tr.recover

            def recover_and_note(step, error):
                resume = recover(step, error)
                tag["after"] = {s: _full(tr, s) for s in ("actor_train", "rollout", "reference")}
                return resume

            tr.progress = progress
            tr.recover = recover_and_note
            tr.adapter.best_plan = lambda rlen, devices=None: (
                _plan((devices[0],), (devices[1],), (devices[0],)),
                0.0,
            )
            res = tr.run()
            initial = tr._initial["reference"]
        finally:
            tr.close()
    assert res.error is None, res.error
    assert [m["step"] for m in res.metrics] == [0, 1, 2, 3, 4]
    (rec,) = _recoveries(res)
    assert rec["recovery"] == "snapshot", rec
    after = tag["after"]
    # actor_train as the snapshot of step 3 held it, to the byte
    assert sorted(after["actor_train"]) == sorted(tag["actor"])
    for name, t in tag["actor"].items():
        assert torch.equal(after["actor_train"][name], t), name
    # the rollout holds actor_train's weights, the reference the initial ones
    for name, t in after["rollout"].items():
        assert torch.equal(t, tag["actor"][name]), name
    for name, t in after["reference"].items():
        assert torch.equal(t, initial[name]), name
    assert all(m.get("snapshot_s") is not None for m in res.metrics)


@pytest.mark.slow
def test_a_death_while_a_snapshot_is_taken_restores_the_committed_one_from_its_mirror():
    # actor_train's only copy is on device 2, mirrored to a buddy. Its worker dies right
    # after taking snapshot 3 (the buddy has received its mirror of 3), before replying:
    # 3 is not committed, so the run rolls back to 2, read from the buddy's mirror. Each
    # take from the third on writes into the tensors of the one it drops; a take that
    # wrote into the committed one's would lose or corrupt it here.
    plan = _plan((0,), (1,), (2,))
    cfg = TrainConfig(steps=5, adapt=False, plan=plan, devices=3, seed=5, **FAST)
    tag: dict = {}
    with _workers(3) as driver:
        tr = Trainer(cfg, driver=driver)
        try:
            tr.start()

            def progress(step, m):
                if step == 2:
                    tag["actor"] = _full(tr, "actor_train")
                    _arm(driver, tr.device_worker[2], "rl.snapshot")

            recover = tr.recover

            def recover_and_note(step, error):
                resume = recover(step, error)
                tag["after"] = _full(tr, "actor_train")
                return resume

            tr.progress = progress
            tr.recover = recover_and_note
            tr.adapter.best_plan = lambda rlen, devices=None: (
                _plan((devices[0],), (devices[1],), (devices[0],)),
                0.0,
            )
            res = tr.run()
        finally:
            tr.close()
    assert res.error is None, res.error
    assert [m["step"] for m in res.metrics] == [0, 1, 2, 3, 4]
    (rec,) = _recoveries(res)
    assert rec["recovery"] == "snapshot" and rec["rolled_back_steps"] == [3], rec
    assert sorted(tag["after"]) == sorted(tag["actor"])
    for name, t in tag["actor"].items():
        assert torch.equal(tag["after"][name], t), name


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_a_death_inside_a_steps_update_rolls_back_to_the_last_snapshot(victim):
    # actor_train dp 2: both units step, then one worker dies before replying. The
    # update is on the survivor's unit too; the step is run again from the snapshot,
    # so the optimizer steps once per step (three, not four).
    plan = _plan((0, 1), (1, 0), (0, 1))
    cfg = TrainConfig(steps=3, adapt=False, plan=plan, devices=2, seed=5, **FAST)
    with _workers(2) as driver:
        tr = Trainer(cfg, driver=driver)
        try:
            tr.start()

            def progress(step, m):
                if step == 0:
                    # victim 0: the first unit's worker; the other unit's copy serves
                    _arm(driver, tr.device_worker[victim], "rl.train")

            submit, sent = tr._rollout_submit, []

            def note(step, rlen=None):
                job = submit(step, rlen)
                sent.append((step, job["problems"]))
                return job

            tr._rollout_submit = note
            tr.progress = progress
            tr.adapter.best_plan = lambda rlen, devices=None: (
                _plan(tuple(devices), tuple(devices), tuple(devices)),
                0.0,
            )
            res = tr.run()
            adam_step = _full(tr, "actor_train")["adam_step"]
        finally:
            tr.close()
    assert res.error is None, res.error
    assert [m["step"] for m in res.metrics] == [0, 1, 2]
    (rec,) = _recoveries(res)
    assert rec["step"] == 1 and rec["recovery"] == "snapshot", rec
    assert adam_step.tolist() == [3.0]
    # step 1 was sent twice (before and after the death), with the same prompts
    again = [p for st, p in sent if st == 1]
    assert len(again) == 2 and again[0] == again[1], sent


@pytest.mark.slow
@pytest.mark.parametrize(
    "fn,when", [("rl.init", "die_after"), ("rl.init", "die_before"), ("import", "die_before")]
)
def test_a_death_during_start_up_is_recovered_from_the_initial_states(fn, when):
    # rl.init, die_before: the survivors wait in the default group's rendezvous for the
    # dead worker; the abort ends that wait at once, not at the 60 s group timeout.
    # import: the death comes as the workers learn the trainer's commands.
    plan = _plan((0,), (1,), (2,))
    cfg = TrainConfig(steps=2, adapt=False, plan=plan, devices=3, seed=5, **FAST)
    with _workers(3) as driver:
        driver.import_module("nereus_rl.trainer.worker")
        victim = sorted(driver.workers)[2]
        driver.call([victim], "import", "tests.support.worker_faults")
        driver.call([victim], f"faults.{when}", fn, {})
        tr = Trainer(cfg, driver=driver)
        try:
            tr.adapter.best_plan = lambda rlen, devices=None: (_plan((0,), (1,), (0,)), 0.0)
            t0 = time.monotonic()
            tr.start()
            started_s = time.monotonic() - t0
            res = tr.run()
        finally:
            tr.close()
    assert started_s < 30.0, started_s
    assert res.error is None, res.error
    assert [m["step"] for m in res.metrics] == [0, 1]
    (rec,) = _recoveries(res)
    assert rec["step"] == 0 and rec["recovery"] == "snapshot", rec


def _snapshot_every_third_step(tr: Trainer) -> None:
    """Snapshots every third step, whatever they would cost (as a dear one is spaced)."""
    snaps = tr.snapshots

    def every_third(plan, cluster, step_s, budget):
        snaps.interval, snaps.predicted_s = 3, 0.0
        return 3

    snaps.price = every_third


@pytest.mark.slow
def test_with_a_snapshot_every_third_step_a_death_rolls_back_and_runs_the_steps_again():
    plan = _plan((0,), (1,), (2,))
    cfg = TrainConfig(steps=6, adapt=False, plan=plan, devices=3, seed=5, **FAST)
    with _workers(3) as driver:
        tr = Trainer(cfg, driver=driver)
        try:
            tr.start()
            _snapshot_every_third_step(tr)

            def progress(step, m):
                if step == 3 and 2 in tr.device_worker:  # after step 3; committed: step 2
                    driver.kill(tr.device_worker[2])

            tr.progress = progress
            tr.adapter.best_plan = lambda rlen, devices=None: (_plan((0,), (1,), (0,)), 0.0)
            res = tr.run()
            adam_step = _full(tr, "actor_train")["adam_step"]
        finally:
            tr.close()
    assert res.error is None, res.error
    assert [m["step"] for m in res.metrics] == [0, 1, 2, 3, 4, 5]
    (rec,) = _recoveries(res)
    assert rec["recovery"] == "snapshot" and rec["rolled_back_steps"] == [3], rec
    assert adam_step.tolist() == [6.0]  # step 3's first update was undone
    taken = [m["step"] for m in res.metrics if m["snapshot_s"] > 0]
    assert taken == [2, 5], taken


@pytest.mark.slow
def test_a_disk_checkpoint_is_written_each_time_a_snapshot_passes_a_multiple_of_the_interval(
    tmp_path,
):
    # Snapshots every third step commit steps 2 and 5 (each recorded with the next
    # step); checkpoint_every=2 writes both, though 2 + 1 is no multiple of 2.
    plan = _plan((0,), (1,), (2,))
    every = {"checkpoint_every": 2, "checkpoint_dir": str(tmp_path)}
    cfg = TrainConfig(steps=7, adapt=False, plan=plan, devices=3, seed=5, **FAST, **every)
    with _workers(3) as driver:
        tr = Trainer(cfg, driver=driver)
        try:
            tr.start()
            _snapshot_every_third_step(tr)
            res = tr.run()
        finally:
            tr.close()
    assert res.error is None, res.error
    written = [m for m in res.metrics if "checkpoint_bytes" in m]
    assert len(written) == 2 and all(m["checkpoint_bytes"] > 0 for m in written), written
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["version"] == 5


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", [True, False], ids=["disk", "none"])
def test_a_shard_that_lost_its_holder_and_its_mirror_comes_back_from_the_disk_checkpoint(
    tmp_path, checkpoint
):
    # actor_train alone on device 2, mirrored on device 3: both die at once.
    plan = _plan((0,), (1,), (2,))
    every = {"checkpoint_every": 1, "checkpoint_dir": str(tmp_path)} if checkpoint else {}
    cfg = TrainConfig(steps=4, adapt=False, plan=plan, devices=4, seed=5, **FAST, **every)
    with _workers(4) as driver:
        tr = Trainer(cfg, driver=driver)
        tag: dict = {}
        try:
            tr.start()
            assert tr.snapshots.layouts(plan)["actor_train"][1] == [3]  # the buddy

            def progress(step, m):
                if step == 0:  # on disk as the next step begins
                    tag["actor"] = _full(tr, "actor_train")
                if step == 1 and 2 in tr.device_worker:  # step 1's copies die with them
                    driver.kill(tr.device_worker[2])
                    driver.kill(tr.device_worker[3])

            recover = tr.recover

            def recover_and_note(step, error):
                resume = recover(step, error)
                tag["after"] = _full(tr, "actor_train")
                return resume

            tr.progress = progress
            tr.recover = recover_and_note
            tr.adapter.best_plan = lambda rlen, devices=None: (_plan((0,), (1,), (0,)), 0.0)
            if not checkpoint:  # the state is gone from memory: a clear error
                with pytest.raises(SnapshotLostError, match=r"mirror on worker \d+; both are lost"):
                    tr.run()
                return
            res = tr.run()
        finally:
            tr.close()
    assert res.error is None, res.error
    assert [m["step"] for m in res.metrics] == [0, 1, 2, 3]
    (rec,) = _recoveries(res)
    assert rec["recovery"] == "snapshot" and rec["from_disk"].endswith("checkpoint.pt"), rec
    assert rec["rolled_back_steps"] == [1], rec  # step 0's checkpoint: step 1 runs again
    for name, t in tag["actor"].items():
        assert torch.equal(tag["after"][name], t), name
    written = [m["checkpoint_bytes"] for m in res.metrics if "checkpoint_bytes" in m]
    assert len(written) >= 2 and all(n > 0 for n in written), written
