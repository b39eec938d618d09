"""PPO / GRPO / ReMax pieces against small hand-computed examples (numbers worked out below)."""

import math

import pytest
import torch

from nereus_rl.algos.common import (
    aggregate_loss,
    clipped_policy_loss,
    kl_estimate,
    masked_mean,
    masked_whiten,
)
from nereus_rl.algos.grpo import group_advantages, grpo_loss
from nereus_rl.algos.ppo import gae, kl_penalized_rewards, value_loss
from nereus_rl.algos.remax import reinforce_loss, remax_advantages

LN2 = math.log(2.0)


def close(a, b, tol=1e-6):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.tensor(b), atol=tol)


def test_kl_estimators():
    logp = torch.log(torch.tensor([0.5, 0.25]))
    ref = torch.log(torch.tensor([0.25, 0.5]))
    # log ratio = +ln2, -ln2
    assert close(kl_estimate(logp, ref, "k1"), [LN2, -LN2])
    assert close(kl_estimate(logp, ref, "k2"), [0.5 * LN2**2, 0.5 * LN2**2])
    # k3 = exp(-lr) - 1 + lr: 0.5 - 1 + 0.693147 = 0.193147; 2 - 1 - 0.693147 = 0.306853
    assert close(kl_estimate(logp, ref, "k3"), [0.193147, 0.306853])
    with pytest.raises(ValueError, match="k1"):
        kl_estimate(logp, ref, "k4")


def test_masked_reductions_and_aggregation():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert close(masked_mean(x, m), 7 / 3)  # (1 + 2 + 4) / 3
    assert close(masked_mean(x, m, dim=-1), [1.5, 4.0])
    assert close(masked_mean(x, m, num_tokens=7), 1.0)
    assert close(aggregate_loss(x, m, "token_mean"), 7 / 3)
    assert close(aggregate_loss(x, m, "seq_mean_token_mean"), 2.75)  # (1.5 + 4) / 2
    assert close(aggregate_loss(x, m, "seq_mean_token_sum"), 3.5)  # (3 + 4) / 2
    with pytest.raises(ValueError, match="token_mean"):
        aggregate_loss(x, m, "mean")
    # mean 2, population variance 2/3: (x - 2) / sqrt(2/3) = -1.224745, 0, 1.224745
    w = masked_whiten(torch.tensor([1.0, 2.0, 3.0, 100.0]), torch.tensor([1.0, 1.0, 1.0, 0.0]))
    assert close(w, [-1.224745, 0.0, 1.224745, 0.0], 1e-5)


def test_clipped_policy_loss_values_and_gradient():
    old = torch.zeros(2, 2)
    ratio = torch.tensor([[1.5, 0.5], [1.1, 0.5]])
    logp = torch.log(ratio).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0], [-2.0, -1.0]])
    mask = torch.ones(2, 2)
    loss, stats = clipped_policy_loss(logp, old, adv, mask, clip_eps=0.2)
    # per token max(-A r, -A clip(r)):
    #   r=1.5 A=1:  max(-1.5, -1.2) = -1.2 (clipped)   r=0.5 A=1:  max(-0.5, -0.8) = -0.5
    #   r=1.1 A=-2: max(2.2, 2.2)   = 2.2              r=0.5 A=-1: max(0.5, 0.8)   = 0.8 (clipped)
    assert close(loss, (-1.2 - 0.5 + 2.2 + 0.8) / 4)  # 0.325
    assert close(stats["clipfrac"], 0.5)
    loss.backward()
    # d/dlogp of -A r is -A r where unclipped, 0 where clipped; /4 for the mean.
    assert close(logp.grad, [[0.0, -0.5 / 4], [2.2 / 4, 0.0]])
    # A masked token contributes nothing, whatever its value.
    mask2 = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss2, _ = clipped_policy_loss(logp.detach(), old, adv, mask2, clip_eps=0.2)
    assert close(loss2, (-1.2 - 0.5 + 2.2) / 3)


