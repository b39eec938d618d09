"""Variable-length prompts through the trainer's stage commands (nereus_rl.trainer.worker).

``rl.generate``, ``rl.infer`` and ``rl.train`` get a batch of prompts of different lengths,
left-padded to the longest with a prompt mask, as the trainer sends a dataset's prompts.
Each sample's result must be what it is when the sample runs alone, unpadded: greedy
responses token for token, behaviour / reference log-probs and critic values, and the
loss and gradients of a training step of each algorithm (PPO's policy and critic, GRPO,
ReMax): the batch's loss and gradient are the sums of the samples' (at the batch's token
count). Padding that leaked into attention, positions, losses, advantages or KL would
show as a difference. In one process here, and (slow) under tp, pp and dp over four gloo
processes, against the same samples alone in one process.

Tolerance: fp32 results of the padded and unpadded forms differ only by summation order
(masked softmax, other batch shapes): ``TOL`` = 1e-5 relative, far below what a leak moves
(``test_the_comparison_can_fail``).
"""

from __future__ import annotations

from functools import cache
from types import SimpleNamespace

import pytest
import torch
from support.gloo_pool import GlooPool

from nereus_rl.models.generate import left_pad
from nereus_rl.models.model import Decoder, ModelConfig, shard_tensor
from nereus_rl.models.parallel import ParallelGroups, init_parallel_groups
from nereus_rl.trainer.worker import rl_generate, rl_infer, rl_train
from nereus_rl.trainer.worker_state import make_opt, rl_state

CFG = ModelConfig(
    "varlen_rl", 3, 32, 4, 2, 48, 64, 64,
    rope_theta=1e6, norm_eps=1e-6, qkv_bias=True, tie_embeddings=True, arch="qwen2",
)  # fmt: skip
SEED = 5
PAD, EOS = 0, 1
LENS = [5, 2, 7, 4]  # padded to 7
N_RESP = 6
REAL = [6, 3, 6, 1]  # response tokens up to and including EOS
TOL = 1e-5
HP = {"lr": 0.0, "kl_coef": 0.05, "num_micro": 2}


def _decoder(groups: ParallelGroups | None = None, critic: bool = False) -> Decoder:
    """The test model (this rank's shards under ``groups``), with weights large enough
    that every context mistake moves the outputs (see test_varlen)."""
    full = Decoder(CFG, value_head=critic, seed=SEED)
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in full.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5, generator=gen)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5, generator=gen)
            else:
                p.normal_(0.0, 0.2, generator=gen)
    if groups is None:
        return full
    model = Decoder(CFG, groups, value_head=critic, seed=SEED)
    state = full.shard_state_dict()
    model.load_shard_state_dict(
        {
            s.name: shard_tensor(state[s.name], s.split_dim, groups.tp_rank, groups.tp_size)
            for s in model.local_specs()
        }
    )
    return model


def _ctx(stage: str, model: Decoder, trains: bool):
    """A worker context holding one stage, as ``rl.setup`` leaves it."""
    ctx = SimpleNamespace(state={})
    rl = rl_state(ctx)
    rl["hp"] = HP
    entry = {"model": model, "desc": {"stage": stage}, "trains": trains}
    if trains:
        entry["opt"] = make_opt(model, HP)
    rl["stages"][stage] = entry
    return ctx


def _data():
    """(prompts, responses [B, N], response mask [B, N], per-token inputs of the losses)."""
    gen = torch.Generator().manual_seed(13)
    prompts = [torch.randint(2, CFG.vocab, (n,), generator=gen) for n in LENS]
    responses = torch.randint(2, CFG.vocab, (len(LENS), N_RESP), generator=gen)
    rmask = (torch.arange(N_RESP)[None, :] < torch.tensor(REAL)[:, None]).float()
    responses = responses.masked_fill(rmask == 0, PAD)
    shape = (len(LENS), N_RESP)
    extra = {
        "old_logp": torch.randn(shape, generator=gen) * 0.1 - 4.0,
        "ref_logp": torch.randn(shape, generator=gen) * 0.1 - 4.0,
        "advantages": torch.randn(shape, generator=gen),
        "seq_advantages": torch.randn(len(LENS), generator=gen),
        "returns": torch.randn(shape, generator=gen),
        "old_values": torch.randn(shape, generator=gen) * 0.1,
    }
    return prompts, responses, rmask, extra


