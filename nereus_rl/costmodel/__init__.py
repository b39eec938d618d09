"""The cost model: predicted step latency and per-device memory of a GlobalPlan, the
cost of each EMU primitive, and their refinement from measurements.

:mod:`.costmodel` (``CostModel``), :mod:`.work` (the work and memory of a stage's
layout), :mod:`.overlap` (an asynchronous step), :mod:`.primitives` (Extend, Destroy,
Split, Merge), :mod:`.step_overhead` and :mod:`.shape_correction` (per-step costs the
work model leaves out), :mod:`.calibration` (error and noise bounds), :mod:`.vec` (many
layouts at once). Imports only ``nereus_rl.core`` (core <- costmodel <- planner <-
policy); importing it starts nothing.
"""

from nereus_rl.costmodel.calibration import ModelTolerance, StepNoise, TransitionCalibration
from nereus_rl.costmodel.costmodel import (
    DEFAULT_EFFICIENCY,
    CostModel,
    StageEstimate,
    StepEstimate,
    compose_step,
    stage_tiers,
)
from nereus_rl.costmodel.overlap import overlapped_step, own_seconds, rollout_slack
from nereus_rl.costmodel.primitives import PrimitiveCost, PrimitiveCostModel, UnitLayout
from nereus_rl.costmodel.shape_correction import ShapeCorrection
from nereus_rl.costmodel.step_overhead import PricedModel, StepOverhead
from nereus_rl.costmodel.work import (
    CostModelError,
    stage_memory,
    stage_work,
    state_bytes,
    sync_work,
)

__all__ = [
    "DEFAULT_EFFICIENCY",
    "CostModel",
    "CostModelError",
    "ModelTolerance",
    "PricedModel",
    "PrimitiveCost",
    "PrimitiveCostModel",
    "ShapeCorrection",
    "StageEstimate",
    "StepEstimate",
    "StepNoise",
    "StepOverhead",
    "TransitionCalibration",
    "UnitLayout",
    "compose_step",
    "overlapped_step",
    "own_seconds",
    "rollout_slack",
    "stage_memory",
    "stage_tiers",
    "stage_work",
    "state_bytes",
    "sync_work",
]