def test_kl_penalized_rewards():
    scores = torch.tensor([1.0, 0.5])
    logp = torch.tensor([[0.1, 0.2, 0.3], [0.4, -0.2, 9.0]])
    ref = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    r = kl_penalized_rewards(scores, logp, ref, mask, kl_coef=0.5)
    # -0.5 * k1 on every token, score added on the last real token
    assert close(r, [[-0.05, -0.1, -0.15 + 1.0], [-0.2, 0.1 + 0.5, 0.0]])


def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    adv, ret = gae(rewards, values, torch.ones(1, 3), gamma=1.0, lam=0.5)
    # t2: delta = 1 - 0.7 = 0.3                A2 = 0.3
    # t1: delta = 0 + 0.7 - 0.6 = 0.1          A1 = 0.1 + 0.5 * 0.3  = 0.25
    # t0: delta = 0 + 0.6 - 0.5 = 0.1          A0 = 0.1 + 0.5 * 0.25 = 0.225
    assert close(adv, [[0.225, 0.25, 0.3]])
    assert close(ret, [[0.725, 0.85, 1.0]])


def test_gae_with_padding_and_discount():
    rewards = torch.tensor([[0.0, 2.0, 5.0]])
    values = torch.tensor([[1.0, 0.5, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=1.0)
    # the padded token (r=5, V=9) is ignored: the episode ends at t1
    # t1: delta = 2 + 0 - 0.5 = 1.5             A1 = 1.5
    # t0: delta = 0 + 0.9 * 0.5 - 1 = -0.55     A0 = -0.55 + 0.9 * 1.5 = 0.8
    assert close(adv, [[0.8, 1.5, 0.0]])
    assert close(ret, [[1.8, 2.0, 0.0]])  # lam=1: the discounted return 0.9 * 2
    w, _ = gae(rewards, values, mask, gamma=0.9, lam=1.0, whiten=True)
    # mean 1.15, population std 0.35: (0.8 - 1.15)/0.35 = -1, (1.5 - 1.15)/0.35 = 1
    assert close(w, [[-1.0, 1.0, 0.0]], 1e-4)


def test_value_loss_by_hand():
    values = torch.tensor([[1.0, 2.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.5, 2.0, 0.5]])
    returns = torch.tensor([[2.0, 1.0, 0.0]])
    loss, stats = value_loss(values, old, returns, torch.ones(1, 3), clip_eps=0.2)
    # t0: clipped V = 0.5 + 0.2 = 0.7: max((1-2)^2, (0.7-2)^2) = 1.69 (clipped)
    # t1: V = V_old: 1;  t2: clipped V = 0.3: max(0, 0.09) = 0.09 (clipped)
    assert close(loss, 0.5 * (1.69 + 1.0 + 0.09) / 3)  # 0.463333
    assert close(stats["vf_clipfrac"], 2 / 3)
    loss.backward()
    # only t1 is unclipped: d/dV 0.5 * (V - R)^2 / 3 = (2 - 1) / 3
    assert close(values.grad, [[0.0, 1 / 3, 0.0]])


def test_group_advantages_by_hand():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    adv = group_advantages(scores, 4)
    # group 1: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.577350 -> +-0.866025
    # group 2: all equal -> 0 (eps keeps it finite)
    assert close(adv, [0.866025, -0.866025, -0.866025, 0.866025, 0, 0, 0, 0], 1e-5)
    assert close(group_advantages(scores, 4, scale_by_std=False), [0.5, -0.5, -0.5, 0.5] + [0] * 4)
    with pytest.raises(ValueError, match="multiple of the group size"):
        group_advantages(scores, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("value", [0.3, 0.1, 1 / 3, 2.9])
def test_group_advantages_of_an_equal_group_are_exactly_zero(dtype, value):
    """A group of equal scores gets exactly 0 in any dtype (float32: eight members at 0.3
    have a mean that is off by rounding, and dividing by a std near 0 plus eps magnifies
    it); a group beside it keeps its advantages."""
    for g in (2, 3, 5, 8, 16):
        scores = torch.cat([torch.full((g,), value), torch.arange(g) / g]).to(dtype)
        for by_std in (True, False):
            adv = group_advantages(scores, g, scale_by_std=by_std)
            assert adv.dtype == dtype
            assert torch.equal(adv[:g], torch.zeros(g, dtype=dtype)), (g, adv[:g])
            ref = scores[g:] - scores[g:].mean()
            if by_std:
                ref = ref / (scores[g:].std() + 1e-6)
            assert torch.equal(adv[g:], ref)


def test_grpo_loss_by_hand():
    logp = torch.log(torch.tensor([[0.5, 0.5], [0.25, 0.9]]))
    ref = torch.log(torch.tensor([[0.25, 0.5], [0.5, 0.1]]))
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    loss, stats = grpo_loss(logp, logp.clone(), ref, adv, mask, kl_coef=0.1)
    # ratio 1: pg = -A per token: (-1 - 1 + 1) / 3 = -1/3
    # k3: ln2 -> 0.193147, 0 -> 0, -ln2 -> 0.306853; mean = 0.5 / 3
    assert close(stats["pg_loss"], -1 / 3)
    assert close(stats["kl"], 0.5 / 3)
    assert close(loss, -1 / 3 + 0.1 * 0.5 / 3)


def test_remax_advantages_by_hand():
    token_rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = remax_advantages(token_rewards, torch.tensor([0.5, 1.0]), mask)
    # reward-to-go minus the greedy score: [1,1,1]-0.5, [0.5,0.5]-1 (padded 7 ignored)
    assert close(adv, [[0.5, 0.5, 0.5], [-0.5, -0.5, 0.0]])
    # with a KL penalty of 0.1 per token: to-go of [-0.1, -0.1, 0.9] is [0.7, 0.8, 0.9]
    adv = remax_advantages(torch.tensor([[-0.1, -0.1, 0.9]]), torch.zeros(1), torch.ones(1, 3))
    assert close(adv, [[0.7, 0.8, 0.9]])
    logp = torch.log(torch.tensor([[0.5, 0.5]])).requires_grad_(True)
    loss = reinforce_loss(logp, torch.tensor([[1.0, 1.0]]), torch.ones(1, 2))
    assert close(loss, LN2)  # -(1 * ln 0.5 * 2) / 2
    loss.backward()
    assert close(logp.grad, [[-0.5, -0.5]])


def _bandit(algo: str, steps: int = 30) -> float:
    """Train a 4-armed one-token policy where arm 2 pays 1; return p(arm 2) after training.

    Catches sign errors end to end: each algorithm must move probability to the paying arm.
    """
    gen = torch.Generator().manual_seed(0)
    theta = torch.zeros(4, requires_grad=True)
    value = torch.zeros(1, requires_grad=True)
    opt = torch.optim.Adam([theta, value], lr=0.1)
    group = 8
    for _ in range(steps):
        with torch.no_grad():
            arms = torch.multinomial(theta.softmax(-1), 64, replacement=True, generator=gen)
        scores = (arms == 2).float()
        mask = torch.ones(64, 1)
        old = theta.log_softmax(-1)[arms][:, None].detach()
        logp = theta.log_softmax(-1)[arms][:, None]
        if algo == "grpo":
            adv = group_advantages(scores, group)
            loss, _ = grpo_loss(logp, old, old, adv, mask, kl_coef=0.0)
        elif algo == "remax":
            greedy_score = (theta.argmax() == 2).float().expand(64)
            rewards = kl_penalized_rewards(scores, old, old, mask, kl_coef=0.0)
            loss = reinforce_loss(logp, remax_advantages(rewards, greedy_score, mask), mask)
        else:
            values = value.expand(64, 1)
            rewards = kl_penalized_rewards(scores, old, old, mask, kl_coef=0.1)
            adv, ret = gae(rewards, values, mask)
            pg, _ = clipped_policy_loss(logp, old, adv, mask)
            vf, _ = value_loss(values, values.detach(), ret, mask, clip_eps=10.0)
            loss = pg + vf
        opt.zero_grad()
        loss.backward()
        opt.step()
    return theta.softmax(-1)[2].item()


@pytest.mark.parametrize("algo", ["ppo", "grpo", "remax"])
def test_each_algorithm_moves_probability_to_the_paying_arm(algo):
    # Uniform start: p = 0.25. ReMax's greedy baseline is 0 until arm 2 is the argmax.
    assert _bandit(algo) > 0.9
