"""The run folder's logs for the tools people use: TensorBoard event files (read back
with TensorBoard's own EventAccumulator), Weights & Biases in offline mode (its run file
read back record by record), and the plots' layout panel drawn from a plans.jsonl. No
processes: the rows are a run's as the trainer writes them."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from nereus_rl.cli import main
from nereus_rl.core.globalplan import GlobalPlan, StagePlan
from nereus_rl.trainer.config import TrainConfig, check_config, simple_plan
from nereus_rl.trainer.report import RunLog, latency_figure, read_plans
from nereus_rl.trainer.tracking import MEASURED_STEP, WandbMissingError, scalars
from nereus_rl.trainer.trainer import TrainResult


def _row(step: int) -> dict:
    """A metrics.jsonl row with each kind of field the trainer writes."""
    return {
        "reward_mean": 0.1 * step + 1 / 3, "reward_exact": 0.25, "kl": 0.0123 * step,
        "loss": -0.06428134441375732 + step, "critic_loss": None,
        "response_tokens_mean": 4.125,
        "stage_s": {"rollout": 0.0098 + step, "reward": 1e-4, "inference": 0.0077,
                    "train": 0.0109},
        "inference_work_s": {"reference": 0.0038},
        "held_bytes_max": 1610756, "sync_s": 0.0083, "step": step, "response_len": 6 + step,
        "prompt_len": 9, "level": 5,
        "plan": "GlobalPlan(rollout[dp1 tp1 pp1 @ 0] | reference[dp1 tp1 pp1 @ 1])",
        "num_devices": 2, "step_s": 0.58 - 0.1 * step, "head_start_s": 0.01,
        "transition_s": 0.25 if step == 1 else 0.0, "boundary_s": 0.3 if step == 1 else 0.001,
        "predicted_step_s": 0.0302, "predicted_overhead_s": 0.0046,
        "predicted_whole_s": 0.0348 * (step + 1), "peak_memory_fraction": 0.991,
        "memory_budget_bytes": 2509824, "decision_s": 0.0011,
    }  # fmt: skip


def _flat(row: dict) -> dict[str, float]:
    """Every number of a metrics.jsonl row by its name (nested: ``outer/inner``)."""
    out = {}
    for k, v in row.items():
        if isinstance(v, dict):
            out.update({f"{k}/{s}": x for s, x in v.items()})
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
            out[k] = v
    return out


def _run(tmp_path: Path, steps: int = 3, **cfg) -> list[dict]:
    """A run folder as the trainer writes it; returns metrics.jsonl's rows, as read back."""
    config = TrainConfig(steps=steps, devices=2, **cfg)
    log = RunLog(tmp_path, config)
    res = TrainResult(config)
    plans = [(0, simple_plan("grpo", 2, "disaggregated")), (2, simple_plan("grpo", 2, "colocated"))]
    for s in range(steps):
        for at, plan in plans:
            if at == s:
                res.plans.append((s, plan))
                log.plan(s, plan)
        res.metrics.append(_row(s))
        log.metrics(res.metrics[-1])
    row = {"step": 1, "signal": "seq_len", "taken": True, "reason": "pays back"}
    res.decisions.append(row)
    log.decision(row)
    log.finish(res)
    text = (tmp_path / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in text]


# ---------------------------------------------------------------- TensorBoard


