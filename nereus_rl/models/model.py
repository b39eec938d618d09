"""A compact Llama-style decoder that runs under tensor, pipeline and data parallelism.

RMSNorm, rotary position embeddings (optionally Llama 3's frequency scaling), SwiGLU and
grouped-query attention; the presets have no biases and untied input/output embeddings,
and a :class:`ModelConfig` adds what Hugging Face Llama and Qwen2 checkpoints need
(rope theta, norm eps, q/k/v biases, tied embeddings; :mod:`nereus_rl.models.hf`
reads and writes those checkpoints). One :class:`Decoder` object is one rank's piece of
the model: the layers of its pipeline stage, each linear holding its tensor-parallel shard.
With no process groups (``ParallelGroups.single()``) it is the plain
single-process model, and every sharded model built from the same seed holds
exactly the slices of that model's tensors, whatever the layout.

Sharding follows Megatron's conventions, so that ``nereus_comm`` can reshard a
running model: q/k/v/gate/up split on dim 0 (column parallel), o/down on dim 1
(row parallel), embedding and lm head vocab-split on dim 0, norms and the
critic's value head replicated; q/k/v biases split on dim 0 with their weights. The
pipeline key of a tensor is its layer index; the embedding belongs to layer 0 and the
final norm and head to the last layer. :func:`state_specs` lists the full state in that
form.

Tied embeddings (``tie_embeddings``): the state still names two tensors,
``embed.weight`` (layer 0) and ``lm_head.weight`` (the last layer), holding equal
values, so every layout's stages own whole named tensors and resharding stays a plain
copy of named slices. With one pipeline stage they are one Parameter (listed under both
names by :meth:`Decoder.shard_state_dict`); with several, the first and last stage each
hold a copy, and :func:`allreduce_tied_gradients` sums their gradients so that the copies
stay equal through training (Megatron's embedding group). Loading a stage that holds both
names checks that the two are equal.

Prompts of different lengths run left-padded with an attention mask (1 = real token,
``Decoder.forward``'s ``attention_mask``): each row's positions count from its first real
token (:func:`position_ids`) and no query attends to a padding key
(:func:`attention_bias`), so a real token's output is what it would be unpadded, up to
fp32 rounding. Without a mask, or with one that has no zero, nothing of this runs.

The parallel machinery lives in :mod:`nereus_rl.models.parallel` (groups,
Megatron f/g ops, vocab-parallel log-probs, data-parallel gradient all-reduce),
:mod:`nereus_rl.models.pipeline` (micro-batched GPipe schedule) and
:mod:`nereus_rl.models.generate` (KV-cache generation).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from nereus_rl.core.spec import MODEL_PRESETS, ModelSpec, SpecError
from nereus_rl.models.parallel import (
    ParallelGroups,
    all_reduce,
    copy_to_tp,
    reduce_from_tp,
    stage_layers,
)

ROPE_THETA = 10000.0
NORM_EPS = 1e-5
INIT_STD = 0.02


class UnknownPresetError(SpecError):
    """A model preset name is not one of :data:`PRESETS`."""


class ShardStateError(ValueError):
    """A shard state dict does not match this rank's shards (names, shapes, dtypes)."""


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's rotary frequency scaling (Hugging Face ``rope_type: "llama3"``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, repr=False)
class ModelConfig(ModelSpec):
    """The decision layer's :class:`ModelSpec` plus the architecture details of a checkpoint.

    The presets are plain ``ModelSpec`` objects (the cost model's single truth); every
    function here reads them as a ModelConfig with the defaults below
    (:func:`as_model_config`), which are exactly what the presets have always run.

    Fields added to ModelSpec's:
        rope_theta: rotary base.
        rope_scaling: None, or Llama 3's frequency scaling.
        norm_eps: RMSNorm epsilon.
        qkv_bias: q/k/v projections have biases (Qwen2).
        tie_embeddings: the lm head shares the embedding's weight (see the module doc).
        arch: the Hugging Face model type written on save: ``"llama"`` or ``"qwen2"``.
    """

    rope_theta: float = ROPE_THETA
    rope_scaling: Llama3RopeScaling | None = None
    norm_eps: float = NORM_EPS
    qkv_bias: bool = False
    tie_embeddings: bool = False
    arch: str = "llama"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.arch not in ("llama", "qwen2"):
            raise SpecError(
                f"ModelConfig {self.name!r}: arch={self.arch!r}; use 'llama' or 'qwen2'"
            )
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise SpecError(
                f"ModelConfig {self.name!r}: rope_theta={self.rope_theta} and "
                f"norm_eps={self.norm_eps} must be > 0"
            )

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer, q/k/v biases included."""
        bias = self.hidden + 2 * self.num_kv_heads * self.head_dim if self.qkv_bias else 0
        return super().layer_params + bias

    @property
    def num_params(self) -> int:
        """Distinct parameters (a tied embedding counts once)."""
        tied = self.embedding_params if self.tie_embeddings else 0
        return super().num_params - tied

    def __repr__(self) -> str:
        extra = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if f.name not in _SPEC_FIELDS and getattr(self, f.name) != f.default
        ]
        base = super().__repr__()
        return base if not extra else f"{base[:-1]} {' '.join(extra)})"


_SPEC_FIELDS = {f.name for f in fields(ModelSpec)}


def as_model_config(config: ModelSpec) -> ModelConfig:
    """``config`` as a :class:`ModelConfig` (a plain ModelSpec gets the default fields)."""
    if isinstance(config, ModelConfig):
        return config
    return ModelConfig(**{f: getattr(config, f) for f in _SPEC_FIELDS})


#: The presets the trainer runs (tests and the CPU job: tiny ~0.1M parameters;
#: small ~4.5M; medium ~142M and large ~280M for benchmarks on a device).
PRESETS: dict[str, ModelSpec] = {n: MODEL_PRESETS[n] for n in ("tiny", "small", "medium", "large")}


def get_preset(name: str) -> ModelConfig:
    """The preset :class:`ModelConfig` called ``name``.

    Raises:
        UnknownPresetError: ``name`` is not a preset.
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise UnknownPresetError(
            f"unknown model preset {name!r}; choose one of {sorted(PRESETS)} "
            "or build a ModelConfig yourself"
        ) from None


