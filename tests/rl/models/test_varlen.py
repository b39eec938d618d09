"""Prompts of different lengths: left padding, attention masks and position ids.

A batch's prompts are left-padded to one width with a ``prompt_mask``; every real token
must come out as it would with no padding around it, in generation (with and without
the KV cache), in scoring (policy log-probs, critic values) and in training, in one
process and under TP, PP and DP.

Generation is checked against transformers' greedy ``generate`` (left padding and an
``attention_mask``) on tiny random Llama and Qwen2 checkpoints built here, token for token.

Scoring and training compare a mixed-length batch with each sample run alone, unpadded
and unmasked (the path every equal-length batch takes). Tolerance: the two runs do the
same arithmetic on the real tokens, but on other shapes (a padded [B, T] batch against a
[1, T_i] row, a boolean attention mask against SDPA's ``is_causal``) torch's kernels
block and sum in another order, which moves fp32 results by a few ulps per layer.
``TOL = 2e-5`` on log-probs and values of magnitude ~4 is ~40 ulps, above that drift
(measured: at most 2.4e-7 in one process, 1.2e-6 under tp 2) and far below what a padding
mistake does: a padding key attended to moves the log-probs by 1e-2 and more
(checked in ``test_scores_equal_each_sample_alone``). Rotary attention depends only on
relative positions, so positions counted from column 0 instead of each row's first real
token would move results by rounding alone; ``test_positions_count_from_the_first_real_token``
checks the positions themselves. Gradients are compared relative to the largest
gradient, with the same 2e-5.
"""

from __future__ import annotations

import pytest
import torch
from support.gloo_pool import GlooPool

from nereus_rl.models.generate import generate, left_pad
from nereus_rl.models.model import (
    Decoder,
    Llama3RopeScaling,
    ModelConfig,
    full_attention_mask,
    position_ids,
    shard_tensor,
)
from nereus_rl.models.parallel import (
    allreduce_gradients,
    init_parallel_groups,
    response_logprobs,
    response_values,
)
from nereus_rl.models.pipeline import pipeline_forward, pipeline_forward_backward

TOL = 2e-5
PAD = 0
EOS = 2
# Three layers (pp 2 splits them 2 + 1); Llama 3 rope scaling below the sequence length,
# tied embeddings and q/k/v biases, so that every position-dependent path is exercised.
CFG = ModelConfig(
    "varlen", 3, 32, 4, 2, 48, 64, 64,
    rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 16), qkv_bias=True, tie_embeddings=True,
)  # fmt: skip
SEED = 4
LENS = [9, 3, 6, 1, 7, 2, 9, 5]  # a 1-token prompt and two full-width ones
N_RESP = 6


def _decoder(groups=None, critic: bool = False) -> Decoder:
    """The test model (this rank's shards of it under ``groups``).

    The seed's initial weights (std 0.02) barely let attention move the logits, so that
    greedy tokens hardly depend on the context; these are redrawn larger (and the norm
    scales and biases random, as in test_hf) so that every context mistake shows.
    """
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


def _batch():
    """(prompts as 1-D tensors, responses [B, N], response mask [B, N], value targets [B, N]).

    Responses end early in some rows (mask 0 and the pad id after them), as sampled
    ones do; no real token is the pad id, so the pad's embedding row shows any leak.
    """
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, CFG.vocab, (n,), generator=gen) for n in LENS]
    responses = torch.randint(3, CFG.vocab, (len(LENS), N_RESP), generator=gen)
    real = torch.tensor([6, 4, 6, 1, 5, 6, 2, 6])
    rmask = (torch.arange(N_RESP)[None, :] < real[:, None]).float()
    responses = responses.masked_fill(rmask == 0, PAD)
    targets = torch.randn(len(LENS), N_RESP, generator=gen)
    return prompts, responses, rmask, targets


def _padded(prompts, responses):
    """(sequences [B, P + N], attention mask [B, P + N], P) of the left-padded batch."""
    ids, pmask = left_pad(prompts, PAD)
    seqs = torch.cat([ids, responses], 1)
    return seqs, full_attention_mask(pmask, seqs.shape[1]), ids.shape[1]


