"""Plain data and errors of the exact planner (see ``nereus_rl.planner.planner``): the result, the
plan-space check and the memory-infeasibility error."""

from __future__ import annotations

from dataclasses import dataclass, field

from nereus_rl.core.globalplan import GlobalPlan
from nereus_rl.core.workload import Workload
from nereus_rl.costmodel.costmodel import CostModel, StepEstimate


class PlanSpaceError(ValueError):
    """A plan outside the planner's plan space (a degree that is not a power of two)."""


def check_plan_space(plan: GlobalPlan) -> None:
    """Raise PlanSpaceError unless every stage's dp, tp and pp are powers of two.

    Raises:
        PlanSpaceError: names the stage and the degree.
    """
    for sp in plan.stages:
        for name in ("dp", "tp", "pp"):
            v = getattr(sp, name)
            if v & (v - 1):
                raise PlanSpaceError(
                    f"stage {sp.stage!r} has {name}={v}; the plan space needs powers of two "
                    "(1, 2, 4, ...): round it to one"
                )


class PlanInfeasibleError(ValueError):
    """No plan in the plan space fits device memory. Attributes give the figures.

    Attributes:
        needed_bytes: for each stage, the least bytes per device any layout needs.
        capacity_bytes: usable bytes per device.
        num_devices: devices available.
    """

    def __init__(self, msg: str, needed_bytes: dict[str, int], capacity_bytes: int, n: int):
        super().__init__(msg)
        self.needed_bytes = needed_bytes
        self.capacity_bytes = capacity_bytes
        self.num_devices = n


@dataclass(frozen=True)
class PlanResult:
    """The planner's answer.

    Attributes:
        plan: the best plan.
        latency_s: its predicted step latency (``CostModel.step_latency``'s total).
        estimate: the cost model's full estimate of it (computed on first use).
        k_best: up to k (step latency, plan) pairs, best first.
        timings: ``tables_ms`` (Pareto lists), ``bounds_ms`` (cheap and partition
            bounds), ``search_ms``, ``total_ms``, ``nodes`` (search nodes, the last
            group's depth-first nodes included), ``partitions`` (partitions searched),
            ``aligned`` (whether the placement is node-aligned; see ``planner``); for an
            asynchronous workload also ``priced`` (complete plans the overlapped search
            ranked; its nodes are added to ``nodes``).
    """

    plan: GlobalPlan
    latency_s: float
    k_best: tuple[tuple[float, GlobalPlan], ...] = field(repr=False)
    timings: dict[str, float] = field(repr=False)
    _costmodel: CostModel = field(repr=False, compare=False)
    _workload: Workload = field(repr=False, compare=False)

    @property
    def estimate(self) -> StepEstimate:
        est = self.__dict__.get("_estimate")
        if est is None:
            est = self._costmodel.step_latency(self.plan, self._workload)
            object.__setattr__(self, "_estimate", est)
        return est
