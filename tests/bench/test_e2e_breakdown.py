"""bench_e2e's step-by-step breakdown of adaptive against the best fixed plan."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.lib.e2e_breakdown import print_breakdown, run_moves, run_steps


def test_steps_moves_and_loss_split(capsys):
    # 4 steps; the plan changes after step 1 (set at step 2) with a 0.3 s transition
    res = SimpleNamespace(
        plans=[(0, "A"), (2, "B")],
        metrics=[{"step_s": 1.0, "decision_s": 0.02},
                 {"step_s": 1.5, "transition_s": 0.3, "decision_s": 0.04},
                 {"step_s": 0.5, "decision_s": 0.02}, {"step_s": 0.5}],
        decisions=[
            {"signal": "start_plan", "step": -1, "path": "start", "taken": False,
             "reason": "start plan: kept"},
            {"signal": "seq_len", "step": 0, "taken": False, "reason": "declined"},
            {"signal": "memory", "step": 1, "path": "urgent", "urgent": True, "taken": True,
             "predicted_transition_s": 0.05, "measured_transition_s": 0.3, "reason": "over"},
        ],
    )  # fmt: skip
    st = run_steps(res)
    assert [x[1] for x in st] == [0, 0, 1, 1] and st[1][3] == 0.3 and st[0][3] == 0.0
    mv = run_moves(res)
    assert [m["path"] for m in mv] == ["start", "urgent"]  # the declined row is left out
    rows = [
        {"variant": "adaptive", "steps_per_repeat": [st], "moves_per_repeat": [mv],
         "plans_per_repeat": [[(0, "A"), (2, "B")]]},
        {"variant": "fix", "steps_per_repeat": [[[i, 0, 0.6, 0.0, 0.005] for i in range(4)]] * 2},
    ]  # fmt: skip
    out = print_breakdown("grpo", "sync", rows, "fix")
    # before the move: (1.0 - 0.6) + (1.5 - 0.6); the move 0.3; after: 2 x (0.5 - 0.6)
    assert out["before_first_move_s"] == pytest.approx(1.3)
    assert out["moves_s"] == pytest.approx(0.3)
    assert out["after_moves_s"] == pytest.approx(-0.2)
    # deciding: 0.08 s over the run against the fixed plan's 4 x 0.005 s of observing
    assert out["deciding_s"] == pytest.approx(0.06)
    assert st[0][4] == 0.02 and st[3][4] == 0.0
    text = capsys.readouterr().out
    assert "1.500+0.300" in text and "start: start plan: kept" in text
    assert "step 1 urgent: over (measured 0.300 s)" in text
