"""The exact planner's search for an asynchronous workload (``Workload.rollout_ahead``):
the plans with the lowest overlapped step, as ``CostModel.step_latency`` prices it
(``costmodel.overlap.overlapped_step``), over the planner's plan space.

Why a search of its own: the synchronous objective is a sum over phases of the groups'
maxima, which the Pareto lists and partition bounds of ``planner_search`` order. The
overlapped step is not: the next step's rollout runs beside this step's inference and
training, so a plan that gives the rollout devices of its own hides the others behind
it, and what a stage costs depends on which stages share its devices.

Structure used (``planner.place``): groups lie on disjoint devices and every stage of a
group starts at the group's first device, so the stages of a group run one after
another in the order they are sent (rollout, inference, training); training waits for
every inference stage. With stage times ``t`` (each alone; the rollout's without the
weight sync) and per group ``R`` (its rollout), ``I`` (its inference) and ``T`` (its
training), ``D = max_G (R_G + I_G)`` over groups with inference, the step on devices of
their own (GPUs) is

    sync + max( max_G (R_G + I_G),  max_{G: T_G > 0} (max(D, R_G + I_G) + T_G) )

On local CPU workers sharing the cores, stages that run at once slow each other
(processor sharing), never speed each other up, so the same expression with each
stage's own time is a lower bound there, and so is the cores' work: a stage of ``d``
workers uses ``min(d, C) * t`` core-seconds whatever runs beside it, so the step is at
least ``sync + sum min(d_s, C) t_s / C``.

Search: depth first over the stages (rollout first, then training, then inference),
each joining a group already opened or opening one (each set partition once), with
every layout that fits (devices, memory), fastest first. A node is pruned when its
lower bound (the expressions above with the stages not yet placed at their fastest
layout, the sync at its cheaper tier) exceeds the k-th best step found. A complete
choice is placed (``planner.place``) and priced by ``CostModel.step_total`` itself;
node-aligned on GPUs, where the chain expression is the step, choices are kept by it and
only the k best are placed and priced at the end. Every latency returned is the model's
float for that plan. The search starts from the
synchronous search's best plans, priced the same way, so the first bound is tight.

Dominance, used only where it is exact: on devices of their own, with the placement
node-aligned (devices a run from a node boundary, nodes a power of two wide or one
node), the step is monotone in every stage's time and in nothing else of its layout
but its devices and memory (feasibility) and, for the rollout, the sync's seconds at
each tier; a layout no better in all of those is dropped. On shared cores a layout's
width also changes how fast the stages beside it run, so nothing is dropped there.

``k_best`` lists the best distinct plans found, best first; the first is the optimum
(ties at the model's float resolution may pick either). Plain Python: it runs in both
``native`` modes, so they agree.
"""

from __future__ import annotations

import heapq
import math
import time

import numpy as np

from nereus_rl.core.spec import LocalCpuClusterSpec
from nereus_rl.planner.place import infeasible

_INF = math.inf
# A node is searched only if its bound is below the k-th best by more than this share:
# plans tied with it (the overlapped step has plateaus: every arrangement of the other
# stages that the rollout hides costs the same) are not searched one by one; a plan
# better by less than this share may be missed, within the model's float resolution.
_TIE = 1.0 - 1e-12


def _pareto(cands: list[tuple]) -> list[tuple]:
    """The entries of ``cands`` (``(key..., layout)``) not dominated in every key by
    another (no other entry with every key at most its own and one below); of entries
    with equal keys, the first."""
    if len(cands) < 2:
        return list(cands)
    K = np.array([c[:-1] for c in cands], dtype=float)
    le = (K[:, None, :] <= K[None, :, :]).all(axis=2)  # le[j, i]: j's keys all <= i's
    lt = (K[:, None, :] < K[None, :, :]).any(axis=2)
    dominated = (le & lt).any(axis=0)
    # equal keys: keep the first of each
    eq = le & le.T
    first = np.argmax(eq, axis=0)
    keep = ~dominated & (first == np.arange(len(cands)))
    return [c for c, k in zip(cands, keep.tolist()) if k]