class ParamSpec(NamedTuple):
    """One full (unsharded) tensor of the model's state.

    Same field order as ``nereus_comm.layout.TensorSpec``: ``TensorSpec(*spec)``.
    ``split_dim`` is the tensor-parallel split dim (None = replicated) and
    ``layer`` the pipeline key (layer index).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    split_dim: int | None
    layer: int


def state_specs(
    config: ModelConfig, *, value_head: bool = False, dtype: torch.dtype = torch.float32
) -> list[ParamSpec]:
    """The full model state as (name, full_shape, dtype, split_dim, layer), in a fixed order.

    Arguments:
        config: model shape.
        value_head: the critic variant (a replicated [1, hidden] head instead of the lm head).
        dtype: parameter dtype.

    Returns:
        One :class:`ParamSpec` per parameter: embedding first, then layers in order,
        then the final norm and the head. A tied lm head is listed as its own tensor
        (equal to the embedding; see the module doc).
    """
    c = as_model_config(config)
    kv = c.num_kv_heads * c.head_dim
    last = c.num_layers - 1
    specs = [ParamSpec("embed.weight", (c.vocab, c.hidden), dtype, 0, 0)]
    for i in range(c.num_layers):
        p = f"layers.{i}."
        specs.append(ParamSpec(p + "attn_norm.weight", (c.hidden,), dtype, None, i))
        # nn.Linear registers weight then bias: keep that order (parameter order).
        for proj, rows in (("q", c.hidden), ("k", kv), ("v", kv)):
            specs.append(ParamSpec(p + f"attn.{proj}.weight", (rows, c.hidden), dtype, 0, i))
            if c.qkv_bias:
                specs.append(ParamSpec(p + f"attn.{proj}.bias", (rows,), dtype, 0, i))
        specs += [
            ParamSpec(p + "attn.o.weight", (c.hidden, c.hidden), dtype, 1, i),
            ParamSpec(p + "mlp_norm.weight", (c.hidden,), dtype, None, i),
            ParamSpec(p + "mlp.gate.weight", (c.ffn_hidden, c.hidden), dtype, 0, i),
            ParamSpec(p + "mlp.up.weight", (c.ffn_hidden, c.hidden), dtype, 0, i),
            ParamSpec(p + "mlp.down.weight", (c.hidden, c.ffn_hidden), dtype, 1, i),
        ]
    specs.append(ParamSpec("norm.weight", (c.hidden,), dtype, None, last))
    if value_head:
        specs.append(ParamSpec("value_head.weight", (1, c.hidden), dtype, None, last))
    else:
        specs.append(ParamSpec("lm_head.weight", (c.vocab, c.hidden), dtype, 0, last))
    return specs


def check_tp_divisible(config: ModelConfig, tp: int) -> None:
    """Raise ValueError unless every split dim of ``config`` divides evenly by ``tp``."""
    for what, n in (
        ("num_heads", config.num_heads),
        ("num_kv_heads", config.num_kv_heads),
        ("ffn_hidden", config.ffn_hidden),
        ("vocab", config.vocab),
    ):
        if n % tp:
            raise ValueError(
                f"tensor parallel degree {tp} does not divide {what}={n} of model "
                f"{config.name!r}; uneven splits are not supported, choose a tp that divides it"
            )


def init_full(spec: ParamSpec, seed: int, num_layers: int) -> torch.Tensor:
    """The full fp32 initial value of one tensor; depends only on (seed, name)."""
    if spec.name.endswith("norm.weight"):
        return torch.ones(spec.shape)
    if spec.name.endswith(".bias"):
        return torch.zeros(spec.shape)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(spec.name.encode())) % 2**62)
    std = INIT_STD
    if spec.name.endswith(("attn.o.weight", "mlp.down.weight")):
        # GPT-2 style: keep the residual stream's variance independent of depth.
        std = INIT_STD / math.sqrt(2 * num_layers)
    return torch.randn(spec.shape, generator=gen) * std


def shard_tensor(full: torch.Tensor, split_dim: int | None, tp_rank: int, tp_size: int):
    """This tp rank's shard of a full tensor (the whole tensor if replicated)."""
    if split_dim is None or tp_size == 1:
        return full
    return full.chunk(tp_size, dim=split_dim)[tp_rank]


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale, computed in fp32."""

    def __init__(self, dim: int, dtype: torch.dtype, device, eps: float = NORM_EPS) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.dtype == torch.float32
            and self.weight.dtype == torch.float32
            and x.is_cpu
            and not torch.is_grad_enabled()
        ):
            # One call instead of six. On CPU in fp32 torch computes it with the very ops
            # below (tests/rl/models/test_decode_path.py checks values and gradients bit
            # for bit); CUDA has a fused kernel that sums in another order, so it and the
            # reduced-precision dtypes (normalise in fp32, scale in the model's dtype, as
            # Hugging Face does) keep the explicit form. Only without gradients (rollout,
            # inference): the training step keeps the kernels the cost model counts
            # (costmodel/work.py's KERNELS_PER_LAYER_*).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def rope_inv_freq(
    head_dim: int,
    device,
    theta: float = ROPE_THETA,
    scaling: Llama3RopeScaling | None = None,
) -> torch.Tensor:
    """Rotary inverse frequencies [head_dim / 2], fp32.

    The expressions follow Hugging Face's (``compute_default_rope_parameters`` and
    ``_compute_llama3_parameters``) operation by operation, so that the two agree to the
    last bit wherever torch's kernels do.
    """
    d = head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=device).float() / d))
    if scaling is None:
        return inv_freq
    factor = scaling.factor
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / low
    high_freq_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryTables(NamedTuple):
    """What a forward pass rotates q and k by, computed once per forward and shared by q
    and k of every layer: ``cos`` = [cos, cos] and ``sin`` = [-sin, sin] of the angles
    (the first half signed for the rotate-half form), each [1, T, 1, head_dim] (positions
    [T]) or [B, T, 1, head_dim] (positions [B, T])."""

    cos: torch.Tensor
    sin: torch.Tensor


def rotary_tables(positions: torch.Tensor, inv_freq: torch.Tensor) -> RotaryTables:
    """The :class:`RotaryTables` of ``positions`` ([T] or [B, T]) for ``inv_freq``.

    The angles are those of Hugging Face's rotary embedding, ``positions * inv_freq`` in
    fp32, each frequency used for both halves of a head.
    """
    if positions.dim() == 1:
        angles = positions.float()[:, None] * inv_freq[None, :]  # [T, d/2]
    else:
        angles = positions.float()[..., None] * inv_freq  # [B, T, d/2]
    # cos/sin of the half table, then doubled: an elementwise kernel may round its tail
    # elements on another path than the rest, so the values depend on the layout they
    # are computed in, and this is the layout the model has always used.
    cos, sin = angles.cos(), angles.sin()
    cos, sin = torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)
    if positions.dim() == 1:
        return RotaryTables(cos[None, :, None, :], sin[None, :, None, :])
    return RotaryTables(cos[:, :, None, :], sin[:, :, None, :])


def rotate(x: torch.Tensor, tables: RotaryTables) -> torch.Tensor:
    """Rotate ``x`` [B, T, heads, head_dim] by precomputed tables (Llama's rotate-half
    form, in fp32).

    ``x * cos + [-x2, x1] * [sin, sin]``, with the sign carried by the table instead of
    by x: ``x2 * -sin`` is ``-x2 * sin`` to the bit, and one op fewer per call.
    """
    d = x.shape[-1]
    xf = x.float()
    swapped = torch.cat([xf[..., d // 2 :], xf[..., : d // 2]], -1)
    return (xf * tables.cos + swapped * tables.sin).to(x.dtype)


def apply_rotary(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor | None = None
) -> torch.Tensor:
    """Rotate ``x`` [B, T, heads, head_dim] by its positions (Llama's rotate-half form).

    ``positions`` is [T] (every row alike) or [B, T] (per row, e.g. under left padding).
    ``inv_freq`` defaults to :func:`rope_inv_freq` with the default theta. The model
    itself builds the tables once per forward (:func:`rotary_tables`, :func:`rotate`).
    """
    if inv_freq is None:
        inv_freq = rope_inv_freq(x.shape[-1], x.device)
    return rotate(x, rotary_tables(positions, inv_freq))


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids [B, S] of a padded batch: each row counts from its first real token.

    ``cumsum(mask) - 1`` with padding set to 0, exactly as Hugging Face's generation
    computes them, so a left-padded row sees the rotary positions it would see alone.

    Arguments:
        attention_mask: [B, S] (bool or 0/1), 1 = a real token.
    """
    keep = attention_mask.bool()
    return (keep.long().cumsum(-1) - 1).masked_fill(~keep, 0)


def attention_bias(attention_mask: torch.Tensor, num_queries: int) -> torch.Tensor:
    """The boolean attention mask [B, 1, T, S] (True = may attend) of the last ``T`` of
    ``S`` positions: causal, and never onto a padding key.

    A padding query also attends to itself. Its output is thrown away, but a query with
    no key at all makes softmax 0/0: NaN on kernels without torch's safe softmax, which
    then reaches real tokens through the next layer's values (0 * NaN is NaN) and the
    gradients. A real query's own key is real, so this changes nothing that is kept.

    Arguments:
        attention_mask: [B, S] (bool or 0/1) over every key, 1 = a real token.
        num_queries: T, the queries are the last T positions (S - T are cached).
    """
    keep = attention_mask.bool()
    s = keep.shape[1]
    if num_queries == 1:
        # A decoding step: the query is the last position, so causality masks nothing
        # and its own key is the last one.
        bias = keep[:, None, None, :].clone()
        bias[..., -1] = True
        return bias
    keys = torch.arange(s, device=keep.device)
    queries = keys[s - num_queries :]
    causal = keys[None, :] <= queries[:, None]  # [T, S]
    own = keys[None, :] == queries[:, None]
    return ((causal[None] & keep[:, None, :]) | own[None])[:, None]


def full_attention_mask(prompt_mask: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The attention mask [B, seq_len] of left-padded prompts [B, P] followed by responses:
    the prompt mask, then ones (a response's own padding after EOS comes after every token
    that counts, so causality already keeps it out)."""
    b, p = prompt_mask.shape
    ones = torch.ones(b, seq_len - p, dtype=prompt_mask.dtype, device=prompt_mask.device)
    return torch.cat([prompt_mask, ones], 1)


def _linear(out_features: int, in_features: int, dtype, device, bias: bool = False) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=bias, dtype=dtype, device=device)


class Attention(nn.Module):
    """Grouped-query attention; q/k/v column parallel, o row parallel over the tp group."""

    def __init__(self, config: ModelConfig, groups: ParallelGroups, layer: int, dtype, device):
        super().__init__()
        tp = groups.tp_size
        config = as_model_config(config)
        self.groups = groups
        self.layer = layer
        self.head_dim = config.head_dim
        self.num_heads = config.num_heads // tp
        self.num_kv_heads = config.num_kv_heads // tp
        self.rope_theta = config.rope_theta
        self.rope_scaling = config.rope_scaling
        kv = self.num_kv_heads * self.head_dim
        bias = config.qkv_bias
        self.q = _linear(self.num_heads * self.head_dim, config.hidden, dtype, device, bias)
        self.k = _linear(kv, config.hidden, dtype, device, bias)
        self.v = _linear(kv, config.hidden, dtype, device, bias)
        self.o = _linear(config.hidden, self.num_heads * self.head_dim, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        rope: RotaryTables | torch.Tensor,
        cache=None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend; ``rope`` rotates q and k: :func:`rotary_tables` of the positions, or the
        positions themselves (the tables are then built here);
        ``mask`` [B, 1, T, past + T] replaces the causal mask when given: boolean (True =
        may attend, see :func:`attention_bias`) or additive (0 or -inf, x's dtype)."""
        b, t, _ = x.shape
        # Megatron's f once for the three column-parallel projections (as a fused qkv would).
        x = copy_to_tp(x, self.groups)
        q = self.q(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k(x).view(b, t, self.num_kv_heads, self.head_dim)
        if isinstance(rope, RotaryTables):
            q, k = rotate(q, rope), rotate(k, rope)
        else:  # positions: the tables built here, per call (see Decoder.forward)
            inv_freq = rope_inv_freq(self.head_dim, x.device, self.rope_theta, self.rope_scaling)
            q, k = apply_rotary(q, rope, inv_freq), apply_rotary(k, rope, inv_freq)
        v = self.v(x).view(b, t, self.num_kv_heads, self.head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        past = 0
        if cache is not None:
            past = cache.length
            k, v = cache.update(self.layer, k, v)
        out = cached_attention(q, k, v, past, mask)
        out = out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)
        return reduce_from_tp(self.o(out), self.groups)


def cached_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, mask: torch.Tensor | None
) -> torch.Tensor:
    """scaled_dot_product_attention of q [B, nq, T, d] over k, v [B, nkv, past + T, d]
    (the cache's positions first): ``mask`` when given, else causal over the new
    positions. The training forward and generation's decode forward both attend here, so
    that they pick the same kernel and compute the same outputs: on CPU without
    gradients, a single query position of enough rows, heads and keys by
    :func:`_one_query_attention`, everything else by torch's fused kernel."""
    t = q.shape[2]
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if (
        t == 1
        and q.is_cpu
        and not grad
        and q.shape[0] * num_heads >= ONE_QUERY_MIN_HEADS
        and k.shape[2] * k.shape[3] >= ONE_QUERY_MIN_KEY_ELEMENTS
    ):
        return _one_query_attention(q, k, v, mask)
    gqa = num_heads != num_kv_heads
    if gqa and (k.requires_grad or v.requires_grad or not q.is_cpu):
        # Training: the kernel's own grouped-query backward sums the gradients of a kv
        # head's queries in another order than repeat_interleave's, so the gradients
        # the references were made with come from repeated keys and values. Without
        # gradients, on CPU, the grouped kernel reads the shared head in place and
        # computes the same outputs bit for bit (tests/rl/models/test_decode_path.py);
        # on a GPU the backend choice differs with enable_gqa, so it stays as it was.
        rep = num_heads // num_kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        gqa = False
    if mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    if past == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if t == 1:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    key_pos = torch.arange(past + t, device=q.device)
    mask = key_pos[None, :] <= (past + torch.arange(t, device=q.device))[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


#: Fewest (row, query head) pairs of a decoding step that attend by
#: :func:`_one_query_attention`. Below, the fused kernel's per-pair loop costs less than
#: the products' fixed cost (batch 1 with 8 heads: 9-12 us against 19-24 us); at batch 8
#: the two took the same time end to end.
ONE_QUERY_MIN_HEADS = 128
#: Fewest elements of one head's keys (length x head dim) for :func:`_one_query_attention`:
#: over a few short keys the fused kernel is faster (the "tiny" preset's 16-wide heads
#: over 12 cached keys of a KV cache: 42 us against 77 us at batch 32; 32-wide heads
#: over 64 keys: 197 us against 173 us).
ONE_QUERY_MIN_KEY_ELEMENTS = 1024


def _one_query_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """Attention of one query position per row (a decoding step) on CPU, as two batched
    products and a softmax: the queries sharing a kv head form the rows of one product
    with that head's keys. The fused CPU kernel loops over (row, head) pairs with a
    block's setup each: at batch 32 with 8 heads over 40 keys it takes 137 us against
    93 us here, and a decoding step of benchmarks/bench_rollout.py's full size 6.2 ms
    against 5.6 ms. The outputs agree with the fused kernel's to fp32 rounding, not to
    the bit; ``Decoder.forward`` with a cache and generation's forward both come here,
    so that they agree with each other to the bit."""
    b, num_heads, _, d = q.shape
    num_kv_heads, length = k.shape[1], k.shape[2]
    grouped = q.reshape(b, num_kv_heads, num_heads // num_kv_heads, d) * (d**-0.5)
    scores = torch.matmul(grouped, k.transpose(-1, -2))
    if mask is not None:
        # [B or 1, 1 or heads, 1, length], broadcast against [B, kv heads, group, length]
        if mask.shape[1] == 1:
            mask = mask.reshape(mask.shape[0], 1, 1, length)
        else:
            mask = mask.reshape(mask.shape[0], num_kv_heads, -1, length)
        if mask.dtype == torch.bool:
            scores = scores.masked_fill_(~mask, float("-inf"))
        else:
            scores = scores.add_(mask)
    probs = torch.softmax(scores, -1)
    return torch.matmul(probs, v).view(b, num_heads, 1, d)


class MLP(nn.Module):
    """SwiGLU; gate/up column parallel, down row parallel."""

    def __init__(self, config: ModelConfig, groups: ParallelGroups, dtype, device):
        super().__init__()
        self.groups = groups
        inner = config.ffn_hidden // groups.tp_size
        self.gate = _linear(inner, config.hidden, dtype, device)
        self.up = _linear(inner, config.hidden, dtype, device)
        self.down = _linear(config.hidden, inner, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.groups)
        return reduce_from_tp(self.down(F.silu(self.gate(x)) * self.up(x)), self.groups)


class Block(nn.Module):
    """Pre-norm decoder layer."""

    def __init__(self, config: ModelConfig, groups: ParallelGroups, layer: int, dtype, device):
        super().__init__()
        eps = as_model_config(config).norm_eps
        self.attn_norm = RMSNorm(config.hidden, dtype, device, eps)
        self.attn = Attention(config, groups, layer, dtype, device)
        self.mlp_norm = RMSNorm(config.hidden, dtype, device, eps)
        self.mlp = MLP(config, groups, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        rope: RotaryTables | torch.Tensor,
        cache=None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope, cache, mask)
        return x + self.mlp(self.mlp_norm(x))


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (vocab) are split over the tp group; one all-reduce per call."""

    def __init__(self, config: ModelConfig, groups: ParallelGroups, dtype, device):
        super().__init__()
        self.groups = groups
        rows = config.vocab // groups.tp_size
        self.vocab_start = groups.tp_rank * rows
        self.weight = nn.Parameter(torch.empty(rows, config.hidden, dtype=dtype, device=device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.groups.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        out = out.masked_fill(outside[..., None], 0.0)
        return reduce_from_tp(out, self.groups)


class Decoder(nn.Module):
    """One rank's piece of the decoder: its pipeline stage's layers, tp-sharded.

    Arguments:
        config: model shape.
        groups: this rank's process groups (``ParallelGroups.single()`` for one process).
        value_head: build the critic (values [B, T]) instead of the policy (logits).
        seed: initial weights depend only on (seed, tensor name), never on the layout.
        dtype: parameter dtype (fp32 on CPU).
        device: where the parameters live.

    ``config`` is a :class:`ModelConfig` or the decision layer's ``ModelSpec`` (read with
    ModelConfig's defaults).

    Raises:
        ValueError: tp does not divide the heads, ffn or vocab; pp exceeds the layers; an odd
            head_dim.
    """

    def __init__(
        self,
        config: ModelConfig,
        groups: ParallelGroups | None = None,
        *,
        value_head: bool = False,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        groups = groups or ParallelGroups.single()
        check_tp_divisible(config, groups.tp_size)
        if config.head_dim % 2:
            raise ValueError(f"head_dim={config.head_dim} must be even for rotary embeddings")
        self.config = config
        self.groups = groups
        self.is_critic = value_head
        self.dtype = dtype
        self.layer_ids = stage_layers(config.num_layers, groups.pp_size, groups.pp_rank)
        self.is_first = groups.pp_rank == 0
        self.is_last = groups.pp_rank == groups.pp_size - 1
        if self.is_first:
            self.embed = VocabParallelEmbedding(config, groups, dtype, device)
        self.layers = nn.ModuleDict(
            {str(i): Block(config, groups, i, dtype, device) for i in self.layer_ids}
        )
        full = as_model_config(config)
        self.rope_theta = full.rope_theta
        self.rope_scaling = full.rope_scaling
        # rope_inv_freq by device: a function of the config only, kept off the state.
        self._inv_freq: dict[torch.device, torch.Tensor] = {}
        self.tied = full.tie_embeddings and not value_head
        if self.is_last:
            self.norm = RMSNorm(config.hidden, dtype, device, full.norm_eps)
            if value_head:
                self.value_head = _linear(1, config.hidden, dtype, device)
            else:
                self.lm_head = _linear(config.vocab // groups.tp_size, config.hidden, dtype, device)
                if self.tied and self.is_first:
                    # One stage: one Parameter under both names (module doc).
                    self.lm_head.weight = self.embed.weight
        self.reset_parameters(seed)

    def _params(self) -> dict[str, nn.Parameter]:
        """Parameters by full-state name; a tied weight appears under both of its names."""
        return dict(self.named_parameters(remove_duplicate=False))

    def local_specs(self) -> list[ParamSpec]:
        """Full-state specs of the tensors this rank holds a shard of, in parameter order."""
        mine = self._params()
        return [
            s
            for s in state_specs(self.config, value_head=self.is_critic, dtype=self.dtype)
            if s.name in mine
        ]

    def state_specs(self) -> list[ParamSpec]:
        """The full model's state (all stages), see :func:`state_specs`."""
        return state_specs(self.config, value_head=self.is_critic, dtype=self.dtype)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Set every shard to its slice of the seed's full initial tensor."""
        params = self._params()
        for spec in self.local_specs():
            if self.tied and spec.name == "lm_head.weight":
                # The tied copy starts from the embedding's value, on every stage.
                spec = spec._replace(name="embed.weight")
                full = init_full(spec, seed, self.config.num_layers)
                spec = spec._replace(name="lm_head.weight")
            else:
                full = init_full(spec, seed, self.config.num_layers)
            shard = shard_tensor(full, spec.split_dim, self.groups.tp_rank, self.groups.tp_size)
            params[spec.name].copy_(shard)

    def shard_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's shards by full-state name (detached views of the parameters).

        A tied weight held once (one pipeline stage) is listed under both of its names.
        """
        return {name: p.detach() for name, p in self._params().items()}

    @torch.no_grad()
    def load_shard_state_dict(
        self, state: Mapping[str, torch.Tensor], *, strict: bool = True
    ) -> None:
        """Copy shards into this rank's parameters, after checking all of them.

        Arguments:
            state: name -> shard, as :meth:`shard_state_dict` returns.
            strict: require exactly this rank's names; otherwise load the common ones
                (e.g. a critic from a policy's weights, leaving the head as it is).

        Raises:
            ShardStateError: missing or unexpected names (strict), a shape/dtype mismatch,
                or unequal values for the two names of a tied weight held once. Nothing is
                copied when it is raised.
        """
        params = self._params()
        if strict:
            missing = sorted(set(params) - set(state))
            extra = sorted(set(state) - set(params))
            if missing or extra:
                raise ShardStateError(
                    f"shard state dict does not match pipeline stage {self.groups.pp_rank}: "
                    f"missing {missing[:4]}{'...' if len(missing) > 4 else ''}, unexpected "
                    f"{extra[:4]}{'...' if len(extra) > 4 else ''}; load the shards of this "
                    "rank's stage (or pass strict=False)"
                )
        for name, t in state.items():
            if name in params and (t.shape != params[name].shape or t.dtype != params[name].dtype):
                raise ShardStateError(
                    f"{name}: got {tuple(t.shape)} {t.dtype}, this rank's shard is "
                    f"{tuple(params[name].shape)} {params[name].dtype} (tp={self.groups.tp_size}"
                    f", rank {self.groups.tp_rank}); reshard to this layout first"
                )
        both = ("embed.weight", "lm_head.weight")
        if (
            self.tied
            and all(n in state and n in params for n in both)
            and not torch.equal(state[both[0]], state[both[1]])
        ):
            raise ShardStateError(
                "embed.weight and lm_head.weight differ, but this rank holds them as one tied "
                "weight; their copies on the first and last pipeline stage must stay equal "
                "(sum their gradients with allreduce_tied_gradients)"
            )
        for name, t in state.items():
            if name in params:
                params[name].copy_(t)

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """The rotary inverse frequencies (:func:`rope_inv_freq` of the config) on ``device``."""
        inv = self._inv_freq.get(device)
        if inv is None:
            inv = rope_inv_freq(self.config.head_dim, device, self.rope_theta, self.rope_scaling)
            self._inv_freq[device] = inv
        return inv

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache=None,
        *,
        attention_mask: torch.Tensor | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Run this stage.

        Arguments:
            x: token ids [B, T] on the first stage, hidden states [B, T, hidden] elsewhere.
            positions: absolute positions [T] or [B, T]; default ``arange(T)`` after the
                cache's length, or :func:`position_ids` of ``attention_mask`` when one is given.
            cache: a :class:`nereus_rl.models.generate.KVCache` (appended to, then advanced by T).
            attention_mask: [B, past + T] (bool or 0/1), 1 = a real token, over every key
                this call attends to: the cached ones (``past = cache.length``) then ``x``'s.
                Padding keys are never attended to; every stage of a pipeline gets the same
                mask. A mask without a zero is dropped, so equal-length batches take the
                unmasked path (bitwise what they ran before masks existed).
            last_only: on the last stage, run the final norm and the head on the last
                position only (generation needs no other), returning [B, 1, ...].

        Returns:
            Hidden states [B, T, hidden] on a non-last stage; on the last stage this tp
            rank's logits shard [B, T, vocab/tp] (policy) or values [B, T] (critic), T = 1
            with ``last_only``. Outputs at padding positions are finite but meaningless.

        Raises:
            ValueError: ``attention_mask`` is not [B, past + T].
        """
        t = x.shape[1]
        allowed = None
        if attention_mask is not None:
            past = cache.length if cache is not None else 0
            if tuple(attention_mask.shape) != (x.shape[0], past + t):
                raise ValueError(
                    f"attention_mask is {tuple(attention_mask.shape)}; it must cover the "
                    f"{past} cached and {t} new positions of each of the {x.shape[0]} rows: "
                    f"({x.shape[0]}, {past + t})"
                )
            keep = attention_mask.bool()
            if not bool(keep.all()):
                if positions is None:
                    positions = position_ids(keep)[:, past:]
                allowed = attention_bias(keep, t)
        if positions is None:
            start = cache.length if cache is not None else 0
            positions = torch.arange(start, start + t, device=x.device)
        h = self.embed(x) if self.is_first else x
        mask = allowed
        if allowed is not None and h.is_cpu:
            # Additive, once for every layer: on CPU scaled_dot_product_attention turns a
            # boolean mask into exactly this (0 where allowed, -inf elsewhere, in the
            # queries' dtype) on each call. Other devices keep the boolean mask, which
            # some of their backends take as it is.
            mask = torch.full(allowed.shape, float("-inf"), dtype=h.dtype, device=h.device)
            mask = mask.masked_fill_(allowed, 0.0)
        # Without gradients (rollout, inference) every layer shares one set of rotary
        # tables; with them (training) each layer rotates q and k from the positions, as
        # the cost model's kernel counts of a training step assume (costmodel/work.py's
        # KERNELS_PER_LAYER_*). The values are the same bit for bit.
        rope = (
            None if torch.is_grad_enabled() else rotary_tables(positions, self.inv_freq(h.device))
        )
        for block in self.layers.values():
            h = block(h, rope if rope is not None else positions, cache, mask)
        if cache is not None:
            cache.advance(t)
        if not self.is_last:
            return h
        if last_only:
            h = h[:, -1:]
        h = self.norm(h)
        if self.is_critic:
            return self.value_head(h).squeeze(-1)
        return self.lm_head(copy_to_tp(h, self.groups))


def allreduce_tied_gradients(model: Decoder) -> None:
    """Sum the gradients of a tied embedding's two copies (first and last pipeline stage).

    With tied embeddings and several pipeline stages, ``embed.weight`` (first stage) and
    ``lm_head.weight`` (last stage) are copies of one weight: the weight's gradient is the
    sum of theirs, and each copy takes that sum, so that the same optimizer step keeps
    them equal. Collective over the pipeline group: every stage calls it (middle stages
    add zeros). Call it after the backward pass, before the data-parallel all-reduce or
    after it (both are sums). A no-op without a tied pipeline.
    """
    groups = model.groups
    if not model.tied or groups.pp_group is None:
        return
    rows = model.config.vocab // groups.tp_size
    held = [
        m for m in (getattr(model, "embed", None), getattr(model, "lm_head", None)) if m is not None
    ]
    grads = []
    for mod in held:
        w = mod.weight
        if w.grad is None:
            w.grad = torch.zeros_like(w)
        grads.append(w.grad)
    if grads:
        total = grads[0].clone()
        for g in grads[1:]:
            total += g
    else:
        device = next(model.parameters()).device
        total = torch.zeros(rows, model.config.hidden, dtype=model.dtype, device=device)
    all_reduce(total, groups.pp_group)
    for g in grads:
        g.copy_(total)
