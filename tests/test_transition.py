"""Plan diff, DAG compiler and safety check: worked examples, bad input, random pairs."""

from __future__ import annotations

import dataclasses
import random
import re

import pytest

from nereus_rl.globalplan import GlobalPlan, StagePlan
from nereus_rl.transition import (
    Edge,
    InfeasibleTargetError,
    Placement,
    StateLossError,
    TransitionDAG,
    UnsafeDAGError,
    compile_transition,
    default_primitive_cost,
    diff_plans,
    predicted_completion_time,
    topo_order,
    transition_cost,
)
from nereus_rl.transition_safety import check_dag
from nereus_rl.transition_scenarios import (
    SCENARIO_CAPACITY,
    TRANSITION_TYPES,
    random_scenario,
    scenario_unit_memory,
)

MEM = 10.0  # every unit takes 10 bytes per device in the worked examples


def sp(stage, tp, pp, units, model=None, trains=False):
    model = model or {"rollout": "actor", "actor_train": "actor"}.get(stage, stage)
    return StagePlan(stage, model, trains, len(units), tp, pp, tuple(tuple(u) for u in units))


def plan(*stages):
    return GlobalPlan(tuple(stages))


def compile10(cur, tgt, cap=MEM, **kw):
    return compile_transition(cur, tgt, unit_memory=lambda u: MEM, capacity=cap, **kw)


def resource_edges(dag):
    return [
        (dag.primitives[e.src], dag.primitives[e.dst]) for e in dag.edges if e.kind == "resource"
    ]


# ---------------------------------------------------------------------------
# Diff


def test_diff_keeps_fitting_units_and_finds_split_merge_relayout():
    cur = plan(
        sp("rollout", 2, 1, [[0, 1], [2, 3]]),
        sp("reference", 4, 1, [[4, 5, 6, 7]]),
        sp("reward", 2, 1, [[8, 9]]),
        sp("critic_inference", 1, 1, [[10], [11]], model="critic"),
        sp("critic_train", 1, 1, [[12]], model="critic", trains=True),
    )
    tgt = plan(
        sp("rollout", 4, 1, [[0, 1, 2, 3]]),  # merge
        sp("reference", 2, 1, [[4, 5], [6, 7]]),  # split
        sp("reward", 1, 2, [[8, 9]]),  # relayout in place
        sp("critic_inference", 1, 1, [[10], [13]], model="critic"),  # keep one, move one
        sp("critic_train", 1, 1, [[12]], model="critic", trains=True),  # keep
    )
    d = diff_plans(Placement.from_plan(cur), tgt)
    assert [u.uid for u in d.kept] == ["critic_inference#0", "critic_train#0"]
    assert len(d.merges) == 1 and d.merges[0][1].devices == (0, 1, 2, 3)
    assert len(d.splits) == 1 and d.splits[0][0].uid == "reference#0"
    assert len(d.relayouts) == 1 and d.relayouts[0][2].layout == (1, 2, (8, 9))
    assert [t.devices for t in d.extends] == [(13,)]
    assert [u.uid for u in d.destroys] == ["critic_inference#1"]
    assert d.target.matches(tgt)


# ---------------------------------------------------------------------------
# Worked examples


def test_one_resource_edge_release_before_acquire():
    # reference moves onto reward's device 2; reward moves to the free device 3.
    cur = plan(sp("rollout", 1, 1, [[0]]), sp("reference", 1, 1, [[1]]), sp("reward", 1, 1, [[2]]))
    tgt = plan(sp("rollout", 1, 1, [[0]]), sp("reference", 1, 1, [[2]]), sp("reward", 1, 1, [[3]]))
    dag = compile10(cur, tgt, devices=range(4))
    edges = resource_edges(dag)
    assert dag.num_resource_edges == 1
    ((src, dst),) = edges
    assert (src.kind, src.inputs[0].uid) == ("destroy", "reward#0")
    assert (dst.kind, dst.outputs[0].devices) == ("extend", (2,))
    assert check_dag(dag).any_order
    assert dag.counts() == {"extend": 2, "destroy": 2, "split": 0, "merge": 0}


