"""The transition DAG compiler: the entry point, and the choice among refinements.

Three steps, each in its own module: the plan diff
(:mod:`nereus_rl.transition.diff`) decides which units stay, split, merge,
extend or go; the sequential simulation (:mod:`nereus_rl.transition.simulate`,
with its live-unit indexes in :mod:`nereus_rl.transition.holders`) orders the
primitives, funds every acquisition and anchors every destroy, which gives an
acyclic DAG with a certificate that any topological execution is safe; finally
:mod:`nereus_rl.transition.refine` re-derives the resource edges from a list
schedule by predicted cost, and the faster of the DAGs is returned. The
refinement is skipped (or stopped) once a DAG meets its
:func:`~nereus_rl.transition.refine.makespan_lower_bound`, a completion time no
safe schedule of the same primitives can beat.

Planning time. The goal is the paper's 1.22 ms at 1,024 devices. The Python
compiler here is the exact one (indexes local to the devices a primitive touches,
C-level iteration, the DAG's own order reused as its topological order, the cyclic
garbage collector paused), pinned to the DAGs it gave before by fingerprints
(``tests/rl/transition/test_transition_golden.py``); in CPython it cannot reach the goal (merely
building the returned objects at 1,024 devices costs about a millisecond). So by
default the same algorithm runs in C++ (:mod:`nereus_rl.transition.native`,
``csrc/rl/transition/``), step for step, giving the same DAG field by field (the golden
fingerprints and ``tests/rl/transition/test_transition_native.py`` check both paths), with the DAG's
Python objects built on first access; ``native=False`` keeps this module's Python
compiler as the reference. Compiling one block of a symmetric transition and
replicating it was not taken: the compiler's choices couple blocks that share no device
(extends copy round-robin from holders anywhere, destroys anchor on holders anywhere,
and the acquisition order and the refinement's choice are global), so a replicated DAG
would differ from the general compiler's. ``benchmarks/bench_transition_plan.py`` times
both compilers.

Errors come from the Python compiler on both paths: when C++ finds that no DAG exists it
returns without one (:class:`~nereus_rl.transition.native.Fallback`), and the Python
compiler then runs on the same input and raises its error with its exact message.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Collection, Iterator
from contextlib import contextmanager

from nereus_rl.core.globalplan import GlobalPlan, fmt_devices
from nereus_rl.transition import native as transition_native
from nereus_rl.transition.diff import diff_plans
from nereus_rl.transition.paths import longest_path, predicted_completion_time
from nereus_rl.transition.refine import makespan_lower_bound, refine_by_list_schedule
from nereus_rl.transition.simulate import Simulation
from nereus_rl.transition.types import (
    DEFAULT_CAPACITY,
    CapacityLike,
    InfeasibleTargetError,
    Placement,
    PrimitiveCostFn,
    TransitionDAG,
    UnitMemoryFn,
    default_primitive_cost,
    default_unit_memory,
)

_TOL = 1e-3  # bytes: slack for float sums of memory


def compile_transition(
    current: Placement | GlobalPlan,
    target: GlobalPlan,
    *,
    devices: Collection[int] | None = None,
    lost_devices: Collection[int] = (),
    unit_memory: UnitMemoryFn = default_unit_memory,
    capacity: CapacityLike = DEFAULT_CAPACITY,
    cost_fn: PrimitiveCostFn = default_primitive_cost,
    refine: bool = True,
    stage_slots: bool = True,
    native: bool | None = None,
) -> TransitionDAG:
    """Compile the change ``current -> target`` into a deadlock-free DAG of primitives.

    Arguments:
        current: the live units (or the plan they were made from).
        target: the plan to reach; its stage order is the tie-break.
        devices: the devices that exist after the change (default: every device of
            ``current`` and ``target``); lost devices are removed from it. Devices of
            ``current`` not in it leave gracefully: their units are destroyed.
        lost_devices: devices that died; units on them are lost and destroyed first.
        unit_memory: bytes per device a unit holds (the cost model's estimate plugs in).
        capacity: memory per device, one number or a mapping device -> bytes.
        cost_fn: predicted seconds per primitive (the cost model's estimate plugs in).
        refine: also re-derive the resource edges from a list schedule by ``cost_fn``
            (:mod:`nereus_rl.transition.refine`) and keep the DAG that finishes sooner.
        stage_slots: a device serves at most one unit of each stage at a time. False
            lets a new unit share devices with an old unit of its stage while memory
            allows (needed, e.g., to grow the tp of a stage with a single unit).
        native: run the simulation, refinement and completion time in C++
            (:mod:`nereus_rl.transition.native`; the same DAG, its object fields built
            on first access). None (default): when ``nereus_rl._native`` has it; False:
            the Python compiler, the reference; True: require it. When C++ finds no
            DAG, the Python compiler runs on the same input and raises the error.
    Returns:
        the DAG, with a safe order and the funding certificate.
    Raises:
        InfeasibleTargetError: the target uses devices that do not exist (or are lost),
            a device's target memory exceeds its capacity, the current units already
            exceed it, or no order reaches the target without overfilling a device.
        StateLossError: the target would lose a state (see :func:`diff_plans`).
    """
    if native is None:
        native = transition_native.available()
    elif native and not transition_native.available():
        raise RuntimeError(
            "compile_transition(native=True): nereus_rl._native has no transition "
            "compiler; rebuild it (python setup.py build_ext --inplace) or pass native=None"
        )
    with _gc_paused():
        if native:
            # The native path reads these once and may hand them on to the Python path:
            # a one-shot iterable must survive that.
            if devices is not None and not isinstance(devices, Collection):
                devices = list(devices)
            if not isinstance(lost_devices, Collection):
                lost_devices = list(lost_devices)
            got = transition_native.compile_native(
                current,
                target,
                devices=devices,
                lost_devices=lost_devices,
                unit_memory=unit_memory,
                capacity=capacity,
                cost_fn=cost_fn,
                refine=refine,
                stage_slots=stage_slots,
            )
            if not isinstance(got, transition_native.Fallback):
                return got
            # No DAG from C++: the Python compiler below runs on the same input. After
            # Fallback.RAISE it raises the error C++ found, with its exact message.
            must_raise = got is transition_native.Fallback.RAISE
        else:
            must_raise = False
        cur = current if isinstance(current, Placement) else Placement.from_plan(current)
        lost_set = frozenset(lost_devices)
        cur_devices = cur.devices
        # target.devices, with the units' devices gathered in C
        stage_units = (sp.units for sp in target.stages)
        target_devices = frozenset(itertools.chain.from_iterable(itertools.chain(*stage_units)))
        given = frozenset(devices) if devices is not None else cur_devices | target_devices
        after = given - lost_set
        # Devices that leave gracefully still hold their units until those are destroyed.
        exist = after | (cur_devices - lost_set)
        missing = sorted(target_devices - after)
        if missing:
            stages = [sp.stage for sp in target.stages if sp.devices.intersection(missing)]
            raise InfeasibleTargetError(
                f"target plan needs {len(target_devices)} devices but devices "
                f"{fmt_devices(missing)} (used by {stages}) do not exist or are lost; "
                f"{len(after)} devices exist ({fmt_devices(sorted(after))}): plan over those"
            )
        diff = diff_plans(cur, target, lost_devices=lost_set)
        sim = Simulation(cur, diff, target, exist, lost_set, unit_memory, capacity, stage_slots)
        dag = sim.run()
        if must_raise:
            raise AssertionError(transition_native.DISAGREE)
        if not refine:
            return dag
        return _refine(dag, cost_fn)


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for one compile.

    A compile allocates tens of thousands of small acyclic objects (units, tuples,
    dicts, funding records): at 1,024 devices the collector would scan them about 25
    times and free nothing, a tenth of the compile's time; reference counting frees
    them all the same. The collector resumes (if it ran before) even on an error, and
    its pending young-generation pass then runs once.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _refine(dag: TransitionDAG, cost_fn: PrimitiveCostFn, repairs: int = 3) -> TransitionDAG:
    """The fastest of the compiled DAG and its list-schedule refinements.

    After the plain priority rules (with and without memory reservation), a few repair
    rounds boost the primitives whose start on the critical path waits on a resource
    edge, so that they take the freed memory before primitives with slack do; a round
    that does not help ends the search, and so does reaching the lower bound.
    """
    dur = [float(cost_fn(p)) for p in dag.primitives]
    best, (best_t, path) = dag, longest_path(dag, dur)
    kinds = {(e.src, e.dst): e.kind for e in dag.edges}
    if all(kinds.get(ab) == "data" for ab in itertools.pairwise(path)):
        return dag  # the critical path is data edges only: no schedule can be shorter
    bound = makespan_lower_bound(dag, dur)
    if best_t <= bound + 1e-9:
        return dag  # already optimal for these primitives: refinement cannot help
    for priority, reserve in (("bottom", False), ("order", False), ("bottom", True)):
        alt = refine_by_list_schedule(dag, cost_fn, priority, reserve=reserve)
        if alt is not None:
            t, _ = longest_path(alt, dur)
            if t < best_t - 1e-12:
                best, best_t = alt, t
                if best_t <= bound + 1e-9:
                    return best
    boost = [0.0] * len(dag.primitives)
    for _ in range(repairs):
        _, path = longest_path(best, dur)
        kinds = {(e.src, e.dst): e.kind for e in best.edges}
        waits = [b for a, b in itertools.pairwise(path) if kinds.get((a, b)) == "resource"]
        if not waits:
            break
        for p in waits:
            boost[p] += best_t
        improved = False
        for reserve in (False, True):
            alt = refine_by_list_schedule(dag, cost_fn, "bottom", boost, reserve=reserve)
            if alt is None:
                continue
            t, _ = longest_path(alt, dur)
            if t < best_t - 1e-12:
                best, best_t, improved = alt, t, True
        if not improved or best_t <= bound + 1e-9:
            break
    return best


def transition_cost(
    current: Placement | GlobalPlan,
    target: GlobalPlan,
    *,
    cost_fn: PrimitiveCostFn = default_primitive_cost,
    **compile_kwargs: object,
) -> float:
    """Predicted seconds to change ``current`` into ``target``: what admission weighs.

    Arguments:
        current: the live units (or their plan).
        target: the plan to reach.
        cost_fn: predicted seconds per primitive (the cost model's ``primitive_cost``).
        compile_kwargs: passed to :func:`compile_transition` (devices, lost_devices,
            unit_memory, capacity, stage_slots).
    Returns:
        the compiled DAG's critical-path length under ``cost_fn``.
    Raises:
        InfeasibleTargetError, StateLossError: as :func:`compile_transition`.
    """
    dag = compile_transition(current, target, cost_fn=cost_fn, **compile_kwargs)  # type: ignore[arg-type]
    return predicted_completion_time(dag, cost_fn)
