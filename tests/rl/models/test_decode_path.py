"""The lean decoding step against the forms it replaces, and cached generation against the
full forward.

Bit for bit: grouped-query attention without repeated keys and values (no gradients)
against the repeated form (gradients), the fused fp32 RMS norm and the rotary tables
shared by every layer against their explicit forms, the additive mask built once per
forward against SDPA's boolean one, the per-row sampling noise drawn ahead against
the same noise drawn step by step, and generation's own forward
(:mod:`nereus_rl.models.decode`: one q/k/v product, a prompt's real tokens packed, the
mask sliced from one built for all steps, the head in slices) against
``Decoder.forward`` with a cache, logits and cache contents, step by step.

Within a tolerance: the logits of a cached decoding step (one query against the cache)
against the same position of an uncached forward over the whole sequence, where
torch's attention and matmul kernels sum over other shapes. ``TOL = 2e-5`` on logits of
magnitude ~0.5 bounds that fp32 drift (measured: below 1e-6) and is far below what a
wrong key, position or mask moves (1e-3 and more).
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from nereus_rl.models.decode import (
    HEAD_SLICE,
    DecodeWeights,
    PackedLinear,
    Packing,
    mkl_packs_exactly,
)
from nereus_rl.models.generate import (
    KVCache,
    generate,
    left_pad,
    make_generator,
    make_row_generators,
)
from nereus_rl.models.model import (
    ONE_QUERY_MIN_HEADS,
    ONE_QUERY_MIN_KEY_ELEMENTS,
    Decoder,
    Llama3RopeScaling,
    ModelConfig,
    RMSNorm,
    apply_rotary,
    attention_bias,
    cached_attention,
    full_attention_mask,
    rope_inv_freq,
    rotary_tables,
    rotate,
)

# the module (nereus_rl.models exports a function of the same name)
gen_mod = importlib.import_module("nereus_rl.models.generate")
dec_mod = importlib.import_module("nereus_rl.models.decode")
model_mod = importlib.import_module("nereus_rl.models.model")
TOL = 2e-5
# Grouped-query (4 query heads per kv head), q/k/v biases, Llama 3 rope scaling.
GQA = ModelConfig(
    "gqa", 3, 64, 8, 2, 96, 97, 96,
    rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 16), qkv_bias=True, rope_theta=5e5,
)  # fmt: skip


def _model(seed: int = 3) -> Decoder:
    m = Decoder(GQA, seed=seed)
    with torch.no_grad():  # biases and norm scales away from their 0 / 1 init
        g = torch.Generator().manual_seed(seed)
        for p in m.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return m


def _batch(seed: int = 1, b: int = 5, lo: int = 2, hi: int = 12):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (b,), generator=g).tolist()
    return left_pad([torch.randint(3, GQA.vocab, (n,), generator=g) for n in lens], 0)


def _old_attention_bias(keep: torch.Tensor, num_queries: int) -> torch.Tensor:
    s = keep.shape[1]
    keys = torch.arange(s)
    queries = keys[s - num_queries :]
    causal = keys[None, :] <= queries[:, None]
    own = keys[None, :] == queries[:, None]
    return ((causal[None] & keep[:, None, :]) | own[None])[:, None]


@pytest.mark.parametrize("masked", [True, False])
def test_grouped_attention_equals_repeated_keys(masked):
    """Without gradients the model attends with enable_gqa, with them it repeats keys and
    values (its backward sums in the references' order): the outputs are equal to the bit,
    over a prompt forward and cached decoding steps."""
    m = _model()
    ids, mask = _batch()
    attn = mask if masked else None
    with torch.no_grad():
        fast = m(ids, attention_mask=attn)
    repeated = m(ids, attention_mask=attn)  # k/v require grad: the repeat path
    assert torch.equal(fast, repeated.detach())
    # One kernel call each, both masks, both kinds of query length.
    g = torch.Generator().manual_seed(0)
    for t, s in ((1, 13), (6, 6), (4, 9)):
        q = torch.randn(3, 8, t, 16, generator=g)
        k, v = torch.randn(3, 2, s, 16, generator=g), torch.randn(3, 2, s, 16, generator=g)
        keep = torch.rand(3, s, generator=g) > 0.3
        bias = attention_bias(keep, t)
        kr, vr = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
        want = F.scaled_dot_product_attention(q, kr, vr, attn_mask=bias)
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
        assert torch.equal(got, want)


def test_additive_mask_and_decode_bias_equal_the_boolean_forms():
    g = torch.Generator().manual_seed(0)
    for t, s in ((1, 9), (1, 1), (5, 5), (3, 8)):
        keep = torch.rand(4, s, generator=g) > 0.4
        keep[:, -1] = True
        bias = attention_bias(keep, t)
        assert torch.equal(bias, _old_attention_bias(keep, t))
        additive = torch.full(bias.shape, float("-inf")).masked_fill_(bias, 0.0)
        q, k, v = (torch.randn(4, 2, n, 8, generator=g) for n in (t, s, s))
        assert torch.equal(
            F.scaled_dot_product_attention(q, k, v, attn_mask=additive),
            F.scaled_dot_product_attention(q, k, v, attn_mask=bias),
        )


@pytest.mark.parametrize("hidden", [64, 100, 256, 1000])
def test_rms_norm_equals_the_explicit_form(hidden):
    """fp32 on CPU runs torch's rms_norm; values and gradients are the explicit form's."""
    norm = RMSNorm(hidden, torch.float32, "cpu", eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    x0 = torch.randn(3, 7, hidden) * 3
    x = x0.clone().requires_grad_()
    y = norm(x)
    xr = x0.clone().requires_grad_()
    w = norm.weight.detach().clone().requires_grad_()
    yr = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    g = torch.randn_like(y)
    y.backward(g)
    yr.backward(g)
    assert torch.equal(y, yr)
    assert torch.equal(x.grad, xr.grad) and torch.equal(norm.weight.grad, w.grad)
    # bf16 keeps the explicit form: normalise in fp32, scale in bf16 (Hugging Face's).
    nb = RMSNorm(hidden, torch.bfloat16, "cpu", eps=1e-6)
    xb = x0.bfloat16()
    xf = xb.float()
    want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16() * nb.weight
    assert torch.equal(nb(xb), want)


@pytest.mark.parametrize("per_row", [False, True])
def test_rotary_tables_equal_the_rotate_half_form(per_row):
    """The tables shared by q, k and every layer rotate as the per-call form did."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 4, 16, generator=g, requires_grad=True)
    positions = torch.randint(0, 40, (3, 5) if per_row else (5,), generator=g)
    inv = rope_inv_freq(16, "cpu", 5e5, Llama3RopeScaling(8.0, 1.0, 4.0, 16))
    # The form used before the tables: cos/sin per call, the sign on x.
    angles = positions.float()[..., None] * inv
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([angles.sin(), angles.sin()], -1)
    cos, sin = (c[None, :, None] if not per_row else c[:, :, None] for c in (cos, sin))
    want = x * cos + torch.cat([-x[..., 8:], x[..., :8]], -1) * sin
    got = rotate(x, rotary_tables(positions, inv))
    assert torch.equal(got, want) and torch.equal(apply_rotary(x, positions, inv), want)
    gy = torch.randn(x.shape, generator=g)
    (g1,) = torch.autograd.grad(got, x, gy)
    (g2,) = torch.autograd.grad(want, x, gy)
    assert torch.equal(g1, g2)


@torch.no_grad()
@pytest.mark.parametrize("masked", [True, False])
def test_cached_decoding_equals_the_uncached_forward(masked):
    """Each cached step's logits (last position only) against an uncached forward over the
    whole sequence so far, at every generated position."""
    m = _model()
    ids, mask = _batch(b=4)
    if not masked:
        ids, mask = ids[:, -2:], None
    out = generate(m, ids, 8, prompt_mask=mask)
    seq = out.sequences
    full = m(seq, attention_mask=out.attention_mask)
    p = ids.shape[1]
    cache = KVCache(m, seq.shape[0], seq.shape[1])
    attn = out.attention_mask
    logits = [m(seq[:, :p], cache=cache, attention_mask=None if attn is None else attn[:, :p])]
    assert logits[0].shape[1] == p
    for end in range(p + 1, seq.shape[1] + 1):
        step_mask = None if attn is None else attn[:, :end]
        step = m(seq[:, end - 1 : end], cache=cache, attention_mask=step_mask, last_only=True)
        assert step.shape == (seq.shape[0], 1, GQA.vocab)
        logits.append(step)
    cached = torch.cat(logits, 1)
    real = slice(None) if attn is None else attn.bool()
    assert (cached - full).abs()[real].max() < TOL
    # The greedy tokens are the argmax of those logits.
    assert torch.equal(full[:, p - 1 : -1].argmax(-1), seq[:, p:])


@torch.no_grad()
def test_last_only_is_the_last_position():
    m = _model()
    ids, mask = _batch()
    full = m(ids, attention_mask=mask)
    last = m(ids, attention_mask=mask, last_only=True)
    assert last.shape == (ids.shape[0], 1, GQA.vocab)
    assert (last - full[:, -1:]).abs().max() < TOL


def _draw_step_by_step(gens, batch: int, vocab: int, steps: int) -> list[torch.Tensor]:
    return [torch.stack([torch.rand(vocab, generator=g) for g in gens]) for _ in range(steps)]


@pytest.mark.parametrize("ahead", [0, 3, 1 << 22])
def test_noise_drawn_ahead_equals_step_by_step(monkeypatch, ahead):
    """Per-row CPU generators draw several steps in one call; the noise, and the
    generators' states where the steps stop, are those of step-by-step draws."""
    monkeypatch.setattr(gen_mod, "NOISE_AHEAD", ahead * 4 * 11)
    rows = range(4)
    noise = gen_mod._Noise(make_row_generators(7, rows), 4, 11, steps=8, device="cpu")
    got = [noise.next() for _ in range(5)]
    noise.close()
    ref_gens = make_row_generators(7, rows)
    want = _draw_step_by_step(ref_gens, 4, 11, 5)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(g.is_contiguous() for g in got)
    assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(noise.generator, ref_gens))


