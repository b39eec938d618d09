"""Conventions tables against slicers written here: Hugging Face tensors cut with torch.chunk,
Megatron-Core's shards written out (per-group QKV interleave, per-rank [gate_t; up_t],
padded vocabulary), a Megatron TP2xPP2 -> TP4 reshard run through the plan in one process,
the uneven-groups refusal, Megatron's rank grid, and the name maps."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from nereus_comm.conventions import (
    CONVENTIONS,
    MEGATRON_FUSED,
    Ref,
    check_megatron_tp,
    from_megatron,
    fuse_fc1,
    fuse_qkv,
    hf_specs,
    megatron_divisible_by,
    megatron_global_name,
    megatron_layout,
    megatron_local_name,
    megatron_padded_vocab,
    megatron_ranks,
    megatron_specs,
    model_shape,
    name_map,
    pad_vocab,
    split_fc1,
    split_qkv,
    to_megatron,
    unpad_vocab,
)
from nereus_comm.errors import LayoutError
from nereus_comm.layout import Layout, box_shape
from nereus_comm.plan import plan_reshard
from nereus_comm.specs import transformer_state_specs

# hidden 16, 8 heads of 2 in 4 query groups, ffn 24, vocab 1100 (pads differently per tp).
QWEN = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "num_hidden_layers": 2,
    "hidden_size": 16,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 24,
    "vocab_size": 1100,
    "tie_word_embeddings": False,
}
LLAMA_TIED = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 3,
    "hidden_size": 24,
    "num_attention_heads": 6,
    "num_key_value_heads": 3,
    "intermediate_size": 40,
    "vocab_size": 50,
    "tie_word_embeddings": True,
}
H, HEADS, GROUPS, HD, FFN, VOCAB, LAYERS = 16, 8, 4, 2, 24, 1100, 2


def _hf_full(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random full tensors of every Hugging Face name, shapes written out here."""
    g = torch.Generator().manual_seed(seed)
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * (hidden // heads)
    ffn, vocab = cfg["intermediate_size"], cfg["vocab_size"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        shapes |= {
            pre + "input_layernorm.weight": (hidden,),
            pre + "post_attention_layernorm.weight": (hidden,),
            pre + "self_attn.q_proj.weight": (hidden, hidden),
            pre + "self_attn.k_proj.weight": (kv, hidden),
            pre + "self_attn.v_proj.weight": (kv, hidden),
            pre + "self_attn.o_proj.weight": (hidden, hidden),
            pre + "mlp.gate_proj.weight": (ffn, hidden),
            pre + "mlp.up_proj.weight": (ffn, hidden),
            pre + "mlp.down_proj.weight": (hidden, ffn),
        }
        if cfg["model_type"] == "qwen2":
            for x, n in (("q", hidden), ("k", kv), ("v", kv)):
                shapes[pre + f"self_attn.{x}_proj.bias"] = (n,)
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def _cut(t: torch.Tensor, box) -> torch.Tensor:
    return t[tuple(slice(a, b) for a, b in box)]


# ------------------------------------------------------------------ Hugging Face tables


@pytest.mark.parametrize("cfg", [QWEN, LLAMA_TIED], ids=["qwen2", "llama-tied"])
def test_hf_specs_shapes_and_torch_chunk_shards(cfg):
    full = _hf_full(cfg)
    specs = hf_specs(cfg, dtype=torch.float32)
    assert specs[0].name == "model.embed_tokens.weight"
    assert {s.name for s in specs} == set(full)  # tied: no lm_head.weight
    last = cfg["num_hidden_layers"] - 1
    for spec in specs:
        assert spec.shape == tuple(full[spec.name].shape), spec
        name = spec.name
        row_parallel = name.endswith(("o_proj.weight", "down_proj.weight"))
        norm = name.endswith("norm.weight")
        assert spec.split_dim == (None if norm else 1 if row_parallel else 0), spec
        if name.startswith("model.layers."):
            assert spec.stage_key == int(name.split(".")[2]), spec
        else:
            assert spec.stage_key == (0 if "embed" in name else last), spec
        for tp in (1, 2, 3, 4):
            lay = Layout(1, tp, 1, tuple(range(tp)))
            for t in range(tp):
                got = _cut(full[name], lay.shard_box(spec, t))
                if spec.split_dim is None:
                    want = full[name]
                else:
                    chunks = full[name].chunk(tp, dim=spec.split_dim)
                    want = chunks[t] if t < len(chunks) else got.new_empty(got.shape)
                assert torch.equal(got, want), (name, tp, t)


def test_hf_specs_in_nereus_names_are_transformer_state_specs():
    cfg = dict(QWEN, architectures=["LlamaForCausalLM"], model_type="llama")
    to_nereus = name_map(cfg, "hf", "nereus")
    prefixes = ("master.", "optim.exp_avg_sq.", "optim.exp_avg.", "")

    def rename(name: str) -> str:
        if name == "optim.step":
            return name
        pre = next(p for p in prefixes if name.startswith(p) and Ref(name[len(p) :]) in to_nereus)
        return pre + to_nereus[Ref(name[len(pre) :])].name

    for optimizer in (False, True):
        ours = hf_specs(cfg, dtype=torch.float16, with_optimizer=optimizer)
        theirs = transformer_state_specs(
            LAYERS,
            H,
            FFN,
            HEADS,
            GROUPS,
            VOCAB,
            param_dtype=torch.float16,
            adam=optimizer,
            master_fp32=optimizer,
        )
        got = [(rename(s.name), s.shape, s.dtype, s.split_dim, s.stage_key) for s in ours]
        assert got == [(s.name, s.shape, s.dtype, s.split_dim, s.stage_key) for s in theirs]


def test_model_shape_reads_configs():
    s = model_shape(QWEN)
    got = (s.hidden, s.num_heads, s.num_kv_heads, s.head_dim, s.ffn, s.vocab)
    assert got == (16, 8, 4, 2, 24, 1100)
    assert s.qkv_bias and not s.tie_embeddings
    assert model_shape(LLAMA_TIED).tie_embeddings and not model_shape(LLAMA_TIED).qkv_bias
    own = model_shape(
        dict(
            num_layers=2, hidden=16, num_heads=8, num_kv_heads=4, ffn=24, vocab=1100, qkv_bias=True
        )
    )
    assert own == s
    assert model_shape(dict(QWEN, head_dim=8)).symbols()["q"] == 64
    with pytest.raises(LayoutError, match="attention_bias"):
        model_shape(dict(LLAMA_TIED, attention_bias=True))
    with pytest.raises(LayoutError, match="multiple of num_kv_heads"):
        model_shape(dict(QWEN, num_key_value_heads=3))
    with pytest.raises(LayoutError, match=r"lacks \['ffn'\]"):
        model_shape({k: v for k, v in QWEN.items() if k != "intermediate_size"})


# ------------------------------------------------------------------ Megatron, written out


def _megatron_padded(vocab: int, tp: int, divisible_by: int) -> int:
    """Megatron-LM's _vocab_size_with_padding, as it was first written."""
    after = vocab
    while after % (divisible_by * tp):
        after += 1
    return after


def _megatron_rank_state(hf, tp, t, pp, p, padded, convention="megatron"):
    """What Megatron rank (tp t, pp stage p) holds, under Megatron's local names."""
    per_stage = LAYERS // pp
    qpg = HEADS // GROUPS
    out = {}

    def rows(x, parts, i):  # i-th of `parts` equal row blocks
        n = x.shape[0] // parts
        return x[i * n : (i + 1) * n]

    def cols(x, parts, i):
        n = x.shape[1] // parts
        return x[:, i * n : (i + 1) * n]

    def padded_rows(x):
        x = torch.cat([x, torch.zeros(padded - x.shape[0], *x.shape[1:])])
        return rows(x, tp, t)

    if p == 0:
        out["embedding.word_embeddings.weight"] = padded_rows(hf["model.embed_tokens.weight"])
    if p == pp - 1:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        out["output_layer.weight"] = padded_rows(hf["lm_head.weight"])
    te = convention == "megatron_te"
    for local in range(per_stage):
        i = p * per_stage + local
        src, dst = f"model.layers.{i}.", f"decoder.layers.{local}."
        qkv = dst + "self_attention.linear_qkv."
        fc1 = dst + "mlp.linear_fc1."
        for kind in ("weight", "bias"):
            q = hf[src + f"self_attn.q_proj.{kind}"]
            k = hf[src + f"self_attn.k_proj.{kind}"]
            v = hf[src + f"self_attn.v_proj.{kind}"]
            blocks = []
            for g in range(t * GROUPS // tp, (t + 1) * GROUPS // tp):
                blocks += [q[g * qpg * HD : (g + 1) * qpg * HD], k[g * HD : (g + 1) * HD]]
                blocks.append(v[g * HD : (g + 1) * HD])
            out[qkv + kind] = torch.cat(blocks)
        gate, up = hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]
        out[fc1 + "weight"] = torch.cat([rows(gate, tp, t), rows(up, tp, t)])
        out[dst + "self_attention.linear_proj.weight"] = cols(
            hf[src + "self_attn.o_proj.weight"], tp, t
        )
        out[dst + "mlp.linear_fc2.weight"] = cols(hf[src + "mlp.down_proj.weight"], tp, t)
        attn_norm = qkv + "layer_norm_weight" if te else dst + "input_layernorm.weight"
        mlp_norm = fc1 + "layer_norm_weight" if te else dst + "pre_mlp_layernorm.weight"
        out[attn_norm] = hf[src + "input_layernorm.weight"]
        out[mlp_norm] = hf[src + "post_attention_layernorm.weight"]
    return out


def _megatron_full_views(hf, specs, padded):
    """Full tensors of the Megatron specs, made with the conventions' fuse helpers."""
    out = {}
    for i in range(LAYERS):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        for kind in ("weight", "bias"):
            q, k, v = (hf[src + f"self_attn.{x}_proj.{kind}"] for x in "qkv")
            out[dst + f"self_attention.linear_qkv.{kind}"] = fuse_qkv(q, k, v, GROUPS)
        gate, up = hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]
        out[dst + "mlp.linear_fc1.weight"] = fuse_fc1(gate, up)
    hf_to_meg = name_map(QWEN, "hf", "megatron")
    for hf_ref, meg_ref in hf_to_meg.items():
        if meg_ref.part is None:
            out[meg_ref.name] = hf[hf_ref.name]
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        out[name] = pad_vocab(out[name], padded)
    assert set(out) == {s.name for s in specs}
    return out


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("convention", ["megatron", "megatron_te"])
def test_megatron_specs_cut_as_megatron_does(tp, convention):
    hf = _hf_full(QWEN, seed=1)
    specs = megatron_specs(QWEN, tp=tp, dtype=torch.float32, convention=convention)
    padded = _megatron_padded(VOCAB, tp, 128)
    views = _megatron_full_views(hf, megatron_specs(QWEN, tp=tp), padded)
    if convention == "megatron_te":  # the same tensors, two norms renamed
        rename = {
            m.name: te.name
            for m, te in zip(
                name_map(QWEN, "hf", "megatron").values(),
                name_map(QWEN, "hf", "megatron_te").values(),
            )
        }
        views = {rename.get(k, k): v for k, v in views.items()}
    assert {s.name for s in specs} == set(views)
    lay = megatron_layout(tp, 1, 1, num_layers=LAYERS)
    for spec in specs:
        assert spec.shape == tuple(views[spec.name].shape), spec
        for t in range(tp):
            want = _megatron_rank_state(hf, tp, t, 1, 0, padded, convention)[spec.name]
            shard = _cut(views[spec.name], lay.box(spec, lay.rank_at(0, 0, t))).contiguous()
            if any(spec.name.endswith("." + f) for f in MEGATRON_FUSED):
                got = to_megatron(shard)
                assert torch.equal(from_megatron(want, spec), shard)
            else:
                got = shard
            assert torch.equal(got, want), (spec.name, tp, t)


def test_fused_parts_follow_the_name_map():
    hf = _hf_full(QWEN, seed=2)
    views = _megatron_full_views(hf, megatron_specs(QWEN, tp=1), _megatron_padded(VOCAB, 1, 128))
    for hf_ref, meg_ref in name_map(QWEN, "hf", "megatron").items():
        fused = views[meg_ref.name]
        if meg_ref.part in ("q", "k", "v"):
            got = dict(zip("qkv", split_qkv(fused, HEADS, GROUPS)))[meg_ref.part]
        elif meg_ref.part in ("gate", "up"):
            got = dict(zip(("gate", "up"), split_fc1(fused)))[meg_ref.part]
        elif meg_ref.name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            got = unpad_vocab(fused, VOCAB)
        else:
            got = fused
        assert torch.equal(got, hf[hf_ref.name]), hf_ref


def test_vocab_padding():
    for vocab, tp, d in itertools.product((1, 50, 1100, 32000, 128256), (1, 2, 3, 4, 8), (1, 128)):
        assert megatron_padded_vocab(vocab, tp, d) == _megatron_padded(vocab, tp, d)
    # One padded size for several tp degrees; Megatron reaches it at each with its divisor.
    shared = megatron_padded_vocab(VOCAB, (2, 4))
    assert shared == 1536 != _megatron_padded(VOCAB, 2, 128) == 1280
    for tp in (2, 4):
        assert _megatron_padded(VOCAB, tp, megatron_divisible_by(shared, tp)) == shared
    shared = megatron_padded_vocab(VOCAB, (2, 3))
    assert shared == 1536
    for tp in (2, 3):
        assert _megatron_padded(VOCAB, tp, megatron_divisible_by(shared, tp)) == shared
    x = torch.randn(VOCAB, 3)
    padded = pad_vocab(x, shared)
    assert padded.shape == (shared, 3) and not padded[VOCAB:].any()
    assert torch.equal(unpad_vocab(padded, VOCAB), x)
    assert torch.equal(unpad_vocab(pad_vocab(x.T, shared, dim=1), VOCAB, dim=1), x.T)
    with pytest.raises(LayoutError, match="fewer"):
        pad_vocab(x, VOCAB - 1)


# ------------------------------------------------------------------ resharding


def _run_plan_in_process(plan, src_shards):
    """Every destination shard, assembled from the plan's pieces (NaN where none lands)."""
    out = {}
    for r in plan.dst.ranks:
        mine = {}
        for spec in plan.specs:
            box = plan.dst.box(spec, r)
            if box is not None:
                mine[spec.name] = torch.full(box_shape(box), float("nan"))
        moves = [(r, p) for p in plan.local_copies(r)]
        moves += [(m.src, p) for m in plan.recvs(r) for p in m.pieces]
        for src, piece in moves:
            spec = plan.specs[piece.tensor]
            sbox, dbox = plan.src.box(spec, src), plan.dst.box(spec, r)
            dst_idx = tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(piece.box, dbox))
            src_idx = tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(piece.box, sbox))
            mine[spec.name][dst_idx] = src_shards[src][spec.name][src_idx]
        out[r] = mine
    return out


