"""Live EMU primitives run by the concurrent DAG executor on 4 local workers.

Primitives on disjoint workers must overlap in time (the executor's report and the
manager's own records, taken after each primitive got its workers), primitives that
share a worker must not, and every unit must end bitwise equal to the reference.
"""

from __future__ import annotations

import pytest
import torch

from nereus_rl.core.globalplan import GlobalPlan, StagePlan
from nereus_rl.emu.dag import live_impls
from nereus_rl.emu.manager import EMUManager
from nereus_rl.emu.state import stage_state_specs
from nereus_rl.runtime import Driver
from nereus_rl.transition.compile import compile_transition
from nereus_rl.transition.execute import execute_dag

# Multi-process: out of the fast lane (-m "not slow").
pytestmark = pytest.mark.slow

# Big enough that one extend takes tens of milliseconds even on an idle machine.
SPECS = stage_state_specs(4, hidden=192, ffn=768, vocab=512)


@pytest.fixture(scope="module")
def emus():
    d = Driver(call_timeout=120.0)
    try:
        ranks = d.spawn_local(4, num_threads=1, method="forkserver")
        m = EMUManager(d, transfer_timeout=60.0)
        m.define_stage("a", SPECS, seed=1)
        m.define_stage("b", SPECS, seed=2)
        yield m, ranks
    finally:
        d.shutdown()


def _plan(**units) -> GlobalPlan:
    return GlobalPlan(
        tuple(
            StagePlan(s, s, True, len(us), 1, 1, tuple((d,) for d in us)) for s, us in units.items()
        )
    )


def _run(m: EMUManager, ranks, current: GlobalPlan, target: GlobalPlan):
    """Create ``current``'s units, run the compiled DAG to ``target`` live, check bitwise."""
    live = {}
    for sp in current.stages:
        for i, devs in enumerate(sp.units):
            live[f"{sp.stage}#{i}"] = m.create(sp.stage, [ranks[d] for d in devs])
    first = len(m.records)
    dag = compile_transition(current, target, capacity=float("inf"), stage_slots=False)
    report = execute_dag(dag, live_impls(m, live, lambda devs: [ranks[d] for d in devs]))
    for sp in target.stages:
        got = sorted(u.ranks for u in m.units(sp.stage))
        assert got == sorted(tuple(ranks[d] for d in devs) for devs in sp.units)
        ref = m.reference(sp.stage)
        for u in m.units(sp.stage):
            state = m.full_state(u)
            for name, t in ref.items():
                assert torch.equal(state[name], t), (u, name)
    recs = [r for r in m.records[first:] if r.kind in ("extend", "destroy", "split", "merge")]
    for u in m.units():
        m._commit([u], [], [])  # reset for the next test
    m.flush()
    return dag, report, recs


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return max(a[0], b[0]) < min(a[1], b[1])


def test_extends_on_disjoint_workers_overlap_and_stay_bitwise(emus):
    m, ranks = emus
    dag, report, recs = _run(m, ranks, _plan(a=[0], b=[2]), _plan(a=[0, 1], b=[2, 3]))
    assert [p.kind for p in dag.primitives] == ["extend", "extend"] and not dag.edges
    r0, r1 = report.records
    assert _overlap((r0.start_s, r0.end_s), (r1.start_s, r1.end_s)), report.records
    assert report.max_concurrency == 2
    # The manager's records start once a primitive holds its workers: they overlap
    # only if the two transfers really ran at the same time.
    ra, rb = recs
    assert _overlap((ra.started, ra.started + ra.seconds), (rb.started, rb.started + rb.seconds))
    assert ra.bytes_moved > 0 and rb.bytes_moved > 0


def test_unordered_primitives_sharing_a_worker_run_one_after_the_other(emus):
    m, ranks = emus
    # Both extends copy from the unit on device 0: no edge orders them, they share it.
    dag, _, recs = _run(m, ranks, _plan(a=[0]), _plan(a=[0, 1, 2]))
    assert [p.kind for p in dag.primitives] == ["extend", "extend"] and not dag.edges
    ra, rb = sorted(recs, key=lambda r: r.started)
    assert ra.started + ra.seconds <= rb.started