@pytest.mark.parametrize("ahead", [0, 2, 1 << 22])
def test_sampling_is_the_same_whatever_is_drawn_ahead(monkeypatch, ahead):
    """Sampled generation, whole and stopped early by EOS: the same tokens and generator
    states whether the noise is drawn step by step or ahead."""
    m = _model()
    ids, mask = _batch(b=6)

    def run(rows, eos=None):
        gens = make_row_generators(3, range(rows))
        out = generate(
            m, ids[:rows], 12, prompt_mask=mask[:rows], temperature=1.3, generator=gens,
            eos_id=eos,
        )  # fmt: skip
        return out, gens

    monkeypatch.setattr(gen_mod, "NOISE_AHEAD", 0)
    # A one-row batch stops at its own fifth token (or at an earlier one equal to it).
    eos = int(run(1)[0].responses[0, 4])
    want = [run(6), run(1, eos)]
    assert want[1][0].response_mask.shape[1] <= 5
    monkeypatch.setattr(gen_mod, "NOISE_AHEAD", ahead * 6 * GQA.vocab)
    got = [run(6), run(1, eos)]
    for (a, a_gens), (b, b_gens) in zip(got, want):
        assert torch.equal(a.sequences, b.sequences)
        assert torch.equal(a.response_mask, b.response_mask)
        assert all(torch.equal(x.get_state(), y.get_state()) for x, y in zip(a_gens, b_gens))
    # One generator for the batch draws step by step, as before.
    a = generate(m, ids, 6, prompt_mask=mask, temperature=1.0, generator=make_generator(1))
    c = generate(m, ids, 6, prompt_mask=mask, temperature=1.0, generator=make_generator(1))
    assert torch.equal(a.sequences, c.sequences)


