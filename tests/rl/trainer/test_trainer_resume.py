"""Going on from a disk checkpoint: ``resume`` continues the run that wrote it, and a
run whose survivors cannot hold it stops with its state written where ``resume`` reads it.

The resumed steps are compared, float for float, with the same steps of a run that never
stopped (same options, same plan): the checkpoint carries the trained states (weights,
Adam moments and step), and the prompts come from the run's one generator, drawn again
for the steps before the checkpoint's.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_trainer_recovery import FAST, _plan, _workers

import nereus_rl
from nereus_rl.trainer.snapshot import DiskCheckpoint, SnapshotLostError
from nereus_rl.trainer.trainer import (
    CapacityLostError,
    NotEnoughDevicesError,
    TrainConfig,
    TrainConfigError,
    Trainer,
)

OPTS = {**FAST, "calibration_probes": 0, "adapt": False, "seed": 3}


def _steps(res) -> dict[int, tuple[float, float, float]]:
    return {m["step"]: (m["reward_mean"], m["loss"], m["kl"]) for m in res.metrics}


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_a_resumed_run_goes_on_exactly_as_the_run_that_wrote_the_checkpoint(tmp_path, algo):
    # step 3's state on disk (every 4 steps), then the run goes on to step 5
    whole = nereus_rl.train(
        algo=algo, devices=2, steps=6, checkpoint_every=4, checkpoint_dir=str(tmp_path), **OPTS
    )
    assert whole.error is None, whole.error
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert saved["version"] == 3
    resumed = nereus_rl.train(
        algo=algo, devices=2, steps=6, resume=str(tmp_path / "checkpoint.pt"), **OPTS
    )
    assert resumed.error is None, resumed.error
    assert sorted(_steps(resumed)) == [4, 5]
    assert resumed.plans[0][0] == 4
    assert {s: v for s, v in _steps(whole).items() if s >= 4} == _steps(resumed)


def _checkpoint(path, version: int, states: dict) -> str:
    torch.save({"version": version, "states": states}, path)
    return str(path)


def test_a_checkpoint_that_cannot_resume_this_run_is_refused_before_anything_starts(tmp_path):
    def run(resume: str, **kw):
        return nereus_rl.train(devices=2, steps=6, resume=resume, **{**OPTS, **kw})

    with pytest.raises(TrainConfigError, match="is not a file"):
        run(str(tmp_path / "missing.pt"))
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(TrainConfigError, match="not a checkpoint torch can read"):
        run(str(tmp_path / "junk.pt"))
    bad = _checkpoint(tmp_path / "bad.pt", -1, {"actor": {}})
    with pytest.raises(TrainConfigError, match="holds no step and trained states"):
        run(bad)
    two = _checkpoint(tmp_path / "two.pt", 2, {"actor": {}, "critic": {}})
    with pytest.raises(TrainConfigError, match=r"trains \['actor'\]: resume with the algorithm"):
        run(two)
    late = _checkpoint(tmp_path / "late.pt", 5, {"actor": {}})
    with pytest.raises(TrainConfigError, match="nothing is left to run"):
        run(late)
    other = _checkpoint(tmp_path / "other.pt", 1, {"actor": {"embed.weight": torch.zeros(3, 3)}})
    with pytest.raises(TrainConfigError, match=r"'embed\.weight' is \(3, 3\) torch\.float32"):
        run(other)


@pytest.mark.slow
def test_survivors_that_cannot_hold_the_run_stop_it_with_its_state_on_disk(tmp_path):
    # Two nodes of two; the second dies after step 2, and (as the planner would say of
    # a memory budget two workers cannot meet) no plan fits the two left.
    plan = _plan((0,), (1,), (2, 3))
    opts = {**OPTS, "plan": plan, "nodes": 2, "checkpoint_dir": str(tmp_path)}
    cfg = TrainConfig(devices=4, steps=5, **opts)
    with _workers(4) as driver:
        tr = Trainer(cfg, driver=driver)
        try:
            tr.start()

            def too_few(rlen, devices=None):
                raise NotEnoughDevicesError(
                    f"{len(devices)} devices cannot hold grpo on tiny (test: no plan fits)"
                )

            def progress(step, m):
                if step == 2 and 2 in tr.device_worker:
                    driver.kill(tr.device_worker[2])
                    driver.kill(tr.device_worker[3])

            tr.progress = progress
            tr.adapter.best_plan = too_few
            with pytest.raises(CapacityLostError, match="after step 2 is saved in") as err:
                tr.run()
        finally:
            tr.close()
    path = tmp_path / "checkpoint.pt"
    assert f"resume={str(path)!r}" in str(err.value) and "from step 3" in str(err.value)
    assert torch.load(path, weights_only=True)["version"] == 2
    # On four devices again it goes on as a run that never lost any.
    whole = nereus_rl.train(devices=4, steps=5, plan=plan, nodes=2, **OPTS)
    resumed = nereus_rl.train(devices=4, steps=5, plan=plan, nodes=2, resume=str(path), **OPTS)
    assert whole.error is None and resumed.error is None, (whole.error, resumed.error)
    assert {s: v for s, v in _steps(whole).items() if s >= 3} == _steps(resumed)


def test_when_the_snapshot_cannot_be_saved_the_run_points_at_what_is_on_disk(tmp_path):
    """What the stop names when the survivors' snapshot cannot be written: the last disk
    checkpoint, else the checkpoint the run resumed from, else nothing (the trainer's
    state stands in for a run here: only what _capacity_lost reads)."""

    def lost(lost, initial):  # the holder and the mirror of a shard both died
        raise SnapshotLostError("shard 0 of 'actor_train' lost both copies")

    driver = SimpleNamespace(check_liveness=lambda: ())
    snaps = SimpleNamespace(held={"actor_train": object()}, full_states=lost,
                            group=SimpleNamespace(driver=driver))  # fmt: skip
    older = DiskCheckpoint(tmp_path / "checkpoint.pt")
    torch.save({"version": 4, "states": {}}, older.path)
    older.version = 4
    cfg = SimpleNamespace(checkpoint_dir=str(tmp_path / "new"), resume=None)
    run = SimpleNamespace(snapshots=snaps, _disk_checkpoint=older, cfg=cfg, log=None,
                          _initial={})  # fmt: skip
    run._checkpoint_dir = lambda: Trainer._checkpoint_dir(run)
    err = NotEnoughDevicesError("2 devices cannot hold grpo on tiny.")

    said = str(Trainer._capacity_lost(run, err))
    assert "after step 4 is saved in" in said and f"resume={str(older.path)!r}" in said
    assert not (tmp_path / "new" / "checkpoint.pt").exists()  # nothing half written
    run._disk_checkpoint = None
    cfg.resume = "/runs/a/checkpoint.pt"
    said = str(Trainer._capacity_lost(run, err))
    assert "could not be saved (SnapshotLostError" in said
    assert "still that of /runs/a/checkpoint.pt" in said
    cfg.resume = None
    said = str(Trainer._capacity_lost(run, err))
    assert "nothing is on disk: the run starts over" in said
    run.snapshots = None
    assert "no snapshot was taken yet" in str(Trainer._capacity_lost(run, err))
