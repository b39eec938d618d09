"""Exact planner: the memory-feasible GlobalPlan with the lowest predicted step latency.

Plan space (``N`` available devices):
    * each planned stage s gets a layout ``(dp, tp, pp)`` of powers of two, homogeneous
      within the stage, using ``d_s = dp * tp * pp`` devices;
    * the stages are partitioned into colocation groups; a group's stages all start at
      the group's first device (a stage uses the first ``d_s`` devices of its group), so
      the group spans ``n_G = max_{s in G} d_s`` devices and its stages' memory adds up
      on its first device; groups are on disjoint devices and ``sum_G n_G <= N``;
    * groups are placed in decreasing size at consecutive offsets, so every group (and
      every stage, unit, tp group) is aligned to its power-of-two size and never
      straddles a node boundary it need not cross. (When the available devices have
      holes, e.g. after a loss, groups are laid over the sorted survivors; alignment
      then is not guaranteed, and the returned latencies are re-priced as placed:
      ``timings["aligned"]`` says which case applied. Exactness is claimed for the
      aligned case.)

Objective (``CostModel.step_latency``): ``sum_p max_G T_{G,p}`` with
``T_{G,p} = sum_{s in G, phase p} t_s``; the rollout's time includes the weight sync,
intra-node iff rollout and actor_train share a group of at most one node.

Algorithm (exact branch and bound over three levels):
    1. Stage tables: for every stage and power of two ``n``, the Pareto list ``F_s(n)``
       of (time, memory) over layouts with ``d <= n`` that fit a device.
       Keeping only Pareto points is safe: replacing a stage's layout by one that is
       no slower and needs no more memory or devices keeps the plan feasible and does
       not increase any ``T_{G,p}`` (sums and maxima are monotone), hence the
       objective. Times are ``W @ (1/e)`` over a work matrix built once per stage
       shape; a refinement of the efficiencies only redoes the product.
    2. Group tables: for a group ``G`` and size ``n``, the Pareto set (over the vector
       ``(T_{G,0}, T_{G,1}, T_{G,2})``) of choices from ``F_s(n)`` whose memory sum fits
       a device, built stage by stage, pruning partial choices that are dominated in
       every phase time and in memory (dominance is preserved by adding the same
       remaining stages). When the group holds rollout and actor_train and
       ``n`` exceeds a node, only choices with some stage wider than a node are kept,
       so the sync tier the table assumes is the one the placed plan gets.
    3. Search: every set partition of the stages (Bell(6) = 203 at most), in order of
       a lower bound; depth-first over group sizes (largest first) and group vectors.
       Bounds use ``C_G(n)``: per phase, the sum over the group's stages of
       ``min F_s(n)`` (each stage's fastest layout with ``d <= n`` that fits a device
       alone; for the rollout the faster of its two sync variants). ``C_G(n)`` is at
       most any phase time of ``G`` at any size up to ``n``: ``F_s(n)`` holds every
       layout with ``d <= n`` and a group's choices are a subset of its stages'
       (joint memory and the width rule only remove choices). At each node the bound
       ``sum_p max(M_p, V_p, max_{G' left} C_{G',p}(n'))`` (``M``: phase maxima so
       far; ``V``: the candidate vector of the current group; ``n'``: the largest
       size the remaining devices allow each remaining group) is therefore valid, and
       maxima and sums are monotone. A group's table at size ``n`` (step 2, the
       costly part) is built only when ``sum_p max(M_p, C_{G,p}(n), rest_p)`` can
       still beat the incumbent. A node is pruned only when its bound is no better
       than the incumbent (the k-th best), so the returned plan attains the minimum
       of the objective over the plan space. The size loop ends when some stage of
       the group fits no layout up to ``n`` (or, for a group without rollout and
       actor_train, when its table at ``n`` is empty: ``F_s(m) ⊆ F_s(n)`` for
       ``m <= n``), or when ``sum_p max(M_p, C_{G,p}(n))`` alone cannot beat the
       incumbent (``C_G`` only grows as ``n`` shrinks).

``PlanResult.k_best`` lists the best distinct plans the search met, best first; the
first is the exact optimum, the others are the next best among plans whose stage
layouts are Pareto points (a plan that only swaps in a dominated layout is left out).

Caching across calls (``Planner``): work matrices per stage shape (the weight-sync
part per actor, shared by every bucket), time vectors per efficiency version, Pareto
and group tables per (shape, version, capacity); those of a superseded version are
dropped. A call after a signal change (new response bucket, devices lost) rebuilds
only what changed. Pricing every layout of a
new bucket's stages (``costmodel_work.stage_work``/``stage_memory``, plain Python) is
the largest part of a call after a bucket change; ``Planner.prepare`` does it ahead
for known buckets.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from nereus_rl.costmodel import CostModel, StepEstimate
from nereus_rl.globalplan import GlobalPlan, StagePlan, fmt_bytes
from nereus_rl.planner_tables import (
    _combine3,
    _pareto2,
    _partitions,
    _pow2floor,
    _prune3,
    _StageTable,
)
from nereus_rl.planner_tables import set_partitions as set_partitions  # public, re-exported
from nereus_rl.spec import ClusterSpec
from nereus_rl.workload import StageWork, Workload

_INF = math.inf


class PlanSpaceError(ValueError):
    """A plan outside the planner's plan space (a degree that is not a power of two)."""


