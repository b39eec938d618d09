"""Lookahead choice: pick a plan that keeps fitting as lengths rise.

The planner's best plan for the next step's workload alone is, with response lengths
rising, often the one that just fits: a step or two later its predicted peak crosses
the memory budget again and another urgent move follows (transition churn). Here the
candidates (the planner's k-best for the next step, each feasible for it) are scored
over a horizon of workloads built from the controller's own length forecast (never
from the length schedule):

    score(c) = T(current -> c) + sum_j latency(c, wl_j)

and, when ``c`` goes over memory at horizon step ``j``, the predicted extra urgent
move replaces the rest: ``+ T(c -> r) + sum_{i >= j} latency(r, wl_i)`` where ``r``
is the fastest (over the rest) candidate that holds every remaining length, else the
fastest that fits ``wl_j`` (one extra move is predicted; what happens after it is
not). Lookahead only overrides the old choice (the planner's
best for the next step) when that choice goes over memory within the horizon; then
the lowest score wins. A forecast length that no candidate holds is beyond planning:
the horizon ends before it. When the old choice fits the (so cut) horizon, a
flat forecast included, the old choice stands.

The urgent path uses it to choose its move. The opportunistic path uses it too (with
the current plan among the candidates, at no transition cost): a planner's best that
goes over within the horizon is replaced by the best-scoring plan, and the chosen
plan's crossing (``over_at``) and the move it would force (``forced_move_s``) go to
admission, which counts savings only until then (:mod:`nereus_rl.policy.admission`).

Transition costs are the expensive part (a DAG compile each), so candidates are
visited by their latency lower bound and the search stops when the bound exceeds
the best score found (branch and bound: the result is the exact argmin).

Near ties (``tie_margin``): scores within that relative band of the best count as
tied, and among them the candidate needing the fewest moves over the horizon wins
(staying: 0; a move: 1; a move that goes over within the horizon: 2). The trainer
passes the cost model's measured step error capped at the controller's efficiency
band (``Adapter.tie_margin``), so a predicted difference the model cannot resolve
never buys an extra move. The start plan (:func:`choose_start`) then prefers the
candidate on the fewest devices, the planner's best included: no move is at stake
there, and within the band a plan on fewer devices leaves headroom (see
:func:`_choose`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from nereus_rl.core.globalplan import GlobalPlan
from nereus_rl.core.workload import Workload
from nereus_rl.costmodel.costmodel import CostModel


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
        over_at: horizon index where the chosen plan goes over memory (None: never).
        forced_move_s: predicted seconds of the extra move that crossing forces
            (0.0 when it never goes over; inf when no candidate holds that length).
        current_over_at: horizon index where the current plan goes over memory (None:
            never; 0: it cannot run the next step, the urgent path).
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
    over_at: int | None = None
    forced_move_s: float = 0.0
    current_over_at: int | None = None

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
            "lookahead_over_at": self.over_at,
            "lookahead_current_over_at": self.current_over_at,
            # inf (no plan holds the length where it goes over) is not valid JSON
            "lookahead_forced_move_s": (
                self.forced_move_s if self.forced_move_s != float("inf") else None
            ),
        }


def first_over(plan: GlobalPlan, workloads: Sequence[Workload], costmodel: CostModel) -> int | None:
    """Index of the first workload under which ``plan`` goes over memory (None: never)."""
    return next(
        (j for j, wl in enumerate(workloads) if costmodel.memory_violations(plan, wl)), None
    )


def choose(
    current: GlobalPlan,
    candidates: Sequence[GlobalPlan],
    workloads: Sequence[Workload],
    lengths: Sequence[int],
    costmodel: CostModel,
    transition_cost: Callable[[GlobalPlan, GlobalPlan], float],
    tie_margin: float = 0.0,
) -> LookaheadChoice:
    """Choose among ``candidates`` over the horizon ``workloads`` (see the module doc).

    Arguments:
        current: the running plan (the transition's source; it may be among the
            candidates, then at no transition cost: the opportunistic path).
        candidates: the planner's k-best for ``workloads[0]``, best first; those that do
            not fit ``workloads[0]`` are skipped.
        workloads: the next step's workload, then the forecast ones.
        lengths: the response length of each workload (for the record).
        costmodel: prices latency and memory.
        transition_cost: predicted seconds of a transition ``(src, dst)``.
        tie_margin: relative band of the best score within which candidates count as
            tied; among them the one needing the fewest moves wins (0: exact argmin).

    Raises:
        LookaheadError: no workloads, lengths of another size, no candidate that fits
            the next step's workload, or a negative ``tie_margin``.
    """
    ch = _choose(current, candidates, workloads, lengths, costmodel, transition_cost, tie_margin)
    return replace(ch, current_over_at=first_over(current, workloads, costmodel))


def choose_start(
    candidates: Sequence[GlobalPlan],
    workloads: Sequence[Workload],
    lengths: Sequence[int],
    costmodel: CostModel,
    transition_cost: Callable[[GlobalPlan, GlobalPlan], float],
    tie_margin: float = 0.0,
    unmeasured: Callable[[GlobalPlan], int] | None = None,
) -> LookaheadChoice:
    """The run's first plan, chosen as :func:`choose` chooses a move, with no plan
    running yet (so no transition to the candidate is paid): ``candidates[0]`` (the
    planner's best at the first step) stands unless it goes over memory within
    ``workloads`` (the run's lengths from its first step); then the lowest score wins,
    the predicted forced move (its price and the plan it goes to) included, and among
    near ties (``tie_margin``) the candidate that is not forced to move, then the one
    with the fewest stages of a shape the startup calibration did not measure
    (``unmeasured(plan)``, None: none counted), then the one on the fewest devices (see
    :func:`_choose`), the planner's best included.

    Why: a start plan fast at the first length that rising lengths force off pays the
    forced move and its slower steps before it, which a plan that holds every length
    never pays.

    Raises:
        LookaheadError: as :func:`choose` (no candidate fits the first workload, ...).
    """

    def tcost(a: GlobalPlan | None, b: GlobalPlan) -> float:
        return 0.0 if a is None else transition_cost(a, b)

    # current=None: every candidate starts at no cost, and none is "the current plan"
    ch = _choose(
        None, candidates, workloads, lengths, costmodel, tcost, tie_margin,
        fewer_devices=True, unmeasured=unmeasured,
    )  # fmt: skip
    return replace(ch, reason="start plan: " + ch.reason)


def _lengths_label(lengths: Sequence[int]) -> str:
    """``lengths`` for a reason, each repeat as "length xsteps" (a 200-step run's start
    plan looks over 200 lengths)."""
    runs: list[list[int]] = []
    for n in lengths:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return "[" + ", ".join(f"{n} x{k}" if k > 1 else f"{n}" for n, k in runs) + "]"


def _tie_how(unm: Callable[[int], int], ndev: Callable[[int], int], pick: int, other: int) -> str:
    """Why near-tied candidate ``pick`` was taken over ``other`` (start plan: fewer
    unmeasured stage shapes, else fewer devices), for a decision's reason."""
    if unm(pick) < unm(other):
        return (
            f"with {unm(pick)} stage(s) of a shape the calibration did not run instead of "
            f"{unm(other)}"
        )
    return f"on {ndev(pick)} devices instead of {ndev(other)}"


def _total_of(cm) -> Callable[[GlobalPlan, Workload], float]:
    """``cm``'s step total: ``step_total`` where it has one (the same float as
    ``step_latency(...).total_s``, without building the estimate)."""
    fn = getattr(cm, "step_total", None)
    return fn if fn is not None else (lambda p, wl: cm.step_latency(p, wl).total_s)


def _choose(
    current: GlobalPlan | None,
    candidates: Sequence[GlobalPlan],
    workloads: Sequence[Workload],
    lengths: Sequence[int],
    costmodel: CostModel,
    transition_cost: Callable[[GlobalPlan, GlobalPlan], float],
    tie_margin: float,
    fewer_devices: bool = False,
    unmeasured: Callable[[GlobalPlan], int] | None = None,
) -> LookaheadChoice:
    """The choice of :func:`choose` (without ``current_over_at``).

    With ``fewer_devices`` (the start plan), near ties go to the candidate on the
    fewest devices (after the fewest moves), and the planner's best that holds every
    length is itself tied with the candidates that hold them too and score within the
    band of it. Why: within the band the model cannot say which plan is faster, and the
    one on fewer devices leaves devices spare: headroom for the lengths to grow into
    and for a device loss that then forces no move.

    Before the devices, with ``unmeasured`` (the start plan: stages of a shape no
    calibration probe ran), near ties go to the candidate with the fewest such stages:
    within the band the model's error is what decides, and it is known (the tie band
    itself) only for the shapes it measured; an unmeasured one is extrapolated and may
    be mispriced severalfold.
    """
    if not tie_margin >= 0:
        raise LookaheadError(f"tie_margin={tie_margin} must be >= 0")
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
    # A horizon repeats lengths (a forecast holds, a schedule plateaus): each candidate's
    # memory is checked once per distinct workload
    fit_of: dict[tuple[int, Workload], bool] = {}
    for i, c in enumerate(cands):
        for wl in workloads:
            if (i, wl) not in fit_of:
                fit_of[i, wl] = not cm.memory_violations(c, wl)
    fits_all = [[fit_of[i, wl] for wl in workloads] for i in range(len(cands))]
    old_over_full = next((j for j in range(h) if not fits_all[0][j]), None)
    # A length that no candidate holds is beyond planning (the planner will have to be
    # asked when it comes): the horizon ends before the first such one, so that a
    # forecast running past every plan's memory does not switch lookahead off for the
    # lengths before it (before, the old choice was then kept, whatever it held).
    h_all = h
    h = next((j for j in range(h) if not any(f[j] for f in fits_all)), h)
    fits = [f[:h] for f in fits_all]
    # (repeated lengths are priced once by the decisions' PricedModel memo)
    total = _total_of(cm)
    lat = [[total(c, wl) for wl in workloads[:h]] for c in cands]
    over = [next((j for j in range(h) if not f[j]), None) for f in fits]
    tcache: dict[tuple[int, int], float] = {}

    def tcost(a: int | None, b: int) -> float:
        key = (-1 if a is None else a, b)
        if key not in tcache:
            src = current if a is None else cands[a]
            tcache[key] = 0.0 if src == cands[b] else float(transition_cost(src, cands[b]))
        return tcache[key]

    repl_of: dict[int, int | None] = {}  # by the step it goes over at: one search each

    def repl(i: int) -> int | None:
        j = over[i]
        if j not in repl_of:
            repl_of[j] = _repl(j)
        return repl_of[j]

    def _repl(j: int) -> int | None:
        # The extra urgent move's target: the fastest candidate over the rest of the
        # horizon among those that hold all of it (as this choice itself prefers),
        # else the fastest fitting wl_j. (Before, it was always the fastest fitting
        # wl_j, whose own later crossing went uncounted: that favoured candidates that
        # go over early, replaced by a plan that would go over again.)
        rest = [r for r in range(len(cands)) if all(fits[r][j:])]
        if rest:
            return min(rest, key=lambda r: sum(lat[r][j:]))
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

    def forced(i: int) -> float:
        if over[i] is None:
            return 0.0
        r = repl(i)
        return tcost(i, r) if r is not None else float("inf")

    def moves(i: int) -> int:
        # moves over the horizon: to the candidate, and the one its crossing forces
        return (cands[i] != current) + (over[i] is not None)

    def ndev(i: int) -> int:
        return len(getattr(cands[i], "devices", ()))

    def unm(i: int) -> int:
        return unmeasured(cands[i]) if unmeasured is not None else 0

    any_fit = h == h_all
    cut = (
        ""
        if any_fit
        else f"; no candidate of {len(cands)} fits the forecast lengths from horizon step "
        f"{h} ({list(lengths[h:])}), scored over the {h} step(s) before"
    )
    old = score(0)
    cur = next((i for i, c in enumerate(cands) if c == current), None)
    if over[0] is None and tie_margin > 0 and cur not in (None, 0) and over[cur] is None:
        # The planner's best holds the horizon, and so does the current plan: a move
        # whose score is within the model's error of staying is churn (a ranking a
        # noisy measurement can flip; a near tie keeps the plan needing no move).
        stay = score(cur)
        if stay <= old * (1 + tie_margin):
            return LookaheadChoice(
                cands[cur], cur, not any_fit, tuple(lengths), h_all, stay, old, old_over_full,
                f"lookahead over {h_all} steps at lengths {_lengths_label(lengths)}: near tie: the "
                f"current plan scores {stay:.4g} s, within {tie_margin:.0%} of the planner's "
                f"best ({old:.4g} s with its move); kept the current plan{cut}",
                len(cands), None, 0.0,
            )  # fmt: skip
    if over[0] is None:
        # The old choice holds every plannable forecast length: no churn to avoid, and
        # the planner's ranking (latency) is trusted over a cheaper-looking transition.
        kept = (
            f"lookahead over {h_all} steps at lengths {_lengths_label(lengths)}: the planner's "
            f"best for the next step fits every forecast length{' it can' if cut else ''}"
        )
        pick, scored = 0, 1
        if fewer_devices and tie_margin > 0:
            # (a candidate with as few moves holds every length too: its score is its
            # latency sum, no transition to compile)
            band = old * (1 + tie_margin)
            near = [i for i in range(len(cands)) if moves(i) <= moves(0) and bound(i) <= band]
            scored = len(cands)
            pick = min(near, key=lambda i: (unm(i), ndev(i), score(i)))
            if (unm(pick), ndev(pick)) >= (unm(0), ndev(0)):
                pick = 0
        if pick == 0:
            return LookaheadChoice(
                cands[0], 0, not any_fit, tuple(lengths), h_all, old, old, old_over_full,
                f"{kept}; kept{cut}", scored, old_over_full,
            )  # fmt: skip
        s_pick = score(pick)
        return LookaheadChoice(
            cands[pick], pick, not any_fit, tuple(lengths), h_all, s_pick, old, old_over_full,
            f"{kept}; near tie: candidate {pick} also does and scores {s_pick:.4g} s, within "
            f"{tie_margin:.0%} of it ({old:.4g} s), {_tie_how(unm, ndev, pick, 0)}: "
            f"taken{cut}",
            scored, None if any_fit else h, 0.0,
        )  # fmt: skip
    best_i, best_s, scored = 0, old, 1
    for i in sorted(range(1, len(cands)), key=bound):
        if bound(i) >= best_s:
            break
        s = score(i)
        scored += 1
        if s < best_s:
            best_i, best_s = i, s
    tie = ""
    if tie_margin > 0 and best_s < float("inf"):
        # Near ties: the scores rest on the cost model, whose latencies are trusted only
        # to within ``tie_margin``; a move is real time (and transitions are what the
        # model prices least well). Among candidates within the band of the best score,
        # the one needing the fewest moves over the horizon wins, then the lowest score.
        band = best_s * (1 + tie_margin)
        sc = {best_i: best_s}
        for i in range(len(cands)):
            if i not in sc and bound(i) <= band:
                sc[i] = score(i)
                scored += 1
        near = [i for i, v in sc.items() if v <= band]

        def key(i: int) -> tuple:
            return (moves(i), unm(i), ndev(i), sc[i]) if fewer_devices else (moves(i), sc[i])

        pick = min(near, key=key)
        if key(pick)[:-1] < key(best_i)[:-1]:
            how = (
                f"{moves(pick)} move(s) over the horizon instead of {moves(best_i)}"
                if moves(pick) < moves(best_i)
                else f"as many moves ({moves(pick)}), {_tie_how(unm, ndev, pick, best_i)}"
            )
            tie = (
                f"; near tie: candidate {pick} scores {sc[pick]:.4g} s, within "
                f"{tie_margin:.0%} of the best ({best_s:.4g} s, candidate {best_i}), with {how}"
            )
            best_i, best_s = pick, sc[pick]
    if best_s == float("inf"):  # not expected once the horizon is cut; kept safe
        return LookaheadChoice(
            cands[0], 0, True, tuple(lengths), h_all, old, old, old_over_full,
            f"no candidate of {len(cands)} scores finitely over the forecast lengths "
            f"{list(lengths)}; kept the planner's best for the next step",
            scored, old_over_full, forced(0),
        )  # fmt: skip
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
        not any_fit,
        tuple(lengths),
        h_all,
        best_s,
        old,
        old_over_full,
        f"lookahead over {h_all} steps at lengths {_lengths_label(lengths)}: {why}{tie}{cut}",
        scored,
        over[best_i] if over[best_i] is not None else (None if any_fit else h),
        forced(best_i),
    )
