"""What the unprepared decision path relies on: the compiled Pareto lists built without a
sort by time, a partition heap kept across calls, and the per-workload keys
(``Workload.with_response_len`` returns the same object per length)."""

import copy
import pickle

import numpy as np
import pytest

from nereus_rl.core.spec import cluster_preset
from nereus_rl.core.workload import make_workload
from nereus_rl.costmodel.costmodel import CostModel
from nereus_rl.planner import native as planner_native
from nereus_rl.planner.planner import Planner
from nereus_rl.planner.reference import pareto_lists

native = pytest.mark.skipif(
    not planner_native.AVAILABLE, reason="nereus_rl._native built without the planner"
)


def test_with_response_len_same_object_per_length_and_not_pickled():
    base = make_workload("ppo", batch=64, response_len=1024)
    a, b = base.with_response_len(2048), base.with_response_len(2048)
    assert a is b and a.response_len == 2048
    assert all(s.response_len == 2048 for s in a.stages)
    assert base.with_response_len(4096) is not a
    for clone in (pickle.loads(pickle.dumps(base)), copy.deepcopy(base)):
        assert clone == base and "_by_len" not in clone.__dict__
        assert clone.with_response_len(2048) == a


@native
@pytest.mark.parametrize("cluster", ["h200x8", "h200x64", "h200x1024"])
def test_compiled_pareto_lists_equal_the_reference(cluster):
    """The memory-order sweep gives the reference's sorted Pareto lists, entry for entry,
    under efficiencies that reorder the layouts (ties in memory included)."""
    c = cluster_preset(cluster)
    w = make_workload("ppo", reward="llama-3.1-8b", batch=2 * c.num_devices, response_len=2048)
    rng = np.random.default_rng(c.num_devices)
    for trial in range(3):
        cm = CostModel(c)
        if trial:
            cm._x = cm._x * rng.uniform(0.2, 5.0, cm._x.shape)  # another time order
        pl = Planner(c, cm)
        res = pl.plan(w)
        stages = list(w.planned_stages)
        actor = w.stage("actor_train").model_spec
        sid = tuple(pl._sid(s, actor, w.dtype) for s in stages)
        phases, r_i, a_i, tables = pl._shape(stages, sid, actor, w.dtype)
        W, starts = pl._stack(sid, tables, r_i)
        times = planner_native.price(W, cm._x)
        ctx = planner_native.make_context(
            times, tables, phases, r_i, a_i, cm.capacity_bytes, c.num_devices, 8, False
        )
        memo = (times.tolist(), starts)
        cap = cm.capacity_bytes
        fast = []
        for i, t in enumerate(tables):
            _, f = pareto_lists(pl, ("t", trial), t, cap, lambda m=memo: m, i)
            fast.append(f)
        if r_i >= 0:
            _, fe = pareto_lists(pl, ("t", trial), tables[r_i], cap, lambda m=memo: m, len(tables))
            fast[r_i] = [a if a < b else b for a, b in zip(fast[r_i], fe)]
        # The cheap table's single-stage rows are each stage's fastest layout per size.
        C = ctx.cheap_table()
        for i, f in enumerate(fast):
            got = C[1 << i][:, phases[i]]
            want = np.array(f) * (1.0 - 1e-12)
            assert got.tolist() == want.tolist()
        assert res.latency_s > 0


@native
def test_kept_partition_heap_gives_the_same_answers_as_a_fresh_context():
    """Searches repeated on one context (its heap kept between calls) against a fresh
    context per call, over device counts, k and an interleaving of both."""
    c = cluster_preset("h200x64")
    cm = CostModel(c)
    w = make_workload("ppo", reward="llama-3.1-8b", batch=128, response_len=2048)
    pl = Planner(c, cm)
    pl.plan(w)
    stages = list(w.planned_stages)
    actor = w.stage("actor_train").model_spec
    sid = tuple(pl._sid(s, actor, w.dtype) for s in stages)
    phases, r_i, a_i, tables = pl._shape(stages, sid, actor, w.dtype)
    W, _ = pl._stack(sid, tables, r_i)
    times = planner_native.price(W, cm._x)
    args = (times, tables, phases, r_i, a_i, cm.capacity_bytes, 64, 8, False)
    kept = planner_native.make_context(*args)
    for n, k in [(64, 1), (64, 5), (40, 3), (64, 1), (40, 1), (64, 12), (17, 2), (64, 1)]:
        pidx = planner_native.partition_index_of(len(stages), n)
        got = kept.search(pidx, k)
        want = planner_native.make_context(*args).search(pidx, k)
        assert got[0] == want[0] and got[1:3] == want[1:3], (n, k)