def test_two_resource_edges_chain():
    # A chain of moves: reward 2->3, reference 1->2, rollout 0->1.
    cur = plan(sp("rollout", 1, 1, [[0]]), sp("reference", 1, 1, [[1]]), sp("reward", 1, 1, [[2]]))
    tgt = plan(sp("rollout", 1, 1, [[1]]), sp("reference", 1, 1, [[2]]), sp("reward", 1, 1, [[3]]))
    dag = compile10(cur, tgt, devices=range(4))
    assert dag.num_resource_edges == 2
    got = {(s.inputs[0].uid, d.outputs[0].devices) for s, d in resource_edges(dag)}
    assert got == {("reward#0", (2,)), ("reference#0", (1,))}
    rep = check_dag(dag)
    assert rep.any_order and rep.peak_bytes <= MEM
    # The chain is serial: (extend, destroy) three times on the critical path.
    assert predicted_completion_time(dag, lambda p: 1.0) == 6.0
    cost = transition_cost(
        cur, tgt, cost_fn=lambda p: 1.0, devices=range(4), unit_memory=lambda u: MEM, capacity=MEM
    )
    assert cost == 6.0


def test_stage_order_breaks_ties():
    # rollout and reference both wait for device memory; rollout comes first in the plan,
    # so it is funded first; swapping the stage order swaps who goes first.
    def run(order):
        stages = {
            "rollout": (sp("rollout", 1, 1, [[0]]), sp("rollout", 1, 1, [[2]])),
            "reference": (sp("reference", 1, 1, [[1]]), sp("reference", 1, 1, [[2]])),
        }
        reward = (sp("reward", 1, 1, [[2]]), sp("reward", 1, 1, [[3]]))
        cur = plan(*(stages[s][0] for s in order), reward[0])
        tgt = plan(*(stages[s][1] for s in order), reward[1])
        dag = compile_transition(
            cur, tgt, unit_memory=lambda u: 5.0, capacity=10.0, devices=range(4)
        )
        ext = [dag.primitives[p] for p in dag.order if dag.primitives[p].kind == "extend"]
        return [p.stage for p in ext if p.outputs[0].devices == (2,)]

    assert run(["rollout", "reference"]) == ["rollout", "reference"]
    assert run(["reference", "rollout"]) == ["reference", "rollout"]


def test_executable_destroy_is_chosen_when_stages_swap_devices():
    # Each stage wants the other's devices and no device holds two units: per-component
    # migration deadlocks. The compiler destroys one unit of a stage that has another
    # holder (never the last), which unblocks the chain.
    cur = plan(sp("rollout", 1, 1, [[0], [1]]), sp("reference", 1, 1, [[2], [3]]))
    tgt = plan(sp("rollout", 1, 1, [[2], [3]]), sp("reference", 1, 1, [[0], [1]]))
    dag = compile10(cur, tgt)
    assert any("blocked: destroy" in n for n in dag.notes)
    first = dag.primitives[dag.order[0]]
    assert first.kind == "destroy"
    rep = check_dag(dag)
    assert rep.any_order
    # No destroy removes the last holder: each has an anchor.
    destroys = [p.pid for p in dag.primitives if p.kind == "destroy"]
    assert sorted({p for p, _, _ in dag.anchors}) == sorted(destroys)
    assert 1 <= dag.num_resource_edges <= 4


def test_in_place_split_merge_need_no_resource_edges():
    cur = plan(sp("rollout", 2, 1, [[0, 1], [2, 3]]), sp("reward", 2, 1, [[0, 1]]))
    tgt = plan(sp("rollout", 4, 1, [[0, 1, 2, 3]]), sp("reward", 1, 2, [[0, 1]]))
    dag = compile_transition(cur, tgt, unit_memory=lambda u: 8.0 / (u.tp * u.pp), capacity=20.0)
    assert dag.counts() == {"extend": 0, "destroy": 0, "split": 1, "merge": 2}
    assert dag.num_resource_edges == 0
    assert check_dag(dag).any_order


# ---------------------------------------------------------------------------
# Bad input


def test_target_needs_missing_devices():
    cur = plan(sp("rollout", 1, 1, [[0]]))
    tgt = plan(sp("rollout", 1, 1, [[0], [5]]))
    with pytest.raises(InfeasibleTargetError, match=r"devices 5 \(used by \['rollout'\]\)"):
        compile10(cur, tgt, cap=100, devices=range(4))


def test_target_over_memory():
    cur = plan(sp("rollout", 1, 1, [[0]]), sp("reward", 1, 1, [[1]]))
    tgt = plan(sp("rollout", 1, 1, [[0]]), sp("reward", 1, 1, [[0]]))
    with pytest.raises(InfeasibleTargetError, match="on device 0"):
        compile10(cur, tgt)


