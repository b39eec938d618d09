"""The C++ transition compiler gives the Python compiler's DAG, field by field.

Random transitions of every type (dense and sparse, with and without refinement and
stage slots), a cost function that is not the default table, a per-device capacity,
a Placement with its own uids, and the error paths: on each, both paths must give
equal DAGs (every field), equal predicted completion times, or errors of the same
type with the same message.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from nereus_rl.baselines.scenarios import (
    SCALED_CAPACITY,
    SCENARIO_CAPACITY,
    TRANSITION_TYPES,
    random_scenario,
    scaled_scenario,
    scenario_unit_memory,
)
from nereus_rl.core.globalplan import GlobalPlan, StagePlan
from nereus_rl.transition import (
    Placement,
    TransitionDAG,
    TransitionError,
    Unit,
    compile_transition,
    default_primitive_cost,
    predicted_completion_time,
)
from nereus_rl.transition import native as transition_native

pytestmark = pytest.mark.skipif(
    not transition_native.available(), reason="nereus_rl._native has no transition compiler"
)

FIELDS = [f.name for f in dataclasses.fields(TransitionDAG)]


def _both(current, target, **kw):
    """Compile on both paths: (python, native), each a DAG or (error type, message)."""
    out = []
    for native in (False, True):
        try:
            out.append(compile_transition(current, target, native=native, **kw))
        except TransitionError as e:
            out.append((type(e).__name__, str(e)))
    return out


def _assert_same(py, nat, where: str, cost_fn=default_primitive_cost) -> None:
    if isinstance(py, tuple) or isinstance(nat, tuple):
        assert py == nat, f"{where}: python {py!r} but native {nat!r}"
        return
    assert isinstance(nat, transition_native.NativeTransitionDAG), where
    t_nat = predicted_completion_time(nat, cost_fn)  # from C++, before any field is built
    assert t_nat == predicted_completion_time(py, cost_fn), where
    for name in FIELDS:
        assert getattr(py, name) == getattr(nat, name), f"{where}: field {name} differs"
    assert nat == py and py == nat


def _cost(prim) -> float:
    """Not the default table: an arbitrary callable, so the native path calls it."""
    return 0.3 + 0.7 * len(prim.inputs) + sum(b for _, b in prim.acquire) / 7e9


@pytest.mark.parametrize("kind", TRANSITION_TYPES)
def test_random_transitions_match_the_python_compiler(kind):
    rng = random.Random(101 + TRANSITION_TYPES.index(kind))
    for i in range(25):
        try:
            sc = random_scenario(
                kind, rng, rng.choice((8, 12)), min_fill=rng.choice((0.0, 0.5)), max_dp=4
            )
        except AssertionError:  # the generator found no scenario of this kind
            continue
        options = rng.choice(({}, {"stage_slots": False}, {"refine": False}, {"cost_fn": _cost}))
        py, nat = _both(
            sc.current,
            sc.target,
            devices=sc.devices,
            lost_devices=sc.lost,
            unit_memory=scenario_unit_memory,
            capacity=SCENARIO_CAPACITY,
            **options,
        )
        _assert_same(py, nat, f"{kind} {i} {options}", options.get("cost_fn", _cost))


def test_scaled_transition_matches_with_per_device_capacity_and_plain_memory():
    sc = scaled_scenario(128)
    cap = {d: SCALED_CAPACITY * (1.0 + (d % 3) / 10) for d in sc.devices}
    mem = lambda u: 6e9 * (2.5 if u.trains else 1.0) / (u.tp * u.pp)  # noqa: E731
    py, nat = _both(sc.current, sc.target, devices=sc.devices, unit_memory=mem, capacity=cap)
    _assert_same(py, nat, "scaled128")


def _plan(*stages) -> GlobalPlan:
    return GlobalPlan(tuple(stages))


def _sp(stage, model, trains, tp, units) -> StagePlan:
    return StagePlan(stage, model, trains, len(units), tp, 1, tuple(units))


def test_placement_with_own_uids_and_a_reused_half_uid():
    # "r0a" is what the relayout of r0 names its first half: the native path hands such
    # a transition to the Python compiler, and the DAGs still agree.
    cur = Placement(
        (
            Unit("r0", "rollout", "actor", False, 2, 1, (0, 1)),
            Unit("r0a", "rollout", "actor", False, 1, 1, (2,)),
            Unit("t0", "train", "actor", True, 1, 1, (3,)),
        )
    )
    tgt = _plan(
        _sp("rollout", "actor", False, 1, [(1,), (0,), (2,)]),
        _sp("train", "actor", True, 1, [(3,)]),
    )
    py, nat = _both(cur, tgt, capacity=SCENARIO_CAPACITY, unit_memory=scenario_unit_memory)
    assert not isinstance(py, tuple)
    assert py == nat
    cur2 = Placement(tuple(u._replace(uid=f"x{i}") for i, u in enumerate(cur.units)))
    py, nat = _both(cur2, tgt, capacity=SCENARIO_CAPACITY, unit_memory=scenario_unit_memory)
    _assert_same(py, nat, "own uids")


def test_errors_are_the_python_compilers():
    cur = _plan(_sp("rollout", "actor", False, 1, [(0,), (1,)]), _sp("t", "actor", True, 1, [(2,)]))
    cases = {
        "state loss": _plan(_sp("rollout", "actor", False, 1, [(0,)])),
        "missing device": _plan(
            _sp("rollout", "actor", False, 1, [(9,)]), _sp("t", "actor", True, 1, [(2,)])
        ),
        "over capacity": _plan(
            _sp("rollout", "actor", False, 1, [(0,), (1,)]), _sp("t", "actor", True, 1, [(0,)])
        ),
        "swap": _plan(
            _sp("rollout", "actor", False, 1, [(2,), (1,)]), _sp("t", "actor", True, 1, [(0,)])
        ),
    }
    for name, tgt in cases.items():
        py, nat = _both(cur, tgt, capacity=20e9, unit_memory=scenario_unit_memory)
        assert isinstance(py, tuple), name
        assert py == nat, name
        # The compiled path raises nothing itself: it hands the input back, and the Python
        # compiler (run by compile_transition) raises.
        got = transition_native.compile_native(cur, tgt, **_native_kw(20e9))
        assert got is transition_native.Fallback.RAISE, name


def test_a_native_no_dag_that_python_compiles_is_a_bug(monkeypatch):
    # C++ says no DAG exists but the Python compiler compiles one: the two disagree, and
    # compile_transition says so instead of returning either answer.
    cur = _plan(_sp("rollout", "actor", False, 1, [(0,), (1,)]), _sp("t", "actor", True, 1, [(2,)]))
    tgt = _plan(_sp("rollout", "actor", False, 1, [(1,), (0,)]), _sp("t", "actor", True, 1, [(2,)]))
    kw = {"capacity": 40e9, "unit_memory": scenario_unit_memory}
    compile_transition(cur, tgt, native=True, **kw)  # feasible
    fallback = transition_native.Fallback.RAISE
    monkeypatch.setattr(transition_native, "compile_native", lambda *a, **k: fallback)
    with pytest.raises(AssertionError, match="report this as a bug"):
        compile_transition(cur, tgt, native=True, **kw)


def _native_kw(capacity) -> dict:
    return {
        "devices": None,
        "lost_devices": (),
        "unit_memory": scenario_unit_memory,
        "capacity": capacity,
        "cost_fn": default_primitive_cost,
        "refine": True,
        "stage_slots": True,
    }


def test_devices_given_as_one_shot_iterables():
    sc = scaled_scenario(32)
    kw = {"unit_memory": scenario_unit_memory, "capacity": SCALED_CAPACITY}
    want = compile_transition(sc.current, sc.target, devices=sc.devices, native=False, **kw)
    got = compile_transition(
        sc.current, sc.target, devices=iter(sc.devices), lost_devices=iter(()), **kw
    )
    assert got == want
