"""Concurrent executor for transition DAGs.

Ready primitives (all predecessors ended) run at once on a thread pool, each by
calling the caller's implementation ``impls[kind](primitive)``: the EMU runtime
supplies live ones; tests and benchmarks supply sleeping ones. A resource
manager grants each primitive its memory and stage slots when it starts and
takes back what it releases when it ends; it never lets a device hold two units
of one stage or more bytes than its capacity. For DAGs whose funding certificate
proves every order safe (compiled ones) it never has to hold anything back; for
other DAGs that pass the safety check it grants acquisitions on each device in
the safe order (tickets), which rules out circular waits.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from nereus_rl.transition.safety import SafetyReport, check_dag
from nereus_rl.transition.types import (
    CapacityLike,
    Placement,
    Primitive,
    TransitionDAG,
    TransitionExecutionError,
    Unit,
    capacity_of,
)

PrimitiveImpl = Callable[[Primitive], None]
_TOL = 1e-3


@dataclass(frozen=True)
class PrimitiveRecord:
    """When one primitive ran, in seconds since the execution started."""

    pid: int
    kind: str
    start_s: float
    end_s: float

    def __repr__(self) -> str:
        return (
            f"{self.kind[0].upper()}{self.pid}[{self.start_s * 1e3:.1f}-{self.end_s * 1e3:.1f} ms]"
        )


@dataclass(frozen=True)
class ExecutionReport:
    """Result of :func:`execute_dag`.

    Attributes:
        records: one record per primitive, in primitive-id order.
        makespan_s: seconds from the first start to the last end.
        critical_path: primitive ids that determined the makespan, in order.
        final: the placement at the end (equal to the DAG's target).
        resource_waits: how often a ready primitive had to wait for the resource manager.
        max_concurrency: the most primitives running at once (from the records).
        any_order: the DAG was certified safe in every order (no tickets used).
    """

    records: tuple[PrimitiveRecord, ...]
    makespan_s: float
    critical_path: tuple[int, ...]
    final: Placement
    resource_waits: int
    max_concurrency: int
    any_order: bool

    def __repr__(self) -> str:
        return (
            f"ExecutionReport({len(self.records)} primitives in {self.makespan_s * 1e3:.1f} ms, "
            f"critical path {list(self.critical_path)}, max {self.max_concurrency} concurrent, "
            f"{self.resource_waits} resource waits)"
        )


class ResourceManager:
    """Device memory, stage slots and live units during one execution.

    Arguments:
        dag: the DAG being run (initial placement, memory table, devices).
        capacity: device memory.
        tickets: per device, the safe order of primitives acquiring on it; ``None``
            to grant in any order.
    """

    def __init__(
        self,
        dag: TransitionDAG,
        capacity: CapacityLike,
        tickets: dict[int, list[int]] | None,
    ) -> None:
        self.dag = dag
        mem = dict(dag.unit_bytes)
        self.cap = {d: capacity_of(capacity, d) for d in dag.devices}
        self.used = dict.fromkeys(dag.devices, 0.0)
        self.live: dict[str, Unit] = {}
        self.slots: dict[tuple[str, int], str] = {}
        lost = {u.uid for p in dag.primitives if p.lost for u in p.inputs}
        for u in dag.current.units:
            for d in u.devices:
                if d in self.used:
                    self.used[d] += mem[u.uid]
            if u.uid not in lost:
                self.live[u.uid] = u
            for d in u.devices:  # a lost unit keeps its surviving slots until destroyed
                if d in self.used:
                    self.slots[(u.stage, d)] = u.uid
        self.tickets = tickets
        self.next_ticket = dict.fromkeys(tickets, 0) if tickets else {}

    def try_acquire(self, p: Primitive) -> bool:
        """Grant ``p``'s memory and slots if they are free now (and it holds the tickets)."""
        if self.tickets is not None:
            for d, _ in p.acquire:
                q = self.tickets[d]
                if q[self.next_ticket[d]] != p.pid:
                    return False
        for d, a in p.acquire:
            if self.used[d] + a > self.cap[d] + _TOL:
                return False
        for s in self.dag.slots_acquired(p):
            if s in self.slots:
                return False
        for d, a in p.acquire:
            self.used[d] += a
        if self.tickets is not None:
            for d in {d for d, _ in p.acquire}:
                self.next_ticket[d] += 1
        for u in p.outputs:
            for d in u.devices:
                self.slots[(u.stage, d)] = u.uid
        return True

    def finish(self, p: Primitive) -> None:
        """``p`` ended: its inputs are gone, its outputs live, its releases are free."""
        for u in p.inputs:
            self.live.pop(u.uid, None)
            for d in u.devices:
                if self.slots.get((u.stage, d)) == u.uid:
                    del self.slots[(u.stage, d)]
        for u in p.outputs:
            self.live[u.uid] = u
        for d, r in p.release:
            self.used[d] -= r
            assert self.used[d] >= -_TOL, f"device {d} released more than it held"


def execute_dag(
    dag: TransitionDAG,
    impls: Mapping[str, PrimitiveImpl],
    *,
    capacity: CapacityLike | None = None,
    max_workers: int | None = None,
    safety: SafetyReport | None = None,
) -> ExecutionReport:
    """Run ``dag`` concurrently and check that it ends in the target placement.

    Arguments:
        dag: the transition DAG.
        impls: ``kind -> callable(primitive)`` for ``extend``, ``destroy``, ``split``,
            ``merge``; each returns when the primitive is done and raises on failure.
        capacity: device memory (default: the DAG's).
        max_workers: threads running primitives at once (default: up to 64).
        safety: a report from :func:`check_dag` to reuse (default: checked here).
    Returns:
        the execution report.
    Raises:
        UnsafeDAGError: the DAG fails the safety check (before anything runs).
        ValueError: ``impls`` lacks a kind the DAG uses.
        TransitionExecutionError: an implementation raised (the message names the
            primitive; running ones are let finish, nothing new starts), or the end
            state is not the target placement.
    """
    cap_like = dag.capacity if capacity is None else capacity
    rep = safety if safety is not None else check_dag(dag, capacity=cap_like)
    kinds = {p.kind for p in dag.primitives}
    missing = sorted(kinds - set(impls))
    if missing:
        raise ValueError(f"no implementation for primitive kinds {missing}; pass impls[kind]")
    n = len(dag.primitives)
    tickets = None
    if not rep.any_order:
        tickets = {}
        for p in rep.order:
            for d in dict(dag.primitives[p].acquire):
                tickets.setdefault(d, []).append(p)
    rm = ResourceManager(dag, cap_like, tickets)
    preds = dag.preds()
    succs = dag.succs()
    npred = [len(set(x)) for x in preds]
    rank = {p: i for i, p in enumerate(rep.order)}
    waiting = sorted((i for i in range(n) if npred[i] == 0), key=rank.__getitem__)
    new_ready: list[int] = []
    done_q: queue.Queue[tuple[int, float, float, BaseException | None]] = queue.Queue()
    start = [0.0] * n
    end = [0.0] * n
    t0 = time.perf_counter()

    def work(p: int) -> None:
        s = time.perf_counter() - t0
        err: BaseException | None = None
        try:
            impls[dag.primitives[p].kind](dag.primitives[p])
        except BaseException as e:  # reported to the dispatcher, re-raised there
            err = e
        done_q.put((p, s, time.perf_counter() - t0, err))

    running = 0
    resource_waits = 0
    failed: tuple[int, BaseException] | None = None
    finished = 0
    seen_edges: set[tuple[int, int]] = set()
    waited: set[int] = set()
    with ThreadPoolExecutor(max_workers=max_workers or min(64, max(1, n))) as pool:
        while finished < n:
            if new_ready:  # merge the newly ready into the (sorted) waiting list
                waiting = sorted(waiting + new_ready, key=rank.__getitem__)
                new_ready = []
            if failed is None:
                still = []
                for p in waiting:
                    if rm.try_acquire(dag.primitives[p]):
                        running += 1
                        pool.submit(work, p)
                    else:
                        if p not in waited:
                            waited.add(p)
                            resource_waits += 1
                        still.append(p)
                waiting = still
            if running == 0:
                if failed is not None:
                    break
                blocked = ", ".join(repr(dag.primitives[p]) for p in waiting)
                raise TransitionExecutionError(
                    f"execution stalled with nothing running; waiting: {blocked} (used {rm.used})"
                )
            p, s, e, err = done_q.get()
            running -= 1
            start[p], end[p] = s, e
            if err is not None:
                failed = failed or (p, err)
                continue
            rm.finish(dag.primitives[p])
            finished += 1
            for q in succs[p]:
                if (p, q) in seen_edges:
                    continue
                seen_edges.add((p, q))
                npred[q] -= 1
                if npred[q] == 0:
                    new_ready.append(q)
    if failed is not None:
        p, err = failed
        raise TransitionExecutionError(
            f"primitive {dag.primitives[p]!r} failed: {err!r}; {finished} of {n} primitives "
            "finished, the placement is in between"
        ) from err
    final = Placement(tuple(rm.live.values()))
    if not final.matches(dag.target):
        raise TransitionExecutionError(
            f"execution ended in {final!r}, not the target {dag.target!r}"
        )
    records = tuple(PrimitiveRecord(i, dag.primitives[i].kind, start[i], end[i]) for i in range(n))
    return ExecutionReport(
        records=records,
        makespan_s=max(end, default=0.0) - min(start, default=0.0),
        critical_path=tuple(_critical_path(preds, start, end)),
        final=final,
        resource_waits=resource_waits,
        max_concurrency=_max_overlap(start, end),
        any_order=rep.any_order,
    )


def _max_overlap(start: list[float], end: list[float]) -> int:
    """The most primitives whose measured [start, end) intervals overlap at one moment."""
    events = sorted([(t, 1) for t in start] + [(t, -1) for t in end])
    best = cur = 0
    for _, k in events:  # at equal times, ends (-1) sort before starts (+1)
        cur += k
        best = max(best, cur)
    return best


def _critical_path(preds: list[list[int]], start: list[float], end: list[float]) -> list[int]:
    """Walk back from the last primitive to end through the predecessor that ended last."""
    if not end:
        return []
    p = max(range(len(end)), key=end.__getitem__)
    path = [p]
    while preds[p]:
        p = max(preds[p], key=end.__getitem__)
        path.append(p)
    return path[::-1]


def sleeping_impls(
    durations: Mapping[int, float] | Callable[[Primitive], float],
) -> dict[str, PrimitiveImpl]:
    """Implementations that only sleep, for tests and benchmarks.

    Arguments:
        durations: seconds per primitive id, or a function of the primitive.
    Returns:
        ``impls`` for :func:`execute_dag`.
    """

    def run(p: Primitive) -> None:
        dt = durations(p) if callable(durations) else durations[p.pid]
        time.sleep(dt)

    return {k: run for k in ("extend", "destroy", "split", "merge")}
