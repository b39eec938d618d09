"""PPO for language models: KL-penalized token rewards, GAE, clipped policy and value losses.

Departures from the textbook: the environment gives one score per response, placed
on its last token; every token also pays ``kl_coef * KL`` to the reference policy
(estimated per token with k1 by default), as in InstructGPT and verl. The critic
is a value-head copy of the model and its values are read at each response token.
"""

from __future__ import annotations

import torch

from nereus_rl.algos.common import (
    aggregate_loss,
    clipped_policy_loss,
    kl_estimate,
    masked_mean,
    masked_whiten,
)

__all__ = ["clipped_policy_loss", "gae", "kl_penalized_rewards", "value_loss"]


def kl_penalized_rewards(
    scores: torch.Tensor,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_coef: float,
    kl_estimator: str = "k1",
) -> torch.Tensor:
    """Token rewards [B, T]: ``-kl_coef * KL_t`` on every response token, plus the
    sequence's score on its last response token.

    Arguments:
        scores: one reward per sequence [B].
        logp, ref_logp: sampled tokens' log-probs under the policy and the reference [B, T].
        mask: response-token mask [B, T] (right-padded: ones then zeros).
        kl_coef: KL penalty coefficient (0 turns it off).
        kl_estimator: "k1", "k2" or "k3" (see :func:`nereus_rl.algos.common.kl_estimate`).

    Returns:
        Token rewards, 0 on padding.
    """
    rewards = -kl_coef * kl_estimate(logp, ref_logp, kl_estimator) * mask
    last = (mask.sum(-1).long() - 1).clamp(min=0)
    has_tokens = mask.sum(-1) > 0
    rewards = rewards.clone()
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, last] += scores * has_tokens
    return rewards


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    whiten: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over response tokens.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``,
    where the value and advantage after the last response token are 0 (the episode ends).

    Arguments:
        rewards: token rewards [B, T].
        values: critic values at each token [B, T] (no gradient is taken).
        mask: response-token mask [B, T] (right-padded).
        gamma: discount.
        lam: GAE lambda.
        whiten: normalize advantages over the masked tokens (returns are not).

    Returns:
        (advantages, returns) [B, T]; returns = advantages + values (before whitening);
        both 0 on padding.
    """
    values = values.detach() * mask
    rewards = rewards * mask
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    advs = []
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = (delta + gamma * lam * next_adv) * m
        advs.append(adv)
        # A padded position passes nothing back: the next real token sees V=0, A=0.
        next_value = values[:, t] * m
        next_adv = adv
    advantages = torch.stack(advs[::-1], dim=1)
    returns = (advantages + values) * mask
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    agg: str = "token_mean",
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss: ``0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)``.

    Arguments:
        values: current critic values [B, T] (differentiable).
        old_values: values at rollout time [B, T].
        returns: targets [B, T] (from :func:`gae`).
        mask: response-token mask.
        clip_eps: how far values may move from ``old_values`` before the clipped term rules.
        agg, num_tokens: see :func:`nereus_rl.algos.common.aggregate_loss`.

    Returns:
        (loss, stats) with ``vf_clipfrac``.
    """
    clipped_values = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    unclipped = (values - returns) ** 2
    clipped = (clipped_values - returns) ** 2
    loss = 0.5 * aggregate_loss(torch.maximum(unclipped, clipped), mask, agg, num_tokens)
    with torch.no_grad():
        stats = {"vf_clipfrac": masked_mean((clipped > unclipped).float(), mask)}
    return loss, stats
