"""The planner against brute force over its whole plan space, and against SCIP."""

import dataclasses
import itertools

import numpy as np
import pytest

from nereus_rl.core.globalplan import GlobalPlan, StagePlan
from nereus_rl.core.spec import cluster_preset
from nereus_rl.core.workload import make_workload
from nereus_rl.costmodel.costmodel import CostModel, stage_tiers
from nereus_rl.planner.place import place
from nereus_rl.planner.planner import (
    PlanInfeasibleError,
    Planner,
    PlanSpaceError,
    check_plan_space,
    plan,
    planner_for,
    set_partitions,
)


def brute_force(workload, cluster, cm, *, prune_dominated=False, N=None, per_partition=False):
    """Minimum objective over every (partition, layout per stage) with sum of widths <= N.

    Evaluates the objective formula directly; with ``prune_dominated`` a layout that is
    no faster, no smaller and no narrower than another of its stage is skipped (replacing
    it cannot make a plan worse: used only to keep the 5-stage case small). With
    ``per_partition`` returns ``{partition: minimum}`` instead (inf: nothing fits).
    """
    N = cluster.num_devices if N is None else N
    cap = cm.capacity_bytes
    pl = Planner(cluster, cm)
    stages = list(workload.planned_stages)
    actor = workload.stage("actor_train").model_spec
    x = cm.inverse_efficiencies
    names = [s.stage for s in stages]
    r, a = names.index("rollout"), names.index("actor_train")
    cands = []
    for s in stages:
        t = pl._table(s, actor if s.stage == "rollout" else None, workload.dtype)
        rows = []
        for i, (_dp, _tp, _pp) in enumerate(t.layouts):
            if t.d[i] > N or t.mem[i] > cap:
                continue
            if s.stage == "rollout":
                ts = {v: float((t.W[i] + t.sync[v][i]) @ x) for v in ("intra", "inter")}
            else:
                ts = {v: float(t.W[i] @ x) for v in ("intra", "inter")}
            rows.append((int(t.d[i]), int(t.mem[i]), ts))
        if prune_dominated:
            rows = [
                row
                for row in rows
                if not any(
                    o is not row
                    and o[0] <= row[0]
                    and o[1] <= row[1]
                    and o[2]["inter"] <= row[2]["inter"]
                    and o[2]["intra"] <= row[2]["intra"]
                    and (o[0], o[1], o[2]["inter"]) != (row[0], row[1], row[2]["inter"])
                    for o in rows
                )
            ]
        cands.append(rows)
    best = np.inf
    by_part = {}
    dpn, one = cluster.devices_per_node, cluster.num_nodes == 1
    for part in set_partitions(list(range(len(stages)))):
        part_best = np.inf
        for choice in itertools.product(*cands):
            widths = [max(choice[i][0] for i in g) for g in part]
            if sum(widths) > N:
                continue
            if any(sum(choice[i][1] for i in g) > cap for g in part):
                continue
            M = [0.0, 0.0, 0.0]
            for g, wdt in zip(part, widths):
                intra = one or (r in g and a in g and wdt <= dpn)
                T = [0.0, 0.0, 0.0]
                for i in g:
                    T[stages[i].phase] += choice[i][2]["intra" if intra else "inter"]
                M = [max(p, q) for p, q in zip(M, T)]
            part_best = min(part_best, sum(M))
        by_part[tuple(sorted(part))] = part_best
        best = min(best, part_best)
    return by_part if per_partition else best


@pytest.mark.parametrize(
    "cluster,kw",
    [
        ("h200x8", dict(algo="grpo", batch=64, group_size=4, response_len=2048)),
        ("h100x16", dict(algo="remax", batch=128, response_len=4096)),
        ("a100x32", dict(algo="grpo", batch=256, group_size=4, response_len=1024)),
        # memory-bound: 8B on 8 A100s must spread and cannot colocate everything
        ("a100x8", dict(algo="grpo", batch=64, group_size=4, response_len=4096)),
    ],
)
def test_equals_brute_force(cluster, kw):
    c = cluster_preset(cluster)
    cm = CostModel(c)
    w = make_workload(kw.pop("algo"), **kw)
    res = plan(w, c, cm)
    assert res.latency_s == pytest.approx(brute_force(w, c, cm), rel=1e-9)
    assert res.estimate.total_s == pytest.approx(res.latency_s, rel=1e-9)
    assert not cm.memory_violations(res.plan, w)
    assert all(s.is_pow2() for s in res.plan.stages)


