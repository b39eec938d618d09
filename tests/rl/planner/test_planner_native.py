"""The compiled planner search (nereus_rl._native) against the Python reference: the same
plans, objectives (bit for bit), k-best order, node counts and bounds, call by call."""

import numpy as np
import pytest

from nereus_rl.core.spec import cluster_preset
from nereus_rl.core.workload import make_workload
from nereus_rl.costmodel.costmodel import CostModel
from nereus_rl.planner import native as planner_native
from nereus_rl.planner.bounds import partition_bounds_of as _partition_bounds
from nereus_rl.planner.planner import PlanInfeasibleError, Planner

pytestmark = pytest.mark.skipif(
    not planner_native.AVAILABLE, reason="nereus_rl._native built without the planner"
)

CLASSES = ("gemm", "attention", "mem", "launch", "allreduce:intra", "allreduce:inter")


def _same(a, b):
    """Assert two PlanResults are identical: plans, objectives, k-best order, work done."""
    assert a.latency_s == b.latency_s and a.plan == b.plan
    assert [lat for lat, _ in a.k_best] == [lat for lat, _ in b.k_best]
    assert [p for _, p in a.k_best] == [p for _, p in b.k_best]
    for key in ("nodes", "partitions", "aligned"):
        assert a.timings[key] == b.timings[key], key


