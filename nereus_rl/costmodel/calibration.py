"""What the adaptation loop learns about its own predictions while a job runs.

Two corrections, both measured on the job itself and neither tuned to a trace:

* :class:`TransitionCalibration`: how much longer transitions take than the cost
  model prices them (the DAG's predicted completion covers the primitives only).
* :class:`ModelTolerance`: how far the cost model's step-latency predictions have been
  from the measured step times; the trainer's lookahead treats predicted differences
  smaller than that (capped at the controller's efficiency band) as ties.
"""

from __future__ import annotations

from collections import deque


def _median(xs) -> float:
    r = sorted(xs)
    n = len(r)
    return r[n // 2] if n % 2 else 0.5 * (r[n // 2 - 1] + r[n // 2])


class TransitionCalibration:
    """What transitions take on this job beyond the cost model's price, learned from
    the transitions it has run.

    The DAG's predicted completion prices the primitives; a transition also rebuilds
    the changed stages' models on their new units and runs the executor, a fixed part
    per transition that the price leaves out (on 2 shared cores it is about a tenth of
    a second whatever the price, so a ratio fits badly and an excess fits well).
    Priced low, moves look
    cheap: the urgent path's lookahead prefers a plan that forces a second move soon,
    and payback takes moves whose saving never repays them. The excess is the lower
    median of measured - predicted over the last ``window`` transitions and one prior
    value of 0 (the model's own price): one slow transition alone, such as the first
    use of a layout in a fresh process (its communicators take seconds to make, a
    tenth of a second once made), moves nothing, so it cannot price every later move out of
    reach (a job that then never moves again would never learn otherwise); two
    transitions that agree set the excess. Nothing here is tuned to a trace: with a
    cost model that prices transitions well the excess stays near 0.
    """

    def __init__(self, window: int = 5) -> None:
        if window < 1:
            raise ValueError(f"window={window} must be >= 1")
        self.window = window
        self.excesses: list[float] = []
        self.per_primitive: list[float] = []

    def observe(self, predicted_s: float, measured_s: float, primitives: int = 0) -> None:
        """Record one transition of ``primitives`` primitives (0: not counted per
        primitive); ignored when either time is negative or not a number."""
        if predicted_s >= 0 and measured_s >= 0:
            self.excesses.append(measured_s - predicted_s)
            del self.excesses[: -self.window]
            if primitives > 0:
                self.per_primitive.append(measured_s / primitives)
                del self.per_primitive[: -self.window]

    def floor_s(self, primitives: int) -> float:
        """What a move of ``primitives`` primitives took on this job at the least: that
        many times the lower median of the measured seconds per primitive of its recent
        transitions (0.0 before any).

        The excess (:attr:`excess_s`) needs two transitions that agree before it moves
        off its prior of 0, and a short run makes one or two: without a floor, a move
        whose primitives an earlier move of the same job showed to be slow is still
        priced at the model's (possibly several times lower) price, with too few steps
        left to repay it. Admission's opportunistic path prices a move at no less than
        this (a move it may decline; urgent moves are taken whatever they cost)."""
        if primitives <= 0 or not self.per_primitive:
            return 0.0
        r = sorted(self.per_primitive)
        return primitives * r[(len(r) - 1) // 2]

    @property
    def excess_s(self) -> float:
        """Lower median of the recent measured - predicted and a prior 0 (0.0 with none)."""
        r = sorted([0.0, *self.excesses])
        return r[(len(r) - 1) // 2]

    def price(self, predicted_s: float) -> float:
        """The model's price plus the learned excess (never below 0)."""
        return max(0.0, predicted_s + self.excess_s)


class ModelTolerance:
    """The cost model's recent relative error on step latency.

    Each step's prediction (made with the model refined on the steps before it, for
    the plan that then ran, a new plan included) is compared with the measured step
    time; the tolerance is the median of ``|measured / predicted - 1|`` over the last
    ``window`` steps. Before any such step it is ``prior`` (the trainer passes the
    controller's efficiency band, the error it accepts as "the model agrees"). A
    well-fitted model on a quiet cluster gives a few percent; a shared 2-core machine
    gives tens of percent (mostly load noise that falls on every plan alike).
    """

    def __init__(self, prior: float, window: int = 5, cap: float | None = None) -> None:
        if not prior >= 0:
            raise ValueError(f"prior={prior} must be >= 0")
        if cap is not None and not cap >= 0:
            raise ValueError(f"cap={cap} must be >= 0 or None")
        self.cap = cap
        if window < 1:
            raise ValueError(f"window={window} must be >= 1")
        self.prior = float(prior)
        self.errors: deque[float] = deque(maxlen=window)

    def observe(self, predicted_s: float, measured_s: float) -> None:
        """Record one step; ignored when either time is not positive."""
        if predicted_s > 0 and measured_s > 0:
            self.errors.append(abs(measured_s / predicted_s - 1.0))

    @property
    def value(self) -> float:
        """Median recent relative error (``prior`` with none recorded)."""
        return _median(self.errors) if self.errors else self.prior

    @property
    def margin(self) -> float:
        """:attr:`value` capped at ``cap`` (the band within which predictions count as
        tied; see ``Adapter.tie_margin`` for why it is capped)."""
        return self.value if self.cap is None else min(self.value, self.cap)


class StepNoise:
    """How much the running plan's step time scatters around its price, step to step.

    Each step's residual (measured minus the whole predicted step) is kept with the plan
    that ran; the noise is the scaled median absolute deviation (a standard deviation
    robust to one slow step) of the current plan's last ``window`` residuals. A
    candidate's price rests on about one measurement of its shapes (a startup probe), so
    a predicted saving per step smaller than this scatter is not known to be a saving:
    admission declines it (``Admission.decide(noise_s=...)``). With fewer than
    ``min_steps`` steps on the plan there is no estimate (0.0: no guard).
    """

    def __init__(self, window: int = 6, min_steps: int = 3) -> None:
        if window < 2 or min_steps < 2 or min_steps > window:
            raise ValueError(
                f"window={window}, min_steps={min_steps}: need 2 <= min_steps <= window"
            )
        self.min_steps = min_steps
        self.obs: deque[tuple[object, float]] = deque(maxlen=window)

    def observe(self, plan, predicted_s: float, measured_s: float) -> None:
        """Record one step of ``plan``; ignored when either time is not positive."""
        if predicted_s > 0 and measured_s > 0:
            self.obs.append((plan, measured_s - predicted_s))

    def steps(self, plan) -> int:
        """How many of the recent steps ran ``plan``."""
        return sum(p == plan for p, _ in self.obs)

    def known(self, plan) -> bool:
        """Whether ``plan`` has the ``min_steps`` recent steps an estimate needs."""
        return self.steps(plan) >= self.min_steps

    def noise_s(self, plan) -> float:
        """The robust standard deviation of ``plan``'s recent residuals (0.0: too few)."""
        rs = [r for p, r in self.obs if p == plan]
        if len(rs) < self.min_steps:
            return 0.0
        med = _median(rs)
        return 1.4826 * _median([abs(r - med) for r in rs])
