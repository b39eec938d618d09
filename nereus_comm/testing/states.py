"""Training states of real models' shapes, as plans see them (no tensor is allocated).

:func:`llama_8b_fsdp_tp` gives a Llama-3.1-8B-shaped training state laid out as
torchtitan lays it out on a (2, 4) mesh (FSDP2 x TP4) and the FSDP16 layout it moves to
when the job grows to 16 ranks: the planning case of ``benchmarks/bench_interop.py`` and
of the sharded planner's tests.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nereus_comm.layout import TensorSpec
from nereus_comm.sharding import RankMesh, Replicate, Shard, Sharding, StridedShard
from nereus_comm.specs import LLAMA_PRESETS

#: Each parameter's copies in an AdamW training state with fp32 masters: name prefix, dtype.
ADAMW_COPIES: tuple[tuple[str, torch.dtype], ...] = (
    ("", torch.bfloat16),
    ("master.", torch.float32),
    ("optim.exp_avg.", torch.float32),
    ("optim.exp_avg_sq.", torch.float32),
)


def llama_8b_fsdp_tp(
    copies: Sequence[tuple[str, torch.dtype]] = ADAMW_COPIES,
) -> tuple[list[TensorSpec], dict[str, Sharding], dict[str, Sharding]]:
    """(specs, source Shardings, destination Shardings) of a Llama-3.1-8B-shaped state
    (the sizes of :data:`~nereus_comm.specs.LLAMA_PRESETS`; the embedding and the
    layers, without the final norm and the head).

    Source: FSDP2 x TP4 on ranks [[0..3], [4..7]]: column-parallel weights as
    fully_shard makes them (_StridedShard(0, sf=4) x Shard(0)), row-parallel Shard(0) x
    Shard(1), norms Shard(0) x Replicate. Destination: Shard(0) over ranks 0..15.

    Arguments:
        copies: (name prefix, dtype) of each copy of a parameter (default: bf16
            parameter, fp32 master, AdamW's two moments).
    """
    sizes = LLAMA_PRESETS["llama-3.1-8b"]
    hidden, ffn, vocab, layers = sizes["hidden"], sizes["ffn"], sizes["vocab"], sizes["num_layers"]
    kv = sizes["num_kv_heads"] * hidden // sizes["num_heads"]
    src = RankMesh.of([[0, 1, 2, 3], [4, 5, 6, 7]])
    dst = Sharding(RankMesh.of(list(range(16))), (Shard(0),))
    by_kind = {
        "col": Sharding(src, (StridedShard(0, 4), Shard(0))),
        "row": Sharding(src, (Shard(0), Shard(1))),
        "norm": Sharding(src, (Shard(0), Replicate())),
    }
    params = [("embed", (vocab, hidden), "col")]
    for i in range(layers):
        params += [
            (f"layers.{i}.q", (hidden, hidden), "col"),
            (f"layers.{i}.k", (kv, hidden), "col"),
            (f"layers.{i}.v", (kv, hidden), "col"),
            (f"layers.{i}.o", (hidden, hidden), "row"),
            (f"layers.{i}.gate", (ffn, hidden), "col"),
            (f"layers.{i}.up", (ffn, hidden), "col"),
            (f"layers.{i}.down", (hidden, ffn), "row"),
            (f"layers.{i}.attn_norm", (hidden,), "norm"),
            (f"layers.{i}.mlp_norm", (hidden,), "norm"),
        ]
    specs, srcs, dsts = [], {}, {}
    for name, shape, kind in params:
        for prefix, dtype in copies:
            specs.append(TensorSpec(prefix + name, shape, dtype))
            srcs[prefix + name] = by_kind[kind]
            dsts[prefix + name] = dst
    return specs, srcs, dsts
