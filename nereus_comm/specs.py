"""TensorSpecs of a decoder-only transformer's sharded training state.

Megatron-style tensor parallelism: q/k/v, gate and up projections are
column-split (dim 0), o and down projections row-split (dim 1), the embedding
and the lm head vocab-split (dim 0), norms replicated. Adam's exp_avg and
exp_avg_sq (fp32) and the fp32 master weights follow their parameter's split;
the optimizer's step counter is replicated on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nereus_comm.errors import LayoutError, as_int
from nereus_comm.layout import TensorSpec

__all__ = ["LLAMA_PRESETS", "llama_state_specs", "training_state_specs", "transformer_state_specs"]

LLAMA_PRESETS: dict[str, dict[str, int]] = {
    "llama-3.1-8b": dict(
        num_layers=32, hidden=4096, ffn=14336, num_heads=32, num_kv_heads=8, vocab=128256
    ),
    "llama-3.1-70b": dict(
        num_layers=80, hidden=8192, ffn=28672, num_heads=64, num_kv_heads=8, vocab=128256
    ),
}


def _param_specs(
    num_layers: int, hidden: int, ffn: int, num_heads: int, num_kv_heads: int, vocab: int
) -> list[tuple[str, tuple[int, ...], int | None, int]]:
    head_dim = hidden // num_heads
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    params: list[tuple[str, tuple[int, ...], int | None, int]] = [
        ("embed_tokens.weight", (vocab, hidden), 0, 0)
    ]
    for i in range(num_layers):
        pre = f"layers.{i}."
        params += [
            (pre + "input_layernorm.weight", (hidden,), None, i),
            (pre + "self_attn.q_proj.weight", (q, hidden), 0, i),
            (pre + "self_attn.k_proj.weight", (kv, hidden), 0, i),
            (pre + "self_attn.v_proj.weight", (kv, hidden), 0, i),
            (pre + "self_attn.o_proj.weight", (hidden, q), 1, i),
            (pre + "post_attention_layernorm.weight", (hidden,), None, i),
            (pre + "mlp.gate_proj.weight", (ffn, hidden), 0, i),
            (pre + "mlp.up_proj.weight", (ffn, hidden), 0, i),
            (pre + "mlp.down_proj.weight", (hidden, ffn), 1, i),
        ]
    last = num_layers - 1
    params += [("norm.weight", (hidden,), None, last), ("lm_head.weight", (vocab, hidden), 0, last)]
    return params


def transformer_state_specs(
    num_layers: int,
    hidden: int,
    ffn: int,
    num_heads: int,
    num_kv_heads: int,
    vocab: int,
    *,
    param_dtype: torch.dtype = torch.bfloat16,
    adam: bool = True,
    master_fp32: bool = True,
) -> list[TensorSpec]:
    """The sharded training state of a generic decoder-only transformer.

    Arguments:
        num_layers, hidden, ffn, num_heads, num_kv_heads, vocab: model shape
            (hidden must be a multiple of num_heads).
        param_dtype: dtype of the parameters.
        adam: add Adam's exp_avg and exp_avg_sq (fp32) per parameter and a
            replicated fp32 step counter.
        master_fp32: add fp32 master weights per parameter.

    Returns:
        Specs in a fixed order: parameters, then master weights, then
        exp_avg, then exp_avg_sq, then the step counter. Stage keys: layer
        index; embedding 0; final norm and lm head num_layers - 1.

    Raises:
        LayoutError: a size that is not an int >= 1, or hidden not a multiple of num_heads.
    """
    sizes = dict(
        num_layers=num_layers,
        hidden=hidden,
        ffn=ffn,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        vocab=vocab,
    )
    sizes = {k: as_int(v, f"transformer size {k}", LayoutError) for k, v in sizes.items()}
    bad = {k: v for k, v in sizes.items() if v < 1}
    if bad:
        raise LayoutError(f"transformer sizes must be >= 1, got {bad}")
    if sizes["hidden"] % sizes["num_heads"]:
        raise LayoutError(f"hidden={hidden} must be a multiple of num_heads={num_heads}")
    params = [
        TensorSpec(name, shape, param_dtype, split_dim=split, stage_key=layer)
        for name, shape, split, layer in _param_specs(**sizes)
    ]
    return training_state_specs(params, adam=adam, master_fp32=master_fp32)


def training_state_specs(
    params: Sequence[TensorSpec], *, adam: bool = True, master_fp32: bool = True
) -> list[TensorSpec]:
    """Parameters plus the optimizer state that follows each one's split and stage.

    Arguments:
        params: the parameter specs (their own dtype).
        adam: add "optim.exp_avg.<name>" and "optim.exp_avg_sq.<name>" (fp32) per
            parameter and a replicated fp32 "optim.step".
        master_fp32: add fp32 "master.<name>" weights per parameter.

    Returns:
        Specs in a fixed order: parameters, then master weights, then exp_avg, then
        exp_avg_sq, then the step counter.
    """
    kinds: list[tuple[str, torch.dtype | None]] = [("", None)]
    if master_fp32:
        kinds.append(("master.", torch.float32))
    if adam:
        kinds += [("optim.exp_avg.", torch.float32), ("optim.exp_avg_sq.", torch.float32)]
    specs = [
        TensorSpec(prefix + p.name, p.shape, dtype or p.dtype, p.split_dim, p.stage_key)
        for prefix, dtype in kinds
        for p in params
    ]
    if adam:
        specs.append(TensorSpec("optim.step", (), torch.float32))
    return specs


def llama_state_specs(name: str, **kwargs) -> list[TensorSpec]:
    """`transformer_state_specs` for a preset: "llama-3.1-8b" or "llama-3.1-70b".

    Arguments:
        name: preset name (case-insensitive).
        **kwargs: passed on (param_dtype, adam, master_fp32).

    Raises:
        LayoutError: unknown preset.
    """
    try:
        sizes = LLAMA_PRESETS[name.lower()]
    except KeyError:
        raise LayoutError(
            f"unknown model preset {name!r}; choose one of {sorted(LLAMA_PRESETS)}"
        ) from None
    return transformer_state_specs(**sizes, **kwargs)