def _loss(out, seqs, prompt_len, rmask, targets, model):
    """Token-sum loss and the per-token scores (log-probs or values) at the responses."""
    if model.is_critic:
        v = response_values(out, prompt_len)
        return (((v - targets) ** 2) * rmask).sum(), v
    logp = response_logprobs(out, seqs, prompt_len, model.groups)
    return -(logp * rmask).sum(), logp


def _alone(model, prompts, responses, rmask, targets, backward: bool):
    """Each sample run by itself, unpadded and without a mask: scores [B, N] and (if
    ``backward``) the sum of the per-sample gradients left in ``model``'s grads."""
    rows = []
    for i, p in enumerate(prompts):
        seq = torch.cat([p, responses[i]])[None]
        loss, score = _loss(model(seq), seq, len(p), rmask[i : i + 1], targets[i : i + 1], model)
        if backward:
            loss.backward()
        rows.append(score.detach()[0])
    return torch.stack(rows)


def _masked_diff(a: torch.Tensor, b: torch.Tensor, rmask: torch.Tensor) -> float:
    return ((a - b) * rmask).abs().max().item()


def _grads(model) -> dict[str, torch.Tensor]:
    # remove_duplicate=False: a tied weight held once is listed (with its grad) twice
    return {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}


# ------------------------------------------------------------------ transformers


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """arch -> (transformers model, our Decoder loaded from its saved checkpoint)."""
    # test_hf's helpers import transformers with the repository root off sys.path (the
    # root's kernels/ would shadow Hugging Face's kernels package); skips without it.
    from test_hf import _build

    from nereus_rl.models.hf import hf_config, load_hf_weights

    out = {}
    for arch in ("llama", "qwen2"):
        folder = tmp_path_factory.mktemp(f"varlen_{arch}")
        hf = _build(arch)
        hf.save_pretrained(folder)
        ours = Decoder(hf_config(folder))
        load_hf_weights(ours, folder)
        out[arch] = (hf, ours)
    return out


def _hf_prompts():
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 64, (n,), generator=gen) for n in (5, 11, 1, 8, 11)]
    return left_pad(prompts, PAD)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_generation_equals_transformers(hf_models, arch, use_cache):
    hf, ours = hf_models[arch]
    ids, pmask = _hf_prompts()
    new = 24
    got = generate(ours, ids, new, prompt_mask=pmask, eos_id=EOS, pad_id=PAD, use_cache=use_cache)
    with torch.no_grad():
        want = hf.generate(
            ids, attention_mask=pmask, max_new_tokens=new, do_sample=False,
            pad_token_id=PAD, eos_token_id=EOS,
        )  # fmt: skip
    assert torch.equal(got.sequences, want), (got.sequences, want)
    # Scoring what was generated: the logits at every real position are transformers'.
    attn = got.attention_mask
    with torch.no_grad():
        a = ours(got.sequences, attention_mask=attn)
        b = hf(got.sequences, attention_mask=attn).logits
    d = (a - b)[attn.bool()].abs().max().item()
    assert d <= 1e-5 * b.abs().max().item(), d


# ------------------------------------------------------------------ one process


@pytest.fixture(scope="module")
def data():
    return _batch()


@pytest.mark.parametrize("critic", [False, True])
def test_scores_equal_each_sample_alone(data, critic):
    prompts, responses, rmask, targets = data
    model = _decoder(critic=critic)
    seqs, attn, plen = _padded(prompts, responses)
    with torch.no_grad():
        _, got = _loss(model(seqs, attention_mask=attn), seqs, plen, rmask, targets, model)
        want = _alone(model, prompts, responses, rmask, targets, backward=False)
    d = _masked_diff(got, want, rmask)
    assert d <= TOL, d
    # The comparison can fail: the same padded batch without its mask is far off.
    with torch.no_grad():
        _, unmasked = _loss(model(seqs), seqs, plen, rmask, targets, model)
    assert _masked_diff(unmasked, want, rmask) > 1e-2
    # pipeline_forward with two micro-batches, one of them unpadded: the same numbers.
    outs = pipeline_forward(model, seqs.chunk(2), model.groups, attention_masks=attn.chunk(2))
    got2 = torch.cat(
        [_loss(y, s, plen, m, t, model)[1] for y, s, m, t in
         zip(outs, seqs.chunk(2), rmask.chunk(2), targets.chunk(2))]
    )  # fmt: skip
    assert _masked_diff(got2, want, rmask) <= TOL


