"""The forward pass that generation runs: no gradients, a KV cache, lean per step.

:func:`decode_forward` computes what :meth:`Decoder.forward` computes with a cache, bit
for bit on CPU (tests/rl/models/test_decode_path.py checks it), with less around the
matrix products and the attention kernel:

- for fp32 on CPU with one torch thread, one matrix product for q, k and v
  (:class:`DecodeWeights`: their weights concatenated once per generate call, so that a
  training step's update is always seen) and one rotation for q and k together. MKL's
  single-threaded fp32 product computes a column from its own weight row alike whatever
  the other rows are, so the outputs are those of three products. With several threads
  MKL splits the work by the shape, and the reduced-precision CPU kernels and other
  devices' choose their kernel by the output width (a bf16 case rounded otherwise):
  those keep three products, and none of the packing and slicing below;
- a left-padded prompt's forward (fp32 on CPU, with the fused weights) runs the norms
  and the products on its real tokens only (:class:`Packing`), and goes back to the
  padded layout for the attention kernel (the padding's queries, keys and values are
  zeros; a masked key's value is weighed by exactly 0, whatever it holds) and for
  SiLU, whose vectorised kernel rounds a tensor's last few elements on a scalar path:
  computed over the padded layout, the same elements take it. A row of a product
  depends only on its own input row once there are enough rows for MKL's blocked
  kernel (:func:`pack_min_tokens`);
- the additive attention mask and the positions come from the caller (generate builds
  the mask once for all steps and slices it) instead of being rebuilt from a 0/1 mask by
  every call;
- the linears called as functions, without the module machinery; a decoding step's
  products (one row per sequence) run on weights packed once per generate call into
  MKL's own layout (:func:`mkl_packs_exactly`), where MKL then computes what
  ``F.linear`` computes, bit for bit: about 1.3x faster products at batch 32 (weights
  of :data:`PACK_MIN_WEIGHT` elements and more, smaller ones gain less than the packing
  costs; stages of at most :data:`PACK_MAX_BYTES` of weights, the copies' bound).

The training path (:meth:`Decoder.forward` with gradients) does not come here: the cost
model counts its kernels (costmodel/work.py's ``KERNELS_PER_LAYER_*``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from nereus_rl.models.model import RotaryTables, cached_attention, rotate
from nereus_rl.models.parallel import copy_to_tp, reduce_from_tp

#: (weight rows, columns, product rows, with a bias) -> whether MKL's packed product
#: equals F.linear's bit for bit; probed once per process and shape.
_PACKED_EXACT: dict[tuple[int, int, int, bool], bool] = {}


def mkl_packs_exactly(out_features: int, in_features: int, rows: int, bias: bool) -> bool:
    """Whether a product of ``rows`` rows by an ``out_features x in_features`` fp32 weight
    packed by MKL (``torch.ops.mkl._mkl_reorder_linear_weight``, what torch's compiler
    uses for frozen CPU linears) gives what ``F.linear`` gives, bit for bit.

    MKL's packed product always runs its blocked kernel; ``F.linear`` runs that kernel
    too once there are enough rows for the shape, and a small-matrix kernel that rounds
    otherwise below (for a 688-column weight: below 16 rows). The threshold is MKL's
    own, so it is probed, once per shape, on random numbers: two kernels that sum in
    different orders do not agree on every element of a random product. Call with one
    torch thread (the threaded kernels split the work by shape).
    """
    key = (out_features, in_features, rows, bias)
    if key not in _PACKED_EXACT:
        exact = False
        if torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"):
            g = torch.Generator().manual_seed(0)
            w = torch.randn(out_features, in_features, generator=g)
            b = torch.randn(out_features, generator=g) if bias else None
            x = torch.randn(rows, in_features, generator=g)
            try:
                packed = torch.ops.mkl._mkl_reorder_linear_weight(w, rows)
                got = torch.ops.mkl._mkl_linear(x, packed, w, b, rows)
                exact = torch.equal(got, F.linear(x, w, b))
            except RuntimeError:  # a build whose MKL ops refuse: the plain products
                exact = False
        _PACKED_EXACT[key] = exact
    return _PACKED_EXACT[key]


#: Fewest weight elements packed for the decoding steps. The packed product saves the
#: packing MKL does inside every call, which grows with the weight; a generate call
#: packs each weight once. On the trainer's "tiny" preset (64-wide, weights of at most
#: 11k elements, 8 new tokens) packing made a generate call of 16 rows 1 ms slower
#: (6.4 against 5.4 ms); at 256 x 256 and up, batch 32, the products take about 0.75x
#: the time.
PACK_MIN_WEIGHT = 1 << 16
#: Most bytes of a stage's weights packed: the packed copies live beside the weights
#: for a generate call (the memory model does not count them), so a stage holding more
#: keeps the plain products.
PACK_MAX_BYTES = 64 << 20


@dataclass
class PackedLinear:
    """``F.linear(x, weight, bias)`` for an ``x`` of exactly ``rows`` rows (all but the
    last dimension), on the weight in MKL's packed layout."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    packed: torch.Tensor
    rows: int

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> PackedLinear | None:
        """The packed product, or None where it would not equal ``F.linear``'s or where
        the weight is smaller than :data:`PACK_MIN_WEIGHT`."""
        out_features, in_features = weight.shape
        if out_features * in_features < PACK_MIN_WEIGHT:
            return None
        if not mkl_packs_exactly(out_features, in_features, rows, bias is not None):
            return None
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), rows)
        return cls(weight.detach(), None if bias is None else bias.detach(), packed, rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, self.rows)