def search(pl, workload, stages, tables, r_i, cap, devs, k, seeds, sid) -> tuple[list, dict]:
    """The k best plans of an asynchronous ``workload``: ``([(step seconds, GlobalPlan)]
    best first, timings)``.

    Arguments:
        pl: the planner (cluster, cost model, placement caches).
        workload: the asynchronous workload (``rollout_ahead``).
        stages, tables: its planned stages and their stage tables.
        r_i: index of the rollout (-1: none).
        cap: usable bytes per device.
        devs: sorted available device ids.
        k: how many plans to return.
        seeds: plans to price first (the synchronous search's best): a tight first bound.
        sid: the stages' shape ids (keys ``Planner._place``'s cache).

    Raises:
        PlanInfeasibleError: nothing fits memory.
    """
    t0 = time.perf_counter()
    cm = pl.costmodel
    c = pl.cluster
    N = len(devs)
    S = len(stages)
    cores = float(c.cores) if isinstance(c, LocalCpuClusterSpec) else None
    one_node = c.num_nodes == 1
    dpn = c.devices_per_node
    aligned = devs[-1] - devs[0] == N - 1 and (
        one_node or (dpn & (dpn - 1) == 0 and devs[0] % dpn == 0)
    )
    x = cm._x
    phase = [s.phase for s in stages]

    # Each stage's candidate layouts: (time, memory, devices, layout) fastest first.
    cands: list[list[tuple]] = []
    sync_lb: dict[int, float] = {}
    sync_at: dict[int, tuple[float, float]] = {}  # layout -> (intra, inter) seconds
    a_i = next((i for i, s in enumerate(stages) if s.stage == "actor_train"), -1)
    prune = cores is None and aligned
    cache = pl.__dict__.setdefault("_overlap_rows", {})
    if len(cache) > 256:
        cache.clear()
    for i, t in enumerate(tables):
        # A stage's candidates depend on its table, the efficiencies, the capacity, the
        # device count and whether dominated layouts may go: kept across calls (a job
        # plans the same few bucket shapes again and again).
        ckey = (sid[i], i == r_i, cm.version, cap, N, one_node, prune)
        got = cache.get(ckey)
        if got is None:
            secs = (t.W @ x).tolist()
            rows, s_lb, s_at = [], {}, {}
            for li, (d, m) in enumerate(zip(t.d.tolist(), t.mem_list)):
                if d > N or m > cap:
                    continue
                if i == r_i and t.sync:
                    si = float(t.sync["intra"][li] @ x)
                    se = float(t.sync["inter"][li] @ x)
                    s_lb[li] = si if one_node else min(si, se)
                    s_at[li] = (si, se)
                    key = (secs[li], si, se, m, d, li)
                else:
                    key = (secs[li], m, d, li)
                rows.append(key)
            if prune:
                rows = _pareto(rows)
            rows.sort()
            got = cache[ckey] = ([(r[0], r[-3], r[-2], r[-1]) for r in rows], s_lb, s_at)
        cands.append(got[0])
        if i == r_i:
            sync_lb.update(got[1])
            sync_at.update(got[2])
    if any(not r for r in cands):
        raise infeasible(stages, tables, N, cap)
    tmin = [r[0][0] for r in cands]
    cmin = [min(min(d, cores) * tt for tt, _, d, _ in r) for r in cands] if cores else None
    sync_all = min(sync_lb.values()) if sync_lb else 0.0

    # Node-aligned on devices of their own, a complete choice's step is the chain
    # expression itself (the stage tables price the tiers the placement gives): the
    # search keeps choices by it and only the k best are placed and priced by the
    # model at the end (pricing a plan builds its stages' tiers, O(devices) each).
    # Elsewhere (shared cores, holes, odd nodes) every complete choice is placed and
    # priced by the model as it is found.
    fast = cores is None and aligned
    keep = k + len(seeds) if fast else k  # a seed may come back as a choice: room for both
    heap: list = []  # (-seconds, n, plan or picks): the best so far, worst on top
    priced: set = set()
    counter = [0, 0]  # nodes, plans priced

    def push(v: float, item) -> None:
        counter[1] += 1
        entry = (-v, counter[1], item)
        if len(heap) < keep:
            heapq.heappush(heap, entry)
        elif v < -heap[0][0]:
            heapq.heapreplace(heap, entry)

    def offer(plan) -> None:
        if plan not in priced:
            priced.add(plan)
            push(cm.step_total(plan, workload), plan)

    for p in seeds:
        offer(p)

    def kth() -> float:
        return -heap[0][0] * _TIE if len(heap) >= keep else _INF

    order = sorted(range(S), key=lambda i: (i != r_i, -phase[i], i))
    # group state: [members, choices, width, memory, R, I, T]
    groups: list[list] = []
    choice = [-1] * S
    core_used = [0.0]

    def bound(depth: int) -> float:
        placed = set(order[:depth])
        D = 0.0
        for g in groups:
            if g[5] > 0.0 or any(phase[i] == 1 for i in g[0]):
                D = max(D, g[4] + g[5])
        for i in order[depth:]:
            if phase[i] == 1:
                D = max(D, tmin[i])
        end = D
        for g in groups:
            ri = g[4] + g[5]
            end = max(end, ri)
            if g[6] > 0.0:
                end = max(end, max(D, ri) + g[6])
        for i in order[depth:]:
            if phase[i] == 2:
                end = max(end, D + tmin[i])
            else:
                end = max(end, tmin[i])
        sync = sync_all
        if r_i >= 0 and r_i in placed:
            li = choice[r_i]
            sync = sync_lb.get(li, 0.0)
            if aligned and not one_node and a_i in placed and li in sync_at:
                # Node-aligned: the sync is intra-node iff rollout and actor_train share
                # a group of at most a node's devices (CostModel._build_stage_works).
                g = next(g for g in groups if r_i in g[0])
                intra = a_i in g[0] and g[2] <= dpn
                sync = sync_at[li][0 if intra else 1]
        lb = end + sync
        if cores is not None:
            work = core_used[0] + sum(cmin[i] for i in order[depth:])
            lb = max(lb, work / cores + sync)
        return lb

    def leaf() -> None:
        picks = []
        for g in groups:
            mem = sorted(g[0])
            picks.append((tuple(mem), tuple(choice[i] for i in mem)))
        picks.sort()
        if fast:
            key = tuple(picks)
            if key not in priced:
                priced.add(key)
                push(bound(S), key)
        else:
            offer(pl._place(stages, tables, sid, picks, devs))

    def dfs(depth: int, width_used: int) -> None:
        counter[0] += 1
        if depth == S:
            leaf()
            return
        i = order[depth]
        ph = phase[i]
        # On devices of their own the bound grows with this stage's time in a given
        # group, and the layouts come fastest first: a group (or a new one) pruned at
        # one layout stays pruned for the slower ones (not the rollout: its sync's
        # seconds differ by layout; not on shared cores: the core bound reads widths).
        monotone = cores is None and i != r_i
        dead: set[int] = set()
        for tt, m, d, li in cands[i]:
            if monotone and len(dead) > len(groups):
                break
            choice[i] = li
            core_used[0] += min(d, cores) * tt if cores else 0.0
            for gi in range(len(groups) + 1):
                if gi in dead:
                    continue
                new = gi == len(groups)
                if new:
                    if width_used + d > N:
                        continue
                    g = [[i], [li], d, m, 0.0, 0.0, 0.0]
                    groups.append(g)
                    new_used = width_used + d
                else:
                    g = groups[gi]
                    w = max(g[2], d)
                    if width_used - g[2] + w > N or g[3] + m > cap:
                        continue
                    new_used = width_used - g[2] + w
                    g[0].append(i)
                    g[1].append(li)
                    g.append((g[2], g[3]))
                    g[2], g[3] = w, g[3] + m
                slot = 4 + ph
                g[slot] += tt
                if bound(depth + 1) < kth():
                    dfs(depth + 1, new_used)
                elif monotone:
                    dead.add(gi)
                g[slot] -= tt
                if new:
                    groups.pop()
                else:
                    g[0].pop()
                    g[1].pop()
                    g[2], g[3] = g.pop()
            core_used[0] -= min(d, cores) * tt if cores else 0.0
        choice[i] = -1

    t1 = time.perf_counter()
    dfs(0, 0)
    if not heap:
        raise infeasible(stages, tables, N, cap)
    ranked, seen = [], set()
    for v, n, item in sorted(heap, key=lambda e: (-e[0], e[1])):
        if isinstance(item, tuple):  # a choice kept by its chain expression: now placed
            item = pl._place(stages, tables, sid, list(item), devs)
            if item in seen:
                continue
            v = -cm.step_total(item, workload)
        elif item in seen:
            continue
        seen.add(item)
        ranked.append((-v, n, item))
    ranked.sort(key=lambda e: (e[0], e[1]))
    ranked = ranked[:k]
    timings = {
        "tables_ms": (t1 - t0) * 1e3,
        "bounds_ms": 0.0,
        "search_ms": (time.perf_counter() - t1) * 1e3,
        "nodes": counter[0],
        "partitions": 0,
        "priced": counter[1],
    }
    return [(v, p) for v, _, p in ranked], timings
