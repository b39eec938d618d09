"""The adaptation loop: signals -> planner -> admission -> transition DAG -> state moves.

At each safe boundary (end of a synchronous step; the weight sync of an
asynchronous one) the trainer hands the step's measurements to
:meth:`Adapter.boundary`, which

1. refines the cost model from the measured stage times,
2. feeds the controller its signals for the next step: response length (the
   length schedule's next value, bucketed), devices, predicted peak memory as a
   fraction of the per-worker budget, and measured / predicted step time,
3. on a trigger asks the planner for the best plan under the next step's
   workload, prices the transition by compiling its DAG of EMU primitives
   (``transition_compile``) with the cost model's primitive costs; when the
   current plan cannot run the next step (the urgent path) the candidate is
   chosen among the planner's k-best with lookahead (:mod:`nereus_rl.policy.lookahead`)
   over the seq_len signal's own length forecast, so that a rising length does
   not force another urgent move a step or two later; on the opportunistic path
   the same horizon check runs with the current plan among the candidates, so a
   plan faster for the next step only is not moved back to (the first boundary
   seeds the forecast with the step that ran, so the first move can look ahead),
4. asks admission (payback rule over the trigger's forecast capped by the steps the
   run has left, savings inside the running plan's measured step noise declined, and
   every opportunistic move declined until that noise is measured (3 steps on the plan), with
   the chosen plan's predicted crossing and the move it forces; or ``"always"``, the
   replan-on-every-trigger baseline, which takes the planner's best on the
   opportunistic path as it always did) and, if taken, executes the transition and
   measures it (opportunistic moves priced at no less than the job's measured seconds
   per primitive: ``TransitionCalibration.floor_s``),
5. feeds the measured primitives back to the cost model's primitive estimates
   (``CostModel.observe_primitive``), and the whole transition's time to
   :class:`~nereus_rl.costmodel.calibration.TransitionCalibration` (transitions are priced
   at the model's price plus the measured excess); each step's time against its
   prediction goes to :class:`~nereus_rl.costmodel.calibration.ModelTolerance`, the error
   below which lookahead calls scores tied (capped: :meth:`Adapter.tie_margin`).
   The step's residual (measured minus the model's price) goes to
   :class:`~nereus_rl.costmodel.step_overhead.StepOverhead`, the unpriced rest per worker call,
   which ranks the planner's candidates and completes the efficiency signal's price;
   its stage seconds go to :class:`~nereus_rl.costmodel.shape_correction.ShapeCorrection`, so
   that a stage shape that ran (a probe's or the run's) is priced at its measured
   ratio to the model in every comparison of plans (``Adapter.priced``).

Every decision is logged with its signal, predicted saving, predicted
transition cost, whether it was taken, the measured transition time, the
primitives executed and the stages that fell back.

Pricing a move and carrying out a taken one live in :mod:`nereus_rl.trainer.adapt.move`
(a move cut short by a worker death gets its own decision row there, ``interrupted``,
beside the recovery's row).

Execution (:mod:`nereus_rl.trainer.units`): the model's state lives in EMU
units, and the DAG runs through the concurrent executor
(``transition_exec.execute_dag``) with live primitives, each an
``EMUManager.extend / destroy / split / merge``; the changed stages' models are
then rebuilt from their new units. The manager feeds each primitive's record
to the cost model as it ends, so nothing is fed here for them. A stage whose
primitives cannot run live falls back to one nereus_comm reshard of the whole
stage (``rl.move``); only that measurement is fed here, as one ``"reshard"``
covering an Extend per new unit of each such stage, priced the way
``stagewise_cost`` is (:mod:`nereus_rl.trainer.fallback`).
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from nereus_rl.core.globalplan import GlobalPlan
from nereus_rl.core.spec import local_cpu_cluster, model_preset
from nereus_rl.core.workload import bucket_of, make_workload
from nereus_rl.costmodel.calibration import ModelTolerance, StepNoise, TransitionCalibration
from nereus_rl.costmodel.costmodel import CostModel
from nereus_rl.costmodel.overlap import own_seconds, rollout_slack
from nereus_rl.costmodel.shape_correction import ShapeCorrection, shape
from nereus_rl.costmodel.step_overhead import PricedModel, StepOverhead
from nereus_rl.models.model import check_tp_divisible
from nereus_rl.planner.planner import PlanInfeasibleError, planner_for
from nereus_rl.planner.planner import plan as plan_best
from nereus_rl.policy.admission import Admission
from nereus_rl.policy.auto_budget import auto_budget
from nereus_rl.policy.controller import Controller, SignalError
from nereus_rl.policy.lookahead import LookaheadChoice, LookaheadError
from nereus_rl.policy.lookahead import choose as choose_lookahead
from nereus_rl.policy.start_plan import choose_start_plan
from nereus_rl.trainer.adapt.move import admit_move, compile_priced, execute_move, primitive_seconds
from nereus_rl.trainer.calibrate import stage_seconds
from nereus_rl.trainer.fallback import stagewise_cost
from nereus_rl.transition import TransitionError

# Steps the urgent path looks ahead (the next step and 5 forecast ones): a few steps,
# enough to see the next bucket of a rising length without trusting a long trend. 4 was
# too short for bench_e2e's 20-step rise (about 1.5 tokens per step, and the trend from
# the first two values is rounder still): it missed the 12 -> 16 bucket crossing 3 steps
# on, and the second urgent move followed; 6 sees it and avoids it.
LOOKAHEAD_STEPS = 6


# Candidates an opportunistic move's lookahead scores: the planner's fastest for the
# next step (see Adapter.boundary)
OPPORTUNISTIC_POOL = 12
# Plans the planner returns for an opportunistic decision, re-ranked as decisions price
# them (measured shapes, overhead) before the pool above is taken from them
OPPORTUNISTIC_RANK = 24
# Steps an opportunistic search that kept the running plan stands for an efficiency
# trigger alone (see Adapter._settled_row)
SETTLED_STEPS = 3


def _kept_row(step: int, trig, plan: GlobalPlan, reason: str, **extra: Any) -> dict[str, Any]:
    """The decision row of an opportunistic trigger answered without a full search
    (the running plan kept, nothing to move): the noise not measured yet, a recent
    search that still answers it (settled), or a ranking whose fastest plan cannot beat
    the step noise. ``extra`` adds to or overrides its fields."""
    row = {
        "step": step, "signal": trig.signal, "trigger": trig.reason, "urgent": trig.urgent,
        "current": repr(plan), "taken": False, "path": "opportunistic",
        "predicted_saving_s": 0.0, "predicted_transition_s": 0.0,
        "measured_transition_s": None, "reason": reason,
    }  # fmt: skip
    row.update(extra)
    return row


def _bucket_key(wl) -> tuple:
    """A workload up to its prompt length (see Adapter._settled_row): the stages'
    seq lengths follow the prompt, so the stages themselves are not compared."""
    return (wl.algo, wl.batch, wl.response_len, wl.dtype, wl.rollout_ahead, wl.stage_order)


def rest_observable(plan: GlobalPlan, workload, est, cluster) -> bool:
    """Whether a measured step of ``plan`` shows the driver's rest (``step_overhead``):
    a synchronous step always; an asynchronous one only when its chain of stages ends
    no sooner than the rollout sent ahead (``est``, the stages' price, says which).

    A step whose rollout ends after its chain says nothing of the rest the chain held:
    fed to the fit, a run on such a plan fitted the rest to about 0, and a plan whose
    chain is the whole step then looked as cheap as it (bench_e2e ReMax async started
    on one in 3 of 10 rounds, 1.27x slower). The startup probes, which run a step's
    phases one after another, always show it.
    """
    if not workload.rollout_ahead:
        return True
    secs = {k: v.seconds for k, v in est.stages.items()}
    return rollout_slack(plan, workload, secs, est.sync_s, cluster) <= 0.0


class Adapter:
    """The decision side of one run (see the module docstring).

    Arguments:
        trainer: the :class:`nereus_rl.trainer.trainer.Trainer` (its plan, config, workers).
        enabled: False keeps the first plan (decisions are still not logged).
    """

    def __init__(self, trainer, enabled: bool) -> None:
        self.trainer = trainer
        self.enabled = enabled
        cfg = trainer.cfg
        self.cfg = cfg
        self.mspec = model_preset(cfg.model)
        cores = os.cpu_count() or 1
        self.workers_per_core = max(1.0, cfg.devices / cores)
        # What a step costs beyond the model's price, per worker call (step_overhead);
        # the start plan, admission and lookahead compare plans with it, as the
        # candidates are ranked (empty until the startup probes or a step measure it)
        self.overhead = StepOverhead()
        self._layout_ok: dict[tuple[int, int, int], bool] = {}  # (dp, tp, pp) -> runnable
        # Stage shapes that ran, priced at their measured ratio to the model
        # (shape_correction): the model misprices some shapes 2-4x on these workers
        self.shapes = ShapeCorrection()
        self.controller = Controller(buckets=cfg.buckets, hysteresis=0.0, window=5)
        # a shape no step or probe has run is priced at the model's trusted error above
        # the model (shape_correction): decisions prefer what has been measured
        self.shapes.unmeasured_factor = 1.0 + self.controller.model_tolerance
        self.sized_plan: GlobalPlan | None = None  # the automatic budget's (_auto_budget)
        self._workloads: dict[int, Any] = {}  # response length -> its Workload (workload)
        self._priced: PricedModel | None = None  # the default model's (priced)
        budget = cfg.memory_budget
        if budget is None:
            budget = self._auto_budget()
        self.budget = int(budget)
        self.cluster = local_cpu_cluster(
            cfg.devices, self.workers_per_core, memory_bytes=self.budget * cfg.devices
        )
        self.cm = CostModel(self.cluster)
        self.calibration = TransitionCalibration()
        # the running plan's step-to-step scatter: savings inside it are declined
        self.noise = StepNoise()
        self.admission = Admission(self.priced())
        # The model's error before any refined prediction: the error the controller's
        # efficiency signal accepts as agreement (its "ok" band); see tie_margin.
        band = self.controller.model_tolerance
        self.tolerance = ModelTolerance(band, cap=band)
        self._refined = False
        # the last opportunistic search that kept the running plan: (plan, the next
        # step's workload, step, the plan's price then); see _settled_row
        self._settled: tuple | None = None
        self.prompt_len = 0
        # the start plan's decision row (start_plan), logged at the first boundary
        self.start_row: dict[str, Any] | None = None

    def calibrated(self, observed: list[tuple]) -> None:
        """The cost model was refined at startup from ``observed`` (plan, workload, stage
        seconds): the first step's prediction is a refined one, so its error counts
        towards the tolerance; and the automatic budget (no ``memory_budget`` given) is
        set again by its rule with the measured efficiencies, so that it still sits just
        above the peak of the plan the run starts on (the model is rebuilt for the new
        capacity and the observations replayed into it)."""
        self._refined = True
        if self.cfg.memory_budget is None:
            self.budget = self._auto_budget(observed)
            self.cluster = local_cpu_cluster(
                self.cfg.devices, self.workers_per_core, memory_bytes=self.budget * self.cfg.devices
            )
            self.cm = CostModel(self.cluster)
            for plan, wl, measured in observed:
                self.cm.observe(plan, wl, measured)
            self.admission = Admission(self.priced())

    def priced(self, cm: CostModel | None = None) -> PricedModel:
        """``cm`` (the adapter's model by default) as the decisions price plans: measured
        stage shapes at their measured ratio, plus the per-call overhead's spread. The
        default model's is one object while the model is (its memo then serves every
        decision of a boundary: PricedModel)."""
        if cm is not None:
            return PricedModel(cm, self.overhead, self.shapes)
        if self._priced is None or self._priced._cm is not self.cm:
            self._priced = PricedModel(self.cm, self.overhead, self.shapes)
        return self._priced

    # -------------------------------------------------------------- workload

    def _prompt_len(self, rlen: int) -> int:
        from nereus_rl.data.tasks import TOKENIZER

        t = self.trainer.task
        level = t.level_for_response_len(rlen)
        import random

        return len(TOKENIZER.encode(t.sample(1, level, random.Random(0))[0].prompt))

    def workload(self, rlen: int):
        """The workload of a step whose responses are limited to ``rlen`` tokens (bucketed).

        One object per length for the run (the config and the task are fixed): the cost
        model's and the planner's caches, keyed by workload, then find it at once.
        """
        wl = self._workloads.get(rlen)
        if wl is None:
            wl = self._workloads[rlen] = self._make_workload(rlen)
        return wl

    def _make_workload(self, rlen: int):
        cfg = self.cfg
        return make_workload(
            cfg.algo,
            actor=self.mspec,
            batch=cfg.batch,
            prompt_len=self._prompt_len(rlen),
            response_len=bucket_of(rlen, cfg.buckets),
            group_size=cfg.group_size if cfg.algo == "grpo" else 1,
            micro_batch=max(1, cfg.batch // cfg.num_micro),
            dtype="fp32",
            rollout_ahead=cfg.mode == "async",
        )

    def _auto_budget(self, observed: list[tuple] = ()) -> int:
        """The default per-worker memory budget (no ``memory_budget`` given); also sets
        ``self.sized_plan``, the plan it was sized on, which the run starts on (see
        :func:`nereus_rl.policy.auto_budget.auto_budget`)."""
        budget, self.sized_plan = auto_budget(self, observed)
        return budget

    # -------------------------------------------------------------- planning

    def _runnable(self, plan: GlobalPlan) -> bool:
        # The planner's space is power-of-two degrees; the real model also needs tp to
        # divide its heads and pp no more than its layers.
        # (Judged per stage layout, once: the k-best share a few, and a search asks for
        # every plan it ranks.)
        ok = self._layout_ok
        for sp in plan.stages:
            key = (sp.dp, sp.tp, sp.pp)
            got = ok.get(key)
            if got is None:
                got = ok[key] = self._layout_runnable(*key)
            if not got:
                return False
        return True

    def _layout_runnable(self, dp: int, tp: int, pp: int) -> bool:
        mc = self.trainer.mc
        try:
            check_tp_divisible(mc, tp)
        except ValueError:
            return False
        return pp <= mc.num_layers and dp <= self.cfg.batch

    def _rank(self, k_best, wl, pm: PricedModel) -> list[tuple[float, GlobalPlan]]:
        """The runnable plans of ``k_best`` with ``pm``'s latency, fastest first (a
        stable sort: ties keep the planner's order)."""
        out = [(pm.step_total(p, wl), p) for _, p in k_best if self._runnable(p)]
        out.sort(key=lambda x: x[0])
        return out

    def ranked_plans(self, rlen: int, devices=None, k: int = 64) -> list[tuple[float, GlobalPlan]]:
        """The planner's ``k`` best runnable plans for the workload at ``rlen``, best
        first, each with its predicted latency (bench_e2e asks for all: a large ``k``).

        Raises:
            NotEnoughDevicesError: no plan fits the devices and the memory budget.
        """
        from nereus_rl.trainer.trainer import NotEnoughDevicesError

        wl = self.workload(rlen)
        try:
            res = plan_best(wl, self.cluster, self.cm, devices=devices, k=k)
        except PlanInfeasibleError as e:
            raise NotEnoughDevicesError(
                f"{self.cfg.devices} devices with a {self.budget / 2**20:.2f} MiB budget each "
                f"cannot hold {self.cfg.algo} on {self.cfg.model} at {rlen}-token responses: "
                f"{e}"
            ) from None
        # Ranked as the decisions price plans (priced): measured stage shapes at their
        # measured ratio to the model (shape_correction) and the measured per-call
        # overhead the model does not price (step_overhead; only its plan-dependent
        # part), so the order is the model's when nothing has been measured yet.
        out = self._rank(res.k_best, wl, self.priced())
        if not out:
            raise NotEnoughDevicesError(
                f"no plan among the planner's best {len(res.k_best)} fits the model's head "
                f"count on {self.cfg.devices} devices; use more devices or another preset"
            )
        return out

    def best_plan(self, rlen: int, devices=None) -> tuple[GlobalPlan, float]:
        """The planner's best runnable plan for the workload at ``rlen``, and its latency.

        Raises:
            NotEnoughDevicesError: no plan fits the devices and the memory budget.
        """
        lat, p = self.ranked_plans(rlen, devices)[0]
        return p, lat

    def lookahead(
        self,
        current: GlobalPlan,
        ranked: list[GlobalPlan],
        rlen: int,
        steps_left: int | None = None,
    ) -> LookaheadChoice:
        """The choice among ``ranked`` (the k-best for ``rlen``, the next step's length;
        on the opportunistic path the current plan too) over ``LOOKAHEAD_STEPS`` steps,
        or the ``steps_left`` the run still has if fewer: ``rlen``, then the seq_len
        signal's own trend forecast (never the length schedule). See
        :mod:`nereus_rl.policy.lookahead`; it keeps ``ranked[0]`` unless that goes over memory
        within the horizon and another candidate scores better."""
        lengths = self.horizon_lengths(rlen, steps_left)
        wls = [self.workload(n) for n in lengths]
        return choose_lookahead(
            current, ranked, wls, lengths, self.priced(), self.move_price,
            tie_margin=self.tie_margin(),
        )  # fmt: skip

    def horizon_lengths(self, rlen: int, steps_left: int | None = None) -> tuple[int, ...]:
        """The lengths :meth:`lookahead` scores over: ``rlen`` (bucketed), then the
        seq_len signal's forecast, ``LOOKAHEAD_STEPS`` in all or the ``steps_left``."""
        horizon = (
            LOOKAHEAD_STEPS if steps_left is None else max(1, min(LOOKAHEAD_STEPS, steps_left))
        )
        lengths = (bucket_of(rlen, self.cfg.buckets),)
        return lengths + tuple(self.controller.seq_len.forecast_lengths(horizon - 1))

    def urgent_candidates(
        self, ranked: list[GlobalPlan], rlen: int, steps_left: int | None, devices
    ) -> list[GlobalPlan]:
        """``ranked`` (the k-best at ``rlen``, the next step's length), then the
        planner's runnable k-best on ``devices`` at the horizon's longest length that
        ``ranked`` lacks.

        The planner's search at one length drops a layout that another on the same
        devices beats there, so the k-best at the next length can lack the plans that
        hold the lengths the forecast rises to, the ones an urgent move's lookahead is
        for (the start plan takes every length of its schedule the same way:
        :func:`nereus_rl.policy.start_plan.start_candidates`). The lookahead drops those that
        do not fit the next step.
        """
        try:
            longest = max(self.horizon_lengths(rlen, steps_left))
        except SignalError:  # no length forecast: the lookahead says so
            return ranked
        if longest <= bucket_of(rlen, self.cfg.buckets):
            return ranked
        try:
            more = self.ranked_plans(longest, devices=devices)
        except ValueError:  # nothing fits there: the lookahead cuts its horizon
            return ranked
        seen = set(ranked)
        return [*ranked, *(p for _, p in more if p not in seen)]

    def move_price(self, a: GlobalPlan, b: GlobalPlan) -> float:
        """Predicted seconds of the move ``a -> b`` as the lookahead prices it: its DAG's
        completion time (a per-stage reshard's where no DAG compiles), calibrated with
        the measured transitions. Before the workers exist (the start plan), plan device
        ``d`` stands for worker ``d``."""
        devs = getattr(self.trainer, "device_worker", None) or range(self.cfg.devices)
        try:
            raw = compile_priced(self.cm, self.mspec, devs, a, b)[1]
        except TransitionError:
            raw = stagewise_cost(self.cm, self.mspec, a, b)
        return self.calibration.price(raw)

    def tie_margin(self) -> float:
        """The lookahead's tie band: the cost model's measured recent error, capped at
        the controller's efficiency band.

        The measured error is mostly load noise common to every plan on a shared
        machine (bench_e2e's runs: 10-70%), which says little about how well the model
        ranks two plans; beyond the band the efficiency signal already treats the
        model as wrong and replans. So the band is the most a tie can span, and a
        model that predicts well (a few percent) narrows it. (Payback does not drop
        savings under this error: a run's decision log showed the model, refined on
        the running plan, rank a 5% faster plan correctly while its error was 10-35%;
        the calibrated transition price is the guard there.)
        """
        return self.tolerance.margin

    def unmeasured_stages(self, plan: GlobalPlan) -> int:
        """Stages of ``plan`` whose shape (stage, dp, tp, pp) no measurement priced: the
        startup probes' and the run's (``ShapeCorrection``); the start plan's near ties
        prefer fewer (``lookahead.choose_start``)."""
        rs = self.shapes.ratios(self.cm)
        return sum(shape(sp) not in rs for sp in plan.stages)

    def initial_plan(self, rlen: int) -> GlobalPlan:
        """The first plan: the planner's (``plan="auto"``), a fixed colocated/disaggregated
        one, or the GlobalPlan given as ``plan``. An adaptive run's planner's plan is
        chosen among the k-best at ``rlen`` with lookahead over the run's configured
        lengths (:mod:`nereus_rl.policy.start_plan`; its decision row is logged at the first
        boundary; ``start_lengths`` says which lengths it looks over),
        unless the automatic budget was sized on a plan (``_auto_budget``)."""
        from nereus_rl.trainer.trainer import simple_plan

        if isinstance(self.cfg.plan, GlobalPlan):
            return self.cfg.plan
        if self.cfg.plan == "auto":
            ranked = self.ranked_plans(rlen)
            self.start_row = None
            if self.cfg.memory_budget is None and self.sized_plan in [p for _, p in ranked]:
                return self.sized_plan  # the automatic budget's plan (see _auto_budget)
            if not self.enabled:
                return ranked[0][1]  # a fixed run cannot move: the planner's best
            # chosen over the run's configured lengths, forced moves priced (start_plan)
            plan, self.start_row = choose_start_plan(self, [p for _, p in ranked])
            return plan
        return simple_plan(self.cfg.algo, self.cfg.devices, self.cfg.plan)

    def prepare_buckets(self, rlen: int) -> None:
        """Price the stage tables of every response bucket from ``rlen``'s up once, on the
        cost model the run starts with, so that a later decision after a bucket change
        does not (decisions are unchanged)."""
        planner_for(self.cluster, self.cm).prepare(
            self.workload(b) for b in self.cfg.buckets if b >= bucket_of(rlen, self.cfg.buckets)
        )

    def can_run(self, plan: GlobalPlan, rlen: int) -> bool:
        """Whether ``plan`` fits the memory budget at responses of ``rlen`` tokens (a
        fixed plan's run always runs its plan); as the urgent path judges it."""
        return not self.enabled or not self.admission.problems(plan, self.workload(rlen), None)

    def _primitive_cost(self, prim) -> float:
        return primitive_seconds(self.cm, self.mspec, prim)

    def compile(self, current: GlobalPlan, target: GlobalPlan):
        """The transition DAG current -> target and its predicted completion seconds."""
        return compile_priced(self.cm, self.mspec, self.trainer.device_worker, current, target)

    # -------------------------------------------------------------- the boundary

    def boundary(self, step: int, m: dict[str, Any]) -> dict[str, Any]:
        """Observe step ``step``'s metrics; maybe change the plan before step ``step + 1``.

        Returns:
            Extra metrics for the step (signals, ``transition_s``).
        """
        tr = self.trainer
        plan = tr.plan
        wl_now = self.workload(m["response_len"])
        measured = stage_seconds(self.cfg.algo, m, worker_inference=self.cfg.mode == "async")
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
            # A prediction from the model refined on earlier steps (the first step's is
            # the unrefined model's, which says nothing about the refined one's error).
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
        # Probed shapes priced under this step's conditions, as measured on this plan
        # (shape_correction: the run's regime against the startup probes')
        self.shapes.anchor(self.cm, plan, wl_now)
        nxt = tr._response_len(step + 1)
        wl = self.workload(nxt)
        peak = max(self.cm.peak_memory(plan, wl).values())
        frac = peak / self.budget
        eff = step_s / whole if whole > 0 else None
        out = {
            "predicted_step_s": predicted,
            "predicted_overhead_s": ovh,
            # what the efficiency signal compares the step with (async: the rest on the
            # chain, so not always the sum of the two above)
            "predicted_whole_s": whole,
            "peak_memory_fraction": frac,
            "memory_budget_bytes": self.budget,
        }
        if not self.enabled:
            return out
        if self.start_row is not None:  # the start plan's choice (after the calibration)
            self._log(self.start_row)
            self.start_row = None
        triggers = self.controller.update(
            step,
            seq_len=nxt,
            current_seq_len=m["response_len"],
            available_devices=sorted(tr.device_worker),
            in_use=plan.devices,
            peak_memory_fraction=frac,
            efficiency_ratio=eff,
        )
        if step == 0:
            triggers = [t for t in triggers if t.urgent]  # the first values set the levels
        if not triggers:
            return out
        trig = max(triggers, key=lambda t: t.urgent)
        # Steps that run after this boundary: no saving is counted, and no length looked
        # ahead to, past the run's end (cfg.steps is the trainer's own)
        steps_left = self.cfg.steps - (step + 1)
        avail = sorted(tr.device_worker)
        urgent_now = bool(self.admission.problems(plan, wl, avail))
        if not urgent_now and self.cfg.admission != "always" and not self.noise.known(plan):
            # Admission declines every opportunistic move until the running plan's step
            # noise is measured (adapt_move): searching and pricing candidates for it
            # was most of the deciding in a run's first steps (50-60 ms at step 1 of a
            # bench_e2e run, a third of a step), time no fixed plan pays.
            self._log(_kept_row(
                step, trig, plan, "the current plan's step noise is not measured yet "
                f"({self.noise.steps(plan)} of {self.noise.min_steps} steps on it): "
                "no opportunistic move before it, so no plan was searched"))  # fmt: skip
            return out
        if not urgent_now and self.cfg.admission != "always":
            row = self._settled_row(step, plan, wl, triggers)
            if row is not None:
                self._log(row)
                return out
        self._settled = None
        try:
            # An opportunistic move asks the planner for fewer plans (re-priced, each,
            # as decisions price them: 10-24 ms of a PPO boundary for 64); urgent moves
            # and the replan-always baseline keep the whole k-best
            k = 64 if urgent_now or self.cfg.admission == "always" else OPPORTUNISTIC_RANK
            ranked = [p for _, p in self.ranked_plans(nxt, devices=avail, k=k)]
        except ValueError as e:  # nothing fits: keep running the current plan
            self._log({"step": step, "signal": trig.signal, "trigger": trig.reason,
                       "urgent": trig.urgent, "taken": False, "reason": str(e),
                       "current": repr(plan), "measured_transition_s": None})  # fmt: skip
            return out
        cand, la, la_note = ranked[0], None, None
        if not urgent_now and self.cfg.admission != "always" and cand != plan:
            row = self._within_noise_row(step, plan, wl, trig, cand)
            if row is not None:
                self._log(row)
                self._settle(step, plan, wl, urgent_now)
                return out
        # (The replan-on-every-trigger baseline keeps its definition off the urgent
        # path: the planner's best for the next step, no horizon check.)
        if urgent_now or (cand != plan and self.cfg.admission != "always"):
            # Urgent (the current plan cannot run the next step): choose the move with
            # lookahead so that rising lengths do not force another move soon after.
            # Opportunistic: the same horizon check, with the current plan among the
            # candidates at no transition cost, so that a plan faster for the next step
            # only (the one an urgent move's lookahead avoided) is not moved back to;
            # admission then counts the chosen plan's saving only until its crossing.
            # An opportunistic move looks ahead over the planner's fastest few only: its
            # target must beat the running plan by more than the step noise, which no
            # plan far down the ranking does, and scoring all 64 over the horizon (their
            # DAGs compiled) was 40-85 ms of a PPO boundary, a third of a step. An urgent
            # move keeps the whole ranking (a plan that holds longer lengths may rank
            # low) and adds the k-best at the horizon's longest length.
            if urgent_now:
                cands = self.urgent_candidates(ranked, nxt, steps_left, avail)
            else:
                pool = ranked[:OPPORTUNISTIC_POOL]
                cands = pool if plan in pool else [*pool, plan]
            try:
                la = self.lookahead(plan, cands, nxt, steps_left)
                cand = la.plan
            except (LookaheadError, SignalError) as e:
                la_note = f"lookahead not used: {e}"
        row: dict[str, Any] = {
            "step": step,
            "signal": trig.signal,
            "trigger": trig.reason,
            "urgent": trig.urgent,
            "current": repr(plan),
            "candidate": repr(cand),
            "measured_transition_s": None,
            # the measured unpriced rest that ranked the candidates with the model
            **self.overhead.record(),
            **self.shapes.record(self.cm),
        }
        if la is not None:
            row.update(la.record())
        elif la_note:
            row["lookahead_reason"] = la_note
        if cand == plan:
            why = "the planner's best plan is the current one"
            if ranked[0] != plan:
                why = "lookahead keeps the current plan: " + la.reason
            row.update(taken=False, reason=why, path="opportunistic",
                       predicted_saving_s=0.0, predicted_transition_s=0.0)  # fmt: skip
            self._log(row)
            self._settle(step, plan, wl, urgent_now)
            return out
        dag, raw_cost, taken = admit_move(self, plan, cand, wl, trig, la, steps_left, row)
        if taken:
            # (a death mid-move logs this row, interrupted, and goes on to recovery)
            out["transition_s"] = execute_move(self, plan, cand, dag, step, raw_cost, row)
        else:
            self._settle(step, plan, wl, urgent_now)
        self._log(row)
        return out

    def _within_noise_row(self, step: int, plan: GlobalPlan, wl, trig, fastest) -> dict | None:
        """The decision row of an opportunistic search whose fastest plan for the next
        step (``fastest``, the ranking's first) saves no more than the running plan's
        measured step noise, or None.

        Admission declines a saving within that noise (``Admission.decide``), and every
        plan the lookahead could choose is one of the ranked plans or the running plan,
        none faster at the next step than ``fastest``: no move can be taken. So the
        lookahead (its candidates priced over the horizon and their moves compiled: a
        third of a PPO search) and admission's pricing of the move are not run; the
        outcome is the one they would reach. (Only on the opportunistic path, after the
        noise is measured: the caller returned before both otherwise.)
        """
        pm = self.priced()
        cur, best = pm.step_total(plan, wl), pm.step_total(fastest, wl)
        noise = self.noise.noise_s(plan)
        saving = cur - best
        if saving > noise:
            return None
        if saving <= 0:
            why = (
                f"not faster: the ranking's fastest plan for the next step prices {best:.4g} "
                f"s/step against the current plan's {cur:.4g} s"
            )
        else:
            why = (
                f"within noise: the fastest plan for the next step saves {saving:.3g} s/step, "
                f"within the measured step noise ({noise:.3g} s per step on the current plan)"
            )
        return _kept_row(
            step, trig, plan, why + ", so admission takes no candidate: none was looked "
            "ahead to or priced for a move",
            candidate=repr(fastest), predicted_saving_s=saving, step_noise_s=noise,
        )  # fmt: skip

    def _settle(self, step: int, plan: GlobalPlan, wl, urgent: bool) -> None:
        # an opportunistic search that kept the running plan (see _settled_row)
        if not urgent and self.cfg.admission != "always":
            self._settled = (plan, wl, step, self.priced().step_total(plan, wl))

    def _settled_row(self, step: int, plan: GlobalPlan, wl, triggers) -> dict | None:
        """The decision row of an efficiency trigger that the last search still answers,
        or None to search.

        On these shared cores a step's measured / predicted ratio crosses the
        efficiency signal's bands every other step (bench_e2e PPO async quick: 4 of 9
        boundaries searched, 16-46 ms each, where a boundary that only observes costs
        2-4 ms). The model already folds each step's measurement into the plans'
        prices, so a search repeated for the same next workload on the same plan,
        whose price has not moved beyond the model's tie band, finds what the last one
        found. So an efficiency trigger alone is answered by a search that kept the
        running plan within the last ``SETTLED_STEPS`` steps, for the same next
        workload up to its prompt length, while the running plan's price is within the
        tie band of its price then; any other trigger (a new length bucket, devices,
        memory) searches.

        The prompt length may differ: the workloads of one response-length bucket
        differ only in it where the curriculum lengthens prompts with responses (the
        ``sort`` task's prompt is as long as its response), and keyed on the whole
        workload the check missed 4 of the 9 searches of a PPO async run on bench_e2e's
        trace, each of which kept the plan. A longer prompt that changes the running
        plan's price by more than the tie band searches again (the price check below).
        """
        last = self._settled
        if last is None or any(t.signal != "efficiency" for t in triggers):
            return None
        s_plan, s_wl, s_step, s_price = last
        if s_plan != plan or step - s_step > SETTLED_STEPS:
            return None
        if s_wl != wl and _bucket_key(s_wl) != _bucket_key(wl):
            return None
        price = self.priced().step_total(plan, wl)
        if price > s_price * (1.0 + self.tie_margin()):
            return None
        same = "the same next workload"
        if s_wl != wl:
            same = f"the same response bucket ({s_wl.prompt_len} -> {wl.prompt_len}-token prompts)"
        return _kept_row(
            step, triggers[0], plan, f"settled: the search at step {s_step} kept the "
            f"current plan for {same}, and its price ({price:.4g} s) is "
            f"within the tie band of its price then ({s_price:.4g} s): not searched again",
        )  # fmt: skip

    def _log(self, row: dict[str, Any]) -> None:
        self.trainer.result.decisions.append(row)
        if self.trainer.log is not None:
            self.trainer.log.decision(row)