def check_plan_space(plan: GlobalPlan) -> None:
    """Raise PlanSpaceError unless every stage's dp, tp and pp are powers of two.

    Raises:
        PlanSpaceError: names the stage and the degree.
    """
    for sp in plan.stages:
        for name in ("dp", "tp", "pp"):
            v = getattr(sp, name)
            if v & (v - 1):
                raise PlanSpaceError(
                    f"stage {sp.stage!r} has {name}={v}; the plan space needs powers of two "
                    "(1, 2, 4, ...): round it to one"
                )


class PlanInfeasibleError(ValueError):
    """No plan in the plan space fits device memory. Attributes give the figures.

    Attributes:
        needed_bytes: for each stage, the least bytes per device any layout needs.
        capacity_bytes: usable bytes per device.
        num_devices: devices available.
    """

    def __init__(self, msg: str, needed_bytes: dict[str, int], capacity_bytes: int, n: int):
        super().__init__(msg)
        self.needed_bytes = needed_bytes
        self.capacity_bytes = capacity_bytes
        self.num_devices = n


@dataclass(frozen=True)
class PlanResult:
    """The planner's answer.

    Attributes:
        plan: the best plan.
        latency_s: its predicted step latency.
        estimate: the cost model's full estimate of it (computed on first use).
        k_best: up to k (latency_s, plan) pairs, best first.
        timings: ``tables_ms``, ``search_ms``, ``total_ms``, ``nodes`` (search nodes),
            ``partitions`` (partitions searched).
    """

    plan: GlobalPlan
    latency_s: float
    k_best: tuple[tuple[float, GlobalPlan], ...] = field(repr=False)
    timings: dict[str, float] = field(repr=False)
    _costmodel: CostModel = field(repr=False, compare=False)
    _workload: Workload = field(repr=False, compare=False)

    @property
    def estimate(self) -> StepEstimate:
        est = self.__dict__.get("_estimate")
        if est is None:
            est = self._costmodel.step_latency(self.plan, self._workload)
            object.__setattr__(self, "_estimate", est)
        return est