def test_generation_buffers_hold_what_concatenation_did():
    """Sequences and masks come out as before: prompts, then the tokens, cut at the stop."""
    m = _model()
    ids, mask = _batch(b=3)
    out = generate(m, ids, 9, prompt_mask=mask, eos_id=None)
    assert out.sequences.shape == (3, ids.shape[1] + 9) and out.sequences.is_contiguous()
    assert torch.equal(out.sequences[:, : ids.shape[1]], ids)
    assert torch.equal(out.attention_mask, full_attention_mask(mask, out.sequences.shape[1]))


@pytest.fixture
def one_thread():
    """One torch thread: the fused, packed and sliced products run only there."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _steps_both_ways(m, ids, mask, new_tokens: int = 6):
    """Logits and caches of the prompt's forward and ``new_tokens`` decoding steps, by
    ``Decoder.forward`` with a KVCache (the form generation ran before) and by generation's
    own steps, on the same greedy sequence."""
    seq = generate(m, ids, new_tokens, prompt_mask=mask).sequences
    p, total = ids.shape[1], seq.shape[1]
    full = None if mask is None else full_attention_mask(mask, total)
    cache = KVCache(m, seq.shape[0], total)
    steps = gen_mod._Steps(m, seq.shape[0], p, total, full, seq.device)
    old, new = [], []
    with torch.no_grad():
        for end in range(p, total):
            x = seq[:, :p] if end == p else seq[:, end - 1 : end]
            attn = None if full is None else full[:, :end]
            old.append(m(x, cache=cache, attention_mask=attn, last_only=True))
            new.append(steps.forward(x))
    return old, new, cache, steps.cache, full


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("packed", [True, False])
def test_generation_forward_equals_the_model_forward(monkeypatch, threads, dtype, masked, packed):
    """Every step's logits and every cached key and value at a real position are those of
    Decoder.forward, bit for bit: fused q/k/v (fp32, one thread), packed prompt or not,
    the sliced mask; with two threads, the three products and no packing."""
    monkeypatch.setattr(gen_mod, "pack_min_tokens", lambda model: 1 if packed else 10**9)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_steps_both_ways(dtype, masked)
    finally:
        torch.set_num_threads(before)


def _check_steps_both_ways(dtype, masked, b: int = 6):
    m = _model().to(dtype)
    m.dtype = dtype
    ids, mask = _batch(b=b)
    if not masked:
        ids, mask = ids[:, -3:], None
    old, new, cache_old, cache_new, full = _steps_both_ways(m, ids, mask)
    assert all(torch.equal(a, b) for a, b in zip(old, new))
    n = cache_old.length
    real = torch.ones(ids.shape[0], n, dtype=torch.bool) if full is None else full.bool()[:, :n]
    for i in m.layer_ids:
        for old_kv, new_kv in (
            (cache_old.keys, cache_new.keys),
            (cache_old.values, cache_new.values),
        ):
            a, b = old_kv[i][:, :, :n].transpose(1, 2), new_kv[i][:, :, :n].transpose(1, 2)
            assert torch.equal(a[real], b[real])


def test_generation_packs_the_prompt_and_slices_the_head(monkeypatch, one_thread):
    """The benchmark's sizes take the packed prompt and, where MKL's packed weights are not
    exact for the step's rows, the sliced head."""
    monkeypatch.setattr(dec_mod, "mkl_packs_exactly", lambda *shape: False)
    packs, heads = [], []
    of, head = Packing.of.__func__, dec_mod._head

    def packing_of(cls, keep):
        packs.append(keep.shape)
        return of(cls, keep)

    def sliced_head(h, weight, bias=None):
        heads.append(h.shape[0])
        return head(h, weight, bias)

    monkeypatch.setattr(Packing, "of", classmethod(packing_of))
    monkeypatch.setattr(dec_mod, "_head", sliced_head)
    m = Decoder(ModelConfig("wide", 2, 64, 4, 2, 512, 2048, 256), seed=1)
    g = torch.Generator().manual_seed(0)
    ids, mask = left_pad([torch.randint(1, 2048, (n,), generator=g) for n in range(20, 28)], 0)
    generate(m, ids, 3, prompt_mask=mask)
    assert packs == [(8, 27)] and heads == [8, 8, 8]
    torch.set_num_threads(2)  # several threads: neither
    generate(m, ids, 3, prompt_mask=mask)
    assert packs == [(8, 27)] and heads == [8, 8, 8]