@dataclass
class DecodeWeights:
    """Per layer of a stage, q, k and v's weights (and biases) as one [q; k; v] matrix
    (None: the model's own three, for other dtypes, devices and thread counts than fp32
    on CPU with one torch thread), and the decoding steps' products on packed weights.

    Build it with :meth:`of` at the start of each generate call: it copies the current
    weights, so it is stale after any update of the model.
    """

    qkv: dict[int, tuple[torch.Tensor, torch.Tensor | None] | None]
    #: whether q, k and v run as one product (fp32 on CPU, one torch thread)
    fused: bool
    #: (layer, "qkv" | "o" | "gate" | "up" | "down") or ("head",) -> the packed product
    #: of a decoding step's rows (only where it is exact: :func:`mkl_packs_exactly`)
    packed: dict[tuple, PackedLinear] = field(default_factory=dict)

    @classmethod
    @torch.no_grad()
    def of(cls, model, rows: int | None = None) -> DecodeWeights:
        """The fused weights of ``model``'s layers (this rank's stage and tp shards), and,
        given ``rows`` (a decoding step's batch), their packed products."""
        fuse = model.dtype == torch.float32 and next(model.parameters()).is_cpu
        fuse = fuse and torch.get_num_threads() == 1
        qkv = {}
        packed: dict[tuple, PackedLinear] = {}
        if (
            rows is not None
            and sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() == 2)
            > PACK_MAX_BYTES
        ):
            rows = None  # too large a stage to hold a packed copy of its weights

        def pack(key: tuple, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
            if rows is not None and (p := PackedLinear.of(weight, bias, rows)) is not None:
                packed[key] = p

        for i in model.layer_ids:
            block = model.layers[str(i)]
            attn, mlp = block.attn, block.mlp
            qkv[i] = None
            if fuse:
                weight = torch.cat([attn.q.weight, attn.k.weight, attn.v.weight])
                bias = None
                if attn.q.bias is not None:
                    bias = torch.cat([attn.q.bias, attn.k.bias, attn.v.bias])
                qkv[i] = (weight, bias)
                pack((i, "qkv"), weight, bias)
                pack((i, "o"), attn.o.weight)
                for name in ("gate", "up", "down"):
                    pack((i, name), getattr(mlp, name).weight)
        if fuse and model.is_last:
            pack(("head",), model.lm_head.weight)
        return cls(qkv, fuse, packed)

    def linear(self, key: tuple, x: torch.Tensor, weight: torch.Tensor, bias=None, plain=F.linear):
        """``F.linear(x, weight, bias)``, on the packed weight of ``key`` where there is
        one for ``x``'s number of rows, else by ``plain`` (the same product)."""
        if self.packed:
            p = self.packed.get(key)
            if p is not None and x.numel() == p.rows * x.shape[-1]:
                return p(x)
        return plain(x, weight, bias)


def pack_min_tokens(model) -> int:
    """Fewest real prompt tokens that run packed: with fewer rows than about K / 25 (K the
    products' inner size, at most ffn_hidden / tp) MKL takes a small-matrix path that
    rounds otherwise, and a padded batch's rows could take the one and its real tokens
    the other. K / 8, and at least 64, keeps both well within the blocked kernel."""
    return max(64, model.config.ffn_hidden // model.groups.tp_size // 8)


@dataclass
class Packing:
    """Where the real tokens of a left-padded batch [B, T] are: ``rows``/``cols`` [N] of
    each real token in order (row by row), ``last`` [B] the packed index of each row's
    last token (every row ends with a real one)."""

    rows: torch.Tensor
    cols: torch.Tensor
    last: torch.Tensor
    shape: tuple[int, int]

    @classmethod
    def of(cls, keep: torch.Tensor) -> Packing:
        """The packing of ``keep`` [B, T] (bool, True = a real token, left padding)."""
        rows, cols = keep.nonzero(as_tuple=True)
        last = keep.sum(1).cumsum(0) - 1
        return cls(rows, cols, last, tuple(keep.shape))

    @property
    def num_tokens(self) -> int:
        return int(self.rows.shape[0])

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] -> [N, ...] (the real tokens, a copy)."""
        return x[self.rows, self.cols]

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[N, ...] -> [B, T, ...] with zeros at the padding."""
        out = x.new_zeros(*self.shape, *x.shape[1:])
        out[self.rows, self.cols] = x
        return out


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask (True = may attend) as the one ``Decoder.forward`` passes
    to the attention kernel: additive (0 or -inf, ``dtype``) on CPU, the boolean mask
    itself elsewhere (see ``Decoder.forward``)."""
    if not allowed.is_cpu:
        return allowed
    mask = torch.full(allowed.shape, float("-inf"), dtype=dtype, device=allowed.device)
    return mask.masked_fill_(allowed, 0.0)


def _attend(block, weights, x, rope, cache, mask, groups, packing=None) -> torch.Tensor:
    attn = block.attn
    layer = attn.layer
    fused = weights.qkv[layer]
    nq, nkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    x = copy_to_tp(x, groups)
    if packing is not None:  # x [N, hidden]; rope [N, 1, d]
        qkv = F.linear(x, *fused).view(-1, nq + 2 * nkv, d)
        qkv[:, : nq + nkv] = rotate(qkv[:, : nq + nkv], rope)
        qkv = packing.unpack(qkv)
        b, t = packing.shape
        q, k, v = qkv[:, :, :nq], qkv[:, :, nq : nq + nkv], qkv[:, :, nq + nkv :]
    elif fused is not None:
        b, t, _ = x.shape
        qkv = weights.linear((layer, "qkv"), x, *fused).view(b, t, nq + 2 * nkv, d)
        qk = rotate(qkv[:, :, : nq + nkv], rope)
        q, k, v = qk[:, :, :nq], qk[:, :, nq:], qkv[:, :, nq + nkv :]
    else:
        b, t, _ = x.shape
        q = rotate(attn.q(x).view(b, t, nq, d), rope)
        k = rotate(attn.k(x).view(b, t, nkv, d), rope)
        v = attn.v(x).view(b, t, nkv, d)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    past = cache.length
    k, v = cache.update(attn.layer, k, v)
    out = cached_attention(q, k, v, past, mask)
    out = out.transpose(1, 2)
    if packing is not None:
        out = packing.pack(out).view(-1, nq * d)
    else:
        out = out.reshape(b, t, nq * d)
    return reduce_from_tp(weights.linear((layer, "o"), out, attn.o.weight), groups)


def _mlp(mlp, layer: int, weights, x: torch.Tensor, groups, packing=None) -> torch.Tensor:
    x = copy_to_tp(x, groups)
    gate = weights.linear((layer, "gate"), x, mlp.gate.weight)
    if packing is None:
        gate = F.silu(gate)
    else:
        gate = packing.pack(F.silu(packing.unpack(gate)))
    gated = gate * weights.linear((layer, "up"), x, mlp.up.weight)
    return reduce_from_tp(weights.linear((layer, "down"), gated, mlp.down.weight), groups)


@torch.no_grad()
def decode_forward(
    model,
    x: torch.Tensor,
    rope: RotaryTables,
    cache,
    weights: DecodeWeights,
    mask: torch.Tensor | None = None,
    packing: Packing | None = None,
) -> torch.Tensor:
    """Run this stage on ``x`` after what ``cache`` holds; the last position only on the
    last stage (``Decoder.forward(..., last_only=True)``'s output, bit for bit on CPU).

    Arguments:
        model: this rank's Decoder stage (policy).
        x: token ids [B, T] on the first stage, hidden states [B, T, hidden] elsewhere.
        rope: :func:`nereus_rl.models.model.rotary_tables` of the positions of ``x``.
        cache: a :class:`nereus_rl.models.generate.KVCache`, appended to and advanced by T.
        weights: :meth:`DecodeWeights.of` the model, built after its last update.
        mask: [B, 1, T, past + T] from :func:`additive_mask`, or None without padding
            (causal over the new positions, as :func:`~nereus_rl.models.model.cached_attention`).
        packing: the real tokens of ``x`` when it is a left-padded prompt (the cache
            empty, the weights fused); ``rope`` is then that of the real tokens [N, ...].

    Returns:
        Hidden states [B, T, hidden] on a non-last stage; this tp rank's logits shard
        [B, 1, vocab/tp] on the last stage.
    """
    groups = model.groups
    cache_t = x.shape[1]
    if packing is not None:
        x = packing.pack(x)
    h = model.embed(x) if model.is_first else x
    for i, block in model.layers.items():
        h = h + _attend(block, weights, block.attn_norm(h), rope, cache, mask, groups, packing)
        h = h + _mlp(block.mlp, int(i), weights, block.mlp_norm(h), groups, packing)
    cache.advance(cache_t)
    if not model.is_last:
        return h if packing is None else packing.unpack(h)
    h = h[:, -1:] if packing is None else h[packing.last][:, None]
    h = copy_to_tp(model.norm(h), groups)
    if weights.fused:
        return weights.linear(("head",), h, model.lm_head.weight, plain=_head)
    return F.linear(h, model.lm_head.weight)


#: Rows of the head's weight per product for a batch of HEAD_SLICED_ROWS rows.
HEAD_SLICE = 512
#: Batch sizes whose head product runs in slices of HEAD_SLICE weight rows.
HEAD_SLICED_ROWS = range(4, 16)


def _head(h: torch.Tensor, weight: torch.Tensor, bias: None = None) -> torch.Tensor:
    """``F.linear(h, weight)`` for h [B, 1, hidden], fp32 on CPU, one torch thread. On the
    2-core benchmark machine, MKL's product of 4 to 15 rows by a 4096 x 256 head runs
    about 1.6x faster on slices of 512 weight rows than on the whole (batch 8: 0.32 ms
    against 0.51 ms); a column of a single-threaded fp32 product depends only on its own
    weight row, so the logits are the same (tests/rl/models/test_decode_path.py).
    ``bias`` is always None (the head has none): the signature is ``F.linear``'s, as
    :meth:`DecodeWeights.linear` calls it."""
    if h.shape[0] not in HEAD_SLICED_ROWS or weight.shape[0] <= 2 * HEAD_SLICE:
        return F.linear(h, weight)
    return torch.cat([F.linear(h, w) for w in weight.split(HEAD_SLICE)], -1)