def test_event_files_hold_every_metric_of_metrics_jsonl(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = _run(tmp_path)
    assert list(tmp_path.glob("events.out.tfevents.*")), "no event file in the run folder"
    ea = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    tags = ea.Tags()["scalars"]
    by_name = {t.split("/", 1)[1]: t for t in tags if t != MEASURED_STEP}
    want = set().union(*(_flat(r) for r in rows))
    assert set(by_name) == want, "an event tag per number of metrics.jsonl, no other"
    for name in ("step_s", "reward_mean", "loss", "kl", "predicted_whole_s", "transition_s",
                 "held_bytes_max", "stage_s/rollout", "prompt_len"):  # fmt: skip
        assert name in by_name
    assert by_name["step_s"] == "time/step_s" and by_name["kl"] == "kl/kl"
    assert by_name["reward_mean"].startswith("reward/")
    assert by_name["held_bytes_max"].startswith("memory/")
    for name, tag in by_name.items():
        events = ea.Scalars(tag)
        got = {e.step: e.value for e in events}
        for r in rows:
            v = _flat(r).get(name)
            if v is None:
                assert r["step"] not in got, (tag, r["step"])
                continue
            # TensorBoard keeps a scalar as a float32: equal to the metric so rounded
            assert got[r["step"]] == float(np.float32(v)), (tag, r["step"], got, v)
    # predicted vs measured: the step as the model prices it, beside the prediction
    measured = {e.step: e.value for e in ea.Scalars(MEASURED_STEP)}
    for r in rows:
        assert measured[r["step"]] == pytest.approx(r["step_s"] + r["head_start_s"], rel=1e-6)
    # plan changes and decisions as text
    assert {"plan/text_summary", "decision/text_summary"} <= set(ea.Tags()["tensors"])
    assert [e.step for e in ea.Tensors("plan/text_summary")] == [0, 2]


def test_scalars_leave_out_what_is_not_a_number():
    got = scalars({"step": 3, "plan": "x", "critic_loss": None, "kl": float("nan"), "ok": True})
    assert got == {}
    got = scalars({"step": 3, "step_s": 2.0, "stage_s": {"train": 1.0, "x": None}})
    assert got == {"time/step_s": 2.0, "time/stage_s/train": 1.0, MEASURED_STEP: 2.0}


# ---------------------------------------------------------------- Weights & Biases


def _wandb_records(path: Path):
    """The records of a W&B run file: a 7-byte header, then LevelDB-style log blocks of
    32 KiB holding chunks (crc32 4, length 2, type 1: full, first, middle, last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, out, part = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        part = chunk if kind in (1, 2) else part + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(part)
            out.append(rec)
            part = b""
    return out


def test_wandb_offline_run_holds_the_same_metrics(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed")
    monkeypatch.setenv("WANDB_MODE", "offline")  # never the network
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    rows = _run(tmp_path, wandb=True, wandb_project="nereus-test")
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    want = [r["step"] for r in rows]
    # W&B's service process writes the file: on a loaded machine its last records can
    # land after finish() has returned, so the file is read until they are there.
    deadline = time.monotonic() + 60.0
    while True:
        history = {}
        for rec in _wandb_records(runs[0]):
            if rec.WhichOneof("record_type") == "history":
                items = {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in rec.history.item
                }
                if "_step" in items and any(k.startswith("time/") for k in items):
                    history[items["_step"]] = items
        if sorted(history) == want or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert sorted(history) == want
    for r in rows:
        assert {k: history[r["step"]][k] for k in scalars(r)} == scalars(r)  # exact (JSON)


def test_wandb_asked_for_but_not_installed_is_a_clear_error(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(WandbMissingError, match="pip install wandb"):
        check_config(TrainConfig(wandb=True))
    assert main(["train", "--wandb", "--steps", "1"]) == 2  # before any process starts
    assert "pip install wandb" in capsys.readouterr().err


# ---------------------------------------------------------------- the layout panel


def _plan(dp: int, tp: int, first: int = 0) -> GlobalPlan:
    n = tp
    units = tuple(tuple(range(first + u * n, first + (u + 1) * n)) for u in range(dp))
    rest = first + dp * n
    return GlobalPlan(
        (
            StagePlan("rollout", "actor", False, dp, tp, 1, units),
            StagePlan("reference", "reference", False, 1, 1, 1, ((rest % 4,),)),
            StagePlan("actor_train", "actor", True, dp, tp, 1, units),
        )
    )


def test_layout_panel_is_drawn_from_plans_jsonl(tmp_path):
    cfg = TrainConfig(steps=6, devices=4)
    log = RunLog(tmp_path, cfg)
    res = TrainResult(cfg)
    for step, plan in ((0, _plan(1, 2)), (3, _plan(2, 1)), (5, _plan(1, 2, first=2))):
        res.plans.append((step, plan))
        log.plan(step, plan)
    for s in range(6):
        res.metrics.append(_row(s))
        log.metrics(res.metrics[-1])
    log.finish(res)
    plans = read_plans(tmp_path)
    assert [s for s, _ in plans] == [0, 3, 5]
    assert plans[1][1][0] == {
        "stage": "rollout", "model": "actor", "trains": False, "dp": 2, "tp": 1, "pp": 1,
        "units": [[0], [1]],
    }  # fmt: skip
    fig = latency_figure(res.metrics, [], plans)
    try:
        titles = [a.get_title() for a in fig.axes]
        assert titles[0].startswith("step latency") and titles[1] == "response length"
        panel = fig.axes[2]
        assert "stage layouts" in titles[2] and "devices" in titles[2]
        assert panel.get_xlabel() == "RL step" and "devices" in panel.get_ylabel()
        assert [t.get_text() for t in panel.get_yticklabels()] == [
            "rollout", "reference", "actor_train",
        ]  # fmt: skip
        notes = [t.get_text() for t in panel.texts]
        # each stage's layout and devices where they start or change (the reference's
        # devices: 2, 2 (no note), then 0)
        assert notes.count("dp1 tp2 pp1 @ 0-1") == 2  # rollout, actor_train at step 0
        assert notes.count("dp2 tp1 pp1 @ 0-1") == 2  # at step 3
        assert notes.count("dp1 tp2 pp1 @ 2-3") == 2  # at step 5
        assert "dp1 tp1 pp1 @ 2" in notes and "dp1 tp1 pp1 @ 0" in notes
        # a cell per (stage, device, plan): 2+1+2 devices in each of the three plans
        assert sum(len(c.get_paths()) for c in panel.collections) == 15
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    assert (tmp_path / "latency_plan.png").stat().st_size > 1000


def test_plans_written_before_the_stages_field_still_draw(tmp_path):
    old = "GlobalPlan(rollout[dp2 tp1 pp1 @ 0-1] | reference[dp1 tp1 pp1 @ 3])"
    (tmp_path / "plans.jsonl").write_text(json.dumps({"step": 0, "plan": old}) + "\n")
    plans = read_plans(tmp_path)
    assert plans == [
        (0, [{"stage": "rollout", "dp": 2, "tp": 1, "pp": 1, "units": [[0, 1]]},
             {"stage": "reference", "dp": 1, "tp": 1, "pp": 1, "units": [[3]]}]),
    ]  # fmt: skip
    fig = latency_figure([_row(0), _row(1)], [], plans)
    assert len(fig.axes) == 3
    import matplotlib.pyplot as plt

    plt.close(fig)
