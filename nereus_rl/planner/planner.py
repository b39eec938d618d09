"""Exact planner: the memory-feasible GlobalPlan with the lowest predicted step latency.

Plan space (``N`` available devices):
    * each planned stage s gets a layout ``(dp, tp, pp)`` of powers of two, homogeneous
      within the stage, using ``d_s = dp * tp * pp`` devices;
    * the stages are partitioned into colocation groups; a group's stages all start at
      the group's first device (a stage uses the first ``d_s`` devices of its group), so
      the group spans ``n_G = max_{s in G} d_s`` devices and its stages' memory adds up
      on its first device; groups are on disjoint devices and ``sum_G n_G <= N``;
    * groups are placed in decreasing size (then by first stage) at consecutive offsets
      (``planner_place``), so every group (and every stage, unit, tp group) is aligned
      to its power-of-two size; with ``devices_per_node`` a power of two (or one node)
      none then straddles a node boundary it need not cross, and the stage tables
      price each layout at the link tiers its size implies.
    * With nodes that are not a power of two wide (3 or 6 devices) and more than one
      node, a group may straddle a node boundary where it lands, so tiers depend on
      placement: the search then prices every choice as placed (``planner_placed``, in
      both ``native`` modes), and is exact over the same plan space as placed.
    * When the available devices have holes (e.g. after a loss), groups are laid over
      the sorted survivors; with nodes a power of two wide, alignment then is not
      guaranteed, and the returned latencies are re-priced as placed (exactness is
      claimed for the aligned case). ``timings["aligned"]`` is true only when every
      stage of the returned plan gets the link tiers its size implies.

Objective (``CostModel.step_latency``): ``sum_p max_G T_{G,p}`` with
``T_{G,p} = sum_{s in G, phase p} t_s``; the rollout's time includes the weight sync,
intra-node iff rollout and actor_train share a group within one node (or the cluster is
one node). An asynchronous workload (``Workload.rollout_ahead``) is ranked by the
overlapped step that ``step_latency`` prices for it: ``planner.overlap_search``, seeded
with the synchronous search's best plans (below), returns the plan space's minimum and
every ``latency_s`` is ``step_latency``'s total of its plan.

Algorithm (exact branch and bound; each step in its own module):
    1. Stage tables (``planner_tables``, here): for every stage and power of two ``n``,
       the Pareto list ``F_s(n)`` of (time, memory) over layouts with ``d <= n`` that
       fit a device. Keeping only Pareto points is safe: a layout no slower, needing no
       more memory or devices keeps the plan feasible and no ``T_{G,p}`` grows (sums
       and maxima are monotone). Times are ``W @ (1/e)`` over a work matrix priced once
       per stage shape; a refinement of the efficiencies only redoes the product.
    2. Partition bounds (``planner_bounds``): ``C_G(n)``, per phase the sum over the
       group's stages of their fastest layout in ``F_s(n)``, bounds the group's phase
       times at any size up to ``n``; for all 203 set partitions of six stages at once
       (numpy), the minimum over the maximal power-of-two size assignments of
       ``sum_p max_G C_{G,p}(n_G)`` bounds every plan of the partition. Partitions are
       searched in order of this bound and the rest dropped once it reaches the
       incumbent (1 to 13 of 203 are searched in bench_planner's calls).
    3. Search of a partition (``planner_search``): depth first over group sizes
       (largest first) with the bound ``sum_p max(M_p, V_p, R_p)`` (``M``: phase
       maxima of the groups placed; ``V``: the current group's; ``R``: the cheap
       bound of each later group at the largest size the devices left allow). Every
       group but the last picks a vector from its group table (``planner_groups``:
       the 3-D Pareto set of its phase vectors whose memory fits, built only when the
       cheap bound can still beat the incumbent); the last group enumerates its
       stages' layouts depth first against the objective itself, pruned by memory and
       by the same bound, at the largest size left only (a larger size holds every
       smaller size's choices), plus a node's size when it holds rollout and
       actor_train (the intra-node sync is only priced there). When rollout and
       actor_train share a group wider than a node, only choices with some stage wider
       than a node are kept (the sync tier priced is the one the placed plan gets); at
       a node or less the intra-node variant applies. A node is pruned only when its
       bound is no better than the incumbent (the k-th best), so the result is the
       minimum over the plan space.

``PlanResult.k_best`` lists the best distinct plans found, best first; the first is the
exact optimum; the others are the next best among plans whose stage layouts are Pareto
points and whose non-last groups take Pareto vectors (a plan that only swaps in a
dominated layout or vector is left out).

Compiled search (``planner_native``, csrc/rl/planner/; for nodes a power of two wide or
a single node, the searches above otherwise): steps 1 to 3 run in C++ over
flat arrays when ``nereus_rl._native`` is built (``Planner(native=None)``, the default);
``native=False`` runs them in Python, the reference. The port follows the Python step by
step (summation orders, stable sorts, heapq's sift order), so both return the same plans,
objectives bit for bit and k-best order; tests/rl/planner/test_planner_native.py checks it call by
call. The compiled search computes a partition's bound only when that partition may be
the next to search: every partition starts with a cheap lower bound (its largest group
at the largest size, the others at the largest size left), refined by a branch and bound
over its rows when it comes to the top; the order searched, and so every result, is the
reference's (csrc/rl/planner/search.cpp). Pricing is shared: one product of the stacked
work matrices of the call's stages with the inverse efficiencies (``Planner._stack``).

Caching across calls (``Planner``): stage tables per stage shape (the weight-sync part
per actor, shared by every bucket), their stacked work matrices per set of shapes;
Pareto lists, group tables and the cheap bounds (the compiled search: one context
holding all of them) per (shapes, efficiency version, capacity), partition bounds (and
the compiled search's heap of partitions) also per device count; those of a superseded
version are dropped. A context's Pareto lists need no sort by time: each table's layouts
have a fixed memory order per size, swept once per new context. Per workload object,
its stages' keys and shape (``Workload.with_response_len`` gives one object per bucket
length). Placed plans are reused
per (shapes, choices, device run), StagePlans when a stage gets the same layout on the
same run of devices. A call after a signal change rebuilds only what the change
touched: a bucket change prices the new shapes' layouts (``costmodel_work.stage_work``,
plain Python, by far the largest part of such a call; ``Planner.prepare`` does it ahead
for known buckets), a refinement redoes the pricing, Pareto lists and bounds, a device
loss only the partition bounds and the search. A refinement (``CostModel`` calls
``Planner._on_refine``) rebuilds the compiled context of the latest call's stage shapes
at once, with its partition keys on that call's device count, so the decision that
follows it on the same bucket and devices (a job's usual case) finds them built.
"""

