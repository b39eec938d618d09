"""The transition DAG compiler in C++: diff, simulation, refinement and completion time.

:func:`compile_native` is :func:`~nereus_rl.transition.compile.compile_transition` run
in ``nereus_rl._native`` (``csrc/rl/transition/``): the device checks, the plan diff,
the sequential simulation that orders, funds and anchors the primitives, the
list-schedule refinement and the predicted completion time. The C++ mirrors the Python
step for step (same orders, same float operations), so the DAG is identical field by
field; the golden fingerprints and ``tests/rl/transition/test_transition_native.py``
check both paths.
Inputs are read once from the current plan (or Placement) and the target plan.

What is lazy. The returned :class:`NativeTransitionDAG` is a :class:`TransitionDAG`
whose fields ``current``, ``target``, ``devices``, ``primitives``, ``edges``,
``order``, ``funding``, ``anchors``, ``early_destroys`` and ``unit_bytes`` are built
(in C++, from the compact result) on first access (:data:`LAZY_FIELDS`; a Placement
given as ``current`` is kept as is); everything that decides them has run by the time
the compile returns, so building them cannot fail or change them.
:func:`~nereus_rl.transition.paths.predicted_completion_time` of such a DAG, with the
compile's cost function or the default table, comes straight from C++ without building
them. At 1,024 devices building all of them costs about as much again as the compile
(``benchmarks/bench_transition_plan.py`` reports both times).

Costs and memory. The default table (:func:`~nereus_rl.transition.types.default_primitive_cost`)
is evaluated in C++ from the primitives' kinds and bytes (with the module's bandwidth
constants as they are at call time); any other ``cost_fn`` is called once per primitive
(the primitives are built for it) and the durations go to C++ as an array. A
``unit_memory`` declared with :func:`memory_by_layout` (the default and the scenarios'
ones) is called once per distinct (model, trains, tp, pp); any other once per unit.

Errors. When C++ reports that no DAG exists (a target device missing or lost, a state
would be lost, a device over capacity before or after, every acquisition blocked),
:func:`compile_native` returns :attr:`Fallback.RAISE`; the caller
(:func:`~nereus_rl.transition.compile.compile_transition`) then runs the Python compiler on
the same input, which raises its error with its exact message; nothing else has happened
by then. This module never calls the Python compiler itself.
"""

from __future__ import annotations

import dataclasses
import enum
import gc
from collections.abc import Callable, Collection, Mapping

import nereus_rl.transition.types as _tr
from nereus_rl.core.globalplan import GlobalPlan
from nereus_rl.transition.types import (
    CapacityLike,
    Edge,
    Funding,
    Placement,
    Primitive,
    PrimitiveCostFn,
    TransitionDAG,
    Unit,
    UnitMemoryFn,
    capacity_of,
    default_primitive_cost,
)

try:
    from nereus_rl import _native

    _HAVE = hasattr(_native, "transition_front")
except ImportError:  # the package runs without its compiled module (the Python path)
    _HAVE = False


class Fallback(enum.Enum):
    """Why :func:`compile_native` returned no DAG; either way the Python compiler then runs
    on the same input."""

    #: A created unit would reuse a current uid: the Python compiler compiles the DAG.
    COMPILE = "compile"
    #: C++ found that no DAG exists: the Python compiler raises the error, with its message.
    RAISE = "raise"


#: Raised when C++ found no DAG but the Python compiler compiled one.
DISAGREE = (
    "the native transition compiler found no DAG but the Python compiler compiled the "
    "same transition; report this as a bug"
)

#: The DAG fields built from the compiled result on first access.
LAZY_FIELDS = (
    "current",
    "target",
    "devices",
    "primitives",
    "edges",
    "order",
    "funding",
    "anchors",
    "early_destroys",
    "unit_bytes",
)

#: Unit-memory functions that depend only on a unit's (model, trains, tp, pp): called once
#: per distinct layout instead of once per unit. Add one with :func:`memory_by_layout`.
_BY_LAYOUT: set[Callable[..., float]] = set()


def available() -> bool:
    """True when ``nereus_rl._native`` has the compiled transition compiler."""
    return _HAVE


def memory_by_layout(fn: UnitMemoryFn) -> UnitMemoryFn:
    """Declare that ``fn(unit)`` depends only on ``(model, trains, tp, pp)``.

    The native path then calls it once per distinct layout, not once per unit.

    Arguments:
        fn: a unit-memory function.
    Returns:
        ``fn`` itself.
    """
    _BY_LAYOUT.add(fn)
    return fn


memory_by_layout(_tr.default_unit_memory)


