"""The part of a step's time the cost model does not price, measured on the job.

The cost model is fitted to the stages' own seconds (rollout and training as the
workers time them, inference as the driver does) and sums them by phase. A step also
holds what no stage time holds: the driver's RPC to every worker of every stage, the
split of the batch over a stage's units and the gather of their replies, the reward
scoring, the memory query. On CPU workers that rest is a sizeable part of a short
step, and it grows with the number of worker calls a step makes (a dp 2 reference's
inference phase takes longer than a dp 1's where the model prices both alike): without
it the model ranks a plan with more calls level with one with fewer, and adaptation
moves to it (``bench_e2e.py``'s model check shows the residual per plan).

:class:`StepOverhead` fits the whole step's residual (measured step seconds minus the
model's prediction for the plan that ran) as ``a + b * calls`` over the recent steps
and startup probes, ``calls`` being the worker calls one step makes (each stage calls
each of its workers). ``b`` (never below 0) separates plans; ``a`` is common to all
of them and only moves the efficiency signal's ratio to where the unpriced rest is
counted. Nothing is tuned to a trace: with no observation, or a model that prices
everything, both are 0.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Any

from nereus_rl.core.globalplan import GlobalPlan


def worker_calls(plan: GlobalPlan) -> int:
    """Worker calls one step makes under ``plan``: each stage's workers, summed."""
    return sum(len(sp.devices) for sp in plan.stages)


class StepOverhead:
    """Least-squares fit of step residual = ``a + b * worker_calls(plan)``.

    Arguments:
        window: how many recent (plan, residual) observations the fit uses.

    Raises:
        ValueError: ``window`` below 2.
    """

    def __init__(self, window: int = 20) -> None:
        if window < 2:
            raise ValueError(f"window={window} must be >= 2 (a line needs two points)")
        self.window = window
        self.obs: deque[tuple[int, float]] = deque(maxlen=window)
        self.version = 0  # bumps on every observation (PricedModel's memo keys on it)
        # (version, fit): the fit is read once per priced plan, hundreds of times per
        # boundary, and the observations change once per step
        self._coef: tuple[int, tuple[float, float]] | None = None

    def observe(self, plan: GlobalPlan, predicted_s: float, measured_s: float) -> None:
        """Record one step of ``plan``: measured minus predicted (ignored when either is
        not positive)."""
        if predicted_s > 0 and measured_s > 0:
            self.obs.append((worker_calls(plan), measured_s - predicted_s))
            self.version += 1

    @property
    def coef(self) -> tuple[float, float]:
        """(a, b): the fit; b is 0 when every observation has one call count or the
        slope comes out negative (then a is the mean residual)."""
        got = self._coef
        if got is not None and got[0] == self.version:
            return got[1]
        fit = self._fit()
        self._coef = (self.version, fit)
        return fit

    def _fit(self) -> tuple[float, float]:
        if not self.obs:
            return 0.0, 0.0
        xs = [float(x) for x, _ in self.obs]
        ys = [y for _, y in self.obs]
        n = len(xs)
        mx, my = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        if sxx == 0:
            return my, 0.0
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
        if b <= 0:
            return my, 0.0
        return my - b * mx, b

    def predict(self, plan: GlobalPlan) -> float:
        """The fitted residual for one step of ``plan`` (seconds; may be negative when the
        model over-prices every plan)."""
        a, b = self.coef
        return a + b * worker_calls(plan)

    def spread(self, plan: GlobalPlan) -> float:
        """The plan-dependent part only, ``b * calls`` (what ranking plans uses)."""
        return self.coef[1] * worker_calls(plan)

    def record(self) -> dict:
        """The fit for a decision log: a, b and the observations it rests on."""
        a, b = self.coef
        return {"overhead_a_s": a, "overhead_b_s_per_call": b, "overhead_obs": len(self.obs)}


# (plan, workload) estimates a PricedModel keeps between changes of what prices them
MEMO_SIZE = 8192


