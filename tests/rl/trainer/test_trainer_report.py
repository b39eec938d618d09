"""The run folder and summary table (no processes)."""

from __future__ import annotations

import json

from nereus_rl.trainer.report import RunLog, summary_table
from nereus_rl.trainer.trainer import TrainConfig, TrainResult, simple_plan


def _metrics(step: int) -> dict:
    return {
        "step": step, "reward_mean": 0.1 * step, "reward_exact": 0.0, "kl": 0.01,
        "loss": -0.1, "step_s": 0.5, "transition_s": 0.25 if step == 2 else 0.0,
        "response_len": 6 + step, "held_bytes_max": 2**20, "memory_budget_bytes": 2**21,
    }  # fmt: skip


def test_run_folder_keeps_lines_as_they_come_and_summarises(tmp_path):
    cfg = TrainConfig(steps=4)
    log = RunLog(tmp_path, cfg)
    res = TrainResult(cfg)
    plan = simple_plan("grpo", 4, "colocated")
    res.plans.append((0, plan))
    log.plan(0, plan)
    for s in range(3):
        res.metrics.append(_metrics(s))
        log.metrics(res.metrics[-1])
        # flushed at once: a run that dies now keeps what it logged
        assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == s + 1
    row = {"step": 1, "signal": "seq_len", "taken": True, "measured_transition_s": 0.25}
    res.decisions.append(row)
    log.decision(row)
    res.error = "WorkerLostError: worker 3 died"
    log.error(res.error)
    log.finish(res)
    text = (tmp_path / "summary.txt").read_text()
    assert "steps=3/4" in text and "stopped early" in text
    assert "0.000" in text and "0.200" in text  # reward first and last quarter
    assert "decisions (taken)             1 (1)" in text
    assert json.loads((tmp_path / "decisions.jsonl").read_text())["signal"] == "seq_len"
    assert (tmp_path / "latency_plan.png").stat().st_size > 1000
    assert (tmp_path / "reward_kl.png").stat().st_size > 1000
    assert summary_table(res).startswith("nereus-rl grpo tiny")
