"""The transition DAG compiler.

The plan diff (:mod:`nereus_rl.transition_diff`) decides which units stay,
split, merge, extend or go. The compiler simulates the primitives one at a time
on the device resources (memory and per-stage slots), which yields a safe
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
Finally :mod:`nereus_rl.transition_refine` re-derives the resource edges from a
list schedule by predicted cost, and the faster of the DAGs is returned; the
refinement is skipped (or stopped) once a DAG meets its
:func:`~nereus_rl.transition_refine.makespan_lower_bound`,
a completion time no safe schedule of the same primitives can beat.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Collection, Mapping

from nereus_rl.globalplan import GlobalPlan, fmt_devices
from nereus_rl.transition import (
    DEFAULT_CAPACITY,
    CapacityLike,
    Edge,
    Funding,
    InfeasibleTargetError,
    Placement,
    Primitive,
    PrimitiveCostFn,
    TransitionDAG,
    Unit,
    UnitMemoryFn,
    capacity_of,
    default_primitive_cost,
    default_unit_memory,
    longest_path,
)
from nereus_rl.transition_diff import TransitionDiff, diff_plans
from nereus_rl.transition_refine import (
    fund_acquisition,
    makespan_lower_bound,
    refine_by_list_schedule,
)

_TOL = 1e-3  # bytes: slack for float sums of memory


def compile_transition(
    current: Placement | GlobalPlan,
    target: GlobalPlan,
    *,
    devices: Collection[int] | None = None,
    lost_devices: Collection[int] = (),
    unit_memory: UnitMemoryFn = default_unit_memory,
    capacity: CapacityLike = DEFAULT_CAPACITY,
    cost_fn: PrimitiveCostFn = default_primitive_cost,
    refine: bool = True,
    stage_slots: bool = True,
) -> TransitionDAG:
    """Compile the change ``current -> target`` into a deadlock-free DAG of primitives.

    Arguments:
        current: the live units (or the plan they were made from).
        target: the plan to reach; its stage order is the tie-break.
        devices: the devices that exist after the change (default: every device of
            ``current`` and ``target``); lost devices are removed from it. Devices of
            ``current`` not in it leave gracefully: their units are destroyed.
        lost_devices: devices that died; units on them are lost and destroyed first.
        unit_memory: bytes per device a unit holds (the cost model's estimate plugs in).
        capacity: memory per device, one number or a mapping device -> bytes.
        cost_fn: predicted seconds per primitive (the cost model's estimate plugs in).
        refine: also re-derive the resource edges from a list schedule by ``cost_fn``
            (:mod:`nereus_rl.transition_refine`) and keep the DAG that finishes sooner.
        stage_slots: a device serves at most one unit of each stage at a time. False
            lets a new unit share devices with an old unit of its stage while memory
            allows (needed, e.g., to grow the tp of a stage with a single unit).
    Returns:
        the DAG, with a safe order and the funding certificate.
    Raises:
        InfeasibleTargetError: the target uses devices that do not exist (or are lost),
            a device's target memory exceeds its capacity, the current units already
            exceed it, or no order reaches the target without overfilling a device.
        StateLossError: the target would lose a state (see :func:`diff_plans`).
    """
    cur = current if isinstance(current, Placement) else Placement.from_plan(current)
    lost_set = frozenset(lost_devices)
    after = (frozenset(devices) if devices is not None else cur.devices | target.devices) - lost_set
    # Devices that leave gracefully still hold their units until those are destroyed.
    exist = after | (cur.devices - lost_set)
    missing = sorted(target.devices - after)
    if missing:
        stages = [sp.stage for sp in target.stages if sp.devices.intersection(missing)]
        raise InfeasibleTargetError(
            f"target plan needs {len(target.devices)} devices but devices "
            f"{fmt_devices(missing)} (used by {stages}) do not exist or are lost; "
            f"{len(after)} devices exist ({fmt_devices(sorted(after))}): plan over those"
        )
    diff = diff_plans(cur, target, lost_devices=lost_set)
    dag = _Compiler(cur, diff, target, exist, lost_set, unit_memory, capacity, stage_slots).run()
    if not refine:
        return dag
    return _refine(dag, cost_fn)


def _refine(dag: TransitionDAG, cost_fn: PrimitiveCostFn, repairs: int = 3) -> TransitionDAG:
    """The fastest of the compiled DAG and its list-schedule refinements.

    After the plain priority rules (with and without memory reservation), a few repair
    rounds boost the primitives whose start on the critical path waits on a resource
    edge, so that they take the freed memory before primitives with slack do; a round
    that does not help ends the search, and so does reaching the lower bound.
    """
    dur = [float(cost_fn(p)) for p in dag.primitives]
    best, (best_t, path) = dag, longest_path(dag, dur)
    kinds = {(e.src, e.dst): e.kind for e in dag.edges}
    if all(kinds.get(ab) == "data" for ab in itertools.pairwise(path)):
        return dag  # the critical path is data edges only: no schedule can be shorter
    bound = makespan_lower_bound(dag, dur)
    if best_t <= bound + 1e-9:
        return dag  # already optimal for these primitives: refinement cannot help
    for priority, reserve in (("bottom", False), ("order", False), ("bottom", True)):
        alt = refine_by_list_schedule(dag, cost_fn, priority, reserve=reserve)
        if alt is not None:
            t, _ = longest_path(alt, dur)
            if t < best_t - 1e-12:
                best, best_t = alt, t
                if best_t <= bound + 1e-9:
                    return best
    boost = [0.0] * len(dag.primitives)
    for _ in range(repairs):
        _, path = longest_path(best, dur)
        kinds = {(e.src, e.dst): e.kind for e in best.edges}
        waits = [b for a, b in itertools.pairwise(path) if kinds.get((a, b)) == "resource"]
        if not waits:
            break
        for p in waits:
            boost[p] += best_t
        improved = False
        for reserve in (False, True):
            alt = refine_by_list_schedule(dag, cost_fn, "bottom", boost, reserve=reserve)
            if alt is None:
                continue
            t, _ = longest_path(alt, dur)
            if t < best_t - 1e-12:
                best, best_t, improved = alt, t, True
        if not improved or best_t <= bound + 1e-9:
            break
    return best


class _Compiler:
    """One compilation: the sequential simulation that orders, funds and anchors."""

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
        self._state_cache: dict[tuple[str, str, bool], tuple[tuple[str, str], ...]] = {}
        self.unit_memory = unit_memory
        self.rank = {name: i for i, name in enumerate(target.stage_names)}
        for u in cur.units:
            self.rank.setdefault(u.stage, len(self.rank))

    def mem(self, u: Unit) -> float:
        m = self._mem.get(u.uid)
        if m is None:
            m = self._mem[u.uid] = float(self.unit_memory(u))
        return m

    def _prim(self, kind: str, stage: str, ins: tuple[Unit, ...], outs: tuple[Unit, ...]) -> int:
        pid = len(self.prims)
        mem = self._mem  # every unit's memory is known before primitives are built
        acq = tuple((d, mem[u.uid]) for u in outs for d in u.devices)
        lostdev = self.lostdev
        if lostdev:
            rel = tuple((d, mem[u.uid]) for u in ins for d in u.devices if d not in lostdev)
            lost = kind == "destroy" and bool(lostdev.intersection(ins[0].devices))
        else:
            rel, lost = tuple((d, mem[u.uid]) for u in ins for d in u.devices), False
        prim = Primitive(pid, kind, stage, ins, outs, None, acq, rel, lost)
        self.prims.append(prim)
        self.slot_acq.append(prim.slots_acquired() if self.stage_slots else ())
        self.slot_rel.append(prim.slots_released() if self.stage_slots else ())
        return pid

    # -- building blocks -------------------------------------------------
    def _check_memory(self) -> None:
        used = dict.fromkeys(self.exist, 0.0)
        mem = self._mem
        for u in self.cur.units:
            m = mem[u.uid]
            for d in u.devices:
                if d in used:
                    used[d] += m
        for d, b in used.items():
            if b > self.cap[d] + _TOL:
                on = [u for u in self.cur.units if d in u.devices]
                raise InfeasibleTargetError(
                    f"current units {on} already hold {b:.3g} bytes on device {d}, over its "
                    f"capacity {self.cap[d]:.3g}; give the real capacity or unit memory"
                )
        self.used = used
        tgt = dict.fromkeys(self.exist, 0.0)
        for u in self.diff.target.units:
            m = mem[u.uid]
            for d in u.devices:
                tgt[d] += m
        for d, b in tgt.items():
            if b > self.cap[d] + _TOL:
                on = [u for u in self.diff.target.units if d in u.devices]
                raise InfeasibleTargetError(
                    f"target plan puts {b:.3g} bytes on device {d} ({on}), over its capacity "
                    f"{self.cap[d]:.3g}; choose a plan that fits memory"
                )

    def _edge(self, src: int, dst: int, kind: str, reason: str) -> None:
        if (src, dst) in self.edge_set:
            return
        self.edge_set.add((src, dst))
        self.edges.append(Edge(src, dst, kind, reason))
        self.in_preds[dst].append(src)

    def run(self) -> TransitionDAG:
        self.prims: list[Primitive] = []
        self.slot_acq: list[tuple[tuple[str, int], ...]] = []
        self.slot_rel: list[tuple[tuple[str, int], ...]] = []
        halves = tuple(h for _, hs, _ in self.diff.relayouts for h in hs)
        mem, unit_memory = self._mem, self.unit_memory
        for u in self.cur.units + self.diff.target.units + halves:
            if u.uid not in mem:
                mem[u.uid] = float(unit_memory(u))
        self._check_memory()
        diff = self.diff
        lost_pids = [self._prim("destroy", u.stage, (u,), ()) for u in diff.lost]
        acquirers: list[int] = []
        self.destroy_of: dict[str, int] = {}
        self.consumer: dict[str, int] = {}
        for u, (a, b) in diff.splits:
            acquirers.append(self._prim("split", u.stage, (u,), (a, b)))
            self.consumer[u.uid] = acquirers[-1]
        for u, (a, b), t in diff.relayouts:
            s = self._prim("split", u.stage, (u,), (a, b))
            m = self._prim("merge", u.stage, (a, b), (t,))
            acquirers += [s, m]
            self.consumer[u.uid] = s
            self.consumer[a.uid] = self.consumer[b.uid] = m
        for (a, b), t in diff.merges:
            acquirers.append(self._prim("merge", t.stage, (a, b), (t,)))
            self.consumer[a.uid] = self.consumer[b.uid] = acquirers[-1]
        for t in diff.extends:
            acquirers.append(self._prim("extend", t.stage, (), (t,)))
        for u in diff.destroys:
            self.destroy_of[u.uid] = self._prim("destroy", u.stage, (u,), ())
        kind_rank = {"split": 0, "merge": 1, "extend": 2}
        acquirers.sort(
            key=lambda p: (self.rank[self.prims[p].stage], kind_rank[self.prims[p].kind], p)
        )

        n = len(self.prims)
        self.edges: list[Edge] = []
        self.edge_set: set[tuple[int, int]] = set()
        self.in_preds: list[list[int]] = [[] for _ in range(n)]
        self.anc = [0] * n
        self.order: list[int] = []
        self.done: set[int] = set()
        self.funding: list[Funding] = []
        self.anchors: list[tuple[int, tuple[str, str], str]] = []
        self.early: list[tuple[int, int]] = []
        self.funds: dict[int, list[list[float]]] = {
            d: [[-1, self.cap[d] - self.used[d]]] for d in self.exist
        }
        self.final = {u.uid for u in diff.target.units}
        self.creator: dict[str, int] = {}
        self.live: dict[str, Unit] = {}
        self.live_cat: dict[str, tuple[int, int]] = {}
        self._group_cache: dict[tuple[str, str, bool], tuple] = {}
        # Live holders of each state by preference class (OrderedDicts: O(1) round-robin).
        self.src_groups: dict[tuple[tuple[str, str], str], tuple[OrderedDict, ...]] = {}
        self.anchor_groups: dict[tuple[str, str], tuple[OrderedDict, ...]] = {}
        self.model_stages: dict[str, list[str]] = {}
        for u in [*self.cur.units, *diff.target.units]:
            ms = self.model_stages.setdefault(u.model, [])
            if u.stage not in ms:
                ms.append(u.stage)
        for ms in self.model_stages.values():
            ms.sort(key=self.rank.__getitem__)
        self.slot: dict[tuple[str, int], str] = {}
        self.slot_free_by: dict[tuple[str, int], int] = {}
        self.dev_units: dict[int, dict[str, None]] = {d: {} for d in self.exist}
        lost_uids = {u.uid for u in diff.lost}
        for u in self.cur.units:
            if u.uid not in lost_uids:
                self._add_live(u)
        for p in lost_pids:  # their surviving devices are freed at once
            self._run(p)

        pending = acquirers
        while pending:
            blocked = []
            for p in pending:
                if self._ready(p):
                    self._run(p)
                else:
                    blocked.append(p)
            if len(blocked) == len(pending):
                self._unblock(blocked)
            pending = blocked
        for p in sorted(
            self.destroy_of.values(), key=lambda q: (self.rank[self.prims[q].stage], q)
        ):
            if p not in self.done:
                assert self._destroy_ok(p) is not None, "final holders exist for every state"
                self._run(p)

        prims = tuple(self.prims)
        target = diff.target
        return TransitionDAG(
            current=self.cur,
            target=target,
            primitives=prims,
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

    # -- liveness ----------------------------------------------------------
    def _add_live(self, u: Unit) -> None:
        uid = u.uid
        self.live[uid] = u
        created = uid in self.creator
        consumed = uid in self.consumer
        src_cat = 2 * created + consumed
        if uid in self.final:
            anchor_cat = 1 if created else 0
        else:
            anchor_cat = 2 if consumed else 3
        self.live_cat[uid] = (src_cat, anchor_cat)
        for sg, ag in self._groups(u):
            sg[src_cat][uid] = None
            ag[anchor_cat][uid] = None
        # Per-device indexes (who holds a stage slot, which units sit on a device) keep
        # the blocked-acquisition search local to the devices involved.
        stage, slot, dev_units = u.stage, self.slot, self.dev_units
        if self.lostdev:  # units on lost devices keep their other devices' slots only
            for d in u.devices:
                slot[(stage, d)] = uid
                du = dev_units.get(d)
                if du is not None:
                    du[uid] = None
        else:
            for d in u.devices:
                slot[(stage, d)] = uid
                dev_units[d][uid] = None

    def _groups(
        self, u: Unit
    ) -> tuple[tuple[tuple[OrderedDict, ...], tuple[OrderedDict, ...]], ...]:
        """Per state of ``u``: its source groups (by stage) and its anchor groups."""
        key = (u.model, u.stage, u.trains)
        out = self._group_cache.get(key)
        if out is None:
            pairs = []
            for s in self._states(u):
                sg = self.src_groups.get((s, u.stage))
                if sg is None:
                    sg = self.src_groups[(s, u.stage)] = tuple(OrderedDict() for _ in range(4))
                ag = self.anchor_groups.get(s)
                if ag is None:
                    ag = self.anchor_groups[s] = tuple(OrderedDict() for _ in range(4))
                pairs.append((sg, ag))
            out = self._group_cache[key] = tuple(pairs)
        return out

    def _states(self, u: Unit) -> tuple[tuple[str, str], ...]:
        # Units repeat a handful of (model, stage, trains) triples: build each tuple once.
        key = (u.model, u.stage, u.trains)
        st = self._state_cache.get(key)
        if st is None:
            st = self._state_cache[key] = u.states
        return st

    def _drop_live(self, u: Unit) -> None:
        uid = u.uid
        del self.live[uid]
        src_cat, anchor_cat = self.live_cat.pop(uid)  # the groups _add_live put it in
        for sg, ag in self._groups(u):
            del sg[src_cat][uid]
            del ag[anchor_cat][uid]
        stage, slot, dev_units = u.stage, self.slot, self.dev_units
        for d in u.devices:
            if slot.get((stage, d)) == uid:
                del slot[(stage, d)]
            du = dev_units.get(d)
            if du is not None:
                du.pop(uid, None)

    # -- readiness ---------------------------------------------------------
    def _fits(self, p: int) -> bool:
        used, cap = self.used, self.cap
        for d, a in self.prims[p].acquire:
            if used[d] + a > cap[d] + _TOL:
                return False
        slot = self.slot
        return all(s not in slot for s in self.slot_acq[p])

    def _pick_source(self, t: Unit, commit: bool = False) -> str | None:
        """Copy source for ``t``: an original unit before a created one, one that stays
        before one about to be split or merged, the same stage before another stage of
        the same model (weights only), round-robin within each group."""
        if t.trains:
            key, stages = ("optimizer", t.stage), (t.stage,)
        else:
            key = ("weights", t.model)
            stages = (t.stage, *(x for x in self.model_stages[t.model] if x != t.stage))
        for cat in range(4):
            for st in stages:
                groups = self.src_groups.get((key, st))
                if groups and groups[cat]:
                    g = groups[cat]
                    uid = next(iter(g))
                    if commit:  # round-robin: the next extend prefers another source
                        g.move_to_end(uid)
                    return uid
        return None

    def _ready(self, p: int) -> bool:
        if not self._fits(p):
            return False
        prim = self.prims[p]
        if prim.kind == "merge":
            return all(u.uid in self.live for u in prim.inputs)
        if prim.kind == "extend":
            return self._pick_source(prim.outputs[0]) is not None
        return True

    def _destroy_ok(self, p: int) -> list[tuple[tuple[str, str], str]] | None:
        """Anchors keeping each state of the destroyed unit alive; None for a last holder.

        Preference: a unit that stays, then a created target unit, then one whose state
        moves on through a split or merge, then one destroyed later (which gets an edge).
        """
        u = self.prims[p].inputs[0]
        out = []
        for s in u.states:
            best = None
            for g in self.anchor_groups.get(s, ()):
                for uid in g:
                    if uid != u.uid:
                        best = uid
                        break
                if best is not None:
                    break
            if best is None:
                return None
            out.append((s, best))
        return out

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
        rank = self.rank
        for p in blocked:
            prim = self.prims[p]
            for s in self.slot_acq[p]:
                owner = self.slot.get(s)
                q = self._destroy_for(owner) if owner is not None else None
                if q is not None:
                    self.early.append((q, p))
                    self._run(q)
                    ran = True
            for d, a in prim.acquire:
                while self.used[d] + a > self.cap[d] + _TOL:
                    cands = [self._destroy_for(uid) for uid in self.dev_units[d]]
                    cands = [q for q in cands if q is not None]
                    if not cands:
                        break
                    q = min(cands, key=lambda q: (rank[self.prims[q].stage], q))
                    self.early.append((q, p))
                    self._run(q)
                    ran = True
        if ran:
            return
        for q in sorted(self.destroy_of.values(), key=lambda q: (rank[self.prims[q].stage], q)):
            if q not in self.done and self._destroy_ok(q) is not None:
                self.early.append((q, -1))
                self._run(q)
                return
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
    def _fund(self, p: int, anc: int, need: float, entries: list[list[float]], res) -> int:
        """Take ``need`` from ``entries``: initial first, then ancestors, then earliest."""
        if need <= _TOL:
            return anc
        first = entries[0]
        if first[0] == -1 and first[1] >= need:  # fast path: memory free from the start
            first[1] -= need
            self.funding.append(Funding(p, res, -1, need))
            return anc
        return fund_acquisition(
            p,
            anc,
            need,
            entries,
            res,
            self.anc,
            self.funding,
            lambda f, q, why: self._edge(f, q, "resource", why),
        )

    def _run(self, p: int) -> None:
        prim = self.prims[p]
        anc = 0
        # data edges into p
        if prim.kind == "extend":
            t = prim.outputs[0]
            src_uid = self._pick_source(t, commit=True)
            assert src_uid is not None
            src = self.live[src_uid]
            prim = self.prims[p] = prim._replace(source=src)
            if src_uid in self.creator:
                self._edge(self.creator[src_uid], p, "data", f"{src_uid} is created before copy")
            if src_uid in self.destroy_of:
                self._edge(p, self.destroy_of[src_uid], "data", f"{src_uid} lives until copied")
            if src_uid in self.consumer:
                self._edge(p, self.consumer[src_uid], "data", f"{src_uid} lives until copied")
        elif prim.kind == "merge":
            for u in prim.inputs:
                if u.uid in self.creator:
                    self._edge(self.creator[u.uid], p, "data", f"{u.uid} is created before merge")
        elif prim.kind == "destroy" and not prim.lost:
            anchors = self._destroy_ok(p)
            assert anchors is not None
            for s, uid in anchors:
                self.anchors.append((p, s, uid))
                if uid in self.creator:
                    self._edge(self.creator[uid], p, "data", f"{uid} holds {s[0]} of {s[1]}")
                elif uid in self.destroy_of:
                    self._edge(p, self.destroy_of[uid], "data", f"{uid} holds {s[0]} of {s[1]}")
        for q in self.in_preds[p]:
            anc |= self.anc[q] | (1 << q)
        # acquisitions, funded
        for d, a in prim.acquire:
            anc = self._fund(p, anc, a, self.funds[d], d)
            self.used[d] += a
        for s in self.slot_acq[p]:
            f = self.slot_free_by.pop(s, -1)
            self.funding.append(Funding(p, s, f, 1.0))
            if f != -1 and not (anc >> f) & 1:
                self._edge(f, p, "resource", f"release-before-acquire on slot {s[0]}@{s[1]}")
                anc |= self.anc[f] | (1 << f)
        self.anc[p] = anc
        # effects
        for u in prim.inputs:
            if u.uid in self.live:
                self._drop_live(u)
        for u in prim.outputs:
            self.creator[u.uid] = p
            self._add_live(u)
        for d, r in prim.release:
            self.used[d] -= r
            self.funds[d].append([p, r])
        for s in self.slot_rel[p]:
            self.slot_free_by[s] = p
        self.order.append(p)
        self.done.add(p)


def transition_cost(
    current: Placement | GlobalPlan,
    target: GlobalPlan,
    *,
    cost_fn: PrimitiveCostFn = default_primitive_cost,
    **compile_kwargs: object,
) -> float:
    """Predicted seconds to change ``current`` into ``target``: what admission weighs.

    Arguments:
        current: the live units (or their plan).
        target: the plan to reach.
        cost_fn: predicted seconds per primitive (the cost model's ``primitive_cost``).
        compile_kwargs: passed to :func:`compile_transition` (devices, lost_devices,
            unit_memory, capacity, stage_slots).
    Returns:
        the compiled DAG's critical-path length under ``cost_fn``.
    Raises:
        InfeasibleTargetError, StateLossError: as :func:`compile_transition`.
    """
    dag = compile_transition(current, target, cost_fn=cost_fn, **compile_kwargs)  # type: ignore[arg-type]
    return longest_path(dag, [cost_fn(p) for p in dag.primitives])[0]
