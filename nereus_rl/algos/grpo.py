"""GRPO: group-relative advantages, no critic, KL to the reference inside the loss.

Each prompt is sampled ``group_size`` times; a response's advantage is its score
minus the group mean, divided by the group's standard deviation (unbiased, as
``torch.std``), the same for all its tokens (DeepSeekMath, Shao et al. 2024).
The KL term is the k3 estimator, added to the clipped surrogate loss rather than
to the rewards.
"""

from __future__ import annotations

import torch

from nereus_rl.algos.common import aggregate_loss, clipped_policy_loss, kl_estimate


def group_advantages(
    scores: torch.Tensor, group_size: int, *, eps: float = 1e-6, scale_by_std: bool = True
) -> torch.Tensor:
    """Per-sequence advantages [B] from scores [B] laid out group by group.

    Arguments:
        scores: one score per response; responses ``g*G .. g*G+G-1`` share a prompt.
        group_size: responses per prompt (G >= 2 for a standard deviation).
        eps: added to the standard deviation.
        scale_by_std: divide by the group's std (False: Dr. GRPO's mean-only form).

    Returns:
        Advantages [B], in the scores' dtype; exactly 0 for every member of a group whose
        scores are all equal.

    Raises:
        ValueError: B is not a multiple of ``group_size`` or ``group_size < 2``.
    """
    if group_size < 2 or scores.shape[0] % group_size:
        raise ValueError(
            f"GRPO needs groups of >= 2 responses per prompt and a batch that is a multiple "
            f"of the group size; got batch {scores.shape[0]}, group_size {group_size}"
        )
    grouped = scores.view(-1, group_size)
    adv = grouped - grouped.mean(-1, keepdim=True)
    if scale_by_std:
        adv = adv / (grouped.std(-1, keepdim=True) + eps)
    # A group of equal scores carries no signal, but its mean is rounded (eight float32
    # 0.3s average to 0.3 + 3e-8) and dividing that residue by a std of about 1e-8 plus
    # eps makes it a visible advantage: such groups get exactly 0.
    equal = (grouped == grouped[:, :1]).all(-1, keepdim=True)
    return adv.masked_fill(equal, 0).reshape(-1)


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    kl_coef: float = 0.04,
    kl_estimator: str = "k3",
    agg: str = "token_mean",
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate with sequence advantages broadcast to tokens, plus ``kl_coef * KL``.

    Arguments:
        logp: current log-probs [B, T] (differentiable).
        old_logp: log-probs at sampling time [B, T].
        ref_logp: reference log-probs [B, T].
        advantages: per-sequence advantages [B] (:func:`group_advantages`).
        mask: response-token mask [B, T].
        clip_eps, agg, num_tokens: as in :func:`nereus_rl.algos.common.clipped_policy_loss`.
        kl_coef, kl_estimator: the KL term's weight and estimator.

    Returns:
        (loss, stats) with ``pg_loss``, ``kl``, ``clipfrac`` and ``approx_kl``.
    """
    pg_loss, stats = clipped_policy_loss(
        logp,
        old_logp,
        advantages[:, None].expand_as(logp),
        mask,
        clip_eps=clip_eps,
        agg=agg,
        num_tokens=num_tokens,
    )
    kl = aggregate_loss(kl_estimate(logp, ref_logp, kl_estimator), mask, agg, num_tokens)
    stats = {**stats, "pg_loss": pg_loss.detach(), "kl": kl.detach()}
    return pg_loss + kl_coef * kl, stats