class _Lazy:
    """A DAG field built from the compiled result on first access, then stored on the
    instance (a non-data descriptor: the stored value shadows it from then on)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, dag: object, owner: type | None = None) -> object:
        if dag is None:
            return self
        native = dag.__dict__["_native"]
        # Thousands of new tuples: pause the cyclic collector as the compile does (it
        # would scan them and free nothing; reference counting frees them all the same).
        was = gc.isenabled()
        gc.disable()
        try:
            value = self._build(native)
        finally:
            if was:
                gc.enable()
        dag.__dict__[self.name] = value
        return value

    def _build(self, native: object) -> object:
        if self.name in ("current", "target"):
            return _placement(getattr(native, f"{self.name}_units")())
        if self.name == "devices":
            return frozenset(native.exist_devices())  # type: ignore[attr-defined]
        if self.name == "primitives":
            return native.primitives(Primitive)  # type: ignore[attr-defined]
        if self.name == "edges":
            return native.edges(Edge)  # type: ignore[attr-defined]
        if self.name == "funding":
            return native.funding(Funding)  # type: ignore[attr-defined]
        return getattr(native, self.name)()


class NativeTransitionDAG(TransitionDAG):
    """A :class:`TransitionDAG` whose object fields are built from C++ on first access.

    Equal (``==``) to a :class:`TransitionDAG` with the same fields.
    """

    current = _Lazy()  # type: ignore[assignment]
    target = _Lazy()  # type: ignore[assignment]
    devices = _Lazy()  # type: ignore[assignment]
    primitives = _Lazy()  # type: ignore[assignment]
    edges = _Lazy()  # type: ignore[assignment]
    order = _Lazy()  # type: ignore[assignment]
    funding = _Lazy()  # type: ignore[assignment]
    anchors = _Lazy()  # type: ignore[assignment]
    early_destroys = _Lazy()  # type: ignore[assignment]
    unit_bytes = _Lazy()  # type: ignore[assignment]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TransitionDAG):
            return NotImplemented
        names = [f.name for f in dataclasses.fields(TransitionDAG)]
        return all(getattr(self, n) == getattr(other, n) for n in names)

    __hash__ = None  # type: ignore[assignment]

    def native_completion_time(self, cost_fn: PrimitiveCostFn) -> float | None:
        """The critical path by ``cost_fn`` from C++, when it needs no primitive objects.

        Returns:
            seconds, or None when ``cost_fn`` is neither the compile's cost function
            nor the default table (the caller then prices the primitives itself).
        """
        native = self.__dict__.get("_native")
        if native is None:
            return None
        if cost_fn is self.__dict__.get("_cost_fn") and native.has_durations:
            return native.completion_time_set()
        if cost_fn is default_primitive_cost:
            return native.completion_time(_table(native))
        return native.completion_time([float(cost_fn(p)) for p in self.primitives])


def _set_table(native: object) -> None:
    """Set the durations to the default cost table's, computed in C++."""
    native.set_table_durations(  # type: ignore[attr-defined]
        1.0, _tr.DEFAULT_EXTEND_BYTES_PER_S, 0.5, _tr.DEFAULT_RESHARD_BYTES_PER_S, 0.1
    )


def _table(native: object) -> list[float]:
    """The default cost table's durations, computed in C++ (restores the set ones)."""
    had = native.durations()  # type: ignore[attr-defined]
    _set_table(native)
    out = native.durations()  # type: ignore[attr-defined]
    if had:
        native.set_durations(had)  # type: ignore[attr-defined]
    return out


def placement_from_plan(plan: GlobalPlan) -> Placement:
    """``Placement.from_plan(plan)``, its units built in C++.

    Uids ``"<stage>#<i>"`` are unique by construction (GlobalPlan's stage names are
    unique and a stage's counter has no ``#``), so Placement's own uid check is skipped.
    """
    return _placement(_native.transition_units_from_plan(plan.stages, Unit))


def _placement(units: tuple[Unit, ...]) -> Placement:
    out = object.__new__(Placement)  # uids unique: made so by the diff or the plan
    object.__setattr__(out, "units", units)
    return out


def compile_native(
    current: Placement | GlobalPlan,
    target: GlobalPlan,
    *,
    devices: Collection[int] | None,
    lost_devices: Collection[int],
    unit_memory: UnitMemoryFn,
    capacity: CapacityLike,
    cost_fn: PrimitiveCostFn,
    refine: bool,
    stage_slots: bool,
) -> TransitionDAG | Fallback:
    """``compile_transition`` in C++: the same arguments, the same DAG.

    Returns:
        the DAG (a :class:`NativeTransitionDAG`); :attr:`Fallback.COMPILE` when a created
        unit would reuse a current uid (the Python compiler then compiles it);
        :attr:`Fallback.RAISE` when C++ reports that no DAG exists (the Python compiler,
        run by the caller on the same input, then raises the error with its message).
        Nothing raises here for an infeasible or lossy transition.
    """
    from_plan = not isinstance(current, Placement)
    native = _native.transition_front(
        current.stages if from_plan else current.units,
        from_plan,
        target.stages,
        None if devices is None else list(devices),
        list(lost_devices),
        Unit,
    )
    if native.status == -1:
        return Fallback.COMPILE
    if native.status != 0:
        return Fallback.RAISE
    # Capacity before memory, as the Python compiler reads them.
    cap, scalar = None, 0.0
    if isinstance(capacity, Mapping):
        try:
            cap = [capacity_of(capacity, d) for d in native.exist_devices()]
        except KeyError:
            return Fallback.RAISE  # the KeyError of the Python compiler's device order
    else:
        scalar = float(capacity)
    if unit_memory in _BY_LAYOUT:
        native.set_layout_memory([float(unit_memory(u)) for u in native.layout_units()])
    else:
        native.set_memory(list(map(float, map(unit_memory, native.memory_units()))))
    native.simulate(cap, scalar, stage_slots)
    if native.status != 0:
        return Fallback.RAISE
    if refine:
        if cost_fn is default_primitive_cost:
            _set_table(native)
        else:
            prims = native.primitives(Primitive)
            native.set_durations([float(cost_fn(p)) for p in prims])
        native.refine()
    dag = object.__new__(NativeTransitionDAG)
    set_ = object.__setattr__
    set_(dag, "_native", native)
    set_(dag, "_cost_fn", cost_fn if refine else None)
    if not from_plan:
        set_(dag, "current", current)
    set_(dag, "capacity", capacity)
    set_(dag, "stage_slots", stage_slots)
    if refine and cost_fn is not default_primitive_cost:
        set_(dag, "primitives", prims)
    return dag
