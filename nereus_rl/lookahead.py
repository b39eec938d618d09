"""Lookahead choice for the urgent path: pick a plan that keeps fitting as lengths rise.

The urgent path used to take the planner's best plan for the next step's workload
only. With response lengths rising, that plan is often the one that just fits: a
step or two later its predicted peak crosses the memory budget again and another
urgent move follows (transition churn). Here the candidates (the planner's k-best
for the next step, each feasible for it) are scored over a horizon of workloads
built from the controller's own length forecast (never from the length schedule):

    score(c) = T(current -> c) + sum_j latency(c, wl_j)

and, when ``c`` goes over memory at horizon step ``j``, the predicted extra urgent
move replaces the rest: ``+ T(c -> r) + sum_{i >= j} latency(r, wl_i)`` where ``r``
is the fastest candidate that fits ``wl_j`` (one extra move is predicted; what
happens after it is not). Lookahead only overrides the old choice (the planner's
best for the next step) when that choice goes over memory within the horizon; then
the lowest score wins. When the old choice fits the whole horizon (a flat forecast
included), or no candidate does, the old choice stands.

Transition costs are the expensive part (a DAG compile each), so candidates are
visited by their latency lower bound and the search stops when the bound exceeds
the best score found (branch and bound: the result is the exact argmin).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from nereus_rl.costmodel import CostModel
from nereus_rl.globalplan import GlobalPlan
from nereus_rl.workload import Workload


class LookaheadError(ValueError):
    """Bad input to :func:`choose` (no candidates or no workloads)."""


@dataclass(frozen=True)
class LookaheadChoice:
    """The urgent path's choice and why.

    Attributes:
        plan: the chosen plan.
        rank: its index among the candidates (0: the old choice).
        fallback: True when no candidate fits the whole horizon (old choice kept).
        lengths: the response lengths (bucketed) of the horizon's workloads.
        horizon: number of steps scored.
        score_s: the chosen plan's score (transition + horizon latency [+ extra move]).
        old_score_s: the old choice's score on the same terms.
        old_over_at: horizon index where the old choice goes over memory (None: never).
        reason: one sentence a person can read.
        scored: candidates whose score was computed (the rest were bounded out).
    """

    plan: GlobalPlan
    rank: int
    fallback: bool
    lengths: tuple[int, ...]
    horizon: int
    score_s: float
    old_score_s: float
    old_over_at: int | None
    reason: str
    scored: int = field(default=0)

    def record(self) -> dict:
        """The fields logged in the trainer's decision record."""
        return {
            "lookahead_lengths": list(self.lengths),
            "lookahead_horizon": self.horizon,
            "lookahead_rank": self.rank,
            "lookahead_fallback": self.fallback,
            "lookahead_score_s": self.score_s,
            "lookahead_old_score_s": self.old_score_s,
            "lookahead_old_over_at": self.old_over_at,
            "lookahead_scored": self.scored,
            "lookahead_reason": self.reason,
        }


def choose(
    current: GlobalPlan,
    candidates: Sequence[GlobalPlan],
    workloads: Sequence[Workload],
    lengths: Sequence[int],
    costmodel: CostModel,
    transition_cost: Callable[[GlobalPlan, GlobalPlan], float],
) -> LookaheadChoice:
    """Choose among ``candidates`` over the horizon ``workloads`` (see the module doc).

    Arguments:
        current: the running plan (the transition's source).
        candidates: the planner's k-best for ``workloads[0]``, best first; those that do
            not fit ``workloads[0]`` are skipped.
        workloads: the next step's workload, then the forecast ones.
        lengths: the response length of each workload (for the record).
        costmodel: prices latency and memory.
        transition_cost: predicted seconds of a transition ``(src, dst)``.

    Raises:
        LookaheadError: no workloads, lengths of another size, or no candidate that fits
            the next step's workload.
    """
    if not workloads or len(lengths) != len(workloads):
        raise LookaheadError(
            f"need one length per workload and at least one ({len(lengths)} lengths, "
            f"{len(workloads)} workloads)"
        )
    cm = costmodel
    h = len(workloads)
    cands = [c for c in candidates if not cm.memory_violations(c, workloads[0])]
    if not cands:
        raise LookaheadError("no candidate fits the next step's workload; ask the planner again")
    lat = [[cm.step_latency(c, wl).total_s for wl in workloads] for c in cands]
    fits = [[not cm.memory_violations(c, wl) for wl in workloads] for c in cands]
    over = [next((j for j in range(h) if not f[j]), None) for f in fits]
    tcache: dict[tuple[int, int], float] = {}

    def tcost(a: int | None, b: int) -> float:
        key = (-1 if a is None else a, b)
        if key not in tcache:
            src = current if a is None else cands[a]
            tcache[key] = 0.0 if src == cands[b] else float(transition_cost(src, cands[b]))
        return tcache[key]

    def repl(i: int) -> int | None:
        # The extra urgent move's target: the fastest candidate fitting wl_j.
        j = over[i]
        ok = [r for r in range(len(cands)) if fits[r][j]]
        return min(ok, key=lambda r: lat[r][j]) if ok else None

    def bound(i: int) -> float:
        j = over[i]
        if j is None:
            return sum(lat[i])
        r = repl(i)
        tail = sum(lat[r][j:]) if r is not None else float("inf")
        return sum(lat[i][:j]) + tail

    def score(i: int) -> float:
        b = bound(i)
        if over[i] is None or b == float("inf"):
            return b + tcost(None, i)
        return b + tcost(None, i) + tcost(i, repl(i))

    any_fit = any(o is None for o in over)
    old = score(0)
    if over[0] is None:
        # The old choice holds every forecast length: no churn to avoid, and the
        # planner's ranking (latency) is trusted over a cheaper-looking transition.
        return LookaheadChoice(
            cands[0], 0, False, tuple(lengths), h, old, old, None,
            f"lookahead over {h} steps at lengths {list(lengths)}: the planner's best for "
            "the next step fits every forecast length; kept",
            1,
        )  # fmt: skip
    if not any_fit:
        return LookaheadChoice(
            cands[0], 0, True, tuple(lengths), h, old, old, over[0],
            f"no candidate of {len(cands)} fits the forecast lengths {list(lengths)}; "
            "kept the planner's best for the next step",
            1,
        )  # fmt: skip
    best_i, best_s, scored = 0, old, 1
    for i in sorted(range(1, len(cands)), key=bound):
        if bound(i) >= best_s:
            break
        s = score(i)
        scored += 1
        if s < best_s:
            best_i, best_s = i, s
    if best_i == 0:
        why = (
            "the planner's best for the next step scores best even with the "
            f"extra move it predicts at horizon step {over[0]}"
        )
    else:
        how = (
            "fits every forecast length"
            if over[best_i] is None
            else f"goes over at horizon step {over[best_i]}"
        )
        old_how = f"goes over memory at horizon step {over[0]} (an extra urgent move)"
        why = (
            f"candidate {best_i} {how} and scores {best_s:.4g} s vs the old choice's "
            f"{old:.4g} s, which {old_how}"
        )
    return LookaheadChoice(
        cands[best_i],
        best_i,
        False,
        tuple(lengths),
        h,
        best_s,
        old,
        over[0],
        f"lookahead over {h} steps at lengths {list(lengths)}: {why}",
        scored,
    )
