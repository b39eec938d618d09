"""Scoring of bench_costmodel's measurements: the fit/held-out split, the model's errors,
and how large the measurement noise is beside them (see bench_costmodel.py).

Why a noise floor: on a shared 2-vCPU virtual machine a plan's figure moves by ~25-35%
from one round to the next, and the held-out error of a single run mixes the model's own
(systematic) error with that noise, twice: in the held-out plan's figure and in the fit
set's. Three estimates are printed beside the error, none of which needs a model:

* twins: plans whose work is identical (on 2 processes, micro-batch 8 is capped at the 4
  sequences a process gets, so ``mb 4`` and ``mb 8`` run the same steps): how far apart
  the bench measures the same work. With independent noise of s.d. ``s`` on each figure
  the pair differs by ~1.4 ``s`` and a perfect model is off by ~``s``: 0.7x of it.
* split halves: every plan's figure from the even rounds against the odd rounds', and
  the held-out error when the model is fitted and scored within each half.
* runs (several ``--measurements`` files): each held-out plan's error, averaged over the
  runs; the part of it that persists (the same plan mispredicted the same way in every
  run) is the model's, what averages out is noise. ``pooled`` scores every plan's figure
  over all the runs' repetitions (a minimum over more rounds).
"""

from __future__ import annotations

import math

import numpy as np

from nereus_rl.core.spec import local_cpu_cluster
from nereus_rl.costmodel.costmodel import CostModel
from nereus_rl.costmodel.work import CLASS_INDEX

EFF_CLASSES = ("gemm", "attention", "mem", "elementwise", "launch", "interference", "contention")


def grid_of(rows: list[dict]) -> dict:
    """Micro-batches and sequence lengths measured per preset (the grid of the run)."""
    grid: dict = {}
    for r in rows:
        mbs, seqs = grid.setdefault(r["preset"], (set(), set()))
        mbs.add(r["micro_batch"])
        seqs.add(r["seq_len"])
    return {p: (sorted(m), sorted(s)) for p, (m, s) in grid.items()}


def is_fit(row: dict, grid: dict, fit: str) -> bool:
    """Fit set: half of the 1-process plans (a checkerboard over micro-batch x seq_len)
    and, with ``fit == "mixed"``, a quarter of each 2-process layout's (every other cell
    of that checkerboard): co-runners cannot be learnt from one process. Fixed by the
    grid, never chosen by the errors."""
    mbs, seqs = grid[row["preset"]]
    i, j = mbs.index(row["micro_batch"]), seqs.index(row["seq_len"])
    if row["layout"] == "1p":
        return (i + j) % 2 == 0
    return fit == "mixed" and (i + j) % 4 == 0


def score(rows: list[dict], works: dict, fit: str, layouts) -> tuple[list[dict], dict]:
    """Fit each measure on the fit plans, predict every plan; sets ``role``,
    ``<metric>_predicted_ms`` and ``<metric>_error_pct`` on the rows.

    Arguments:
        rows: one per plan, with ``<measure>_measured_ms``.
        works: ``metric -> (row index -> ideal seconds per class)``.
        fit: ``"mixed"`` or ``"1p"``.
        layouts: the layout names, for the per-layout summary.

    Returns:
        (summary rows, fitted efficiencies per metric).
    """
    grid = grid_of(rows)
    for r in rows:
        r["role"] = "fit" if is_fit(r, grid, fit) else "held_out"
    summary, effs = [], {}
    for metric, work in works.items():
        mkey = metric.rstrip("1")
        cm = CostModel(local_cpu_cluster(1, 1.0))
        for _ in range(3):  # a few passes: the fit converges past the weak prior
            for k, r in enumerate(rows):
                if r["role"] == "fit":
                    cm.observe_work(work[k], r[f"{mkey}_measured_ms"] / 1e3)
        x = cm.inverse_efficiencies
        for k, r in enumerate(rows):
            pred = float(work[k] @ x) * 1e3
            meas = r[f"{mkey}_measured_ms"]
            r[f"{metric}_predicted_ms"] = pred
            r[f"{metric}_error_pct"] = 100 * (pred - meas) / meas
        effs[metric] = {
            c: round(float(cm.efficiency(c)), 4) for c in EFF_CLASSES if c in CLASS_INDEX
        }
        sets = [("fit", "fit", None), ("held_out_all", "held_out", None)]
        sets += [(f"held_out_{lay}", "held_out", lay) for lay in layouts]
        for name, role, lay in sets:
            sel = [r for r in rows if r["role"] == role and lay in (None, r["layout"])]
            if not sel:
                continue
            errs = np.abs([r[f"{metric}_error_pct"] for r in sel])
            summary.append(
                {
                    "metric": metric,
                    "set": name,
                    "num_plans": len(sel),
                    "mean_abs_error_pct": float(errs.mean()),
                    "max_abs_error_pct": float(errs.max()),
                }
            )
    return summary, effs


