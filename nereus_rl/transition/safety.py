"""Safety check for transition DAGs, compiled or hand-written.

Two levels, in the spirit of the banker's algorithm:

1. *Safe sequence* (any DAG): a topological order in which every primitive finds
   its inputs and copy source alive, no ``destroy`` removes the last live holder
   of a state, no stage slot on a device goes to two units, and every device's
   memory stays within capacity; the order must end in the DAG's target
   placement. Found greedily (releases become available as early as the DAG
   allows, acquisitions in the DAG's own order); when the greedy search is stuck
   the DAG is reported unsafe, naming the blocked primitives and devices.
2. *Any order* (DAGs with a funding certificate, i.e. compiled ones): every
   acquisition is covered by memory free before the transition or by releases
   of its ancestors, no release is spent twice, and every destroy keeps an
   anchor holder of each state; then every topological execution is safe, so
   the executor may start primitives as soon as their predecessors end.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from nereus_rl.core.globalplan import fmt_devices
from nereus_rl.transition.paths import topo_order
from nereus_rl.transition.types import (
    CapacityLike,
    Placement,
    TransitionDAG,
    Unit,
    UnsafeDAGError,
    capacity_of,
)

_TOL = 1e-3


@dataclass(frozen=True)
class SafetyReport:
    """Result of :func:`check_dag`.

    Attributes:
        order: a safe sequential order of primitive ids.
        any_order: every topological execution is safe (certificate verified).
        peak_bytes: the highest memory any device reaches along ``order``.
        reason: why ``any_order`` is False ("" when it is True).
    """

    order: tuple[int, ...]
    any_order: bool
    peak_bytes: float
    reason: str = ""

    def __repr__(self) -> str:
        how = "any order" if self.any_order else f"safe order only ({self.reason})"
        return f"SafetyReport({len(self.order)} primitives, {how}, peak {self.peak_bytes:.3g} B)"


def check_dag(dag: TransitionDAG, *, capacity: CapacityLike | None = None) -> SafetyReport:
    """Verify that ``dag`` can run without double ownership, overfull memory or lost state.

    Arguments:
        dag: the DAG to check.
        capacity: device memory to check against (default: the DAG's own).
    Returns:
        the safety report.
    Raises:
        UnsafeDAGError: the DAG has a cycle, consumes a unit that does not exist or
            twice, or no execution order keeps every device safe and every state held;
            the message names the primitives, units and devices.
    """
    cap_like = dag.capacity if capacity is None else capacity
    topo_order(dag)  # raises on a cycle, naming it
    prims = dag.primitives
    n = len(prims)

    consumed: dict[str, int] = {}
    for p in prims:
        for u in p.inputs:
            if u.uid in consumed:
                raise UnsafeDAGError(
                    f"unit {u!r} is consumed twice, by {prims[consumed[u.uid]]!r} and {p!r}; "
                    "each unit is destroyed, split or merged once"
                )
            consumed[u.uid] = p.pid

    order, peak = _safe_sequence(dag, cap_like)
    ok, reason = _verify_certificate(dag, cap_like)
    assert len(order) == n
    return SafetyReport(tuple(order), ok, peak, reason)


def _initial_used(dag: TransitionDAG) -> dict[int, float]:
    """Memory per device before the transition (lost units count on their surviving devices)."""
    mem = dict(dag.unit_bytes)
    used = dict.fromkeys(dag.devices, 0.0)
    for u in dag.current.units:
        if u.uid not in mem:
            raise UnsafeDAGError(
                f"DAG gives no memory for current unit {u!r}; list it in unit_bytes"
            )
        for d in u.devices:
            if d in used:
                used[d] += mem[u.uid]
    return used


def _safe_sequence(dag: TransitionDAG, cap_like: CapacityLike) -> tuple[list[int], float]:
    prims = dag.primitives
    n = len(prims)
    preds = dag.preds()
    succs = dag.succs()
    npred = [len(set(p)) for p in preds]
    rank = {p: i for i, p in enumerate(dag.order)} if len(dag.order) == n else {}
    cap = {d: capacity_of(cap_like, d) for d in dag.devices}
    used = _initial_used(dag)
    live: dict[str, Unit] = {u.uid: u for u in dag.current.units}
    lost_uids = {u.uid for p in prims if p.lost for u in p.inputs}
    slots: dict[tuple[str, int], str] = {}
    for u in live.values():  # a lost unit keeps its surviving slots until it is destroyed
        for d in u.devices:
            if d in cap:
                slots[(u.stage, d)] = u.uid
    peak = max(used.values(), default=0.0)
    holders: dict[tuple[str, str], int] = {}  # live, not lost, units holding each state
    for u in live.values():
        if u.uid not in lost_uids:
            for st in u.states:
                holders[st] = holders.get(st, 0) + 1

    def key(i: int) -> tuple[bool, int, int]:
        return (prims[i].kind != "destroy", rank.get(i, i), i)

    ready = [key(i) for i in range(n) if npred[i] == 0]
    heapq.heapify(ready)
    seen_edges: set[tuple[int, int]] = set()
    order: list[int] = []

    def why_not(i: int) -> str | None:
        p = prims[i]
        for u in p.inputs:
            if u.uid not in live:
                return f"input {u.uid} is not alive"
        if p.kind == "extend" and (
            p.source is None or p.source.uid not in live or p.source.uid in lost_uids
        ):
            return f"copy source {p.source.uid if p.source else None} is not alive"
        if p.kind == "destroy" and not p.lost:
            u = p.inputs[0]
            for s in u.states:
                others = holders.get(s, 0) - (u.uid not in lost_uids)
                if not others:
                    return f"{u.uid} is the last live holder of {s[0]} of {s[1]!r}"
        for d, a in p.acquire:
            if d not in cap:
                return f"device {d} does not exist"
            if used[d] + a > cap[d] + _TOL:
                on = [v for v in live.values() if d in v.devices and v.uid not in lost_uids]
                return (
                    f"device {d} needs {a:.3g} bytes but has {cap[d] - used[d]:.3g} free "
                    f"(held by {on})"
                )
        for s in dag.slots_acquired(p):
            if s in slots:
                return f"device {s[1]} already serves {slots[s]} of stage {s[0]!r}"
        return None

    while ready:
        # Releases first (they only make room), then acquisitions in the DAG's own order.
        pick = None
        skipped = []
        while ready:
            item = heapq.heappop(ready)
            if why_not(item[2]) is None:
                pick = item[2]
                break
            skipped.append(item)
        for item in skipped:
            heapq.heappush(ready, item)
        if pick is None:
            blocked = [item[2] for item in ready]
            details = " | ".join(f"{prims[i]!r}: {why_not(i)}" for i in blocked)
            devs = sorted({d for i in blocked for d in prims[i].devices})
            raise UnsafeDAGError(
                f"no safe order: every ready primitive is blocked (devices {fmt_devices(devs)}): "
                f"{details}; add edges so releases come before these acquisitions, or keep "
                "another holder of the state alive"
            )
        p = prims[pick]
        for d, a in p.acquire:
            used[d] += a
            peak = max(peak, used[d])
        for u in p.inputs:
            if live.pop(u.uid, None) is not None and u.uid not in lost_uids:
                for st in u.states:
                    holders[st] -= 1
            for d in u.devices:
                if slots.get((u.stage, d)) == u.uid:
                    del slots[(u.stage, d)]
        for u in p.outputs:
            live[u.uid] = u
            for st in u.states:
                holders[st] = holders.get(st, 0) + 1
            for d in u.devices:
                slots[(u.stage, d)] = u.uid
        for d, r in p.release:
            used[d] -= r
        order.append(pick)
        for q in succs[pick]:
            if (pick, q) in seen_edges:
                continue
            seen_edges.add((pick, q))
            npred[q] -= 1
            if npred[q] == 0:
                heapq.heappush(ready, key(q))

    final = Placement(tuple(u for u in live.values() if u.uid not in lost_uids))
    if not final.matches(dag.target):
        got, want = final.layout_key(), dag.target.layout_key()
        bad = sorted(s for s in set(got) | set(want) if got.get(s) != want.get(s))
        raise UnsafeDAGError(
            f"executing the DAG does not reach its target placement: stages {bad} differ "
            f"(got {[got.get(s) for s in bad]}, want {[want.get(s) for s in bad]})"
        )
    return order, peak


def _verify_certificate(dag: TransitionDAG, cap_like: CapacityLike) -> tuple[bool, str]:
    if dag.funding is None:
        return False, "no funding certificate"
    prims = dag.primitives
    n = len(prims)
    preds = dag.preds()
    anc = [0] * n
    for p in topo_order(dag):
        a = 0
        for q in preds[p]:
            a |= anc[q] | (1 << q)
        anc[p] = a
    return _check_funding(dag, cap_like, anc)


def _check_funding(dag: TransitionDAG, cap_like: CapacityLike, anc: list[int]) -> tuple[bool, str]:
    prims = dag.primitives
    need: dict[tuple[int, object], float] = {}
    for p in prims:
        for d, a in p.acquire:
            need[(p.pid, d)] = need.get((p.pid, d), 0.0) + a
        for s in dag.slots_acquired(p):
            need[(p.pid, s)] = 1.0
    given: dict[tuple[int, object], float] = {}
    spent: dict[tuple[int, object], float] = {}
    for f in dag.funding or ():
        if f.funder != -1 and not (anc[f.pid] >> f.funder) & 1:
            return False, f"{prims[f.pid]!r} is funded by {prims[f.funder]!r}, not an ancestor"
        given[(f.pid, f.resource)] = given.get((f.pid, f.resource), 0.0) + f.amount
        spent[(f.funder, f.resource)] = spent.get((f.funder, f.resource), 0.0) + f.amount
    for k, a in need.items():
        if given.get(k, 0.0) + _TOL < a:
            return False, f"{prims[k[0]]!r} acquisition on {k[1]} is not fully funded"
    for (funder, res), amt in spent.items():
        if funder == -1:
            continue
        p = prims[funder]
        if isinstance(res, tuple):
            avail = 1.0 if res in dag.slots_released(p) else 0.0
        else:
            avail = sum(r for d, r in p.release if d == res)
        if amt > avail + _TOL:
            return False, f"{p!r} release on {res} is spent {amt:.3g} > {avail:.3g}"
    # Initial free memory and slots: against the current placement.
    used = _initial_used(dag)
    owned = {(u.stage, d) for u in dag.current.units for d in u.devices}
    for (funder, res), amt in spent.items():
        if funder != -1:
            continue
        if isinstance(res, tuple):
            if res in owned or amt > 1.0 + _TOL:
                return False, f"slot {res} funded as initially free but it is owned"
        elif amt > capacity_of(cap_like, res) - used.get(res, 0.0) + _TOL:
            return False, f"device {res}: initial free memory spent more than once"
    # Anchors: every destroy keeps a holder of each state.
    creator = {u.uid: p.pid for p in prims for u in p.outputs}
    consumer = {u.uid: p.pid for p in prims for u in p.inputs}
    final = {u.uid for u in dag.target.units}
    anchored = {(p, s) for p, s, _ in dag.anchors}
    states = {u.uid: u.states for u in dag.current.units}
    states.update((u.uid, u.states) for p in prims for u in p.outputs)
    for p, s, uid in dag.anchors:
        q = consumer.get(uid)
        ok = s in states.get(uid, ()) and (
            (uid in final and uid not in creator)
            or (uid in creator and (anc[p] >> creator[uid]) & 1 and uid in final)
            or (q is not None and prims[q].kind in ("split", "merge"))
            or (q is not None and prims[q].kind == "destroy" and (anc[q] >> p) & 1)
        )
        if not ok:
            return False, f"{prims[p]!r} anchors {s} on {uid}, which may be gone first"
    for p in prims:
        if p.kind == "destroy" and not p.lost:
            for s in p.inputs[0].states:
                if (p.pid, s) not in anchored:
                    return False, f"{p!r} has no anchor for {s}"
    # Inputs exist before they are consumed, and copy sources live until copied.
    for p in prims:
        for u in p.inputs:
            c = creator.get(u.uid)
            if c is not None and not (anc[p.pid] >> c) & 1:
                return False, f"{p!r} may run before {prims[c]!r} creates {u.uid}"
        if p.source is not None:
            c = creator.get(p.source.uid)
            if c is not None and not (anc[p.pid] >> c) & 1:
                return False, f"{p!r} may copy before {prims[c]!r} creates {p.source.uid}"
            q = consumer.get(p.source.uid)
            if q is not None and not (anc[q] >> p.pid) & 1:
                return False, f"{prims[q]!r} may consume {p.source.uid} before {p!r} copies it"
    return True, ""