from __future__ import annotations

import dataclasses
import operator
import time
from collections.abc import Iterable

import numpy as np

from nereus_rl.core.globalplan import GlobalPlan
from nereus_rl.core.spec import ClusterSpec
from nereus_rl.core.workload import StageWork, Workload
from nereus_rl.costmodel.costmodel import CostModel, stage_tiers
from nereus_rl.planner import native as planner_native
from nereus_rl.planner import overlap_search
from nereus_rl.planner import placed as planner_placed
from nereus_rl.planner import reference as planner_reference
from nereus_rl.planner.place import SHARED_PLACED, infeasible, place
from nereus_rl.planner.tables import _StageTable
from nereus_rl.planner.tables import set_partitions as set_partitions  # public, re-exported
from nereus_rl.planner.types import PlanInfeasibleError as PlanInfeasibleError
from nereus_rl.planner.types import PlanResult
from nereus_rl.planner.types import PlanSpaceError as PlanSpaceError
from nereus_rl.planner.types import check_plan_space as check_plan_space

# A StageWork's fields but its ModelSpec, read in one C call: with a token for the
# spec, the key of a stage shape without hashing the (nested, uncached) dataclasses.
_SW_FIELDS = operator.attrgetter(
    *(f.name for f in dataclasses.fields(StageWork) if f.name != "model_spec")
)