def test_dropping_last_holder_of_optimizer_state():
    cur = plan(
        sp("rollout", 1, 1, [[0]]),
        sp("critic_train", 1, 1, [[1]], model="critic", trains=True),
    )
    tgt = plan(sp("rollout", 1, 1, [[0]]))
    with pytest.raises(StateLossError, match=r"critic_train#0"):
        compile10(cur, tgt, cap=100)


def test_state_only_on_lost_devices():
    cur = plan(
        sp("rollout", 1, 1, [[0]]),
        sp("actor_train", 1, 1, [[1]], trains=True),
    )
    tgt = plan(sp("rollout", 1, 1, [[0]]), sp("actor_train", 1, 1, [[2]], trains=True))
    with pytest.raises(StateLossError, match=r"actor_train#0.*lost devices 1"):
        compile10(cur, tgt, cap=100, lost_devices=[1], devices=range(3))


def test_swap_of_single_units_has_no_safe_order():
    cur = plan(sp("rollout", 1, 1, [[0]]), sp("reference", 1, 1, [[1]]))
    tgt = plan(sp("rollout", 1, 1, [[1]]), sp("reference", 1, 1, [[0]]))
    with pytest.raises(InfeasibleTargetError, match=r"device 1 needs .*reference#0"):
        compile10(cur, tgt)


def _chain_dag():
    cur = plan(sp("rollout", 1, 1, [[0]]), sp("reference", 1, 1, [[1]]), sp("reward", 1, 1, [[2]]))
    tgt = plan(sp("rollout", 1, 1, [[0]]), sp("reference", 1, 1, [[2]]), sp("reward", 1, 1, [[3]]))
    return compile10(cur, tgt, devices=range(4))


def _with_edges(dag: TransitionDAG, edges) -> TransitionDAG:
    return dataclasses.replace(dag, edges=tuple(edges), order=(), funding=None)


def test_hand_written_cycle_is_named():
    dag = _chain_dag()
    e = next(e for e in dag.edges if e.kind == "resource")
    bad = _with_edges(dag, [*dag.edges, Edge(e.dst, e.src, "data", "hand-written")])
    with pytest.raises(UnsafeDAGError, match=r"cycle: .*reward#0.*reference#1|cycle: .*reference"):
        check_dag(bad)


def test_hand_written_unsafe_order_is_named():
    dag = _chain_dag()
    e = next(e for e in dag.edges if e.kind == "resource")
    # Force the acquisition before the release that makes room for it.
    edges = [x for x in dag.edges if x is not e] + [Edge(e.dst, e.src, "resource", "wrong")]
    with pytest.raises(UnsafeDAGError, match=r"no safe order.*device 2 needs"):
        check_dag(_with_edges(dag, edges))


def test_hand_written_destroy_of_last_holder_is_named():
    dag = _chain_dag()
    d = next(p for p in dag.primitives if p.kind == "destroy" and p.inputs[0].uid == "reward#0")
    e = next(p for p in dag.primitives if p.kind == "extend" and p.stage == "reward")
    edges = [x for x in dag.edges if not (x.src == e.pid and x.dst == d.pid)]
    edges.append(Edge(d.pid, e.pid, "data", "wrong"))
    with pytest.raises(UnsafeDAGError, match=r"reward#0 is the last live holder of weights"):
        check_dag(_with_edges(dag, edges))


def test_dag_without_resource_edge_has_a_safe_order_but_no_certificate():
    dag = _chain_dag()
    edges = [e for e in dag.edges if e.kind != "resource"]
    rep = check_dag(_with_edges(dag, edges))
    assert not rep.any_order
    # The safe sequence puts reward's destroy before reference's extend onto device 2.
    pos = {p: i for i, p in enumerate(rep.order)}
    d = next(p for p in dag.primitives if p.kind == "destroy" and p.inputs[0].uid == "reward#0")
    e = next(p for p in dag.primitives if p.kind == "extend" and p.outputs[0].devices == (2,))
    assert pos[d.pid] < pos[e.pid]
    # A certificate that claims an edge that is not there is rejected.
    forged = dataclasses.replace(dag, edges=tuple(edges))
    assert not check_dag(forged).any_order


# ---------------------------------------------------------------------------
# Random current/target pairs


