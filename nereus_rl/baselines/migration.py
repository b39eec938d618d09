"""Per-component migration, as DynaRL-style systems do it: the baseline for the DAG.

Each model-stage migrates on its own thread, concurrently with the others and
without a global order: it re-lays-out its in-place units, then acquires the
devices of its new units one by one (waiting while a device lacks memory, and
holding what it already has), copies state into them, and only then releases
its old units. Two stages that each hold part of what the other needs wait on
each other forever; a waiter that exceeds ``timeout_s`` gives up.

Failures are classified: ``deadlock`` when the waiting stages form a cycle in
the wait-for graph (stage X waits on device d, whose memory stage Y would free
only after its own migration), ``timeout`` when a wait outlasts the timeout
without such a cycle, ``state_lost`` when a stage finds no live unit to copy
from. It uses the same plan diff and the same primitive implementations as the
DAG executor, so the two run the same work.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from nereus_rl.core.globalplan import GlobalPlan
from nereus_rl.transition import (
    DEFAULT_CAPACITY,
    CapacityLike,
    Placement,
    Primitive,
    Unit,
    UnitMemoryFn,
    capacity_of,
    default_unit_memory,
)
from nereus_rl.transition.compile import diff_plans
from nereus_rl.transition.execute import PrimitiveImpl

_TOL = 1e-3


@dataclass(frozen=True)
class BaselineResult:
    """Outcome of one per-component migration.

    Attributes:
        success: every stage finished and the placement equals the target.
        failure: ``None``, ``"deadlock"``, ``"timeout"``, ``"state_lost"`` or ``"error"``
            (a primitive implementation raised).
        detail: which stages waited on which devices (for a failure).
        elapsed_s: seconds until the last stage finished or gave up.
    """

    success: bool
    failure: str | None
    detail: str
    elapsed_s: float

    def __repr__(self) -> str:
        if self.success:
            return f"BaselineResult(ok in {self.elapsed_s * 1e3:.1f} ms)"
        return f"BaselineResult({self.failure}: {self.detail})"


class _Abort(Exception):
    pass


class _Board:
    """Shared device memory, live units and the wait-for graph."""

    def __init__(self, devices: Collection[int], capacity: CapacityLike) -> None:
        self.cond = threading.Condition()
        self.cap = {d: capacity_of(capacity, d) for d in devices}
        self.used = dict.fromkeys(devices, 0.0)
        self.releasable: dict[int, dict[str, float]] = {d: {} for d in devices}
        self.waiting_on: dict[str, tuple[int, frozenset[str]]] = {}
        self.live: dict[str, Unit] = {}
        self.failure: tuple[str, str] | None = None

    def fail(self, kind: str, detail: str) -> None:
        if self.failure is None:
            self.failure = (kind, detail)
        self.cond.notify_all()

    def _cycle(self, start: str) -> list[str] | None:
        """A cycle of waiting stages through ``start``, if any."""
        path = [start]
        seen = {start}

        def dfs(x: str) -> list[str] | None:
            for y in sorted(self.waiting_on.get(x, (0, frozenset()))[1]):
                if y == start:
                    return [*path, start]
                if y in self.waiting_on and y not in seen:
                    seen.add(y)
                    path.append(y)
                    got = dfs(y)
                    if got:
                        return got
                    path.pop()
            return None

        return dfs(start)

    def acquire(self, stage: str, d: int, a: float, timeout_s: float, poll_s: float) -> None:
        with self.cond:
            t0 = time.perf_counter()
            while self.used[d] + a > self.cap[d] + _TOL:
                if self.failure is not None:
                    raise _Abort
                blockers = frozenset(s for s, b in self.releasable[d].items() if b > _TOL)
                self.waiting_on[stage] = (d, blockers)
                cyc = self._cycle(stage)
                if cyc is not None:
                    waits = "; ".join(
                        f"{s} waits on device {self.waiting_on[s][0]}" for s in cyc[:-1]
                    )
                    self.fail("deadlock", f"wait-for cycle {' -> '.join(cyc)} ({waits})")
                    raise _Abort
                if time.perf_counter() - t0 > timeout_s:
                    self.fail(
                        "timeout",
                        f"{stage} waited {timeout_s:.3g} s on device {d} "
                        f"(releasable by {sorted(blockers) or 'nobody'})",
                    )
                    raise _Abort
                self.cond.wait(poll_s)
            self.waiting_on.pop(stage, None)
            self.used[d] += a

    def release(self, stage: str, u: Unit, m: float) -> None:
        with self.cond:
            for d in u.devices:
                if d in self.used:
                    self.used[d] -= m
                    self.releasable[d][stage] = self.releasable[d].get(stage, 0.0) - m
            self.live.pop(u.uid, None)
            self.cond.notify_all()


def run_per_component(
    current: Placement | GlobalPlan,
    target: GlobalPlan,
    impls: Mapping[str, PrimitiveImpl],
    *,
    devices: Collection[int] | None = None,
    lost_devices: Collection[int] = (),
    unit_memory: UnitMemoryFn = default_unit_memory,
    capacity: CapacityLike = DEFAULT_CAPACITY,
    timeout_s: float = 1.0,
    launch_delay_s: Mapping[str, float] | None = None,
    seed: int = 0,
    poll_s: float = 0.001,
) -> BaselineResult:
    """Migrate every stage on its own thread (no global order) and report how it ended.

    Arguments:
        current: the live units (or their plan).
        target: the plan to reach.
        impls: ``kind -> callable(primitive)``, as for the DAG executor.
        devices, lost_devices, unit_memory, capacity: as for ``compile_transition``.
        timeout_s: how long one device wait may last.
        launch_delay_s: seconds each stage waits before it starts (randomized launch).
        seed: shuffles the order in which each stage acquires its devices.
        poll_s: how often a waiter re-checks the wait-for graph.
    Returns:
        the result; failures are reported, not raised.
    Raises:
        StateLossError: the diff itself loses state (before anything runs).
    """
    cur = current if isinstance(current, Placement) else Placement.from_plan(current)
    lost = frozenset(lost_devices)
    diff = diff_plans(cur, target, lost_devices=lost)
    exist = (set(devices) if devices is not None else set(target.devices)) | cur.devices
    exist -= lost
    board = _Board(exist, capacity)
    mem: dict[str, float] = {}

    def m(u: Unit) -> float:
        if u.uid not in mem:
            mem[u.uid] = float(unit_memory(u))
        return mem[u.uid]

    lost_uids = {u.uid for u in diff.lost}
    for u in cur.units:
        if u.uid in lost_uids:
            continue  # its surviving shards are dropped at once
        board.live[u.uid] = u
        for d in u.devices:
            board.used[d] += m(u)
    pids = iter(range(1 << 30))

    def prim(kind: str, ins: tuple[Unit, ...], outs: tuple[Unit, ...], src: Unit | None):
        stage = (ins or outs)[0].stage
        acq = tuple((d, m(u)) for u in outs for d in u.devices)
        rel = tuple((d, m(u)) for u in ins for d in u.devices if d not in lost)
        return Primitive(next(pids), kind, stage, ins, outs, src, acq, rel)

    stages = list(dict.fromkeys([*target.stage_names, *(u.stage for u in cur.units)]))
    work: dict[str, dict[str, list]] = {
        s: {"inplace": [], "extends": [], "destroys": []} for s in stages
    }
    for u, halves in diff.splits:
        work[u.stage]["inplace"].append(((u,), halves))
    for u, (a, b), t in diff.relayouts:
        work[u.stage]["inplace"].append(((u,), (a, b)))
        work[u.stage]["inplace"].append(((a, b), (t,)))
    for ins, t in diff.merges:
        work[t.stage]["inplace"].append((ins, (t,)))
    for t in diff.extends:
        work[t.stage]["extends"].append(t)
    for u in diff.destroys:
        work[u.stage]["destroys"].append(u)
        for d in u.devices:
            if d in board.releasable:
                board.releasable[d][u.stage] = board.releasable[d].get(u.stage, 0.0) + m(u)
    rng = random.Random(seed)
    acquire_orders = {
        s: [(t, d) for t in w["extends"] for d in rng.sample(t.devices, len(t.devices))]
        for s, w in work.items()
    }

    def migrate(stage: str) -> None:
        w = work[stage]
        try:
            time.sleep((launch_delay_s or {}).get(stage, 0.0))
            for ins, outs in w["inplace"]:
                for u in outs:
                    for d in u.devices:
                        board.acquire(stage, d, m(u), timeout_s, poll_s)
                kind = "split" if len(outs) == 2 else "merge"
                impls[kind](prim(kind, ins, outs, None))
                with board.cond:
                    for u in outs:
                        board.live[u.uid] = u
                for u in ins:
                    board.release(stage, u, m(u))
            for t, d in acquire_orders[stage]:
                board.acquire(stage, d, m(t), timeout_s, poll_s)
            for t in w["extends"]:
                with board.cond:
                    src = _source(board.live, t)
                    if src is None:
                        board.fail("state_lost", f"no live unit to copy {t!r} from")
                        raise _Abort
                impls["extend"](prim("extend", (), (t,), src))
                with board.cond:
                    board.live[t.uid] = t
            for u in w["destroys"]:
                impls["destroy"](prim("destroy", (u,), (), None))
                board.release(stage, u, m(u))
        except _Abort:
            return
        except Exception as e:  # a failing primitive ends the whole migration
            with board.cond:
                board.fail("error", f"{stage}: {e!r}")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=migrate, args=(s,), daemon=True) for s in stages]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    elapsed = time.perf_counter() - t0
    if board.failure is not None:
        return BaselineResult(False, board.failure[0], board.failure[1], elapsed)
    final = Placement(tuple(board.live.values()))
    if not final.matches(diff.target):
        return BaselineResult(False, "wrong_placement", repr(final), elapsed)
    return BaselineResult(True, None, "", elapsed)


def _source(live: dict[str, Unit], t: Unit) -> Unit | None:
    """A live unit to copy ``t`` from: same stage first, then same model (weights only)."""
    same = [u for u in live.values() if u.stage == t.stage and u.uid != t.uid]
    if same:
        return same[0]
    if t.trains:
        return None
    other = [u for u in live.values() if u.model == t.model and u.uid != t.uid]
    return other[0] if other else None
