"""The adaptive run's first plan, chosen over the lengths the run is configured with.

The planner ranks plans at the first step's workload only. With responses growing, its
best there is often a plan that memory forces the run off a few steps later: the run
pays the forced move and, before it, steps on a plan chosen for lengths that no longer
hold, while the best fixed plan (one that fits every step) pays neither.

So the start plan is chosen with lookahead (:func:`nereus_rl.policy.lookahead.choose_start`)
over the run's lengths from step 0 to its end. At startup the controller's seq_len
signal has seen no length, so it cannot forecast; what the run has is its configured
length schedule (``TrainConfig.trace``, the replayed trace file, when one is given;
else the curriculum from ``length_start`` to ``length_end`` over ``steps``): the
response-length limit of every step, which the rollout enforces. That is the schedule
the trainer's own steps use, so the start plan's forecast is what the run will ask, not
a guess; later decisions still forecast from the seq_len signal, as the schedule of a
real run is only an upper bound. A schedule whose lengths are flat, or whose planner's
best holds every length, keeps the planner's best (lookahead overrides it only when it
goes over).

The candidates are the planner's k-best at the first step's length and, after them, its
k-best at each later length of the schedule. The planner's search at one length drops a
stage layout that another layout on the same devices beats there (it can never be that
length's best), so its k-best at the first length can lack the plans that hold longer
lengths by spending memory for speed (say, training at pp 2 on two devices, which dp 2 on
the same two beats at the first length, where both fit).

Among near ties (scores within the model's measured error, the adapter's tie margin)
the start goes to the plan on the fewest devices, not to the lowest score: the
calibration's probes are few and noisy, so which of several near-tied plans scores
lowest changes from startup to startup, and the plan on fewer devices leaves devices
spare for the lengths to grow into and for a loss that then forces no move
(:func:`nereus_rl.policy.lookahead._choose`).

The choice is the run's first Decision (``path: "start"``), with the lookahead's record
and its reason; it is not a transition (``taken`` is False).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from nereus_rl.core.globalplan import GlobalPlan
from nereus_rl.core.workload import Workload, bucket_of
from nereus_rl.policy.controller import SignalError
from nereus_rl.policy.decision import Decision
from nereus_rl.policy.lookahead import LookaheadError, choose_start

# what each ``TrainConfig.start_lengths`` looks over, as the start Decision's trigger
TRIGGERS = {
    "schedule": "start: the configured lengths of {n} steps",
    "cap": "start: the first step's length, then the longest ({n} steps)",
    "first": "start: the first step's length only",
}


class StartPlanError(ValueError):
    """No plan fits a length of the schedule (the run will have to stop or move there)."""


def start_lengths(schedule: Sequence[int], buckets: Sequence[int], which: str) -> list[int]:
    """The lengths the start plan is chosen over (bucketed), step 0 first, as
    ``which`` (``TrainConfig.start_lengths``) says: the run's configured length of every
    step (``"schedule"``: ``schedule``, every step's response-length limit); step 0's,
    then the schedule's longest at every later step (``"cap"``: a run that knows its
    response cap, not how its responses will grow); or step 0's only (``"first"``). The
    same choice, near-tie rules included, runs over whichever it is."""
    every = [bucket_of(n, buckets) for n in schedule]
    if which == "first":
        return every[:1]
    if which == "cap":
        return every[:1] + [max(every)] * (len(every) - 1)
    return every


def start_candidates(
    ranked: list[GlobalPlan],
    lengths: Sequence[int],
    ranked_at: Callable[[int], list[GlobalPlan]],
) -> list[GlobalPlan]:
    """``ranked`` (the k-best at the first length, best first), then the planner's
    runnable k-best at each later distinct length of ``lengths`` (shorter first;
    ``ranked_at(n)``) that ``ranked`` lacks (see the module docstring); a length where
    nothing fits (``ranked_at`` raises :class:`StartPlanError`) adds none."""
    out, seen = list(ranked), set(ranked)
    for n in sorted(set(lengths[1:]) - {lengths[0]}):
        try:
            more = ranked_at(n)
        except StartPlanError:  # nothing fits there: the run will have to stop or move
            continue
        for p in more:
            if p not in seen:
                seen.add(p)
                out.append(p)
    return out


def choose_start_plan(
    ranked: list[GlobalPlan],
    lengths: Sequence[int],
    which: str,
    workload: Callable[[int], Workload],
    ranked_at: Callable[[int], list[GlobalPlan]],
    costmodel,
    move_price: Callable[[GlobalPlan, GlobalPlan], float],
    tie_margin: float = 0.0,
    unmeasured: Callable[[GlobalPlan], int] | None = None,
) -> tuple[GlobalPlan, Decision]:
    """The start plan among ``ranked`` (the planner's runnable k-best at the first
    step's length, best first) and its Decision (see the module docstring).

    Arguments:
        lengths: the lengths to choose over (:func:`start_lengths` of ``which``).
        workload: the workload at a length; ranked_at: see :func:`start_candidates`.
        costmodel, move_price, tie_margin, unmeasured: as
            :func:`~nereus_rl.policy.lookahead.choose_start` takes them.

    A lookahead that cannot choose (no candidate fits the first step: not expected, the
    planner's k-best all fit it) keeps ``ranked[0]`` and says why in the Decision.
    """
    wls = {n: workload(n) for n in set(lengths)}
    ranked = start_candidates(ranked, lengths, ranked_at)
    base = dict(
        step=-1,  # decided before step 0
        signal="start_plan",
        trigger=TRIGGERS[which].format(n=len(lengths)),
        urgent=False,
        current=None,
        taken=False,  # not a transition: the run starts on the plan
        path="start",
    )
    try:
        ch = choose_start(
            ranked, [wls[n] for n in lengths], lengths, costmodel, move_price,
            tie_margin=tie_margin, unmeasured=unmeasured,
        )  # fmt: skip
    except (LookaheadError, SignalError) as e:
        why = f"the planner's best: lookahead not used: {e}"
        return ranked[0], Decision(**base, candidate=ranked[0], reason=why)
    return ch.plan, Decision(**base, candidate=ch.plan, reason=ch.reason, lookahead=ch.record())
