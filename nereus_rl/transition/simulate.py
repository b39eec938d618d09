"""The transition compiler's sequential simulation: it orders, funds and anchors primitives.

The plan diff (:mod:`nereus_rl.transition.diff`) decides which units stay, split,
merge, extend or go. :class:`Simulation` runs the primitives one at a time on
the device resources (memory and per-stage slots), which yields a safe
sequential order. Acquisitions run first, in stage order (the deterministic
tie-break). When every remaining acquisition is blocked, it chooses *executable*
destroys (never the last live holder of a state) that free the devices the
blocked acquisitions need, in priority order. Every acquisition is *funded* by
memory free before the transition or by releases earlier in the order; a
resource edge ``release -> acquire`` is added only where the funding release is
not already an ancestor (release-before-acquire). The funding is kept as a
certificate: it proves that every topological execution of the DAG keeps each
device within capacity and gives no stage slot to two units. All edges point
forward in the simulated order, so the DAG is acyclic by construction.

Speed. Planning runs inside the trainer's control loop and at cluster scale
(thousands of units), so each step of the simulation is local to the devices
and states the primitive touches: the live units are indexed by state and
preference class, stage slot and device (:mod:`nereus_rl.transition.holders`),
and only devices some primitive acquires or releases are indexed at all; each
device keeps the list of its unspent releases; ancestor sets are integer bit
sets; a primitive's stage slots follow from its shape (an extend takes every
device of its new unit, a destroy frees every device of its unit). None of this
changes what is computed: the DAG is the one the plain simulation gives (tests
pin it to fingerprints recorded before these changes).
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import chain, repeat
from operator import attrgetter

from nereus_rl.core.globalplan import GlobalPlan
from nereus_rl.transition.diff import TransitionDiff
from nereus_rl.transition.holders import Holders
from nereus_rl.transition.refine import fund_acquisition
from nereus_rl.transition.types import (
    CapacityLike,
    Edge,
    Funding,
    InfeasibleTargetError,
    Placement,
    Primitive,
    TransitionDAG,
    Unit,
    UnitMemoryFn,
    capacity_of,
)

_TOL = 1e-3  # bytes: slack for float sums of memory
_KIND_RANK = {"split": 0, "merge": 1, "extend": 2}
_DEVICES = attrgetter("devices")
_UID = attrgetter("uid")


class Simulation:
    """One compilation: the sequential simulation that orders, funds and anchors.

    Arguments:
        cur: the live units.
        diff: the plan diff of ``cur`` and the target.
        target: the target plan (its stage order is the tie-break).
        exist: devices that exist during the transition.
        lost: lost devices.
        unit_memory: bytes per device of a unit.
        capacity: memory per device.
        stage_slots: a device serves at most one unit of each stage at a time.
    """

    def __init__(
        self,
        cur: Placement,
        diff: TransitionDiff,
        target: GlobalPlan,
        exist: frozenset[int],
        lost: frozenset[int],
        unit_memory: UnitMemoryFn,
        capacity: CapacityLike,
        stage_slots: bool = True,
    ) -> None:
        self.stage_slots = stage_slots
        self.cur, self.diff, self.exist, self.lostdev = cur, diff, exist, lost
        self.capacity = capacity
        if isinstance(capacity, Mapping):
            self.cap = {d: capacity_of(capacity, d) for d in exist}
        else:
            self.cap = dict.fromkeys(exist, float(capacity))
        self._mem: dict[str, float] = {}
        self.unit_memory = unit_memory
        self.rank = {name: i for i, name in enumerate(target.stage_names)}
        for st in dict.fromkeys(u.stage for u in cur.units):
            self.rank.setdefault(st, len(self.rank))

    # -- primitives ----------------------------------------------------------
    def _prim(self, kind: str, stage: str, ins: tuple[Unit, ...], outs: tuple[Unit, ...]) -> int:
        pid = len(self.prims)
        mem = self._mem  # every unit's memory is known before primitives are built
        if len(outs) == 1:
            t = outs[0]
            acq = tuple(zip(t.devices, repeat(mem[t.uid])))
        else:
            acq = tuple((d, mem[u.uid]) for u in outs for d in u.devices)
        lostdev = self.lostdev
        if lostdev:
            rel = tuple((d, mem[u.uid]) for u in ins for d in u.devices if d not in lostdev)
            lost = kind == "destroy" and bool(lostdev.intersection(ins[0].devices))
        elif len(ins) == 1:
            u = ins[0]
            rel, lost = tuple(zip(u.devices, repeat(mem[u.uid]))), False
        else:
            rel, lost = tuple((d, mem[u.uid]) for u in ins for d in u.devices), False
        prim = tuple.__new__(Primitive, (pid, kind, stage, ins, outs, None, acq, rel, lost))
        self.prims.append(prim)
        # The same slots as Primitive.slots_acquired / slots_released, by kind.
        if not self.stage_slots:
            s_acq = s_rel = ()
        elif kind == "extend":
            t = outs[0]
            s_acq, s_rel = tuple(zip(repeat(t.stage), t.devices)), ()
        elif kind == "destroy":
            u = ins[0]
            s_acq, s_rel = (), tuple(zip(repeat(u.stage), u.devices))
        else:
            s_acq, s_rel = prim.slots_acquired(), prim.slots_released()
        self.slot_acq.append(s_acq)
        self.slot_rel.append(s_rel)
        return pid

    def _check_memory(self) -> None:
        """Current and target memory per device within capacity, or InfeasibleTargetError.

        The target is summed only over devices some primitive touches: elsewhere the
        target units are the current ones, already checked.
        """
        used = dict.fromkeys(self.exist, 0.0)
        mem = self._mem
        units = self.cur.units
        pairs = zip(map(_DEVICES, units), map(mem.__getitem__, map(_UID, units)))
        if self.lostdev:  # units on lost devices count on their surviving devices
            for devs, m in pairs:
                for d in devs:
                    if d in used:
                        used[d] += m
        else:
            for devs, m in pairs:
                for d in devs:
                    used[d] += m
        cap = self.cap
        for d, b in used.items():
            if b > cap[d] + _TOL:
                on = [u for u in units if d in u.devices]
                raise InfeasibleTargetError(
                    f"current units {on} already hold {b:.3g} bytes on device {d}, over its "
                    f"capacity {cap[d]:.3g}; give the real capacity or unit memory"
                )
        self.used = used
        touched, target = self.touched, self.diff.target.units
        tgt = dict.fromkeys(touched, 0.0)
        untouched = touched.isdisjoint
        for u in target:
            if untouched(u.devices):
                continue
            m = mem[u.uid]
            for d in u.devices:
                if d in tgt:
                    tgt[d] += m
        for d in self.exist:  # in the same device order as the current check
            b = tgt.get(d)
            if b is not None and b > cap[d] + _TOL:
                on = [u for u in target if d in u.devices]
                raise InfeasibleTargetError(
                    f"target plan puts {b:.3g} bytes on device {d} ({on}), over its capacity "
                    f"{cap[d]:.3g}; choose a plan that fits memory"
                )

    def _edge(self, src: int, dst: int, kind: str, reason: str) -> None:
        if (src, dst) in self.edge_set:
            return
        self.edge_set.add((src, dst))
        self.edges.append(Edge(src, dst, kind, reason))
        self.in_preds[dst].append(src)

    def _build(self) -> tuple[list[int], list[int]]:
        """Units' memory, the memory checks, and the primitives: (lost destroys, acquirers)."""
        diff = self.diff
        mem, unit_memory = self._mem, self.unit_memory
        units = self.cur.units  # uids are unique within a placement
        mem.update(zip(map(_UID, units), map(float, map(unit_memory, units))))
        # Units the transition creates (the others are current units), and the devices
        # some primitive acquires or releases: those of the units consumed or created.
        created = [*diff.extends, *(t for _, t in diff.merges)]
        for _, halves in diff.splits:
            created += halves
        for _, halves, t in diff.relayouts:
            created += [*halves, t]
        for u in created:
            if u.uid not in mem:
                mem[u.uid] = float(unit_memory(u))
        touched: set[int] = set()
        for u in chain(diff.lost, diff.destroys, created):
            touched.update(u.devices)
        for u, _ in diff.splits:
            touched.update(u.devices)
        for u, _, _ in diff.relayouts:
            touched.update(u.devices)
        for halves, _ in diff.merges:
            for u in halves:
                touched.update(u.devices)
        self.touched = frozenset(touched)
        self._check_memory()
        self.prims: list[Primitive] = []
        self.slot_acq: list[tuple[tuple[str, int], ...]] = []
        self.slot_rel: list[tuple[tuple[str, int], ...]] = []
        prim = self._prim
        lost_pids = [prim("destroy", u.stage, (u,), ()) for u in diff.lost]
        acquirers: list[int] = []
        self.destroy_of: dict[str, int] = {}
        consumer: dict[str, int] = {}
        self.consumer = consumer
        for u, (a, b) in diff.splits:
            acquirers.append(prim("split", u.stage, (u,), (a, b)))
            consumer[u.uid] = acquirers[-1]
        for u, (a, b), t in diff.relayouts:
            s = prim("split", u.stage, (u,), (a, b))
            m = prim("merge", u.stage, (a, b), (t,))
            acquirers += [s, m]
            consumer[u.uid] = s
            consumer[a.uid] = consumer[b.uid] = m
        for (a, b), t in diff.merges:
            acquirers.append(prim("merge", t.stage, (a, b), (t,)))
            consumer[a.uid] = consumer[b.uid] = acquirers[-1]
        for t in diff.extends:
            acquirers.append(prim("extend", t.stage, (), (t,)))
        for u in diff.destroys:
            self.destroy_of[u.uid] = prim("destroy", u.stage, (u,), ())
        prims, rank = self.prims, self.rank
        acquirers.sort(key=lambda p: (rank[prims[p].stage], _KIND_RANK[prims[p].kind], p))
        return lost_pids, acquirers

    def _start(self) -> None:
        """The simulation's state before the first primitive: the current units live."""
        diff = self.diff
        n = len(self.prims)
        self.edges: list[Edge] = []
        self.edge_set: set[tuple[int, int]] = set()
        self.in_preds: list[list[int]] = [[] for _ in range(n)]
        self.anc = [0] * n  # ancestor bit sets
        self.order: list[int] = []
        self.done: set[int] = set()
        self.funding: list[Funding] = []
        self.anchors: list[tuple[int, tuple[str, str], str]] = []
        self.early: list[tuple[int, int]] = []
        self.creator: dict[str, int] = {}
        self.slot_free_by: dict[tuple[str, int], int] = {}
        model_stages: dict[str, list[str]] = {}
        pairs = dict.fromkeys((u.model, u.stage) for u in self.cur.units)
        pairs.update(dict.fromkeys((u.model, u.stage) for u in diff.target.units))
        for model, stage in pairs:
            model_stages.setdefault(model, []).append(stage)
        for ms in model_stages.values():
            ms.sort(key=self.rank.__getitem__)
        touched = self.touched
        cap, used = self.cap, self.used
        # Per device, [funder, bytes left]: memory free before (-1), then releases.
        self.funds = {d: [[-1, cap[d] - used[d]]] for d in touched if d in cap}
        final = {u.uid for u in diff.target.units}
        self.holders = Holders(self.consumer, final, model_stages, touched, self.lostdev)
        self.live, self.slot = self.holders.live, self.holders.slot
        self.dev_units = self.holders.dev_units
        lost_uids = {u.uid for u in diff.lost}
        self.holders.add_current(u for u in self.cur.units if u.uid not in lost_uids)

    def run(self) -> TransitionDAG:
        """Simulate the transition and return the compiled (unrefined) DAG.

        Raises:
            InfeasibleTargetError: a device is over capacity before or after, or no
                order reaches the target without overfilling a device.
        """
        lost_pids, acquirers = self._build()
        self._start()
        for p in lost_pids:  # their surviving devices are freed at once
            self._run(p)

        pending = acquirers
        ready, run = self._ready, self._run
        while pending:
            blocked = []
            for p in pending:
                if ready(p):
                    run(p)
                else:
                    blocked.append(p)
            if len(blocked) == len(pending):
                self._unblock(blocked)
            pending = blocked
        diff, prims, rank, done = self.diff, self.prims, self.rank, self.done
        for p in sorted(self.destroy_of.values(), key=lambda q: (rank[prims[q].stage], q)):
            if p not in done:
                assert self._destroy_ok(p) is not None, "final holders exist for every state"
                run(p)

        return TransitionDAG(
            current=self.cur,
            target=diff.target,
            primitives=tuple(prims),
            edges=tuple(self.edges),
            order=tuple(self.order),
            capacity=self.capacity,
            devices=self.exist,
            unit_bytes=tuple(sorted(self._mem.items())),
            funding=tuple(self.funding),
            anchors=tuple(self.anchors),
            early_destroys=tuple(self.early),
            stage_slots=self.stage_slots,
        )

    # -- readiness ---------------------------------------------------------
    def _ready(self, p: int) -> bool:
        used, cap = self.used, self.cap
        prim = self.prims[p]
        for d, a in prim.acquire:
            if used[d] + a > cap[d] + _TOL:
                return False
        slot = self.slot
        for s in self.slot_acq[p]:
            if s in slot:
                return False
        kind = prim.kind
        if kind == "merge":
            live = self.live
            return all(u.uid in live for u in prim.inputs)
        if kind == "extend":
            return self.holders.pick_source(prim.outputs[0]) is not None
        return True

    def _destroy_ok(self, p: int) -> list[tuple[tuple[str, str], str]] | None:
        """Anchors keeping each state of the destroyed unit alive; None for a last holder."""
        return self.holders.anchors(self.prims[p].inputs[0])

    def _destroy_for(self, uid: str) -> int | None:
        q = self.destroy_of.get(uid)
        if q is None or q in self.done or self._destroy_ok(q) is None:
            return None
        return q

    def _unblock(self, blocked: list[int]) -> None:
        """Every acquisition is blocked: run executable destroys that free needed devices.

        For each blocked acquisition in priority order: destroy the owner of a stage slot
        it needs, and units on devices short of memory (stage order), while executable.
        """
        ran = False
        rank, prims, used, cap = self.rank, self.prims, self.used, self.cap
        destroy_of, done = self.destroy_of, self.done
        for p in blocked:
            prim = prims[p]
            for s in self.slot_acq[p]:
                owner = self.slot.get(s)
                q = self._destroy_for(owner) if owner is not None else None
                if q is not None:
                    self.early.append((q, p))
                    self._run(q)
                    ran = True
            for d, a in prim.acquire:
                while used[d] + a > cap[d] + _TOL:
                    # The first executable destroy in (stage, id) order: the same as the
                    # minimum over the executable ones, testing executability lazily.
                    cands = []
                    for uid in self.dev_units[d]:
                        q = destroy_of.get(uid)
                        if q is not None and q not in done:
                            cands.append((rank[prims[q].stage], q))
                    cands.sort()
                    q = next((q for _, q in cands if self._destroy_ok(q) is not None), None)
                    if q is None:
                        break
                    self.early.append((q, p))
                    self._run(q)
                    ran = True
        if ran:
            return
        for q in sorted(destroy_of.values(), key=lambda q: (rank[prims[q].stage], q)):
            if q not in done and self._destroy_ok(q) is not None:
                self.early.append((q, -1))
                self._run(q)
                return
        self._raise_blocked(blocked)

    def _raise_blocked(self, blocked: list[int]) -> None:
        lines = []
        for p in blocked:
            prim = self.prims[p]
            short = [
                f"device {d} needs {a:.3g} bytes, free {self.cap[d] - self.used[d]:.3g}, "
                f"held by {[self.live[uid] for uid in self.dev_units[d]]}"
                for d, a in prim.acquire
                if self.used[d] + a > self.cap[d] + _TOL
            ]
            slots = [f"{s} owned by {self.slot[s]}" for s in self.slot_acq[p] if s in self.slot]
            lines.append(f"{prim!r}: " + "; ".join(short + slots or ["waits for its inputs"]))
        raise InfeasibleTargetError(
            "no order reaches the target without overfilling a device or destroying the last "
            "holder of a state; blocked: " + " | ".join(lines) + ". Give the transition more "
            "free memory (an intermediate plan) or keep one more unit of the blocking stage"
        )

    # -- running one primitive in the simulation -----------------------------
    def _run(self, p: int) -> None:
        prim = self.prims[p]
        kind = prim.kind
        creator, edge = self.creator, self._edge
        # data edges into p
        if kind == "extend":
            t = prim.outputs[0]
            src_uid = self.holders.pick_source(t, commit=True)
            assert src_uid is not None
            src = self.live[src_uid]
            prim = self.prims[p] = tuple.__new__(Primitive, (*prim[:5], src, *prim[6:]))
            if src_uid in creator:
                edge(creator[src_uid], p, "data", f"{src_uid} is created before copy")
            if src_uid in self.destroy_of:
                edge(p, self.destroy_of[src_uid], "data", f"{src_uid} lives until copied")
            if src_uid in self.consumer:
                edge(p, self.consumer[src_uid], "data", f"{src_uid} lives until copied")
        elif kind == "merge":
            for u in prim.inputs:
                if u.uid in creator:
                    edge(creator[u.uid], p, "data", f"{u.uid} is created before merge")
        elif kind == "destroy" and not prim.lost:
            anchors = self._destroy_ok(p)
            assert anchors is not None
            for s, uid in anchors:
                self.anchors.append((p, s, uid))
                if uid in creator:
                    edge(creator[uid], p, "data", f"{uid} holds {s[0]} of {s[1]}")
                elif uid in self.destroy_of:
                    edge(p, self.destroy_of[uid], "data", f"{uid} holds {s[0]} of {s[1]}")
        anc_of = self.anc
        anc = 0
        for q in self.in_preds[p]:
            anc |= anc_of[q] | (1 << q)
        # acquisitions, funded
        used, funds, funding = self.used, self.funds, self.funding
        for d, a in prim.acquire:
            if a > _TOL:
                entries = funds[d]
                first = entries[0]
                if first[0] == -1 and first[1] >= a:  # fast path: memory free from the start
                    first[1] -= a
                    funding.append(tuple.__new__(Funding, (p, d, -1, a)))
                else:
                    anc = fund_acquisition(
                        p,
                        anc,
                        a,
                        entries,
                        d,
                        anc_of,
                        funding,
                        lambda f, q, why: edge(f, q, "resource", why),
                    )
            used[d] += a
        slot_free_by = self.slot_free_by
        for s in self.slot_acq[p]:
            f = slot_free_by.pop(s, -1)
            funding.append(tuple.__new__(Funding, (p, s, f, 1.0)))
            if f != -1 and not (anc >> f) & 1:
                edge(f, p, "resource", f"release-before-acquire on slot {s[0]}@{s[1]}")
                anc |= anc_of[f] | (1 << f)
        anc_of[p] = anc
        # effects
        holders = self.holders
        live = holders.live
        for u in prim.inputs:
            if u.uid in live:
                holders.drop(u)
        for u in prim.outputs:
            creator[u.uid] = p
            holders.add_created(u)
        for d, r in prim.release:
            used[d] -= r
            funds[d].append([p, r])
        for s in self.slot_rel[p]:
            slot_free_by[s] = p
        self.order.append(p)
        self.done.add(p)