def held_out(summary: list[dict], metric: str = "cpu") -> tuple[float, float]:
    """(mean, max) absolute held-out error of ``metric`` over all held-out plans."""
    (s,) = [s for s in summary if s["metric"] == metric and s["set"] == "held_out_all"]
    return s["mean_abs_error_pct"], s["max_abs_error_pct"]


def _apart(a: float, b: float) -> float:
    """How far apart two figures are, in % of the smaller (as the round spread)."""
    return 100.0 * (max(a, b) / min(a, b) - 1.0)


def twins(rows: list[dict], batch: int, procs: dict) -> dict:
    """Plans with identical work (same preset, layout, sequence length and effective
    micro-batch ``min(mb, batch / processes)``): mean and max of ``max/min - 1`` (%) over
    the pairs, per measure. ``procs``: layout -> processes."""
    groups: dict = {}
    for r in rows:
        eff_mb = min(r["micro_batch"], batch // procs[r["layout"]])
        groups.setdefault((r["preset"], r["layout"], eff_mb, r["seq_len"]), []).append(r)
    out = {}
    for m in ("cpu", "wall"):
        d = [
            _apart(a[f"{m}_measured_ms"], b[f"{m}_measured_ms"])
            for g in groups.values()
            for i, a in enumerate(g)
            for b in g[i + 1 :]
        ]
        out[m] = (float(np.mean(d)), float(np.max(d)), len(d)) if d else None
    return out


def pooled(runs: list) -> list:
    """Several runs' measurements (each ``[(plan, repetitions)]``, the same plans in the
    same order) as one: each plan's repetitions taken together, each run's rounds
    numbered after the previous run's, so a figure over rounds is over every run's."""
    out = [(plan, []) for plan, _ in runs[0]]
    offset = 0
    for k, measured in enumerate(runs):
        if [p for p, _ in measured] != [p for p, _ in out]:
            raise ValueError(
                f"run {k} measured another grid than run 0: pool only runs of the same grid "
                "(the same --quick/--wide settings)"
            )
        for (_, into), (_, reps) in zip(out, measured):
            into.extend(dict(r, round=r["round"] + offset) for r in reps)
        offset += 1 + max(r["round"] for _, reps in measured for r in reps)
    return out


def halves_spread(even: list[dict], odd: list[dict], metric: str = "cpu") -> tuple[float, float]:
    """Mean and max ``max/min - 1`` (%) of each plan's figures from the two halves."""
    d = [_apart(a[f"{metric}_measured_ms"], b[f"{metric}_measured_ms"]) for a, b in zip(even, odd)]
    return float(np.mean(d)), float(np.max(d))


def across_runs(per_run: list[list[dict]], metric: str = "cpu") -> dict:
    """Systematic against noise over several runs' scored rows (same plans, same order).

    For each held-out plan, its errors over the runs: the mean (what persists), the
    standard deviation (what does not). ``systematic_pct`` is the mean over plans of the
    |mean error|; ``expected_from_noise_pct`` what that figure would be if every plan's
    true mean error were 0 (``sd / sqrt(runs) x sqrt(2 / pi)``, the mean of a half-normal);
    ``persistent`` lists plans whose mean error is over 2.5 standard errors from 0.
    """
    n = len(per_run)
    keys = [(r["preset"], r["layout"], r["micro_batch"], r["seq_len"]) for r in per_run[0]]
    E = np.array([[r[f"{metric}_error_pct"] for r in rows] for rows in per_run]).T
    ho = [k for k, r in enumerate(per_run[0]) if r["role"] == "held_out"]
    mean, sd = E[ho].mean(1), E[ho].std(1, ddof=1)
    se = sd / math.sqrt(n)
    persistent = [
        (keys[k], round(float(m), 1), round(float(m / s), 1))
        for k, m, s in zip(ho, mean, se)
        if s > 0 and abs(m) > 2.5 * s
    ]
    return {
        "runs": n,
        "per_run_held_out_mean_pct": [float(np.abs(E[ho, i]).mean()) for i in range(n)],
        "systematic_pct": float(np.abs(mean).mean()),
        "expected_from_noise_pct": float((se * math.sqrt(2 / math.pi)).mean()),
        "noise_sd_pct": float(sd.mean()),
        "persistent": persistent,
    }