@pytest.mark.parametrize("critic", [False, True])
def test_train_step_equals_sum_of_samples(data, critic):
    prompts, responses, rmask, targets = data
    ref = _decoder(critic=critic)
    _alone(ref, prompts, responses, rmask, targets, backward=True)
    want = _grads(ref)
    seqs, attn, plen = _padded(prompts, responses)

    def step(seqs: torch.Tensor) -> dict[str, torch.Tensor]:
        model = _decoder(critic=critic)
        mbs = seqs.chunk(2)

        def loss_fn(y, m):
            return _loss(y, mbs[m], plen, rmask.chunk(2)[m], targets.chunk(2)[m], model)[0]

        pipeline_forward_backward(model, mbs, loss_fn, model.groups, attention_masks=attn.chunk(2))
        return _grads(model)

    got = step(seqs)
    scale = max(g.abs().max().item() for g in want.values())
    d = max((got[n] - want[n]).abs().max().item() for n in want)
    assert d <= TOL * scale, (d, scale)
    # Padding contributes nothing, not even rounding: other tokens in every padding slot
    # (the prompts' and the responses' after EOS) give bitwise the same gradients.
    pads = torch.cat([attn[:, :plen] == 0, rmask == 0], 1)
    other = torch.randint(3, CFG.vocab, seqs.shape, generator=torch.Generator().manual_seed(5))
    again = step(torch.where(pads, other, seqs))
    assert all(torch.equal(again[n], got[n]) for n in got)


def test_batch_generation_equals_each_prompt_alone(data):
    prompts = data[0]
    model = _decoder()
    ids, pmask = left_pad(prompts, PAD)
    kw = {"eos_id": EOS, "pad_id": PAD, "max_new_tokens": 10}
    out = generate(model, ids, prompt_mask=pmask, **kw)
    for i, p in enumerate(prompts):
        alone = generate(model, p[None], **kw)
        n = alone.responses.shape[1]
        assert torch.equal(out.responses[i, :n], alone.responses[0]), i
        assert torch.equal(out.response_mask[i, :n], alone.response_mask[0]), i


def test_positions_count_from_the_first_real_token(data):
    # Rotary attention sees only relative positions, so a row's common offset moves its
    # outputs by rounding alone (~1e-7, below TOL): check the positions themselves.
    prompts, responses, _, _ = data
    seqs, attn, plen = _padded(prompts, responses)
    pos = position_ids(attn)
    for i, p in enumerate(prompts):
        real = attn[i].bool()
        assert torch.equal(pos[i, real], torch.arange(len(p) + N_RESP))
        assert torch.equal(pos[i, ~real], torch.zeros(plen - len(p), dtype=torch.long))
    # transformers' formula (generation/utils.py: cumsum - 1, padding set to 0)
    assert torch.equal(pos, (attn.long().cumsum(-1) - 1).masked_fill(attn == 0, 0))
    # The forward derives exactly these (bitwise), not the columns' indices.
    model = _decoder()
    with torch.no_grad():
        got = model(seqs, attention_mask=attn)
        assert torch.equal(got, model(seqs, positions=pos, attention_mask=attn))
        cols = model(seqs, positions=torch.arange(seqs.shape[1]), attention_mask=attn)
    assert not torch.equal(got, cols)


def test_a_mask_without_padding_is_the_unmasked_path():
    # Equal-length batches stay bitwise what they were: a mask of ones changes nothing.
    model = _decoder()
    ids = torch.randint(3, CFG.vocab, (3, 7), generator=torch.Generator().manual_seed(1))
    ones = torch.ones_like(ids)
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=ones), model(ids))
    kw = {"temperature": 1.0, "max_new_tokens": 6}
    a = generate(model, ids, generator=torch.Generator().manual_seed(0), **kw)
    b = generate(model, ids, generator=torch.Generator().manual_seed(0), prompt_mask=ones, **kw)
    assert torch.equal(a.sequences, b.sequences) and a.attention_mask is None


