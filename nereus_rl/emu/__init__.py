"""Elastic Model Units on live workers: one replica of one model-stage, its devices and
its state, and the four primitives (Extend, Destroy, Split, Merge) that change them.

:mod:`.manager` (``EMUManager``: the driver side), :mod:`.primitives`, :mod:`.recover`
(capacity after lost workers), :mod:`.dag` (a transition DAG run on live units),
:mod:`.state` (state specs), :mod:`.arena` (workers' host memory), :mod:`.groups`
(pooled process groups), :mod:`.train` (a synthetic training step); the worker side
is :mod:`.worker` and :mod:`.comm`. Imports ``nereus_rl.core``, ``costmodel``,
``transition`` and ``runtime`` and nereus_comm's API (core <- transition <- emu <-
trainer).
"""

from nereus_rl.emu.arena import ArenaExhaustedError
from nereus_rl.emu.dag import live_impls, run_primitive
from nereus_rl.emu.groups import DriverGroupBackend
from nereus_rl.emu.manager import EMUManager
from nereus_rl.emu.state import reference_state, stage_state_specs, synthetic, with_training_state
from nereus_rl.emu.types import EMU, EMUError, EMUStateLostError, PrimitiveRecord, StageState

__all__ = [
    "EMU",
    "ArenaExhaustedError",
    "DriverGroupBackend",
    "EMUError",
    "EMUManager",
    "EMUStateLostError",
    "PrimitiveRecord",
    "StageState",
    "live_impls",
    "reference_state",
    "run_primitive",
    "stage_state_specs",
    "synthetic",
    "with_training_state",
]
