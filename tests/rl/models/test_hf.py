"""Hugging Face checkpoints in and out of nereus_rl.models (nereus_rl.models.hf).

Two tiny random checkpoints are built with transformers in the test (nothing is
downloaded): a LlamaForCausalLM with untied embeddings, rope theta 5e5 and Llama 3
rope scaling, and a Qwen2ForCausalLM with tied embeddings and q/k/v biases. Norm scales
and biases are randomized so that a wrong mapping of either shows.

Tolerance: single-process logits come out bitwise equal to transformers' (same fp32
operations in the same order). Under tensor parallelism the row-parallel projections
sum partial products in another order, which moves fp32 results by a few ulps per layer;
``REL = 1e-5`` of the largest logit is ~100 fp32 ulps of it, far above that drift and far
below any real mistake (a dropped bias or wrong rope shows at 1e-2 and more, see
``test_the_comparison_can_fail``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]


def _import_transformers():
    """transformers, or a skip.

    transformers 5 imports the Hugging Face ``kernels`` distribution, and this repository's
    top-level ``kernels/`` folder (the Triton kernels) shadows it whenever the repository
    root is on sys.path (``python -m pytest`` puts it there): import transformers with the
    root left out, so ``kernels`` resolves to the installed distribution.
    """
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if Path(os.path.abspath(p or ".")) != ROOT]
    try:
        mod = sys.modules.get("kernels")
        if mod is not None and Path(getattr(mod, "__file__", "") or "").is_relative_to(ROOT):
            pytest.skip("the repository's kernels/ was imported as 'kernels' before transformers")
        mod = pytest.importorskip(
            "transformers", reason="transformers is not installed (pip install -e '.[test]')"
        )
        try:  # binds sys.modules["kernels"] to the distribution, for transformers' lazy imports
            import kernels  # noqa: F401
        except ImportError:
            pass
        for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "AutoModelForCausalLM"):
            getattr(mod, name)
        return mod
    finally:
        sys.path[:] = saved


transformers = _import_transformers()
safetensors = pytest.importorskip(
    "safetensors", reason="safetensors is not installed (pip install -e '.[hf]')"
)

from safetensors.torch import load_file, save_file  # noqa: E402
from support.gloo_pool import GlooPool  # noqa: E402

from nereus_rl.models.hf import (  # noqa: E402
    HFCheckpointError,
    hf_config,
    load_hf_weights,
    merge_shards,
    merge_tp_shards,
    read_hf_shards,
    save_hf,
    save_hf_stage,
)
from nereus_rl.models.model import (  # noqa: E402
    Decoder,
    ModelConfig,
    ShardStateError,
    as_model_config,
    get_preset,
    state_specs,
)
from nereus_rl.models.parallel import ParallelGroups, init_parallel_groups  # noqa: E402
from nereus_rl.models.pipeline import pipeline_forward, pipeline_forward_backward  # noqa: E402

REL = 1e-5
VOCAB = 64
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,  # pp=2 splits them 2 + 1
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    attn_implementation="sdpa",
)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Below the test's sequence length, so the scaling changes the logits.
    "original_max_position_embeddings": 16,
}


def _build(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    if arch == "llama":
        cfg = transformers.LlamaConfig(
            rope_theta=5e5, rms_norm_eps=1e-6, rope_scaling=LLAMA3, **COMMON
        )
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(
            rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, **COMMON
        )
        model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.eval()


def _tokens(b: int = 4, t: int = 40) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(7))


def _hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def _diff(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max abs diff, that over the largest |logit|)."""
    d = (got - want).abs().max().item()
    return d, d / want.abs().max().item()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """arch -> (folder, transformers model, reference logits)."""
    out = {}
    ids = _tokens()
    for arch in ("llama", "qwen2"):
        folder = tmp_path_factory.mktemp(f"hf_{arch}")
        model = _build(arch)
        model.save_pretrained(folder)
        out[arch] = (folder, model, _hf_logits(model, ids))
    return out


# ------------------------------------------------------------------ config


