"""bench_e2e's rows from runs, and its confirmation phase for the best fixed plan.

bench_e2e picks ``best_fixed`` as the least mean step latency among the fitting fixed
plans, each measured in a few noisy repeats. The least of several noisy means is biased
low (the winner's curse): scored on the same repeats, the "within 5% of the best fixed
plan" goal leans against adaptive by about the noise of one mean (10-20% on the shared
2-core machine). So the plan is SELECTED on those repeats and then MEASURED again: the
confirmation phase runs ``num_rounds`` fresh interleaved rounds of exactly two variants,
adaptive and the selected plan (which one runs first alternates per round, so neither
always meets the machine's state after the other), and the goal is scored on those
rounds only (``e2e_verdict``). Its rows:

    adaptive_confirmed              adaptive's confirmation runs (ratio 1 to itself)
    best_fixed_confirmed (<name>)   the selected plan's confirmation runs, each paired
                                    with the same round's adaptive run
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.lib.e2e_verdict import CONFIRMED, SELECTION, paired_range

# Default confirmation rounds per setting (--confirm), --quick included: three like the
# selection repeats, so the confirmed range is no wider than the selection one's, and
# --quick (GRPO sync alone) stays near two minutes on an idle 2-core machine.
CONFIRM_ROUNDS = 3


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def variant_row(
    algo: str,
    mode: str,
    variant: str,
    plan: str | None,
    runs: list[dict[str, Any]],
    base: list[float],
    budget: int,
) -> dict[str, Any]:
    """One variant's row from its runs (bench_e2e's per-run dicts, one per round).

    Arguments:
        plan: the fixed plan's repr, or None for an adaptive variant.
        runs: the variant's runs, in round order.
        base: adaptive's step latency in the same rounds (the paired ratios' divisors).
        budget: the memory budget per worker (bytes).

    Returns the row: mean step latency with its spread, the ratio of means to adaptive,
    the paired ratios' mean, min, max, geometric mean and 90% range, transitions,
    reward, the largest peak/budget and whether it fits.
    """
    lat = [r["step_latency_s"] for r in runs]
    ratios = [a / b for a, b in zip(lat, base, strict=True)]
    geo, lo, hi = paired_range(ratios)
    frac = max(r["peak_memory_fraction"] for r in runs)
    adaptive = plan is None
    return {
        "algo": algo,
        "mode": mode,
        "variant": variant,
        "plan": plan,
        "repeats": len(runs),
        "step_latency_s": _mean(lat),
        "step_latency_min_s": min(lat),
        "step_latency_max_s": max(lat),
        "step_latency_stdev_s": statistics.stdev(lat) if len(lat) > 1 else 0.0,
        "latency_vs_adaptive_x": _mean(lat) / _mean(base),
        "paired_ratio_mean_x": _mean(ratios),
        "paired_ratio_min_x": min(ratios),
        "paired_ratio_max_x": max(ratios),
        # geometric mean of the paired ratios and its 90% range (e2e_verdict)
        "paired_geomean_x": geo,
        "ci_lo_x": lo,
        "ci_hi_x": hi,
        "transitions": _mean([r["transitions"] for r in runs]),
        "calibration_s": _mean([r["calibration_s"] for r in runs]),
        "reward_mean": _mean([r["reward_mean"] for r in runs]),
        "peak_memory_fraction": frac,
        # adaptive runs move away before the next step when the signal passes 1
        "fits_budget": adaptive or frac <= 1.0,
        "memory_budget_bytes": budget,
        "errors": [r["error"] for r in runs if r["error"]],
        "plans_per_repeat": [r["plans"] for r in runs] if adaptive else None,
        "steps_per_repeat": [r["steps"] for r in runs],
        "moves_per_repeat": [r["moves"] for r in runs] if adaptive else None,
    }


def run_rounds(
    num_rounds: int,
    run: Callable[[str], dict[str, Any]],
    names: Sequence[str] = ("adaptive", "fixed"),
) -> dict[str, list[dict[str, Any]]]:
    """``num_rounds`` interleaved rounds of ``run(name)`` for each of ``names``, the
    order rotated by one each round (two names: adaptive first in even rounds, the fixed
    plan first in odd ones), so that no variant always meets the machine's state after
    the same other one. Returns each one's runs in round order (index i of every list is
    round i)."""
    if num_rounds < 0:
        raise ValueError(f"confirmation rounds must be >= 0 (0 disables), got {num_rounds}")
    names = tuple(names)
    out: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for i in range(num_rounds):
        k = i % len(names)
        for which in names[k:] + names[:k]:
            out[which].append(run(which))
    return out


def confirm_best_fixed(
    selected: dict[str, Any],
    num_rounds: int,
    run: Callable[[str], dict[str, Any]],
    extra: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """Measure the selected best fixed plan again against adaptive (:func:`run_rounds`)
    and return the confirmation rows, ``[adaptive_confirmed, best_fixed_confirmed
    (<name>)]``, built from those rounds only (none of ``selected``'s figures); ``[]``
    when ``num_rounds`` is 0.

    Arguments:
        selected: the selection row, variant ``"best_fixed (<name>)"``.
        num_rounds: confirmation rounds (0 disables).
        run: ``run("adaptive")`` / ``run("fixed")`` runs adaptive / the selected plan
            once and returns bench_e2e's per-run dict.
        extra: further adaptive variants to run in the same rounds (``run(name)``);
            each adds a row ``<name>_confirmed``, paired with adaptive like the others,
            whose ``vs_best_fixed`` holds its paired ratio to the selected plan
            (geometric mean, 90% range: its own "within 5% of the best" figure).

    Raises ValueError when ``selected`` is not a best_fixed selection row or
    ``num_rounds`` is negative, before anything runs.
    """
    name = selected.get("variant", "")
    if not name.startswith(SELECTION) or selected.get("plan") is None:
        raise ValueError(
            f"confirm_best_fixed needs the best_fixed selection row (variant "
            f"'{SELECTION}<name>)' with a plan), got variant {name!r}"
        )
    runs = run_rounds(num_rounds, run, ("adaptive", "fixed", *extra))
    if not num_rounds:
        return []
    base = [r["step_latency_s"] for r in runs["adaptive"]]
    a, m = selected["algo"], selected["mode"]
    budget = selected["memory_budget_bytes"]
    rows = [
        variant_row(a, m, "adaptive_confirmed", None, runs["adaptive"], base, budget),
        variant_row(
            a,
            m,
            CONFIRMED + name[len(SELECTION) :],
            selected["plan"],
            runs["fixed"],
            base,
            budget,
        ),
    ]
    fixed = [r["step_latency_s"] for r in runs["fixed"]]
    for name in extra:
        row = variant_row(a, m, f"{name}_confirmed", None, runs[name], base, budget)
        lat = [r["step_latency_s"] for r in runs[name]]
        geo, lo, hi = paired_range([f / x for f, x in zip(fixed, lat, strict=True)])
        # the selected plan's latency over this variant's, round by round (as the goal)
        row["vs_best_fixed"] = {"paired_geomean_x": geo, "ci_lo_x": lo, "ci_hi_x": hi}
        rows.append(row)
    for r in rows:
        r["phase"] = "confirmation"  # held out from the selection repeats
    return rows
