"""nereus_rl: elastic RL post-training on top of nereus_comm.

``nereus_rl.train(...)`` runs PPO, GRPO or ReMax on worker processes and adapts the
job's layout as it runs (see :mod:`nereus_rl.trainer.trainer`). The decision layer (spec,
workload, costmodel, planner, admission, controller) and the transition DAG are pure
computation and import without starting anything.
"""

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["TrainConfig", "TrainResult", "train"]

if TYPE_CHECKING:
    from nereus_rl.trainer.trainer import TrainConfig, TrainResult, train


def __getattr__(name: str) -> Any:
    # Lazy: importing the planner must not pull in the trainer, its runtime and torch.distributed.
    if name in __all__:
        from nereus_rl.trainer import trainer as trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'nereus_rl' has no attribute {name!r}")
