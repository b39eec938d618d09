"""Transitions: a plan change compiled into a DAG of EMU primitives, checked and run.

A plan change (current placement -> target GlobalPlan) becomes a DAG of Elastic Model
Unit primitives (``extend``, ``destroy``, ``split``, ``merge``) with data edges and
resource edges. Where each part lives:

- :mod:`.types`: units, placements, primitives, the DAG, the errors, default costs;
- :mod:`.diff`: what changes between two plans;
- :mod:`.compile`: the compiler (its simulation in :mod:`.simulate` and :mod:`.holders`,
  refined by :mod:`.refine`; the compiled path in :mod:`.native`);
- :mod:`.paths`: orders and critical paths;
- :mod:`.safety`: the safe-order check;
- :mod:`.execute`: the concurrent executor.

Pure computation: nothing here starts a process or opens a socket. Imports only
``nereus_rl.core`` and the compiled ``nereus_rl._native`` (core <- transition <- emu; the
policy layer prices transitions with it).
"""

from nereus_rl.transition.compile import compile_transition, transition_cost
from nereus_rl.transition.diff import TransitionDiff, diff_plans
from nereus_rl.transition.paths import longest_path, predicted_completion_time, topo_order
from nereus_rl.transition.types import (
    DEFAULT_CAPACITY,
    KINDS,
    CapacityLike,
    Edge,
    Funding,
    InfeasibleTargetError,
    Placement,
    Primitive,
    PrimitiveCostFn,
    StateLossError,
    TransitionDAG,
    TransitionError,
    TransitionExecutionError,
    Unit,
    UnitMemoryFn,
    UnsafeDAGError,
    capacity_of,
    default_primitive_cost,
    default_unit_memory,
)

__all__ = [
    "DEFAULT_CAPACITY",
    "KINDS",
    "CapacityLike",
    "Edge",
    "Funding",
    "InfeasibleTargetError",
    "Placement",
    "Primitive",
    "PrimitiveCostFn",
    "StateLossError",
    "TransitionDAG",
    "TransitionDiff",
    "TransitionError",
    "TransitionExecutionError",
    "Unit",
    "UnitMemoryFn",
    "UnsafeDAGError",
    "capacity_of",
    "compile_transition",
    "default_primitive_cost",
    "default_unit_memory",
    "diff_plans",
    "longest_path",
    "predicted_completion_time",
    "topo_order",
    "transition_cost",
]
