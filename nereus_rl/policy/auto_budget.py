"""The default memory budget of an adaptive run (``TrainConfig.memory_budget`` None).

See :func:`auto_budget`; the trainer's adapter calls it at startup and again after the
startup calibration.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from nereus_rl.core.globalplan import GlobalPlan
from nereus_rl.core.spec import ClusterSpec
from nereus_rl.core.workload import Workload
from nereus_rl.costmodel.costmodel import CostModel
from nereus_rl.costmodel.step_overhead import PricedModel
from nereus_rl.planner.planner import PlanInfeasibleError
from nereus_rl.planner.planner import plan as plan_best

# The budget is this much above the predicted peak of the plan it is sized on at the first
# response length: that plan fits, and growing responses exceed it, so the run meets
# memory pressure and makes a transition.
AUTO_BUDGET_HEADROOM = 1.08


# (k_best, workload, priced model) -> the runnable plans with their price, fastest first
Ranked = list[tuple[float, GlobalPlan]]
Rank = Callable[[Ranked, Workload, PricedModel], Ranked]


def auto_budget(
    cluster: ClusterSpec,
    lengths: Sequence[int],
    workload: Callable[[int], Workload],
    rank: Rank,
    priced: Callable[[CostModel], PricedModel],
    observed: Sequence[tuple] = (),
) -> tuple[int, GlobalPlan | None]:
    """The default per-worker memory budget of a run (no ``memory_budget`` given), and
    the plan it was sized on, which the run starts on (None when nothing fits: the
    budget is then the machine's share).

    The budget emulates the situation Nereus is for: a device whose memory holds a
    fast plan at the first response length but not at the run's longest, while
    another plan still fits there. It sits just above the sized plan's peak at the
    first length (``AUTO_BUDGET_HEADROOM``), at most halfway to its peak at the
    longest length, and never below 1.01x the least peak of any plan at the longest
    length, so the run always has a plan to move to.

    The sized plan is the fastest one for which that situation exists among the
    planner's k-best at the first length; the fastest when none has it. Why: when
    the fastest plan is also the leanest at the longest length, no budget makes
    growing responses force a move. The run starts on the fastest plan that meets
    memory pressure, whichever the calibration ranks first, since the default run is
    the one that shows a transition.

    Arguments:
        cluster: the machine (its devices' whole memory).
        lengths: the response-length limit of every step of the run, step 0 first.
        workload: the workload of a step at a response length.
        rank: the runnable plans among the planner's k-best, each with its price under
            the given priced model, fastest first (as the run ranks its start plan).
        priced: a cost model as the decisions price plans (measured overhead, shapes).
        observed: (plan, workload, stage seconds) measurements to price the plans with.
    """
    cl = cluster
    cm = CostModel(cl)
    for plan, wl, measured in observed:
        cm.observe(plan, wl, measured)
    wl = workload(lengths[0])
    wl_max = workload(max(lengths))
    try:
        res = plan_best(wl, cl, cm, k=64)
        # ranked as best_plan ranks the start plan (with the measured per-call
        # overhead): sized on another plan, the budget can sit above the peak of
        # the plan the run starts on, and the run never meets memory pressure
        ranked = rank(res.k_best, wl, priced(cm))
    except (PlanInfeasibleError, ValueError):
        return cl.device.memory_bytes, None
    if not ranked:
        return cl.device.memory_bytes, None
    try:
        fits_max = plan_best(wl_max, cl, cm, k=64).k_best
        least = min(max(cm.peak_memory(p, wl_max).values()) for _, p in fits_max)
    except (PlanInfeasibleError, ValueError):
        least = None

    def sized(p: GlobalPlan) -> tuple[float, bool]:
        # (budget sized on p, whether p's growing responses go over it)
        peak0 = max(cm.peak_memory(p, wl).values())
        peak_max = max(cm.peak_memory(p, wl_max).values())
        budget = peak0 * AUTO_BUDGET_HEADROOM
        if peak_max > peak0:
            budget = min(budget, (peak0 + peak_max) / 2)
            if least is not None:
                budget = max(budget, least * 1.01)
        return budget, peak_max > budget

    for _, p in ranked:
        budget, forced = sized(p)
        if forced:
            return int(budget), p
    return int(sized(ranked[0][1])[0]), ranked[0][1]
