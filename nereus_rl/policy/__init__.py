"""The decision policy: when to change the plan, and to which.

:mod:`.controller` turns a run's measurements into signals and triggers;
:mod:`.lookahead` chooses among candidate plans over the forecast lengths;
:mod:`.admission` weighs a move's saving against its cost; :mod:`.decide` walks one
boundary's steps; :mod:`.start_plan` and :mod:`.auto_budget` set a run up. Every
decision is a frozen :class:`Decision` and the outcome of a taken move an
:class:`Outcome` (:mod:`.decision`, also the schema of decisions.jsonl). Pure functions
of data: no processes, no trainer.
"""

from nereus_rl.policy.admission import Admission, AdmissionError, Verdict
from nereus_rl.policy.auto_budget import auto_budget
from nereus_rl.policy.controller import Controller, SignalError, Trigger
from nereus_rl.policy.decision import Decision, MovePrice, Outcome, Recovery
from nereus_rl.policy.lookahead import LookaheadChoice, LookaheadError, choose, choose_start
from nereus_rl.policy.start_plan import StartPlanError, choose_start_plan, start_lengths

__all__ = [
    "Admission",
    "AdmissionError",
    "Controller",
    "Decision",
    "LookaheadChoice",
    "LookaheadError",
    "MovePrice",
    "Outcome",
    "Recovery",
    "SignalError",
    "StartPlanError",
    "Trigger",
    "Verdict",
    "auto_budget",
    "choose",
    "choose_start",
    "choose_start_plan",
    "start_lengths",
]
