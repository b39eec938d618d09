"""bench_costmodel's CPU figure of a plan from its repetitions (see bench_costmodel.py).

Per round, per process: the sum of each part's fastest repetition (or the fastest whole
step), optionally rescaled to the run's typical host speed by the optimizer step's
time in that round (``speed_refs``); then the slower process; then the median over the
rounds.
"""

from __future__ import annotations

import numpy as np


def cpu_estimate(reps, estimator: str, ref: float | None = None) -> float:
    """CPU seconds of one step from its repetitions, per process, then the slower process.

    ``step``: each process's fastest repetition; ``parts``: the sum over the step's parts
    (micro-batches, optimizer step) of each part's fastest repetition. Taking the slower
    process per repetition first would add the maximum of two independent noises (each
    process's core has its own other load and steal) to every two-process figure: a bias
    that a one-process figure does not have and that a model would learn as
    interference. Every repetition starts both processes at a barrier, so each one's
    fastest still ran beside the other.

    ``ref`` (host-speed probe, see ``speed_refs``): each process's figure is scaled by
    ``ref`` over that process's fastest optimizer part in these repetitions, i.e. to the
    figure it would have had at the run's typical host speed.
    """
    if any("cpu_each" not in r for r in reps):  # saved outputs without per-process figures
        return min(r["cpu"] for r in reps)
    num = len(reps[0]["cpu_each"])
    if estimator == "step":
        each = [min(r["cpu_each"][k] for r in reps) for k in range(num)]
    else:
        each = [float(np.min([r["parts_each"][k] for r in reps], axis=0).sum()) for k in range(num)]
    if ref is not None:
        each = [e * ref / min(r["parts_each"][k][-1] for r in reps) for k, e in enumerate(each)]
    return max(each)


def has_probe(reps) -> bool:
    """Whether repetitions carry each process's parts, the optimizer step last after at
    least one micro-batch (every output since per-process parts were recorded)."""
    return all("parts_each" in r and len(r["parts_each"][0]) >= 2 for r in reps)


def speed_refs(measured) -> dict:
    """Host-speed reference per (preset, layout): the median, over every round, process
    and plan of that preset and layout, of the optimizer part's fastest repetition.

    The optimizer step (AdamW over the same parameters, zero_grad) is the same work in
    every such plan, and a round's optimizer part moves with its micro-batches
    (correlation 0.6-0.95 per plan over 32 rounds), so it tells how fast the host ran in
    that round. A measurement common to fit and held-out plans: no model, no error.
    ``{}`` for outputs without per-process parts (then every figure is raw).
    """
    opt: dict = {}
    for (preset, _, _, lay), reps in measured:
        if not reps or not has_probe(reps):
            return {}
        per_round: dict = {}
        for r in reps:
            per_round.setdefault(r["round"], []).append(r)
        for got in per_round.values():
            for k in range(len(got[0]["parts_each"])):
                opt.setdefault((preset, lay), []).append(min(r["parts_each"][k][-1] for r in got))
    return {key: float(np.median(v)) for key, v in opt.items()}


def iqr_pct(xs) -> float:
    """Interquartile range of ``xs`` in % of their median."""
    q1, q2, q3 = np.percentile(xs, [25, 50, 75])
    return float(100.0 * (q3 - q1) / q2)


def median_over_rounds(use, estimator: str, ref: float | None = None) -> tuple[float, float]:
    """(CPU, wall) seconds of a plan: each round's figure from that round's repetitions
    (CPU: ``cpu_estimate``, at the reference host speed ``ref`` when given; wall: the
    fastest), then the median over the rounds."""
    per_round: dict = {}
    for r in use:
        per_round.setdefault(r["round"], []).append(r)
    cpu = [cpu_estimate(got, estimator, ref) for got in per_round.values()]
    wall = [min(r["wall"] for r in got) for got in per_round.values()]
    return float(np.median(cpu)), float(np.median(wall))
