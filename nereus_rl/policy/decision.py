"""The adaptation loop's records: what the policy decided at a boundary (:class:`Decision`)
and what the trainer did with a taken move (:class:`Outcome`).

The policy returns a frozen Decision; the trainer executes a taken move and reports an
Outcome; one row of a run's ``decisions.jsonl`` is ``decision.to_row(outcome)``. This
docstring is the schema of that file.

decisions.jsonl: one JSON object per line, one line per decision, in the order made.
Seconds are wall-clock seconds; plans are written as ``repr(GlobalPlan)``. A key marked
(opt) is absent from rows that do not carry it.

Every row:
    step (int): the step whose boundary decided; -1 for the start plan (before step 0).
    signal (str): the signal that triggered: ``seq_len``, ``devices``, ``memory``,
        ``efficiency``; ``start_plan`` for the start plan's row.
    trigger (str): the trigger's reason, one sentence.
    urgent (bool): whether the trigger is urgent (the signal crossed a hard limit).
    current (str | null): the running plan (null for the start plan).
    taken (bool): whether a move was made (the start plan's row: false, not a move).
    reason (str): why, one sentence: admission's reason, or why no move was priced.
    measured_transition_s (float | null): the move's measured seconds (null: no move).
Decided rows (every row but the one of a search where no plan fits):
    path (str): ``urgent`` (the running plan cannot run the next step),
        ``opportunistic``, or ``start``.
    predicted_saving_s (float | null): predicted seconds per step the candidate saves
        over the running plan (0.0 when nothing was moved to; null on a recovery).
    predicted_transition_s (float | null): the move's predicted seconds as admission
        prices it (calibrated, floored; 0.0 when nothing was moved to; null on a
        recovery).
(opt) candidate (str): the plan compared with the running one (the chosen plan).
(opt) step_noise_s (float | null): the running plan's measured step-to-step scatter in
    seconds per step (null: not measured yet); savings within it are declined.
The model the candidates were ranked with (rows of a search):
    overhead_a_s, overhead_b_s_per_call (float): the fitted unpriced rest per step and
        per worker call, seconds; overhead_obs (int): steps it was fitted on.
    shape_ratio ({str: float}): measured/priced ratio per stage shape
        ("stage dpN tpN ppN"); shape_regime_factor (float): the run's regime against
        the startup probes'.
Lookahead (rows where it ran; see :class:`nereus_rl.policy.lookahead.LookaheadChoice`):
    lookahead_lengths ([int]), lookahead_horizon (int), lookahead_rank (int),
    lookahead_fallback (bool), lookahead_score_s, lookahead_old_score_s (float, seconds
    over the horizon), lookahead_old_over_at, lookahead_over_at,
    lookahead_current_over_at (int | null: horizon index where that plan goes over
    memory), lookahead_scored (int), lookahead_reason (str; also alone when lookahead
    could not run: why), lookahead_forced_move_s (float | null: seconds of the move a
    crossing forces; null when no plan holds the length).
Admission's pricing of a move (rows that priced one; :class:`MovePrice`):
    forecast_steps (float): steps the saving is counted over (the trigger's forecast
        capped by the steps left and the candidate's crossing); signal_forecast_steps
        (float): the trigger's own forecast; steps_left (int): steps after this boundary;
    predicted_transition_model_s (float): the cost model's price of the move;
    transition_excess_s (float): the measured excess added to it; transition_floor_s
        (float): the least a move of that many primitives has measured;
    model_tolerance (float): the cost model's recent relative error; tie_margin (float):
        the relative band within which lookahead calls scores tied;
    predicted_forced_move_s (float): seconds of a later move the candidate's crossing
        forces (included in predicted_transition_s);
    primitives ([str]): the move's DAG as "kind:stage"; (opt) dag_note (str): why no
        DAG was compiled (the move is then priced as a per-stage reshard).
The outcome of a taken move (:class:`Outcome`):
    interrupted (bool | str | null): a move: whether a worker death cut it short; a
        recovery: the change a death cut short (null: none).
    cut short: cause (str): the error's first line; lost_workers ([int]).
    completed: bytes_moved (int), executed_primitives ([str] "kind:stage"),
        primitive_s (float), rebind_s (float), fallbacks (int), fallback_stages
        ({stage: why}), (opt) execution (str: the executor's report),
        costmodel_primitives_observed (int), costmodel_p2p_efficiency (float),
        (opt) costmodel_feedback_error (str).
    recovery (``signal: devices``, after a worker died): cause (str), unsound_units,
        adopted_units ([str]), recovery (``emu`` or ``reshard``), recovery_fallback
        (str | null), recovery_rounds ([{lost_devices, joined, error, ...}]),
        executed_primitives ([str]), bytes_moved (int | null).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nereus_rl.core.globalplan import GlobalPlan


def _plan(p: GlobalPlan | None) -> str | None:
    return None if p is None else repr(p)


@dataclass(frozen=True)
class MovePrice:
    """What admission weighed a move with, besides the saving (see the schema above).

    Attributes:
        forecast_steps: steps the saving was counted over.
        signal_forecast_steps: the trigger's own forecast of steps to its next crossing.
        steps_left: steps the run runs after this boundary.
        step_noise_s: the running plan's step noise (None: not measured yet).
        model_s: the cost model's price of the move (its DAG's completion time).
        excess_s: the measured excess of past moves over their price, added to it.
        floor_s: the least a move of as many primitives has measured.
        model_tolerance: the cost model's recent relative error.
        tie_margin: lookahead's relative tie band.
        forced_move_s: seconds of the later move the candidate's crossing forces.
        primitives: the DAG's primitives as ``"kind:stage"``.
        dag_note: why no DAG was compiled (None: it was).
    """

    forecast_steps: float
    signal_forecast_steps: float
    steps_left: int
    step_noise_s: float | None
    model_s: float
    excess_s: float
    floor_s: float
    model_tolerance: float
    tie_margin: float
    forced_move_s: float
    primitives: tuple[str, ...]
    dag_note: str | None = None

    def record(self) -> dict[str, Any]:
        row = {
            "forecast_steps": self.forecast_steps,
            "signal_forecast_steps": self.signal_forecast_steps,
            "steps_left": self.steps_left,
            "step_noise_s": self.step_noise_s,
            "predicted_transition_model_s": self.model_s,
            "transition_excess_s": self.excess_s,
            "transition_floor_s": self.floor_s,
            "model_tolerance": self.model_tolerance,
            "tie_margin": self.tie_margin,
            "predicted_forced_move_s": self.forced_move_s,
            "primitives": list(self.primitives),
        }
        if self.dag_note:
            row["dag_note"] = self.dag_note
        return row


@dataclass(frozen=True)
class Decision:
    """One decision of the adaptation loop (see the module docstring for its row).

    Attributes:
        step: the boundary's step (-1: the start plan).
        signal, trigger, urgent: the trigger that prompted it (the most urgent one).
        current: the running plan (None: the start plan).
        taken: whether to move to ``candidate``.
        reason: why, one sentence.
        path: ``"urgent"``, ``"opportunistic"`` or ``"start"``; None when no plan fits
            (nothing was priced: the row then has no path nor predictions).
        candidate: the plan compared with the running one (None: none was).
        predicted_saving_s: seconds per step the candidate saves (None: not priced).
        predicted_transition_s: the move's price as admission weighed it.
        step_noise_s: the noise a saving was compared with, where no move was priced.
        candidates: the plans the search ranked for the next step, with their predicted
            step seconds, fastest first (not written to the row: it says which was
            chosen and why).
        model: the record of the model the candidates were ranked with (the measured
            overhead and stage-shape ratios).
        lookahead: the lookahead's record (None: it did not run).
        lookahead_note: why the lookahead could not run (None: it ran or was not asked).
        move: admission's pricing of the move (None: no move was priced).
    """

    step: int
    signal: str
    trigger: str
    urgent: bool
    current: GlobalPlan | None
    taken: bool
    reason: str
    path: str | None = None
    candidate: GlobalPlan | None = None
    predicted_saving_s: float | None = 0.0
    predicted_transition_s: float | None = 0.0
    step_noise_s: float | None = None
    candidates: tuple[tuple[GlobalPlan, float], ...] = ()
    model: Mapping[str, Any] | None = None
    lookahead: Mapping[str, Any] | None = None
    lookahead_note: str | None = None
    move: MovePrice | None = None

    def to_row(self, outcome: Outcome | None = None) -> dict[str, Any]:
        """The decisions.jsonl row of this decision and, for a taken move, its outcome."""
        row: dict[str, Any] = {
            "step": self.step,
            "signal": self.signal,
            "trigger": self.trigger,
            "urgent": self.urgent,
            "current": _plan(self.current),
        }
        if self.candidate is not None:
            row["candidate"] = repr(self.candidate)
        row["measured_transition_s"] = None
        if self.model:
            row.update(self.model)
        if self.lookahead is not None:
            row.update(self.lookahead)
        elif self.lookahead_note:
            row["lookahead_reason"] = self.lookahead_note
        row["taken"] = self.taken
        row["reason"] = self.reason
        if self.path is not None:
            row["path"] = self.path
            row["predicted_saving_s"] = self.predicted_saving_s
            row["predicted_transition_s"] = self.predicted_transition_s
        if self.move is not None:
            row.update(self.move.record())
        elif self.step_noise_s is not None:
            row["step_noise_s"] = self.step_noise_s
        if outcome is not None:
            row.update(outcome.record())
        return row

    def __repr__(self) -> str:
        verdict = "TAKE" if self.taken else "KEEP"
        return f"Decision(step {self.step} {self.signal} {self.path}: {verdict}: {self.reason})"


@dataclass(frozen=True)
class Recovery:
    """How the state was rebuilt after a worker died (the outcome of a recovery).

    Attributes:
        unsound_units, adopted_units: units found broken, and units kept as they were.
        method: ``"emu"`` (EMU primitives) or ``"reshard"`` (per-stage reshard).
        fallback: why the reshard was used (None: it was not).
        rounds: one record per recovery round (lost devices, joined workers, error).
    """

    unsound_units: tuple[str, ...]
    adopted_units: tuple[str, ...]
    method: str
    fallback: str | None
    rounds: tuple[Mapping[str, Any], ...]


@dataclass(frozen=True)
class Outcome:
    """What the trainer did with a taken move (see the module docstring for its keys).

    Attributes:
        measured_s: the move's wall-clock seconds (up to the cut, when cut short).
        interrupted: a move: whether a worker death cut it short; a recovery: the
            change a death cut short (None: none).
        cause: the error that cut it short, or that a recovery answered.
        lost_workers: the workers that error named.
        bytes_moved: bytes sent between workers.
        executed_primitives: ``"kind:stage"`` of each primitive run live.
        primitive_s, rebind_s: seconds of the live primitives; of rebuilding the models.
        fallback_stages: stages moved by a per-stage reshard instead, and why.
        execution: the executor's report (None: nothing ran live).
        learned: what the cost model learned from the move
            (``costmodel_primitives_observed``, ``costmodel_p2p_efficiency``,
            ``costmodel_feedback_error``).
        recovery: set on a recovery's outcome.
    """

    measured_s: float
    interrupted: bool | str | None = False
    cause: str | None = None
    lost_workers: tuple[int, ...] = ()
    bytes_moved: int | None = None
    executed_primitives: tuple[str, ...] = ()
    primitive_s: float | None = None
    rebind_s: float | None = None
    fallback_stages: Mapping[str, str] = field(default_factory=dict)
    execution: str | None = None
    learned: Mapping[str, Any] = field(default_factory=dict)
    recovery: Recovery | None = None

    @property
    def status(self) -> str:
        """``"recovered"``, ``"interrupted"``, ``"fell back"`` (some stage moved by a
        per-stage reshard) or ``"executed"``."""
        if self.recovery is not None:
            return "recovered"
        if self.interrupted:
            return "interrupted"
        return "fell back" if self.fallback_stages else "executed"

    def record(self) -> dict[str, Any]:
        row: dict[str, Any] = {"measured_transition_s": self.measured_s}
        if self.recovery is not None:
            r = self.recovery
            row.update(
                cause=self.cause,
                interrupted=self.interrupted,
                unsound_units=list(r.unsound_units),
                adopted_units=list(r.adopted_units),
                recovery=r.method,
                recovery_fallback=r.fallback,
                recovery_rounds=[dict(x) for x in r.rounds],
                executed_primitives=list(self.executed_primitives),
                bytes_moved=self.bytes_moved,
            )
            return row
        row["interrupted"] = self.interrupted
        if self.interrupted:
            row.update(cause=self.cause, lost_workers=list(self.lost_workers))
            return row
        row.update(
            bytes_moved=self.bytes_moved,
            executed_primitives=list(self.executed_primitives),
            primitive_s=self.primitive_s,
            rebind_s=self.rebind_s,
            fallbacks=len(self.fallback_stages),
            fallback_stages=dict(self.fallback_stages),
        )
        if self.execution is not None:
            row["execution"] = self.execution
        row.update(self.learned)
        return row
