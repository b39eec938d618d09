"""Single-process checks of nereus_rl.models.model: presets, specs and shard naming, state
dicts, deterministic init, KV-cache generation, vocab-parallel log-probs."""

import math

import pytest
import torch

from nereus_rl.models.generate import KVCache, generate, make_generator
from nereus_rl.models.model import (
    PRESETS,
    Decoder,
    ModelConfig,
    ShardStateError,
    UnknownPresetError,
    check_tp_divisible,
    get_preset,
    state_specs,
)
from nereus_rl.models.parallel import (
    ParallelGroups,
    response_logprobs,
    response_values,
    stage_layers,
    vocab_parallel_logprobs,
)

TINY = get_preset("tiny")


def test_presets_and_param_counts():
    # tiny by hand: embed 64*64 + head 64*64 + final norm 64
    #   + 2 layers * (norms 2*64 + q 64*64 + k,v 2*32*64 + o 64*64 + gate/up/down 3*176*64)
    per_layer = 128 + 4096 + 2 * 2048 + 4096 + 3 * 176 * 64
    assert TINY.num_params == 4096 + 4096 + 64 + 2 * per_layer == 100_672
    critic = sum(math.prod(s.shape) for s in state_specs(TINY, value_head=True))
    assert critic == 100_672 - 4096 + 64
    assert 3e6 < PRESETS["small"].num_params < 6e6
    assert 1e8 < PRESETS["medium"].num_params < 3e8
    # the "a few hundred million" for benchmarks; its state specs hold exactly
    # the parameters the cost model counts
    large = PRESETS["large"]
    assert 2e8 < large.num_params < 1e9
    assert sum(math.prod(s.shape) for s in state_specs(large)) == large.num_params
    assert repr(TINY) == "ModelSpec(tiny: 0.1M params, L2 h64 heads 4/2 ffn176 V64)"
    assert TINY.num_params == 100_672  # the cost model's count equals the real state's
    with pytest.raises(UnknownPresetError, match="tiny"):
        get_preset("huge")


def test_config_validation():
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelConfig("x", 2, 64, 4, 3, 176, 64, 128)
    with pytest.raises(ValueError, match="num_heads"):
        ModelConfig("x", 2, 60, 8, 2, 176, 64, 128)
    with pytest.raises(ValueError, match="num_layers"):
        ModelConfig("x", 0, 64, 4, 2, 176, 64, 128)
    with pytest.raises(ValueError, match="num_kv_heads=2"):
        check_tp_divisible(TINY, 4)
    check_tp_divisible(TINY, 2)


def test_stage_layers_remainder_to_earlier_stages():
    assert [stage_layers(5, 2, p) for p in range(2)] == [[0, 1, 2], [3, 4]]
    assert [stage_layers(7, 3, p) for p in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [stage_layers(4, 4, p) for p in range(4)] == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="exceeds"):
        stage_layers(2, 3, 0)


def test_state_specs_follow_megatron_conventions():
    specs = {s.name: s for s in state_specs(TINY)}
    assert specs["embed.weight"][1:] == ((64, 64), torch.float32, 0, 0)
    assert specs["layers.1.attn.q.weight"].split_dim == 0
    assert specs["layers.1.attn.k.weight"].shape == (32, 64)  # 2 kv heads * 16
    assert specs["layers.1.attn.o.weight"].split_dim == 1
    assert specs["layers.0.mlp.gate.weight"].split_dim == 0
    assert specs["layers.0.mlp.up.weight"].split_dim == 0
    assert specs["layers.0.mlp.down.weight"][1:] == ((64, 176), torch.float32, 1, 0)
    assert specs["layers.0.attn_norm.weight"].split_dim is None
    assert specs["norm.weight"][3:] == (None, 1)
    assert specs["lm_head.weight"][3:] == (0, 1)
    critic = {s.name: s for s in state_specs(TINY, value_head=True, dtype=torch.float64)}
    assert "lm_head.weight" not in critic
    assert critic["value_head.weight"] == ("value_head.weight", (1, 64), torch.float64, None, 1)
    # The single-process model holds exactly the full state, in spec order.
    full = Decoder(TINY)
    assert [(n, tuple(p.shape)) for n, p in full.named_parameters()] == [
        (s.name, s.shape) for s in state_specs(TINY)
    ]


def test_sharded_stage_holds_its_slices():
    # Building a stage communicates nothing, so fake coordinates are enough here.
    groups = ParallelGroups(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2, pp_ranks=(1, 3))
    stage = Decoder(TINY, groups, seed=7)
    full = dict(Decoder(TINY, seed=7).named_parameters())
    names = [n for n, _ in stage.named_parameters()]
    assert names[0].startswith("layers.1.") and names[-2:] == ["norm.weight", "lm_head.weight"]
    assert "embed.weight" not in names
    for spec, (name, p) in zip(stage.local_specs(), stage.named_parameters()):
        assert spec.name == name
        want = full[name] if spec.split_dim is None else full[name].chunk(2, spec.split_dim)[1]
        assert torch.equal(p, want), name