def test_hf_config_reads_the_fields(ckpts):
    llama = hf_config(ckpts["llama"][0])
    assert (llama.num_layers, llama.hidden, llama.num_heads, llama.num_kv_heads) == (3, 32, 4, 2)
    assert (llama.ffn_hidden, llama.vocab, llama.max_seq_len) == (48, VOCAB, 128)
    assert llama.rope_theta == 5e5 and llama.norm_eps == 1e-6
    assert llama.rope_scaling.factor == 8.0
    assert llama.rope_scaling.original_max_position_embeddings == 16
    assert not llama.qkv_bias and not llama.tie_embeddings and llama.arch == "llama"
    qwen = hf_config(ckpts["qwen2"][0])
    assert qwen.rope_theta == 1e6 and qwen.rope_scaling is None
    assert qwen.qkv_bias and qwen.tie_embeddings and qwen.arch == "qwen2"
    # The cost model's count is the checkpoint's: a tied embedding counts once.
    hf_count = sum(p.numel() for p in ckpts["qwen2"][1].parameters())
    assert qwen.num_params == hf_count
    assert llama.num_params == sum(p.numel() for p in ckpts["llama"][1].parameters())


def test_transformers4_style_rope_fields(tmp_path):
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 48,
        "vocab_size": 64,
        "rope_theta": 5e5,
        "rope_scaling": dict(LLAMA3, rope_type=None, type="llama3"),
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    c = hf_config(tmp_path)
    assert c.rope_theta == 5e5 and c.rope_scaling.factor == 8.0
    assert c.num_kv_heads == 4 and c.norm_eps == 1e-6 and c.max_seq_len == 2048


