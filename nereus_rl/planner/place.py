"""Turning the exact planner's choice into a placed GlobalPlan (see ``nereus_rl.planner.planner``),
and the error raised when nothing fits memory."""

from __future__ import annotations

import numpy as np

from nereus_rl.core.globalplan import GlobalPlan, StagePlan, fmt_bytes
from nereus_rl.core.workload import StageWork
from nereus_rl.planner.tables import _StageTable, tp_rule
from nereus_rl.planner.types import PlanInfeasibleError

#: StagePlans (and unit tuples) on runs of consecutive devices, shared by every Planner:
#: each is a pure function of its key (stage, model, kind, layout, first and last device;
#: units: first device, count, width) and immutable, so sharing them is interning, and a
#: new Planner (e.g. for another job on the same cluster) places without rebuilding them.
SHARED_PLACED: dict = {}


def _stage_plan(
    stage: str, model: str, trains: bool, dp: int, tp: int, pp: int, units
) -> StagePlan:
    """A StagePlan without ``__post_init__``'s checks: ``place`` builds its units as ``dp``
    consecutive slices of ``tp * pp`` sorted distinct ids, valid by construction, and the
    checks cost O(devices) Python steps per stage (milliseconds at 4,096 devices)."""
    sp = object.__new__(StagePlan)
    sp.__dict__.update(stage=stage, model=model, trains=trains, dp=dp, tp=tp, pp=pp, units=units)
    return sp


def _by_size(group: tuple) -> tuple[int, int]:
    return group[0], group[1]


def place(
    stages: list[StageWork],
    tables: list[_StageTable],
    picks: list,
    devs: list[int],
    cache: dict | None = None,
) -> GlobalPlan:
    """Lay the chosen groups over ``devs``: decreasing size, consecutive offsets.

    Arguments:
        stages: the planned stages.
        tables: their stage tables (``layouts`` indexed by the choices).
        picks: ``[(group, choices), ...]``: stage indices of a group and the layout
            index each of them takes.
        devs: sorted available device ids (a list, or a range of step 1).
        cache: StagePlans already built, reused when a stage gets the same layout on
            the same run of consecutive devices (StagePlans are immutable; building
            one's units costs O(devices) Python steps).

    Returns:
        The plan; a stage uses the first ``dp * tp * pp`` devices of its group.
    """
    groups = []
    for g, ch in picks:
        lay = [tables[i].layouts[li] for i, li in zip(g, ch)]
        size = max([dp * tp * pp for dp, tp, pp in lay])
        # Groups are tuples of increasing stage indices: g[0] is the smallest.
        groups.append((-size, g[0], g, lay))
    # Decreasing size keeps every group aligned to its power-of-two size.
    if len(groups) > 1:
        groups.sort(key=_by_size)
    out: list = [None] * len(stages)
    off = 0
    use = cache is not None
    for neg_size, _, g, lay in groups:
        first = devs[off]
        for i, (dp, tp, pp) in zip(g, lay):
            sw = stages[i]
            w = tp * pp
            n = dp * w
            last = devs[off + n - 1]
            # Sorted distinct ids: the slice is a run of consecutive ids iff its ends
            # are n - 1 apart, and then (first, last) names it.
            run = use and last - first == n - 1
            key = (sw.stage, sw.model, sw.kind, dp, tp, pp, first, last)
            sp = cache.get(key) if run else None
            if sp is None:
                # On a run, the units are fixed by (first, n, w): stages (and calls) that
                # take the same slice at the same width share one tuple (it is immutable).
                ukey = ("units", first, n, w)
                units = cache.get(ukey) if run else None
                if units is None:
                    it = iter(devs[off : off + n])
                    units = tuple(zip(*([it] * w)))  # dp consecutive tuples of w devices
                sp = _stage_plan(sw.stage, sw.model, sw.trains, dp, tp, pp, units)
                if run:
                    if len(cache) > 4096:
                        cache.clear()
                    cache[key] = sp
                    cache[ukey] = units
            out[i] = sp
        off -= neg_size
    # Stage names are the workload's, unique: skip __post_init__'s check.
    gp = object.__new__(GlobalPlan)
    gp.__dict__["stages"] = tuple(out)
    return gp


def infeasible(
    stages: list[StageWork], tables: list[_StageTable], N: int, cap: int
) -> PlanInfeasibleError:
    """The error for "no plan fits memory", with each stage's least bytes per device."""
    need = {}
    lines = []
    for sw, t in zip(stages, tables):
        ok = t.d <= N
        i = int(np.argmin(np.where(ok, t.mem, np.iinfo(np.int64).max)))
        need[sw.stage] = int(t.mem[i])
        dp, tp, pp = t.layouts[i]
        lines.append(f"{sw.stage}: {fmt_bytes(t.mem[i])}/device at best (dp{dp} tp{tp} pp{pp})")
    rules = [r for r in (tp_rule(sw, N) for sw in stages) if r]
    msg = (
        f"no plan fits memory on {N} devices of {fmt_bytes(cap)} usable each; "
        "least memory needed per device by stage: "
        + "; ".join(lines)
        + ". "
        + (
            "Tensor parallelism is limited by the attention heads: " + "; ".join(rules) + ". "
            if rules
            else ""
        )
        + "Add devices, use devices with more memory, or shrink batch/sequence length."
    )
    return PlanInfeasibleError(msg, need, cap, N)
