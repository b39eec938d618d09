"""The exact planner: the memory-feasible GlobalPlan with the lowest predicted step latency.

:mod:`.planner` (``Planner``, ``plan``) runs the search, compiled (:mod:`.native`) or in
Python (:mod:`.reference`), over the stage tables (:mod:`.tables`), partition bounds
(:mod:`.bounds`), group tables (:mod:`.groups`) and depth-first search (:mod:`.search`),
or, on nodes that are not a power of two wide, priced as placed (:mod:`.placed`), and
places the result on devices (:mod:`.place`). Imports ``nereus_rl.core``,
``nereus_rl.costmodel`` and the compiled ``nereus_rl._native`` only (core <- costmodel <-
planner <- policy); importing it starts nothing.
"""

from nereus_rl.planner.planner import Planner, plan, planner_for
from nereus_rl.planner.tables import set_partitions
from nereus_rl.planner.types import (
    PlanInfeasibleError,
    PlanResult,
    PlanSpaceError,
    check_plan_space,
)

__all__ = [
    "PlanInfeasibleError",
    "PlanResult",
    "PlanSpaceError",
    "Planner",
    "check_plan_space",
    "plan",
    "planner_for",
    "set_partitions",
]
