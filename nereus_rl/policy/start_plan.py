"""The adaptive run's first plan, chosen over the lengths the run is configured with.

The planner ranks plans at the first step's workload only. With responses growing, its
best there is often a plan that memory forces the run off a few steps later: the run
pays the forced move and, before it, steps on a plan chosen for lengths that no longer
hold, while the best fixed plan (one that fits every step) pays neither. bench_e2e
(GRPO sync, quick, idle): the start plan went over the budget in 2 of 3 repeats and the
best fixed plan measured 0.79x adaptive's step latency.

So the start plan is chosen with lookahead (:func:`nereus_rl.policy.lookahead.choose_start`)
over the run's lengths from step 0 to its end. At startup the controller's seq_len
signal has seen no length, so it cannot forecast; what the run has is its configured
length schedule (``TrainConfig.trace``, the replayed trace file, when one is given;
else the curriculum from ``length_start`` to ``length_end`` over ``steps``): the
response-length limit of every step, which the rollout enforces. That is the
schedule the trainer's own steps use, so the start plan's forecast is what the run
will ask, not a guess; later decisions still forecast from the seq_len signal (the
lookahead on the urgent and opportunistic paths), as the schedule of a real run is only
an upper bound. A schedule whose lengths are flat, or whose planner's best holds every
length, keeps the planner's best (lookahead overrides it only when it goes over).

The candidates are the planner's k-best at the first step's length and, after them, its
k-best at each later length of the schedule. The planner's search at one length drops a
stage layout that another layout on the same devices beats there (it can never be that
length's best), so its k-best at the first length lacks the plans that hold longer
lengths by spending memory for speed: bench_e2e ReMax async, where the best fixed plan
(the planner's best at the longest length, rollout and reference on devices of their own,
training pp 2 on two) ran 0.10 s per step, was not among the 176 plans the planner
enumerates at the first length (training dp 2 on the same two devices beats its pp 2 there
and fits there, not later), and the start went to a plan the model itself priced 15-27%
slower (three diagnostic starts).

Among near ties (scores within the model's measured error, ``Adapter.tie_margin``)
the start goes to the plan on the fewest devices, not to the lowest score: the
calibration's probes are few and noisy, so which of several near-tied plans scored
lowest changed from startup to startup (GRPO sync: five different start plans over ten
rounds, the 4-device ones 9% slower on average than the 3-device best fixed plan), and
the plan on fewer devices leaves devices spare for the lengths to grow into and for a
loss that then forces no move (:func:`nereus_rl.policy.lookahead._choose`).

The choice is logged as the run's first decision row (``path: "start"``), with the
lookahead's record and its reason; it is not a transition (``taken`` is False).
"""

from __future__ import annotations

from typing import Any

from nereus_rl.core.globalplan import GlobalPlan
from nereus_rl.core.workload import bucket_of
from nereus_rl.policy.controller import SignalError
from nereus_rl.policy.lookahead import LookaheadError, choose_start
from nereus_rl.trainer.config import TrainConfigError


def start_lengths(adapter) -> list[int]:
    """The lengths the start plan is chosen over (bucketed), step 0 first, as
    ``TrainConfig.start_lengths`` says: the run's configured length of every step
    (``"schedule"``); step 0's, then the schedule's longest at every later step
    (``"cap"``: a run that knows its response cap, not how its responses will grow);
    or step 0's only (``"first"``). The same choice, near-tie rules included, runs
    over whichever it is."""
    tr, cfg = adapter.trainer, adapter.cfg
    every = [bucket_of(tr._response_len(s), cfg.buckets) for s in range(cfg.steps)]
    if cfg.start_lengths == "first":
        return every[:1]
    if cfg.start_lengths == "cap":
        return every[:1] + [max(every)] * (len(every) - 1)
    return every


def start_candidates(adapter, ranked: list[GlobalPlan], lengths: list[int]) -> list[GlobalPlan]:
    """``ranked`` (the k-best at the first length, best first), then the planner's
    runnable k-best at each later distinct length of ``lengths`` (shorter first) that
    ``ranked`` lacks (see the module docstring); a length nothing fits adds none."""
    out, seen = list(ranked), set(ranked)
    for n in sorted(set(lengths[1:]) - {lengths[0]}):
        try:
            more = adapter.ranked_plans(n)
        except TrainConfigError:  # nothing fits there: the run will have to stop or move
            continue
        for _, p in more:
            if p not in seen:
                seen.add(p)
                out.append(p)
    return out


def choose_start_plan(adapter, ranked: list[GlobalPlan]) -> tuple[GlobalPlan, dict[str, Any]]:
    """The start plan among ``ranked`` (the planner's runnable k-best at the first
    step's length, best first) and its decision row (see the module docstring).

    A lookahead that cannot choose (no candidate fits the first step: not expected, the
    planner's k-best all fit it) keeps ``ranked[0]`` and says why in the row.
    """

    lengths = start_lengths(adapter)
    wls = {n: adapter.workload(n) for n in set(lengths)}
    ranked = start_candidates(adapter, ranked, lengths)
    row: dict[str, Any] = {
        "step": -1,  # decided before step 0
        "signal": "start_plan",
        "trigger": {
            "schedule": f"start: the configured lengths of {len(lengths)} steps",
            "cap": f"start: the first step's length, then the longest ({len(lengths)} steps)",
            "first": "start: the first step's length only",
        }[adapter.cfg.start_lengths],
        "urgent": False,
        "path": "start",
        "taken": False,  # not a transition: the run starts on the plan
        "current": None,
        "measured_transition_s": None,
        "predicted_transition_s": 0.0,
        "predicted_saving_s": 0.0,
    }
    try:
        ch = choose_start(
            ranked, [wls[n] for n in lengths], lengths, adapter.priced(), adapter.move_price,
            tie_margin=adapter.tie_margin(), unmeasured=adapter.unmeasured_stages,
        )  # fmt: skip
    except (LookaheadError, SignalError) as e:
        row.update(candidate=repr(ranked[0]), reason=f"the planner's best: lookahead not used: {e}")
        return ranked[0], row
    row.update(ch.record())
    row.update(candidate=repr(ch.plan), reason=ch.reason)
    return ch.plan, row
