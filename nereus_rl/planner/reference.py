"""The exact planner's search in Python: the reference the compiled search
(``planner_native``) must equal, plan for plan and bit for bit (see ``nereus_rl.planner.planner``;
``Planner(native=False)`` runs it).

The search reads its planner through :class:`SearchHost` (what it prices with and the caches
it fills), so this module never imports the planner that calls it."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Protocol

import numpy as np

from nereus_rl.planner import native as planner_native
from nereus_rl.planner.bounds import CheapRows, cheap_table, partition_bounds_of
from nereus_rl.planner.groups import group_vectors
from nereus_rl.planner.place import infeasible
from nereus_rl.planner.search import LastGroup, Search
from nereus_rl.planner.tables import _StageTable

if TYPE_CHECKING:
    from nereus_rl.core.spec import ClusterSpec
    from nereus_rl.costmodel.costmodel import CostModel

_INF = math.inf


class SearchHost(Protocol):
    """What the reference search needs of its planner (``nereus_rl.planner.planner.Planner``
    is one): the cluster and cost model it prices with, the stacked work matrices of a
    call's stage shapes, and the caches it keeps across calls (the planner drops them when
    the cost model's version changes)."""

    cluster: ClusterSpec
    costmodel: CostModel
    _pareto: dict  # (ids, block, version, cap) -> ({n: Pareto list}, fastest per size)
    _groups: dict  # (ids, group, n, width rule, phases, cap, version) -> group vectors
    _ginfo: dict  # (version, cap, ids, phases) -> per-call-shape search data

    def _stack(
        self, sid: tuple[int, ...], tables: list[_StageTable], r_i: int
    ) -> tuple[np.ndarray, list[int]]:
        """The stages' stacked work matrices and each block's first row."""
        ...


def pareto_lists(pl: SearchHost, key: tuple, table: _StageTable, cap: int, priced, slot: int):
    """({n: [(t, mem, layout_idx, d), ...] sorted by time} for every size n, and the
    fastest time at each size ``2**j``, inf where nothing fits), for block ``slot`` of
    the stacked product ``priced()`` (see ``_stack``)."""
    pk = (key, slot, pl.costmodel.version, cap)
    got = pl._pareto.get(pk)
    if got is not None:
        return got
    tl, a = priced()
    # Plain floats and ints: the lists are short, numpy per element costs more.
    ml = table.mem_list
    tl = tl[a[slot] : a[slot + 1]]
    out = {}
    fast = []
    prev: list = []
    n = 1
    while n <= pl.cluster.num_devices:
        cand = prev + [(tl[i], ml[i], i, n) for i in table.by_d.get(n, ()) if ml[i] <= cap]
        cand.sort()
        front, best_mem = [], None
        for c in cand:
            if best_mem is None or c[1] < best_mem:
                front.append(c)
                best_mem = c[1]
        out[n] = front
        fast.append(front[0][0] if front else _INF)
        prev = front
        n *= 2
    got = pl._pareto[pk] = (out, fast)
    return got