def test_deterministic_init_and_state_dict_roundtrip():
    a, b = Decoder(TINY, seed=0), Decoder(TINY, seed=0)
    c = Decoder(TINY, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.embed.weight, c.embed.weight)
    x = torch.randint(0, 64, (2, 7))
    c.load_shard_state_dict(a.shard_state_dict())
    assert torch.equal(c(x), a(x))

    bad = dict(a.shard_state_dict())
    bad["layers.0.attn.q.weight"] = torch.zeros(32, 64)
    d = Decoder(TINY, seed=5)
    before = [p.clone() for p in d.parameters()]
    with pytest.raises(ShardStateError, match=r"layers\.0\.attn\.q\.weight"):
        d.load_shard_state_dict(bad)
    with pytest.raises(ShardStateError, match="missing"):
        d.load_shard_state_dict({"embed.weight": a.embed.weight})
    assert all(torch.equal(p, q) for p, q in zip(before, d.parameters()))  # nothing moved

    critic = Decoder(TINY, value_head=True, seed=5)
    critic.load_shard_state_dict(a.shard_state_dict(), strict=False)
    assert torch.equal(critic.embed.weight, a.embed.weight)
    assert critic(x).shape == (2, 7)


def test_dtype_is_a_parameter():
    m = Decoder(TINY, dtype=torch.float64)
    assert m(torch.randint(0, 64, (1, 5))).dtype == torch.float64


def test_response_logprobs_and_values_slice_the_response():
    m = Decoder(TINY, seed=1)
    seq = torch.randint(2, 64, (2, 9))
    logits = m(seq)
    lp = response_logprobs(logits, seq, 6, ParallelGroups.single())
    want = torch.log_softmax(logits, -1)[0, 5].gather(-1, seq[0, 6:7])  # pos 5 predicts 6
    assert lp.shape == (2, 3) and torch.allclose(lp[0, 0:1], want)
    values = Decoder(TINY, value_head=True)(seq)
    assert torch.equal(response_values(values, 6), values[:, 5:8])


def test_vocab_parallel_logprobs_single_process():
    logits = torch.randn(3, 5, 64, requires_grad=True)
    targets = torch.randint(0, 64, (3, 5))
    got = vocab_parallel_logprobs(logits, targets, ParallelGroups.single())
    want = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    assert torch.allclose(got, want, atol=1e-6)
    w = torch.randn(3, 5)
    (g1,) = torch.autograd.grad((got * w).sum(), logits)
    (g2,) = torch.autograd.grad((want * w).sum(), logits)
    assert torch.allclose(g1, g2, atol=1e-6)


def test_kv_cache_prefill_in_chunks_matches_full_forward():
    m = Decoder(TINY, seed=2)
    x = torch.randint(0, 64, (2, 11))
    full = m(x)
    cache = KVCache(m, 2, 16)
    parts = [m(x[:, :4], cache=cache), m(x[:, 4:5], cache=cache), m(x[:, 5:], cache=cache)]
    assert cache.length == 11
    assert torch.allclose(torch.cat(parts, 1), full, atol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_generation_with_cache_equals_without(temperature):
    m = Decoder(TINY, seed=4)
    prompts = torch.randint(2, 64, (6, 5))
    kw = {"temperature": temperature, "eos_id": 1, "max_new_tokens": 20}
    a = generate(m, prompts, generator=make_generator(9), **kw)
    b = generate(m, prompts, generator=make_generator(9), use_cache=False, **kw)
    assert torch.equal(a.sequences, b.sequences)
    assert torch.equal(a.response_mask, b.response_mask)
    assert torch.equal(a.sequences[:, :5], prompts)
    # After EOS a sequence is padded and masked out.
    for row, mask in zip(a.responses, a.response_mask):
        hits = (row == 1).nonzero()
        if len(hits):
            e = int(hits[0])
            assert mask[: e + 1].eq(1).all() and mask[e + 1 :].eq(0).all()
            assert row[e + 1 :].eq(0).all()
    # Same seed, same samples; another seed, other samples.
    if temperature > 0:
        c = generate(m, prompts, generator=make_generator(9), **kw)
        d = generate(m, prompts, generator=make_generator(10), **kw)
        assert torch.equal(a.sequences, c.sequences)
        assert not torch.equal(a.sequences, d.sequences)


def test_generate_rejects_bad_input():
    m = Decoder(TINY)
    p = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(m, p, 200)
    with pytest.raises(ValueError, match="generator"):
        generate(m, p, 3, temperature=1.0)
    with pytest.raises(ValueError, match="critic"):
        generate(Decoder(TINY, value_head=True), p, 3)
