"""The RL algorithms' losses and advantages: PPO, GRPO and ReMax, as pure tensor functions.

:mod:`.common` (masked reductions, KL estimators, the clipped policy loss, loss
aggregation), :mod:`.ppo` (GAE, value loss), :mod:`.grpo` (group-relative advantages)
and :mod:`.remax` (greedy-baseline advantages). Imports nothing of nereus_rl; the
trainer uses it.
"""

from nereus_rl.algos.common import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    aggregate_loss,
    clipped_policy_loss,
    kl_estimate,
    masked_mean,
    masked_sum,
    masked_whiten,
)
from nereus_rl.algos.grpo import group_advantages, grpo_loss
from nereus_rl.algos.ppo import gae, kl_penalized_rewards, value_loss
from nereus_rl.algos.remax import reinforce_loss, remax_advantages

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "aggregate_loss",
    "clipped_policy_loss",
    "gae",
    "group_advantages",
    "grpo_loss",
    "kl_estimate",
    "kl_penalized_rewards",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "reinforce_loss",
    "remax_advantages",
    "value_loss",
]