def _device_list(devices: Iterable[int] | None, num_devices: int) -> range | list[int]:
    """Sorted distinct device ids; a ``range`` with step 1 is kept as it is (no list of
    thousands of ids built per call)."""
    if devices is None:
        return range(num_devices)
    if isinstance(devices, range) and devices.step == 1:
        return devices
    return sorted(set(devices))


class Planner:
    """Exact planner with caches that survive across calls (see the module docstring).

    Arguments:
        cluster: the cluster (device ids ``0 .. num_devices-1``).
        costmodel: prices plans; its ``version`` keys the time caches.
        native: run the search compiled (``nereus_rl._native``; the default when it is
            built) or in Python (the reference; same plans, objectives and k-best order).

    Raises:
        ValueError: ``native=True`` and the compiled search is not built.
    """

    def __init__(
        self, cluster: ClusterSpec, costmodel: CostModel, *, native: bool | None = None
    ) -> None:
        if native and not planner_native.AVAILABLE:
            raise ValueError(
                "native=True but nereus_rl._native has no planner search; build it with "
                "`python setup.py build_ext --inplace` or pass native=False"
            )
        self.cluster = cluster
        self.costmodel = costmodel
        self.native = planner_native.AVAILABLE if native is None else native
        self._nctx: dict = {}  # (version, cap, ids) -> compiled search context
        self._ids: dict = {}  # (StageWork, actor or None, dtype) -> small int
        self._tables: dict = {}  # id -> _StageTable
        self._pareto: dict = {}  # (ids, block, version, cap) -> {n: Pareto list}
        self._groups: dict = {}  # (ids, group, n, width rule, cap, version) -> vectors
        self._ginfo: dict = {}  # (version, cap, ids) -> per-call-shape search data
        self._sync: dict = {}
        self._placed_times: dict = {}  # (table, version) -> layouts priced per tier (placed)
        self._placed = SHARED_PLACED  # StagePlans by layout and device run (interned)
        self._stacks: dict = {}  # stage ids -> stacked work matrices (see _stack)
        self._layouts: dict = {}  # stage ids -> their tables' compiled layouts
        self._plans: dict = {}  # GlobalPlans by stage shapes, choices and device run
        self._specs: dict = {}  # id(ModelSpec) -> (spec, token); equal specs, one token
        self._spec_tok: dict = {}  # ModelSpec -> token
        self._shapes: dict = {}  # stage ids -> (phases, r_i, a_i, tables)
        self._wls: dict = {}  # id(workload) -> (workload, stages, stage ids, shape)
        self._pidx: dict = {}  # (stages, devices) -> compiled partition index
        self._overlapped: dict = {}  # async results: (shapes, version, cap, devices, k) -> ...
        self._ver = costmodel.version
        # The latest compiled call's (stage ids, tables, phases, r_i, a_i, capacity,
        # partition index): what _on_refine rebuilds ahead of the next call.
        self._last: tuple | None = None
        costmodel.add_refine_listener(self._on_refine)

    def _tok(self, spec) -> int:
        """Small int per ModelSpec value, found by identity first (specs are shared by a
        workload's copies), by equality on first sight of an object."""
        got = self._specs.get(id(spec))
        if got is None or got[0] is not spec:
            tok = self._spec_tok.setdefault(spec, len(self._spec_tok))
            got = self._specs[id(spec)] = (spec, tok)
        return got[1]

    def _sid(self, sw: StageWork, actor, dtype: str) -> int:
        """Small int for a stage shape: its fields, its spec's token and, for rollout, the
        actor's (no dataclass is hashed on the decision path)."""
        act = self._tok(actor) if sw.stage == "rollout" else -1
        key = (_SW_FIELDS(sw), self._tok(sw.model_spec), act, dtype)
        sid = self._ids.get(key)
        if sid is None:
            sid = self._ids[key] = len(self._ids)
        return sid

    def _table(self, sw: StageWork, actor, dtype: str) -> _StageTable:
        sid = self._sid(sw, actor, dtype)
        t = self._tables.get(sid)
        if t is None:
            t = self._tables[sid] = _StageTable(
                sw, actor, self.cluster, self.cluster.num_devices, dtype, self._sync
            )
        return t

    def prepare(self, workloads: Iterable[Workload]) -> int:
        """Build the stage tables of ``workloads`` ahead of the decisions that need them.

        A job knows its response-length bucket edges in advance; preparing one workload
        per bucket at start-up moves the per-layout work pricing (the largest part of a
        call after a bucket change) off the decision path; with the compiled search, the
        buckets' contexts (Pareto lists) at the current efficiencies are built too, so a
        decision before the next refinement does not build them. Results are unchanged.

        Arguments:
            workloads: the workloads (e.g. one per response bucket) to prepare.

        Returns:
            The number of stage tables built (those not already cached).
        """
        before = len(self._tables)
        self._check_version()
        ver, cap = self.costmodel.version, self.costmodel.capacity_bytes
        for w in workloads:
            stages = list(w.planned_stages)
            actor = w.stage("actor_train").model_spec
            sid = tuple(self._sid(s, actor, w.dtype) for s in stages)
            phases, r_i, a_i, tables = self._shape(stages, sid, actor, w.dtype)
            self._stack(sid, tables, r_i)
            if self.native:
                # The compiled layouts and the context (Pareto lists) at the current
                # efficiencies: a decision before the next refinement finds them built
                planner_native.stage_layouts(tables)
                self._context(sid, tables, phases, r_i, a_i, cap, ver)
        return len(self._tables) - before

    def _check_version(self) -> None:
        """Drop the caches of a superseded efficiency version: Pareto lists, group tables
        and bounds are keyed by it, and it only grows, so older entries can never be hit
        again (dropping them keeps a long job, a refinement every step, bounded). The
        compiled contexts are left to ``_context``'s bound instead: freeing one costs about
        as much as building it, so that is spread, one per new context."""
        ver = self.costmodel.version
        if ver != self._ver:
            self._pareto.clear()
            self._groups.clear()
            self._ginfo.clear()
            self._overlapped.clear()
            self._ver = ver

    def _on_refine(self) -> None:
        """The cost model was refined (a new ``version``): build the compiled context of
        the latest call's stage shapes at the new efficiencies now, with its partition
        keys on that call's device count, as part of the refinement. A job refines after
        every step and then decides, most often on the same bucket and devices: that
        decision finds them built. Same inputs as the call would use, so results are
        unchanged; a call on other shapes or devices builds what it needs as before."""
        last = self._last
        if last is None or not self.native:
            return
        sid, tables, phases, r_i, a_i, cap, pidx = last
        if cap != self.costmodel.capacity_bytes:
            return
        self._check_version()
        ctx = self._context(sid, tables, phases, r_i, a_i, cap, self._ver)
        warm = getattr(ctx, "warm", None)  # (a module built before it had none)
        if warm is not None:
            warm(pidx)

    def _shape(self, stages, sid: tuple[int, ...], actor, dtype: str):
        """What a call needs of its stages, kept per stage shapes: ``(phases, rollout
        index, actor_train index, stage tables)`` (-1: no such stage)."""
        shape = self._shapes.get(sid)
        if shape is None:
            if len(self._shapes) > 64:
                self._shapes.clear()
            names = [s.stage for s in stages]
            shape = self._shapes[sid] = (
                [s.phase for s in stages],
                names.index("rollout") if "rollout" in names else -1,
                names.index("actor_train") if "actor_train" in names else -1,
                [self._table(s, actor, dtype) for s in stages],
            )
        return shape

    def _stack(self, sid: tuple[int, ...], tables: list[_StageTable], r_i: int):
        """The stages' work matrices stacked (the rollout's intra-node sync variant in its
        slot, its inter-node one after the last stage) and each block's first row, so that
        one product prices them all. Both searches price from it (a row's product can
        differ in the last bit with its place in the matrix); kept per stage shapes."""
        got = self._stacks.get(sid)
        if got is None:
            works = [t.work("intra" if i == r_i else None) for i, t in enumerate(tables)]
            if r_i >= 0:
                works.append(tables[r_i].work("inter"))
            starts = [0]
            for W in works:
                starts.append(starts[-1] + len(W))
            if len(self._stacks) > 64:
                self._stacks.clear()
            # Fortran order: numpy's W @ x is cheaper on it here (see planner_native.price).
            got = self._stacks[sid] = (np.asfortranarray(np.concatenate(works)), starts)
        return got

    def plan(
        self, workload: Workload, *, devices: Iterable[int] | None = None, k: int = 1
    ) -> PlanResult:
        """The best plan for ``workload`` on ``devices`` (see module docstring).

        Arguments:
            workload: the step to plan.
            devices: available device ids (default: all of the cluster's).
            k: how many of the best plans to return in ``k_best``.

        Returns:
            PlanResult.

        Raises:
            PlanInfeasibleError: no plan fits memory; says the bytes needed per device.
            ValueError: k < 1, no devices, or a device id outside the cluster.
        """
        t0 = time.perf_counter()
        if k < 1:
            raise ValueError(f"k={k} must be >= 1")
        devs = _device_list(devices, self.cluster.num_devices)
        if not devs:
            raise ValueError("no devices available to plan on; pass at least one device id")
        if devs[0] < 0 or devs[-1] >= self.cluster.num_devices:
            raise ValueError(
                f"device ids must be in 0..{self.cluster.num_devices - 1} for {self.cluster.name}"
            )
        N = len(devs)
        self._check_version()
        ver = self._ver
        cap = self.costmodel.capacity_bytes
        got = self._wls.get(id(workload))
        if got is None or got[0] is not workload:
            got = self._workload_shape(workload)
        _, stages, sid, (phases, r_i, a_i, tables) = got
        dpn = self.cluster.devices_per_node
        # Nodes not a power of two wide: groups land across node boundaries as their
        # sizes fall, so the search prices each choice where it is placed (planner_placed).
        by_place = self.cluster.num_nodes > 1 and dpn & (dpn - 1) != 0
        args = (stages, tables, sid, r_i, a_i, cap, devs, ver, workload.dtype, by_place)
        cm = self.costmodel
        if workload.rollout_ahead:
            return self._plan_overlapped(workload, args, phases, k, t0)
        ranked, timings = self._ranked(phases, args, k)
        plans = [(obj, self._place(stages, tables, sid, picks, devs)) for obj, picks in ranked]
        timings["tables_ms"] += (timings.pop("_start") - t0) * 1e3
        if by_place:
            aligned = self._node_aligned(plans[0][1])
        else:
            # Placement is node-aligned when the devices are a run starting on a node
            # boundary (nodes a power of two wide).
            aligned = devs[-1] - devs[0] == N - 1 and devs[0] % dpn == 0
        if by_place or not aligned:
            # As step_latency prices them (the placed search's sums are the same up to
            # rounding; with holes in the devices, placed plans are priced as placed).
            plans = sorted(
                ((cm.step_total(p, workload), p) for _, p in plans), key=lambda lp: lp[0]
            )
        timings["total_ms"] = (time.perf_counter() - t0) * 1e3
        timings["aligned"] = aligned
        return PlanResult(plans[0][1], plans[0][0], tuple(plans), timings, cm, workload)

    def _plan_overlapped(self, workload: Workload, args: tuple, phases, k: int, t0: float):
        """``plan`` for an asynchronous workload (``planner.overlap_search``), seeded with
        the synchronous search's best plans. Kept per (stage shapes, efficiency version,
        capacity, devices, k): the search is a pure function of them, and a job asks the
        same question at every boundary until a signal or the model changes."""
        stages, tables, sid, r_i, _, cap, devs, ver, _, by_place = args
        N = len(devs)
        dkey = (devs[0], N) if isinstance(devs, range) else tuple(devs)
        key = (sid, ver, cap, dkey, k, workload.stage_order)
        got = self._overlapped.get(key)
        if got is None:
            ranked, timings = self._ranked(phases, args, k)
            timings["tables_ms"] += (timings.pop("_start") - t0) * 1e3
            seeds = [self._place(stages, tables, sid, picks, devs) for _, picks in ranked]
            plans, extra = overlap_search.search(
                self, workload, stages, tables, r_i, cap, devs, k, seeds, sid
            )
            for name, v in extra.items():
                timings[name] = timings.get(name, 0.0) + v
            dpn = self.cluster.devices_per_node
            timings["aligned"] = (
                self._node_aligned(plans[0][1])
                if by_place
                else devs[-1] - devs[0] == N - 1 and devs[0] % dpn == 0
            )
            if len(self._overlapped) >= 64:
                self._overlapped.clear()
            got = self._overlapped[key] = (tuple(plans), timings)
        plans, timings = got
        timings = dict(timings, total_ms=(time.perf_counter() - t0) * 1e3)
        return PlanResult(plans[0][1], plans[0][0], plans, timings, self.costmodel, workload)

    def _ranked(self, phases, args: tuple, k: int) -> tuple[list, dict]:
        """``([(objective, picks)] best first, timings)`` of the k best plans with each
        stage's time counted in ``phases`` (``args``: what ``plan`` gathered)."""
        stages, tables, sid, r_i, a_i, cap, devs, ver, dtype, by_place = args
        if by_place:
            return planner_placed.search(
                self, stages, tables, phases, r_i, a_i, cap, devs, k, ver, dtype
            )
        sargs = (stages, tables, sid, phases, r_i, a_i, cap, len(devs), k, ver)
        if self.native:
            return self._search_native(*sargs)
        return planner_reference.search(self, *sargs)

    def _node_aligned(self, plan: GlobalPlan) -> bool:
        """Whether every stage of ``plan`` gets the link tiers its layout implies (a tp
        group, pp chain or stage of at most a node's devices inside one node). The weight
        sync's tier follows: a group's devices are its widest stage's."""
        c = self.cluster
        dpn = c.devices_per_node
        for sp in plan.stages:
            ideal = (sp.tp > dpn, sp.tp * sp.pp > dpn, sp.dp * sp.tp * sp.pp > dpn)
            if tuple(t == "inter" for t in stage_tiers(c, sp)) != ideal:
                return False
        return True

    def _workload_shape(self, workload: Workload) -> tuple:
        """``(workload, planned stages, stage ids, _shape's tuple)``, kept per workload
        object (it holds the object, so its id is not reused while kept): a job plans
        the same few bucket workloads again and again (``Workload.with_response_len``
        returns the same object per bucket), and keying their stages by value costs
        more than the rest of a prepared call's Python."""
        stages = list(workload.planned_stages)
        actor = workload.stage("actor_train").model_spec
        dtype = workload.dtype
        sid = tuple(self._sid(s, actor, dtype) for s in stages)
        got = (workload, stages, sid, self._shape(stages, sid, actor, dtype))
        if len(self._wls) >= 64:
            self._wls.clear()
        self._wls[id(workload)] = got
        return got

    def _place(self, stages, tables, sid, picks, devs) -> GlobalPlan:
        """``place``, with whole plans kept per (stage shapes, choices, device run): a
        call whose signals changed often picks a plan an earlier call placed."""
        if devs[-1] - devs[0] != len(devs) - 1:
            return place(stages, tables, picks, devs, self._placed)
        key = (sid, tuple(picks), devs[0], len(devs))
        got = self._plans.get(key)
        if got is None:
            if len(self._plans) > 1024:
                self._plans.clear()
            got = self._plans[key] = place(stages, tables, picks, devs, self._placed)
        return got

    def _context(self, sid: tuple[int, ...], tables, phases, r_i, a_i, cap, ver):
        """The compiled search context of the stage shapes ``sid`` (their Pareto lists and
        the caches of later searches), kept per (version, capacity, stage shapes)."""
        ckey = (ver, cap, sid, tuple(phases))
        ctx = self._nctx.get(ckey)
        if ctx is None:
            if len(self._nctx) >= 8:  # the oldest first: a superseded version's, if any
                del self._nctx[next(iter(self._nctx))]
            c = self.cluster
            W, _ = self._stack(sid, tables, r_i)
            layouts = self._layouts.get(sid)
            if layouts is None:  # the tables' compiled layouts, marshalled once
                if len(self._layouts) > 64:
                    self._layouts.clear()
                layouts = self._layouts[sid] = planner_native.stage_layouts(tables)
            ctx = self._nctx[ckey] = planner_native.make_context_of(
                planner_native.price(W, self.costmodel._x),
                layouts,
                phases,
                r_i,
                a_i,
                cap,
                c.num_devices,
                c.devices_per_node,
                c.num_nodes == 1,
            )
        return ctx

    def _search_native(self, stages, tables, sid, phases, r_i, a_i, cap, N, k, ver):
        """The compiled search (``planner_native``): ``([(objective, picks)] best first,
        timings)``; its context is kept per (version, capacity, stage shapes)."""
        t0 = time.perf_counter()
        ctx = self._context(sid, tables, phases, r_i, a_i, cap, ver)
        t_ctx = time.perf_counter()
        pidx = self._pidx.get((len(stages), N))
        if pidx is None:
            pidx = planner_native.partition_index_of(len(stages), N)
            if len(self._pidx) > 32:
                self._pidx.clear()
            self._pidx[(len(stages), N)] = pidx
        ranked, nodes, nparts, bounds_ms, search_ms = ctx.search(pidx, k)
        self._last = (sid, tables, phases, r_i, a_i, cap, pidx)
        if not ranked:
            raise infeasible(stages, tables, N, cap)
        timings = {
            "_start": t0,
            "tables_ms": (t_ctx - t0) * 1e3,
            "bounds_ms": bounds_ms,
            "search_ms": search_ms,
            "nodes": nodes,
            "partitions": nparts,
        }
        return ranked, timings


