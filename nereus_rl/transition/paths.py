"""Orders and critical paths of a transition DAG, and its predicted completion time.

:func:`topo_order` gives the order the executor and the checks walk (the DAG's
own safe order when it is topological, else Kahn's algorithm), and names a cycle
when there is one; :func:`longest_path` and :func:`predicted_completion_time`
give the critical path by predicted primitive durations, which admission weighs
as the transition's cost. They are re-exported by :mod:`nereus_rl.transition.types`.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping

from nereus_rl.core.globalplan import fmt_devices
from nereus_rl.transition.types import (
    PrimitiveCostFn,
    TransitionDAG,
    UnsafeDAGError,
    default_primitive_cost,
)


def longest_path(
    dag: TransitionDAG, durations: Mapping[int, float] | Iterable[float]
) -> tuple[float, list[int]]:
    """Length and primitives of the longest path through ``dag`` by ``durations``.

    Arguments:
        dag: the DAG (acyclic).
        durations: seconds per primitive id (a mapping or a sequence).
    Returns:
        ``(seconds, [pid, ...])`` in execution order.
    """
    n = len(dag.primitives)
    if isinstance(durations, Mapping):
        dur = [durations[i] for i in range(n)]
    else:
        dur = durations if isinstance(durations, list) else list(durations)
    if not n:
        return 0.0, []
    preds = dag.preds()
    order = topo_order(dag)
    finish = [0.0] * n
    via = [-1] * n
    end, end_t = -1, -1.0
    for p in order:
        best, arg = 0.0, -1
        for q in preds[p]:
            if finish[q] > best:
                best, arg = finish[q], q
        t = finish[p] = best + dur[p]
        via[p] = arg
        if t > end_t:  # the first primitive (in topological order) that ends last
            end, end_t = p, t
    path = [end]
    while via[path[-1]] >= 0:
        path.append(via[path[-1]])
    return end_t, path[::-1]


def predicted_completion_time(
    dag: TransitionDAG, cost_fn: PrimitiveCostFn = default_primitive_cost
) -> float:
    """Predicted seconds to run ``dag`` with unbounded concurrency (its critical path).

    The compiled DAG encodes every resource conflict as an edge, so running each
    primitive as soon as its predecessors end is safe; admission uses this as the
    transition cost.

    Arguments:
        dag: a compiled transition DAG.
        cost_fn: seconds per primitive.
    Returns:
        predicted completion time in seconds.
    """
    native = getattr(dag, "native_completion_time", None)  # a DAG the C++ path compiled
    if native is not None:
        t = native(cost_fn)
        if t is not None:
            return t
    return longest_path(dag, [cost_fn(p) for p in dag.primitives])[0]


def topo_order(dag: TransitionDAG) -> list[int]:
    """A topological order of ``dag`` (Kahn, smallest safe-order position first).

    When ``dag.order`` is itself topological (as the compiler's always is), Kahn's
    algorithm with that tie-break returns it unchanged, so it is checked in one pass
    over the edges and returned without the heap.

    Raises:
        UnsafeDAGError: the DAG has a cycle; the message names the primitives on it.
    """
    n = len(dag.primitives)
    if len(dag.order) == n:
        pos = [-1] * n
        for i, p in enumerate(dag.order):
            if 0 <= p < n:
                pos[p] = i
        if -1 not in pos and all(pos[e.src] < pos[e.dst] for e in dag.edges):
            return list(dag.order)
    rank = {p: i for i, p in enumerate(dag.order)} if len(dag.order) == n else {}
    preds = dag.preds()
    succs = dag.succs()
    indeg = [len(set(p)) for p in preds]
    seen_edges: set[tuple[int, int]] = set()
    heap = [(rank.get(i, i), i) for i in range(n) if indeg[i] == 0]
    heapq.heapify(heap)
    out = []
    while heap:
        _, p = heapq.heappop(heap)
        out.append(p)
        for q in succs[p]:
            if (p, q) in seen_edges:
                continue
            seen_edges.add((p, q))
            indeg[q] -= 1
            if indeg[q] == 0:
                heapq.heappush(heap, (rank.get(q, q), q))
    if len(out) != n:
        cycle = _find_cycle(preds, set(range(n)) - set(out))
        names = " -> ".join(repr(dag.primitives[i]) for i in cycle)
        devs = sorted({d for i in cycle for d in dag.primitives[i].devices})
        raise UnsafeDAGError(
            f"transition DAG has a cycle: {names} (devices {fmt_devices(devs)}); "
            "remove one of these edges so the primitives can be ordered"
        )
    return out


def _find_cycle(preds: list[list[int]], nodes: set[int]) -> list[int]:
    """One cycle among ``nodes``: the primitives Kahn's algorithm could not order.

    Each of them has a predecessor among them, so walking predecessors must repeat.
    """
    seen: dict[int, int] = {}
    path: list[int] = []
    p = min(nodes)
    while p not in seen:
        seen[p] = len(path)
        path.append(p)
        p = next(q for q in preds[p] if q in nodes)
    cycle = path[seen[p] :][::-1]
    return [*cycle, cycle[0]]
