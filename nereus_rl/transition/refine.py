"""Re-fund a compiled DAG's acquisitions along a simulated timeline (list scheduling).

The compiler's sequential simulation fixes which primitives exist and their data
edges (copy sources, state anchors), and proves that a safe order exists. Its
resource edges, though, follow that sequential order: an acquisition early in
the order may take memory released early even when its own copy source is ready
only late, pushing another stage's acquisition behind a later release.

This pass replays the same primitives in time with the predicted costs: ready
primitives start, longest remaining data path first (stage order breaks ties),
as soon as their memory and stage slots are free; each acquisition is funded by
the free memory at start or by releases that have already ended. Every edge
still points from an earlier end to a later start, so the DAG stays acyclic and
the funding certificate holds for every order. The compiler keeps whichever of
the DAGs has the shorter predicted completion time.

Greedy list scheduling alone can lose to the optimum when a primitive with slack
takes memory a critical one waits for, or when extends fill a device before an
in-place split (which holds both halves while it runs) gets to run; the
``reserve`` variant guards against both. :func:`makespan_lower_bound` tells the
compiler when no variant can do better, so it can skip them.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from itertools import chain
from operator import add, attrgetter

from nereus_rl.transition.paths import topo_order
from nereus_rl.transition.types import (
    Edge,
    Funding,
    PrimitiveCostFn,
    TransitionDAG,
    capacity_of,
)

_TOL = 1e-3


def refine_by_list_schedule(
    dag: TransitionDAG,
    cost_fn: PrimitiveCostFn,
    priority: str = "bottom",
    boost: Sequence[float] | None = None,
    reserve: bool = False,
) -> TransitionDAG | None:
    """The DAG with resource edges re-derived from a list schedule, or None if it gets stuck.

    Arguments:
        dag: a compiled DAG (its data edges, sources and anchors are kept).
        cost_fn: predicted seconds per primitive.
        priority: which ready primitive starts first: ``"bottom"`` (longest remaining
            data path, then the compiler's order) or ``"order"`` (the compiler's order).
        boost: seconds added to a primitive's priority (to start it before others that
            compete for the same memory).
        reserve: a ready primitive that does not fit yet reserves the memory it needs:
            one of lower priority starts only if that memory stays free (so a primitive
            with slack does not take memory a critical one waits for). Primitives that
            acquire nothing start first, then in-place splits and merges (they hold
            extra memory only while they run; once extends fill a device they could
            not run at all). Where reservations would leave nothing running, the step
            is retried without them.
    Returns:
        the refined DAG, or None when greedy list scheduling reaches a state where
        nothing runs and no ready primitive fits (the compiled DAG is then kept).
    """
    prims = dag.primitives
    n = len(prims)
    dur = [float(cost_fn(p)) for p in prims]
    data = [e for e in dag.edges if e.kind == "data"]
    dpreds: list[list[int]] = [[] for _ in range(n)]
    dsuccs: list[list[int]] = [[] for _ in range(n)]
    for e in data:
        dpreds[e.dst].append(e.src)
        dsuccs[e.src].append(e.dst)
    rank_sigma = {p: i for i, p in enumerate(dag.order)}
    # Longest remaining data path (bottom level), over the compiler's order reversed.
    bottom = [0.0] * n
    for p in reversed(dag.order):
        bottom[p] = dur[p] + max((bottom[q] for q in dsuccs[p]), default=0.0)

    mem = dict(dag.unit_bytes)
    cap = {d: capacity_of(dag.capacity, d) for d in dag.devices}
    used = dict.fromkeys(dag.devices, 0.0)
    slots: set[tuple[str, int]] = set()
    for u in dag.current.units:
        for d in u.devices:
            if d in used:  # a lost unit keeps its surviving slots until it is destroyed
                used[d] += mem[u.uid]
                slots.add((u.stage, d))
    funds = {d: [[-1, cap[d] - used[d]]] for d in dag.devices}
    slot_free_by: dict[tuple[str, int], int] = {}
    slot_acq = [dag.slots_acquired(p) for p in prims]

    npred = [len(set(x)) for x in dpreds]
    if priority == "order":
        bottom = [0.0] * n
    if boost is not None:
        bottom = [b + x for b, x in zip(bottom, boost)]
    if reserve:
        top = max(bottom, default=0.0) + 1.0
        bottom = [
            (2 * top if not prims[p].acquire else top + b if prims[p].release else b)
            for p, b in enumerate(bottom)
        ]
    ready = [(-bottom[p], rank_sigma[p], p) for p in range(n) if npred[p] == 0]
    heapq.heapify(ready)
    running: list[tuple[float, int]] = []
    anc = [0] * n
    edges = list(data)
    have = {(e.src, e.dst) for e in data}
    funding: list[Funding] = []
    order: list[int] = []
    now = 0.0
    finished = 0
    while finished < n:
        use_reserve = reserve
        while True:
            waiting = []
            reserved: dict[int, float] = {}
            while ready:
                item = heapq.heappop(ready)
                p = item[2]
                prim = prims[p]
                fits = all(used[d] + a <= cap[d] + _TOL for d, a in prim.acquire) and all(
                    s not in slots for s in slot_acq[p]
                )
                if fits and reserved and prim.acquire:
                    fits = all(
                        used[d] + a + reserved.get(d, 0.0) <= cap[d] + _TOL for d, a in prim.acquire
                    )
                if not fits:
                    if use_reserve:
                        for d, a in prim.acquire:
                            reserved[d] = reserved.get(d, 0.0) + a
                    waiting.append(item)
                    continue
                a_bits = 0
                for q in dpreds[p]:
                    a_bits |= anc[q] | (1 << q)
                for d, a in prim.acquire:
                    a_bits = fund_acquisition(
                        p,
                        a_bits,
                        a,
                        funds[d],
                        d,
                        anc,
                        funding,
                        lambda f, q, why: _add(edges, have, f, q, why),
                    )
                    used[d] += a
                for s in slot_acq[p]:
                    f = slot_free_by.pop(s, -1)
                    funding.append(Funding(p, s, f, 1.0))
                    if f != -1 and not (a_bits >> f) & 1:
                        _add(edges, have, f, p, f"release-before-acquire on slot {s[0]}@{s[1]}")
                        a_bits |= anc[f] | (1 << f)
                    slots.add(s)
                anc[p] = a_bits
                order.append(p)
                heapq.heappush(running, (now + dur[p], p))
            for item in waiting:
                heapq.heappush(ready, item)
            if running or not use_reserve:
                break
            use_reserve = False  # reservations alone held everything back: plain greedy
        if not running:
            return None  # greedy got stuck; the compiler's own DAG stands
        now, p = heapq.heappop(running)
        batch = [p]
        while running and running[0][0] <= now:
            batch.append(heapq.heappop(running)[1])
        for p in batch:
            prim = prims[p]
            for d, r in prim.release:
                used[d] -= r
                funds[d].append([p, r])
            for s in dag.slots_released(prim):
                slots.discard(s)
                slot_free_by[s] = p
            finished += 1
            for q in dsuccs[p]:
                npred[q] -= 1
                if npred[q] == 0:
                    heapq.heappush(ready, (-bottom[q], rank_sigma[q], q))
    return TransitionDAG(
        current=dag.current,
        target=dag.target,
        primitives=prims,
        edges=tuple(edges),
        order=tuple(order),
        capacity=dag.capacity,
        devices=dag.devices,
        unit_bytes=dag.unit_bytes,
        funding=tuple(funding),
        anchors=dag.anchors,
        early_destroys=dag.early_destroys,
        stage_slots=dag.stage_slots,
    )


def _add(edges: list[Edge], have: set[tuple[int, int]], f: int, p: int, why: str) -> None:
    if (f, p) not in have:
        have.add((f, p))
        edges.append(Edge(f, p, "resource", why))


def fund_acquisition(
    p: int,
    a_bits: int,
    need: float,
    entries: list[list[float]],
    res: int,
    anc: Sequence[int],
    funding: list[Funding],
    add_edge: Callable[[int, int, str], None],
) -> int:
    """Fund ``need`` bytes of primitive ``p`` on device ``res`` from ``entries``.

    ``entries`` are ``[funder, bytes left]`` pairs (funder -1: memory free from the
    start). They are drawn in three passes: free memory first, then releases by ``p``'s
    ancestors (no new ordering needed), then the rest in list order, each of which adds a
    release-before-acquire edge through ``add_edge(funder, p, why)``. Used by the
    compiler's simulation and by the list-schedule refinement, so both fund alike.

    Returns:
        ``a_bits`` (``p``'s ancestor bit set) widened by the funders it now follows.
    """
    if need <= _TOL:
        return a_bits
    # One scan sorts the live entries into the three passes (list order within each).
    # Entries of the last pass can become ancestors as edges are added, which then
    # need no edge of their own.
    free, ancestral, rest = [], [], []
    for e in entries:
        if e[1] > _TOL:
            f = e[0]
            if f == -1:
                free.append(e)
            elif (a_bits >> f) & 1:
                ancestral.append(e)
            else:
                rest.append(e)
    for group in (free, ancestral, rest):
        for e in group:
            f, rem = e[0], e[1]
            take = min(rem, need)
            e[1] = rem - take
            need -= take
            funding.append(Funding(p, res, f, take))
            if f != -1 and not (a_bits >> f) & 1:
                add_edge(f, p, f"release-before-acquire on device {res}")
                a_bits |= anc[f] | (1 << f)
            if need <= _TOL:
                entries[:] = [x for x in entries if x[1] > _TOL]
                return a_bits
    raise AssertionError(f"device {res}: {need} bytes unfunded though the device had room")


def makespan_lower_bound(dag: TransitionDAG, durations: list[float]) -> float:
    """A completion time no safe schedule of ``dag``'s primitives and data edges can beat.

    Two bounds, the larger wins: the longest path over data edges alone; and, for each
    primitive that cannot start at time 0 because a device's free memory (or a stage
    slot) it acquires is short before the transition, the earliest end of any other
    primitive that releases on that device (or slot), plus the primitive's remaining
    data path. Memory on a device only grows when a release ends, so such a primitive
    cannot start before one does. The refinement stops once the DAG reaches this bound.

    Arguments:
        dag: a compiled DAG.
        durations: seconds per primitive id.
    Returns:
        seconds.
    """
    prims = dag.primitives
    n = len(prims)
    dpreds: list[list[int]] = [[] for _ in range(n)]
    dsuccs: list[list[int]] = [[] for _ in range(n)]
    for e in dag.edges:
        if e.kind == "data":
            dpreds[e.dst].append(e.src)
            dsuccs[e.src].append(e.dst)
    order = dag.order if len(dag.order) == n else topo_order(dag)
    head = [0.0] * n  # earliest start by data edges
    for p in order:
        for q in dpreds[p]:
            if head[q] + durations[q] > head[p]:
                head[p] = head[q] + durations[q]
    tail = [0.0] * n  # own duration plus the longest data path after it
    for p in reversed(order):
        longest = 0.0
        for q in dsuccs[p]:
            if tail[q] > longest:
                longest = tail[q]
        tail[p] = durations[p] + longest
    bound = max(map(add, head, tail), default=0.0)
    # Free memory and held slots before the transition, on the devices some primitive
    # acquires (no other device can block an acquisition).
    want = dict(chain.from_iterable(map(attrgetter("acquire"), prims)))  # device -> bytes
    if not want:
        return bound
    mem = dict(dag.unit_bytes)
    devices = dag.devices
    if isinstance(dag.capacity, Mapping):
        free = {d: capacity_of(dag.capacity, d) for d in want if d in devices}
    else:
        free = {d: float(dag.capacity) for d in want if d in devices}
    held: set[tuple[str, int]] = set()
    elsewhere = free.keys().isdisjoint
    for u in dag.current.units:
        if elsewhere(u.devices):
            continue
        m = mem[u.uid]
        for d in u.devices:
            if d in free:
                free[d] -= m
                if dag.stage_slots:
                    held.add((u.stage, d))
    # Primitives whose acquisition does not fit before the transition, and where.
    blocked: list[tuple[int, list[object]]] = []
    for p, prim in enumerate(prims):
        acq = prim.acquire
        if not acq:
            continue
        if len(acq) == 1:
            d, a = acq[0]
            short: list[object] = [d] if a > free[d] + _TOL else []
        else:
            need: dict[int, float] = {}
            for d, a in acq:
                need[d] = need.get(d, 0.0) + a
            short = [d for d, a in need.items() if a > free[d] + _TOL]
        if held:
            short += [s for s in dag.slots_acquired(prim) if s in held]
        if short:
            blocked.append((p, short))
    if not blocked:
        return bound
    wanted = {r for _, short in blocked for r in short}
    want_slots = any(isinstance(r, tuple) for r in wanted)
    # Per device (or slot) they need: the two earliest release ends, so a primitive that
    # releases there itself still sees another's.
    first: dict[object, list[tuple[float, int]]] = {}
    for q, prim in enumerate(prims):
        if not prim.release and not want_slots:
            continue
        rel: set[object] = {d for d, _ in prim.release if d in wanted}
        if want_slots:
            rel.update(s for s in dag.slots_released(prim) if s in wanted)
        if not rel:
            continue
        end = head[q] + durations[q]
        for r in rel:
            lst = first.setdefault(r, [])
            lst.append((end, q))
            if len(lst) > 2:
                lst.sort()
                del lst[2:]
    for p, short in blocked:
        start = head[p]
        for r in short:
            ends = [end for end, q in first.get(r, ()) if q != p]
            # No releaser: the DAG could not be safe; leave that to the safety check.
            if ends and min(ends) > start:
                start = min(ends)
        if start + tail[p] > bound:
            bound = start + tail[p]
    return bound