def test_presets_are_unchanged():
    # A preset read as a ModelConfig has exactly the behaviour it always had.
    tiny = get_preset("tiny")
    full = as_model_config(tiny)
    assert (full.rope_theta, full.norm_eps, full.qkv_bias, full.tie_embeddings) == (
        1e4,
        1e-5,
        False,
        False,
    )
    assert full.rope_scaling is None and full.num_params == tiny.num_params
    assert state_specs(full) == state_specs(tiny)
    ids = _tokens(2, 12)
    a, b = Decoder(tiny, seed=1), Decoder(full, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert torch.equal(a(ids), b(ids))


# ------------------------------------------------------------------ exactness, one process


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logits_equal_transformers(ckpts, arch):
    folder, _, want = ckpts[arch]
    model = Decoder(hf_config(folder))
    load_hf_weights(model, folder)
    with torch.no_grad():
        got = model(_tokens())
    _, rel = _diff(got, want)
    assert rel <= REL, rel


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_comparison_can_fail(ckpts, arch):
    # Without the architecture details the logits are far off: the test would notice.
    folder, _, want = ckpts[arch]
    c = hf_config(folder)
    wrong = ModelConfig(
        c.name, c.num_layers, c.hidden, c.num_heads, c.num_kv_heads, c.ffn_hidden,
        c.vocab, c.max_seq_len, qkv_bias=c.qkv_bias, tie_embeddings=c.tie_embeddings,
        arch=c.arch, norm_eps=c.norm_eps, rope_theta=c.rope_theta,
    )  # fmt: skip
    if arch == "llama":  # drop only the llama3 scaling
        model = Decoder(wrong)
    else:  # drop only the biases
        model = Decoder(c)
    state = read_hf_shards(folder, model.local_specs(), c)
    if arch == "qwen2":
        state = {k: (torch.zeros_like(v) if k.endswith(".bias") else v) for k, v in state.items()}
    model.load_shard_state_dict(state)
    with torch.no_grad():
        _, rel = _diff(model(_tokens()), want)
    assert rel > 1e-3, rel


def test_tied_weight_is_one_parameter_in_one_stage(ckpts):
    folder = ckpts["qwen2"][0]
    model = Decoder(hf_config(folder))
    assert model.lm_head.weight is model.embed.weight
    state = model.shard_state_dict()
    assert torch.equal(state["embed.weight"], state["lm_head.weight"])
    assert [s.name for s in model.local_specs()] == list(state)
    bad = dict(state, **{"lm_head.weight": state["lm_head.weight"] + 1})
    with pytest.raises(ShardStateError, match="tied"):
        model.load_shard_state_dict(bad)


# ------------------------------------------------------------------ shards and saving


def _stage_models(folder, tp: int, pp: int, critic: bool = False):
    """Every (pp_rank, tp_rank)'s Decoder, built without process groups and loaded."""
    c = hf_config(folder)
    out = {}
    for p in range(pp):
        for t in range(tp):
            g = ParallelGroups(tp_rank=t, tp_size=tp, pp_rank=p, pp_size=pp)
            m = Decoder(c, g, value_head=critic, seed=5)
            load_hf_weights(m, folder)
            out[(p, t)] = m
    return c, out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_each_rank_reads_its_slices(ckpts, arch):
    folder = ckpts[arch][0]
    c, ranks = _stage_models(folder, tp=2, pp=2)
    full = Decoder(c)
    load_hf_weights(full, folder)
    want = full.shard_state_dict()
    merged = merge_shards({k: m.shard_state_dict() for k, m in ranks.items()}, c)
    assert merged.keys() == want.keys()
    assert all(torch.equal(merged[k], want[k]) for k in want)
    # Tied under pp: the first stage's embedding and the last stage's head are copies.
    if c.tie_embeddings:
        assert "lm_head.weight" not in ranks[(0, 0)].shard_state_dict()
        assert torch.equal(
            ranks[(1, 1)].shard_state_dict()["lm_head.weight"],
            ranks[(0, 1)].shard_state_dict()["embed.weight"],
        )


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("max_shard_bytes", [None, 20_000])
def test_save_then_transformers_loads_the_same_logits(ckpts, arch, max_shard_bytes, tmp_path):
    folder, _, want = ckpts[arch]
    c = hf_config(folder)
    model = Decoder(c)
    load_hf_weights(model, folder)
    kw = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    written = save_hf(tmp_path, model.shard_state_dict(), c, **kw)
    assert ((tmp_path / "model.safetensors.index.json").exists()) == (max_shard_bytes is not None)
    assert all(p.exists() for p in written)
    cls = transformers.AutoModelForCausalLM
    again = cls.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    assert type(again).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    _, rel = _diff(_hf_logits(again, _tokens()), want)
    assert rel <= REL, rel
    # And back into nereus_rl, through the sharded index when there is one.
    assert hf_config(tmp_path).num_params == c.num_params
    other = Decoder(hf_config(tmp_path), seed=9)
    load_hf_weights(other, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(other.parameters(), model.parameters()))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_each_stage_writes_its_own_file(ckpts, arch, tmp_path):
    folder, _, want = ckpts[arch]
    c, ranks = _stage_models(folder, tp=2, pp=2)
    # Stages in reverse: no stage waits for another's file.
    for p in (1, 0):
        shards = [ranks[(p, t)].shard_state_dict() for t in range(2)]
        specs = ranks[(p, 0)].local_specs()
        save_hf_stage(tmp_path, merge_tp_shards(shards, specs), c, stage=p, num_stages=2)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    on_disk = {k for f in files for k in load_file(tmp_path / f)}
    assert on_disk == set(index["weight_map"])
    sizes = sum(t.numel() * 4 for f in files for t in load_file(tmp_path / f).values())
    assert index["metadata"]["total_size"] == sizes
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    _, rel = _diff(_hf_logits(again, _tokens()), want)
    assert rel <= REL, rel


def test_critic_loads_the_trunk_and_keeps_its_head(ckpts):
    folder = ckpts["llama"][0]
    critic = Decoder(hf_config(folder), value_head=True, seed=4)
    head = critic.value_head.weight.detach().clone()
    state = load_hf_weights(critic, folder)
    assert "value_head.weight" not in state and torch.equal(critic.value_head.weight, head)
    policy = Decoder(hf_config(folder))
    load_hf_weights(policy, folder)
    assert torch.equal(critic.layers["2"].mlp.down.weight, policy.layers["2"].mlp.down.weight)


def test_specs_target_and_bf16(ckpts, tmp_path):
    folder = ckpts["llama"][0]
    c = hf_config(folder)
    specs = [s for s in state_specs(c) if s.layer == 1]
    got = load_hf_weights(specs, folder, tp_rank=1, tp_size=2)
    full = load_file(folder / "model.safetensors")
    assert torch.equal(
        got["layers.1.attn.o.weight"], full["model.layers.1.self_attn.o_proj.weight"][:, 16:]
    )
    # A bf16 checkpoint loads exactly into an fp32 model; the reverse needs cast=True.
    policy = Decoder(c)
    load_hf_weights(policy, folder)
    state = {k: v.to(torch.bfloat16) for k, v in policy.shard_state_dict().items()}
    save_hf(tmp_path / "bf16", state, c)
    assert json.loads((tmp_path / "bf16/config.json").read_text())["torch_dtype"] == "bfloat16"
    up = Decoder(c)
    load_hf_weights(up, tmp_path / "bf16")
    assert torch.equal(up.embed.weight, state["embed.weight"].float())
    low = Decoder(c, dtype=torch.bfloat16)
    with pytest.raises(HFCheckpointError, match=r"model\.embed_tokens\.weight.*round"):
        load_hf_weights(low, folder)
    load_hf_weights(low, folder, cast=True)


# ------------------------------------------------------------------ bad input


def _copy_ckpt(src, dst, edit_config=None, edit_tensors=None):
    dst.mkdir()
    raw = json.loads((src / "config.json").read_text())
    if edit_config:
        edit_config(raw)
    (dst / "config.json").write_text(json.dumps(raw))
    tensors = load_file(src / "model.safetensors")
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda r: r.update(architectures=["MistralForCausalLM"]), "architectures"),
        (lambda r: r.update(model_type="mistral"), "model_type"),
        (lambda r: r.update(hidden_act="gelu"), "hidden_act='gelu'"),
        (lambda r: r["rope_parameters"].update(rope_type="yarn"), "rope_type='yarn'"),
        (lambda r: r["rope_parameters"].update(partial_rotary_factor=0.5), "partial_rotary"),
        (lambda r: r["rope_parameters"].pop("low_freq_factor"), "low_freq_factor"),
        (lambda r: r.update(attention_bias=True), "attention_bias=true"),
        (lambda r: r.update(mlp_bias=True), "mlp_bias"),
        (lambda r: r.update(head_dim=16), "head_dim=16"),
        (lambda r: r.update(attention_dropout=0.1), "attention_dropout"),
        (lambda r: r.pop("hidden_size"), "hidden_size is missing"),
        (lambda r: r.update(num_key_value_heads=3), "num_kv_heads"),
    ],
)
def test_unsupported_llama_config(ckpts, tmp_path, edit, match):
    folder = _copy_ckpt(ckpts["llama"][0], tmp_path / "c", edit_config=edit)
    with pytest.raises(HFCheckpointError, match=match) as e:
        hf_config(folder)
    assert str(folder / "config.json") in str(e.value)


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda r: r.update(use_sliding_window=True), "use_sliding_window"),
        (lambda r: r.update(layer_types=["sliding_attention"] * 3), "layer_types"),
        (lambda r: r.update(rope_parameters={"rope_type": "linear", "factor": 2.0}), "linear"),
    ],
)
def test_unsupported_qwen2_config(ckpts, tmp_path, edit, match):
    folder = _copy_ckpt(ckpts["qwen2"][0], tmp_path / "c", edit_config=edit)
    with pytest.raises(HFCheckpointError, match=match) as e:
        hf_config(folder)
    assert str(folder / "config.json") in str(e.value)


