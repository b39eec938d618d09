"""bench_e2e's check of the cost model on the fixed plans it runs.

For every fixed plan a setting runs, the calibrated model's predicted step latency
(mean over the trace's lengths, per phase: generation with the weight sync, inference,
training) beside the measured one (mean over steps and repeats, per phase as the
trainer times them, plus the rest of the step: the driver's scoring, data moves and
RPCs that no stage time holds). From those, per setting: the rank correlation of
predicted and measured step latency over the plans, where the empirical best sits in
the model's ranking, and whether the model's pick (the fixed plan with the lowest
prediction) measured within 5% of the empirical best, the paper's criterion.
"""

from __future__ import annotations

from typing import Any

PHASES = ("gen", "infer", "train")


def measured_phases(m: dict[str, Any]) -> dict[str, float]:
    """One step's measured seconds per phase, and ``rest``: the step minus the phases."""
    st = m.get("stage_s") or {}
    out = {
        "gen": st.get("rollout", 0.0) + m.get("sync_s", 0.0),
        "infer": st.get("inference", 0.0) + st.get("reward", 0.0),
        "train": st.get("train", 0.0),
    }
    out["rest"] = m["step_s"] - sum(out.values())
    return out


def predicted_phases(cm, plan, workloads: list, overhead=None, shapes=None) -> dict[str, float]:
    """The model's mean predicted seconds per phase and in total over ``workloads``;
    with ``overhead`` (a fitted :class:`~nereus_rl.costmodel.step_overhead.StepOverhead`) the
    total includes its measured unpriced rest for the plan (``ovh``); with ``shapes``
    (a :class:`~nereus_rl.costmodel.shape_correction.ShapeCorrection`) measured stage shapes are
    priced at their measured ratio, as the run's decisions price them."""
    ovh = 0.0 if overhead is None else overhead.predict(plan)
    # an async step's rest is on its chain of stages, where the rollout may hide it
    # (PricedModel.chain_rest); a synchronous step's is added to its total
    rests = [max(0.0, ovh) if wl.rollout_ahead else 0.0 for wl in workloads]
    ests = [cm.step_latency(plan, wl, r) for wl, r in zip(workloads, rests)]
    if shapes is not None:
        ests = [shapes.correct(cm, plan, wl, e, r) for wl, e, r in zip(workloads, ests, rests)]
    n = len(ests)
    out = {ph: sum(e.phase_s[i] for e in ests) / n for i, ph in enumerate(PHASES)}
    out["ovh"] = ovh
    out["total"] = (
        sum(e.total_s + (0.0 if wl.rollout_ahead else ovh) for wl, e in zip(workloads, ests)) / n
    )
    return out


def mean_phases(steps: list[dict[str, Any]]) -> dict[str, float]:
    """Mean over ``steps`` (metrics rows) of :func:`measured_phases`, and of step_s."""
    rows = [measured_phases(m) for m in steps]
    out = {k: sum(r[k] for r in rows) / len(rows) for k in (*PHASES, "rest")}
    out["total"] = sum(m["step_s"] for m in steps) / len(steps)
    return out


def _ranks(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0.0] * len(xs)
    for pos, i in enumerate(order):
        r[i] = float(pos)
    return r


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation of ``a`` and ``b`` (no tie correction); nan below 3."""
    n = len(a)
    if n < 3:
        return float("nan")
    ra, rb = _ranks(a), _ranks(b)
    d2 = sum((x - y) ** 2 for x, y in zip(ra, rb))
    return 1.0 - 6.0 * d2 / (n * (n * n - 1))


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank agreement over ``rows`` (each: variant, predicted total, measured total).

    Returns the Spearman correlation, the empirical best, its rank in the model's
    order (1 = the model's pick), the model's pick and its measured / best ratio, and
    whether that ratio is within 5% (<= 1.05).
    """
    pred = [r["predicted"]["total"] for r in rows]
    meas = [r["measured"]["total"] for r in rows]
    best = min(range(len(rows)), key=lambda i: meas[i])
    pick = min(range(len(rows)), key=lambda i: pred[i])
    by_pred = sorted(range(len(rows)), key=lambda i: pred[i])
    ratio = meas[pick] / meas[best]
    return {
        "plans": len(rows),
        "spearman": spearman(pred, meas),
        "best": rows[best]["variant"],
        "best_rank_by_model": by_pred.index(best) + 1,
        "pick": rows[pick]["variant"],
        "pick_vs_best_x": ratio,
        "pick_within_5pct": ratio <= 1.05,
    }


def print_table(algo: str, mode: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Print predicted vs measured per plan and phase, and the summary; return it."""
    print(
        f"{algo} {mode}: calibrated model vs measured, per fixed plan (s/step; "
        "pred/meas per phase gen|infer|train; pred prices measured stage shapes at their "
        "measured ratio (shape_correction) and includes ovh, the measured unpriced rest the "
        "run fitted (step_overhead); rest = step - phases)"
    )
    print(
        f"  {'variant':20} {'pred':>6} {'meas':>6} {'m/p':>5}  "
        f"{'gen p/m':>11} {'infer p/m':>11} {'train p/m':>11} {'ovh/rest':>11}"
    )
    for r in sorted(rows, key=lambda r: r["measured"]["total"]):
        p, m = r["predicted"], r["measured"]
        cells = " ".join(f"{p[ph]:5.3f}/{m[ph]:5.3f}" for ph in PHASES)
        print(
            f"  {r['variant']:20} {p['total']:6.3f} {m['total']:6.3f} "
            f"{m['total'] / p['total']:5.2f}  {cells} {p.get('ovh', 0.0):5.3f}/{m['rest']:5.3f}"
        )
    s = summarize(rows)
    print(
        f"{algo} {mode}: spearman(pred, meas) {s['spearman']:.2f} over {s['plans']} plans; "
        f"empirical best {s['best']} is the model's #{s['best_rank_by_model']}; the model's "
        f"pick {s['pick']} measured {s['pick_vs_best_x']:.2f}x the best "
        f"({'within' if s['pick_within_5pct'] else 'NOT within'} 5%)"
    )
    return s