def _random_concurrent_run(dag, rng, cap):
    """Start and finish primitives in a random interleaving that respects the edges only.

    A primitive takes its memory and slots when it starts and gives back what it
    consumes when it finishes; many may run at once. Checks capacity, slots and
    holders at every step, and the final placement.
    """
    mem = dict(dag.unit_bytes)
    used = dict.fromkeys(dag.devices, 0.0)
    live = {}
    slots = {}
    lost = {u.uid for p in dag.primitives if p.lost for u in p.inputs}
    for u in dag.current.units:
        for d in u.devices:
            if d in used:
                used[d] += mem[u.uid]
        if u.uid not in lost:
            live[u.uid] = u
        for d in u.devices:  # a lost unit keeps its surviving slots until destroyed
            if d in used:
                slots[(u.stage, d)] = u.uid
    npred = [len(set(x)) for x in dag.preds()]
    succs = [sorted(set(x)) for x in dag.succs()]
    ready = [i for i, k in enumerate(npred) if k == 0]
    running = []
    dying = set()  # units whose destroy has started: no longer count as holders
    while ready or running:
        if ready and (not running or rng.random() < 0.6):
            p = dag.primitives[ready.pop(rng.randrange(len(ready)))]
            for d, a in p.acquire:
                used[d] += a
                assert used[d] <= cap + 1e-6, f"{p!r} overfills device {d}"
            for s in dag.slots_acquired(p):
                assert s not in slots, f"{p!r} takes slot {s} held by {slots[s]}"
                slots[s] = p.outputs[0].uid
            if p.kind == "destroy" and not p.lost:
                u = p.inputs[0]
                for st in u.states:
                    others = [
                        v
                        for v in live.values()
                        if v.uid != u.uid and st in v.states and v.uid not in dying
                    ]
                    assert others, f"{p!r} destroys the last holder of {st}"
                dying.add(u.uid)
            running.append(p)
        else:
            p = running.pop(rng.randrange(len(running)))
            for u in p.inputs:
                live.pop(u.uid, None)
            for s in dag.slots_released(p):
                slots.pop(s, None)  # a lost unit's slots on lost devices were never held
            for u in p.outputs:
                live[u.uid] = u
            for d, r in p.release:
                used[d] -= r
            for q in succs[p.pid]:
                npred[q] -= 1
                if npred[q] == 0:
                    ready.append(q)
    assert Placement(tuple(live.values())).matches(dag.target)


@pytest.mark.parametrize("kind", TRANSITION_TYPES)
def test_random_pairs_compile_to_safe_acyclic_dags(kind):
    rng = random.Random(TRANSITION_TYPES.index(kind))
    compiled = 0
    infeasible = 0
    while compiled < 25:
        sc = random_scenario(kind, rng, num_devices=12)
        try:
            dag = compile_transition(
                sc.current,
                sc.target,
                devices=sc.devices,
                lost_devices=sc.lost,
                unit_memory=scenario_unit_memory,
                capacity=SCENARIO_CAPACITY,
            )
        except InfeasibleTargetError:
            infeasible += 1
            continue
        compiled += 1
        assert len(topo_order(dag)) == len(dag.primitives)
        assert all(e.src != e.dst for e in dag.edges)
        pos = {p: i for i, p in enumerate(dag.order)}
        assert all(pos[e.src] < pos[e.dst] for e in dag.edges), "edges follow the safe order"
        rep = check_dag(dag)
        assert rep.any_order, rep.reason
        assert rep.peak_bytes <= SCENARIO_CAPACITY + 1e-3
        assert dag.target.matches(sc.target)
        for _ in range(5):  # random concurrent executions stay safe
            _random_concurrent_run(dag, rng, SCENARIO_CAPACITY)
        assert predicted_completion_time(dag, default_primitive_cost) > 0
    assert infeasible < 40, "the generator should mostly draw reachable targets"


def test_compile_is_deterministic():
    sc = random_scenario("rebalance", random.Random(7), num_devices=12)
    kw = dict(unit_memory=scenario_unit_memory, capacity=SCENARIO_CAPACITY, devices=sc.devices)
    a = compile_transition(sc.current, sc.target, **kw)
    b = compile_transition(sc.current, sc.target, **kw)
    assert a == b
    assert repr(a).startswith("TransitionDAG(")


