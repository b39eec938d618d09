"""The adaptation loop, trainer side: observe a step, ask the policy, carry out its move.

At each safe boundary (end of a synchronous step; the weight sync of an asynchronous
one) the trainer hands the step's measurements to :meth:`Adapter.boundary`, which

1. observes (:meth:`Adapter.observe`): refines the cost model from the measured stage
   times; the step's time against its prediction goes to
   :class:`~nereus_rl.costmodel.calibration.ModelTolerance` (the error below which
   lookahead calls scores tied, :meth:`Adapter.tie_margin`) and to the running plan's
   step noise; the step's residual (measured minus the model's price) to
   :class:`~nereus_rl.costmodel.step_overhead.StepOverhead`, the unpriced rest per
   worker call; its stage seconds to
   :class:`~nereus_rl.costmodel.shape_correction.ShapeCorrection`, so that a stage shape
   that ran is priced at its measured ratio to the model in every comparison of plans
   (:meth:`Adapter.priced`);
2. feeds the controller its signals for the next step (:meth:`Adapter.triggers`):
   response length (the length schedule's next value, bucketed), devices, predicted
   peak memory as a fraction of the per-worker budget, and measured / predicted step
   time;
3. on a trigger, decides (:meth:`Adapter.decide`) with the policy's steps
   (:mod:`nereus_rl.policy.decide`): the planner's best plans for the next step's
   workload, ranked as decisions price them; lookahead
   (:mod:`nereus_rl.policy.lookahead`) over the seq_len signal's own length forecast,
   so that a rising length does not force another urgent move a step or two later (on
   the opportunistic path with the running plan among the candidates, so that a plan
   faster for the next step only is not moved to); admission
   (:mod:`nereus_rl.policy.admission`: the payback rule over the trigger's forecast
   capped by the steps the run has left, savings within the running plan's step noise
   declined; or ``"always"``, the replan-on-every-trigger baseline), with the move
   priced by compiling its DAG of EMU primitives and calibrated with the moves
   measured so far (:class:`~nereus_rl.costmodel.calibration.TransitionCalibration`);
4. carries out a taken move (:func:`nereus_rl.trainer.adapt.move.execute_move`),
   which reports an :class:`~nereus_rl.policy.decision.Outcome`, and writes the
   decision's row (``Decision.to_row(outcome)``; the schema of decisions.jsonl is
   :mod:`nereus_rl.policy.decision`).

What the decisions price plans with, and the questions they ask of it (workloads,
ranking, lookahead, move prices, the first plan), is
:class:`~nereus_rl.trainer.adapt.pricing.Planning`, which the Adapter extends.

Execution (:mod:`nereus_rl.trainer.units`): the model's state lives in EMU units, and
the DAG runs through the concurrent executor with live primitives; a stage whose
primitives cannot run live falls back to one nereus_comm reshard of the whole stage
(:mod:`nereus_rl.trainer.fallback`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from nereus_rl.core.globalplan import GlobalPlan
from nereus_rl.core.workload import Workload
from nereus_rl.costmodel.overlap import own_seconds, rollout_slack
from nereus_rl.policy import decide as policy
from nereus_rl.policy.controller import SignalError, Trigger
from nereus_rl.policy.decide import OPPORTUNISTIC_POOL, OPPORTUNISTIC_RANK, SETTLED_STEPS, Settled
from nereus_rl.policy.decision import Decision, MovePrice, Outcome
from nereus_rl.policy.lookahead import LookaheadError
from nereus_rl.trainer.adapt.move import MoveHost, compile_priced, execute_move, price_move
from nereus_rl.trainer.adapt.pricing import Planning
from nereus_rl.trainer.calibrate import stage_seconds

__all__ = [
    "OPPORTUNISTIC_POOL",
    "OPPORTUNISTIC_RANK",
    "SETTLED_STEPS",
    "Adapter",
    "MoveHost",
    "StepSignals",
    "compile_priced",
    "rest_observable",
]


@dataclass(frozen=True)
class StepSignals:
    """What one boundary observed, for the controller and the decision.

    Attributes:
        response_len: the step's response length limit.
        next_len: the next step's.
        workload: the next step's workload.
        peak_memory_fraction: the running plan's predicted peak over the budget there.
        efficiency: measured / predicted step seconds (None: no prediction).
    """

    response_len: int
    next_len: int
    workload: Workload
    peak_memory_fraction: float
    efficiency: float | None


def rest_observable(plan: GlobalPlan, workload, est, cluster) -> bool:
    """Whether a measured step of ``plan`` shows the driver's rest (``step_overhead``):
    a synchronous step always; an asynchronous one only when its chain of stages ends
    no sooner than the rollout sent ahead (``est``, the stages' price, says which).

    A step whose rollout ends after its chain says nothing of the rest the chain held:
    fed to the fit, it would price the rest near 0 and make a plan whose chain is the
    whole step look as cheap as one whose rollout hides it. The startup probes, which
    run a step's phases one after another, always show it.
    """
    if not workload.rollout_ahead:
        return True
    secs = {k: v.seconds for k, v in est.stages.items()}
    return rollout_slack(plan, workload, secs, est.sync_s, cluster) <= 0.0


class Adapter(Planning):
    """The trainer side of the adaptation loop of one run (see the module docstring).

    Arguments: as :class:`~nereus_rl.trainer.adapt.pricing.Planning` takes them.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # the last opportunistic search that kept the running plan (decide.settled)
        self.settled: Settled | None = None

    def record(self, decision: Decision, outcome: Outcome | None = None) -> None:
        """Write ``decision`` (and the outcome of its move) as a decisions.jsonl row."""
        self.host.log_decision(decision.to_row(outcome))

    # -------------------------------------------------------------- the boundary

    def boundary(self, step: int, m: dict[str, Any]) -> dict[str, Any]:
        """Observe step ``step``'s metrics; maybe change the plan before step ``step + 1``.

        Returns:
            Extra metrics for the step (signals, ``transition_s``).

        Raises:
            WorkerLostError, WorkerTimeoutError, RemoteError: a worker died during a
                taken move (its row is logged first, ``interrupted``).
        """
        plan = self.host.plan
        out, sig = self.observe(step, m, plan)
        if not self.enabled:
            return out
        if self.start_decision is not None:  # the start plan's (after the calibration)
            self.record(self.start_decision)
            self.start_decision = None
        triggers = self.triggers(step, plan, sig)
        if not triggers:
            return out
        decision, dag, raw_cost = self.decide(step, plan, sig, triggers)
        if not decision.taken:
            self.record(decision)
            return out
        outcome, error = execute_move(
            self.host, self.cm, self.mspec, self.calibration, plan, decision.candidate, dag,
            step, raw_cost,
        )  # fmt: skip
        self.record(decision, outcome)
        if error is not None:  # the trainer's recovery goes on from it
            raise error
        self.controller.plan_changed()
        out["transition_s"] = outcome.measured_s
        return out

    def observe(self, step: int, m: dict[str, Any], plan: GlobalPlan):
        """Refine the models from step ``step``'s metrics ``m`` on ``plan``.

        Returns:
            The step's extra metrics (predictions, memory) and its :class:`StepSignals`.
        """
        cfg = self.cfg
        # priced at the batch's padded prompt width: the work that ran
        wl_now = self.workload(m["response_len"], m.get("prompt_len"))
        measured = stage_seconds(cfg.algo, m, worker_inference=cfg.mode == "async")
        if wl_now.rollout_ahead and step == 0:
            # the first async step waits for its own rollout: not the steady state the
            # overlapped price is for, so its whole step is priced phase after phase
            wl_now = replace(wl_now, rollout_ahead=False)
        # the stages' price with the measured shapes' ratios (as plans are ranked)
        est = self.priced().stage_price(plan, wl_now)
        predicted = est.total_s
        if wl_now.rollout_ahead:
            # stages measured beside the rollout: their own time refines the model
            measured = own_seconds(plan, wl_now, measured, est, self.cm.cluster)
        # the step as a whole: the stages' price and the measured unpriced rest (an
        # async step's rest on its chain of stages, where the rollout may hide it)
        ovh = self.overhead.predict(plan)
        whole = self.priced().step_whole(plan, wl_now)
        # the step as the model prices it: its rollout sent when the step began, not
        # during the previous boundary (Trainer._run_ahead)
        step_s = m["step_s"] + m.get("head_start_s", 0.0)
        if self._refined:
            # a prediction of the model refined on earlier steps (the first step's is
            # the unrefined model's, which says nothing about the refined one's error)
            self.tolerance.observe(whole, step_s)
        if rest_observable(plan, wl_now, est, self.cm.cluster):
            self.overhead.observe(plan, predicted, step_s)
        self.noise.observe(plan, whole, step_s)
        self.shapes.observe(plan, wl_now, measured)
        try:
            self.cm.observe(plan, wl_now, measured)
            self._refined = True
        except Exception:
            pass
        # probed shapes priced under this step's conditions, as measured on this plan
        self.shapes.anchor(self.cm, plan, wl_now)
        nxt = self.response_len(step + 1)
        wl = self.workload(nxt)
        frac = max(self.cm.peak_memory(plan, wl).values()) / self.budget
        out = {
            "predicted_step_s": predicted,
            "predicted_overhead_s": ovh,
            # what the efficiency signal compares the step with (async: the rest on the
            # chain, so not always the sum of the two above)
            "predicted_whole_s": whole,
            "peak_memory_fraction": frac,
            "memory_budget_bytes": self.budget,
        }
        eff = step_s / whole if whole > 0 else None
        return out, StepSignals(m["response_len"], nxt, wl, frac, eff)

    def triggers(self, step: int, plan: GlobalPlan, sig: StepSignals) -> list[Trigger]:
        """The controller's triggers for the next step (at step 0 the urgent ones only:
        the first values set the signals' levels)."""
        triggers = self.controller.update(
            step,
            seq_len=sig.next_len,
            current_seq_len=sig.response_len,
            available_devices=self._devices(),
            in_use=plan.devices,
            peak_memory_fraction=sig.peak_memory_fraction,
            efficiency_ratio=sig.efficiency,
        )
        if step == 0:
            triggers = [t for t in triggers if t.urgent]
        return triggers

    def decide(self, step: int, plan: GlobalPlan, sig: StepSignals, triggers: list[Trigger]):
        """The Decision of the boundary after ``step`` on ``triggers`` (the policy's steps,
        :mod:`nereus_rl.policy.decide`).

        Returns:
            (the Decision, the move's DAG or None, the model's price of the move).
        """
        trig = max(triggers, key=lambda t: t.urgent)
        avail = self._devices()
        urgent = bool(self.admission.problems(plan, sig.workload, avail))
        always = self.cfg.admission == "always"
        if not urgent and not always:
            if not self.noise.known(plan):
                steps_on = self.noise.steps(plan)
                d = policy.noise_unmeasured(step, trig, plan, steps_on, self.noise.min_steps)
                return d, None, 0.0
            pm = self.priced()
            d = policy.settled(
                step, plan, sig.workload, triggers, self.settled, pm.step_total, self.tie_margin()
            )
            if d is not None:
                return d, None, 0.0
        self.settled = None
        d, dag, raw_cost = self._search(step, plan, trig, sig, urgent, avail)
        if not d.taken and d.path is not None and not urgent and not always:
            # an opportunistic search that found plans and kept the running one
            # (decide.settled)
            self.settled = Settled(
                plan, sig.workload, step, self.priced().step_total(plan, sig.workload)
            )
        return d, dag, raw_cost

    def _search(
        self, step: int, plan: GlobalPlan, trig: Trigger, sig: StepSignals, urgent: bool, avail
    ):
        """Rank the plans for the next step, choose among them with lookahead, and price
        the move to the choice (see :meth:`decide`)."""
        always = self.cfg.admission == "always"
        # Steps that run after this boundary: no saving is counted, and no length looked
        # ahead to, past the run's end
        steps_left = self.cfg.steps - (step + 1)
        try:
            k = policy.search_size(urgent, always)
            scored = self.ranked_plans(sig.next_len, devices=avail, k=k)
        except ValueError as e:  # nothing fits: keep running the current plan
            return policy.no_plan_fits(step, trig, plan, e), None, 0.0
        ranked = [p for _, p in scored]
        cand, la, la_note = ranked[0], None, None
        if not urgent and not always and cand != plan:
            pm = self.priced()
            cur_s, best_s = pm.step_total(plan, sig.workload), pm.step_total(cand, sig.workload)
            d = policy.within_noise(step, plan, trig, cand, cur_s, best_s, self.noise.noise_s(plan))
            if d is not None:
                return d, None, 0.0
        # The replan-on-every-trigger baseline keeps its definition off the urgent path:
        # the planner's best for the next step, no horizon check.
        if urgent or (cand != plan and not always):
            if urgent:
                cands = self.urgent_candidates(ranked, sig.next_len, steps_left, avail)
            else:
                cands = policy.opportunistic_pool(ranked, plan)
            try:
                la = self.lookahead(plan, cands, sig.next_len, steps_left)
                cand = la.plan
            except (LookaheadError, SignalError) as e:
                la_note = f"lookahead not used: {e}"
        fields = policy.search_fields(
            scored,
            {**self.overhead.record(), **self.shapes.record(self.cm)},
            None if la is None else la.record(),
            la_note,
        )
        if cand == plan:
            reason = None if la is None else la.reason
            return policy.kept_current(step, trig, plan, ranked[0], reason, **fields), None, 0.0
        return self._admit(step, trig, plan, cand, sig.workload, la, steps_left, fields)

    def _admit(self, step, trig, plan, cand, wl, la, steps_left, fields):
        """Price the move ``plan -> cand`` and ask admission (see :meth:`decide`)."""
        dag, raw_cost, dag_note = price_move(self.cm, self.mspec, self._devices(), plan, cand)
        # Priced as transitions have measured on this job so far: the model's price plus
        # the learned excess, and no less than this job's measured seconds per primitive
        # for as many primitives
        floor = self.calibration.floor_s(len(dag.primitives) if dag is not None else 0)
        cost = max(self.calibration.price(raw_cost), floor)
        # The trigger's forecast (steps to its next crossing) is capped by the steps the
        # run has left: a saving is not counted past the run's end
        fc = self.controller.forecast(trig.signal)
        # None until the running plan has the steps its noise needs: no opportunistic
        # move rests on one or two steps of a fresh plan (admission declines it)
        noise = self.noise.noise_s(plan) if self.noise.known(plan) else None
        verdict = self.admission.decide(
            plan, cand, wl,
            forecast_steps=min(fc.steps, float(steps_left)),
            transition_cost=cost,
            available_devices=self._devices(),
            trigger=trig.reason,
            candidate_over_in=None if la is None else la.over_at,
            current_over_in=None if la is None else la.current_over_at,
            forced_move_s=0.0 if la is None else la.forced_move_s,
            noise_s=noise,
        )  # fmt: skip
        move = MovePrice(
            forecast_steps=verdict.forecast_steps,
            signal_forecast_steps=fc.steps,
            steps_left=steps_left,
            step_noise_s=noise,
            model_s=raw_cost,
            excess_s=self.calibration.excess_s,
            floor_s=floor,
            model_tolerance=self.tolerance.value,
            tie_margin=self.tie_margin(),
            forced_move_s=verdict.forced_move_s,
            primitives=tuple(f"{p.kind}:{p.stage}" for p in dag.primitives) if dag else (),
            dag_note=dag_note,
        )
        always = self.cfg.admission == "always"
        d = policy.admitted(step, trig, plan, verdict, move, cost, always, **fields)
        return d, dag, raw_cost