def _set(name, value):
    def edit(t):
        t[name] = value

    return edit


@pytest.mark.parametrize(
    "edit_tensors,match",
    [
        (
            _set("model.layers.1.self_attn.k_proj.weight", torch.zeros(8, 32)),
            r"model.layers.1.self_attn.k_proj.weight in .*model.safetensors has shape \(8, 32\).*"
            r"implies \(16, 32\)",
        ),
        (
            _set("model.norm.weight", torch.ones(32, dtype=torch.float16)),
            r"model.norm.weight in .*model.safetensors is torch.float16.*declares",
        ),
        (
            _set("model.layers.3.mlp.up_proj.weight", torch.zeros(48, 32)),
            r"model.layers.3.mlp.up_proj.weight in .*model.safetensors is not a weight",
        ),
        (
            lambda t: t.pop("lm_head.weight"),
            r"lm_head.weight is missing from .*model.safetensors",
        ),
    ],
)
def test_bad_tensors(ckpts, tmp_path, edit_tensors, match):
    folder = _copy_ckpt(ckpts["llama"][0], tmp_path / "c", edit_tensors=edit_tensors)
    with pytest.raises(HFCheckpointError, match=match):
        load_hf_weights(Decoder(hf_config(folder)), folder)


def test_bad_folders(ckpts, tmp_path):
    with pytest.raises(HFCheckpointError, match=r"config\.json: not found"):
        hf_config(tmp_path)
    folder = _copy_ckpt(ckpts["llama"][0], tmp_path / "c")
    (folder / "model.safetensors").unlink()
    with pytest.raises(HFCheckpointError, match=r"neither model\.safetensors nor"):
        load_hf_weights(Decoder(hf_config(folder)), folder)
    # An index naming a file that is not there.
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.embed_tokens.weight": "gone.safetensors"}})
    )
    with pytest.raises(HFCheckpointError, match=r"gone\.safetensors: not found"):
        load_hf_weights(Decoder(hf_config(folder)), folder)
    # A Decoder of another shape than the folder's.
    c = hf_config(ckpts["llama"][0])
    other = ModelConfig("x", 3, 32, 4, 4, 48, VOCAB, 128, rope_theta=5e5)
    with pytest.raises(HFCheckpointError, match="num_kv_heads: 2 in the folder, 4 here"):
        load_hf_weights(Decoder(other), ckpts["llama"][0])
    # Saving what a checkpoint cannot express.
    m = Decoder(c)
    bad = ModelConfig("x", 3, 32, 4, 2, 48, VOCAB, 128, qkv_bias=True, arch="llama")
    with pytest.raises(HFCheckpointError, match="qkv_bias"):
        save_hf(tmp_path / "o", Decoder(bad).shard_state_dict(), bad)
    with pytest.raises(ValueError, match="lacks"):
        save_hf(tmp_path / "o", {"embed.weight": m.embed.weight}, c)
    tied = ModelConfig("t", 3, 32, 4, 2, 48, VOCAB, 128, tie_embeddings=True)
    state = Decoder(tied).shard_state_dict()
    state["lm_head.weight"] = state["lm_head.weight"] + 1
    with pytest.raises(ValueError, match=r"differs from embed\.weight"):
        save_hf(tmp_path / "o", state, tied)


