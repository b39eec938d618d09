"""Token-level pieces shared by PPO, GRPO and ReMax: masked reductions, KL estimators,
the clipped surrogate policy loss and loss aggregation.

Every function is pure: tensors in, tensors out. Shapes: ``[B, T]`` for per-token
quantities over the response tokens (``mask`` is 1 on real response tokens, 0 on
padding), ``[B]`` for per-sequence ones.
"""

from __future__ import annotations

import torch

LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
KL_ESTIMATORS = ("k1", "k2", "k3")


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` where ``mask`` is 1 (over ``dim``, or everything)."""
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(
    x: torch.Tensor, mask: torch.Tensor, dim: int | None = None, num_tokens: float | None = None
) -> torch.Tensor:
    """Mean of ``x`` over the masked entries.

    ``num_tokens`` replaces the denominator (whole-tensor mean only): pass the global
    token count when a batch is split over micro-batches or data-parallel replicas, so
    that the summed losses equal the full-batch loss.
    """
    if num_tokens is not None:
        if dim is not None:
            raise ValueError("num_tokens only applies to the whole-tensor mean (dim=None)")
        return masked_sum(x, mask) / num_tokens
    return masked_sum(x, mask, dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked entries (population variance); 0 elsewhere."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy.

    ``k1 = logp - ref_logp`` (unbiased, can be negative), ``k2 = (logp - ref_logp)^2 / 2``,
    ``k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1`` (unbiased, never negative;
    Schulman's estimator, the one GRPO puts in its loss).

    Raises:
        ValueError: unknown ``kind``.
    """
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"unknown KL estimator {kind!r}; choose one of {KL_ESTIMATORS}")


def aggregate_loss(
    loss: torch.Tensor, mask: torch.Tensor, mode: str = "token_mean", num_tokens=None
) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a scalar.

    ``token_mean``: mean over all response tokens of the batch (``num_tokens`` may give
    the global count). ``seq_mean_token_mean``: mean over sequences of each sequence's
    token mean. ``seq_mean_token_sum``: mean over sequences of each sequence's token sum.

    Raises:
        ValueError: unknown ``mode``.
    """
    if mode == "token_mean":
        return masked_mean(loss, mask, num_tokens=num_tokens)
    if mode == "seq_mean_token_mean":
        return masked_mean(loss, mask, dim=-1).mean()
    if mode == "seq_mean_token_sum":
        return masked_sum(loss, mask, dim=-1).mean()
    raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {LOSS_AGGREGATIONS}")


def clipped_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    agg: str = "token_mean",
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate: mean of max(-A r, -A clip(r, 1-eps, 1+eps)), r = exp(logp - old).

    Arguments:
        logp: current log-probs of the sampled tokens [B, T] (differentiable).
        old_logp: log-probs at sampling time [B, T].
        advantages: per-token advantages [B, T].
        mask: response-token mask [B, T].
        clip_eps: ratio clip range.
        agg, num_tokens: see :func:`aggregate_loss`.

    Returns:
        (loss, stats) with stats ``clipfrac`` (share of tokens where the clipped term
        was taken) and ``approx_kl`` (k3 of old vs new over the masked tokens).
    """
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    loss = aggregate_loss(torch.maximum(unclipped, clipped), mask, agg, num_tokens)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((clipped > unclipped).float(), mask),
            "approx_kl": masked_mean(kl_estimate(old_logp, logp.detach(), "k3"), mask),
        }
    return loss, stats
