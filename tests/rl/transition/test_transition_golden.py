"""The compiler's speed work must not change a single DAG: fingerprints pin them.

``transition_golden.json`` holds transitions (current and target plans, devices,
lost devices, capacity) and, for each and each of three option sets, a
fingerprint of the DAG that ``compile_transition`` gave before the
planning-speed work (or the error it raised). Every field of the DAG counts:
primitives with their sources, edges with their reasons, the safe order, the
funding certificate, anchors, early destroys and the memory table. The inputs
are stored, not drawn, so a change to the scenario generators cannot move them.

To re-record after an intended change of the compiler's output (say why in the
commit): ``PYTHONPATH=. python tests/rl/transition/test_transition_golden.py --record``.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import random
import sys

import pytest

from nereus_rl.core.globalplan import GlobalPlan, StagePlan
from nereus_rl.transition import TransitionDAG, TransitionError, compile_transition
from nereus_rl.transition import native as transition_native

GOLDEN = pathlib.Path(__file__).with_name("transition_golden.json")


def fingerprint(dag: TransitionDAG) -> str:
    """A hash of every field of ``dag``."""
    parts = [
        repr(dag.current.units),
        repr(dag.target.units),
        repr([tuple(p) for p in dag.primitives]),
        repr(list(dag.edges)),
        repr(dag.order),
        repr(dag.funding),
        repr(dag.anchors),
        repr(dag.early_destroys),
        repr(sorted(dag.devices)),
        repr(dag.unit_bytes),
        repr(dag.stage_slots),
        repr(dag.capacity),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def _plan_json(plan: GlobalPlan) -> list:
    return [
        [s.stage, s.model, s.trains, s.tp, s.pp, [list(u) for u in s.units]] for s in plan.stages
    ]


def _plan(rows: list) -> GlobalPlan:
    return GlobalPlan(
        tuple(
            StagePlan(st, model, trains, len(units), tp, pp, tuple(tuple(u) for u in units))
            for st, model, trains, tp, pp, units in rows
        )
    )


def _unit_memory(u) -> float:
    # The scenarios' memory model, written out so the recorded inputs stand alone.
    return 8e9 * (3.0 if u.trains else 1.0) / (u.tp * u.pp)


OPTIONS = ({}, {"stage_slots": False}, {"refine": False})


def outcome(case: dict, options: dict, native: bool | None = None) -> str:
    """The compiled DAG's fingerprint, or the error's type and a hash of its message.

    ``native``: as ``compile_transition`` (False: the Python compiler; True: C++).
    """
    try:
        dag = compile_transition(
            _plan(case["current"]),
            _plan(case["target"]),
            devices=case["devices"],
            lost_devices=case["lost"],
            unit_memory=_unit_memory,
            capacity=case["capacity"],
            native=native,
            **options,
        )
    except TransitionError as e:
        return f"{type(e).__name__}: {hashlib.sha256(str(e).encode()).hexdigest()[:20]}"
    return fingerprint(dag)


def _cases() -> list[dict]:
    """The recorded inputs: scaled rebalances and random transitions of every type."""
    from nereus_rl.baselines.scenarios import (
        SCALED_CAPACITY,
        SCENARIO_CAPACITY,
        TRANSITION_TYPES,
        random_scenario,
        scaled_scenario,
    )

    def case(name, sc, capacity):
        return {
            "name": name,
            "current": _plan_json(sc.current),
            "target": _plan_json(sc.target),
            "devices": sorted(sc.devices),
            "lost": sorted(sc.lost),
            "capacity": capacity,
        }

    out = []
    for n in (32, 64):
        out.append(case(f"scaled{n}", scaled_scenario(n), SCALED_CAPACITY))
    rng = random.Random(7)
    for kind in TRANSITION_TYPES:
        for i in range(20):
            nd = rng.choice((8, 12))
            try:
                sc = random_scenario(
                    kind, rng, nd, min_fill=rng.choice((0.0, 0.5)), max_dp=rng.choice((3, 4))
                )
            except AssertionError:
                continue
            out.append(case(f"{kind}{i}", sc, SCENARIO_CAPACITY))
    return out


def _golden() -> list[dict]:
    return json.loads(GOLDEN.read_text())["cases"]


def test_recorded_cases_cover_every_outcome():
    wants = [w for c in _golden() for w in c["want"]]
    dags = sum(1 for w in wants if ":" not in w)
    assert len(wants) > 250 and dags > 150 and len(wants) - dags > 50  # both kinds are tested


@pytest.mark.parametrize("part", range(4))
@pytest.mark.parametrize(
    "native",
    [
        pytest.param(False, id="python"),
        pytest.param(
            True,
            id="native",
            marks=pytest.mark.skipif(
                not transition_native.available(), reason="nereus_rl._native not built"
            ),
        ),
    ],
)
def test_dags_match_the_recorded_fingerprints(part, native):
    cases = _golden()[part::4]
    wrong = [
        f"{c['name']} {opts}"
        for c in cases
        for opts, want in zip(OPTIONS, c["want"])
        if outcome(c, opts, native) != want
    ]
    assert not wrong, f"{len(wrong)} of {3 * len(cases)} DAGs changed, e.g. {wrong[:5]}"


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit(__doc__)
    cases = _cases()
    for c in cases:
        c["want"] = [outcome(c, opts, native=False) for opts in OPTIONS]
    GOLDEN.write_text(json.dumps({"cases": cases}, separators=(",", ":")) + "\n")
    print(f"recorded {len(cases)} cases to {GOLDEN}")
