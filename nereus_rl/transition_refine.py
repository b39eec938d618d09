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
the two DAGs has the shorter predicted completion time.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from nereus_rl.transition import (
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
) -> TransitionDAG | None:
    """The DAG with resource edges re-derived from a list schedule, or None if it gets stuck.

    Arguments:
        dag: a compiled DAG (its data edges, sources and anchors are kept).
        cost_fn: predicted seconds per primitive.
        priority: which ready primitive starts first: ``"bottom"`` (longest remaining
            data path, then the compiler's order) or ``"order"`` (the compiler's order).
        boost: seconds added to a primitive's priority (to start it before others that
            compete for the same memory).
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
        waiting = []
        while ready:
            item = heapq.heappop(ready)
            p = item[2]
            prim = prims[p]
            if all(used[d] + a <= cap[d] + _TOL for d, a in prim.acquire) and all(
                s not in slots for s in slot_acq[p]
            ):
                a_bits = 0
                for q in dpreds[p]:
                    a_bits |= anc[q] | (1 << q)
                for d, a in prim.acquire:
                    a_bits = _fund(p, a_bits, a, funds[d], d, anc, funding, edges, have)
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
            else:
                waiting.append(item)
        for item in waiting:
            heapq.heappush(ready, item)
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


def _fund(
    p: int,
    a_bits: int,
    need: float,
    entries: list[list[float]],
    res: int,
    anc: list[int],
    funding: list[Funding],
    edges: list[Edge],
    have: set[tuple[int, int]],
) -> int:
    """Take ``need`` bytes: initial memory, then ancestors' releases, then the releases
    that ended first (all have ended: the edge never delays the start in the schedule)."""
    if need <= _TOL:
        return a_bits
    for pass_ in range(3):
        for e in entries:
            f, rem = int(e[0]), e[1]
            if rem <= _TOL:
                continue
            if pass_ == 0 and f != -1:
                continue
            if pass_ == 1 and (f == -1 or not (a_bits >> f) & 1):
                continue
            take = min(rem, need)
            e[1] = rem - take
            need -= take
            funding.append(Funding(p, res, f, take))
            if f != -1 and not (a_bits >> f) & 1:
                _add(edges, have, f, p, f"release-before-acquire on device {res}")
                a_bits |= anc[f] | (1 << f)
            if need <= _TOL:
                entries[:] = [x for x in entries if x[1] > _TOL]
                return a_bits
    raise AssertionError(f"device {res}: {need} bytes unfunded though the device had room")