def search(pl: SearchHost, stages, tables, sid, phases, r_i, a_i, cap, N, k, ver):
    """The reference search: ``([(objective, picks)] best first, timings)``, as
    ``Planner._search_native`` returns them."""
    t0 = time.perf_counter()
    S = len(stages)
    sid_t = tuple(sid)
    memo: list = []

    def priced():
        if not memo:
            W, starts = pl._stack(sid_t, tables, r_i)
            memo.append((planner_native.price(W, pl.costmodel._x).tolist(), starts))
        return memo[0]

    plain, fast = [], []
    for i, t in enumerate(tables):
        if i == r_i:
            plain.append(None)
            fast.append(None)
        else:
            fronts, fa = pareto_lists(pl, sid_t, t, cap, priced, i)
            plain.append(fronts)
            fast.append(fa)
    rvar = {}
    if r_i >= 0:
        (rvar["intra"], fi), (rvar["inter"], fe) = (
            pareto_lists(pl, sid_t, tables[r_i], cap, priced, slot) for slot in (r_i, len(tables))
        )
        fast[r_i] = [a if a < b else b for a, b in zip(fi, fe)]
    t_tables = time.perf_counter()

    # Everything below depends on the stage shapes, efficiencies and capacity only:
    # kept across calls (a device loss reuses the group tables).
    ckey = (ver, cap, tuple(sid), tuple(phases))
    info = pl._ginfo.get(ckey)
    if info is None:
        if len(pl._ginfo) > 8:
            pl._ginfo.clear()
        info = pl._ginfo[ckey] = ({}, {}, {})
    groups, lasts, bounds = info
    dpn = pl.cluster.devices_per_node
    one_node = pl.cluster.num_nodes == 1

    def lists_of(g: tuple[int, ...], n: int) -> tuple[list, int, bool]:
        """The group's stage lists at n, its width rule, and whether it has one."""
        both = r_i in g and a_i in g
        # The cost model's rule: intra-node sync when the cluster is one node, or
        # rollout and actor_train share a group within a node.
        intra = one_node or (both and n <= dpn)
        thr = dpn if (both and not intra) else 0
        var = rvar.get("intra" if intra else "inter")
        return [(var if i == r_i else plain[i])[n] for i in g], thr, both

    def gi(g: tuple[int, ...], n: int):
        """(Pareto vectors, whether no size up to n can fit) of group g at size n."""
        got = groups.get((g, n))
        if got is None:
            lists, thr, both = lists_of(g, n)
            # Keyed by the whole stack: its product prices the lists (see Planner._stack).
            gkey = (sid_t, g, n, thr, tuple(phases[i] for i in g), cap, ver)
            vecs = pl._groups.get(gkey)
            if vecs is None:
                vecs = pl._groups[gkey] = group_vectors(lists, [phases[i] for i in g], thr, cap)
            # Empty: nothing fits at n; for a group without rollout and actor_train
            # also at no smaller size (F_s(m) is dominated within F_s(n), m <= n).
            got = groups[(g, n)] = (vecs, not vecs and not both)
        return got

    def gl(g: tuple[int, ...], n: int):
        """(LastGroup or None, next size worth searching) of the last group at n."""
        got = lasts.get((g, n))
        if got is None:
            lists, thr, _ = lists_of(g, n)
            lg = LastGroup(lists, [phases[i] for i in g], thr, cap) if all(lists) else None
            # A larger size holds every smaller size's choices, except that a group
            # with the width rule gets the intra-node sync at a node or less.
            nxt = dpn if (thr and n > dpn) else 0
            got = lasts[(g, n)] = (lg, nxt)
        return got

    # Cheap bounds of every stage subset at every size (one table for all device
    # counts), then of every partition on N devices (planner_bounds).
    Cl = bounds.get("rows")
    if Cl is None:
        # Each stage's fastest layout alone at each size (the rollout: the faster of
        # its two sync variants).
        C = cheap_table(np.array(fast), phases)
        # Shave a relative 1e-12: the bounds are sums in another order than the
        # search's, and a bound must never exceed what it bounds.
        C *= 1.0 - 1e-12
        Cl = bounds["rows"] = CheapRows(C)
    pb = partition_bounds_of(S, N)
    got = bounds.get(N)
    if got is None:
        lbs = pb.partition_bounds(Cl.C[:, : pb.L])
        order = np.argsort(lbs, kind="stable")[: int(np.count_nonzero(lbs < _INF))]
        got = bounds[N] = (order.tolist(), lbs.tolist())
    order, lbs = got
    if not order:
        raise infeasible(stages, tables, N, cap)
    t_bounds = time.perf_counter()

    search = Search(Cl, gi, gl, k)
    jmax = pb.L - 1
    nparts = 0
    for o in order:
        if lbs[o] >= search.thr:
            break
        nparts += 1
        # Heavy groups first: the size loop prunes best when they come early.
        gm = sorted(zip(pb.parts[o], pb.masks[o]), key=lambda x: -sum(Cl[x[1]][jmax]))
        search.run([g for g, _ in gm], [m for _, m in gm], N)
    if not search.best:
        raise infeasible(stages, tables, N, cap)
    t_search = time.perf_counter()
    ranked = [(-e[0], e[2]) for e in sorted(search.best, key=lambda e: -e[0])]
    timings = {
        "_start": t0,
        "tables_ms": (t_tables - t0) * 1e3,
        "bounds_ms": (t_bounds - t_tables) * 1e3,
        "search_ms": (t_search - t_bounds) * 1e3,
        "nodes": search.nodes,
        "partitions": nparts,
    }
    return ranked, timings
