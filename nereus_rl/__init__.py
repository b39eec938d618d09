"""nereus_rl: elastic RL post-training on top of nereus_comm.

``nereus_rl.train(...)`` runs PPO, GRPO or ReMax on worker processes and adapts the
job's layout as it runs (see :mod:`nereus_rl.trainer`).

Subpackages, by layer (dependencies point one way; tests/test_layering.py checks it):

- the decision layer, pure computation that imports without starting anything:
  ``core`` (plans, specs, workloads) <- ``costmodel`` <- ``planner`` <- ``policy``;
  ``core`` <- ``transition`` (the DAG of primitives); ``baselines`` (MILP and
  per-component baselines, for tests and benchmarks);
- the worker side: ``runtime`` (processes and commands), ``emu`` (Elastic Model Units),
  ``models`` (the TP/PP decoder), ``data`` (tasks), ``algos`` (PPO, GRPO, ReMax);
- ``trainer``: the RL loop that uses all of them, and ``cli``.
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
