"""The exact planner's searches that price plans as placed (see
``nereus_rl.planner.planner``): :func:`search`, for multi-node clusters whose nodes are
not a power of two wide.

With ``devices_per_node`` a power of two, ``place`` lays every group (and stage, unit,
tp group) on a block aligned to its power-of-two size, so a block that fits in a node
lies in one and a stage's link tiers follow from its layout alone: the stage tables
price them so. With nodes of 3 or 6 devices that fails (a block of two devices at
offset 2 straddles nodes 0 and 1 of three), and a stage's tiers depend on where its
group lands, which depends on the other groups' sizes. This search prices every choice
where ``place`` puts it:

* a plan is a partition into groups, a layout per stage, and so a size per group
  (``n_G = max d_s``); ``place`` orders the groups by (decreasing size, first stage) and
  lays them at consecutive offsets, so the sizes fix every group's offset;
* for each partition, a depth-first search over group sizes (powers of two summing to at
  most ``N``), pruned by the cheap bound (per stage, its fastest layout up to the size at
  the most favourable tiers); at each full size vector, each group's table of Pareto
  phase vectors at its size and offset (``planner_groups.group_vectors``, with the width
  rule "some stage uses all ``n_G`` devices", so the group's size is the one searched),
  its stages priced at the tiers their devices get, the weight sync on the tier of the
  group's devices; then a depth-first search over the groups' vectors against
  ``sum_p max_G T_{G,p}``, pruned by the same bound.

Dropping a dominated stage layout or phase vector is safe at a fixed size and offset (the
objective is monotone in the times and the group's size is kept), so the minimum is the
minimum over the plan space as placed. Both ``Planner(native=True)`` and
``Planner(native=False)`` run this search (the compiled search assumes node-aligned
tiers), so they agree. It is plain Python, for the rare clusters it serves (about
0.1 s for six-stage PPO on 192 devices in nodes of 6).
"""

from __future__ import annotations

import heapq
import itertools
import math
import time

import numpy as np

from nereus_rl.costmodel.vec import stage_work_many
from nereus_rl.planner.groups import group_vectors
from nereus_rl.planner.place import infeasible
from nereus_rl.planner.tables import _partitions

_INF = math.inf
_SHAVE = 1.0 - 1e-12
# (tp groups, pp chains, dp group) inter-node or not: every combination
_COMBOS = tuple(itertools.product((False, True), repeat=3))


def _crosses(nodes: list[int], idx) -> bool:
    first = nodes[idx[0]]
    return any(nodes[j] != first for j in idx)


def _combo(nodes: list[int], o: int, dp: int, tp: int, pp: int) -> int:
    """Index into ``_COMBOS`` of the tiers a layout gets on the devices at positions
    ``o .. o + dp*tp*pp - 1`` (as ``costmodel.stage_tiers`` reads them)."""
    w = tp * pp
    tp_x = pp_x = False
    for u in range(dp):
        base = o + u * w
        for p in range(pp):
            if not tp_x and _crosses(nodes, range(base + p * tp, base + (p + 1) * tp)):
                tp_x = True
        for t in range(tp):
            if not pp_x and _crosses(nodes, range(base + t, base + w, tp)):
                pp_x = True
    dp_x = _crosses(nodes, range(o, o + dp * w))
    return _COMBOS.index((tp_x, pp_x, dp_x))


def _front(cands: list) -> list:
    """(time, memory) Pareto points of ``cands`` sorted by time (memory falling)."""
    cands.sort()
    out, best = [], None
    for c in cands:
        if best is None or c[1] < best:
            out.append(c)
            best = c[1]
    return out


