"""verl-style weight sync: FSDP2 x TP training shards -> TP rollout engines, in place, every step.

Four ranks train a small Qwen2-style model (Hugging Face names, ``model.`` prefix, from
:func:`nereus_comm.conventions.hf_specs`) with FSDP2 x TP on a (dp 2, tp 2) mesh: the
column-parallel weights (q/k/v with their biases, gate/up, embedding, lm head) hold the
strided shards fully_shard makes of a TP shard, the row-parallel ones (o_proj,
down_proj) dim-0 chunks of their column shards, the norms dim-0 chunks. Colocated on the
same ranks run two rollout engines of TP2 each, on other rank pairs ({0, 2} and
{1, 3}), with vLLM-style fused buffers: ``qkv_proj`` = [q_t; k_t; v_t] and
``gate_up_proj`` = [gate_t; up_t] per TP rank.

After every training step the new weights go to the rollout engines: one
:func:`~nereus_comm.plan_sharded` plan (built once), and per step one
:func:`~nereus_comm.reshard_sharded` over the job's gloo group that writes each piece
straight into its slice of the fused rollout buffers (``out=``). Every byte of every
rollout buffer is compared, each step, with the shard cut here from the full tensors
with torch.chunk.

    python examples/verl_weight_sync.py
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from nereus_comm.testing import LocalWorkers, WorkerContext

CONFIG = {
    "model_type": "qwen2",
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "vocab_size": 500,
}
TRAIN_RANKS = [[0, 1], [2, 3]]  # (dp, tp)
ROLLOUT_RANKS = [[0, 2], [1, 3]]  # two engines (rows) of TP2
STEPS = 3


def full_weights(specs, step: int) -> dict[str, torch.Tensor]:
    """The model's full weights after ``step`` training steps (deterministic)."""
    out = {}
    for s in specs:
        g = torch.Generator().manual_seed(sum(map(ord, s.name)))
        out[s.name] = (torch.randn(s.shape, generator=g) + step).to(s.dtype)
    return out


def train_shard(full: torch.Tensor, split_dim: int | None, rank: int) -> torch.Tensor:
    """The training shard, as torchtitan/verl build it: TP first, then FSDP2 (dim 0)."""
    dp, tp = divmod(rank, 2)
    t = full if split_dim is None else full.chunk(2, dim=split_dim)[tp]
    parts = t.chunk(2, dim=0)
    return parts[dp] if dp < len(parts) else t[t.shape[0] :]


def rollout_shard(full: torch.Tensor, split_dim: int | None, rank: int) -> torch.Tensor:
    """The rollout engine's TP shard of a Hugging Face tensor (vLLM's cut)."""
    t = next(r.index(rank) for r in ROLLOUT_RANKS if rank in r)
    return full if split_dim is None else full.chunk(2, dim=split_dim)[t]


def _worker(ctx: WorkerContext) -> dict:
    from nereus_comm import (
        ProcessGroupTransport,
        RankMesh,
        Replicate,
        Shard,
        Sharding,
        StridedShard,
        plan_sharded,
        reshard_sharded,
    )
    from nereus_comm.conventions import hf_specs

    specs = hf_specs(CONFIG, dtype=torch.bfloat16)
    train_mesh, rollout_mesh = RankMesh.of(TRAIN_RANKS), RankMesh.of(ROLLOUT_RANKS)

    def training(split_dim):  # FSDP2 over dp of the TP shard
        if split_dim is None:
            return Sharding(train_mesh, (Shard(0), Replicate()))
        if split_dim == 0:
            return Sharding(train_mesh, (StridedShard(0, 2), Shard(0)))
        return Sharding(train_mesh, (Shard(0), Shard(split_dim)))

    def rollout(split_dim):
        tp = Replicate() if split_dim is None else Shard(split_dim)
        return Sharding(rollout_mesh, (Replicate(), tp))

    plan = plan_sharded(
        specs,
        {s.name: training(s.split_dim) for s in specs},
        {s.name: rollout(s.split_dim) for s in specs},
    )

    # The rollout engine's buffers: fused qkv and gate_up, the rest one tensor each.
    by_name = {s.name: s for s in specs}
    buffers: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for i in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for fused, parts in (
            ("self_attn.qkv_proj.weight", ("q_proj.weight", "k_proj.weight", "v_proj.weight")),
            ("self_attn.qkv_proj.bias", ("q_proj.bias", "k_proj.bias", "v_proj.bias")),
            ("mlp.gate_up_proj.weight", ("gate_proj.weight", "up_proj.weight")),
        ):
            names = [p + fused.split(".")[0] + "." + part for part in parts]
            shapes = [
                rollout_shard(torch.empty(by_name[n].shape), 0, ctx.rank).shape for n in names
            ]
            buf = torch.full((sum(s[0] for s in shapes), *shapes[0][1:]), -1.0).bfloat16()
            buffers[p + fused] = buf
            at = 0
            for n, shape in zip(names, shapes):
                out[n] = buf[at : at + shape[0]]  # a view: the sync writes into the buffer
                at += shape[0]
    for s in specs:
        if s.name not in out:
            shard = rollout_shard(torch.empty(s.shape), s.split_dim, ctx.rank)
            out[s.name] = buffers[s.name] = torch.full(shard.shape, -1.0).bfloat16()

    transport = ProcessGroupTransport(dist.group.WORLD)
    bad, seconds = [], []
    for step in range(1, STEPS + 1):
        full = full_weights(specs, step)  # what training produced this step
        mine = {s.name: train_shard(full[s.name], s.split_dim, ctx.rank) for s in specs}
        dist.barrier()
        start = time.perf_counter()
        res = reshard_sharded(plan, ctx.rank, mine, transport, out=out, timeout=60)
        seconds.append(time.perf_counter() - start)
        # The rollout engine's fused buffers against the reference cut of this step.
        for name, buf in buffers.items():
            if "qkv_proj" in name or "gate_up_proj" in name:
                p, kind = name.rsplit(".", 2)[0], name.rsplit(".", 1)[1]
                parts = ("q", "k", "v") if "qkv" in name else ("gate", "up")
                want = torch.cat(
                    [rollout_shard(full[f"{p}.{x}_proj.{kind}"], 0, ctx.rank) for x in parts]
                )
            else:
                want = rollout_shard(full[name], by_name[name].split_dim, ctx.rank)
            if buf.shape != want.shape or not torch.equal(buf, want):
                bad.append(f"step {step}: {name}")
        if any(res.tensors[n].data_ptr() != out[n].data_ptr() for n in out):
            bad.append(f"step {step}: a result is not the rollout buffer itself")
    return {"bad": bad, "seconds": seconds, "bytes": (plan.total_bytes, plan.lower_bound_bytes)}


def main() -> int:
    start = time.perf_counter()
    with LocalWorkers(4, timeout=120) as pool:
        results = pool.run(_worker)
    per_step = [max(r["seconds"][i] for r in results) for i in range(STEPS)]
    sent, bound = results[0]["bytes"]
    print(
        f"weight sync FSDP2 x TP2 (2, 2) -> 2 rollout engines of TP2, {sent} B sent per step "
        f"(lower bound {bound} B); per step (slowest rank): "
        + ", ".join(f"{s * 1e3:.1f} ms" for s in per_step)
        + f"; {time.perf_counter() - start:.1f} s in all"
    )
    bad = {r: res["bad"] for r, res in enumerate(results) if res["bad"]}
    if bad or sent != bound:
        print(f"MISMATCH: {bad}")
        return 1
    print("every byte of every fused rollout buffer, every step, on every rank: equal")
    return 0


if __name__ == "__main__":
    sys.exit(main())
