"""bench_e2e's model check: phases from a step's metrics, rank agreement, the 5% test."""

from __future__ import annotations

import math

from benchmarks.lib.e2e_model_error import mean_phases, measured_phases, spearman, summarize


def test_measured_phases_rest_is_what_no_phase_holds():
    m = {"step_s": 1.0, "sync_s": 0.1,
         "stage_s": {"rollout": 0.3, "inference": 0.2, "reward": 0.05, "train": 0.25}}  # fmt: skip
    ph = measured_phases(m)
    assert ph["gen"] == 0.4 and ph["infer"] == 0.25 and ph["train"] == 0.25
    assert math.isclose(ph["rest"], 0.1)
    avg = mean_phases([m, {**m, "step_s": 2.0}])
    assert math.isclose(avg["total"], 1.5) and math.isclose(avg["rest"], 0.6)


def test_spearman_orders():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert spearman([1, 2, 3, 4], [40, 30, 20, 10]) == -1.0
    assert math.isnan(spearman([1, 2], [2, 1]))


def _row(v, pred, meas):
    return {"variant": v, "predicted": {"total": pred}, "measured": {"total": meas}}


def test_summarize_pick_within_5pct_or_not():
    rows = [_row("a", 0.10, 0.30), _row("b", 0.20, 0.20), _row("c", 0.30, 0.40)]
    s = summarize(rows)
    assert s["pick"] == "a" and s["best"] == "b" and s["best_rank_by_model"] == 2
    assert math.isclose(s["pick_vs_best_x"], 1.5) and not s["pick_within_5pct"]
    rows[0]["measured"]["total"] = 0.205
    s = summarize(rows)
    assert s["best"] == "b" and s["pick_within_5pct"]
