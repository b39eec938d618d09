"""OR-Tools CP-SAT scheduling model of a transition: the baseline for the DAG's plan.

It schedules the same primitives as a compiled DAG, with the same data edges
(copy sources, state anchors), but leaves the resource conflicts to the solver:
each device's memory and each stage slot is a reservoir (an acquisition adds at
the primitive's start, a release subtracts at its end) that must stay within
capacity. The objective is the completion time (makespan). Durations come from
the same primitive cost function as :func:`~nereus_rl.transition.predicted_completion_time`,
rounded to ``quantum_s``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from nereus_rl.transition import (
    PrimitiveCostFn,
    TransitionDAG,
    capacity_of,
    default_primitive_cost,
    longest_path,
)


@dataclass(frozen=True)
class ScheduleResult:
    """Result of :func:`schedule_cpsat`.

    Attributes:
        status: ``"OPTIMAL"``, ``"FEASIBLE"`` (stopped at the time limit without proof),
            ``"UNKNOWN"`` (no schedule found in time) or ``"INFEASIBLE"``.
        makespan_s: completion time of the best schedule found (``inf`` if none).
        bound_s: the solver's proven lower bound on the completion time.
        dag_makespan_s: the DAG's own completion time with the same rounded durations.
        build_s, solve_s: seconds to build the model and to solve it.
        num_reservoirs: memory and slot reservoirs in the model.
    """

    status: str
    makespan_s: float
    bound_s: float
    dag_makespan_s: float
    build_s: float
    solve_s: float
    num_reservoirs: int

    @property
    def proven_optimal(self) -> bool:
        return self.status == "OPTIMAL"

    @property
    def gap_pct(self) -> float:
        """How much longer the DAG's completion time is than the solver's schedule, in %."""
        if not math.isfinite(self.makespan_s) or self.makespan_s <= 0:
            return float("nan")
        return 100.0 * (self.dag_makespan_s - self.makespan_s) / self.makespan_s

    def __repr__(self) -> str:
        return (
            f"ScheduleResult({self.status}, {self.makespan_s:.3g} s vs DAG "
            f"{self.dag_makespan_s:.3g} s, gap {self.gap_pct:.2f}%, solve {self.solve_s:.3g} s)"
        )


def schedule_cpsat(
    dag: TransitionDAG,
    cost_fn: PrimitiveCostFn = default_primitive_cost,
    *,
    time_limit_s: float = 10.0,
    num_workers: int = 1,
    quantum_s: float = 0.01,
    memory_quantum: float | None = None,
    hint_dag_schedule: bool = True,
) -> ScheduleResult:
    """Schedule ``dag``'s primitives to minimize completion time with CP-SAT.

    Arguments:
        dag: a compiled DAG (its primitives, data edges and memory table are used; its
            resource edges are not: the solver decides those conflicts itself).
        cost_fn: seconds per primitive.
        time_limit_s: solver time limit; the status says whether it proved optimality.
        num_workers: CP-SAT search workers.
        quantum_s: time unit of the integer model.
        memory_quantum: byte unit of the integer model (default: the greatest common
            divisor of all byte amounts when they are whole numbers, so the model is
            exact; else the largest capacity over 2**20). Acquisitions round up and
            releases down, so the integer model is never looser than the bytes.
        hint_dag_schedule: start the search from the DAG's own schedule.
    Returns:
        the schedule result.
    """
    from ortools.sat.python import cp_model

    t0 = time.perf_counter()
    prims = dag.primitives
    n = len(prims)
    dur = [max(1, round(cost_fn(p) / quantum_s)) for p in prims]
    dag_len, _ = longest_path(dag, dur)
    horizon = sum(dur)
    m = cp_model.CpModel()
    start = [m.new_int_var(0, horizon, f"s{i}") for i in range(n)]
    end = [m.new_int_var(0, horizon, f"e{i}") for i in range(n)]
    # One interval per primitive; memory and slots are reservoirs over its start and end
    # (an acquisition persists after the primitive ends, so a cumulative would not do).
    for i in range(n):
        m.new_interval_var(start[i], dur[i], end[i], f"i{i}")
    for e in dag.edges:
        if e.kind == "data":
            m.add(start[e.dst] >= end[e.src])

    # Memory reservoirs: level = bytes above the pre-transition use, at most the free bytes.
    mem = dict(dag.unit_bytes)
    used0 = dict.fromkeys(dag.devices, 0.0)
    for u in dag.current.units:
        for d in u.devices:
            if d in used0:
                used0[d] += mem[u.uid]
    q = memory_quantum or _memory_quantum(dag, used0)
    events: dict[int, list[tuple[object, int]]] = {}
    acquirers: set[int] = set()
    for p in prims:
        for d, a in p.acquire:
            events.setdefault(d, []).append((start[p.pid], math.ceil(a / q - 1e-9)))
            acquirers.add(d)
        for d, r in p.release:
            events.setdefault(d, []).append((end[p.pid], -math.floor(r / q + 1e-9)))
    num_res = 0
    for d in sorted(acquirers):
        free = math.floor((capacity_of(dag.capacity, d) - used0[d]) / q + 1e-9)
        times = [t for t, _ in events[d]]
        changes = [c for _, c in events[d]]
        low = -sum(-c for c in changes if c < 0)
        m.add_reservoir_constraint(times, changes, low, free)
        num_res += 1
    # Stage-slot reservoirs: a device serves one unit of each stage at a time.
    owned = {(u.stage, d) for u in dag.current.units for d in u.devices}
    slot_events: dict[tuple[str, int], list[tuple[object, int]]] = {}
    for p in prims:
        for s in dag.slots_acquired(p):
            slot_events.setdefault(s, []).append((start[p.pid], 1))
    for p in prims:
        for s in dag.slots_released(p):
            if s in slot_events:
                slot_events[s].append((end[p.pid], -1))
    for s, ev in sorted(slot_events.items()):
        m.add_reservoir_constraint(
            [t for t, _ in ev], [c for _, c in ev], -1, 0 if s in owned else 1
        )
        num_res += 1

    makespan = m.new_int_var(0, horizon, "makespan")
    m.add_max_equality(makespan, end)
    m.minimize(makespan)
    if hint_dag_schedule:
        est = _asap(dag, dur)
        for i in range(n):
            m.add_hint(start[i], est[i])
            m.add_hint(end[i], est[i] + dur[i])
        m.add_hint(makespan, max((est[i] + dur[i] for i in range(n)), default=0))
    build_s = time.perf_counter() - t0

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = num_workers
    t1 = time.perf_counter()
    st = solver.solve(m)
    solve_s = time.perf_counter() - t1
    status = solver.status_name(st)
    if st in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        ms = solver.objective_value * quantum_s
    else:
        ms = float("inf")
    return ScheduleResult(
        status=status,
        makespan_s=ms,
        bound_s=solver.best_objective_bound * quantum_s,
        dag_makespan_s=dag_len * quantum_s,
        build_s=build_s,
        solve_s=solve_s,
        num_reservoirs=num_res,
    )


def _memory_quantum(dag: TransitionDAG, used0: dict[int, float]) -> float:
    vals = [a for p in dag.primitives for _, a in p.acquire + p.release]
    vals += [capacity_of(dag.capacity, d) - used0[d] for d in dag.devices]
    if all(float(v).is_integer() for v in vals):
        g = 0
        for v in vals:
            g = math.gcd(g, int(v))
        if g > 0:
            return float(g)
    return max(capacity_of(dag.capacity, d) for d in dag.devices) / 2**20


def _asap(dag: TransitionDAG, dur: list[int]) -> list[int]:
    """Earliest start of each primitive when every edge (data and resource) is respected."""
    from nereus_rl.transition import topo_order

    preds = dag.preds()
    est = [0] * len(dag.primitives)
    for p in topo_order(dag):
        est[p] = max((est[q] + dur[q] for q in preds[p]), default=0)
    return est
