"""What the adaptation loop learns about its own predictions while a job runs.

Two corrections, both measured on the job itself and neither tuned to a trace:

* :class:`TransitionCalibration`: how much longer transitions take than the cost
  model prices them (the DAG's predicted completion covers the primitives only).
* :class:`ModelTolerance`: how far the cost model's step-latency predictions have been
  from the measured step times; predicted differences smaller than that are not
  evidence, so the lookahead treats them as ties and payback does not count them.
"""

from __future__ import annotations

from collections import deque


def _median(xs) -> float:
    r = sorted(xs)
    n = len(r)
    return r[n // 2] if n % 2 else 0.5 * (r[n // 2 - 1] + r[n // 2])


class TransitionCalibration:
    """Scale from the cost model's predicted transition seconds to what transitions
    take on this job, learned from the transitions it has run.

    The DAG's predicted completion prices the primitives only; a transition also
    rebuilds the changed stages' models on their new units and runs the executor, and
    on a loaded machine the primitives themselves take longer than priced (a run on 2
    shared cores measured 1.5-12x the prediction). Priced low, transitions look
    cheaper than they are: the urgent path's lookahead prefers a plan that forces a
    second move soon, and payback takes moves whose saving never repays them. The
    scale is the median of measured / predicted over the last ``window`` transitions
    (the median, so that one slow outlier, such as a layout's first communicator
    setup, does not make every later move look too dear); 1.0 before any (the model's
    own prices). Nothing here is tuned to a trace: with a cost model that prices
    transitions well the scale stays near 1.
    """

    def __init__(self, window: int = 5) -> None:
        if window < 1:
            raise ValueError(f"window={window} must be >= 1")
        self.window = window
        self.ratios: list[float] = []

    def observe(self, predicted_s: float, measured_s: float) -> None:
        """Record one transition; ignored when either time is not positive."""
        if predicted_s > 0 and measured_s > 0:
            self.ratios.append(measured_s / predicted_s)
            del self.ratios[: -self.window]

    @property
    def scale(self) -> float:
        """Median measured / predicted of the recent transitions (1.0 with none)."""
        return _median(self.ratios) if self.ratios else 1.0


class ModelTolerance:
    """The cost model's recent relative error on step latency.

    Each step's prediction (made with the model refined on the steps before it, for
    the plan that then ran, a new plan included) is compared with the measured step
    time; the tolerance is the median of ``|measured / predicted - 1|`` over the last
    ``window`` steps. Before any such step it is ``prior`` (the trainer passes the
    controller's efficiency band, the error it accepts as "the model agrees"). A
    well-fitted model on a quiet cluster gives a few percent; a shared 2-core machine
    gives tens of percent, and then a predicted 3% saving is noise, not a reason to
    move.
    """

    def __init__(self, prior: float, window: int = 5) -> None:
        if not prior >= 0:
            raise ValueError(f"prior={prior} must be >= 0")
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
