"""Concurrent executor and the per-component baseline, with sleeping primitives."""

from __future__ import annotations

import dataclasses
import random
import threading

import pytest

from nereus_rl.baselines.migration import run_per_component
from nereus_rl.baselines.scenarios import (
    TRANSITION_TYPES,
    compile_scenario,
    draw_reachable,
)
from nereus_rl.core.globalplan import GlobalPlan, StagePlan
from nereus_rl.transition import (
    TransitionExecutionError,
    compile_transition,
    longest_path,
)
from nereus_rl.transition.execute import execute_dag, sleeping_impls
from nereus_rl.transition.safety import check_dag

MEM = 10.0


def sp(stage, units, model=None):
    model = model or {"rollout": "actor"}.get(stage, stage)
    return StagePlan(stage, model, False, len(units), 1, 1, tuple(tuple(u) for u in units))


def plan(*stages):
    return GlobalPlan(tuple(stages))


SWAP = (
    plan(sp("rollout", [[0], [1]]), sp("reference", [[2], [3]])),
    plan(sp("rollout", [[2], [3]]), sp("reference", [[0], [1]])),
)


def test_executor_runs_concurrently_and_reaches_target():
    # Four independent moves onto free devices: all four extends run at once.
    cur = plan(sp("rollout", [[0], [1]]), sp("reference", [[2], [3]]))
    tgt = plan(sp("rollout", [[4], [5]]), sp("reference", [[6], [7]]))
    dag = compile_transition(cur, tgt, unit_memory=lambda u: MEM, capacity=MEM)
    assert dag.num_resource_edges == 0
    seen = []
    lock = threading.Lock()

    def impl(p):
        with lock:
            seen.append(p.kind)
        threading.Event().wait(0.05)

    rep = execute_dag(dag, {k: impl for k in ("extend", "destroy", "split", "merge")})
    assert rep.final.matches(tgt)
    assert sorted(seen) == ["destroy"] * 4 + ["extend"] * 4  # each primitive called once
    assert rep.max_concurrency >= 4
    assert rep.resource_waits == 0
    assert rep.makespan_s < 0.05 * 8 * 0.75  # well under a serial run
    ext = [r for r in rep.records if r.kind == "extend"]
    assert max(r.start_s for r in ext) < min(r.end_s for r in ext)  # all four overlapped
    assert len(rep.critical_path) == 2  # an extend, then the destroy it anchors
    assert [dag.primitives[p].kind for p in rep.critical_path] == ["extend", "destroy"]


def test_executor_follows_resource_edges_on_the_swap():
    dag = compile_transition(*SWAP, unit_memory=lambda u: MEM, capacity=MEM)
    rng = random.Random(3)
    durations = {p.pid: rng.uniform(0.001, 0.004) for p in dag.primitives}
    rep = execute_dag(dag, sleeping_impls(durations))
    assert rep.final.matches(SWAP[1])
    starts = {r.pid: r.start_s for r in rep.records}
    ends = {r.pid: r.end_s for r in rep.records}
    for e in dag.edges:
        assert ends[e.src] <= starts[e.dst] + 1e-6, e
    # The measured makespan is at least the critical path of the sleeps.
    assert rep.makespan_s >= longest_path(dag, durations)[0] * 0.95


def test_executor_uses_tickets_for_uncertified_dags():
    cur = plan(sp("rollout", [[0]]), sp("reference", [[1]]), sp("reward", [[2]]))
    tgt = plan(sp("rollout", [[0]]), sp("reference", [[2]]), sp("reward", [[3]]))
    dag = compile_transition(cur, tgt, unit_memory=lambda u: MEM, capacity=MEM, devices=range(4))
    bare = dataclasses.replace(
        dag, edges=tuple(e for e in dag.edges if e.kind != "resource"), funding=None
    )
    rep = execute_dag(bare, sleeping_impls(lambda p: 0.002))
    assert not rep.any_order
    assert rep.final.matches(tgt)
    # reference's extend onto device 2 was ready at once but had to wait for reward's destroy
    assert rep.resource_waits >= 1