@pytest.mark.parametrize("kind", ["scale_down", "rebalance", "device_loss"])
def test_dense_pairs_with_and_without_refinement(kind):
    rng = random.Random(50 + TRANSITION_TYPES.index(kind))
    compiled = 0
    while compiled < 8:
        sc = random_scenario(kind, rng, num_devices=12, min_fill=0.5, max_dp=4)
        kw = dict(
            devices=sc.devices,
            lost_devices=sc.lost,
            unit_memory=scenario_unit_memory,
            capacity=SCENARIO_CAPACITY,
        )
        try:
            plain = compile_transition(sc.current, sc.target, refine=False, **kw)
        except InfeasibleTargetError:
            continue
        compiled += 1
        best = compile_transition(sc.current, sc.target, **kw)
        assert check_dag(plain).any_order and check_dag(best).any_order
        assert best.primitives == plain.primitives  # refinement only re-derives edges
        t_plain = predicted_completion_time(plain)
        assert predicted_completion_time(best) <= t_plain + 1e-9
        for dag in (plain, best):
            _random_concurrent_run(dag, rng, SCENARIO_CAPACITY)


def test_cpsat_schedule_matches_the_chain_and_never_beats_its_bound():
    from nereus_rl.transition_milp import schedule_cpsat

    dag = _chain_dag()
    res = schedule_cpsat(dag, lambda p: 1.0, time_limit_s=10.0, quantum_s=1.0)
    # extend reward@3, destroy reward#0, extend reference@2, destroy reference#0 is a chain
    # that no schedule can shorten: 4 units of time.
    assert res.proven_optimal
    assert res.makespan_s == 4.0 == res.dag_makespan_s
    assert res.gap_pct == 0.0
    # Without its resource edges the DAG would be shorter than any safe schedule: the
    # solver's reservoirs enforce the memory the edges encode.
    bare = _with_edges(dag, [e for e in dag.edges if e.kind != "resource"])
    res2 = schedule_cpsat(
        bare, lambda p: 1.0, time_limit_s=10.0, quantum_s=1.0, hint_dag_schedule=False
    )
    assert res2.makespan_s == 4.0 and res2.dag_makespan_s == 2.0


def test_certificate_needs_the_copy_source_edge():
    dag = _chain_dag()
    e = next(p for p in dag.primitives if p.kind == "extend" and p.stage == "reference")
    d = next(p for p in dag.primitives if p.kind == "destroy" and p.stage == "reference")
    assert e.source.uid == d.inputs[0].uid
    edges = [x for x in dag.edges if (x.src, x.dst) != (e.pid, d.pid)]
    rep = check_dag(dataclasses.replace(dag, edges=tuple(edges)))
    # The one edge both keeps the source alive for the copy and anchors the state.
    assert not rep.any_order
    assert re.search(r"may consume reference#0|anchors .* on reference#1", rep.reason)


def test_single_unit_tp_growth_needs_stage_overlap():
    # critic_train (one unit) grows from tp2 on devices 0-1 to tp4 on 0-3: the new unit
    # overlaps the old one, which is the last holder of the optimizer state.
    cur = plan(sp("critic_train", 2, 1, [[0, 1]], model="critic", trains=True))
    tgt = plan(sp("critic_train", 4, 1, [[0, 1, 2, 3]], model="critic", trains=True))
    kw = dict(unit_memory=lambda u: 8.0 / u.tp, capacity=8.0, devices=range(4))
    with pytest.raises(InfeasibleTargetError, match=r"\('critic_train', 0\) owned by"):
        compile_transition(cur, tgt, **kw)
    dag = compile_transition(cur, tgt, stage_slots=False, **kw)
    assert [p.kind for p in (dag.primitives[i] for i in dag.order)] == ["extend", "destroy"]
    rep = check_dag(dag)
    assert rep.any_order and rep.peak_bytes == 6.0  # old 4 + new 2 on devices 0 and 1
    # Memory still rules: at capacity 5 the copy cannot sit beside the original.
    with pytest.raises(InfeasibleTargetError, match="device 0 needs 2 bytes"):
        compile_transition(cur, tgt, stage_slots=False, **{**kw, "capacity": 5.0})


@pytest.mark.parametrize("kind", ["tp_pp_change", "scale_up"])
def test_random_pairs_without_stage_slots(kind):
    rng = random.Random(90 + TRANSITION_TYPES.index(kind))
    compiled = 0
    while compiled < 10:
        sc = random_scenario(kind, rng, num_devices=12, min_fill=0.5, max_dp=4)
        try:
            dag = compile_transition(
                sc.current,
                sc.target,
                devices=sc.devices,
                lost_devices=sc.lost,
                unit_memory=scenario_unit_memory,
                capacity=SCENARIO_CAPACITY,
                stage_slots=False,
            )
        except InfeasibleTargetError:
            continue
        compiled += 1
        assert check_dag(dag).any_order
        for _ in range(3):
            _random_concurrent_run(dag, rng, SCENARIO_CAPACITY)
