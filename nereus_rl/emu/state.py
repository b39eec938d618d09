"""A model-stage's state as TensorSpecs, and deterministic synthetic content.

A training stage's state is its parameters, the two Adam moments of each
(same shape, split and pipeline stage as the parameter, fp32), the optimizer
step count and the unit's RNG state (both replicated on every rank of the
unit); an inference stage holds only the parameters. Names follow
nereus_comm.specs.transformer_state_specs.

Synthetic content is a pure function of (tensor name, global element index),
so any rank can make exactly its own shard of any layout without the full
tensor, and the reference is the same function over the full box. The real
model (nereus_rl.models.model) replaces it when it exists.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

from nereus_comm.layout import Box, TensorSpec, box_shape
from nereus_comm.specs import transformer_state_specs

RNG_STATE_BYTES = torch.Generator().get_state().numel()
RNG_SPEC = TensorSpec("rng", (RNG_STATE_BYTES,), torch.uint8)
"""The unit's torch.Generator state, replicated on every rank of the unit."""


def with_training_state(params: Sequence[TensorSpec]) -> list[TensorSpec]:
    """A training unit's state for any parameter specs: params, Adam state, step and RNG.

    Names follow nereus_comm.specs: ``optim.exp_avg.<param>``,
    ``optim.exp_avg_sq.<param>`` (fp32, same shape, split and stage as the
    parameter), ``optim.step``; plus ``rng``, the unit's generator state.

    Arguments:
        params: the parameter specs.

    Returns:
        The specs, parameters first.
    """
    specs = list(params)
    for moment in ("exp_avg", "exp_avg_sq"):
        specs += [
            TensorSpec(f"optim.{moment}.{p.name}", p.shape, torch.float32, p.split_dim, p.stage_key)
            for p in params
        ]
    specs.append(TensorSpec("optim.step", (), torch.float32))
    specs.append(RNG_SPEC)
    return specs


def stage_state_specs(
    num_layers: int,
    hidden: int,
    ffn: int,
    vocab: int,
    *,
    num_heads: int = 2,
    num_kv_heads: int | None = None,
    training: bool = True,
    param_dtype: torch.dtype = torch.float32,
    master_fp32: bool = False,
) -> list[TensorSpec]:
    """One unit's state for a decoder-only transformer (nereus_comm.specs), plus RNG.

    Arguments:
        num_layers, hidden, ffn, vocab, num_heads, num_kv_heads: model sizes
            (num_kv_heads defaults to num_heads).
        training: a training stage (Adam moments, step, RNG) or inference (params only).
        param_dtype: parameter dtype.
        master_fp32: add fp32 master weights (training only).

    Returns:
        The specs.
    """
    specs = transformer_state_specs(
        num_layers, hidden, ffn, num_heads, num_kv_heads or num_heads, vocab,
        param_dtype=param_dtype, adam=training, master_fp32=master_fp32 and training,
    )  # fmt: skip
    return [*specs, RNG_SPEC] if training else specs


def _name_seed(name: str, seed: int) -> int:
    return (zlib.crc32(name.encode()) + 7919 * seed) & 0x7FFFFFFF


def synthetic(spec: TensorSpec, box: Box, seed: int = 0) -> torch.Tensor:
    """Deterministic content of ``box`` of ``spec`` (a new contiguous tensor).

    Floats are multiples of 2**-16 in [-0.5, 0.5), exact in every float dtype
    the state uses; the RNG state is a real torch.Generator state.

    Arguments:
        spec: the tensor.
        box: the global region wanted.
        seed: varies the content between runs/stages.

    Returns:
        A tensor of shape box_shape(box) and dtype spec.dtype.
    """
    s = _name_seed(spec.name, seed)
    if spec.name == "rng":
        g = torch.Generator()
        g.manual_seed(s)
        full = g.get_state()
        return full[box[0][0] : box[0][1]].clone()
    if spec.name == "optim.step":
        return torch.full((), float(1 + seed % 97), dtype=spec.dtype)
    shape = box_shape(box)
    out = torch.empty(shape, dtype=spec.dtype)
    if out.numel() == 0:
        return out
    if not shape:
        out.copy_(_hashed(spec, box, s).abs())
        return out
    # Rows of dim 0 in chunks, so that the int64 temporaries stay small.
    row = max(1, out[0].numel())
    step = max(1, _CHUNK_ELEMS // row)
    (a0, b0) = box[0]
    for start in range(a0, b0, step):
        stop = min(b0, start + step)
        out[start - a0 : stop - a0] = _hashed(spec, ((start, stop), *box[1:]), s)
    if "exp_avg_sq" in spec.name:
        out.abs_()  # a second moment is never negative (Adam takes its square root)
    return out


_CHUNK_ELEMS = 1 << 22


def _hashed(spec: TensorSpec, box: Box, s: int) -> torch.Tensor:
    shape = box_shape(box)
    idx = torch.zeros((), dtype=torch.int64)
    stride = 1
    for dim in reversed(range(len(shape))):
        (a, b) = box[dim]
        view = [1] * len(shape)
        view[dim] = b - a
        idx = idx + torch.arange(a, b, dtype=torch.int64).view(view) * stride
        stride *= spec.shape[dim]
    idx = idx.expand(shape) if shape else idx
    # A multiplicative hash of the global index: cheap, and different per tensor.
    h = (idx * 2654435761 + s) % 4294967291
    h = (h ^ (h >> 13)) & 0xFFFF
    if spec.dtype.is_floating_point:
        return (h.to(torch.float32) / 65536.0 - 0.5).to(spec.dtype)
    return (h % 251).to(spec.dtype)


def full_box(spec: TensorSpec) -> Box:
    """The box covering the whole tensor."""
    return tuple((0, n) for n in spec.shape)


def reference_state(specs: Sequence[TensorSpec], seed: int = 0) -> dict[str, torch.Tensor]:
    """The full (unsharded) synthetic state: what every unit must equal bitwise."""
    return {s.name: synthetic(s, full_box(s), seed) for s in specs}
