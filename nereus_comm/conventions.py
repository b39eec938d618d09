"""Model-state conventions as tables: Hugging Face, Megatron-Core and nereus_comm's own names.

One table, :data:`PARAMS`, lists every parameter of a Llama / Qwen2 decoder once, with its
name in each convention, its Hugging Face shape in config symbols, its tensor-parallel
split and its pipeline stage. The functions around it only read tables:

- :func:`hf_specs`: the ``TensorSpec`` of each Hugging Face tensor ("model." prefix,
  ``lm_head.weight``). Column-parallel projections split dim 0, row-parallel ones
  (``o_proj``, ``down_proj``) dim 1, embedding and lm head dim 0 (vocab-parallel), norms
  replicated; torch.chunk semantics, like every spec. Stage key: the layer index; the
  embedding layer 0; the final norm and the lm head the last layer. Tied embeddings: the
  embedding alone (no ``lm_head.weight``).
- :func:`megatron_specs`: Megatron-Core's GPT names with *global* layer numbers
  (``decoder.layers.<i>``); Megatron itself numbers layers from 0 on every pipeline stage
  (:func:`megatron_local_name` and :func:`megatron_global_name` convert).
- :func:`name_map`: one convention's names to another's, built once per model.
- :func:`megatron_ranks` / :func:`megatron_layout`: a Megatron rank grid as a ``Layout``.

Megatron's fused tensors as specs (the *view convention*)
---------------------------------------------------------
A spec is cut over tp with torch.chunk along one dim, so a fused Megatron tensor is
described by a view of it in which Megatron's shard is exactly such a chunk:

- ``linear_qkv.weight`` is ``[groups * (q_per_group + 2) * head_dim, hidden]``, rows ordered
  per query group as ``[q heads of the group..., k, v]``; tp rank t holds groups
  ``[t * groups / tp, (t + 1) * groups / tp)``. Its spec is the view
  ``(groups, (q_per_group + 2) * head_dim, hidden)`` split on dim 0 (the bias:
  ``(groups, (q_per_group + 2) * head_dim)``). Megatron needs ``groups % tp == 0``; specs
  for a tp that does not divide the groups are refused (:func:`check_megatron_tp`),
  since a torch.chunk of groups would then not be any Megatron shard.
- ``linear_fc1.weight`` (SwiGLU) is ``[gate; up]``, ``[2 * ffn, hidden]``, but tp rank t
  holds ``[gate_t; up_t]`` (each half chunked on its own), which is not a dim-0 chunk of
  the fused tensor. Its spec is the view ``(2, ffn, hidden)`` split on dim 1: the box of
  rank t is ``[0:2, t*ffn/tp:(t+1)*ffn/tp, :]``, whose contiguous bytes are exactly
  Megatron's ``[gate_t; up_t]``.

A shard in the view convention and Megatron's local tensor share their bytes:
:func:`to_megatron` flattens the first two dims, :func:`from_megatron` unflattens them
(both are views, never copies). :func:`fuse_qkv` / :func:`split_qkv` and
:func:`fuse_fc1` / :func:`split_fc1` convert full tensors between Hugging Face's separate
q/k/v (gate/up) and the fused view.

Vocabulary padding
------------------
Megatron pads the vocabulary to a multiple of ``make_vocab_size_divisible_by * tp``; the
embedding and output layer hold that many rows, and nereus_comm's specs use the padded
size as their shape (with a padded size divisible by tp, torch.chunk gives every rank
``padded / tp`` rows, as Megatron does). The padded size depends on tp, but a reshard
keeps every shape, so specs meant for several tp degrees (``megatron_specs(tp=(2, 4))``)
pad once for all of them (to a multiple of ``lcm(tps) * divisible_by``); Megatron pads to
exactly that size at tp when run with ``make_vocab_size_divisible_by =
megatron_divisible_by(padded, tp)``. :func:`pad_vocab` / :func:`unpad_vocab` add and drop
the padding rows of a full tensor (e.g. on the way from or to a Hugging Face checkpoint).

Not covered: Megatron's virtual (interleaved) pipeline stages, uneven first/last pipeline
stages, expert (MoE) parameters, the distributed optimizer's flat buffers, and the copy of
a tied embedding that Megatron keeps on the last pipeline stage.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import NamedTuple

import torch

from nereus_comm.errors import LayoutError, as_int
from nereus_comm.layout import Layout, TensorSpec, layer_range, stage_of_layer
from nereus_comm.specs import training_state_specs

__all__ = [
    "CONVENTIONS",
    "MEGATRON_DEFAULT_ORDER",
    "MEGATRON_FUSED",
    "MEGATRON_VOCAB_DIVISIBLE_BY",
    "PARAMS",
    "ModelShape",
    "Param",
    "Ref",
    "check_megatron_tp",
    "from_megatron",
    "fuse_fc1",
    "fuse_qkv",
    "hf_specs",
    "megatron_divisible_by",
    "megatron_global_name",
    "megatron_layout",
    "megatron_local_name",
    "megatron_padded_vocab",
    "megatron_ranks",
    "megatron_specs",
    "model_shape",
    "name_map",
    "pad_vocab",
    "split_fc1",
    "split_qkv",
    "to_megatron",
    "unpad_vocab",
]


class Param(NamedTuple):
    """One parameter of the decoder: its names, Hugging Face shape, tp split and stage.

    Name patterns hold ``{i}`` for the layer index. ``part`` names the slice of a fused
    Megatron tensor this parameter is (None: the whole tensor). ``shape`` uses the
    symbols of :meth:`ModelShape.symbols`. ``stage`` is "first" (layer 0), "layer" (its
    own layer) or "last" (the last layer). ``when`` is a :class:`ModelShape` flag the
    parameter needs ("qkv_bias", "untied"), or None.
    """

    hf: str
    nereus: str
    megatron: str
    megatron_te: str
    part: str | None
    shape: tuple[str, ...]
    split_dim: int | None
    stage: str
    when: str | None = None


_L = "model.layers.{i}."
_M = "decoder.layers.{i}."
_N = "layers.{i}."
_QKV = _M + "self_attention.linear_qkv."
_FC1 = _M + "mlp.linear_fc1."

#: Every parameter of a Llama / Qwen2 decoder; the specs list the rows of one layer in this
#: order. Columns: hf, nereus, megatron, megatron_te, part, shape, split_dim, stage, when.
# fmt: off
PARAMS: tuple[Param, ...] = (
    Param("model.embed_tokens.weight", "embed_tokens.weight",
          "embedding.word_embeddings.weight", "embedding.word_embeddings.weight",
          None, ("vocab", "hidden"), 0, "first"),
    Param(_L + "input_layernorm.weight", _N + "input_layernorm.weight",
          _M + "input_layernorm.weight", _QKV + "layer_norm_weight",
          None, ("hidden",), None, "layer"),
    Param(_L + "self_attn.q_proj.weight", _N + "self_attn.q_proj.weight",
          _QKV + "weight", _QKV + "weight",
          "q", ("q", "hidden"), 0, "layer"),
    Param(_L + "self_attn.k_proj.weight", _N + "self_attn.k_proj.weight",
          _QKV + "weight", _QKV + "weight",
          "k", ("kv", "hidden"), 0, "layer"),
    Param(_L + "self_attn.v_proj.weight", _N + "self_attn.v_proj.weight",
          _QKV + "weight", _QKV + "weight",
          "v", ("kv", "hidden"), 0, "layer"),
    Param(_L + "self_attn.q_proj.bias", _N + "self_attn.q_proj.bias",
          _QKV + "bias", _QKV + "bias",
          "q", ("q",), 0, "layer", "qkv_bias"),
    Param(_L + "self_attn.k_proj.bias", _N + "self_attn.k_proj.bias",
          _QKV + "bias", _QKV + "bias",
          "k", ("kv",), 0, "layer", "qkv_bias"),
    Param(_L + "self_attn.v_proj.bias", _N + "self_attn.v_proj.bias",
          _QKV + "bias", _QKV + "bias",
          "v", ("kv",), 0, "layer", "qkv_bias"),
    Param(_L + "self_attn.o_proj.weight", _N + "self_attn.o_proj.weight",
          _M + "self_attention.linear_proj.weight", _M + "self_attention.linear_proj.weight",
          None, ("hidden", "q"), 1, "layer"),
    Param(_L + "post_attention_layernorm.weight", _N + "post_attention_layernorm.weight",
          _M + "pre_mlp_layernorm.weight", _FC1 + "layer_norm_weight",
          None, ("hidden",), None, "layer"),
    Param(_L + "mlp.gate_proj.weight", _N + "mlp.gate_proj.weight",
          _FC1 + "weight", _FC1 + "weight",
          "gate", ("ffn", "hidden"), 0, "layer"),
    Param(_L + "mlp.up_proj.weight", _N + "mlp.up_proj.weight",
          _FC1 + "weight", _FC1 + "weight",
          "up", ("ffn", "hidden"), 0, "layer"),
    Param(_L + "mlp.down_proj.weight", _N + "mlp.down_proj.weight",
          _M + "mlp.linear_fc2.weight", _M + "mlp.linear_fc2.weight",
          None, ("hidden", "ffn"), 1, "layer"),
    Param("model.norm.weight", "norm.weight",
          "decoder.final_layernorm.weight", "decoder.final_layernorm.weight",
          None, ("hidden",), None, "last"),
    Param("lm_head.weight", "lm_head.weight",
          "output_layer.weight", "output_layer.weight",
          None, ("vocab", "hidden"), 0, "last", "untied"),
)
# fmt: on

#: The conventions `name_map` knows: a column of PARAMS each. "megatron" is Megatron-Core's
#: local (non-Transformer-Engine) layer spec; "megatron_te" its Transformer Engine spec, which
#: fuses the two pre-norms into linear_qkv and linear_fc1.
CONVENTIONS: tuple[str, ...] = ("hf", "nereus", "megatron", "megatron_te")

#: Megatron's fused tensors (name suffix -> the view's shape in symbols, split dim, parts in
#: order). The view is the spec's shape; see the module docstring.
MEGATRON_FUSED: dict[str, tuple[tuple[str, ...], int, tuple[str, ...]]] = {
    "self_attention.linear_qkv.weight": (("groups", "group_rows", "hidden"), 0, ("q", "k", "v")),
    "self_attention.linear_qkv.bias": (("groups", "group_rows"), 0, ("q", "k", "v")),
    "mlp.linear_fc1.weight": (("2", "ffn", "hidden"), 1, ("gate", "up")),
}

# The fused tensors whose tp split runs over query groups.
_GROUPED = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")

#: Megatron-Core's default rank order (initialize_model_parallel(order=...)): the first
#: axis varies fastest.
MEGATRON_DEFAULT_ORDER = "tp-cp-ep-dp-pp"

#: Megatron-Core's default make_vocab_size_divisible_by.
MEGATRON_VOCAB_DIVISIBLE_BY = 128

# Hugging Face config keys (and nereus_rl's ModelConfig aliases) -> ModelShape fields.
_CONFIG_KEYS: dict[str, str] = {
    "num_hidden_layers": "num_layers",
    "hidden_size": "hidden",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "intermediate_size": "ffn",
    "vocab_size": "vocab",
    "tie_word_embeddings": "tie_embeddings",
    "ffn_hidden": "ffn",
}
# Hugging Face flags this table has no row for: refused rather than silently dropped.
_UNSUPPORTED_HF_FLAGS = ("mlp_bias",)


@dataclass(frozen=True)
class ModelShape:
    """The sizes that fix every parameter's shape.

    Arguments:
        num_layers, hidden, num_heads, num_kv_heads, ffn, vocab: as in
            `transformer_state_specs` (vocab: the real, unpadded vocabulary).
        head_dim: per-head size; None means hidden // num_heads.
        tie_embeddings: the lm head is the embedding (no separate tensor).
        qkv_bias: q/k/v projections have biases (Qwen2).

    Raises:
        LayoutError: a size that is not an int >= 1, num_heads not a multiple of
            num_kv_heads, or head_dim None with hidden not a multiple of num_heads.
    """

    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    ffn: int
    vocab: int
    head_dim: int | None = None
    tie_embeddings: bool = False
    qkv_bias: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("tie_embeddings", "qkv_bias"):
                object.__setattr__(self, f.name, bool(value))
            elif value is not None or f.name != "head_dim":
                what = f"model size {f.name}"
                object.__setattr__(self, f.name, as_int(value, what, LayoutError, lo=1))
        if self.num_heads % self.num_kv_heads:
            raise LayoutError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads="
                f"{self.num_kv_heads} (each query group has the same number of heads)"
            )
        if self.head_dim is None:
            if self.hidden % self.num_heads:
                raise LayoutError(
                    f"hidden={self.hidden} is not a multiple of num_heads={self.num_heads}; "
                    "give head_dim"
                )
            object.__setattr__(self, "head_dim", self.hidden // self.num_heads)

    def symbols(self, vocab: int | None = None) -> dict[str, int]:
        """The value of each shape symbol of `PARAMS` and `MEGATRON_FUSED`.

        Arguments:
            vocab: the vocabulary rows to use (a padded size); None: `self.vocab`.
        """
        assert self.head_dim is not None  # set by __post_init__
        q_per_group = self.num_heads // self.num_kv_heads
        return {
            "vocab": self.vocab if vocab is None else vocab,
            "hidden": self.hidden,
            "q": self.num_heads * self.head_dim,
            "kv": self.num_kv_heads * self.head_dim,
            "ffn": self.ffn,
            "groups": self.num_kv_heads,
            "group_rows": (q_per_group + 2) * self.head_dim,
            "2": 2,
        }

    def has(self, flag: str | None) -> bool:
        """Whether a `Param.when` flag holds for this model."""
        if flag is None:
            return True
        return {"qkv_bias": self.qkv_bias, "untied": not self.tie_embeddings}[flag]


def _read(config: object, key: str) -> object:
    if isinstance(config, Mapping):
        return config.get(key)
    return getattr(config, key, None)


def model_shape(config: ModelShape | Mapping | object) -> ModelShape:
    """A :class:`ModelShape` from a Hugging Face config or from ModelShape's own fields.

    Arguments:
        config: a ModelShape; a mapping or object with Hugging Face's keys
            (``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``,
            ``num_key_value_heads``, ``intermediate_size``, ``vocab_size``, ``head_dim``,
            ``tie_word_embeddings``; ``model_type`` "qwen2" or a ``Qwen2ForCausalLM``
            architecture has q/k/v biases); or one with ModelShape's field names.

    Raises:
        LayoutError: a missing or bad size; a Hugging Face flag no table row covers
            (Llama's attention_bias also biases o_proj; mlp_bias).
    """
    if isinstance(config, ModelShape):
        return config
    names = {f.name for f in fields(ModelShape)}
    values: dict[str, object] = {}
    for key in (*_CONFIG_KEYS, *names):
        value = _read(config, key)
        if value is not None:
            values.setdefault(_CONFIG_KEYS.get(key, key), value)
    if _read(config, "hidden_size") is not None:  # a Hugging Face config
        archs = _read(config, "architectures") or ()
        qwen2 = _read(config, "model_type") == "qwen2" or "Qwen2ForCausalLM" in archs
        if _read(config, "attention_bias") and not qwen2:
            raise LayoutError(
                "attention_bias=true is not supported: Llama's attention_bias also biases "
                "o_proj, which no row of conventions.PARAMS describes"
            )
        for flag in _UNSUPPORTED_HF_FLAGS:
            if _read(config, flag):
                raise LayoutError(f"{flag}=true is not supported: no row of PARAMS has it")
        values["qkv_bias"] = qwen2
        values.setdefault("num_kv_heads", values.get("num_heads"))
    missing = sorted(
        {"num_layers", "hidden", "num_heads", "num_kv_heads", "ffn", "vocab"} - set(values)
    )
    if missing:
        raise LayoutError(f"model config lacks {missing}")
    return ModelShape(**values)  # type: ignore[arg-type]


def _stage_key(stage: str, layer: int, num_layers: int) -> int:
    return {"first": 0, "layer": layer, "last": num_layers - 1}[stage]


def _rows(shape: ModelShape) -> Iterator[tuple[Param, int]]:
    """(row, layer) of every parameter the model has, in spec order: the first stage's
    tensors, then layer 0's, layer 1's, ..., then the last stage's."""
    kept = [p for p in PARAMS if shape.has(p.when)]
    yield from ((p, 0) for p in kept if p.stage == "first")
    for i in range(shape.num_layers):
        yield from ((p, i) for p in kept if p.stage == "layer")
    yield from ((p, shape.num_layers - 1) for p in kept if p.stage == "last")


def hf_specs(
    config: ModelShape | Mapping | object,
    *,
    dtype: torch.dtype = torch.bfloat16,
    with_optimizer: bool = False,
    master_fp32: bool = True,
) -> list[TensorSpec]:
    """The specs of a Hugging Face Llama / Qwen2 model's tensors ("model." names).

    Arguments:
        config: see :func:`model_shape`.
        dtype: the parameters' dtype.
        with_optimizer: add Adam's state (``optim.exp_avg.<name>``,
            ``optim.exp_avg_sq.<name>``, ``optim.step``) and, with `master_fp32`, fp32
            ``master.<name>`` weights, as `training_state_specs` names them.
        master_fp32: with `with_optimizer`, include the fp32 master weights.

    Returns:
        The embedding, then each layer's tensors in PARAMS order, then the final norm and
        the lm head (then the optimizer state, if asked for).

    Raises:
        LayoutError: a bad config (see :func:`model_shape`).
    """
    shape = model_shape(config)
    sym = shape.symbols()
    params = [
        TensorSpec(
            p.hf.format(i=i),
            tuple(sym[s] for s in p.shape),
            dtype,
            p.split_dim,
            _stage_key(p.stage, i, shape.num_layers),
        )
        for p, i in _rows(shape)
    ]
    if not with_optimizer:
        return params
    return training_state_specs(params, adam=True, master_fp32=master_fp32)


def _fused_suffix(name: str) -> str | None:
    for suffix in MEGATRON_FUSED:
        if name.endswith("." + suffix):
            return suffix
    return None


def _as_tps(tp: int | Sequence[int]) -> tuple[int, ...]:
    tps = (tp,) if not isinstance(tp, Sequence) else tuple(tp)
    if not tps:
        raise LayoutError("tp must be an int >= 1 or a non-empty sequence of them")
    return tuple(as_int(t, "tp", LayoutError, lo=1) for t in tps)


def megatron_padded_vocab(
    vocab: int, tp: int | Sequence[int], divisible_by: int = MEGATRON_VOCAB_DIVISIBLE_BY
) -> int:
    """Megatron's padded vocabulary: `vocab` rounded up to a multiple of divisible_by * tp.

    Arguments:
        vocab: the real vocabulary size.
        tp: the tensor-parallel degree; several: pad for all of them at once (a
            multiple of divisible_by * lcm(tps)), so one spec shape serves each.
        divisible_by: Megatron's make_vocab_size_divisible_by.
    """
    vocab = as_int(vocab, "vocab", LayoutError, lo=1)
    divisible_by = as_int(divisible_by, "divisible_by", LayoutError, lo=1)
    multiple = divisible_by * math.lcm(*_as_tps(tp))
    return -(-vocab // multiple) * multiple


def megatron_divisible_by(padded_vocab: int, tp: int) -> int:
    """The make_vocab_size_divisible_by with which Megatron at `tp` pads any vocabulary of
    at most `padded_vocab` rows to exactly `padded_vocab` (for specs padded for several tp).

    Raises:
        LayoutError: padded_vocab is not a multiple of tp.
    """
    padded_vocab = as_int(padded_vocab, "padded_vocab", LayoutError, lo=1)
    tp = as_int(tp, "tp", LayoutError, lo=1)
    if padded_vocab % tp:
        raise LayoutError(f"padded vocab {padded_vocab} is not a multiple of tp={tp}")
    # Megatron pads to ceil(vocab / (d * tp)) * d * tp; with d * tp == padded that is padded.
    return padded_vocab // tp


def pad_vocab(t: torch.Tensor, padded_vocab: int, dim: int = 0) -> torch.Tensor:
    """`t` with zero rows appended along `dim` up to `padded_vocab` (a new tensor).

    Raises:
        LayoutError: `t` already has more than padded_vocab rows.
    """
    n = t.shape[dim]
    if n > padded_vocab:
        raise LayoutError(f"cannot pad {n} vocabulary rows to {padded_vocab}: fewer")
    pad_shape = list(t.shape)
    pad_shape[dim] = padded_vocab - n
    return torch.cat([t, t.new_zeros(pad_shape)], dim=dim)


def unpad_vocab(t: torch.Tensor, vocab: int, dim: int = 0) -> torch.Tensor:
    """The first `vocab` rows of `t` along `dim` (a view; drops Megatron's padding).

    Raises:
        LayoutError: `t` has fewer than vocab rows.
    """
    if t.shape[dim] < vocab:
        raise LayoutError(f"cannot unpad {t.shape[dim]} vocabulary rows to {vocab}: fewer")
    return t.narrow(dim, 0, vocab)


def check_megatron_tp(specs: Iterable[TensorSpec], tp: int | Sequence[int]) -> None:
    """Refuse a tp degree under which a Megatron spec is not cut the way Megatron cuts it.

    torch.chunk equals Megatron's split only when the split dim divides evenly: the query
    groups of a fused QKV, the ffn rows of a fused fc1, and every other split dim (Megatron
    asserts divisibility for each).

    Raises:
        LayoutError: names the tensor, its size (for a fused QKV: the query-group count)
            and tp.
    """
    tps = _as_tps(tp)
    # Fused QKVs first: their query-group count is the constraint a user most often meets.
    ordered = sorted(specs, key=lambda s: _fused_suffix(s.name) not in _GROUPED)
    for spec in ordered:
        if spec.split_dim is None:
            continue
        n = spec.shape[spec.split_dim]
        for t in tps:
            if n % t == 0:
                continue
            if _fused_suffix(spec.name) in _GROUPED:
                raise LayoutError(
                    f"{spec.name}: {n} query groups cannot be split evenly over tp={t}; "
                    "Megatron needs the query-group count (num_key_value_heads) to be a "
                    "multiple of tp"
                )
            raise LayoutError(
                f"{spec.name}: dim {spec.split_dim} of size {n} cannot be split evenly over "
                f"tp={t}, as Megatron splits it"
            )


def megatron_specs(
    config: ModelShape | Mapping | object,
    *,
    tp: int | Sequence[int],
    dtype: torch.dtype = torch.bfloat16,
    with_optimizer: bool = False,
    master_fp32: bool = True,
    divisible_by: int = MEGATRON_VOCAB_DIVISIBLE_BY,
    padded_vocab: int | None = None,
    convention: str = "megatron",
) -> list[TensorSpec]:
    """The specs of a Megatron-Core GPT model's tensors, with global layer numbers.

    Fused QKV and fc1 are views (module docstring); the embedding and output layer have
    the padded vocabulary as rows.

    Arguments:
        config: see :func:`model_shape`.
        tp: every tensor-parallel degree these specs must serve (each is checked, and the
            vocabulary is padded for all of them).
        dtype, with_optimizer, master_fp32: as for :func:`hf_specs`.
        divisible_by: Megatron's make_vocab_size_divisible_by.
        padded_vocab: the vocabulary rows to use instead of megatron_padded_vocab's.
        convention: "megatron" (local layer spec) or "megatron_te" (Transformer Engine).

    Raises:
        LayoutError: a bad config; a tp under which a tensor is not cut as Megatron cuts
            it (a fused QKV whose query groups tp does not divide, ffn or the padded
            vocabulary not divisible by tp); an unknown convention.
    """
    if convention not in ("megatron", "megatron_te"):
        raise LayoutError(f"convention must be 'megatron' or 'megatron_te', got {convention!r}")
    shape = model_shape(config)
    tps = _as_tps(tp)
    if padded_vocab is None:
        padded_vocab = megatron_padded_vocab(shape.vocab, tps, divisible_by)
    padded_vocab = as_int(padded_vocab, "padded_vocab", LayoutError, lo=shape.vocab)
    sym = shape.symbols(padded_vocab)
    params: list[TensorSpec] = []
    seen: set[str] = set()
    for p, i in _rows(shape):
        name = getattr(p, convention).format(i=i)
        if name in seen:  # a later part of a fused tensor
            continue
        seen.add(name)
        suffix = _fused_suffix(name)
        dims, split = (p.shape, p.split_dim) if suffix is None else MEGATRON_FUSED[suffix][:2]
        key = _stage_key(p.stage, i, shape.num_layers)
        params.append(TensorSpec(name, tuple(sym[s] for s in dims), dtype, split, key))
    check_megatron_tp(params, tps)
    if not with_optimizer:
        return params
    return training_state_specs(params, adam=True, master_fp32=master_fp32)


def to_megatron(view: torch.Tensor) -> torch.Tensor:
    """Megatron's tensor (full or a tp shard) from a fused view: its first two dims
    flattened. Shares `view`'s storage when `view` is contiguous."""
    return view.flatten(0, 1)


def from_megatron(t: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """The fused view of Megatron's tensor `t` (full, or a tp shard) for `spec`.

    The view's unsplit leading dim keeps its full size: (groups, group_rows, ...) for a
    fused QKV splits groups, (2, ffn, ...) for fc1 splits ffn.

    Raises:
        LayoutError: `spec` is not a fused Megatron spec.
    """
    if _fused_suffix(spec.name) is None:
        raise LayoutError(f"{spec!r} is not one of Megatron's fused tensors {list(MEGATRON_FUSED)}")
    if spec.split_dim == 0:
        return t.unflatten(0, (-1, spec.shape[1]))
    return t.unflatten(0, (spec.shape[0], -1))


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Megatron's fused QKV view (groups, (q_per_group + 2) * head_dim, ...) from the full
    q (heads * head_dim, ...), k and v (groups * head_dim, ...) of Hugging Face."""
    rest = q.shape[1:]
    qg = q.reshape(num_groups, -1, *rest)
    kg = k.reshape(num_groups, -1, *rest)
    vg = v.reshape(num_groups, -1, *rest)
    return torch.cat([qg, kg, vg], dim=1)


def split_qkv(
    fused: torch.Tensor, num_heads: int, num_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hugging Face's full (q, k, v) from a full fused QKV view (inverse of fuse_qkv)."""
    head_dim = fused.shape[1] // (num_heads // num_groups + 2)
    q_rows = fused.shape[1] - 2 * head_dim
    q, k, v = fused.split([q_rows, head_dim, head_dim], dim=1)
    rest = fused.shape[2:]
    return tuple(x.reshape(-1, *rest) for x in (q, k, v))  # type: ignore[return-value]


def fuse_fc1(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Megatron's fused SwiGLU fc1 view (2, ffn, hidden) from full gate and up."""
    return torch.stack([gate, up])


def split_fc1(fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Full (gate, up) from a full fused fc1 view (inverse of fuse_fc1)."""
    return fused[0], fused[1]


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _check_pp(num_layers: int, pp: int) -> None:
    if num_layers % pp:
        raise LayoutError(
            f"num_layers={num_layers} is not a multiple of pp={pp}: Megatron's default "
            "pipeline split needs it (uneven first/last stages are not covered)"
        )


def megatron_local_name(name: str, num_layers: int, pp: int) -> tuple[int, str]:
    """(stage, Megatron's name on that stage) of a global Megatron name.

    ``decoder.layers.<i>`` becomes ``decoder.layers.<i - offset>`` on the stage holding
    layer i; names outside the decoder layers keep their name (stage: the one holding
    them, embedding on the first, final norm and output layer on the last).

    Raises:
        LayoutError: num_layers not a multiple of pp; a layer index past num_layers.
    """
    _check_pp(num_layers, pp)
    m = _LAYER.match(name)
    if m is None:
        last = name.startswith(("decoder.final_layernorm.", "output_layer."))
        return (pp - 1 if last else 0), name
    layer = int(m.group(1))
    if layer >= num_layers:
        raise LayoutError(f"{name}: layer {layer} is not below num_layers={num_layers}")
    stage = stage_of_layer(layer, num_layers, pp)
    local = layer - layer_range(num_layers, pp, stage)[0]
    return stage, f"decoder.layers.{local}.{m.group(2)}"


def megatron_global_name(local_name: str, stage: int, num_layers: int, pp: int) -> str:
    """The global Megatron name (spec name) of `local_name` on pipeline stage `stage`.

    Raises:
        LayoutError: num_layers not a multiple of pp; stage or local index out of range.
    """
    _check_pp(num_layers, pp)
    if not 0 <= stage < pp:
        raise LayoutError(f"stage {stage} is not in [0, pp={pp})")
    m = _LAYER.match(local_name)
    if m is None:
        return local_name
    start, stop = layer_range(num_layers, pp, stage)
    local = int(m.group(1))
    if local >= stop - start:
        raise LayoutError(f"{local_name}: stage {stage} holds only {stop - start} layers")
    return f"decoder.layers.{start + local}.{m.group(2)}"


class Ref(NamedTuple):
    """A tensor in some convention, or a part of it ("q", "k", "v", "gate", "up") when it is
    one of Megatron's fused tensors."""

    name: str
    part: str | None = None


def name_map(config: ModelShape | Mapping | object, src: str, dst: str) -> dict[Ref, Ref]:
    """Every tensor of `src`'s convention to its counterpart in `dst`'s (build once per model).

    Hugging Face's and nereus's tensors are whole (part None); a Megatron fused tensor
    appears once per part. The map is a bijection: ``name_map(c, a, b)`` inverted is
    ``name_map(c, b, a)``. Megatron names carry global layer numbers.

    Arguments:
        config: see :func:`model_shape` (layers, biases and tied embeddings).
        src, dst: conventions from :data:`CONVENTIONS`.

    Raises:
        LayoutError: an unknown convention; a bad config.
    """
    return dict(_name_map(model_shape(config), src, dst))


@lru_cache(maxsize=64)
def _name_map(shape: ModelShape, src: str, dst: str) -> tuple[tuple[Ref, Ref], ...]:
    for c in (src, dst):
        if c not in CONVENTIONS:
            raise LayoutError(f"unknown convention {c!r}; choose one of {list(CONVENTIONS)}")

    def ref(p: Param, convention: str, i: int) -> Ref:
        part = p.part if convention.startswith("megatron") else None
        return Ref(getattr(p, convention).format(i=i), part)

    return tuple((ref(p, src, i), ref(p, dst, i)) for p, i in _rows(shape))


def megatron_ranks(
    tp: int,
    pp: int,
    dp: int,
    *,
    cp: int = 1,
    order: str = MEGATRON_DEFAULT_ORDER,
    ranks: Sequence[int] | None = None,
) -> tuple[int, ...]:
    """The rank tuple of a nereus_comm Layout(dp * cp, tp, pp) for a Megatron rank grid.

    Megatron numbers rank = sum(coordinate * stride) with the first axis of `order`
    fastest (the default "tp-cp-ep-dp-pp": tp, then cp, then dp, then pp; ep is 1 for
    dense parameters). A Layout lists ``ranks[(d * pp + p) * tp + t]``. Context-parallel
    ranks hold the same weights as their data-parallel peers, so they count as replicas:
    layout replica d' = d * cp + c.

    Arguments:
        tp, pp, dp, cp: Megatron's degrees.
        order: Megatron's order string ("-"-separated tp, cp, ep, dp, pp, each at most
            once; tp, dp and pp required).
        ranks: the global rank id of each Megatron rank (default: Megatron rank itself;
            Megatron's rank_offset k is ``range(k, k + world)``).

    Raises:
        LayoutError: a bad degree or order, or ranks of the wrong length.
    """
    sizes = {
        "tp": as_int(tp, "tp", LayoutError, lo=1),
        "cp": as_int(cp, "cp", LayoutError, lo=1),
        "ep": 1,
        "dp": as_int(dp, "dp", LayoutError, lo=1),
        "pp": as_int(pp, "pp", LayoutError, lo=1),
    }
    axes = order.split("-")
    if (
        len(set(axes)) != len(axes)
        or not set(axes) <= set(sizes)
        or not {"tp", "dp", "pp"} <= set(axes)
    ):
        raise LayoutError(
            f"order {order!r} must list tp, dp and pp (and optionally cp, ep) once each, "
            "'-'-separated"
        )
    if "cp" not in axes and sizes["cp"] > 1:
        raise LayoutError(f"cp={cp} but order {order!r} has no cp axis")
    stride, step = {}, 1
    for axis in axes:
        stride[axis] = step
        step *= sizes[axis]
    world = step
    ids = tuple(range(world)) if ranks is None else tuple(ranks)
    if len(ids) != world:
        raise LayoutError(f"ranks has {len(ids)} entries for a Megatron world of {world}")
    out = []
    for d in range(sizes["dp"]):
        for c in range(sizes["cp"]):
            for p in range(sizes["pp"]):
                for t in range(sizes["tp"]):
                    coord = {"tp": t, "cp": c, "dp": d, "pp": p}
                    out.append(ids[sum(coord[a] * stride[a] for a in coord if a in stride)])
    # Replica d' = d * cp + c is row (d' * pp + p) * tp + t: the loops above emit that order.
    return tuple(out)


def megatron_layout(
    tp: int,
    pp: int,
    dp: int,
    *,
    cp: int = 1,
    order: str = MEGATRON_DEFAULT_ORDER,
    ranks: Sequence[int] | None = None,
    num_layers: int | None = None,
) -> Layout:
    """The nereus_comm Layout of a Megatron rank grid (see :func:`megatron_ranks`).

    Raises:
        LayoutError: as megatron_ranks; num_layers not a multiple of pp.
    """
    if num_layers is not None:
        _check_pp(num_layers, pp)
    grid = megatron_ranks(tp, pp, dp, cp=cp, order=order, ranks=ranks)
    return Layout(dp * cp, tp, pp, grid, num_layers=num_layers)
