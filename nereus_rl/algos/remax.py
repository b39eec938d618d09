"""ReMax: REINFORCE with the greedy response's reward as the baseline, no critic.

For every prompt one extra response is decoded greedily; its score is the
baseline of the sampled response (Li et al. 2023). As in verl, a token's
advantage is its reward-to-go (the score on the last token plus any per-token KL
penalty, see :func:`nereus_rl.algos.ppo.kl_penalized_rewards`) minus the
baseline. The policy loss is the clipped surrogate, which at the first update
of a batch (ratio 1) has exactly the REINFORCE gradient.
"""

from __future__ import annotations

import torch

from nereus_rl.algos.common import aggregate_loss, clipped_policy_loss

__all__ = ["clipped_policy_loss", "reinforce_loss", "remax_advantages"]


def remax_advantages(
    token_rewards: torch.Tensor, greedy_scores: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Advantages [B, T]: reward-to-go of each token minus the greedy response's score.

    Arguments:
        token_rewards: [B, T] (the score on the last response token, optionally minus KL).
        greedy_scores: the greedy response's score for the same prompt [B].
        mask: response-token mask [B, T].

    Returns:
        Advantages, 0 on padding.
    """
    rewards = token_rewards * mask
    to_go = rewards.flip(-1).cumsum(-1).flip(-1)
    return (to_go - greedy_scores[:, None]) * mask


def reinforce_loss(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    agg: str = "token_mean",
    num_tokens: float | None = None,
) -> torch.Tensor:
    """Plain REINFORCE: ``-A_t * logp_t`` aggregated (see ``aggregate_loss``)."""
    return aggregate_loss(-advantages * logp, mask, agg, num_tokens)