def tier_prices(pl, stages, tables, r_i: int, ver: int, dtype: str) -> list:
    """Each stage's ``(table, per, sync)``: ``per[c][li]`` the seconds of layout ``li`` at
    the tiers ``_COMBOS[c]``, ``sync`` the rollout's weight sync per tier (``{}`` for the
    other stages); kept on the planner per (table, efficiency version)."""
    c = pl.cluster
    x = pl.costmodel._x
    out = []
    for i, (sw, t) in enumerate(zip(stages, tables)):
        key = (id(t), ver)
        got = pl._placed_times.get(key)
        if got is None or got[0] is not t:
            if len(pl._placed_times) > 64:
                pl._placed_times.clear()
            dp, tp, pp = (np.array([lay[j] for lay in t.layouts], dtype=np.int64) for j in range(3))
            per = [
                (stage_work_many(sw, dp, tp, pp, np.tile(cb, (len(dp), 1)), c, dtype) @ x).tolist()
                for cb in _COMBOS
            ]
            sync = {v: (t.sync[v] @ x).tolist() for v in t.sync} if i == r_i else {}
            got = pl._placed_times[key] = (t, per, sync)
        out.append(got)
    return out


def search(pl, stages, tables, phases, r_i, a_i, cap, devs, k, ver, dtype):
    """The k best plans priced as placed: ``([(objective, picks)] best first, timings)``,
    as ``Planner._search_native`` returns them.

    Arguments:
        pl: the planner (its cluster and cost model price the layouts).
        stages, tables: the planned stages and their stage tables.
        phases: the phase each stage's time counts in.
        r_i, a_i: index of rollout and actor_train (-1: absent).
        cap: usable bytes per device.
        devs: sorted available device ids.
        k: how many best plans to keep.
        ver: the cost model's version (keys the priced layouts kept on ``pl``).
        dtype: the workload's compute dtype (the tables'), to price them at other tiers.
    """
    t0 = time.perf_counter()
    c = pl.cluster
    dpn = c.devices_per_node
    N = len(devs)
    S = len(stages)
    nodes = [dv // dpn for dv in devs]
    times = tier_prices(pl, stages, tables, r_i, ver, dtype)
    combo_at: dict = {}

    def combo(lay: tuple, o: int) -> int:
        ck = (lay, o)
        cb = combo_at.get(ck)
        if cb is None:
            cb = combo_at[ck] = _combo(nodes, o, *lay)
        return cb

    # Cheap bound of each stage at each size: its fastest layout up to it at the most
    # favourable tiers (and sync tier), a lower bound wherever it is placed.
    sizes = [1 << j for j in range(N.bit_length())]
    cheap = []
    for i, t in enumerate(tables):
        _, per, sync = times[i]
        row, best = [], _INF
        for n in sizes:
            for li in t.by_d.get(n, ()):
                if t.mem_list[li] > cap:
                    continue
                v = min(p[li] for p in per)
                if sync:
                    v += min(s[li] for s in sync.values())
                best = min(best, v)
            row.append(best * _SHAVE)
        cheap.append(row)

    def cheap_vec(g: tuple, j: int) -> tuple:
        v = [0.0, 0.0, 0.0]
        for i in g:
            v[phases[i]] += cheap[i][j]
        return tuple(v)

    gv_cache: dict = {}

    def vectors(g: tuple, n: int, o: int) -> list:
        """Pareto phase vectors of group g at size n laid at position o."""
        gk = (g, n, o)
        got = gv_cache.get(gk)
        if got is not None:
            return got
        sync_v = None
        if r_i in g:
            both = a_i in g
            sync_v = "intra" if both and not _crosses(nodes, range(o, o + n)) else "inter"
        lists = []
        for i in g:
            t = tables[i]
            _, per, sync = times[i]
            allc, full = [], []
            m = 1
            while m <= n:
                for li in t.by_d.get(m, ()):
                    mem = t.mem_list[li]
                    if mem > cap:
                        continue
                    tt = per[combo(t.layouts[li], o)][li]
                    if sync_v is not None and i == r_i:
                        tt += sync[sync_v][li]
                    cnd = (tt, mem, li, m)
                    allc.append(cnd)
                    if m == n:
                        full.append(cnd)
                m *= 2
            merged = {cd[2]: cd for cd in _front(allc) + _front(full)}
            lists.append(sorted(merged.values()))
        # Width rule: some stage uses all n devices (n > 1), so the group's size is n.
        got = gv_cache[gk] = group_vectors(lists, [phases[i] for i in g], n // 2, cap)
        return got

    best: list = []  # max-heap of (-objective, counter, picks)
    state = {"thr": _INF, "count": 0, "nodes": 0}

    def offer(obj: float, picks: list) -> None:
        if obj >= state["thr"]:
            return
        heapq.heappush(best, (-obj, state["count"], picks))
        state["count"] += 1
        if len(best) > k:
            heapq.heappop(best)
        if len(best) >= k:
            state["thr"] = -best[0][0]

    def bound(vs) -> float:
        m = [0.0, 0.0, 0.0]
        for v in vs:
            for p in range(3):
                if v[p] > m[p]:
                    m[p] = v[p]
        return m[0] + m[1] + m[2]

    def leaf(part: tuple, js: list) -> None:
        """Search the groups' vectors at sizes 2**js."""
        order = sorted(range(len(part)), key=lambda q: (-js[q], part[q][0]))
        off, pos = 0, [0] * len(part)
        for q in order:
            pos[q] = off
            off += 1 << js[q]
        tabs = []
        for q, g in enumerate(part):
            vs = vectors(g, 1 << js[q], pos[q])
            if not vs:
                return
            tabs.append(vs)
        G = len(part)
        # Per later groups: the phase-wise maxima of their cheapest vectors.
        low = [tuple(min(v[p] for v, _ in tb) for p in range(3)) for tb in tabs]
        rest = [(0.0, 0.0, 0.0)] * (G + 1)
        for q in range(G - 1, -1, -1):
            rest[q] = tuple(max(a, b) for a, b in zip(rest[q + 1], low[q]))
        picks: list = [None] * G

        def dfs(q: int, M: tuple) -> None:
            state["nodes"] += 1
            if q == G:
                offer(M[0] + M[1] + M[2], [(part[i], picks[i]) for i in range(G)])
                return
            r = rest[q + 1]
            for vec, ch in tabs[q]:
                a = (max(M[0], vec[0]), max(M[1], vec[1]), max(M[2], vec[2]))
                if max(a[0], r[0]) + max(a[1], r[1]) + max(a[2], r[2]) >= state["thr"]:
                    continue
                picks[q] = ch
                dfs(q + 1, a)

        dfs(0, (0.0, 0.0, 0.0))

    def sizes_dfs(part: tuple, q: int, rem: int, js: list, acc: list) -> None:
        state["nodes"] += 1
        G = len(part)
        if q == G:
            leaf(part, js)
            return
        left = G - q - 1
        j = (rem - left).bit_length() - 1
        while j >= 0:
            cv = cheap_vec(part[q], j)
            if cv[0] == _INF or cv[1] == _INF or cv[2] == _INF:
                break  # some stage fits nothing up to 2**j, nor below
            # later groups at the largest size the devices left allow
            rest_j = (rem - (1 << j) - left + 1).bit_length() - 1 if left else -1
            vs = [*acc, cv] + [cheap_vec(g, rest_j) for g in part[q + 1 :]]
            b = bound(vs)
            if b >= state["thr"]:
                if bound([*acc, cv]) >= state["thr"]:
                    break  # smaller sizes only raise this group's bound
                j -= 1
                continue
            js.append(j)
            sizes_dfs(part, q + 1, rem - (1 << j), js, [*acc, cv])
            js.pop()
            j -= 1

    parts = [p for p in _partitions(S) if len(p) <= N]
    t_tables = time.perf_counter()
    ranked_parts = []
    for part in parts:
        top = (N - len(part) + 1).bit_length() - 1
        lb = bound([cheap_vec(g, top) for g in part])
        if lb < _INF:
            ranked_parts.append((lb, part))
    ranked_parts.sort(key=lambda e: e[0])
    t_bounds = time.perf_counter()
    searched = 0
    for lb, part in ranked_parts:
        if lb >= state["thr"]:
            break
        searched += 1
        sizes_dfs(part, 0, N, [], [])
    t_search = time.perf_counter()
    if not best:
        raise infeasible(stages, tables, N, cap)
    ranked = [(-e[0], e[2]) for e in sorted(best, key=lambda e: (-e[0], e[1]))]
    timings = {
        "_start": t0,
        "tables_ms": (t_tables - t0) * 1e3,
        "bounds_ms": (t_bounds - t_tables) * 1e3,
        "search_ms": (t_search - t_bounds) * 1e3,
        "nodes": state["nodes"],
        "partitions": searched,
    }
    return ranked, timings