class PricedModel:
    """``costmodel`` with measured stage shapes at their measured price (``shapes``, a
    :class:`~nereus_rl.costmodel.shape_correction.ShapeCorrection`, optional) and
    :meth:`StepOverhead.spread` added to each step latency's total; an asynchronous
    step instead holds the whole fitted rest on its chain of stages (:meth:`chain_rest`),
    where the rollout sent ahead may hide it.

    What the decisions compare plans with (the planner's candidates, lookahead's
    scores, admission's saving), so that they rank plans alike; everything else
    (memory, primitives, observe) is the cost model's own.
    """

    def __init__(self, costmodel, overhead: StepOverhead, shapes=None) -> None:
        self._cm = costmodel
        self._overhead = overhead
        self._shapes = shapes
        # (plan, workload) -> step_latency while the model, the overhead fit and the
        # shape ratios stay as they were (their versions): one boundary's decisions
        # price the same candidates at the same lengths again and again (the planner's
        # k-best, the lookahead's horizon, admission), 60-70% of a PPO boundary's time
        self._memo: dict[tuple, Any] = {}
        self._totals: dict[tuple, float] = {}  # the same, for step_total
        self._token: tuple | None = None

    def stage_price(self, plan: GlobalPlan, workload, rest_s: float = 0.0):
        """The model's estimate with measured shapes corrected, without the overhead
        (with ``rest_s`` on an asynchronous step's chain: see ``overlapped_step``)."""
        if self._shapes is not None:
            return self._shapes.price(self._cm, plan, workload, rest_s)
        return self._cm.step_latency(plan, workload, rest_s)

    def chain_rest(self, plan: GlobalPlan, workload) -> float | None:
        """The driver's rest an asynchronous step spends on its chain of stages: the
        whole fitted rest (``StepOverhead.predict``, not below 0), which the rollout
        sent ahead hides on some plans and not on others, so its common part ``a`` too
        tells plans apart; None for a synchronous step (there the plan-dependent part,
        ``spread``, is added to the total).
        """
        if not workload.rollout_ahead:
            return None
        return max(0.0, self._overhead.predict(plan))

    def step_whole(self, plan: GlobalPlan, workload) -> float:
        """The step as it is measured: the stages' price and the whole fitted rest
        (``predict``: ``a`` included), the rest on an asynchronous step's chain.
        What the efficiency signal compares a measured step with."""
        rest = self.chain_rest(plan, workload)
        if rest is None:
            return self.stage_price(plan, workload).total_s + self._overhead.predict(plan)
        return self.stage_price(plan, workload, rest).total_s

    def _current_token(self) -> tuple:
        """What the memos key on; they are emptied when it changes (or fill up)."""
        shapes = self._shapes
        token = (
            getattr(self._cm, "version", None),
            self._overhead.version,
            None if shapes is None else shapes.version,
        )
        if (
            token != self._token
            or token[0] is None
            or len(self._memo) >= MEMO_SIZE
            or len(self._totals) >= MEMO_SIZE
        ):
            self._memo.clear()
            self._totals.clear()
            self._token = token
        return token

    def step_total(self, plan: GlobalPlan, workload) -> float:
        """``step_latency(plan, workload).total_s``, bit for bit, without building the
        estimate (ranking and the lookahead read the total only)."""
        token = self._current_token()
        key = (plan, workload)
        total = self._totals.get(key)
        if total is None:
            est = self._memo.get(key)
            if est is not None:
                return est.total_s
            rest = self.chain_rest(plan, workload)
            r = 0.0 if rest is None else rest
            if self._shapes is not None:
                total = self._shapes.price_total(self._cm, plan, workload, r)
            else:
                total = self._cm.step_total(plan, workload, r)
            if rest is None:
                total = total + self._overhead.spread(plan)
            if token[0] is not None:  # a model without versions is never memoized
                self._totals[key] = total
        return total

    def step_latency(self, plan: GlobalPlan, workload):
        """The corrected estimate with the measured per-call overhead in ``total_s``."""
        token = self._current_token()
        key = (plan, workload)
        est = self._memo.get(key)
        if est is None:
            rest = self.chain_rest(plan, workload)
            if rest is None:
                est = self.stage_price(plan, workload)
                est = replace(est, total_s=est.total_s + self._overhead.spread(plan))
            else:
                est = self.stage_price(plan, workload, rest)
            if token[0] is not None:  # a model without versions is never memoized
                self._memo[key] = est
        return est

    def __getattr__(self, name: str):
        return getattr(self._cm, name)
