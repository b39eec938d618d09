"""The RL trainer: PPO, GRPO and ReMax on worker processes, adapting their layout as they run.

``train(...)`` is the entry point; :class:`Trainer` is the driver side of one run.
Inside: :mod:`.trainer` (the loop), :mod:`.config` (options, results, errors, fixed
plans), :mod:`.step` (a step's rollout and training work), :mod:`.group` (the workers as
the driver addresses them), :mod:`.units` (the state as EMU units, transitions run as
primitives), :mod:`.recover` and :mod:`.recover_check` (going on after a worker died),
:mod:`.calibrate` (startup probes), :mod:`.fallback` (the per-stage reshard's price),
:mod:`.adapt` (the decisions at safe boundaries), :mod:`.report` (the run folder); on
the workers, :mod:`.worker` (the commands), :mod:`.worker_state` (stage models and
their state) and :mod:`.worker_device` (devices, host copies, the move transport).
"""

from nereus_rl.trainer.config import (
    NotEnoughDevicesError,
    TrainConfig,
    TrainConfigError,
    TrainResult,
    UnknownAlgorithmError,
)
from nereus_rl.trainer.recover import RecoveryStateLostError
from nereus_rl.trainer.trainer import CapacityLostError, Trainer, train

__all__ = [
    "CapacityLostError",
    "NotEnoughDevicesError",
    "RecoveryStateLostError",
    "TrainConfig",
    "TrainConfigError",
    "TrainResult",
    "Trainer",
    "UnknownAlgorithmError",
    "train",
]