def test_reshard_megatron_tp2_pp2_to_tp4_equals_megatron_shards():
    hf = _hf_full(QWEN, seed=3)
    specs = megatron_specs(QWEN, tp=(2, 4), dtype=torch.float32)
    by_name = {s.name: s for s in specs}
    padded = by_name["output_layer.weight"].shape[0]
    assert padded == 1536
    fused = {n for n, s in by_name.items() if any(n.endswith("." + f) for f in MEGATRON_FUSED)}
    src = megatron_layout(2, 2, 1, num_layers=LAYERS)
    dst = megatron_layout(4, 1, 1, ranks=(3, 2, 1, 0), num_layers=LAYERS)
    # Every source rank hands over Megatron's own local state, renamed and viewed.
    src_shards = {}
    for r in src.ranks:
        _, p, t = src.coords(r)
        local = _megatron_rank_state(hf, 2, t, 2, p, padded)
        shards = {}
        for name, x in local.items():
            g = megatron_global_name(name, p, LAYERS, 2)
            shards[g] = from_megatron(x, by_name[g]) if g in fused else x
            assert shards[g].shape == box_shape(src.box(by_name[g], r)), g
        src_shards[r] = shards
    got = _run_plan_in_process(plan_reshard(specs, src, dst), src_shards)
    for r in dst.ranks:
        _, _, t = dst.coords(r)
        want = _megatron_rank_state(hf, 4, t, 1, 0, padded)
        assert set(got[r]) == set(want)
        for name, x in got[r].items():
            mine = to_megatron(x) if name in fused else x
            stage, local = megatron_local_name(name, LAYERS, 1)
            assert stage == 0
            assert torch.equal(mine, want[local]), (r, name)
    # The naive form is not Megatron's: a dim-0 chunk of the flat fused fc1 differs.
    fc1 = to_megatron(
        fuse_fc1(hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"])
    )
    want = _megatron_rank_state(hf, 4, 1, 1, 0, padded)["decoder.layers.0.mlp.linear_fc1.weight"]
    assert not torch.equal(fc1.chunk(4)[1], want)


def test_uneven_query_groups_are_refused():
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    with pytest.raises(LayoutError, match=rf"{name}: 4 query groups .* tp=8"):
        megatron_specs(QWEN, tp=8)
    with pytest.raises(LayoutError, match=rf"{name}: 4 query groups .* tp=8"):
        megatron_specs(QWEN, tp=(2, 8))
    three = dict(QWEN, num_attention_heads=6, num_key_value_heads=3, hidden_size=24)
    with pytest.raises(LayoutError, match=rf"{name}: 3 query groups .* tp=2"):
        megatron_specs(three, tp=2)
    # Specs built for tp 2, checked against a later tp 8 (the padded vocab splits over 8).
    with pytest.raises(LayoutError, match=rf"{name}: 4 query groups .* tp=8"):
        check_megatron_tp(megatron_specs(QWEN, tp=2), 8)
    with pytest.raises(LayoutError, match=r"linear_fc1\.weight: dim 1 of size 24 .* tp=16"):
        check_megatron_tp(
            megatron_specs(
                dict(QWEN, num_key_value_heads=16, num_attention_heads=16, hidden_size=64), tp=1
            ),
            16,
        )
    check_megatron_tp(megatron_specs(QWEN, tp=2), (1, 2))


# ------------------------------------------------------------------ ranks and names


def _megatron_coords(rank, order, sizes):
    """Megatron's RankGenerator decomposition: the first axis of `order` fastest."""
    coords = {}
    for axis in order.split("-"):
        coords[axis] = rank % sizes[axis]
        rank //= sizes[axis]
    return coords


@pytest.mark.parametrize("order", ["tp-cp-ep-dp-pp", "tp-pp-dp", "tp-dp-pp"])
@pytest.mark.parametrize(("tp", "pp", "dp", "cp"), [(2, 2, 2, 1), (4, 1, 2, 1), (2, 3, 1, 2)])
def test_megatron_ranks_match_megatron_grid(order, tp, pp, dp, cp):
    if cp > 1 and "cp" not in order:
        with pytest.raises(LayoutError, match="no cp axis"):
            megatron_ranks(tp, pp, dp, cp=cp, order=order)
        return
    sizes = {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "ep": 1}
    ids = [100 + 7 * r for r in range(tp * pp * dp * cp)]
    lay = megatron_layout(tp, pp, dp, cp=cp, order=order, ranks=ids)
    assert (lay.dp, lay.tp, lay.pp) == (dp * cp, tp, pp)
    for r, gid in enumerate(ids):
        c = _megatron_coords(r, order, sizes)
        assert lay.coords(gid) == (c["dp"] * cp + c.get("cp", 0), c["pp"], c["tp"]), (r, c)


def test_megatron_ranks_refuse_bad_input():
    with pytest.raises(LayoutError, match="must list tp, dp and pp"):
        megatron_ranks(2, 1, 1, order="tp-dp")
    with pytest.raises(LayoutError, match="must list tp, dp and pp"):
        megatron_ranks(2, 1, 1, order="tp-dp-pp-tp")
    with pytest.raises(LayoutError, match="3 entries for a Megatron world of 4"):
        megatron_ranks(2, 1, 2, ranks=(0, 1, 2))
    with pytest.raises(LayoutError, match="not a multiple of pp"):
        megatron_layout(1, 2, 1, num_layers=3)


def test_megatron_local_names():
    assert megatron_local_name("decoder.layers.3.mlp.linear_fc1.weight", 4, 2) == (
        1,
        "decoder.layers.1.mlp.linear_fc1.weight",
    )
    assert megatron_local_name("embedding.word_embeddings.weight", 4, 2) == (
        0,
        "embedding.word_embeddings.weight",
    )
    assert megatron_local_name("output_layer.weight", 4, 2)[0] == 1
    assert megatron_local_name("decoder.final_layernorm.weight", 4, 2)[0] == 1
    for spec in megatron_specs(dict(QWEN, num_hidden_layers=6), tp=1):
        for pp in (1, 2, 3, 6):
            stage, local = megatron_local_name(spec.name, 6, pp)
            assert megatron_global_name(local, stage, 6, pp) == spec.name
            assert stage == Layout(1, 1, pp, tuple(range(pp)), num_layers=6).stage_of(spec)
    with pytest.raises(LayoutError, match="holds only 2 layers"):
        megatron_global_name("decoder.layers.2.input_layernorm.weight", 0, 4, 2)
    with pytest.raises(LayoutError, match="not a multiple of pp"):
        megatron_local_name("decoder.layers.0.input_layernorm.weight", 5, 2)


@pytest.mark.parametrize("cfg", [QWEN, LLAMA_TIED], ids=["qwen2", "llama-tied"])
def test_name_maps_round_trip(cfg):
    maps = {(a, b): name_map(cfg, a, b) for a in CONVENTIONS for b in CONVENTIONS}
    for (a, b), m in maps.items():
        assert len(set(m.values())) == len(m)  # one-to-one
        assert {v: k for k, v in m.items()} == maps[b, a]
        for c in CONVENTIONS:
            assert {k: maps[b, c][v] for k, v in m.items()} == maps[a, c]
    hf_names = {s.name for s in hf_specs(cfg)}
    assert {k.name for k in maps["hf", "nereus"]} == hf_names
    for conv in ("megatron", "megatron_te"):
        meg = maps["hf", conv].values()
        assert {r.name for r in meg} == {s.name for s in megatron_specs(cfg, tp=1, convention=conv)}
        for name in {r.name for r in meg if r.part}:
            parts = tuple(r.part for r in meg if r.name == name)
            suffix = next(f for f in MEGATRON_FUSED if name.endswith("." + f))
            assert parts == MEGATRON_FUSED[suffix][2], name
    tied = cfg["tie_word_embeddings"]
    assert (Ref("lm_head.weight") in maps["hf", "nereus"]) is not tied
    assert maps["hf", "megatron"][Ref("model.layers.1.mlp.down_proj.weight")] == Ref(
        "decoder.layers.1.mlp.linear_fc2.weight"
    )
    assert maps["megatron_te", "hf"][
        Ref("decoder.layers.0.mlp.linear_fc1.layer_norm_weight")
    ] == Ref("model.layers.0.post_attention_layernorm.weight")
    with pytest.raises(LayoutError, match="unknown convention"):
        name_map(cfg, "hf", "deepspeed")


def test_fuse_split_round_trip():
    q, k, v = torch.randn(HEADS * HD, H), torch.randn(GROUPS * HD, H), torch.randn(GROUPS * HD, H)
    fused = fuse_qkv(q, k, v, GROUPS)
    assert fused.shape == (GROUPS, (HEADS // GROUPS + 2) * HD, H)
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, HEADS, GROUPS), (q, k, v)))
    gate, up = torch.randn(FFN, H), torch.randn(FFN, H)
    assert all(torch.equal(a, b) for a, b in zip(split_fc1(fuse_fc1(gate, up)), (gate, up)))
    assert math.prod(to_megatron(fused).shape) == fused.numel()
