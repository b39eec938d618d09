"""Baselines the transition DAG and the planner are compared against, and the scenarios
that drive those comparisons: for tests and benchmarks, not for a job.

:mod:`.migration` (per-component migration, DynaRL-style), :mod:`.transition_milp`
(CP-SAT scheduling of a transition), :mod:`.planner_milp` (the planner's problem for
SCIP and CP-SAT) and :mod:`.scenarios` (random plan changes). Imports ``nereus_rl.core``,
``costmodel``, ``planner`` and ``transition`` only. The MILP names load OR-Tools on first
use, so the scenarios import without it.
"""

from typing import TYPE_CHECKING, Any

from nereus_rl.baselines.migration import BaselineResult, run_per_component
from nereus_rl.baselines.scenarios import (
    SCALED_CAPACITY,
    SCENARIO_CAPACITY,
    TRANSITION_TYPES,
    Scenario,
    compile_scenario,
    random_plan,
    random_scenario,
    scaled_scenario,
    scenario_unit_memory,
)
from nereus_rl.baselines.transition_milp import ScheduleResult, schedule_cpsat

if TYPE_CHECKING:
    from nereus_rl.baselines.planner_milp import MilpResult, solve_cpsat, solve_scip

_MILP = ("MilpResult", "solve_cpsat", "solve_scip")

__all__ = [
    "SCALED_CAPACITY",
    "SCENARIO_CAPACITY",
    "TRANSITION_TYPES",
    "BaselineResult",
    "MilpResult",
    "Scenario",
    "ScheduleResult",
    "compile_scenario",
    "random_plan",
    "random_scenario",
    "run_per_component",
    "scaled_scenario",
    "scenario_unit_memory",
    "schedule_cpsat",
    "solve_cpsat",
    "solve_scip",
]


def __getattr__(name: str) -> Any:
    # Lazy: planner_milp imports OR-Tools' solvers (about half a second) at module level.
    if name in _MILP:
        from nereus_rl.baselines import planner_milp

        return getattr(planner_milp, name)
    raise AttributeError(f"module 'nereus_rl.baselines' has no attribute {name!r}")
