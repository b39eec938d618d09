"""Branch and bound over group sizes and choices of the exact planner (see
``nereus_rl.planner.planner``): the search of the partitions the cheap bounds leave.

Within a partition, groups are taken in order, each at sizes from the largest the
remaining devices allow downwards. A group before the last picks a vector from its
group table (``planner_groups``); the last group needs no table: its stages' layouts
are enumerated depth first against the objective ``sum_p max(M_p, T_p)`` itself
(``M``: the phase maxima of the groups before), pruned by memory and by the bound
``sum_p max(M_p, T_p + R_p)`` (``R``: the remaining stages' fastest times), so only
choices that beat the incumbent are visited.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping

_INF = math.inf
_SHAVE = 1.0 - 1e-12


class LastGroup:
    """What the depth-first search of a partition's last group needs at one size.

    Arguments:
        lists: per stage, its Pareto list ``[(time, mem, layout_idx, d), ...]`` sorted
            by time (memory falling); none empty.
        phases: phase of each stage.
        thr: width rule: 0, or some stage must use more than ``thr`` devices.
        cap: usable bytes per device.
    """

    __slots__ = ("cap", "lists", "phases", "rflag", "rmem", "rmin", "thr")

    def __init__(self, lists: list, phases: list[int], thr: int, cap: int) -> None:
        self.lists, self.phases, self.thr, self.cap = lists, phases, thr, cap
        G = len(lists)
        # Suffix sums from position pos on: fastest time per phase, least memory, and
        # whether some later stage can satisfy the width rule.
        self.rmin = [(0.0, 0.0, 0.0)] * (G + 1)
        self.rmem = [0] * (G + 1)
        self.rflag = [False] * (G + 1)
        for pos in range(G - 1, -1, -1):
            lst = lists[pos]
            r = list(self.rmin[pos + 1])
            r[phases[pos]] += lst[0][0]
            self.rmin[pos] = (r[0], r[1], r[2])
            self.rmem[pos] = self.rmem[pos + 1] + lst[-1][1]
            self.rflag[pos] = self.rflag[pos + 1] or any(c[3] > thr for c in lst)
        # Shave a relative 1e-12: the search adds these in another order than a plan's
        # times are summed, and a bound must never exceed what it bounds.
        self.rmin = [(a * _SHAVE, b * _SHAVE, c * _SHAVE) for a, b, c in self.rmin]


class Search:
    """The k best plans over partitions searched one by one, sharing one incumbent.

    Arguments:
        Cl: cheap bounds, ``Cl[mask][j] = [c0, c1, c2]`` for the stage subset ``mask``
            at size ``2**j`` (inf: some stage fits no layout up to it).
        gi: ``gi(group, n) -> (vectors, stop)``: the group's table at size ``n``
            (``[(vec, choices)]``) and whether no smaller size can fit either.
        gl: ``gl(group, n) -> (LastGroup | None, next_n)``: the same group for the
            depth-first search (None: nothing fits at n), and the next smaller size
            that can hold a plan no larger size holds (0: none).
        k: how many best plans to keep.

    Attributes:
        best: max-heap of ``(-objective, counter, [(group, choices), ...])``.
        thr: the objective to beat (the k-th best so far; inf until k plans are found).
        nodes: search nodes visited.
    """

    def __init__(self, Cl: Mapping, gi: Callable, gl: Callable, k: int) -> None:
        self.Cl, self.gi, self.gl, self.k = Cl, gi, gl, k
        self.best: list = []
        self.seen: set = set()
        self.thr = _INF
        self.nodes = 0
        self._count = 0

    def run(self, part: list[tuple[int, ...]], masks: list[int], N: int) -> None:
        """Search one partition (groups in search order, with their stage bitmasks)."""
        self._rec(part, masks, 0, N, (0.0, 0.0, 0.0), [], {})

    def _offer(self, obj: float, picks: list) -> None:
        # A plan is its groups' choices; the size a table was built at is not part of it.
        key = tuple(sorted(picks))
        if key in self.seen or obj >= self.thr:
            return
        self.seen.add(key)
        heapq.heappush(self.best, (-obj, self._count, picks))
        self._count += 1
        if len(self.best) > self.k:
            heapq.heappop(self.best)
        if len(self.best) >= self.k:
            self.thr = -self.best[0][0]

    def _last(self, g: tuple[int, ...], lg: LastGroup, M: tuple, picks: list) -> None:
        lists, ph, wthr, cap = lg.lists, lg.phases, lg.thr, lg.cap
        rmin, rmem, rflag = lg.rmin, lg.rmem, lg.rflag
        m0, m1, m2 = M
        G = len(lists)
        ch = [0] * G

        def dfs(pos: int, t0: float, t1: float, t2: float, mem: int, flag: bool) -> None:
            self.nodes += 1
            if pos == G:
                if flag:
                    obj = (m0 if m0 > t0 else t0) + (m1 if m1 > t1 else t1)
                    self._offer(obj + (m2 if m2 > t2 else t2), [*picks, (g, tuple(ch))])
                return
            p = ph[pos]
            q0, q1, q2 = rmin[pos + 1]
            room = cap - mem - rmem[pos + 1]
            later = rflag[pos + 1]
            for t, m, li, d in lists[pos]:
                if m > room:
                    continue  # memory falls along the list: a later layout may fit
                a0, a1, a2 = t0, t1, t2
                if p == 0:
                    a0 += t
                elif p == 1:
                    a1 += t
                else:
                    a2 += t
                b0, b1, b2 = a0 + q0, a1 + q1, a2 + q2
                lb = (m0 if m0 > b0 else b0) + (m1 if m1 > b1 else b1) + (m2 if m2 > b2 else b2)
                if lb >= self.thr:
                    break  # time grows along the list: no later layout does better
                f = flag or d > wthr
                if not (f or later):
                    continue
                ch[pos] = li
                dfs(pos + 1, a0, a1, a2, mem + m, f)

        dfs(0, 0.0, 0.0, 0.0, 0, wthr == 0)

    def _rec(self, part, masks, i, rem, M, picks, rest_memo) -> None:
        self.nodes += 1
        ng = len(part)
        Cl = self.Cl
        Cg = Cl[masks[i]]
        left = ng - i - 1
        n = 1 << ((rem - left).bit_length() - 1)
        m0, m1, m2 = M
        while n >= 1:
            c0, c1, c2 = Cg[n.bit_length() - 1]
            if c0 == _INF or c1 == _INF or c2 == _INF:
                break  # some stage fits no layout at n, nor at any smaller size
            # C_G(n) only grows as n shrinks: once it alone (with M) cannot beat the
            # incumbent, no smaller size of this group can.
            if (m0 if m0 > c0 else c0) + (m1 if m1 > c1 else c1) + (
                m2 if m2 > c2 else c2
            ) >= self.thr:
                break
            if not left:
                lg, nxt = self.gl(part[i], n)
                if lg is not None:
                    self._last(part[i], lg, M, picks)
                if not nxt:
                    break
                n = nxt
                continue
            rem2 = rem - n
            # Bound for the groups after i given rem2 devices: each gets at most the
            # largest size the others leave it (memoized per partition).
            n2 = 1 << ((rem2 - left + 1).bit_length() - 1)
            rest = rest_memo.get((i, n2))
            if rest is None:
                r0 = r1 = r2 = 0.0
                j2 = n2.bit_length() - 1
                for mk in masks[i + 1 :]:
                    a, b, c = Cl[mk][j2]
                    if a > r0:
                        r0 = a
                    if b > r1:
                        r1 = b
                    if c > r2:
                        r2 = c
                if r0 == _INF or r1 == _INF or r2 == _INF:
                    r0 = _INF
                rest = rest_memo[(i, n2)] = (r0, r1, r2)
            r0, r1, r2 = rest
            if r0 == _INF:
                n //= 2
                continue
            b0 = m0 if m0 > r0 else r0
            b1 = m1 if m1 > r1 else r1
            b2 = m2 if m2 > r2 else r2
            # The cheap bound of this group at n gates building its table.
            if (b0 if b0 > c0 else c0) + (b1 if b1 > c1 else c1) + (
                b2 if b2 > c2 else c2
            ) >= self.thr:
                n //= 2
                continue
            vecs, stop = self.gi(part[i], n)
            if stop:
                break
            for vec, ch in vecs:
                a0 = m0 if m0 > vec[0] else vec[0]
                a1 = m1 if m1 > vec[1] else vec[1]
                a2 = m2 if m2 > vec[2] else vec[2]
                lb = (a0 if a0 > r0 else r0) + (a1 if a1 > r1 else r1) + (a2 if a2 > r2 else r2)
                if lb >= self.thr:
                    continue
                nxt = [*picks, (part[i], ch)]
                self._rec(part, masks, i + 1, rem2, (a0, a1, a2), nxt, rest_memo)
            n //= 2