def test_executor_reports_failing_primitive():
    dag = compile_transition(*SWAP, unit_memory=lambda u: MEM, capacity=MEM)

    def boom(p):
        raise OSError("link down")

    impls = sleeping_impls(lambda p: 0.001)
    impls["extend"] = boom
    with pytest.raises(TransitionExecutionError, match=r"E\d+\[.*failed: OSError\('link down'\)"):
        execute_dag(dag, impls)
    with pytest.raises(ValueError, match="no implementation for primitive kinds"):
        execute_dag(dag, {"extend": boom})


@pytest.mark.parametrize("kind", TRANSITION_TYPES)
def test_random_pairs_execute_to_target(kind):
    rng = random.Random(100 + TRANSITION_TYPES.index(kind))
    for _ in range(6):
        sc, dag, _ = draw_reachable(kind, rng, num_devices=12)
        rep = execute_dag(dag, sleeping_impls(lambda p: rng.uniform(0.0, 0.002)))
        assert rep.final.matches(sc.target)
        assert rep.resource_waits == 0  # every conflict is an edge: nothing waits at run time
        assert check_dag(dag).any_order


def test_per_component_deadlocks_on_the_swap_where_the_dag_succeeds():
    impls = sleeping_impls(lambda p: 0.001)
    res = run_per_component(*SWAP, impls, unit_memory=lambda u: MEM, capacity=MEM, timeout_s=2.0)
    assert not res.success and res.failure == "deadlock"
    assert "wait-for cycle" in res.detail and "rollout" in res.detail
    assert res.elapsed_s < 1.0  # found by the cycle, not by the timeout
    dag = compile_transition(*SWAP, unit_memory=lambda u: MEM, capacity=MEM)
    assert execute_dag(dag, impls).final.matches(SWAP[1])


def test_per_component_timeout_and_success():
    cur = plan(sp("rollout", [[0]]), sp("reference", [[1]]), sp("reward", [[2]]))
    tgt = plan(sp("rollout", [[0]]), sp("reference", [[2]]), sp("reward", [[3]]))
    impls = sleeping_impls(lambda p: 0.001)
    kw = dict(unit_memory=lambda u: MEM, capacity=MEM, devices=range(4))
    # reward starts late: reference waits on device 2 with no cycle, and gives up.
    slow = run_per_component(cur, tgt, impls, timeout_s=0.05, launch_delay_s={"reward": 0.3}, **kw)
    assert slow.failure == "timeout" and "device 2" in slow.detail
    ok = run_per_component(cur, tgt, impls, timeout_s=1.0, **kw)
    assert ok.success, ok


def test_scaled_rebalance_executes_to_target():
    from nereus_rl.baselines.scenarios import SCALED_CAPACITY, scaled_scenario

    sc = scaled_scenario(128)
    dag = compile_scenario(sc, capacity=SCALED_CAPACITY)
    assert dag.counts() == {"extend": 20, "destroy": 28, "split": 32, "merge": 0}
    rep = execute_dag(dag, sleeping_impls(lambda p: 0.001), max_workers=16)
    assert rep.final.matches(sc.target)
    assert rep.resource_waits == 0
    assert 1 < rep.max_concurrency <= 16


def test_per_component_reports_a_failing_primitive():
    impls = sleeping_impls(lambda p: 0.001)

    def boom(p):
        raise OSError("link down")

    impls["extend"] = boom
    res = run_per_component(SWAP[0], SWAP[0], impls, unit_memory=lambda u: MEM, capacity=MEM)
    assert res.success  # nothing to do: no primitive runs
    cur = plan(sp("rollout", [[0]]))
    tgt = plan(sp("rollout", [[1]]))
    res = run_per_component(cur, tgt, impls, unit_memory=lambda u: MEM, capacity=MEM)
    assert res.failure == "error" and "link down" in res.detail