def test_fused_qkv_product_equals_three_products(one_thread):
    """One [q; k; v] product, fp32 on CPU, with and without biases, over row counts from
    MKL's small-matrix path to its blocked one; other dtypes keep three products."""
    g = torch.Generator().manual_seed(0)
    for hidden, kv, bias in ((64, 16, True), (256, 128, False), (128, 64, True)):
        w = [torch.randn(n, hidden, generator=g) * 0.05 for n in (hidden, kv, kv)]
        b = [torch.randn(n, generator=g) for n in (hidden, kv, kv)] if bias else [None] * 3
        fused_w = torch.cat(w)
        fused_b = torch.cat(b) if bias else None
        for rows in (*range(1, 41), 97, 300, 1270):
            x = torch.randn(rows, 1, hidden, generator=g)
            three = torch.cat([F.linear(x, wi, bi) for wi, bi in zip(w, b)], -1)
            assert torch.equal(F.linear(x, fused_w, fused_b), three), (hidden, rows)
    m = _model()
    weights = DecodeWeights.of(m)
    assert weights.fused and weights.qkv[0][0].shape == (GQA.hidden + 2 * 2 * GQA.head_dim, 64)
    assert not DecodeWeights.of(Decoder(GQA, dtype=torch.bfloat16)).fused
    torch.set_num_threads(2)
    assert not DecodeWeights.of(m).fused


