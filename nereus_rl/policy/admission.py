"""Payback admission: decide whether to move from the current plan to a candidate.

Two paths:
    * urgent: the current plan cannot run (no plan yet, it uses devices that are gone,
      or its predicted peak memory exceeds a device's capacity under the current
      workload). The candidate is taken at once, whatever the transition costs,
      provided the candidate itself can run.
    * opportunistic: the current plan runs but the candidate is predicted faster. It is
      taken only when ``saving per step x forecast steps >= transition cost``, where the
      forecast is the number of steps until the triggering signal next crosses a
      threshold (after which the planner will be asked again, so savings beyond it
      cannot be counted on; the trainer caps it at the steps its run has left), and the
      saving per step exceeds the measured step noise (``noise_s``; none is taken
      before the current plan's noise is measured, ``noise_s=None``). When the length
      forecast says the candidate goes over memory ``over_in_steps`` steps after the
      move, sooner than the current plan would, the candidate is priced with the move it
      will force: its saving counts only until then, and that move's predicted cost is
      added to the transition's (``forced_move_s``). Without this, a candidate that is
      faster for the next step only (the one the urgent path's lookahead avoided) looks
      like a bargain over a long flat forecast and is taken, and the urgent move follows
      a step or two later.

Every call returns a :class:`Verdict` holding its inputs and its reason, and
``Admission.history`` keeps them, so a run can explain each transition it made or
declined.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from nereus_rl.core.globalplan import GlobalPlan, fmt_bytes
from nereus_rl.core.workload import Workload
from nereus_rl.costmodel.costmodel import CostModel

TransitionCost = float | Callable[[GlobalPlan | None, GlobalPlan], float]


class AdmissionError(ValueError):
    """Bad input to admission (negative cost or forecast)."""


@dataclass(frozen=True)
class Verdict:
    """One admission decision with everything it was based on.

    Attributes:
        taken: whether to execute the transition.
        path: ``"urgent"`` or ``"opportunistic"``.
        reason: one sentence a person can read.
        trigger: the signal that prompted the decision (free text, may be None).
        current_latency_s: predicted step latency of the current plan (None: no plan).
        candidate_latency_s: predicted step latency of the candidate.
        saving_per_step_s: current minus candidate (0 on the urgent path without a plan).
        forecast_steps: steps until the trigger next crosses its threshold.
        transition_cost_s: predicted transition completion time.
        payback_steps: steps needed to repay the transition (inf if no saving).
        over_in_steps: steps after the move until the length forecast says the
            candidate goes over memory, when that is sooner than the current plan
            (None: not priced so; ``forecast_steps`` is then capped at it).
        forced_move_s: predicted cost of the move that crossing forces (included in
            ``transition_cost_s``; 0 when none).
        problems: why the current plan cannot run (urgent path), else empty.
        current, candidate: the plans.
    """

    taken: bool
    path: str
    reason: str
    trigger: str | None
    current_latency_s: float | None
    candidate_latency_s: float
    saving_per_step_s: float
    forecast_steps: float
    transition_cost_s: float
    payback_steps: float
    problems: tuple[str, ...]
    current: GlobalPlan | None
    candidate: GlobalPlan
    over_in_steps: int | None = None
    forced_move_s: float = 0.0

    def __repr__(self) -> str:
        verdict = "TAKE" if self.taken else "DECLINE"
        return f"Verdict({verdict} {self.path}: {self.reason})"


class Admission:
    """The payback admission rule over one cost model.

    Arguments:
        costmodel: prices both plans under the workload given to :meth:`decide`.
    """

    def __init__(self, costmodel: CostModel) -> None:
        self.costmodel = costmodel
        self.history: list[Verdict] = []

    def problems(
        self, plan: GlobalPlan | None, workload: Workload, available: Iterable[int] | None
    ) -> tuple[str, ...]:
        """Why ``plan`` cannot run now (empty when it can)."""
        if plan is None:
            return ("no current plan",)
        out = []
        if available is not None:
            lost = sorted(plan.devices - set(available))
            if lost:
                out.append(f"uses unavailable devices {lost}")
        over = self.costmodel.memory_violations(plan, workload)
        if over:
            d, b = max(over.items(), key=lambda kv: kv[1])
            cap = self.costmodel.capacity_bytes
            out.append(
                f"{len(over)} devices over memory (worst: device {d} needs "
                f"{fmt_bytes(b)} of {fmt_bytes(cap)})"
            )
        return tuple(out)

    def decide(
        self,
        current: GlobalPlan | None,
        candidate: GlobalPlan,
        workload: Workload,
        *,
        forecast_steps: float | object,
        transition_cost: TransitionCost,
        available_devices: Iterable[int] | None = None,
        trigger: str | None = None,
        candidate_over_in: int | None = None,
        current_over_in: int | None = None,
        forced_move_s: float = 0.0,
        noise_s: float | None = 0.0,
    ) -> Verdict:
        """Decide whether to move from ``current`` to ``candidate``.

        Arguments:
            current: the running plan (None before the first plan).
            candidate: the planner's proposal.
            workload: the workload both are priced under (the new signals' workload).
            forecast_steps: steps until the trigger next crosses its threshold: a number
                or a ``controller.Forecast`` (its ``steps``).
            transition_cost: predicted seconds to carry out the transition: a number or
                a callable ``(current, candidate) -> seconds`` (e.g. the transition DAG's
                predicted completion time).
            available_devices: device ids that are alive (None: all are).
            trigger: name of the signal that prompted this (kept in the record).
            candidate_over_in, current_over_in: steps after the move until the length
                forecast says the candidate (the current plan) goes over memory; None:
                it holds every forecast length. Only the opportunistic path reads them.
            forced_move_s: predicted seconds of the move the candidate's crossing would
                force (e.g. :class:`nereus_rl.policy.lookahead.LookaheadChoice.forced_move_s`).
            noise_s: the measured step-to-step scatter of the current plan's step time
                (:class:`nereus_rl.costmodel.calibration.StepNoise`); an opportunistic saving per
                step not above it is declined (0: no such guard; None: not measured yet,
                so every opportunistic move is declined: one or two steps of a fresh
                plan misprice a move severalfold, and a move taken on them tends to be
                undone).

        Returns:
            Verdict (also appended to ``history``).

        Raises:
            AdmissionError: negative forecast, transition cost, forced-move cost or
                crossing step.
        """
        steps = float(getattr(forecast_steps, "steps", forecast_steps))
        if steps < 0 or math.isnan(steps):
            raise AdmissionError(f"forecast_steps={steps} must be >= 0")
        avail = None if available_devices is None else set(available_devices)
        cost = float(
            transition_cost(current, candidate) if callable(transition_cost) else transition_cost
        )
        if cost < 0 or math.isnan(cost):
            raise AdmissionError(f"transition cost {cost} s must be >= 0")
        forced = float(forced_move_s)
        if forced < 0 or math.isnan(forced):
            raise AdmissionError(f"forced_move_s={forced} must be >= 0")
        noise = None if noise_s is None else float(noise_s)
        if noise is not None and (noise < 0 or math.isnan(noise)):
            raise AdmissionError(f"noise_s={noise} must be >= 0")
        for name, v in (("candidate_over_in", candidate_over_in),
                        ("current_over_in", current_over_in)):  # fmt: skip
            if v is not None and v < 0:
                raise AdmissionError(f"{name}={v} must be >= 0 or None")
        # The candidate forces a move that staying would not (or sooner): count its
        # saving only until then and add that move's cost (see the module doc).
        over_in = None
        if candidate_over_in is not None and (
            current_over_in is None or candidate_over_in < current_over_in
        ):
            over_in = int(candidate_over_in)
        else:
            forced = 0.0
        cand_lat = self.costmodel.step_latency(candidate, workload).total_s
        cur_problems = self.problems(current, workload, avail)
        cand_problems = self.problems(candidate, workload, avail)
        cur_lat = None
        if current is not None and not any("unavailable" in p for p in cur_problems):
            cur_lat = self.costmodel.step_latency(current, workload).total_s
        saving = (cur_lat - cand_lat) if cur_lat is not None else 0.0
        if over_in is not None and not cur_problems:
            steps = min(steps, float(over_in))
            cost += forced
        else:
            over_in, forced = None, 0.0
        payback = cost / saving if saving > 0 else math.inf

        def rec(taken: bool, path: str, reason: str) -> Verdict:
            d = Verdict(
                taken,
                path,
                reason,
                trigger,
                cur_lat,
                cand_lat,
                saving,
                steps,
                cost,
                payback,
                cur_problems,
                current,
                candidate,
                over_in,
                forced,
            )
            self.history.append(d)
            return d

        if cand_problems:
            path = "urgent" if cur_problems else "opportunistic"
            return rec(False, path, "candidate cannot run: " + "; ".join(cand_problems))
        if cur_problems:
            return rec(
                True,
                "urgent",
                "current plan cannot run (" + "; ".join(cur_problems) + f"); transition "
                f"of {cost:.3g} s taken without payback",
            )
        if current == candidate:
            return rec(False, "opportunistic", "candidate is the current plan")
        if saving <= 0:
            return rec(
                False,
                "opportunistic",
                f"candidate is not faster ({cand_lat:.4g} s vs {cur_lat:.4g} s per step)",
            )
        if noise is None:
            # The current plan has too few measured steps to say how much they scatter:
            # a saving measured against one or two of them is not known to be one.
            return rec(
                False,
                "opportunistic",
                f"saves {saving:.3g} s/step by the model, but the current plan's step noise "
                "is not measured yet (too few steps on it): not known to be a saving",
            )
        if saving <= noise:
            # The candidate's price rests on about one measurement of its shapes: a
            # saving inside the step's own scatter is not known to be one.
            return rec(
                False,
                "opportunistic",
                f"saves {saving:.3g} s/step, within the measured step noise ({noise:.3g} s "
                f"per step on the current plan): not known to be a saving",
            )
        gain = saving * steps
        horizon = (
            f" (the forecast puts the candidate over memory {over_in} step(s) after the "
            f"move, which forces another move of {forced:.3g} s, included)"
            if over_in is not None
            else ""
        )
        if gain >= cost:
            return rec(
                True,
                "opportunistic",
                f"saves {saving:.3g} s/step x {steps:.3g} steps = {gain:.3g} s >= "
                f"transition {cost:.3g} s (repaid in {payback:.3g} steps){horizon}",
            )
        return rec(
            False,
            "opportunistic",
            f"saves {saving:.3g} s/step x {steps:.3g} steps = {gain:.3g} s < "
            f"transition {cost:.3g} s (needs {payback:.3g} steps){horizon}",
        )
