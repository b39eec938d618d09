"""Stage shapes priced as they measure on the job, where the cost model misprices them.

The cost model fits one efficiency per operation class over every measurement, so a
stage shape (stage, dp, tp, pp) whose real cost does not follow the model's structure
stays mispriced however often it runs. On CPU workers that share cores this happens:
on 4 workers over 2 busy cores a dp 2 training gains no parallelism and still pays its
all-reduce, while dp 1 and pp 2 trainings can run several times faster than priced,
enough to reorder the planner's ranking of near plans (``bench_e2e.py``'s model check
compares the predicted and measured step of each plan).

:class:`ShapeCorrection` keeps, per stage shape, the recent measurements of that
stage (the plan, workload and measured seconds, from the startup probes and every
step), and prices a stage of a measured shape at the model's price times the median
ratio measured / model's price of those measurements, the ratio taken against the
model as it is now (the model keeps refining; a ratio taken once would go stale).
A shape never measured keeps the model's price times ``unmeasured_factor`` (1 by
default; the trainer sets 1 + the model's trusted error): once some shapes are measured,
an unmeasured one is the least known, and the model can price one far too low on
these workers (a plan with a tp 2 reference that never ran can be predicted faster than
the running plan and run slower), which would draw opportunistic moves to it and let
it win the start among near ties.
Phases are composed as the cost model composes them (stages sharing devices add up,
groups on other devices overlap).

Two regimes. The startup probes (``observe(..., startup=True)``) measure shapes one plan
at a time on a machine as loaded as it was then; the run measures the running plan's
shapes under the run's conditions (another load, an async rollout overlapping the
step). Mixed, the running plan would be priced at today's conditions and every probed
alternative at the probes': a dp 1 reference running beside the async rollout can cost
ten times its model price while a probed alternative stays near its own, so admission
would see a saving that is only the difference in conditions, and move. So a shape
with startup measurements is priced at its startup ratio times one whole-plan factor,
the running plan's run-regime price over its startup-regime price on the shapes it has
both for (:meth:`anchor`, each boundary): every probed plan is priced under today's
conditions, as measured on the plan that runs now, and their relative prices stay the
probes'. A shape measured only during the run keeps its run ratio; with no shape of the
running plan probed the factor is 1.
"""

from __future__ import annotations

import statistics
from collections import defaultdict, deque

from nereus_rl.core.globalplan import GlobalPlan, StagePlan
from nereus_rl.costmodel.costmodel import (
    ClassShares,
    StageEstimate,
    StepEstimate,
    compose_step,
    compose_total,
)


def shape(sp: StagePlan) -> tuple[str, int, int, int]:
    """A stage's shape: (stage, dp, tp, pp)."""
    return (sp.stage, sp.dp, sp.tp, sp.pp)