def _random_calls(rng, cluster, n_calls):
    """A random workload and a sequence of random signals (bucket, devices, refinement)."""
    c = cluster_preset(cluster)
    eff = {k: float(rng.uniform(0.1, 1.0)) for k in rng.choice(CLASSES, 3, replace=False)}
    cm = CostModel(c, efficiencies=eff)
    algo = str(rng.choice(["ppo", "grpo", "remax"]))
    kw = dict(batch=int(rng.choice([16, 64, 256, 1024])), prompt_len=int(rng.choice([256, 1024])))
    if algo == "grpo":
        kw["group_size"] = 4
    if algo == "ppo" and rng.random() < 0.5:
        kw["reward"] = "llama-3.1-8b"
    base = make_workload(algo, response_len=1024, **kw)
    calls = []
    for _ in range(n_calls):
        resp = int(rng.choice([512, 1024, 2048, 4096, 8192]))
        lost = int(rng.integers(0, c.num_devices // 2))
        devs = range(c.num_devices - lost)
        if rng.random() < 0.2 and c.num_devices > 2:  # holes: the unaligned path
            devs = sorted(set(range(c.num_devices)) - {int(rng.integers(0, c.num_devices))})
        calls.append((resp, devs, rng.random() < 0.3, int(rng.choice([1, 2, 5, 12]))))
    return c, cm, base, calls


@pytest.mark.parametrize(
    "cluster,seed",
    [
        ("h200x8", 1),
        ("a100x8", 3),
        ("h100x16", 5),
        ("h100x16", 1),
        ("a100x32", 4),
        ("a100x32", 1),
        ("h200x64", 2),
        ("h100x4", 6),
    ],
)
def test_native_equals_python_on_random_calls(cluster, seed):
    rng = np.random.default_rng(seed)
    c, cm, base, calls = _random_calls(rng, cluster, 6)
    nat, ref = Planner(c, cm, native=True), Planner(c, cm, native=False)
    assert nat.native and not ref.native
    compared = 0
    for resp, devs, refine, k in calls:
        if refine:
            cm.observe_work({"gemm": 1.0, "mem": 0.5, "allreduce:intra": 0.1}, 2.0)
        w = base.with_response_len(resp)
        try:
            want = ref.plan(w, devices=devs, k=k)
        except PlanInfeasibleError as e:
            with pytest.raises(PlanInfeasibleError) as got:
                nat.plan(w, devices=devs, k=k)
            assert str(got.value) == str(e)
            continue
        _same(nat.plan(w, devices=devs, k=k), want)
        # A fresh compiled planner (nothing cached) agrees too.
        _same(Planner(c, cm, native=True).plan(w, devices=devs, k=k), want)
        compared += 1
    assert compared >= 2


def test_native_bounds_equal_python_bit_for_bit():
    """The cheap table and every partition bound equal the numpy ones exactly (the order
    of the partitions searched, hence tie-breaks, depends on them)."""
    c = cluster_preset("h200x32")
    cm = CostModel(c, efficiencies={"gemm": 0.37, "mem": 0.61})
    w = make_workload("ppo", reward="llama-3.1-8b", batch=64, response_len=2048)
    nat, ref = Planner(c, cm, native=True), Planner(c, cm, native=False)
    for N in (32, 24, 13, 6):
        _same(nat.plan(w, devices=range(N)), ref.plan(w, devices=range(N)))
        ((_, _, bounds),) = ref._ginfo.values()
        (ctx,) = nat._nctx.values()
        assert np.array_equal(ctx.cheap_table(), bounds["rows"].C)
        pidx = planner_native.partition_index(_partition_bounds(6, N), N)
        assert ctx.bounds(pidx) == tuple(bounds[N])


@pytest.mark.parametrize("S", [1, 2, 3, 5, 6])
def test_index_built_natively_equals_the_marshalled_one(S):
    """The C++-built partition index (set partitions, maximal size assignments, prefix
    skips) is array for array the one marshalled from planner_bounds.PartitionBounds."""
    for N in (1, 2, 3, 5, 6, 8, 13, 24, 31, 32, 56, 1016, 4080, 4096):
        built = planner_native.partition_index_of(S, N)
        marshalled = planner_native.partition_index(_partition_bounds(S, N), N)
        assert built.N == marshalled.N == N
        got, want = built.arrays(), marshalled.arrays()
        assert len(got[1]) > 0
        for a, b in zip(got, want):
            assert a == b, (S, N)
    with pytest.raises(ValueError, match="between 1 and 10 stages"):
        planner_native._native.PartitionIndex.build(11, 8)
    with pytest.raises(ValueError, match="N must be"):
        planner_native._native.PartitionIndex.build(3, 0)


def test_native_decision_at_a_new_device_count_builds_no_python_bounds(monkeypatch):
    """The compiled search's index comes from C++: PartitionBounds (7-14 ms in Python) is
    not built on the decision path, and the plan is the reference's."""
    from nereus_rl.planner import bounds as planner_bounds

    c = cluster_preset("h200x32")
    cm = CostModel(c)
    w = make_workload("ppo", reward="llama-3.1-8b", batch=64, response_len=2048)
    ref = Planner(c, cm, native=False).plan(w, devices=range(29))

    def no_python_bounds(*_):
        raise AssertionError("PartitionBounds built on the compiled decision path")

    monkeypatch.setattr(planner_bounds.PartitionBounds, "__init__", no_python_bounds)
    planner_native.partition_index_of.cache_clear()
    _same(Planner(c, cm, native=True).plan(w, devices=range(29)), ref)


def test_native_k_best_ties_keep_python_order():
    """Equal objectives (two identical reward and reference stages) rank as in Python."""
    c = cluster_preset("h100x8")
    cm = CostModel(c)
    w = make_workload("ppo", actor="medium", batch=64, prompt_len=256, response_len=512)
    a = Planner(c, cm, native=True).plan(w, k=40)
    b = Planner(c, cm, native=False).plan(w, k=40)
    lats = [lat for lat, _ in a.k_best]
    assert len(set(lats)) < len(lats)  # the case has ties
    _same(a, b)


def test_native_errors_as_python():
    c = cluster_preset("h100x1")
    w = make_workload("grpo", actor="llama-3.1-70b", batch=8)
    msgs = []
    for native in (True, False):
        with pytest.raises(PlanInfeasibleError, match=r"rollout: [0-9.]+ GiB/device") as e:
            Planner(c, CostModel(c), native=native).plan(w)
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1]
    with pytest.raises(ValueError, match="k=0 must be >= 1"):
        Planner(c, CostModel(c), native=True).plan(w, k=0)


def test_placed_stage_plans_pass_validation():
    """place() skips StagePlan's checks (valid by construction): rebuilding every placed
    StagePlan through the checking constructor gives an equal object, holes included."""
    from nereus_rl.core.globalplan import StagePlan

    c = cluster_preset("h200x64")
    cm = CostModel(c)
    w = make_workload("ppo", reward="llama-3.1-8b", batch=128, response_len=2048)
    for devs in (range(64), range(40), sorted(set(range(64)) - {5, 17})):
        res = Planner(c, cm).plan(w, devices=devs, k=4)
        for _, p in res.k_best:
            for sp in p.stages:
                fields = (sp.stage, sp.model, sp.trains, sp.dp, sp.tp, sp.pp, sp.units)
                assert StagePlan(*fields) == sp and hash(StagePlan(*fields)) == hash(sp)


@pytest.mark.parametrize(
    "keep",
    [
        ("actor_train",),
        ("actor_train", "reference"),
        ("rollout", "actor_train"),
        ("actor_train", "critic_train", "reference", "reward"),  # no rollout: r_i = -1
    ],
)
def test_native_equals_python_on_stage_subsets(keep):
    """Workloads with fewer stages (one stage; no rollout, so no sync variants)."""
    from dataclasses import replace

    c = cluster_preset("h100x16")
    cm = CostModel(c, efficiencies={"gemm": 0.45, "attention": 0.3})
    full = make_workload("ppo", reward="llama-3.1-8b", batch=128, response_len=2048)
    w = replace(full, stages=tuple(s for s in full.stages if s.stage in keep))
    assert {s.stage for s in w.planned_stages} == set(keep)
    for devs in (range(16), range(11), range(3)):
        try:
            want = Planner(c, cm, native=False).plan(w, devices=devs, k=6)
        except PlanInfeasibleError as e:
            with pytest.raises(PlanInfeasibleError) as got:
                Planner(c, cm, native=True).plan(w, devices=devs, k=6)
            assert str(got.value) == str(e)
            continue
        _same(Planner(c, cm, native=True).plan(w, devices=devs, k=6), want)