def test_packed_rows_equal_the_padded_rows(one_thread):
    """Products, the norm and the rotation of a padded batch's real tokens, computed on
    those tokens alone, equal the padded computation's rows (enough rows: MKL's blocked
    kernel); pack and unpack invert each other on the real tokens."""
    g = torch.Generator().manual_seed(0)
    lens = [16, 64, 40, 23, 64, 51, 30, 17]
    keep = torch.zeros(len(lens), 64, dtype=torch.bool)
    for i, n in enumerate(lens):
        keep[i, 64 - n :] = True
    packing = Packing.of(keep)
    assert packing.num_tokens == sum(lens)
    assert torch.equal(packing.last, torch.tensor(lens).cumsum(0) - 1)
    x = torch.randn(len(lens), 64, 256, generator=g)
    assert torch.equal(packing.unpack(packing.pack(x))[keep], x[keep])
    assert torch.equal(packing.unpack(packing.pack(x))[~keep], torch.zeros_like(x[~keep]))
    for n, k in ((256, 256), (688, 256), (256, 688), (512, 256)):
        w = torch.randn(n, k, generator=g) * 0.05
        xk = torch.randn(len(lens), 64, k, generator=g)
        assert torch.equal(F.linear(packing.pack(xk), w), packing.pack(F.linear(xk, w)))
    norm = RMSNorm(256, torch.float32, "cpu", eps=1e-6)
    assert torch.equal(norm(packing.pack(x)), packing.pack(norm(x)))
    tables = rotary_tables(torch.randint(0, 60, keep.shape, generator=g), rope_inv_freq(32, "cpu"))
    q = torch.randn(len(lens), 64, 8, 32, generator=g)
    packed_tables = type(tables)(packing.pack(tables.cos), packing.pack(tables.sin))
    assert torch.equal(rotate(packing.pack(q), packed_tables), packing.pack(rotate(q, tables)))


needs_mkl = pytest.mark.skipif(
    not torch.backends.mkl.is_available(), reason="MKL's packed products need MKL"
)


@needs_mkl
def test_packed_products_equal_linear_where_probed_exact(monkeypatch, one_thread):
    """Wherever the probe says MKL's packed product is exact for a shape, it equals
    F.linear bit for bit on other inputs and weights too (with and without a bias); the
    benchmark's batch-32 shapes are among them, and a single row (MKL's small-matrix
    kernel) is not. Small weights are left unpacked by default."""
    w = torch.zeros(688, 256)
    assert PackedLinear.of(w, None, 32) is not None
    assert PackedLinear.of(w[:64, :64], None, 32) is None  # under PACK_MIN_WEIGHT
    monkeypatch.setattr(dec_mod, "PACK_MIN_WEIGHT", 0)
    g = torch.Generator().manual_seed(1)
    exact = []
    for n, k in ((512, 256), (688, 256), (256, 688), (4096, 256), (96, 64), (97, 96)):
        for rows in (1, 2, 5, 8, 13, 16, 24, 32, 40):
            for bias in (False, True):
                if not mkl_packs_exactly(n, k, rows, bias):
                    continue
                exact.append((n, k, rows, bias))
                w = torch.randn(n, k, generator=g) * 0.05
                b = torch.randn(n, generator=g) if bias else None
                p = PackedLinear.of(w, b, rows)
                for _ in range(3):
                    x = torch.randn(rows, 1, k, generator=g)
                    assert torch.equal(p(x), F.linear(x, w, b)), (n, k, rows, bias)
    for shape in ((512, 256), (688, 256), (256, 688), (4096, 256)):
        assert (*shape, 32, False) in exact
    assert (4096, 256, 1, False) not in exact


