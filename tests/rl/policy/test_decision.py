"""The Decision and Outcome records and their decisions.jsonl rows (policy.decision)."""

from __future__ import annotations

import dataclasses

import pytest

from nereus_rl.policy.decision import Decision, MovePrice, Outcome, Recovery
from nereus_rl.trainer.config import simple_plan


def _decision(**kw) -> Decision:
    base = dict(step=3, signal="memory", trigger="over", urgent=True,
                current=simple_plan("grpo", 4, "colocated"), taken=True, reason="must",
                path="urgent", candidate=simple_plan("grpo", 4, "disaggregated"))  # fmt: skip
    base.update(kw)
    return Decision(**base)


BASE = {"step", "signal", "trigger", "urgent", "current", "taken", "reason",
        "measured_transition_s"}  # fmt: skip


def test_a_decision_is_frozen_and_its_row_names_the_plans():
    d = _decision()
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.taken = False  # type: ignore[misc]
    row = d.to_row()
    assert row["current"] == repr(d.current) and row["candidate"] == repr(d.candidate)
    assert row["measured_transition_s"] is None and row["path"] == "urgent"
    assert set(row) == BASE | {"candidate", "path", "predicted_saving_s", "predicted_transition_s"}
    # a search where no plan fits: no path and no prices
    bare = _decision(taken=False, path=None, candidate=None).to_row()
    assert set(bare) == BASE


def test_a_priced_move_and_its_outcome_write_every_key_once():
    move = MovePrice(
        forecast_steps=4.0, signal_forecast_steps=9.0, steps_left=4, step_noise_s=None,
        model_s=0.1, excess_s=0.02, floor_s=0.05, model_tolerance=0.1, tie_margin=0.1,
        forced_move_s=0.0, primitives=("extend:rollout", "destroy:rollout"),
    )  # fmt: skip
    d = _decision(move=move, predicted_saving_s=0.01, predicted_transition_s=0.12)
    done = Outcome(
        measured_s=0.2, bytes_moved=10, executed_primitives=("extend:rollout",),
        primitive_s=0.1, rebind_s=0.05, fallback_stages={"actor_train": "why"},
        learned={"costmodel_primitives_observed": 2, "costmodel_p2p_efficiency": 0.5},
    )  # fmt: skip
    assert done.status == "fell back"
    row = d.to_row(done)
    assert row["measured_transition_s"] == 0.2 and row["interrupted"] is False
    assert row["fallbacks"] == 1 and row["primitives"] == ["extend:rollout", "destroy:rollout"]
    assert row["step_noise_s"] is None and "dag_note" not in row and "execution" not in row
    cut = Outcome(measured_s=0.1, interrupted=True, cause="WorkerLostError: x", lost_workers=(2,))
    assert cut.status == "interrupted"
    row = d.to_row(cut)
    assert row["cause"] == "WorkerLostError: x" and row["lost_workers"] == [2]
    assert "bytes_moved" not in row


def test_a_recovery_row_has_the_recovery_keys():
    d = _decision(signal="devices", predicted_saving_s=None, predicted_transition_s=None)
    rec = Recovery(("u0",), ("u1",), "emu", None, ({"lost_devices": [1], "joined": {}},))
    out = Outcome(measured_s=1.0, interrupted=None, cause="lost", bytes_moved=5,
                  executed_primitives=("extend:rollout",), recovery=rec)  # fmt: skip
    assert out.status == "recovered"
    row = d.to_row(out)
    assert set(row) == BASE | {
        "candidate", "path", "cause", "interrupted", "unsound_units", "adopted_units",
        "recovery", "recovery_fallback", "recovery_rounds", "executed_primitives",
        "bytes_moved", "predicted_saving_s", "predicted_transition_s",
    }  # fmt: skip
    assert row["predicted_saving_s"] is None and row["recovery"] == "emu"