def _batch(algo: str, critic: bool, seqs, rmask, plen, extra, rows, num_tokens, pmask=None):
    b = {
        "sequences": seqs,
        "mask": rmask[rows],
        "prompt_len": torch.tensor(plen),
        "num_tokens": torch.tensor(num_tokens),
        "old_logp": extra["old_logp"][rows],
        "ref_logp": extra["ref_logp"][rows],
    }
    if critic:
        b.update(returns=extra["returns"][rows], old_values=extra["old_values"][rows])
    elif algo == "grpo":
        b["advantages"] = extra["seq_advantages"][rows]
    else:
        b["advantages"] = extra["advantages"][rows]
    if pmask is not None:
        b["prompt_mask"] = pmask
    return b


def _grads(model: Decoder) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}


@cache
def _alone(algo: str, critic: bool) -> dict:
    """Every sample run alone, unpadded, in one process: generation, inference, and the
    sum over samples of the training loss and gradients (at the batch's token count)."""
    prompts, responses, rmask, extra = _data()
    num_tokens = float(rmask.sum())
    model = _decoder(critic=critic)
    stage = "critic_train" if critic else "actor_train"
    ctx = _ctx(stage, model, trains=True)
    out: dict = {"infer": [], "loss": 0.0, "grads": None, "responses": [], "logp": [], "rm": []}
    for i, p in enumerate(prompts):
        seqs = torch.cat([p, responses[i]])[None]
        out["infer"].append(rl_infer(ctx, stage, [seqs], len(p), 2)["out"][0])
        b = _batch(algo, critic, seqs, rmask, len(p), extra, [i], num_tokens)
        out["loss"] += rl_train(ctx, stage, [b], {**HP, "algo": algo})["loss"]
        g = _grads(model)
        out["grads"] = g if out["grads"] is None else {k: out["grads"][k] + g[k] for k in g}
        if not critic:
            gen = rl_generate(ctx, stage, [p[None]], 8, 0.0, 0, EOS, pad_id=PAD)
            out["responses"].append(gen["sequences"][0, len(p) :])
            out["logp"].append(gen["logp"][0])
            out["rm"].append(gen["mask"][0].bool())
    return out


def _padded_run(algo: str, critic: bool, groups: ParallelGroups, dp: int) -> dict:
    """The left-padded batch, split over ``dp`` units, on this rank's shards."""
    prompts, responses, rmask, extra = _data()
    num_tokens = float(rmask.sum())
    ids, pmask = left_pad(prompts, PAD)
    plen = ids.shape[1]
    seqs = torch.cat([ids, responses], 1)
    rows = list(torch.arange(len(prompts)).chunk(dp))
    model = _decoder(groups, critic)
    stage = "critic_train" if critic else "actor_train"
    ctx = _ctx(stage, model, trains=True)
    out: dict = {"unit": groups.dp_rank, "rows": rows[groups.dp_rank].tolist()}
    inf = rl_infer(
        ctx, stage, [seqs[r] for r in rows], plen, 2, prompt_masks=[pmask[r] for r in rows]
    )
    out["infer"] = None if inf is None else inf["out"]
    batches = [
        _batch(algo, critic, seqs[r], rmask, plen, extra, r, num_tokens, pmask[r]) for r in rows
    ]
    tr = rl_train(ctx, stage, batches, {**HP, "algo": algo})
    out["loss"] = None if tr is None else tr["loss"]
    out["grads"] = {name: p.grad.clone() for name, p in model._params().items()}
    out["specs"] = [(s.name, s.split_dim) for s in model.local_specs()]
    if not critic:
        gen = rl_generate(
            ctx, stage, [ids[r] for r in rows], 8, 0.0, 0, EOS, pad_id=PAD,
            prompt_masks=[pmask[r] for r in rows],
        )  # fmt: skip
        out["gen"] = None if gen is None else (gen["sequences"][:, plen:], gen["logp"])
    return out