# ------------------------------------------------------------------ tp / pp in processes

WORLD = 4


def case_forward(tp, pp, folder, tokens):
    """This rank's logits shard (last stage) from the checkpoint at (tp, pp, dp=4/(tp*pp))."""
    dp = WORLD // (tp * pp)
    groups = init_parallel_groups(tp, pp, dp)
    model = Decoder(hf_config(folder), groups, seed=11)
    load_hf_weights(model, folder)
    outs = pipeline_forward(model, tokens.chunk(2), groups)
    if outs is None:
        return None
    return {"tp_rank": groups.tp_rank, "dp_rank": groups.dp_rank, "logits": torch.cat(outs)}


def case_tied_grads(folder, tokens):
    """Tied embedding gradients at tp2 pp2 vs one process: both copies get the full sum."""
    from nereus_rl.models.model import allreduce_tied_gradients
    from nereus_rl.models.parallel import vocab_parallel_logprobs

    c = hf_config(folder)
    ref = Decoder(c)
    load_hf_weights(ref, folder)
    (-vocab_parallel_logprobs(ref(tokens)[:, :-1], tokens[:, 1:], ref.groups).sum()).backward()
    groups = init_parallel_groups(2, 2, 1)
    model = Decoder(c, groups)
    load_hf_weights(model, folder)

    def loss(y, m):
        return -vocab_parallel_logprobs(y[:, :-1], tokens[:, 1:], groups).sum()

    pipeline_forward_backward(model, [tokens], loss, groups)
    allreduce_tied_gradients(model)
    rows = VOCAB // 2
    want = ref.embed.weight.grad[groups.tp_rank * rows : (groups.tp_rank + 1) * rows]
    mod = model.embed if model.is_first else model.lm_head
    return (mod.weight.grad - want).abs().max().item() / want.abs().max().item()


@pytest.fixture(scope="module")
def pool():
    p = GlooPool(__name__, WORLD)
    yield p
    p.close()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_sharded_logits_equal_transformers(pool, ckpts, arch, tp, pp):
    folder, _, want = ckpts[arch]
    tokens = _tokens()
    res = [r for r in pool.run("case_forward", tp, pp, str(folder), tokens) if r is not None]
    assert len(res) == WORLD // pp  # every last-stage rank answered
    width = VOCAB // tp
    for r in res:
        ref = want[..., r["tp_rank"] * width : (r["tp_rank"] + 1) * width]
        d = (r["logits"] - ref).abs().max().item()
        assert d / want.abs().max().item() <= REL, (arch, tp, pp, d)


@pytest.mark.slow
def test_tied_gradients_sum_over_the_pipeline(pool, ckpts):
    folder = ckpts["qwen2"][0]
    res = pool.run("case_tied_grads", str(folder), _tokens(2, 12))
    assert all(r <= 1e-5 for r in res), res