_PLANNERS: dict = {}


def plan(
    workload: Workload,
    cluster: ClusterSpec,
    costmodel: CostModel,
    *,
    devices: Iterable[int] | None = None,
    k: int = 1,
) -> PlanResult:
    """The memory-feasible plan with the lowest predicted step latency (exact; see module).

    Calls with the same cluster and cost model share one :class:`Planner` and its caches.

    Arguments:
        workload: the RL step to plan.
        cluster: the cluster.
        costmodel: the cost model (its cluster should be ``cluster``).
        devices: available device ids (default: all).
        k: number of best plans to return.

    Returns:
        PlanResult.

    Raises:
        PlanInfeasibleError: nothing fits memory (message gives bytes needed vs capacity).
    """
    return planner_for(cluster, costmodel).plan(workload, devices=devices, k=k)


def planner_for(cluster: ClusterSpec, costmodel: CostModel) -> Planner:
    """The :class:`Planner` that :func:`plan` uses for this cluster and cost model (one
    per pair, caches kept), e.g. to :meth:`Planner.prepare` a job's buckets ahead."""
    key = (id(costmodel), cluster)
    p = _PLANNERS.get(key)
    if p is None or p.costmodel is not costmodel:
        if len(_PLANNERS) > 16:
            _PLANNERS.clear()
        p = _PLANNERS[key] = Planner(cluster, costmodel)
    return p
