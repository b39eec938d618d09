"""torchtitan-style FSDP2 x TP training state resharded onto a bigger mesh after ranks join.

A small attention + MLP block is tensor-parallel (``parallelize_module``: q/k/v and the
MLP's up projection column-wise, the output projections row-wise) and FSDP2-sharded
(``fully_shard``) on a (dp 2, tp 2) mesh of ranks 0..3, which makes its parameters
DTensors with ``[_StridedShard(0), Shard(0)]``, ``[Shard(0), Shard(1)]`` and
``[Shard(0), Replicate()]`` placements. It trains one AdamW step. Then ranks 4 and 5
join: the job rebuilds the model on a (dp 3, tp 2) mesh of all six ranks and moves the
model and optimizer state there with :func:`nereus_comm.dtensor.reshard_dtensors`, in
one exchange (the framework's glue is the lines between "glue begins" and "glue ends").
Every byte of every parameter and Adam moment on every new rank is compared with the
full tensor of the old run (gathered with ``full_tensor()``) cut here with torch.chunk,
and the new mesh trains one more step.

The six processes are local workers on one gloo group (nereus_comm.testing); ranks 4
and 5 stand for the processes that join (they hold nothing until the reshard).

    python examples/torchtitan_fsdp_tp_join.py
"""

from __future__ import annotations

import logging
import sys
import time

import torch
import torch.distributed as dist

from nereus_comm.testing import LocalWorkers, WorkerContext

OLD_RANKS = [[0, 1], [2, 3]]  # (dp 2, tp 2)
NEW_RANKS = [[0, 1], [2, 3], [4, 5]]  # (dp 3, tp 2): ranks 4 and 5 joined
DIM, HIDDEN = 24, 40  # 40 / tp 2 = 20 rows, over dp 3: 7, 7, 6 (uneven)


class Block(torch.nn.Module):
    """Attention-like mixing and an MLP; every weight is tensor-parallel."""

    def __init__(self) -> None:
        super().__init__()
        self.wq = torch.nn.Linear(DIM, DIM)
        self.wk = torch.nn.Linear(DIM, DIM)
        self.wv = torch.nn.Linear(DIM, DIM)
        self.wo = torch.nn.Linear(DIM, DIM)
        self.w1 = torch.nn.Linear(DIM, HIDDEN)
        self.w2 = torch.nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.wo(torch.tanh(self.wq(x) * self.wk(x)) + self.wv(x))
        return h + self.w2(torch.relu(self.w1(h)))


def build(mesh):
    """The block on a (dp, tp) mesh, as torchtitan builds it: TP first, then FSDP2."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = Block()
    col, row = ColwiseParallel(), RowwiseParallel()
    plan = {"wq": col, "wk": col, "wv": col, "wo": row, "w1": col, "w2": row}
    parallelize_module(model, mesh["tp"], plan)
    fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train_step(model, opt, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, DIM, generator=g)  # the same batch on every rank
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    value = loss.detach()
    return float(value.full_tensor() if hasattr(value, "full_tensor") else value)


def _chunk(t: torch.Tensor, n: int, dim: int, c: int) -> torch.Tensor:
    parts = torch.chunk(t, n, dim=dim)
    return parts[c] if c < len(parts) else t.narrow(dim, t.shape[dim], 0)


def reference(full: torch.Tensor, mesh, placements) -> torch.Tensor:
    """This rank's shard of ``full``: torch.chunk over the mesh dims, left to right."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    coords = (mesh.mesh == dist.get_rank()).nonzero()[0].tolist()
    t = full
    for m, p in enumerate(placements):
        n, c = mesh.mesh.shape[m], coords[m]
        if isinstance(p, _StridedShard):  # each of split_factor pieces chunked, concatenated
            f = int(p.split_factor)
            t = torch.cat([_chunk(_chunk(t, f, p.dim, j), n, p.dim, c) for j in range(f)], p.dim)
        elif isinstance(p, Shard):
            t = _chunk(t, n, p.dim, c)
    return t


