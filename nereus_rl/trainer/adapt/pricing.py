"""The run's view of plans: workloads, the cost model as the run refines it, ranking,
lookahead, move prices and the start plan.

:class:`Planning` holds what the decisions price plans with (the cost model for the
run's memory budget, the measured per-call overhead and stage-shape ratios, the
transition calibration, the step noise and the model's tolerance) and answers the
questions the startup, the boundary and a recovery ask: the workload at a length, the
planner's runnable plans ranked as decisions price them, the lookahead's choice, the
price of a move, the first plan. The boundary's loop itself is
:class:`~nereus_rl.trainer.adapt.adapter.Adapter`.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable

from nereus_rl.core.globalplan import GlobalPlan
from nereus_rl.core.spec import local_cpu_cluster
from nereus_rl.core.workload import Workload, bucket_of, make_workload
from nereus_rl.costmodel.calibration import ModelTolerance, StepNoise, TransitionCalibration
from nereus_rl.costmodel.costmodel import CostModel
from nereus_rl.costmodel.shape_correction import ShapeCorrection, shape
from nereus_rl.costmodel.step_overhead import PricedModel, StepOverhead
from nereus_rl.data.tasks import TOKENIZER
from nereus_rl.models.model import check_tp_divisible
from nereus_rl.planner.planner import PlanInfeasibleError, planner_for
from nereus_rl.planner.planner import plan as plan_best
from nereus_rl.policy import decide as policy
from nereus_rl.policy.admission import Admission
from nereus_rl.policy.auto_budget import auto_budget
from nereus_rl.policy.controller import Controller, SignalError
from nereus_rl.policy.decision import Decision
from nereus_rl.policy.lookahead import LookaheadChoice
from nereus_rl.policy.lookahead import choose as choose_lookahead
from nereus_rl.policy.start_plan import StartPlanError, choose_start_plan, start_lengths
from nereus_rl.trainer.adapt.move import MoveHost, compile_priced
from nereus_rl.trainer.config import NotEnoughDevicesError, TrainConfig, simple_plan
from nereus_rl.trainer.fallback import stagewise_cost
from nereus_rl.transition import TransitionError


class Planning:
    """The run's view of plans (see the module docstring); the
    :class:`~nereus_rl.trainer.adapt.adapter.Adapter` decides with it.

    Arguments:
        cfg: the run's options.
        mc: the model's config (a layout must divide its heads and layers).
        task: the run's task (prompt lengths per response length).
        response_len: the response-length limit of a step (the trace's or curriculum's).
        host: the trainer's process side (:class:`MoveHost`).
        enabled: False keeps the first plan (no decision is made nor logged).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        mc,
        task,
        response_len: Callable[[int], int],
        host: MoveHost,
        enabled: bool,
    ) -> None:
        self.cfg = cfg
        self.mc = mc
        self.task = task
        self.response_len = response_len
        self.host = host
        self.enabled = enabled
        self.mspec = mc
        cores = os.cpu_count() or 1
        # the workers' share of this machine's cores (cfg.worker_cores, when set, gives
        # each its own instead: local_cpu_cluster)
        self.workers_per_core = max(1.0, cfg.devices / cores)
        # What a step costs beyond the model's price, per worker call (step_overhead);
        # the start plan, admission and lookahead compare plans with it, as the
        # candidates are ranked (empty until the startup probes or a step measure it)
        self.overhead = StepOverhead()
        self._layout_ok: dict[tuple[int, int, int], bool] = {}  # (dp, tp, pp) -> runnable
        # Stage shapes that ran, priced at their measured ratio to the model
        # (shape_correction): the model misprices some shapes severalfold on CPU workers
        self.shapes = ShapeCorrection()
        self.controller = Controller(buckets=cfg.buckets, hysteresis=0.0, window=5)
        # a shape no step or probe has run is priced at the model's trusted error above
        # the model (shape_correction): decisions prefer what has been measured
        self.shapes.unmeasured_factor = 1.0 + self.controller.model_tolerance
        self.sized_plan: GlobalPlan | None = None  # the automatic budget's (_auto_budget)
        self._workloads: dict[int, Workload] = {}  # response length -> its Workload
        # (response length, a batch's padded prompt width) -> its Workload
        self._padded: dict[tuple[int, int], Workload] = {}
        self._priced: PricedModel | None = None  # the default model's (priced)
        budget = cfg.memory_budget
        if budget is None:
            budget = self._auto_budget()
        self.budget = int(budget)
        self.cluster = self._cluster()
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
        # the start plan's Decision (start_plan), logged at the first boundary
        self.start_decision: Decision | None = None

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
            self.cluster = self._cluster()
            self.cm = CostModel(self.cluster)
            for plan, wl, measured in observed:
                self.cm.observe(plan, wl, measured)
            self.admission = Admission(self.priced())

    def _cluster(self):
        """The cost model's cluster: ``device_cap`` device ids (``max_devices``), each
        with the per-worker budget, so that devices arriving up to it can be planned on;
        the devices a plan may use are the live workers' (:meth:`_devices`)."""
        cap = self.cfg.device_cap
        return local_cpu_cluster(
            cap,
            self.workers_per_core,
            memory_bytes=self.budget * cap,
            worker_cores=self.cfg.worker_cores,
        )

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

    @property
    def _varlen(self) -> bool:
        # a prompt dataset (its batches' widths vary), not a bundled task
        return hasattr(self.task, "prompt_len")

    def _prompt_len(self, rlen: int) -> int:
        if hasattr(self.task, "prompt_len"):  # a dataset's: its padded prompt width
            return self.task.prompt_len(rlen)
        level = self.task.level_for_response_len(rlen)
        return len(TOKENIZER.encode(self.task.sample(1, level, random.Random(0))[0].prompt))

    def workload(self, rlen: int, prompt_len: int | None = None) -> Workload:
        """The workload of a step whose responses are limited to ``rlen`` tokens (bucketed).

        ``prompt_len``: the padded prompt width of a dataset's batch that ran (the
        left-padded batch's columns), so that a step is priced at the work that really
        ran; None: the width the run plans with (a dataset's longest prompt), which bounds
        any batch's. A bundled task's steps keep the width its decisions are priced at
        (its level's prompt at ``rlen``), so that what the model learns from a step and
        what it is asked about stay alike.

        One object per (length, width) for the run (the config and the task are fixed):
        the cost model's and the planner's caches, keyed by workload, then find it at once.
        """
        wl = self._workloads.get(rlen)
        if wl is None:
            wl = self._workloads[rlen] = self._make_workload(rlen)
        if prompt_len is None or prompt_len == wl.prompt_len or not self._varlen:
            return wl
        key = (rlen, int(prompt_len))
        got = self._padded.get(key)
        if got is None:
            got = self._padded[key] = self._make_workload(rlen, int(prompt_len))
        return got

    def _make_workload(self, rlen: int, prompt_len: int | None = None) -> Workload:
        cfg = self.cfg
        return make_workload(
            cfg.algo,
            actor=self.mspec,
            batch=cfg.batch,
            prompt_len=self._prompt_len(rlen) if prompt_len is None else prompt_len,
            response_len=bucket_of(rlen, cfg.buckets),
            group_size=cfg.group_size if cfg.algo == "grpo" else 1,
            micro_batch=max(1, cfg.batch // cfg.num_micro),
            dtype="fp32",
            rollout_ahead=cfg.mode == "async",
        )

    def _schedule(self) -> list[int]:
        """Every step's response-length limit, step 0 first."""
        return [self.response_len(s) for s in range(self.cfg.steps)]

    def _auto_budget(self, observed: list[tuple] = ()) -> int:
        """The default per-worker memory budget (no ``memory_budget`` given); also sets
        ``self.sized_plan``, the plan it was sized on, which the run starts on (see
        :func:`nereus_rl.policy.auto_budget.auto_budget`)."""
        cl = local_cpu_cluster(
            self.cfg.devices, self.workers_per_core, worker_cores=self.cfg.worker_cores
        )
        budget, self.sized_plan = auto_budget(
            cl, self._schedule(), self.workload, self.rank, self.priced, observed
        )
        return budget

    # -------------------------------------------------------------- planning

    def runnable(self, plan: GlobalPlan) -> bool:
        """Whether the model can run ``plan``: the planner's space is power-of-two
        degrees; the real model also needs tp to divide its heads, pp no more than its
        layers and dp no more than the batch (judged once per stage layout: the k-best
        share a few)."""
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
        try:
            check_tp_divisible(self.mc, tp)
        except ValueError:
            return False
        return pp <= self.mc.num_layers and dp <= self.cfg.batch

    def rank(self, k_best, wl: Workload, pm: PricedModel) -> list[tuple[float, GlobalPlan]]:
        """The runnable plans of ``k_best`` with ``pm``'s latency, fastest first (a
        stable sort: ties keep the planner's order)."""
        out = [(pm.step_total(p, wl), p) for _, p in k_best if self.runnable(p)]
        out.sort(key=lambda x: x[0])
        return out

    def ranked_plans(self, rlen: int, devices=None, k: int = 64) -> list[tuple[float, GlobalPlan]]:
        """The planner's ``k`` best runnable plans for the workload at ``rlen``, best
        first, each with its predicted latency, ranked as the decisions price plans
        (:meth:`priced`: the model's order while nothing has been measured).

        Raises:
            NotEnoughDevicesError: no plan fits the devices and the memory budget.
        """
        wl = self.workload(rlen)
        if devices is None and self.cfg.device_cap > self.cfg.devices:
            # the cluster spans max_devices ids: plan over the ones the run has
            devices = self._devices()
        # the devices planned over: after a loss, the survivors, not the configured count
        held = len(devices) if devices is not None else self.cluster.num_devices
        try:
            res = plan_best(wl, self.cluster, self.cm, devices=devices, k=k)
        except PlanInfeasibleError as e:
            raise NotEnoughDevicesError(
                f"{held} devices with a {self.budget / 2**20:.2f} MiB budget each "
                f"cannot hold {self.cfg.algo} on {self.cfg.model} at {rlen}-token responses: "
                f"{e}"
            ) from None
        out = self.rank(res.k_best, wl, self.priced())
        if not out:
            raise NotEnoughDevicesError(
                f"no plan among the planner's best {len(res.k_best)} fits the model's head "
                f"count on {held} devices; use more devices or another preset"
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
        on the opportunistic path the current plan too) over :meth:`horizon_lengths`.
        See :mod:`nereus_rl.policy.lookahead`; it keeps ``ranked[0]`` unless that goes
        over memory within the horizon and another candidate scores better."""
        lengths = self.horizon_lengths(rlen, steps_left)
        wls = [self.workload(n) for n in lengths]
        return choose_lookahead(
            current, ranked, wls, lengths, self.priced(), self.move_price,
            tie_margin=self.tie_margin(),
        )  # fmt: skip

    def horizon_lengths(self, rlen: int, steps_left: int | None = None) -> tuple[int, ...]:
        """The lengths :meth:`lookahead` scores over (:func:`nereus_rl.policy.decide.horizon`:
        ``rlen``, then the seq_len signal's own forecast, never the length schedule)."""
        return policy.horizon(
            rlen, steps_left, self.cfg.buckets, self.controller.seq_len.forecast_lengths
        )

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

    def _devices(self) -> list[int]:
        """The plan devices the run has (before its workers exist: every configured one,
        plan device ``d`` standing for worker ``d``)."""
        devs = getattr(self.host, "device_worker", None)
        return sorted(devs) if devs else list(range(self.cfg.devices))

    def move_price(self, a: GlobalPlan, b: GlobalPlan) -> float:
        """Predicted seconds of the move ``a -> b`` as the lookahead prices it: its DAG's
        completion time (a per-stage reshard's where no DAG compiles), calibrated with
        the measured transitions."""
        try:
            raw = compile_priced(self.cm, self.mspec, self._devices(), a, b)[1]
        except TransitionError:
            raw = stagewise_cost(self.cm, self.mspec, a, b)
        return self.calibration.price(raw)

    def tie_margin(self) -> float:
        """The lookahead's tie band: the cost model's measured recent error, capped at
        the controller's efficiency band.

        The measured error is mostly load noise common to every plan on a shared
        machine, which says little about how well the model ranks two plans; beyond the
        band the efficiency signal already treats the model as wrong and replans. So the
        band is the most a tie can span, and a model that predicts well narrows it.
        (Payback does not drop savings under this error: a model refined on the running
        plan ranks a few percent faster plan correctly while its error is larger; the
        calibrated transition price is the guard there.)
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
        lengths (:mod:`nereus_rl.policy.start_plan`; its decision is logged at the first
        boundary; ``start_lengths`` says which lengths it looks over), unless the
        automatic budget was sized on a plan (``_auto_budget``)."""
        if isinstance(self.cfg.plan, GlobalPlan):
            return self.cfg.plan
        if self.cfg.plan == "auto":
            ranked = self.ranked_plans(rlen)
            self.start_decision = None
            if self.cfg.memory_budget is None and self.sized_plan in [p for _, p in ranked]:
                return self.sized_plan  # the automatic budget's plan (see _auto_budget)
            if not self.enabled:
                return ranked[0][1]  # a fixed run cannot move: the planner's best
            plan, self.start_decision = self._start_plan([p for _, p in ranked])
            return plan
        return simple_plan(self.cfg.algo, self.cfg.devices, self.cfg.plan)

    def _start_plan(self, ranked: list[GlobalPlan]) -> tuple[GlobalPlan, Decision]:
        # chosen over the run's configured lengths, forced moves priced (start_plan)
        lengths = start_lengths(self._schedule(), self.cfg.buckets, self.cfg.start_lengths)

        def ranked_at(n: int) -> list[GlobalPlan]:
            try:
                return [p for _, p in self.ranked_plans(n)]
            except NotEnoughDevicesError as e:
                raise StartPlanError(str(e)) from None

        return choose_start_plan(
            ranked, lengths, self.cfg.start_lengths, self.workload, ranked_at, self.priced(),
            self.move_price, tie_margin=self.tie_margin(), unmeasured=self.unmeasured_stages,
        )  # fmt: skip

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

    def compile(self, current: GlobalPlan, target: GlobalPlan):
        """The transition DAG current -> target and its predicted completion seconds."""
        return compile_priced(self.cm, self.mspec, self._devices(), current, target)
