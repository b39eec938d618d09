"""A model-stage's state as TensorSpecs, and deterministic synthetic content.

A training stage's state is its parameters, the two Adam moments of each
(same shape, split and pipeline stage as the parameter, fp32), the optimizer
step count and the unit's RNG state (both replicated on every rank of the
unit). An inference stage holds only the parameters.

Synthetic content is a pure function of (tensor name, global element index),
so any rank can make exactly its own shard of any layout without the full
tensor, and the reference is the same function over the full box. The real
model (nereus_rl.model) replaces it when it exists.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

from nereus_rl.emu_comm import Box, TensorSpec, box_shape

RNG_STATE_BYTES = torch.Generator().get_state().numel()


def transformer_param_specs(
    num_layers: int,
    hidden: int,
    ffn: int,
    vocab: int,
    *,
    dtype: torch.dtype = torch.float32,
) -> list[TensorSpec]:
    """Parameter specs of a small decoder-only transformer, Megatron-style tp splits.

    Arguments:
        num_layers: transformer layers (the pipeline split divides these).
        hidden, ffn, vocab: model sizes (uneven tp splits are fine).
        dtype: parameter dtype.

    Returns:
        One TensorSpec per parameter: column-parallel weights split on dim 0,
        row-parallel ones on dim 1, norms replicated; the embedding belongs to
        layer 0 and the final norm and lm head to the last layer.
    """
    last = num_layers - 1
    specs = [TensorSpec("embed", (vocab, hidden), dtype, 0, 0)]
    for i in range(num_layers):
        p = f"layers.{i}."
        specs += [
            TensorSpec(p + "attn_norm", (hidden,), dtype, None, i),
            TensorSpec(p + "qkv", (3 * hidden, hidden), dtype, 0, i),
            TensorSpec(p + "attn_out", (hidden, hidden), dtype, 1, i),
            TensorSpec(p + "mlp_norm", (hidden,), dtype, None, i),
            TensorSpec(p + "mlp_up", (ffn, hidden), dtype, 0, i),
            TensorSpec(p + "mlp_down", (hidden, ffn), dtype, 1, i),
        ]
    specs += [
        TensorSpec("final_norm", (hidden,), dtype, None, last),
        TensorSpec("lm_head", (vocab, hidden), dtype, 0, last),
    ]
    return specs


def training_state_specs(
    params: Sequence[TensorSpec], *, training: bool = True
) -> list[TensorSpec]:
    """The full state of one unit: parameters, and for training Adam state, step and RNG.

    Arguments:
        params: the parameter specs.
        training: add the optimizer and RNG state.

    Returns:
        The specs, parameters first.
    """
    specs = list(params)
    if not training:
        return specs
    for p in params:
        for moment in ("exp_avg", "exp_avg_sq"):
            specs.append(
                TensorSpec(f"{p.name}.{moment}", p.shape, torch.float32, p.split_dim, p.stage_key)
            )
    specs.append(TensorSpec("optim.step", (), torch.float32))
    specs.append(TensorSpec("rng", (RNG_STATE_BYTES,), torch.uint8))
    return specs


def _name_seed(name: str, seed: int) -> int:
    return (zlib.crc32(name.encode()) + 7919 * seed) & 0x7FFFFFFF


def synthetic(spec: TensorSpec, box: Box, seed: int = 0) -> torch.Tensor:
    """Deterministic content of ``box`` of ``spec`` (a new contiguous tensor).

    Floats are multiples of 2**-16 in [-0.5, 0.5), exact in every float dtype
    we use; the RNG state is a real torch.Generator state.

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
        return (h.to(torch.float32) / 65536.0 - 0.5).to(spec.dtype).contiguous()
    return (h % 251).to(spec.dtype).contiguous()


def full_box(spec: TensorSpec) -> Box:
    """The box covering the whole tensor."""
    return tuple((0, n) for n in spec.shape)


def reference_state(specs: Sequence[TensorSpec], seed: int = 0) -> dict[str, torch.Tensor]:
    """The full (unsharded) synthetic state: what every unit must equal bitwise."""
    return {s.name: synthetic(s, full_box(s), seed) for s in specs}
