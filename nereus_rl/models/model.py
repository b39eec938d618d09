"""A compact Llama-style decoder that runs under tensor, pipeline and data parallelism.

RMSNorm, rotary position embeddings, SwiGLU and grouped-query attention, with no
biases and untied input/output embeddings (so pipeline stages never share a
parameter). One :class:`Decoder` object is one rank's piece of the model: the
layers of its pipeline stage, each linear holding its tensor-parallel shard.
With no process groups (``ParallelGroups.single()``) it is the plain
single-process model, and every sharded model built from the same seed holds
exactly the slices of that model's tensors, whatever the layout.

Sharding follows Megatron's conventions, so that ``nereus_comm`` can reshard a
running model: q/k/v/gate/up split on dim 0 (column parallel), o/down on dim 1
(row parallel), embedding and lm head vocab-split on dim 0, norms and the
critic's value head replicated. The pipeline key of a tensor is its layer
index; the embedding belongs to layer 0 and the final norm and head to the last
layer. :func:`state_specs` lists the full state in that form.

The parallel machinery lives in :mod:`nereus_rl.models.parallel` (groups,
Megatron f/g ops, vocab-parallel log-probs, data-parallel gradient all-reduce),
:mod:`nereus_rl.models.pipeline` (micro-batched GPipe schedule) and
:mod:`nereus_rl.models.generate` (KV-cache generation).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from nereus_rl.core.spec import MODEL_PRESETS, ModelSpec, SpecError
from nereus_rl.models.parallel import (
    ParallelGroups,
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


#: The decoder's shape is the decision layer's ModelSpec: one type, one set of preset
#: values (nereus_rl.core.spec.MODEL_PRESETS), so the cost model prices exactly what runs.
ModelConfig = ModelSpec

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
        then the final norm and the head.
    """
    c = config
    kv = c.num_kv_heads * c.head_dim
    last = c.num_layers - 1
    specs = [ParamSpec("embed.weight", (c.vocab, c.hidden), dtype, 0, 0)]
    for i in range(c.num_layers):
        p = f"layers.{i}."
        specs += [
            ParamSpec(p + "attn_norm.weight", (c.hidden,), dtype, None, i),
            ParamSpec(p + "attn.q.weight", (c.hidden, c.hidden), dtype, 0, i),
            ParamSpec(p + "attn.k.weight", (kv, c.hidden), dtype, 0, i),
            ParamSpec(p + "attn.v.weight", (kv, c.hidden), dtype, 0, i),
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


def _init_full(spec: ParamSpec, seed: int, num_layers: int) -> torch.Tensor:
    """The full fp32 initial value of one tensor; depends only on (seed, name)."""
    if spec.name.endswith("norm.weight"):
        return torch.ones(spec.shape)
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

    def __init__(self, dim: int, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + NORM_EPS)
        return xf.to(x.dtype) * self.weight


def apply_rotary(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, T, heads, head_dim] by its positions [T] (Llama's rotate-half form)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, d, 2, device=x.device).float() / d))
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, d/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[None, :, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[None, :, None, :]
    xf = x.float()
    x1, x2 = xf[..., : d // 2], xf[..., d // 2 :]
    rotated = torch.cat([-x2, x1], -1)
    return (xf * cos + rotated * sin).to(x.dtype)


def _linear(out_features: int, in_features: int, dtype, device) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=False, dtype=dtype, device=device)


class Attention(nn.Module):
    """Grouped-query attention; q/k/v column parallel, o row parallel over the tp group."""

    def __init__(self, config: ModelConfig, groups: ParallelGroups, layer: int, dtype, device):
        super().__init__()
        tp = groups.tp_size
        self.groups = groups
        self.layer = layer
        self.head_dim = config.head_dim
        self.num_heads = config.num_heads // tp
        self.num_kv_heads = config.num_kv_heads // tp
        kv = self.num_kv_heads * self.head_dim
        self.q = _linear(self.num_heads * self.head_dim, config.hidden, dtype, device)
        self.k = _linear(kv, config.hidden, dtype, device)
        self.v = _linear(kv, config.hidden, dtype, device)
        self.o = _linear(config.hidden, self.num_heads * self.head_dim, dtype, device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache=None) -> torch.Tensor:
        b, t, _ = x.shape
        # Megatron's f once for the three column-parallel projections (as a fused qkv would).
        x = copy_to_tp(x, self.groups)
        q = apply_rotary(self.q(x).view(b, t, self.num_heads, self.head_dim), positions)
        k = apply_rotary(self.k(x).view(b, t, self.num_kv_heads, self.head_dim), positions)
        v = self.v(x).view(b, t, self.num_kv_heads, self.head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        past = 0
        if cache is not None:
            past = cache.length
            k, v = cache.update(self.layer, k, v)
        rep = self.num_heads // self.num_kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        if past == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif t == 1:
            out = F.scaled_dot_product_attention(q, k, v)
        else:
            key_pos = torch.arange(past + t, device=x.device)
            mask = key_pos[None, :] <= (past + torch.arange(t, device=x.device))[:, None]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)
        return reduce_from_tp(self.o(out), self.groups)


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
        self.attn_norm = RMSNorm(config.hidden, dtype, device)
        self.attn = Attention(config, groups, layer, dtype, device)
        self.mlp_norm = RMSNorm(config.hidden, dtype, device)
        self.mlp = MLP(config, groups, dtype, device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache=None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), positions, cache)
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

    ``config`` may be any object with ModelConfig's fields and ``head_dim`` (e.g. the
    decision layer's ``ModelSpec``).

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
        if self.is_last:
            self.norm = RMSNorm(config.hidden, dtype, device)
            if value_head:
                self.value_head = _linear(1, config.hidden, dtype, device)
            else:
                self.lm_head = _linear(config.vocab // groups.tp_size, config.hidden, dtype, device)
        self.reset_parameters(seed)

    def local_specs(self) -> list[ParamSpec]:
        """Full-state specs of the tensors this rank holds a shard of, in parameter order."""
        mine = dict(self.named_parameters())
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
        params = dict(self.named_parameters())
        for spec in self.local_specs():
            full = _init_full(spec, seed, self.config.num_layers)
            shard = shard_tensor(full, spec.split_dim, self.groups.tp_rank, self.groups.tp_size)
            params[spec.name].copy_(shard)

    def shard_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's shards by full-state name (detached views of the parameters)."""
        return {name: p.detach() for name, p in self.named_parameters()}

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
            ShardStateError: missing or unexpected names (strict), or a shape/dtype mismatch.
                Nothing is copied when it is raised.
        """
        params = dict(self.named_parameters())
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
        for name, t in state.items():
            if name in params:
                params[name].copy_(t)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor | None = None, cache=None
    ) -> torch.Tensor:
        """Run this stage.

        Arguments:
            x: token ids [B, T] on the first stage, hidden states [B, T, hidden] elsewhere.
            positions: absolute positions [T]; default ``arange(T)`` after the cache's length.
            cache: a :class:`nereus_rl.models.generate.KVCache` (appended to, then advanced by T).

        Returns:
            Hidden states [B, T, hidden] on a non-last stage; on the last stage this tp
            rank's logits shard [B, T, vocab/tp] (policy) or values [B, T] (critic).
        """
        t = x.shape[1]
        if positions is None:
            start = cache.length if cache is not None else 0
            positions = torch.arange(start, start + t, device=x.device)
        h = self.embed(x) if self.is_first else x
        for block in self.layers.values():
            h = block(h, positions, cache)
        if cache is not None:
            cache.advance(t)
        if not self.is_last:
            return h
        h = self.norm(h)
        if self.is_critic:
            return self.value_head(h).squeeze(-1)
        return self.lm_head(copy_to_tp(h, self.groups))