def test_equals_brute_force_ppo_five_stages():
    c = cluster_preset("h100x4")
    cm = CostModel(c, efficiencies={"gemm": 0.5, "allreduce:intra": 0.8})
    w = make_workload("ppo", actor="medium", batch=64, prompt_len=256, response_len=512)
    res = plan(w, c, cm)
    assert res.latency_s == pytest.approx(brute_force(w, c, cm, prune_dominated=True), rel=1e-9)


def test_k_best_and_devices_subset():
    c = cluster_preset("h200x32")
    cm = CostModel(c)
    w = make_workload("ppo", reward="llama-3.1-8b", batch=256)
    res = plan(w, c, cm, k=4)
    lats = [lat for lat, _ in res.k_best]
    assert len(lats) == 4 and lats == sorted(lats) and lats[0] == res.latency_s
    assert len({p for _, p in res.k_best}) == 4
    for lat, p in res.k_best:
        assert cm.step_latency(p, w).total_s == pytest.approx(lat, rel=1e-9)
    sub = plan(w, c, cm, devices=range(16))
    assert sub.plan.devices <= set(range(16)) and sub.latency_s >= res.latency_s


def test_infeasible_says_memory_needed():
    c = cluster_preset("h100x1")
    w = make_workload("grpo", actor="llama-3.1-70b", batch=8)
    with pytest.raises(PlanInfeasibleError, match=r"rollout: [0-9.]+ GiB/device at best") as e:
        plan(w, c, CostModel(c))
    assert e.value.needed_bytes["actor_train"] > e.value.capacity_bytes
    with pytest.raises(ValueError, match="device ids"):
        plan(w, cluster_preset("h100x8"), CostModel(cluster_preset("h100x8")), devices=[9])


def test_matches_scip_on_random_instances():
    pytest.importorskip("ortools")
    from nereus_rl.baselines.planner_milp import solve_scip

    rng = np.random.default_rng(7)
    for cluster, algo in (("h200x8", "grpo"), ("h100x16", "remax"), ("h100x8", "ppo")):
        c = cluster_preset(cluster)
        eff = {k: float(rng.uniform(0.2, 0.9)) for k in ("gemm", "attention", "mem")}
        cm = CostModel(c, efficiencies=eff)
        kw = dict(batch=int(rng.choice([32, 64, 128])), response_len=int(rng.choice([512, 2048])))
        if algo == "grpo":
            kw["group_size"] = 4
        w = make_workload(algo, **kw)
        res = plan(w, c, cm)
        milp = solve_scip(w, c, cm, time_limit_s=60)
        assert milp.proven, milp
        assert res.latency_s == pytest.approx(milp.objective_s, rel=1e-6)


def test_plan_space_and_holes():
    with pytest.raises(PlanSpaceError, match="tp=3"):
        check_plan_space(GlobalPlan((StagePlan("rollout", "actor", False, 1, 3, 1, ((0, 1, 2),)),)))
    c = cluster_preset("h200x16")
    cm = CostModel(c)
    w = make_workload("grpo", batch=64, group_size=4)
    res = plan(w, c, cm, devices=set(range(16)) - {3})
    assert res.timings["aligned"] is False and 3 not in res.plan.devices
    assert res.latency_s == pytest.approx(cm.step_latency(res.plan, w).total_s)
    check_plan_space(res.plan)