class ShapeCorrection:
    """Measured / predicted stage seconds per stage shape, over recent measurements.

    Arguments:
        window: measurements kept per shape (the median of their ratios is used).

    Raises:
        ValueError: ``window`` below 1.
    """

    def __init__(self, window: int = 6) -> None:
        if window < 1:
            raise ValueError(f"window={window} must be >= 1")
        self.window = window
        self.obs: dict[tuple, deque] = defaultdict(lambda: deque(maxlen=window))
        self.startup_obs: dict[tuple, deque] = defaultdict(lambda: deque(maxlen=window))
        # the whole-plan regime factor, measured by anchor()
        self.factor = 1.0
        self._cache: dict[tuple, dict[tuple, float]] = {}
        self.version = 0  # bumps when what correct() applies may change (PricedModel)
        # a never-measured shape's price over the model's, once any shape is measured
        self.unmeasured_factor = 1.0

    def observe(
        self, plan: GlobalPlan, workload, measured: dict[str, float], *, startup: bool = False
    ) -> None:
        """Record one step's measured seconds per stage (``stage_seconds``'s form) under
        ``plan``; stages not in the plan and non-positive times are ignored. ``startup``:
        a startup probe's step (the probes' regime, see the module doc)."""
        store = self.startup_obs if startup else self.obs
        for sp in plan.stages:
            t = measured.get(sp.stage)
            if t is not None and t > 0:
                store[shape(sp)].append((plan, workload, float(t)))
        self._cache = {}
        self.version += 1

    def _medians(self, cm, store: dict, tag: str) -> dict[tuple, float]:
        # Per shape, the median of measured / cm's price (cached per model version; the
        # adapter rebuilds its model after calibration: the key names the model too)
        ver = (tag, id(cm), getattr(cm, "version", None))
        if ver[2] is not None and ver in self._cache:
            return self._cache[ver]
        out = {}
        # a step's row is stored under each of its stages' shapes: price it once
        priced: dict[tuple, dict] = {}
        for key, rows in store.items():
            rs = []
            for plan, wl, t in rows:
                ests = priced.get((plan, wl))
                if ests is None:
                    ests = priced[plan, wl] = cm.stage_estimates(plan, wl)[0]
                st = ests.get(key[0])
                if st is not None and st.seconds > 0:
                    rs.append(t / st.seconds)
            if rs:
                out[key] = statistics.median(rs)
        if ver[2] is not None:
            self._cache = {k: v for k, v in self._cache.items() if k[1:] == ver[1:]}
            self._cache[ver] = out
        return out

    def anchor(self, cm, plan: GlobalPlan, workload) -> float:
        """Measure the whole-plan regime factor on ``plan`` (the running plan) at
        ``workload``: its stages' price at their run ratios over their price at their
        startup ratios, over the stages that have both (1.0 when none has). Returns it;
        every later :meth:`ratios` prices startup-measured shapes with it."""
        run, start = self._medians(cm, self.obs, "run"), self._medians(cm, self.startup_obs, "s")
        stages = cm.stage_estimates(plan, workload)[0]
        num = den = 0.0
        for sp in plan.stages:
            k, st = shape(sp), stages.get(sp.stage)
            if st is not None and k in run and k in start:
                num += st.seconds * run[k]
                den += st.seconds * start[k]
        factor = num / den if den > 0 and num > 0 else 1.0
        if factor != self.factor:
            self.factor = factor
            self.version += 1
        return self.factor

    def ratios(self, cm) -> dict[tuple, float]:
        """Per measured shape, the ratio it is priced at: its startup ratio times the
        regime factor where it has startup measurements, else its run ratio (each the
        median of measured / ``cm``'s price)."""
        out = dict(self._medians(cm, self.obs, "run"))
        for k, r in self._medians(cm, self.startup_obs, "s").items():
            out[k] = r * self.factor
        return out

    def record(self, cm) -> dict:
        """The ratios for a decision log, keyed ``stage dpN tpN ppN``, and the regime
        factor (``shape_regime_factor``)."""
        return {
            "shape_ratio": {
                f"{k[0]} dp{k[1]} tp{k[2]} pp{k[3]}": round(v, 3)
                for k, v in sorted(self.ratios(cm).items())
            },
            "shape_regime_factor": round(self.factor, 4),
        }

    def price(self, cm, plan: GlobalPlan, workload, rest_s: float = 0.0):
        """``cm.step_latency(plan, workload, rest_s)`` corrected as :meth:`correct` does,
        the step composed once (an async step's composition simulates the stages' order:
        composing the model's price first, then the corrected one, was a third of a
        boundary's pricing)."""
        rs = self.ratios(cm)
        if not rs:
            return cm.step_latency(plan, workload, rest_s)
        stages, sync = cm.stage_estimates(plan, workload)
        return self._rescaled(cm, plan, workload, stages, sync, rs, rest_s)

    def price_total(self, cm, plan: GlobalPlan, workload, rest_s: float = 0.0) -> float:
        """``price(cm, plan, workload, rest_s).total_s``, bit for bit, without building
        the estimate (see ``CostModel.step_total``)."""
        rs = self.ratios(cm)
        if not rs:
            return cm.step_total(plan, workload, rest_s)
        secs, sync = cm.stage_seconds(plan, workload)
        for sp in plan.stages:
            t, r = secs.get(sp.stage), self._ratio(sp, rs)
            if t is not None and r is not None:
                secs[sp.stage] = t * r
        return compose_total(plan, workload, secs, sync, cm.cluster, rest_s)

    def correct(self, cm, plan: GlobalPlan, workload, est, rest_s: float = 0.0):
        """``est`` (``cm.step_latency(plan, workload, rest_s)``) with each measured
        shape's stage at its measured ratio (its ``stages`` entry too), phases and total
        recomposed as the cost model does."""
        rs = self.ratios(cm)
        if not rs:
            return est
        return self._rescaled(cm, plan, workload, est.stages, est.sync_s, rs, rest_s)

    def _ratio(self, sp: StagePlan, rs: dict) -> float | None:
        """The ratio ``sp``'s stage is priced at (its shape's, else the unmeasured
        factor), or None to keep the model's price."""
        r = rs.get(shape(sp))
        if r is None and self.unmeasured_factor != 1.0:
            r = self.unmeasured_factor
        return r

    def _rescaled(
        self, cm, plan, workload, raw: dict, sync_s: float, rs: dict, rest_s: float = 0.0
    ) -> StepEstimate:
        stages = dict(raw)
        for sp in plan.stages:
            st, r = raw.get(sp.stage), self._ratio(sp, rs)
            if st is not None and r is not None:  # each class scaled alike
                parts = st.by_class
                scaled = (
                    parts.scaled(r)
                    if isinstance(parts, ClassShares)
                    else {c: v * r for c, v in parts.items()}
                )
                stages[sp.stage] = StageEstimate(st.stage, st.seconds * r, scaled)
        secs = {n: e.seconds for n, e in stages.items()}
        total, phases = compose_step(plan, workload, secs, sync_s, cm.cluster, rest_s)
        return StepEstimate(total, phases, stages, sync_s)
