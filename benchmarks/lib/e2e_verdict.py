"""bench_e2e's noise-aware verdicts: a confidence range of each variant's paired ratio to
adaptive, and per goal whether it is met, missed or within noise.

Each repeat runs every variant once, interleaved, so a repeat's ratio (variant's mean
step latency / adaptive's in the same repeat) pairs runs made under the same load. The
range is a 90% confidence interval of the mean log ratio (Student's t over the repeats),
exponentiated: a ratio's noise is multiplicative. A goal is "met" when the whole range
is on its side of the threshold, "missed" when the whole range is on the other side, and
"within noise" when the range straddles it: the repeats cannot tell.

Goals (ratios are the variant's latency over adaptive's, so higher favours adaptive):
    startup     adaptive >= 25% lower latency than each startup configuration that fits
                (colocated, disaggregated; at the first and at the longest length):
                ratio >= 1 / 0.75
    replan      never worse than replan-on-every-trigger: ratio >= 1
    best_fixed  within 5% of the empirical best fixed plan: adaptive <= 1.05 x best,
                ratio >= 1 / 1.05. Judged on the ``best_fixed_confirmed`` row when there
                is one: the selected plan measured again against adaptive in held-out
                rounds (``e2e_confirm``). The selection row ``best_fixed`` is the fastest
                of several means over the same repeats, so it is biased low (its verdict
                leans against adaptive): with a confirmed row its verdict is still given,
                labelled "selection (biased low)", and is not the goal's.
"""

from __future__ import annotations

import math
from typing import Any

CONFIDENCE = 0.90
# Student's t 0.95 quantile (two-sided 90%) by degrees of freedom 1..10 (scipy is no
# dependency of the project); beyond 10, the 10's (slightly wide: conservative).
T95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812)
STARTUP = ("colocated", "colocated_max", "disaggregated", "disaggregated_max")
GOALS = {"startup": 1 / 0.75, "replan": 1.0, "best_fixed": 1 / 1.05}
# best_fixed's rows (bench_e2e, e2e_confirm): the selection and its held-out confirmation
SELECTION, CONFIRMED = "best_fixed (", "best_fixed_confirmed ("
SELECTION_LABEL = "selection (biased low)"


def paired_range(ratios: list[float]) -> tuple[float, float, float]:
    """The geometric mean of ``ratios`` and its ``CONFIDENCE`` range (nan with one)."""
    logs = [math.log(r) for r in ratios]
    n = len(logs)
    mean = sum(logs) / n
    if n < 2:
        return math.exp(mean), float("nan"), float("nan")
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    half = T95[min(n - 1, len(T95)) - 1] * sd / math.sqrt(n)
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def verdict(lo: float, hi: float, threshold: float) -> str:
    """``"met"`` (lo >= threshold), ``"missed"`` (hi < threshold), else ``"within
    noise"``; ``"one repeat"`` without a range."""
    if math.isnan(lo) or math.isnan(hi):
        return "one repeat"
    if lo >= threshold:
        return "met"
    if hi < threshold:
        return "missed"
    return "within noise"


def goal_verdicts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One verdict per goal and compared variant of one setting's rows (the rows carry
    ``ci_lo_x`` / ``ci_hi_x`` / ``paired_geomean_x``). Startup configurations that do
    not fit the budget are listed as not judged (they could not run with that memory).

    The best_fixed goal is judged on the ``best_fixed_confirmed (...)`` row when the rows
    hold one; the ``best_fixed (...)`` selection row's entry then comes first, its
    verdict prefixed "selection (biased low): " so that it counts as no goal verdict.
    Each entry's ``note`` says which figures it was judged on.
    """
    by = {r["variant"]: r for r in rows}
    best = next(r for r in rows if r["variant"].startswith(SELECTION))
    confirmed = next((r for r in rows if r["variant"].startswith(CONFIRMED)), None)
    # (goal, row, note, whether the entry is the goal's verdict)
    todo = [("startup", by[v], "", True) for v in STARTUP if v in by]
    todo.append(("replan", by["replan_always"], "", True))
    if confirmed is None:
        todo.append(("best_fixed", best, "on the selection repeats: biased low", True))
    else:
        n = confirmed["repeats"]
        todo.append(("best_fixed", best, f"not the goal's: see {confirmed['variant']}", False))
        note = f"judged on {n} held-out confirmation rounds, not on the selection"
        todo.append(("best_fixed", confirmed, note, True))
    out = []
    for goal, r, note, judged in todo:
        thr = GOALS[goal]
        v = verdict(r["ci_lo_x"], r["ci_hi_x"], thr)
        if not r["fits_budget"]:
            v = "not judged: does not fit the budget"
        if not judged:
            v = f"{SELECTION_LABEL}: {v}"
        out.append(
            {
                "goal": goal,
                "variant": r["variant"],
                "threshold_x": thr,
                "ratio_x": r["paired_geomean_x"],
                "ci_lo_x": r["ci_lo_x"],
                "ci_hi_x": r["ci_hi_x"],
                "verdict": v,
                "note": note,
            }
        )
    return out


def print_verdicts(algo: str, mode: str, verdicts: list[dict[str, Any]]) -> None:
    """One line per goal and variant."""
    print(
        f"{algo} {mode}: goals (variant latency / adaptive's, paired geometric mean and "
        f"{CONFIDENCE:.0%} range over repeats)"
    )
    for v in verdicts:
        note = v.get("note", "")
        print(
            f"  {v['goal']:10} {v['variant']:42} {v['ratio_x']:5.2f}x "
            f"[{v['ci_lo_x']:5.2f}..{v['ci_hi_x']:5.2f}] need >= {v['threshold_x']:.3f}x: "
            f"{v['verdict']}" + (f" ({note})" if note else "")
        )