def test_persistent_caches_and_prepare_match_fresh_planner():
    """A planner reused across signal changes (and one prepared ahead) decides exactly as
    a fresh planner does, call by call, including after efficiency refinements."""
    c = cluster_preset("h200x32")
    cm = CostModel(c)
    base = make_workload("ppo", reward="llama-3.1-8b", batch=64, response_len=2048)
    # The default search (compiled when built) and the Python reference.
    kept, prepared, kept_py = Planner(c, cm), Planner(c, cm), Planner(c, cm, native=False)
    buckets = (1024, 2048, 4096)
    assert prepared.prepare(base.with_response_len(b) for b in buckets) == 3 * 6
    assert prepared.prepare([base]) == 0
    signals = [(2048, 0, False), (4096, 0, False), (4096, 8, False), (1024, 8, True)]
    signals += [(2048, 0, False), (2048, 16, True), (4096, 0, False)]
    for resp, lost, refine in signals:
        if refine:
            cm.observe_work({"gemm": 1.0, "mem": 0.5, "allreduce:intra": 0.1}, 3.1)
        w = base.with_response_len(resp)
        devs = range(32 - lost)
        fresh = Planner(c, cm).plan(w, devices=devs, k=3)
        for p in (kept, prepared, kept_py):
            got = p.plan(w, devices=devs, k=3)
            assert got.latency_s == fresh.latency_s
            assert [lat for lat, _ in got.k_best] == [lat for lat, _ in fresh.k_best]
    assert len(prepared._tables) == 3 * 6  # every call found its stage tables prepared
    # Tables of superseded efficiency versions are dropped, not accumulated.
    assert kept_py._pareto and all(key[-2] == cm.version for key in kept_py._pareto)
    assert kept_py._ginfo and all(key[0] == cm.version for key in kept_py._ginfo)
    assert all(key[-1] == cm.version for key in kept_py._groups)
    if kept.native:
        # Compiled contexts: bounded (the oldest dropped first), the current version's kept;
        # prepare built the buckets' contexts at the version it ran under.
        assert any(key[0] == cm.version for key in kept._nctx) and len(kept._nctx) <= 8
        p2 = Planner(c, cm)
        p2.prepare(base.with_response_len(b) for b in buckets)
        assert len(p2._nctx) == 3 and all(key[0] == cm.version for key in p2._nctx)
        for _ in range(12):  # one new context per version: never more than 8 kept
            cm.observe_work({"gemm": 1.0, "mem": 0.5, "allreduce:intra": 0.1}, 3.1)
            p2.plan(base, devices=range(32))
        assert len(p2._nctx) == 8 and (cm.version, cm.capacity_bytes) in {
            key[:2] for key in p2._nctx
        }


def test_refinement_builds_the_latest_calls_context_ahead():
    """A refinement builds the compiled context of the latest call's stage shapes at the
    new efficiencies; the next call on them uses it and decides as the reference does."""
    c = cluster_preset("h200x32")
    cm = CostModel(c)
    w = make_workload("ppo", reward="llama-3.1-8b", batch=64, response_len=2048)
    p, ref = Planner(c, cm), Planner(c, cm, native=False)
    if not p.native:
        pytest.skip("nereus_rl._native is not built")
    for refine in (False, True, True):
        if refine:
            cm.observe_work({"gemm": 1.0, "mem": 0.5, "allreduce:intra": 0.1}, 3.1)
            built = [key for key in p._nctx if key[0] == cm.version]
            assert len(built) == 1  # by the refinement, before any call
            ctx = p._nctx[built[0]]
        got, want = p.plan(w, devices=range(24), k=3), ref.plan(w, devices=range(24), k=3)
        if refine:
            # the call used it, and built none: one context per version so far
            assert p._nctx[built[0]] is ctx and len(p._nctx) == 1 + cm.version
        assert got.plan == want.plan and got.latency_s == want.latency_s
        assert [lat for lat, _ in got.k_best] == [lat for lat, _ in want.k_best]
    assert not ref._nctx  # the Python reference builds no compiled context


@pytest.mark.parametrize("cluster,lost", [("a100x8", 0), ("h100x16", 3), ("h200x8", 2)])
def test_random_efficiencies_and_device_losses_equal_brute_force(cluster, lost):
    """Optima under random efficiencies on fewer devices (multi-group optima included)."""
    rng = np.random.default_rng(11 + lost)
    c = cluster_preset(cluster)
    N = c.num_devices - lost
    for _ in range(3):
        eff = {k: float(rng.uniform(0.1, 1.0)) for k in ("gemm", "attention", "mem", "launch")}
        cm = CostModel(c, efficiencies=eff)
        w = make_workload(
            "grpo",
            batch=int(rng.choice([32, 64, 256])),
            group_size=4,
            response_len=int(rng.choice([512, 2048, 8192])),
        )
        res = Planner(c, cm).plan(w, devices=range(N))
        assert res.latency_s == pytest.approx(brute_force(w, c, cm, N=N), rel=1e-9)
        assert res.latency_s == pytest.approx(cm.step_latency(res.plan, w).total_s, rel=1e-9)