@needs_mkl
def test_batch_32_steps_run_packed_and_equal_the_model_forward(monkeypatch, one_thread):
    """At batch 32 a decoding step's products run on packed weights and attend by the
    one-query path (the thresholds lowered to this small model's sizes); its logits and
    cache equal Decoder.forward's with a cache, bit for bit."""
    monkeypatch.setattr(dec_mod, "PACK_MIN_WEIGHT", 0)
    monkeypatch.setattr(model_mod, "ONE_QUERY_MIN_KEY_ELEMENTS", 0)
    calls = []
    one_query = model_mod._one_query_attention

    def counted(*args):
        calls.append(args[0].shape[0])
        return one_query(*args)

    monkeypatch.setattr(model_mod, "_one_query_attention", counted)
    weights = DecodeWeights.of(_model(), rows=32)
    assert {key[1] for key in weights.packed if key != ("head",)} == {
        "qkv",
        "o",
        "gate",
        "up",
        "down",
    } and ("head",) in weights.packed
    _check_steps_both_ways(torch.float32, True, b=32)
    assert calls and set(calls) == {32}  # every decoding step, by both forwards


@needs_mkl
def test_a_stage_over_the_byte_bound_keeps_plain_products(monkeypatch, one_thread):
    """The packed copies are bounded: a stage whose weights exceed PACK_MAX_BYTES packs
    nothing (and generates the same tokens)."""
    monkeypatch.setattr(dec_mod, "PACK_MIN_WEIGHT", 0)
    m = _model()
    assert DecodeWeights.of(m, rows=32).packed
    ids, mask = _batch(seed=2, b=32)
    packed_out = generate(m, ids, 4, prompt_mask=mask).sequences
    monkeypatch.setattr(dec_mod, "PACK_MAX_BYTES", 1000)
    assert DecodeWeights.of(m, rows=32).packed == {}
    assert torch.equal(generate(m, ids, 4, prompt_mask=mask).sequences, packed_out)


@pytest.mark.parametrize("mask_kind", [None, "bool", "additive", "per_head"])
@pytest.mark.parametrize("kv_heads", [1, 2, 8])
def test_one_query_attention_agrees_with_the_fused_kernel(mask_kind, kv_heads):
    """A decoding step's attention without gradients (enough rows and keys for the
    one-query path) against SDPA over repeated keys and values, within fp32 rounding,
    with every mask form; below the row or the key threshold the fused kernel itself
    runs (equal to the bit)."""
    g = torch.Generator().manual_seed(0)
    d = 32
    enough = -(-ONE_QUERY_MIN_KEY_ELEMENTS // d)  # keys
    for b, n in ((ONE_QUERY_MIN_HEADS // 8, enough), (1, enough), (ONE_QUERY_MIN_HEADS // 8, 11)):
        q = torch.randn(b, 8, 1, d, generator=g)
        k, v = (
            torch.randn(b, kv_heads, n, d, generator=g),
            torch.randn(b, kv_heads, n, d, generator=g),
        )
        heads = 8 if mask_kind == "per_head" else 1
        allowed = torch.rand(b, heads, 1, n, generator=g) > 0.4
        allowed[..., -1] = True
        mask = None
        if mask_kind == "bool":
            mask = allowed
        elif mask_kind is not None:
            mask = torch.full(allowed.shape, float("-inf")).masked_fill_(allowed, 0.0)
        rep = 8 // kv_heads
        kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        want = F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)
        with torch.no_grad():
            got = cached_attention(q, k, v, n - 1, mask)
        assert got.shape == want.shape
        if b * 8 >= ONE_QUERY_MIN_HEADS and n * d >= ONE_QUERY_MIN_KEY_ELEMENTS:
            assert (got - want).abs().max() < 1e-5
            # a wrong mask or grouping moves the outputs far more than rounding
            wrong = F.scaled_dot_product_attention(q, kr.roll(1, 1), vr.roll(1, 1), attn_mask=mask)
            assert kv_heads == 1 or (got - wrong).abs().max() > 1e-2
        else:
            assert torch.equal(got, want)


def test_sliced_head_equals_the_whole_product(one_thread):
    g = torch.Generator().manual_seed(0)
    for vocab in (4 * HEAD_SLICE, 5 * HEAD_SLICE + 7):
        w = torch.randn(vocab, 96, generator=g) * 0.05
        for rows in range(1, 20):
            h = torch.randn(rows, 1, 96, generator=g)
            assert torch.equal(dec_mod._head(h, w), F.linear(h, w)), (vocab, rows)


def test_response_mask_without_eos_is_all_ones():
    m = _model()
    ids, mask = _batch(b=3)
    out = generate(m, ids, 5, prompt_mask=mask)
    assert out.response_mask.dtype == torch.float32
    assert torch.equal(out.response_mask, torch.ones(3, 5))