class Planner:
    """Exact planner with caches that survive across calls (see the module docstring).

    Arguments:
        cluster: the cluster (device ids ``0 .. num_devices-1``).
        costmodel: prices plans; its ``version`` keys the time caches.
    """

    def __init__(self, cluster: ClusterSpec, costmodel: CostModel) -> None:
        self.cluster = cluster
        self.costmodel = costmodel
        self._tables: dict = {}
        self._times: dict = {}
        self._pareto: dict = {}
        self._groups: dict = {}
        self._ids: dict = {}
        self._ginfo: dict = {}
        self._sync: dict = {}
        self._ver = costmodel.version

    def _table(self, sw: StageWork, actor, dtype: str) -> _StageTable:
        key = (sw, actor, dtype)
        t = self._tables.get(key)
        if t is None:
            t = self._tables[key] = _StageTable(
                sw, actor, self.cluster, self.cluster.num_devices, dtype, self._sync
            )
        return t

    def prepare(self, workloads: Iterable[Workload]) -> int:
        """Build the stage tables of ``workloads`` ahead of the decisions that need them.

        A job knows its response-length bucket edges in advance; preparing one workload
        per bucket at start-up moves the per-layout work pricing (the largest part of a
        call after a bucket change) off the decision path. Results are unchanged.

        Arguments:
            workloads: the workloads (e.g. one per response bucket) to prepare.

        Returns:
            The number of stage tables built (those not already cached).
        """
        built = 0
        for w in workloads:
            actor = w.stage("actor_train").model_spec
            for s in w.planned_stages:
                key = (s, actor if s.stage == "rollout" else None, w.dtype)
                if key not in self._tables:
                    self._table(*key)
                    built += 1
        return built

    def _pareto_lists(self, key, table: _StageTable, variant: str | None, cap: int):
        """{n: [(t, mem, layout_idx, d), ...] sorted by time} for every size n."""
        ver = self.costmodel.version
        pk = (key, variant, ver, cap)
        got = self._pareto.get(pk)
        if got is not None:
            return got
        x = self.costmodel._x
        tk = (key, variant, ver)
        times = self._times.get(tk)
        if times is None:
            W = table.W if variant is None else table.W + table.sync[variant]
            times = self._times[tk] = W @ x
        # Plain floats and ints: the lists are short, numpy per element costs more.
        tl, ml = times.tolist(), table.mem_list
        out = {}
        prev: list = []
        n = 1
        while n <= self.cluster.num_devices:
            cand = prev + [(tl[i], ml[i], i, n) for i in table.by_d.get(n, ()) if ml[i] <= cap]
            cand.sort()
            front, best_mem = [], None
            for c in cand:
                if best_mem is None or c[1] < best_mem:
                    front.append(c)
                    best_mem = c[1]
            out[n] = front
            prev = front
            n *= 2
        self._pareto[pk] = out
        return out

    def _group_vecs(self, gkey, stage_lists, phases, n: int, thr: int, cap: int):
        """Pareto phase vectors of one group at size n: [(vec, choices)], or []."""
        k = (gkey, n, thr, cap, self.costmodel.version)
        got = self._groups.get(k)
        if got is not None:
            return got
        lists = [sl[n] for sl in stage_lists]
        if any(not lst for lst in lists):
            self._groups[k] = []
            return []
        # Fast path: every stage's fastest layout fits together.
        fast = [lst[0] for lst in lists]
        if sum(c[1] for c in fast) <= cap and (thr == 0 or any(c[3] > thr for c in fast)):
            vec = [0.0, 0.0, 0.0]
            for c, p in zip(fast, phases):
                vec[p] += c[0]
            res = [(tuple(vec), tuple(c[2] for c in fast))]
            self._groups[k] = res
            return res
        # Within a phase the times add: combine that phase's stages as 2-D (time, memory)
        # Pareto lists, keeping a second list of choices that satisfy the width flag.
        per_phase: dict[int, tuple[list, list]] = {}
        for pos, (lst, p) in enumerate(zip(lists, phases)):
            cur = per_phase.get(p, ([(0.0, 0, thr == 0, ())], []))
            cur_all = cur[0] if thr == 0 else cur[0] + [c for c in cur[1] if c not in cur[0]]
            cands = [
                (a[0] + t, a[1] + m, a[2] or d > thr, (*a[3], (pos, li)))
                for a in cur_all
                for t, m, li, d in lst
                if a[1] + m <= cap
            ]
            per_phase[p] = _pareto2(cands)
        empty = ([(0.0, 0, False, ())], [])
        P = [per_phase.get(p, empty) for p in range(3)]
        if thr == 0:
            combos = _combine3(P[0][0], P[1][0], P[2][0], cap)
        else:
            combos = []
            for star in per_phase:
                L = [P[p][1] if p == star else P[p][0] for p in range(3)]
                combos += _combine3(L[0], L[1], L[2], cap)
        final = _prune3(combos)
        res = sorted(
            ((v, tuple(li for _, li in sorted(ch))) for v, ch in final), key=lambda r: sum(r[0])
        )
        self._groups[k] = res
        return res

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
        devs = sorted(set(range(self.cluster.num_devices) if devices is None else devices))
        if not devs:
            raise ValueError("no devices available to plan on; pass at least one device id")
        if devs[0] < 0 or devs[-1] >= self.cluster.num_devices:
            raise ValueError(
                f"device ids must be in 0..{self.cluster.num_devices - 1} for {self.cluster.name}"
            )
        N = len(devs)
        if self.costmodel.version != self._ver:
            # Times, Pareto and group tables are keyed by the efficiency version, which
            # only grows: entries of older versions can never be hit again. Dropping them
            # keeps a long job (a refinement every step) from growing without bound.
            self._times.clear()
            self._pareto.clear()
            self._groups.clear()
            self._ginfo.clear()
            self._ver = self.costmodel.version
        cap = self.costmodel.capacity_bytes
        stages = list(workload.planned_stages)
        S = len(stages)
        actor = workload.stage("actor_train").model_spec
        names = [s.stage for s in stages]
        phases = [s.phase for s in stages]
        r_i = names.index("rollout") if "rollout" in names else -1
        a_i = names.index("actor_train") if "actor_train" in names else -1
        tables = [
            self._table(s, actor if s.stage == "rollout" else None, workload.dtype) for s in stages
        ]
        plain = [
            self._pareto_lists((s, workload.dtype), t, None, cap) if i != r_i else None
            for i, (s, t) in enumerate(zip(stages, tables))
        ]
        rvar = {}
        if r_i >= 0:
            for v in ("intra", "inter"):
                rvar[v] = self._pareto_lists((stages[r_i], workload.dtype), tables[r_i], v, cap)
        t_tables = time.perf_counter()

        dpn = self.cluster.devices_per_node
        one_node = self.cluster.num_nodes == 1
        # Small ints for stage shapes: cache keys then hash cheaply.
        sid = [self._ids.setdefault((s, workload.dtype), len(self._ids)) for s in stages]

        ver = self.costmodel.version
        # Group tables and bounds survive across calls: keyed by everything they depend on
        # (stage shapes via sid, the actor behind the rollout's sync, efficiencies, capacity).
        ckey = (ver, cap, actor, workload.dtype)
        ginfo = self._ginfo.get(ckey)
        if ginfo is None:
            if len(self._ginfo) > 8:
                self._ginfo.clear()
            ginfo = self._ginfo[ckey] = {}

        def gi(g: tuple[int, ...], n: int):
            """(Pareto vectors, whether no size up to n can fit) of group g at size n."""
            gkey = tuple(sid[i] for i in g)
            got = ginfo.get((gkey, n))
            if got is not None:
                return got
            both = r_i in g and a_i in g
            intra = both and (one_node or n <= dpn)
            thr = dpn if (both and not intra) else 0
            sl = [(rvar["intra" if intra else "inter"] if i == r_i else plain[i]) for i in g]
            vecs = self._group_vecs(gkey, sl, [phases[i] for i in g], n, thr, cap)
            # Empty: nothing fits at n; for a group without rollout and actor_train also
            # at no smaller size (F_s(m) is part of F_s(n) for m <= n, no width rule).
            stop = not vecs and not both
            ginfo[(gkey, n)] = got = (vecs, stop)
            return got

        # Cheap stage bounds for ordering and pruning partitions: a stage's fastest
        # layout with d <= n that fits a device alone (F_s(n) holds every d <= n, so this
        # bounds every size up to n; the rollout takes the faster of its sync variants).
        # Per phase their sum bounds any group of these stages from below, so partitions
        # whose bound cannot beat the incumbent never build their group tables.
        def smin(i: int, n: int) -> float:
            if i == r_i:
                a, b = rvar["intra"][n], rvar["inter"][n]
                if not a or not b:
                    return a[0][0] if a else (b[0][0] if b else _INF)
                return min(a[0][0], b[0][0])
            lst = plain[i][n]
            return lst[0][0] if lst else _INF

        cheap: dict = {}

        def cheap_lb(g: tuple[int, ...], n: int):
            got = cheap.get((g, n), cheap)
            if got is cheap:
                v = [0.0, 0.0, 0.0]
                for i in g:
                    v[phases[i]] += smin(i, n)
                got = cheap[(g, n)] = None if v[0] + v[1] + v[2] == _INF else tuple(v)
            return got

        parts = []
        for part in _partitions(S):
            if len(part) > N:
                continue
            nmax = _pow2floor(N - len(part) + 1)
            l0 = l1 = l2 = 0.0
            glbs = []
            for g in part:
                glb = cheap_lb(g, nmax)
                if glb is None:
                    break
                c0, c1, c2 = glb
                glbs.append((-(c0 + c1 + c2), g))
                if c0 > l0:
                    l0 = c0
                if c1 > l1:
                    l1 = c1
                if c2 > l2:
                    l2 = c2
            else:
                # Heavy groups first: the size loop prunes best when they come early.
                glbs.sort()
                parts.append((l0 + l1 + l2, [g for _, g in glbs]))
        parts.sort(key=lambda x: x[0])
        if not parts:
            raise self._infeasible(stages, tables, N, cap, workload.dtype)

        best: list = []  # max-heap of (-obj, counter, picks) with k entries
        seen: set = set()
        counter = [0, 0]

        thr = [_INF]  # objective to beat: the k-th best so far (inf until k found)

        def rec(part, i, rem, M, picks, rest_memo):
            counter[0] += 1
            ng = len(part)
            if i == ng:
                obj = M[0] + M[1] + M[2]
                key = tuple(sorted((part[j], picks[j][1]) for j in range(ng)))
                if key in seen or obj >= thr[0]:
                    return
                seen.add(key)
                heapq.heappush(best, (-obj, counter[1], list(zip(part, picks))))
                counter[1] += 1
                if len(best) > k:
                    heapq.heappop(best)
                if len(best) >= k:
                    thr[0] = -best[0][0]
                return
            g = part[i]
            left = ng - i - 1
            n = 1 << ((rem - left).bit_length() - 1)
            m0, m1, m2 = M
            while n >= 1:
                clb = cheap_lb(g, n)
                if clb is None:  # some stage fits no layout at n or at any smaller size
                    break
                rem2 = rem - n
                # Bound for the groups after i given rem2 devices (memoized per partition).
                n2 = 1 << ((rem2 - left + 1).bit_length() - 1) if left else 0
                rest = rest_memo.get((i, n2))
                if rest is None:
                    r0 = r1 = r2 = 0.0
                    if left:
                        for g2 in part[i + 1 :]:
                            lb2 = cheap_lb(g2, n2) if n2 >= 1 else None
                            if lb2 is None:
                                r0 = _INF
                                break
                            if lb2[0] > r0:
                                r0 = lb2[0]
                            if lb2[1] > r1:
                                r1 = lb2[1]
                            if lb2[2] > r2:
                                r2 = lb2[2]
                    rest = rest_memo[(i, n2)] = (r0, r1, r2)
                c0, c1, c2 = clb
                # C_G(n) only grows as n shrinks: once it alone (with M) cannot beat the
                # incumbent, no smaller size of this group can.
                if (m0 if m0 > c0 else c0) + (m1 if m1 > c1 else c1) + (
                    m2 if m2 > c2 else c2
                ) >= thr[0]:
                    break
                r0, r1, r2 = rest
                # The cheap bound of this group at n gates building its group table.
                if r0 == _INF:
                    n //= 2
                    continue
                b0 = m0 if m0 > r0 else r0
                b1 = m1 if m1 > r1 else r1
                b2 = m2 if m2 > r2 else r2
                if (b0 if b0 > c0 else c0) + (b1 if b1 > c1 else c1) + (
                    b2 if b2 > c2 else c2
                ) >= thr[0]:
                    n //= 2
                    continue
                vecs, stop = gi(g, n)
                if stop:
                    break
                for vec, ch in vecs:
                    a0 = m0 if m0 > vec[0] else vec[0]
                    a1 = m1 if m1 > vec[1] else vec[1]
                    a2 = m2 if m2 > vec[2] else vec[2]
                    lb = (a0 if a0 > r0 else r0) + (a1 if a1 > r1 else r1) + (a2 if a2 > r2 else r2)
                    if lb >= thr[0]:
                        continue
                    rec(part, i + 1, rem2, (a0, a1, a2), [*picks, (n, ch)], rest_memo)
                n //= 2

        nparts = 0
        for lb, part in parts:
            if lb >= thr[0]:
                break
            nparts += 1
            rec(part, 0, N, (0.0, 0.0, 0.0), [], {})
        if not best:
            raise self._infeasible(stages, tables, N, cap, workload.dtype)
        t_search = time.perf_counter()
        ranked = sorted(best, key=lambda e: -e[0])
        plans = [(-e[0], self._build(workload, stages, tables, e[2], devs)) for e in ranked]
        # Placement is node-aligned when the devices are a run starting on a node
        # boundary; otherwise (holes after a loss) price the placed plans as placed.
        aligned = devs == list(range(devs[0], devs[0] + N)) and devs[0] % dpn == 0
        if not aligned:
            plans = sorted(
                ((self.costmodel.step_latency(p, workload).total_s, p) for _, p in plans),
                key=lambda lp: lp[0],
            )
        t_end = time.perf_counter()
        timings = {
            "tables_ms": (t_tables - t0) * 1e3,
            "search_ms": (t_search - t_tables) * 1e3,
            "total_ms": (t_end - t0) * 1e3,
            "nodes": counter[0],
            "partitions": nparts,
            "aligned": aligned,
        }
        return PlanResult(plans[0][1], plans[0][0], tuple(plans), timings, self.costmodel, workload)

    def _build(self, workload, stages, tables, picks, devs) -> GlobalPlan:
        groups = []
        for g, (_, ch) in picks:
            lay = {i: tables[i].layouts[li] for i, li in zip(g, ch)}
            size = max(dp * tp * pp for dp, tp, pp in lay.values())
            groups.append((size, min(g), lay))
        groups.sort(key=lambda x: (-x[0], x[1]))
        out: dict[int, StagePlan] = {}
        off = 0
        for size, _, lay in groups:
            for i, (dp, tp, pp) in lay.items():
                sw = stages[i]
                w = tp * pp
                units = tuple(tuple(devs[off + u * w : off + (u + 1) * w]) for u in range(dp))
                out[i] = StagePlan(sw.stage, sw.model, sw.trains, dp, tp, pp, units)
            off += size
        return GlobalPlan(tuple(out[i] for i in range(len(stages))))

    def _infeasible(self, stages, tables, N, cap, dtype) -> PlanInfeasibleError:
        need = {}
        lines = []
        for sw, t in zip(stages, tables):
            ok = t.d <= N
            i = int(np.argmin(np.where(ok, t.mem, np.iinfo(np.int64).max)))
            need[sw.stage] = int(t.mem[i])
            dp, tp, pp = t.layouts[i]
            lines.append(f"{sw.stage}: {fmt_bytes(t.mem[i])}/device at best (dp{dp} tp{tp} pp{pp})")
        msg = (
            f"no plan fits memory on {N} devices of {fmt_bytes(cap)} usable each; "
            "least memory needed per device by stage: " + "; ".join(lines) + ". "
            "Add devices, use devices with more memory, or shrink batch/sequence length."
        )
        return PlanInfeasibleError(msg, need, cap, N)


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
    key = (id(costmodel), cluster)
    p = _PLANNERS.get(key)
    if p is None or p.costmodel is not costmodel:
        if len(_PLANNERS) > 16:
            _PLANNERS.clear()
        p = _PLANNERS[key] = Planner(cluster, costmodel)
    return p.plan(workload, devices=devices, k=k)