def test_partition_bounds_never_exceed_the_partitions_best():
    """The cheap bound of every partition is at most its best plan (brute force)."""
    from nereus_rl.planner.bounds import partition_bounds_of as _partition_bounds

    c = cluster_preset("a100x8")  # memory-bound: the bound must ignore memory soundly
    cm = CostModel(c, efficiencies={"gemm": 0.4, "mem": 0.7})
    w = make_workload("grpo", batch=64, group_size=4, response_len=4096)
    pl = Planner(c, cm, native=False)  # reads the Python search's bounds
    for N in (8, 6, 5):
        exact = brute_force(w, c, cm, N=N, per_partition=True)
        if min(exact.values()) == np.inf:  # 5 devices: nothing fits, the planner says so
            with pytest.raises(PlanInfeasibleError):
                pl.plan(w, devices=range(N))
        else:
            assert pl.plan(w, devices=range(N)).latency_s == pytest.approx(min(exact.values()))
        (_, _, bounds) = next(iter(pl._ginfo.values()))
        _, lbs = bounds[N]
        pb = _partition_bounds(len(w.planned_stages), N)
        assert len(pb.parts) == len(exact)
        for part, lb in zip(pb.parts, lbs):
            assert lb <= exact[tuple(sorted(part))] * (1 + 1e-12), (part, lb)


def test_place_units_cache_is_keyed_by_first_device_size_and_width():
    """``place`` shares unit tuples across stages and calls through its cache; each
    placement must equal an uncached one when only the first device, the stage's device
    count or its unit width changes (a key missing one of them would hand back another
    slice's units)."""
    c = cluster_preset("h200x32")
    w = make_workload("ppo", reward="llama-3.1-8b", batch=64, response_len=2048)
    p = Planner(c, CostModel(c))
    stages = list(w.planned_stages)
    actor = w.stage("actor_train").model_spec
    tables = [p._table(s, actor, w.dtype) for s in stages]
    lay = {L: i for i, L in enumerate(tables[0].layouts)}
    g = (0,)
    cache: dict = {}
    # (layout of stage 0, device run): same size and width at a new first device, a new
    # size at the same first device, a new width at the same size and first device.
    cases = [((8, 1, 1), range(0, 8)), ((8, 1, 1), range(8, 16)), ((16, 1, 1), range(8, 24))]
    cases += [((4, 2, 1), range(8, 16)), ((2, 2, 2), range(8, 16)), ((8, 1, 1), range(8, 16))]
    for (dp, tp, pp), devs in cases:
        if (dp, tp, pp) not in lay:
            continue
        picks = [(g, (lay[(dp, tp, pp)],))]
        got = place(stages[:1], tables[:1], picks, devs, cache).stages[0]
        want = place(stages[:1], tables[:1], picks, devs, None).stages[0]
        assert got.units == want.units and got == want
        assert got.units == tuple(tuple(devs[u * tp * pp : (u + 1) * tp * pp]) for u in range(dp))
    assert any(k[0] == "units" for k in cache)


def test_prepare_marshals_the_compiled_layouts():
    """``prepare`` builds each table's compiled layouts, so a prepared call only prices."""
    c = cluster_preset("h200x32")
    p = Planner(c, CostModel(c))
    if not p.native:
        pytest.skip("nereus_rl._native has no planner search")
    w = make_workload("ppo", reward="llama-3.1-8b", batch=64, response_len=2048)
    p.prepare([w])
    assert p._tables and all("_native" in t.__dict__ for t in p._tables.values())


def test_planner_for_is_the_planner_plan_uses():
    """The trainer prepares its buckets on ``planner_for``'s planner; ``plan`` must use that
    same planner (else the preparation is lost), and a new cost model gets a new one."""
    c = cluster_preset("h200x32")
    cm = CostModel(c)
    p = planner_for(c, cm)
    assert planner_for(c, cm) is p
    w = make_workload("ppo", reward="llama-3.1-8b", batch=64, response_len=2048)
    p.prepare([w])
    built = len(p._tables)
    res = plan(w, c, cm)
    assert len(p._tables) == built  # served from the prepared tables, none built
    assert res.plan == Planner(c, CostModel(c)).plan(w).plan
    assert planner_for(c, CostModel(c)) is not p


