"""bench_e2e's fixed plans and memory budget: the length trace, the startup
configurations of a fixed structure (colocated, disaggregated), the budget rule that
leaves each of them a layout for the whole trace, and the enumeration of every other
feasible fixed plan (each once up to a relabeling of the identical worker processes).
"""

from __future__ import annotations

import itertools
from pathlib import Path

from nereus_rl.core.globalplan import GlobalPlan, StagePlan
from nereus_rl.trainer.config import stage_names

# The planner's k for the enumeration: larger than the Pareto-pruned plan space at a few
# devices (grpo / ppo / remax on 4 workers: 77 / 55 / 32 plans), so k-best is all of it.
ENUM_K = 1000
STRUCTURES = ("colocated", "disaggregated")


def _mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def write_trace(path: Path, steps: int, lo: int = 6, hi: int = 20) -> Path:
    """Rise lo -> hi over the first half, hold a quarter, fall to (lo+hi)/2."""
    rise, hold = max(2, steps // 2), max(1, steps // 4)
    fall = max(1, steps - rise - hold)
    mid = (lo + hi) // 2
    lens = [round(lo + (hi - lo) * i / (rise - 1)) for i in range(rise)]
    lens += [hi] * hold
    lens += [round(hi + (mid - hi) * (i + 1) / fall) for i in range(fall)]
    lines = ["step,response_len"] + [f"{i},{n}" for i, n in enumerate(lens[:steps])]
    path.write_text("\n".join(lines) + "\n")
    return path


def structured_layouts(ad, kind: str) -> list[GlobalPlan]:
    """Every runnable layout of a fixed structure on ``ad``'s devices.

    ``kind``: ``"colocated"`` (every stage on all devices) or ``"disaggregated"``
    (rollout on the first half, the rest on the second half). Each stage's (dp, tp,
    pp) is free (powers of two, runnable on the model).
    """
    n = ad.cfg.devices
    wl = ad.workload(ad.response_len(0))
    planned = {s.stage for s in wl.planned_stages}
    names = [x for x in stage_names(ad.cfg.algo) if x[0] in planned]
    half = n // 2
    options = []
    for name, model, trains in names:
        if kind == "disaggregated":
            devs = list(range(half)) if name == "rollout" else list(range(half, n))
        else:
            devs = list(range(n))
        opts = []
        d = len(devs)
        for tp, pp in itertools.product([1, 2, 4, 8], repeat=2):
            if d % (tp * pp):
                continue
            dp = d // (tp * pp)
            units = tuple(tuple(devs[u * tp * pp : (u + 1) * tp * pp]) for u in range(dp))
            opts.append(StagePlan(name, model, trains, dp, tp, pp, units))
        options.append(opts)
    out = [GlobalPlan(tuple(c)) for c in itertools.product(*options)]
    out = [p for p in out if ad.runnable(p)]
    if not out:
        raise RuntimeError(f"no runnable {kind} plan for {ad.cfg.algo} on {n} devices")
    return out


def peak_over(ad, plan: GlobalPlan, lengths) -> int:
    """The plan's largest predicted per-device peak over the workloads at ``lengths``."""
    return max(max(ad.cm.peak_memory(plan, ad.workload(n)).values()) for n in set(lengths))


def structured_plan(ad, kind: str, rlen: int, fit_lengths=None) -> tuple[GlobalPlan, bool]:
    """The fastest predicted layout of a fixed structure at ``rlen`` among those that fit
    ``ad``'s budget at every length of ``fit_lengths`` (default: ``rlen`` only), priced by
    ``ad``'s model; and whether it fits. When none fits, the one with the smallest peak."""
    fit_lengths = [rlen] if fit_lengths is None else fit_lengths
    wl = ad.workload(rlen)
    best, best_key = None, None
    for plan in structured_layouts(ad, kind):
        peak = peak_over(ad, plan, fit_lengths)
        fits = peak <= ad.budget
        key = (not fits, ad.cm.step_latency(plan, wl).total_s if fits else peak)
        if best_key is None or key < best_key:
            best, best_key = plan, key
    return best, not best_key[0]


def startup_budget(ad, lengths: list[int]) -> tuple[int, dict[str, int]]:
    """The bench's default memory budget per worker (rule ``"startup"``).

    For each fixed structure (colocated, disaggregated), the smallest predicted peak over
    its runnable layouts across the whole trace (``lengths``); the budget is the larger:
    the least memory at which every startup configuration has a layout that runs the
    whole trace (and the planner's own best plan for the longest responses fits too: a
    colocated layout is one of the planner's plans), so the comparison is at equal memory
    with as much memory pressure on adaptive as that allows. Predicted peaks are the cost
    model's memory model, which calibration does not change: the budget is the same in
    every run of a setting.

    Returns the budget and the least peak of each structure (bytes).
    """
    least = {
        k: min(peak_over(ad, p, lengths) for p in structured_layouts(ad, k)) for k in STRUCTURES
    }
    # the planner's feasibility is peak <= capacity = memory - reserve
    return max(least.values()) + ad.cm.memory_reserve_bytes, least


def canonical(plan: GlobalPlan, num_devices: int) -> tuple:
    """``plan`` up to a relabeling of the devices (identical worker processes on one
    host, so relabeled plans run the same work): the smallest key over all relabelings
    (exact up to 6 devices; beyond, the plan as it is)."""

    def key(perm) -> tuple:
        def units(sp):
            return tuple(sorted(tuple(perm[d] for d in u) for u in sp.units))

        return tuple(sorted((sp.stage, sp.dp, sp.tp, sp.pp, units(sp)) for sp in plan.stages))

    if num_devices > 6:
        return key(range(num_devices))
    return min(key(p) for p in itertools.permutations(range(num_devices)))


def enumerate_fixed(ad, lengths: list[int], named: list[GlobalPlan]) -> tuple[list, dict]:
    """Every feasible fixed plan not among ``named``, best predicted first.

    Feasible: among the planner's k-best (``ENUM_K``) for the longest response length of
    ``lengths`` under ``ad``'s budget (peak memory grows with length, so such a plan fits
    at every step) and runnable on the model. Deduplicated up to device relabeling (and
    against ``named``); ranked by ``ad``'s model's mean predicted step latency over
    ``lengths``. Returns [(predicted mean s, plan)] and counts for the printout.
    """
    n = ad.cfg.devices
    ranked = [p for _, p in ad.ranked_plans(max(lengths), k=ENUM_K)]
    named_keys = {canonical(p, n) for p in named}
    seen = set(named_keys)
    wls = {rl: ad.workload(rl) for rl in set(lengths)}
    pm = ad.priced()
    out = []
    dup_named = dup = 0
    for p in ranked:
        c = canonical(p, n)
        if c in seen:
            dup_named += c in named_keys
            dup += 1
            continue
        seen.add(c)
        # as the decisions price it: measured shapes at their ratio (shape_correction)
        # with the measured unpriced rest (step_overhead; an async step's on its chain)
        pred = _mean([pm.step_whole(p, wls[rl]) for rl in lengths])
        out.append((pred, p))
    out.sort(key=lambda x: x[0])
    return out, {"k_best": len(ranked), "duplicates": dup, "same_as_named": dup_named}
