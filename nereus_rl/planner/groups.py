"""Colocation-group tables of the exact planner (see ``nereus_rl.planner.planner``).

For a group ``G`` of stages at size ``n`` (each stage picks a layout from its Pareto list
``F_s(n)``: (time, memory) over layouts with ``d <= n`` that fit a device), the table is
the Pareto set of phase-time vectors ``(T_{G,0}, T_{G,1}, T_{G,2})`` over the choices
whose memory adds up to at most a device's capacity. Within a phase the times add, so
each phase's stages are combined as 2-D (time, memory) Pareto lists; a partial choice
dominated in time and memory is dropped (adding the same remaining stages keeps it
dominated). The three phase lists are then joined, keeping for each (phase 0, phase 1)
pair only the fastest phase-2 choice that still fits, and the 3-D dominated vectors are
dropped.

Width rule (``thr > 0``): a group holding rollout and actor_train wider than a node gets
the inter-node weight sync; such a table keeps only choices with some stage wider than
``thr`` devices (a node), so the sync tier it assumes is the one the placed plan gets.
"""

from __future__ import annotations

import bisect
import math


def _pareto2(cands: list) -> tuple[list, list]:
    """(time, memory) Pareto lists of ``cands``: all of them, and those with the flag set."""
    cands.sort(key=lambda c: (c[0], c[1]))
    out_all, out_flag = [], []
    best_all = best_flag = math.inf
    for c in cands:
        if c[1] < best_all:
            out_all.append(c)
            best_all = c[1]
        if c[2] and c[1] < best_flag:
            out_flag.append(c)
            best_flag = c[1]
    return out_all, out_flag


def _combine3(L0: list, L1: list, L2: list, cap: int) -> list:
    """Phase vectors from one choice per phase list whose memory sum fits ``cap``.

    For each (phase-0, phase-1) pair only the fastest phase-2 choice that fits is
    kept: any other fitting one is slower there and equal elsewhere (dominated).
    Each list is sorted by time with strictly falling memory.
    """
    neg = [-c[1] for c in L2]
    n2 = len(L2)
    out = []
    for a in L0:
        for b in L1:
            budget = cap - a[1] - b[1]
            if budget < 0:
                continue
            j = bisect.bisect_left(neg, -budget)
            if j == n2:
                continue
            c = L2[j]
            out.append(((a[0], b[0], c[0]), a[3] + b[3] + c[3]))
    return out


def _prune3(items: list) -> list:
    """Drop (vector, choice) items whose vector is dominated in all three phases."""
    items.sort(key=lambda it: (it[0][0] + it[0][1] + it[0][2], it[0]))
    kept: list = []
    for it in items:
        v0, v1, v2 = it[0]
        for o, _ in kept:
            if o[0] <= v0 and o[1] <= v1 and o[2] <= v2:
                break
        else:
            kept.append(it)
    return kept


def group_vectors(lists: list, phases: list[int], thr: int, cap: int) -> list:
    """Pareto phase vectors of one group: ``[(vec, choices)]`` sorted by ``sum(vec)``.

    Arguments:
        lists: per stage of the group, its Pareto list at the group's size:
            ``[(time, mem, layout_idx, d), ...]`` sorted by time, memory falling.
        phases: phase of each of these stages.
        thr: width rule (0: none; otherwise some stage must use more than thr devices).
        cap: usable bytes per device.

    Returns:
        ``vec`` is ``(T_0, T_1, T_2)``; ``choices`` the layout index of each stage, in the
        order of ``lists``. Empty when no choice fits.
    """
    if any(not lst for lst in lists):
        return []
    # Fast path: every stage's fastest layout fits together.
    fast = [lst[0] for lst in lists]
    if sum(c[1] for c in fast) <= cap and (thr == 0 or any(c[3] > thr for c in fast)):
        vec = [0.0, 0.0, 0.0]
        for c, p in zip(fast, phases):
            vec[p] += c[0]
        return [(tuple(vec), tuple(c[2] for c in fast))]
    # Partial choices per phase: (time, mem, flag, ((pos, layout_idx), ...)), kept as two
    # Pareto lists: all, and those whose flag (some stage wider than thr) is set.
    per_phase: dict[int, tuple[list, list]] = {}
    for pos, (lst, p) in enumerate(zip(lists, phases)):
        cur = per_phase.get(p, ([(0.0, 0, thr == 0, ())], []))
        if thr == 0:
            cur_all = cur[0]
        else:
            ids = {id(c) for c in cur[0]}
            cur_all = cur[0] + [c for c in cur[1] if id(c) not in ids]
        cands = [
            (a[0] + t, a[1] + m, a[2] or d > thr, (*a[3], (pos, li)))
            for a in cur_all
            for t, m, li, d in lst
            if a[1] + m <= cap
        ]
        per_phase[p] = _pareto2(cands)
    empty = ([(0.0, 0, False, ())], [])
    P = [per_phase.get(p, empty) for p in range(3)]
    if thr == 0:
        combos = _combine3(P[0][0], P[1][0], P[2][0], cap)
    else:
        combos = []
        for star in per_phase:
            L = [P[p][1] if p == star else P[p][0] for p in range(3)]
            combos += _combine3(L[0], L[1], L[2], cap)
    final = _prune3(combos)
    return [(v, tuple(li for _, li in sorted(ch))) for v, ch in final]
