"""Stage shapes priced as they measured on the job, where the cost model misprices them.

The cost model fits one efficiency per operation class over every measurement, so a
stage shape (stage, dp, tp, pp) whose real cost does not follow the model's structure
stays mispriced however often it runs. bench_e2e's model check (GRPO sync quick, load
9-12, benchmarks/results/bench_e2e_2026-12-02.md) priced a dp 1 actor training at
0.150 s and a pp 2 one at 0.128 s where they measured 0.038 s and 0.027 s, and a
dp 2 one at 0.092 s against 0.058 s measured (on 4 workers over 2 busy cores a dp 2
training gains no parallelism and pays its all-reduce), so the planner ranked the plan
that measured fastest 6th of 9.

:class:`ShapeCorrection` keeps, per stage shape, the recent measurements of that
stage (the plan, workload and measured seconds, from the startup probes and every
step), and prices a stage of a measured shape at the model's price times the median
ratio measured / model's price of those measurements, the ratio taken against the
model as it is now (the model keeps refining; a ratio taken once would go stale).
A shape never measured keeps the model's price. Phases are composed as the cost model
composes them (stages sharing devices add up, groups on other devices overlap).
"""

from __future__ import annotations

import statistics
from collections import defaultdict, deque
from dataclasses import replace

from nereus_rl.costmodel import StageEstimate, compose_phases
from nereus_rl.globalplan import GlobalPlan, StagePlan


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
        self._cache: tuple[tuple, dict[tuple, float]] | None = None

    def observe(self, plan: GlobalPlan, workload, measured: dict[str, float]) -> None:
        """Record one step's measured seconds per stage (``stage_seconds``'s form) under
        ``plan``; stages not in the plan and non-positive times are ignored."""
        for sp in plan.stages:
            t = measured.get(sp.stage)
            if t is not None and t > 0:
                self.obs[shape(sp)].append((plan, workload, float(t)))
        self._cache = None

    def ratios(self, cm) -> dict[tuple, float]:
        """Per measured shape, the median of measured / ``cm``'s price (cached per model
        version)."""
        # (the adapter rebuilds its model after calibration: the key names the model too)
        ver = (id(cm), getattr(cm, "version", None))
        if self._cache is not None and ver[1] is not None and self._cache[0] == ver:
            return self._cache[1]
        out = {}
        for key, rows in self.obs.items():
            rs = []
            for plan, wl, t in rows:
                st = cm.step_latency(plan, wl).stages.get(key[0])
                if st is not None and st.seconds > 0:
                    rs.append(t / st.seconds)
            if rs:
                out[key] = statistics.median(rs)
        if ver[1] is not None:
            self._cache = (ver, out)
        return out

    def record(self, cm) -> dict:
        """The ratios for a decision log, keyed ``stage dpN tpN ppN``."""
        return {
            "shape_ratio": {
                f"{k[0]} dp{k[1]} tp{k[2]} pp{k[3]}": round(v, 3)
                for k, v in sorted(self.ratios(cm).items())
            }
        }

    def correct(self, cm, plan: GlobalPlan, workload, est):
        """``est`` (``cm.step_latency(plan, workload)``) with each measured shape's stage
        at its measured ratio (its ``stages`` entry too), phases and total recomposed
        as the cost model does."""
        rs = self.ratios(cm)
        if not rs:
            return est
        stages = dict(est.stages)
        for sp in plan.stages:
            st, r = est.stages.get(sp.stage), rs.get(shape(sp))
            if st is not None and r is not None:  # each class scaled alike
                stages[sp.stage] = StageEstimate(
                    st.stage, st.seconds * r, {c: v * r for c, v in st.by_class.items()}
                )
        phases = compose_phases(plan, workload, {n: e.seconds for n, e in stages.items()})
        return replace(est, total_s=sum(phases), phase_s=phases, stages=stages)
