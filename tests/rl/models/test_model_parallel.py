"""TP / PP / DP equivalence of nereus_rl.models.model against the single-process model.

One module-scoped pool of 4 gloo processes runs every case; each case runs on all
4 ranks (new_group is collective over the world), computes the single-process
reference itself from the same seed, and compares its own shards.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from support.gloo_pool import GlooPool

from nereus_rl.models.generate import generate, make_generator
from nereus_rl.models.model import Decoder, ModelConfig, shard_tensor
from nereus_rl.models.parallel import (
    COMM_COUNTS,
    allreduce_gradients,
    init_parallel_groups,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
)
from nereus_rl.models.pipeline import LAST_PASS, pipeline_forward, pipeline_forward_backward

# Multi-process: out of the fast lane (-m "not slow").
pytestmark = pytest.mark.slow

WORLD = 4
# Three layers, so pp=2 splits them 2 + 1 (earlier stage takes the remainder).
CFG = ModelConfig("test3", 3, 64, 4, 2, 176, 64, 64)
SEED = 3
_GROUPS: dict = {}


def _groups(tp, pp, dp):
    if (tp, pp, dp) not in _GROUPS:
        _GROUPS[(tp, pp, dp)] = init_parallel_groups(tp, pp, dp)
    return _GROUPS[(tp, pp, dp)]


def _batch(b=8, t=12):
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, CFG.vocab, (b, t), generator=gen)
    value_targets = torch.randn(b, t, generator=gen)
    return tokens, value_targets


def _policy_loss(out, tokens, groups, scale):
    logp = vocab_parallel_logprobs(out[:, :-1], tokens[:, 1:], groups)
    return -logp.sum() * scale


def _critic_loss(values, targets, scale):
    return ((values - targets) ** 2).sum() * scale


def case_train(tp, pp, dp, num_micro, critic, schedule="1f1b"):
    """Forward/backward of a (dp, pp, tp) layout vs the single-process full batch."""
    groups = _groups(tp, pp, dp)
    tokens, vt = _batch()
    n_total = tokens.numel()
    ref = Decoder(CFG, value_head=critic, seed=SEED)
    out = ref(tokens)
    ref_loss = (
        _critic_loss(out, vt, 1 / n_total)
        if critic
        else _policy_loss(out, tokens, ref.groups, 1 / n_total)
    )
    ref_loss.backward()
    ref_params = dict(ref.named_parameters())

    model = Decoder(CFG, groups, value_head=critic, seed=SEED)
    init_equal = all(
        torch.equal(p, shard_tensor(ref_params[s.name].detach(), s.split_dim, groups.tp_rank, tp))
        for s, p in zip(model.local_specs(), model.parameters())
    )
    rows = tokens.shape[0] // dp
    local = tokens[groups.dp_rank * rows : (groups.dp_rank + 1) * rows]
    local_vt = vt[groups.dp_rank * rows : (groups.dp_rank + 1) * rows]
    mbs, mvt = local.chunk(num_micro), local_vt.chunk(num_micro)
    scale = dp / n_total  # the dp average divides by dp again

    def loss_fn(y, m):
        if critic:
            return _critic_loss(y, mvt[m], scale)
        return _policy_loss(y, mbs[m], groups, scale)

    before = COMM_COUNTS.copy()
    losses = pipeline_forward_backward(model, mbs, loss_fn, groups, schedule=schedule)
    allreduce_gradients(model, groups)
    comms = dict(COMM_COUNTS - before)
    # Sum of every replica's micro-batch losses is the reference loss.
    total = losses.sum().clone()
    if groups.dp_group is not None:
        dist.all_reduce(total, group=groups.dp_group)
    grad_err = max(
        (p.grad - shard_tensor(ref_params[s.name].grad, s.split_dim, groups.tp_rank, tp))
        .abs()
        .max()
        .item()
        for s, p in zip(model.local_specs(), model.parameters())
    )
    return {
        "init_equal": init_equal,
        "loss_err": abs(total.item() / dp - ref_loss.item()),
        "grad_err": grad_err,
        "grad_scale": max(p.grad.abs().max().item() for p in ref.parameters()),
        "num_params": len(list(model.parameters())),
        "layers": model.layer_ids,
        "comms": comms,
        "coords": (groups.dp_rank, groups.pp_rank, groups.tp_rank),
        "max_live": LAST_PASS["max_live_micro_batches"],
    }


def case_forward_only(tp, pp):
    """pipeline_forward + vocab-parallel entropy vs the single-process logits."""
    groups = _groups(tp, pp, 1)
    tokens, _ = _batch(4, 9)
    ref_logits = Decoder(CFG, seed=SEED)(tokens).detach()
    model = Decoder(CFG, groups, seed=SEED)
    outs = pipeline_forward(model, tokens.chunk(2), groups)
    if outs is None:
        return {"last": False}
    logits = torch.cat(outs)
    width = CFG.vocab // tp
    ref_shard = ref_logits[..., groups.tp_rank * width : (groups.tp_rank + 1) * width]
    ref_ent = torch.distributions.Categorical(logits=ref_logits).entropy()
    return {
        "last": True,
        "logit_err": (logits - ref_shard).abs().max().item(),
        "entropy_err": (vocab_parallel_entropy(logits, groups) - ref_ent).abs().max().item(),
    }


def case_generate(tp, pp, dp, use_cache, temperature):
    """Sharded generation picks the same tokens as the single-process model."""
    groups = _groups(tp, pp, dp)
    prompts = _batch(4, 6)[0]
    ref = Decoder(CFG, seed=SEED)
    model = Decoder(CFG, groups, seed=SEED)
    kw = {"temperature": temperature, "eos_id": 1, "max_new_tokens": 10}
    want = generate(ref, prompts, generator=make_generator(5, groups), **kw)
    got = generate(model, prompts, generator=make_generator(5, groups), use_cache=use_cache, **kw)
    return {
        "equal": torch.equal(got.sequences, want.sequences)
        and torch.equal(got.response_mask, want.response_mask),
        "dp_rank": groups.dp_rank,
        "responses": got.responses.tolist(),
    }


@pytest.fixture(scope="module")
def pool():
    p = GlooPool(__name__, WORLD)
    yield p
    p.close()


TOL = 2e-5


@pytest.mark.parametrize(
    "tp,pp,dp,num_micro,critic,schedule",
    [
        (2, 1, 2, 1, False, "1f1b"),
        (1, 2, 2, 2, False, "1f1b"),
        (1, 2, 2, 4, False, "gpipe"),
        (2, 2, 1, 4, False, "1f1b"),
        (2, 2, 1, 1, True, "1f1b"),
        (1, 1, 4, 2, False, "1f1b"),
    ],
)
def test_train_matches_single_process(pool, tp, pp, dp, num_micro, critic, schedule):
    res = pool.run("case_train", tp, pp, dp, num_micro, critic, schedule)
    for r in res:
        assert r["init_equal"], r
        assert r["loss_err"] < TOL, r
        assert r["grad_err"] < 1e-6, r
    # Every rank of a stage checks its own tensors; together they cover the model.
    if pp == 2:
        assert {tuple(r["layers"]) for r in res} == {(0, 1), (2,)}
    # Communication counts per rank: tp all-reduces per micro-batch are embedding 1,
    # 2 forward + 2 backward per layer, lm head's f 1 and the log-prob's 2; dp adds 1.
    for r in res:
        _, p, _ = r["coords"]
        first, last = p == 0, p == pp - 1
        if tp > 1:
            per_mb = first + 4 * len(r["layers"]) + last * (0 if critic else 3)
        else:
            per_mb = 0
        assert r["comms"].get("all_reduce", 0) == num_micro * per_mb + (dp > 1), r
        assert r["comms"].get("send", 0) == num_micro * ((not last) + (not first)) * (pp > 1)
        assert r["comms"].get("broadcast", 0) == (pp > 1)
        # 1F1B holds at most (stages from here to the end) micro-batches; GPipe holds all.
        live = num_micro if schedule == "gpipe" else min(num_micro, pp - p)
        assert r["max_live"] == live, r


def test_wrong_grads_are_detected(pool):
    # The comparison can fail: without the dp all-reduce, dp=2 grads differ from the
    # full-batch ones (each replica saw half the batch).
    res = pool.run("case_train_no_dp_reduce")
    assert all(r > 1e-4 for r in res), res


def case_train_no_dp_reduce():
    import nereus_rl.models.parallel as mpar

    saved = mpar.allreduce_gradients
    globals()["allreduce_gradients"] = lambda model, groups: None
    try:
        return case_train(2, 1, 2, 1, False)["grad_err"]
    finally:
        globals()["allreduce_gradients"] = saved


def test_forward_only_pipeline_and_entropy(pool):
    tp, pp = 2, 2
    res = [r for r in pool.run("case_forward_only", tp, pp) if r["last"]]
    assert len(res) == tp
    for r in res:
        assert r["logit_err"] < TOL and r["entropy_err"] < 1e-4, r


@pytest.mark.parametrize(
    "tp,pp,dp,use_cache,temperature",
    [
        (2, 2, 1, True, 0.0),
        (2, 2, 1, True, 1.0),
        (2, 2, 1, False, 1.0),
        (2, 1, 2, True, 1.0),
    ],
)
def test_generate_matches_single_process(pool, tp, pp, dp, use_cache, temperature):
    res = pool.run("case_generate", tp, pp, dp, use_cache, temperature)
    assert all(r["equal"] for r in res), res
    # Every rank of a replica returns the same tokens; replicas sample differently.
    by_dp = {}
    for r in res:
        by_dp.setdefault(r["dp_rank"], []).append(r["responses"])
    for outs in by_dp.values():
        assert all(o == outs[0] for o in outs)
    if dp > 1 and temperature > 0:
        assert by_dp[0][0] != by_dp[1][0]