def brute_force_placed(workload, cluster, cm, devices=None):
    """Every plan of the plan space (a partition, a layout per stage; group sizes, the
    widest layout of each group, summing to at most the devices; each group's memory
    within a device), placed by ``place`` and priced by ``CostModel.step_total``: the
    sorted latencies of them all."""
    devs = list(range(cluster.num_devices)) if devices is None else sorted(devices)
    N, cap = len(devs), cm.capacity_bytes
    pl = Planner(cluster, cm)
    stages = list(workload.planned_stages)
    actor = workload.stage("actor_train").model_spec
    tables = [pl._table(s, actor, workload.dtype) for s in stages]
    cands = [[i for i in range(len(t.layouts)) if t.d[i] <= N and t.mem[i] <= cap] for t in tables]
    out = []
    for part in set_partitions(list(range(len(stages)))):
        for ch in itertools.product(*cands):
            widths = [max(int(tables[i].d[ch[i]]) for i in g) for g in part]
            if sum(widths) > N:
                continue
            if any(sum(int(tables[i].mem[ch[i]]) for i in g) > cap for g in part):
                continue
            picks = [(g, tuple(ch[i] for i in g)) for g in part]
            out.append(cm.step_total(place(stages, tables, picks, devs), workload))
    return sorted(out)


def _odd_nodes(base: str, n: int, dpn: int):
    """A legal ClusterSpec of ``n`` devices in nodes of ``dpn`` (not a preset's 8)."""
    return dataclasses.replace(
        cluster_preset(base), num_devices=n, devices_per_node=dpn, name=f"{base}:{n}/{dpn}"
    )


def _node_aligned(cluster, plan):
    """Whether every stage gets the tiers its layout implies (tp group, pp chain, stage of
    a node's devices or fewer inside one node)."""
    dpn = cluster.devices_per_node
    for sp in plan.stages:
        ideal = (sp.tp > dpn, sp.tp * sp.pp > dpn, sp.dp * sp.tp * sp.pp > dpn)
        if tuple(t == "inter" for t in stage_tiers(cluster, sp)) != ideal:
            return False
    return True


@pytest.mark.parametrize(
    "base,n,dpn,algo,kw,devices",
    [
        ("h100x8", 6, 3, "grpo", dict(group_size=4, response_len=2048), None),
        ("h100x8", 12, 3, "grpo", dict(group_size=4, response_len=1024), None),
        ("h100x8", 12, 6, "remax", dict(response_len=2048), None),
        # memory-bound: rollout and actor_train share a group wider than a node of 6, so
        # the sync's tier rule applies at sizes on both sides of the node's width
        ("a100x8", 12, 6, "grpo", dict(group_size=4, response_len=8192), None),
        ("h100x8", 12, 3, "grpo", dict(group_size=4, response_len=4096), [0, 1, 2, 4, 5, 6, 8]),
    ],
)
def test_nodes_not_a_power_of_two_equal_brute_force_as_placed(base, n, dpn, algo, kw, devices):
    """With nodes of 3 or 6 devices, groups may straddle nodes where ``place`` lays them:
    the planner's optimum is the brute-force optimum priced as placed, every k-best entry
    is priced as ``step_latency`` prices it, the compiled and Python searches agree, and
    ``timings["aligned"]`` is true only when the placement is node-aligned."""
    c = _odd_nodes(base, n, dpn)
    cm = CostModel(c)
    w = make_workload(algo, batch=64, **kw)
    want = brute_force_placed(w, c, cm, devices)
    results = [Planner(c, cm, native=nat).plan(w, devices=devices, k=4) for nat in (None, False)]
    for res in results:
        assert res.latency_s == pytest.approx(want[0], rel=1e-12)
        lats = [lat for lat, _ in res.k_best]
        assert lats == sorted(lats) and lats[0] == res.latency_s
        for lat, p in res.k_best:
            assert lat == cm.step_latency(p, w).total_s
            assert not cm.memory_violations(p, w)
            check_plan_space(p)
            if devices is not None:
                assert p.devices <= set(devices)
        assert res.timings["aligned"] == _node_aligned(c, res.plan)
    a, b = results
    assert a.plan == b.plan and [x for x in a.k_best] == [x for x in b.k_best]