def test_bad_masks_are_refused():
    model = _decoder()
    ids = torch.randint(3, CFG.vocab, (2, 5))
    right_padded = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match="left-pad"):
        generate(model, ids, 3, prompt_mask=right_padded)
    with pytest.raises(ValueError, match="left-pad"):
        generate(model, ids, 3, prompt_mask=torch.zeros_like(ids))
    with pytest.raises(ValueError, match="attention_mask"):
        model(ids, attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="2 attention masks for 1"):
        pipeline_forward(model, [ids], model.groups, attention_masks=[None, None])
    with pytest.raises(ValueError, match=r"1 \.\. width"):
        left_pad([ids[0], ids[0, :0]])


# ------------------------------------------------------------------ tp / pp / dp

WORLD = 4


def case_sharded(tp: int, pp: int, dp: int, critic: bool) -> dict:
    """Scores, a training step's gradients and greedy generation of a mixed-length batch
    at (dp, pp, tp), each against the samples run alone in one process."""
    from nereus_rl.models.model import allreduce_tied_gradients

    groups = init_parallel_groups(tp, pp, dp)
    prompts, responses, rmask, targets = _batch()
    ref = _decoder(critic=critic)
    want_scores = _alone(ref, prompts, responses, rmask, targets, backward=True)
    want_grads = _grads(ref)

    rows = len(prompts) // dp
    mine = slice(groups.dp_rank * rows, (groups.dp_rank + 1) * rows)
    # The batch is padded to the global width, as a trainer pads before splitting it.
    seqs, attn, plen = _padded(prompts, responses)
    seqs, attn, rm, tg = seqs[mine], attn[mine], rmask[mine], targets[mine]
    mbs, masks, rms, tgs = seqs.chunk(2), attn.chunk(2), rm.chunk(2), tg.chunk(2)
    model = _decoder(groups, critic)
    res: dict = {"last": model.is_last}

    outs = pipeline_forward(model, mbs, groups, attention_masks=masks)
    if outs is not None:
        got = torch.cat(
            [_loss(y, s, plen, m, t, model)[1] for y, s, m, t in zip(outs, mbs, rms, tgs)]
        )
        res["score_err"] = _masked_diff(got, want_scores[mine], rm)

    def loss_fn(y, m):
        # dp replicas' gradients are averaged: scale so that their mean is the sum
        return _loss(y, mbs[m], plen, rms[m], tgs[m], model)[0] * dp

    pipeline_forward_backward(model, mbs, loss_fn, groups, attention_masks=masks)
    allreduce_tied_gradients(model)
    allreduce_gradients(model, groups)
    scale = max(g.abs().max().item() for g in want_grads.values())
    res["grad_err"] = max(
        (p.grad - shard_tensor(want_grads[s.name], s.split_dim, groups.tp_rank, tp))
        .abs()
        .max()
        .item()
        / scale
        for s, p in zip(model.local_specs(), model.parameters())
    )

    if not critic:
        ids, pmask = left_pad(prompts, PAD)
        kw = {"eos_id": EOS, "pad_id": PAD, "max_new_tokens": 8}
        out = generate(model, ids[mine], prompt_mask=pmask[mine], groups=groups, **kw)
        same = True
        for i, p in zip(range(len(prompts))[mine], out.responses):
            alone = generate(ref, prompts[i][None], **kw).responses[0]
            same = same and torch.equal(p[: alone.shape[0]], alone)
        res["generate_equal"] = same
    return res


@pytest.fixture(scope="module")
def pool():
    p = GlooPool(__name__, WORLD)
    yield p
    p.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    "tp,pp,dp,critic",
    [(2, 1, 2, False), (1, 2, 2, False), (2, 2, 1, False), (2, 2, 1, True)],
)
def test_sharded_equals_each_sample_alone(pool, tp, pp, dp, critic):
    res = pool.run("case_sharded", tp, pp, dp, critic)
    last = [r for r in res if r["last"]]
    assert len(last) == WORLD // pp
    for r in last:
        assert r["score_err"] <= TOL, r
    for r in res:
        assert r["grad_err"] <= TOL, r
        assert r.get("generate_equal", True), r