def _check(want: dict, got: list[dict], algo: str, critic: bool, dp: int, tp: int) -> None:
    reporters = [g for g in got if g["infer"] is not None]
    assert len(reporters) == dp
    scale = max(t.abs().max().item() for t in want["infer"])
    for r in reporters:
        for j, i in enumerate(r["rows"]):
            err = (r["infer"][j] - want["infer"][i]).abs().max().item() / scale
            assert err <= TOL, (i, err)
        if not critic:
            seqs, logp = r["gen"]
            for j, i in enumerate(r["rows"]):
                alone = want["responses"][i]
                assert torch.equal(seqs[j, : alone.shape[0]], alone), (i, seqs[j], alone)
                real = want["rm"][i]
                d = (logp[j][real] - want["logp"][i][real]).abs().max().item()
                assert d <= TOL * max(1.0, want["logp"][i][real].abs().max().item()), (i, d)
    # each unit's loss is scaled by dp (the gradient all-reduce averages them)
    loss = sum(r["loss"] for r in reporters) / dp
    assert abs(loss - want["loss"]) <= TOL * max(1.0, abs(want["loss"])), (loss, want["loss"])
    gscale = max(g.abs().max().item() for g in want["grads"].values())
    for g in got:
        for name, split in g["specs"]:
            full = want["grads"][name]
            tp_rank = g.get("tp_rank", 0)
            ref = shard_tensor(full, split, tp_rank, tp)
            err = (g["grads"][name] - ref).abs().max().item() / gscale
            assert err <= TOL, (algo, critic, name, err)


CASES = [("grpo", False), ("ppo", False), ("ppo", True), ("remax", False)]


@pytest.mark.parametrize("algo,critic", CASES)
def test_padded_batch_equals_each_sample_alone(algo, critic):
    want = _alone(algo, critic)
    got = _padded_run(algo, critic, ParallelGroups.single(), 1)
    _check(want, [got], algo, critic, dp=1, tp=1)


@pytest.mark.slow
@pytest.mark.parametrize("algo,critic", CASES)
def test_dp_split_equals_each_sample_alone(algo, critic):
    """Two units in one process: each unit's share is padded to the batch's width."""
    want = _alone(algo, critic)
    units = []
    for d in range(2):
        g = ParallelGroups(dp_rank=d, dp_size=2)
        units.append(_padded_run(algo, critic, g, 2))
    # no dp group here: each unit's gradient is its own share, scaled by dp
    summed = {k: (units[0]["grads"][k] + units[1]["grads"][k]) / 2 for k in units[0]["grads"]}
    for u in units:
        u["grads"] = summed
    _check(want, units, algo, critic, dp=2, tp=1)


def test_the_comparison_can_fail():
    """Without the prompt mask (padding attended to as if real tokens), the padded batch's
    log-probs leave the samples' by far more than the tolerance."""
    want = _alone("grpo", False)
    prompts, responses, _, _ = _data()
    ids, _ = left_pad(prompts, PAD)
    seqs = torch.cat([ids, responses], 1)
    ctx = _ctx("actor_train", _decoder(), trains=True)
    got = rl_infer(ctx, "actor_train", [seqs], ids.shape[1], 2)["out"]
    scale = max(t.abs().max().item() for t in want["infer"])
    worst = max((got[i] - want["infer"][i]).abs().max().item() / scale for i in range(len(LENS)))
    assert worst > 100 * TOL


# ------------------------------------------------------------------ tp / pp / dp

WORLD = 4


def case_sharded(algo: str, critic: bool, tp: int, pp: int, dp: int) -> dict:
    groups = init_parallel_groups(tp, pp, dp)
    out = _padded_run(algo, critic, groups, dp)
    out["tp_rank"] = groups.tp_rank
    return out


@pytest.fixture(scope="module")
def pool():
    p = GlooPool(__name__, WORLD)
    yield p
    p.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    "algo,critic,tp,pp,dp",
    [
        ("grpo", False, 2, 1, 2),
        ("ppo", True, 1, 2, 2),
        ("ppo", False, 2, 2, 1),
        ("remax", False, 1, 2, 2),
    ],
)
def test_sharded_equals_each_sample_alone(pool, algo, critic, tp, pp, dp):
    want = _alone(algo, critic)
    got = pool.run("case_sharded", algo, critic, tp, pp, dp)
    _check(want, got, algo, critic, dp=dp, tp=tp)