def _worker(ctx: WorkerContext) -> dict:
    from torch.distributed.device_mesh import DeviceMesh

    from nereus_comm.dtensor import reshard_dtensors
    from nereus_comm.optim_state import flatten_state, param_name, unflatten_state

    # torch warns that gathering a strided shard (full_tensor) takes two all_gathers.
    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)

    # Every rank builds every mesh (DeviceMesh creates its groups collectively).
    old_mesh = DeviceMesh("cpu", torch.tensor(OLD_RANKS), mesh_dim_names=("dp", "tp"))
    new_mesh = DeviceMesh("cpu", torch.tensor(NEW_RANKS), mesh_dim_names=("dp", "tp"))
    model = opt = None
    names: list[str] = []
    fulls: dict[str, torch.Tensor] = {}
    if ctx.rank in old_mesh.mesh:
        model, opt = build(old_mesh)
        train_step(model, opt, seed=1)
        names = [n for n, _ in model.named_parameters()]
        placements = {n: str(p.placements) for n, p in model.named_parameters()}
        for n, p in model.named_parameters():  # the reference: the old run's full tensors
            fulls[n] = p.detach().full_tensor()
            for key in ("exp_avg", "exp_avg_sq"):
                fulls[f"{key}.{n}"] = opt.state[p][key].full_tensor()
            fulls[f"step.{n}"] = opt.state[p]["step"].clone()
    box = [fulls, placements if ctx.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)  # to the joining ranks too
    fulls, placements = box

    new_model, new_opt = build(new_mesh)  # the job's model on the new mesh, every rank
    dist.barrier()
    start = time.perf_counter()
    # glue begins
    old = flatten_state(model.state_dict(), opt.state_dict(), param_names=names) if model else None
    new_params = dict(new_model.named_parameters())
    flat = reshard_dtensors(old, new_mesh, lambda n, _: new_params[param_name(n)].placements)
    model_state, optim_state, _ = unflatten_state(flat)
    new_model.load_state_dict(model_state)
    new_opt.load_state_dict(optim_state)
    # glue ends
    seconds = time.perf_counter() - start

    bad = []
    for n, p in new_model.named_parameters():
        checks = {"param": (p.detach(), fulls[n])}
        for key in ("exp_avg", "exp_avg_sq"):
            checks[key] = (new_opt.state[p][key], fulls[f"{key}.{n}"])
        for what, (got, full) in checks.items():
            want = reference(full, new_mesh, got.placements)
            local = got.to_local()
            if local.shape != want.shape or not torch.equal(local, want):
                bad.append(f"{what} of {n}")
        if not torch.equal(new_opt.state[p]["step"], fulls[f"step.{n}"]):
            bad.append(f"step of {n}")
    if new_opt.param_groups[0]["weight_decay"] != 0.1:
        bad.append("param_groups")
    loss = train_step(new_model, new_opt, seed=2)  # the new mesh trains on
    return {"bad": bad, "seconds": seconds, "loss": loss, "placements": placements}


def main() -> int:
    start = time.perf_counter()
    with LocalWorkers(6, timeout=120) as pool:
        results = pool.run(_worker)
    for name, pl in sorted(results[0]["placements"].items()):
        print(f"  {name:10s} was {pl}")
    slowest = max(r["seconds"] for r in results)
    bad = {r: res["bad"] for r, res in enumerate(results) if res["bad"]}
    finite = all(torch.isfinite(torch.tensor(r["loss"])) for r in results)
    print(
        f"FSDP2 x TP (2, 2) on 4 ranks -> (3, 2) on 6 ranks: model + AdamW state resharded "
        f"and loaded in {slowest * 1e3:.0f} ms (slowest rank, a first call); next step's loss "
        f"{results[0]['loss']:.4f}; {time.perf_counter() - start:.1f} "
        "s in all"
    )
    if bad or not finite:
        print(f"MISMATCH: {bad or 'non-finite loss'}")
        return 1
    print("every byte of every parameter and Adam moment on every new rank: equal")
    return 0


if __name__ == "__main__":
    sys.exit(main())
