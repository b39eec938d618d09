"""Controller signals: what the running job watches, when it triggers, and forecasts.

Four signals, each with levels separated by thresholds and a hysteresis band so that a
value hovering near a threshold does not trigger again and again:

    seq_len       the step's response length (e.g. its p90) in the workload's buckets;
                  the level is the bucket the planner plans for.
    devices       the number of available devices (any change triggers; a loss of a
                  device the plan uses makes the current plan infeasible: urgent).
    memory        predicted or measured peak memory / capacity: levels low/ok/high.
    efficiency    measured / predicted step time: levels fast/ok/slow (the cost model
                  is off; refine it and replan).

Each signal forecasts the steps until it next crosses a threshold from its recent
history: a least-squares line through the last ``window`` values, extrapolated to the
next threshold in the direction of the slope (``horizon`` steps when flat or when the
line never reaches it). Devices forecast from the mean interval between past changes.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from nereus_rl.core.workload import DEFAULT_BUCKETS, bucket_of


class SignalError(ValueError):
    """Bad signal configuration or observation."""


@dataclass(frozen=True)
class Trigger:
    """A signal crossed a threshold at ``step``."""

    signal: str
    step: int
    value: float
    old_level: int
    new_level: int
    urgent: bool
    reason: str

    def __repr__(self) -> str:
        return f"Trigger({self.signal}@{self.step}: {self.reason})"


@dataclass(frozen=True)
class Forecast:
    """Steps until ``signal`` is expected to cross ``threshold`` next."""

    signal: str
    steps: float
    slope_per_step: float
    threshold: float | None

    def __repr__(self) -> str:
        return f"Forecast({self.signal}: {self.steps:.3g} steps to {self.threshold})"


class LevelSignal:
    """A scalar signal with sorted thresholds, hysteresis and a trend forecast.

    Level ``i`` holds values in ``(edges[i-1], edges[i]]`` (level 0 below ``edges[0]``,
    level ``len(edges)`` above the last). The level moves up when a value exceeds
    ``edges[level] * (1 + hysteresis)`` and down when it falls to
    ``edges[level-1] * (1 - hysteresis)`` or below.

    With ``smooth`` > 1 the level follows the median of the last ``smooth`` values
    (those since the last :meth:`reset_trend`), not the last value alone: one step
    that an outside cause slowed or sped up then moves no level, and a change that
    lasts moves it one or two steps late. The trend and the forecast still use every
    value.

    Arguments:
        name: signal name.
        edges: increasing positive thresholds.
        hysteresis: relative band around each threshold.
        window: values used for the trend.
        horizon: forecast when no crossing is in sight (steps).
        smooth: values whose median sets the level (1: the last value alone).
    """

    def __init__(
        self,
        name: str,
        edges: Sequence[float],
        *,
        hysteresis: float = 0.1,
        window: int = 10,
        horizon: float = 200.0,
        smooth: int = 1,
    ) -> None:
        if not edges or any(b <= a for a, b in itertools.pairwise(edges)) or edges[0] <= 0:
            raise SignalError(f"{name}: edges {list(edges)} must be positive and increasing")
        if not 0 <= hysteresis < 1:
            raise SignalError(f"{name}: hysteresis={hysteresis} must be in [0, 1)")
        if smooth < 1:
            raise SignalError(f"{name}: smooth={smooth} must be >= 1 (1: no smoothing)")
        self.name = name
        self.edges = tuple(float(e) for e in edges)
        self.hysteresis = hysteresis
        self.horizon = horizon
        self.smooth = smooth
        self.history: deque[tuple[int, float]] = deque(maxlen=max(2, window, smooth))
        self.level: int | None = None

    def _raw_level(self, v: float) -> int:
        for i, e in enumerate(self.edges):
            if v <= e:
                return i
        return len(self.edges)

    def up_threshold(self) -> float | None:
        if self.level is None or self.level >= len(self.edges):
            return None
        return self.edges[self.level] * (1 + self.hysteresis)

    def down_threshold(self) -> float | None:
        if self.level is None or self.level == 0:
            return None
        return self.edges[self.level - 1] * (1 - self.hysteresis)

    def update(self, step: int, value: float) -> Trigger | None:
        """Record ``value`` at ``step``; a Trigger when the level changes (not on the first)."""
        if value < 0 or math.isnan(value):
            raise SignalError(f"{self.name}: value {value} at step {step} must be >= 0")
        self.history.append((step, float(value)))
        if self.smooth > 1:
            value = statistics.median(v for _, v in itertools.islice(
                reversed(self.history), self.smooth))  # fmt: skip
        if self.level is None:
            self.level = self._raw_level(value)
            return None
        old = self.level
        up, down = self.up_threshold(), self.down_threshold()
        if (up is not None and value > up) or (down is not None and value <= down):
            self.level = self._raw_level(value)
        if self.level == old:
            return None
        word = "rose above" if self.level > old else "fell below"
        thr = up if self.level > old else down
        what = self.name if self.smooth == 1 else f"{self.name} (median of the last {self.smooth})"
        return Trigger(
            self.name,
            step,
            value,
            old,
            self.level,
            False,
            f"{what} {value:.4g} {word} {thr:.4g} (level {old} -> {self.level})",
        )

    def reset_trend(self) -> None:
        """Forget the values behind the trend (the level stays).

        For a signal whose values depend on the running plan (peak memory, efficiency):
        after a plan change the old plan's values say nothing about the new plan's
        trend, and a line fitted through both forecasts a crossing far too late.
        """
        self.history.clear()

    def slope(self) -> float:
        """Least-squares slope of the recent values per step (0 with < 2 values)."""
        pts = list(self.history)
        if len(pts) < 2:
            return 0.0
        n = len(pts)
        mx = sum(s for s, _ in pts) / n
        my = sum(v for _, v in pts) / n
        sxx = sum((s - mx) ** 2 for s, _ in pts)
        if sxx == 0:
            return 0.0
        return sum((s - mx) * (v - my) for s, v in pts) / sxx

    def forecast(self) -> Forecast:
        """Steps until the trend line reaches the next threshold in its direction."""
        k = self.slope()
        if not self.history:
            return Forecast(self.name, self.horizon, 0.0, None)
        pts = list(self.history)
        n = len(pts)
        mx = sum(s for s, _ in pts) / n
        my = sum(v for _, v in pts) / n
        last_step = pts[-1][0]
        fitted = my + k * (last_step - mx)
        thr = self.up_threshold() if k > 0 else self.down_threshold() if k < 0 else None
        if thr is None or k == 0:
            return Forecast(self.name, self.horizon, k, thr)
        steps = (thr - fitted) / k
        steps = min(self.horizon, max(1.0, steps))
        return Forecast(self.name, steps, k, thr)

    def project(self, steps_ahead: float) -> float | None:
        """The trend line's value ``steps_ahead`` steps after the last value (None: no values).

        The line is the same least-squares fit :meth:`forecast` uses; the result is
        never negative. With a single value the trend is flat (that value).
        """
        if steps_ahead < 0 or math.isnan(steps_ahead):
            raise SignalError(f"{self.name}: steps_ahead={steps_ahead} must be >= 0")
        pts = list(self.history)
        if not pts:
            return None
        n = len(pts)
        mx = sum(s for s, _ in pts) / n
        my = sum(v for _, v in pts) / n
        fitted = my + self.slope() * (pts[-1][0] - mx)
        return max(0.0, fitted + self.slope() * steps_ahead)


class SeqLenSignal(LevelSignal):
    """Response length in buckets; ``bucket`` is the length to plan for."""

    def __init__(self, buckets: Sequence[int] = DEFAULT_BUCKETS, **kw) -> None:
        super().__init__("seq_len", buckets, **kw)
        self.buckets = tuple(buckets)

    @property
    def bucket(self) -> int | None:
        if self.level is None:
            return None
        if self.level < len(self.buckets):
            return self.buckets[self.level]
        return bucket_of(max(v for _, v in self.history), self.buckets)

    def forecast_lengths(self, horizon: int) -> tuple[int, ...]:
        """Bucketed response lengths for the ``horizon`` values after the last one.

        Entry ``j`` is the trend line ``j + 1`` steps after the last value, bucketed as
        the planner plans (``bucket_of``). Only a rising trend moves the forecast: a
        flat or falling one repeats the last value's bucket, since a plan must still
        hold the length it has now (falling lengths are the opportunistic path's
        business). Nothing here reads future lengths; it is the signal's own history.

        Raises:
            SignalError: ``horizon`` < 0, or no value recorded yet.
        """
        if horizon < 0:
            raise SignalError(f"seq_len: horizon={horizon} must be >= 0")
        if not self.history:
            raise SignalError("seq_len: no value recorded yet; update() before forecasting")
        last = self.history[-1][1]
        out = []
        for j in range(1, horizon + 1):
            v = max(last, self.project(j) or 0.0)
            out.append(bucket_of(v, self.buckets))
        return tuple(out)


class DevicesSignal:
    """Available devices. Any change triggers; losing a device the plan uses is urgent."""

    name = "devices"

    def __init__(self, horizon: float = 200.0) -> None:
        self.available: frozenset[int] | None = None
        self.changes: list[int] = []
        self.horizon = horizon
        self._first_step: int | None = None
        self._last_step: int | None = None

    def update(
        self, step: int, available: Iterable[int], in_use: Iterable[int] = ()
    ) -> Trigger | None:
        """Record the available device ids; a Trigger when the set changed."""
        now = frozenset(available)
        if self._first_step is None:
            self._first_step = step
        self._last_step = step
        old = self.available
        self.available = now
        if old is None or now == old:
            return None
        self.changes.append(step)
        lost, gained = sorted(old - now), sorted(now - old)
        urgent = bool(set(lost) & set(in_use))
        parts = []
        if lost:
            parts.append(f"lost {len(lost)} device(s) {lost[:8]}")
        if gained:
            parts.append(f"gained {len(gained)} device(s) {gained[:8]}")
        if urgent:
            parts.append("the current plan uses a lost device")
        return Trigger(self.name, step, len(now), len(old), len(now), urgent, "; ".join(parts))

    def forecast(self) -> Forecast:
        """Mean steps between past changes (``horizon`` with fewer than one change)."""
        if not self.changes or self._first_step is None:
            return Forecast(self.name, self.horizon, 0.0, None)
        span = self._last_step - self._first_step + 1
        return Forecast(self.name, max(1.0, span / len(self.changes)), 0.0, None)


class Controller:
    """All four signals together.

    Arguments:
        buckets: response-length bucket edges.
        hysteresis: relative band of the seq_len signal.
        memory_edges: (low, high) fractions of capacity.
        efficiency_edges: (fast, slow) ratios of measured to predicted time.
        window, horizon: trend window and the forecast cap, in steps.
        efficiency_smooth: steps whose median ratio sets the efficiency level (see
            :class:`LevelSignal`). On shared cores one step's ratio can cross a band
            every second or third step, each crossing an opportunistic search that
            moves nowhere; a median of a few steps ignores single noisy steps, and a
            model that stays off (a mispriced plan) still triggers, a step later.
    """

    def __init__(
        self,
        *,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        hysteresis: float = 0.1,
        memory_edges: tuple[float, float] = (0.5, 0.95),
        efficiency_edges: tuple[float, float] = (0.85, 1.15),
        window: int = 10,
        horizon: float = 200.0,
        efficiency_smooth: int = 3,
    ) -> None:
        self.seq_len = SeqLenSignal(buckets, hysteresis=hysteresis, window=window, horizon=horizon)
        self.devices = DevicesSignal(horizon)
        self.memory = LevelSignal(
            "memory", memory_edges, hysteresis=0.02, window=window, horizon=horizon
        )
        self.efficiency = LevelSignal(
            "efficiency", efficiency_edges, hysteresis=0.02, window=window, horizon=horizon,
            smooth=efficiency_smooth,
        )  # fmt: skip
        self.triggers: list[Trigger] = []

    def update(
        self,
        step: int,
        *,
        seq_len: float | None = None,
        current_seq_len: float | None = None,
        available_devices: Iterable[int] | None = None,
        in_use: Iterable[int] = (),
        peak_memory_fraction: float | None = None,
        efficiency_ratio: float | None = None,
    ) -> list[Trigger]:
        """Feed one step's observations; returns the triggers it raised.

        ``seq_len`` is the length the next step will run (the trainer feeds the next
        step's length limit at each boundary, keyed by the boundary's step).
        ``current_seq_len``, the length of the step that just ran, is recorded (keyed
        ``step - 1``) only while the seq_len signal has no value yet: at the first
        boundary the signal then holds two lengths the run has actually seen, so its
        first forecast has a trend. Without it the first forecast is flat (one value),
        and the first urgent move of a rising run cannot look ahead: it takes the plan
        that just fits the next step and moves again one or two steps later. (No
        future length is read: the schedule's later values stay unknown here.)

        A memory fraction above 1 (the plan no longer fits) is urgent.
        """
        out = []
        if current_seq_len is not None and seq_len is not None and not self.seq_len.history:
            # Sets the level from the running step's length; a level change at ``step``
            # is then a trigger like any other.
            self.seq_len.update(step - 1, current_seq_len)
        if seq_len is not None and (t := self.seq_len.update(step, seq_len)):
            out.append(t)
        if available_devices is not None and (
            t := self.devices.update(step, available_devices, in_use)
        ):
            out.append(t)
        if peak_memory_fraction is not None:
            t = self.memory.update(step, peak_memory_fraction)
            if peak_memory_fraction > 1.0:
                # Over capacity is urgent whether or not the level changed: a fraction
                # that climbs from 0.96 to 1.1 stays in the "high" level and would
                # otherwise let the plan run over budget unnoticed.
                level = self.memory.level
                t = Trigger(
                    "memory", step, peak_memory_fraction,
                    t.old_level if t else level, level, True,
                    t.reason if t else (
                        f"predicted peak memory {peak_memory_fraction:.2f}x capacity: "
                        "the plan no longer fits"
                    ),
                )  # fmt: skip
            if t:
                out.append(t)
        if efficiency_ratio is not None and (t := self.efficiency.update(step, efficiency_ratio)):
            out.append(t)
        self.triggers.extend(out)
        return out

    @property
    def model_tolerance(self) -> float:
        """The relative error of the cost model that the efficiency signal accepts as
        agreement (the wider side of its "ok" band: 0.15 for the default 0.85..1.15).
        Predicted differences smaller than this are within what the model is trusted
        to; the trainer's lookahead treats them as ties."""
        lo, hi = self.efficiency.edges[0], self.efficiency.edges[-1]
        return max(1.0 - lo, hi - 1.0, 0.0)

    def plan_changed(self) -> None:
        """Call after a transition: the plan-dependent signals (memory, efficiency)
        start their trends afresh under the new plan; levels and thresholds stay."""
        self.memory.reset_trend()
        self.efficiency.reset_trend()

    def forecast(self, signal: str) -> Forecast:
        """The forecast of one signal by name (``seq_len``, ``devices``, ``memory``, ...)."""
        sig = {
            "seq_len": self.seq_len,
            "devices": self.devices,
            "memory": self.memory,
            "efficiency": self.efficiency,
        }.get(signal)
        if sig is None:
            raise SignalError(
                f"unknown signal {signal!r}; use seq_len, devices, memory or efficiency"
            )
        return sig.forecast()
