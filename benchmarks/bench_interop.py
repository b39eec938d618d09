"""nereus_comm against DTensor.redistribute and DCP on DTensor training states.

A training state of ~256 MiB (``--quick``: 32 MiB) lives as DTensors on 4 local gloo
ranks: an MLP stack whose weights are column-parallel ``fc1`` ([F, H], tp Shard(0)),
row-parallel ``fc2`` ([H, F], tp Shard(1)) and a replicated norm ([H]), each as a bf16
parameter with an fp32 master copy, AdamW's two fp32 moments and a per-parameter step
(named as :func:`nereus_comm.optim_state.flatten_state` names them). Three changes:

- (a) TP2 x DP2 -> TP4 on the same 4 ranks (a 1-D mesh);
- (b) FSDP2 x TP2 on a (2, 2) mesh (fc1: [_StridedShard(0, sf=2), Shard(0)], as
  fully_shard makes it) -> FSDP4 on a (4, 1) mesh;
- (c) FSDP2 x TP2 on 4 ranks -> FSDP3 x TP2 on 6 ranks (two ranks join).

Each is made three ways, in the same worker pool, round-robin with the order rotating:

- ``nereus``: :func:`nereus_comm.dtensor.reshard_dtensors` (route "auto": same-host
  shared memory or cross-memory attach). Its first call (metadata exchange, planning,
  route set-up) is reported apart from the repeated calls (a cached plan behind a
  32-byte fingerprint exchange).
- ``redistribute``: ``DTensor.redistribute`` per tensor, where it can: it keeps the mesh,
  so (a) and (b) run as the equivalent placements on the source (2, 2) mesh ([Shard(d),
  Shard(d)] gives rank (i, j) chunk 2i + j, as the 4-rank destination mesh does); (c)
  changes the rank set, which it cannot.
- ``dcp``: ``torch.distributed.checkpoint`` save by the source ranks, then load by the
  destination ranks into preallocated DTensors (allocation not timed), through
  /dev/shm (removed after each round).

A time is the slowest rank's, from a barrier to its end; the tables give the median
over the repeats and the min..max. Every output is compared bit for bit with the
destination shard torch's own ``distribute_tensor`` cuts from the full tensor. Bytes:
what the nereus plan sends between ranks against the lower bound, counted here
independently (elements of each destination shard its rank does not hold in the
source, by index sets). Last, :func:`plan_8b` times planning a Llama-3.1-8B-shaped
training state from FSDP2 x TP4 to FSDP16 (one process, no bytes moved).

    python benchmarks/bench_interop.py [--quick] [--json PATH] [--repeats N] [--mib M] [--donate]

``--donate`` runs nereus with ``donate=True`` (the source state given up, as a layout
change that drops the old state does: a destination shard that is wholly a contiguous
block of the rank's own source shard is that block, not a copy).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from nereus_comm.testing import LocalWorkers, WorkerContext  # noqa: E402

MiB = 2**20
WORLD = 6
CASES = ("a", "b", "c")
WAYS = ("nereus", "redistribute", "dcp")
TITLES = {
    "a": "(a) TP2 x DP2 -> TP4, 4 ranks",
    "b": "(b) FSDP2 x TP2 (2,2) -> FSDP4 (4,1)",
    "c": "(c) FSDP2 x TP2, 4 -> 6 ranks (join)",
}
#: Bytes per parameter element: bf16 parameter, fp32 master, two fp32 Adam moments.
BYTES_PER_ELEMENT = 2 + 4 + 4 + 4


def model_dims(target_bytes: int) -> tuple[int, int, int]:
    """(layers, hidden H, ffn F) of a state of about ``target_bytes``."""
    hidden = 1024 if target_bytes >= 64 * MiB else 256
    ffn = 2 * hidden
    per_layer = (2 * hidden * ffn + hidden) * BYTES_PER_ELEMENT
    return max(1, round(target_bytes / per_layer)), hidden, ffn


def params(target_bytes: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of every parameter; kind: "col", "row" or "norm"."""
    layers, hidden, ffn = model_dims(target_bytes)
    out = []
    for i in range(layers):
        out += [
            (f"layers.{i}.norm.weight", (hidden,), "norm"),
            (f"layers.{i}.fc1.weight", (ffn, hidden), "col"),
            (f"layers.{i}.fc2.weight", (hidden, ffn), "row"),
        ]
    return out


def placements(case: str, side: str, kind: str) -> list:
    """The torch placements of a parameter of ``kind`` in a case's ``side``: "src",
    "dst" or "redistribute" (the destination as placements on the source mesh)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    tp_dim = {"col": 0, "row": 1, "norm": None}[kind]
    tp = Replicate() if tp_dim is None else Shard(tp_dim)
    fsdp_tp = {  # fully_shard over dp of a tp-sharded parameter
        "col": [_StridedShard(0, split_factor=2), Shard(0)],
        "row": [Shard(0), Shard(1)],
        "norm": [Shard(0), Replicate()],
    }[kind]
    if side == "src":
        return [Replicate(), tp] if case == "a" else fsdp_tp
    if case == "a":
        return [tp] if side == "dst" else [Replicate(), Replicate()] if tp_dim is None else [tp, tp]
    if case == "b":
        return [Shard(0), Replicate()] if side == "dst" else [Shard(0), Shard(0)]
    return fsdp_tp  # (c): the same kind of placements on the bigger mesh


def _full(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A deterministic full tensor with (nearly) distinct values, the same in every process."""
    n = 1
    for s in shape:
        n *= s
    seed = sum(map(ord, name)) * 7919
    x = (torch.arange(n, dtype=torch.int64) * 2654435761 + seed) % 1000003
    return (x.to(torch.float32) / 7.0).to(dtype).reshape(shape)


def _chunk(t: torch.Tensor, n: int, dim: int, c: int) -> torch.Tensor:
    parts = torch.chunk(t, n, dim=dim)
    return parts[c] if c < len(parts) else t.narrow(dim, t.shape[dim], 0)


def _cut(full: torch.Tensor, ranks: torch.Tensor, pls, rank: int) -> torch.Tensor | None:
    """``rank``'s shard on a mesh of ``ranks`` by torch.chunk, mesh dims left to right
    (None off the mesh)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    where = (ranks == rank).nonzero()
    if len(where) == 0:
        return None
    coords = where[0].tolist()
    t = full
    for m, p in enumerate(pls):
        n, c = ranks.shape[m], coords[m]
        if isinstance(p, _StridedShard):
            sf = int(p.split_factor)
            t = torch.cat([_chunk(_chunk(t, sf, p.dim, j), n, p.dim, c) for j in range(sf)], p.dim)
        elif isinstance(p, Shard):
            t = _chunk(t, n, p.dim, c)
    return t.contiguous()


def _entries(target_bytes: int):
    """(flat name, shape, dtype, param kind) of every tensor entry of the training state."""
    out = []
    for name, shape, kind in params(target_bytes):
        out.append((name, shape, torch.bfloat16, kind))
        out.append((f"master.{name}", shape, torch.float32, kind))
        out.append((f"optim.exp_avg.{name}", shape, torch.float32, kind))
        out.append((f"optim.exp_avg_sq.{name}", shape, torch.float32, kind))
    return out


def _state(mesh, case: str, target_bytes: int) -> dict | None:
    """This rank's source training state (a flat_state dict) or None off the mesh."""
    from torch.distributed.tensor import DTensor

    if (mesh.mesh == dist.get_rank()).sum() == 0:
        return None
    flat: dict = {}
    for name, shape, dtype, kind in _entries(target_bytes):
        pls = placements(case, "src", kind)
        local = _cut(_full(name, shape, dtype), mesh.mesh, pls, dist.get_rank())
        flat[name] = DTensor.from_local(
            local, mesh, pls, run_check=False, shape=torch.Size(shape), stride=_stride(shape)
        )
    for name, _shape, _kind in params(target_bytes):
        flat[f"optim.step.{name}"] = torch.tensor(3.0)
    flat["optim.param_groups"] = [
        {"params": [n for n, _, _ in params(target_bytes)], "lr": 1e-4, "betas": (0.9, 0.95)}
    ]
    return flat


def _stride(shape) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def _meshes(ctx: WorkerContext, case: str):
    from torch.distributed.device_mesh import DeviceMesh

    key = f"interop_meshes_{case}"
    if key not in ctx.scratch:
        src = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("dp", "tp"))
        if case == "a":
            dst = DeviceMesh("cpu", torch.arange(4), mesh_dim_names=("tp",))
        elif case == "b":
            dst = DeviceMesh("cpu", torch.arange(4).reshape(4, 1), mesh_dim_names=("dp", "tp"))
        else:
            dst = DeviceMesh("cpu", torch.arange(6).reshape(3, 2), mesh_dim_names=("dp", "tp"))
        # Cases (a) and (b) move among ranks 0..3: a group of those (every rank builds it).
        if "interop_group4" not in ctx.scratch:
            ctx.scratch["interop_group4"] = dist.new_group(list(range(4)))
        group = dist.group.WORLD if case == "c" else ctx.scratch["interop_group4"]
        ctx.scratch[key] = (src, dst, group)
    return ctx.scratch[key]


def _dst_placements(case: str, target_bytes: int) -> dict[str, list]:
    kinds = {n: k for n, _, _, k in _entries(target_bytes)}
    return {n: placements(case, "dst", k) for n, k in kinds.items()}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def _worker(
    ctx: WorkerContext, case: str, target_bytes: int, repeats: int, shm_dir: str, donate: bool
) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    from nereus_comm.dtensor import reshard_dtensors

    warnings.filterwarnings("ignore")
    # torch logs a warning per redistribute of a strided shard and per gloo all_to_all.
    logging.getLogger("torch").setLevel(logging.ERROR)
    src, dst, group = _meshes(ctx, case)
    rank = ctx.rank
    in_src = rank < 4
    in_dst = bool((dst.mesh == rank).sum())
    in_group = case == "c" or rank < 4
    state = _state(src, case, target_bytes) if in_src else None
    dst_pl = _dst_placements(case, target_bytes)
    tensors = {n: v for n, v in (state or {}).items() if isinstance(v, DTensor)}
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    first: dict[str, float] = {}
    errors: dict[str, str] = {}
    outs: dict[str, dict] = {}

    def nereus():
        return reshard_dtensors(state, dst, dst_pl, group=group, timeout=300, donate=donate)

    def redistribute():
        if case == "c":
            raise NotImplementedError("the rank set changes: redistribute keeps the mesh")
        kinds = {n: k for n, _, _, k in _entries(target_bytes)}
        return {
            n: v.redistribute(src, placements(case, "redistribute", kinds[n]))
            for n, v in tensors.items()
        }

    def load_target():
        out = {}
        if not in_dst:
            return out
        for n, shape, dtype, kind in _entries(target_bytes):
            pls = placements(case, "dst", kind)
            local = torch.empty(
                _cut(torch.empty(shape, dtype=dtype), dst.mesh, pls, rank).shape, dtype=dtype
            )
            out[n] = DTensor.from_local(
                local, dst, pls, run_check=False, shape=torch.Size(shape), stride=_stride(shape)
            )
        return out

    def dcp_round(target):
        path = os.path.join(shm_dir, f"ckpt_{case}")
        if in_src:
            dcp.save(
                tensors,
                storage_writer=dcp.FileSystemWriter(path),
                process_group=ctx.scratch["interop_group4"],
            )
        dist.barrier()
        if in_dst:
            dcp.load(
                target,
                storage_reader=dcp.FileSystemReader(path),
                process_group=dist.group.WORLD if case == "c" else ctx.scratch["interop_group4"],
            )
        return target

    target = load_target()
    ways = {"nereus": nereus, "redistribute": redistribute, "dcp": lambda: dcp_round(target)}
    for r in range(repeats + 1):  # round 0 is each way's first call
        order = WAYS[r % 3 :] + WAYS[: r % 3]
        for way in order:
            if way in errors:
                continue
            dist.barrier()
            t0 = time.perf_counter()
            try:
                if way == "dcp" or in_group:
                    out = ways[way]()
                else:
                    out = {}
            except NotImplementedError as e:
                errors[way] = str(e)
                continue
            elapsed = time.perf_counter() - t0
            dist.barrier()
            if way == "dcp" and rank == 0:
                shutil.rmtree(os.path.join(shm_dir, f"ckpt_{case}"), ignore_errors=True)
            if r == 0:
                first[way] = elapsed
                outs[way] = out
            else:
                times[way].append(elapsed)
    # Every output against torch's own cut of the full tensor.
    bad = []
    if in_dst:
        for name, shape, dtype, kind in _entries(target_bytes):
            want = _cut(_full(name, shape, dtype), dst.mesh, placements(case, "dst", kind), rank)
            for way, out in outs.items():
                got = out.get(name) if way != "redistribute" else None
                if way == "redistribute" and name in out:
                    got = out[name]
                    want_r = _cut(
                        _full(name, shape, dtype),
                        src.mesh,
                        placements(case, "redistribute", kind),
                        rank,
                    )
                    if not _bits_equal(got.to_local(), want_r):
                        bad.append(f"{way}:{name}")
                    continue
                if got is None or not _bits_equal(got.to_local(), want):
                    bad.append(f"{way}:{name}")
        steps = outs["nereus"]
        if any(
            not torch.equal(steps[f"optim.step.{n}"], torch.tensor(3.0))
            for n, *_ in params(target_bytes)
        ):
            bad.append("nereus:optim.step")
        if steps.get("optim.param_groups", [{}])[0].get("lr") != 1e-4:
            bad.append("nereus:optim.param_groups")
    return {"times": times, "first": first, "errors": errors, "bad": bad}


def lower_bound_bytes(case: str, target_bytes: int) -> int:
    """Bytes the destination ranks lack, by index sets cut with torch.chunk (one process):
    for every tensor and destination rank, its shard's elements that the same rank does
    not hold in the source."""
    total = 0
    by_shape: dict[tuple, int] = {}
    for _name, shape, dtype, kind in _entries(target_bytes):
        key = (shape, kind)
        if key not in by_shape:
            by_shape[key] = _missing_elements(case, shape, kind)
        total += by_shape[key] * torch.empty((), dtype=dtype).element_size()
    # Plain step tensors (4 B each) are replicated; a joining rank lacks them all.
    joiners = 2 if case == "c" else 0
    total += joiners * len(params(target_bytes)) * 4
    return total


def _missing_elements(case: str, shape: tuple[int, ...], kind: str) -> int:
    index = torch.arange(_numel(shape), dtype=torch.int64).reshape(shape)
    src = torch.arange(4).reshape(2, 2)
    dst = {"a": torch.arange(4), "b": torch.arange(4).reshape(4, 1)}.get(
        case, torch.arange(6).reshape(3, 2)
    )
    missing = 0
    for r in range(WORLD):
        want = _cut(index, dst, placements(case, "dst", kind), r)
        if want is None:
            continue
        have = _cut(index, src, placements(case, "src", kind), r)
        if have is None:
            missing += want.numel()
        else:
            missing += int((~torch.isin(want.reshape(-1), have.reshape(-1))).sum())
    return missing


def plan_bytes(case: str, target_bytes: int) -> tuple[int, int]:
    """(bytes the nereus plan sends, its own lower bound), planned as reshard_dtensors plans."""
    from nereus_comm.dtensor import from_torch_placements
    from nereus_comm.layout import TensorSpec
    from nereus_comm.placement import plan_sharded
    from nereus_comm.sharding import RankMesh, Replicate, Sharding

    src = RankMesh.of([[0, 1], [2, 3]])
    dst = {"a": RankMesh.of([0, 1, 2, 3]), "b": RankMesh.of([[0], [1], [2], [3]])}.get(
        case, RankMesh.of([[0, 1], [2, 3], [4, 5]])
    )
    specs, s, d = [], {}, {}
    for name, shape, dtype, kind in _entries(target_bytes):
        specs.append(TensorSpec(name, shape, dtype))
        s[name] = Sharding(src, from_torch_placements(placements(case, "src", kind), len(shape)))
        d[name] = Sharding(dst, from_torch_placements(placements(case, "dst", kind), len(shape)))
    for name, _shape, _kind in params(target_bytes):
        step = f"optim.step.{name}"
        specs.append(TensorSpec(step, (), torch.float32))
        s[step] = Sharding(RankMesh((4,), (0, 1, 2, 3)), (Replicate(),))
        d[step] = Sharding(RankMesh((len(dst.ranks),), dst.ranks), (Replicate(),))
    plan = plan_sharded(specs, s, d)
    return plan.total_bytes, plan.lower_bound_bytes


def plan_8b(repeats: int = 5) -> dict:
    """Plan :func:`nereus_comm.testing.states.llama_8b_fsdp_tp`'s state (FSDP2 x TP4 on a
    (2, 4) mesh -> FSDP16; bf16 parameters, fp32 masters, two Adam moments) with
    plan_sharded, in this process: median and min seconds over ``repeats`` (the first
    call apart), pieces and bytes against the lower bound."""
    from nereus_comm.placement import plan_sharded
    from nereus_comm.testing.states import llama_8b_fsdp_tp

    specs, s, d = llama_8b_fsdp_tp()
    t0 = time.perf_counter()
    plan = plan_sharded(specs, s, d)
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan = plan_sharded(specs, s, d)
        times.append(time.perf_counter() - t0)
    return {
        "tensors": len(specs),
        "first_s": first,
        "median_s": statistics.median(times),
        "min_s": min(times),
        "remote_pieces": len(plan.remote),
        "bytes_sent": plan.total_bytes,
        "lower_bound_bytes": plan.lower_bound_bytes,
    }


def _stats(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def run(target_bytes: int, repeats: int, cases=CASES, donate: bool = False) -> list[dict]:
    """One row per case: each way's median/min/max seconds (slowest rank), ratios, bytes."""
    rows = []
    shm_dir = tempfile.mkdtemp(prefix="nereus_bench_interop_", dir="/dev/shm")
    try:
        with LocalWorkers(WORLD, timeout=600) as pool:
            for case in cases:
                res = pool.run(_worker, case, target_bytes, repeats, shm_dir, donate, timeout=1800)
                bad = [b for r in res for b in r["bad"]]
                if bad:
                    raise SystemExit(f"case {case}: outputs differ from the reference: {bad[:8]}")
                row: dict = {"case": case, "title": TITLES[case]}
                row["state_bytes"] = sum(
                    torch.empty((), dtype=dt).element_size() * _numel(sh)
                    for _, sh, dt, _ in _entries(target_bytes)
                )
                for way in WAYS:
                    if way in res[0]["errors"]:
                        row[f"{way}_s"] = None
                        row[f"{way}_note"] = res[0]["errors"][way]
                        continue
                    # Per round, the slowest rank.
                    per_round = [max(r["times"][way][i] for r in res) for i in range(repeats)]
                    med, lo, hi = _stats(per_round)
                    row[f"{way}_s"], row[f"{way}_min_s"], row[f"{way}_max_s"] = med, lo, hi
                    row[f"{way}_first_s"] = max(r["first"][way] for r in res)
                for way in ("redistribute", "dcp"):
                    if row.get(f"{way}_s"):
                        row[f"speedup_vs_{way}_x"] = row[f"{way}_s"] / row["nereus_s"]
                        row[f"speedup_first_vs_{way}_x"] = (
                            row[f"{way}_first_s"] / row["nereus_first_s"]
                        )
                sent, bound = plan_bytes(case, target_bytes)
                row["bytes_sent"] = sent
                row["plan_lower_bound_bytes"] = bound
                row["lower_bound_bytes"] = lower_bound_bytes(case, target_bytes)
                rows.append(row)
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
    return rows


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1e3:.0f}"


def _cell(row: dict, way: str) -> str:
    if row.get(f"{way}_s") is None:
        return "n/a"
    return f"{_ms(row[f'{way}_s'])} [{_ms(row[f'{way}_min_s'])}..{_ms(row[f'{way}_max_s'])}]"


def report(rows: list[dict]) -> None:
    """Print the table: times (ms, median [min..max] of the slowest rank), ratios, bytes."""
    print(
        f"{'case':40s} {'nereus ms':>16s} {'redistribute ms':>18s} {'dcp ms':>18s} "
        f"{'x redist':>9s} {'x dcp':>7s} {'sent/bound MiB':>16s}"
    )
    for r in rows:
        xr = r.get("speedup_vs_redistribute_x")
        xd = r.get("speedup_vs_dcp_x")
        print(
            f"{r['title']:40s} {_cell(r, 'nereus'):>16s} {_cell(r, 'redistribute'):>18s} "
            f"{_cell(r, 'dcp'):>18s} {'n/a' if xr is None else f'{xr:.1f}':>9s} "
            f"{'n/a' if xd is None else f'{xd:.1f}':>7s} "
            f"{r['bytes_sent'] / MiB:7.1f}/{r['lower_bound_bytes'] / MiB:.1f}"
        )
    print("first calls (ms; nereus: metadata exchange, planning, route set-up included):")
    for r in rows:
        parts = [f"{w} {_ms(r.get(f'{w}_first_s'))}" for w in WAYS if r.get(f"{w}_s") is not None]
        print(f"  {r['title']:40s} " + ", ".join(parts))
    for r in rows:
        ok = r["bytes_sent"] == r["lower_bound_bytes"] == r["plan_lower_bound_bytes"]
        print(
            f"  {r['case']}: bytes sent {r['bytes_sent']} vs lower bound "
            f"{r['lower_bound_bytes']} ({'equal' if ok else 'NOT EQUAL'}); state "
            f"{r['state_bytes'] / MiB:.0f} MiB"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 32 MiB state, 3 repeats")
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--mib", type=float, default=None, help="state size in MiB")
    parser.add_argument(
        "--donate",
        action="store_true",
        help="nereus gives its source state up (donate=True: kept blocks are not copied)",
    )
    args = parser.parse_args()
    mib = args.mib or (32 if args.quick else 256)
    repeats = args.repeats or (3 if args.quick else 5)
    start = time.perf_counter()
    rows = run(int(mib * MiB), repeats, donate=args.donate)
    report(rows)
    planning = plan_8b()
    at_bound = planning["bytes_sent"] == planning["lower_bound_bytes"]
    print(
        f"planning an 8B training state ({planning['tensors']} tensors), FSDP2 x TP4 (2, 4) -> "
        f"FSDP16: {planning['median_s'] * 1e3:.1f} ms median (min {planning['min_s'] * 1e3:.1f}"
        f", first {planning['first_s'] * 1e3:.1f}); {planning['remote_pieces']} remote pieces, "
        f"bytes sent {'equal' if at_bound else 'NOT EQUAL'} to the lower bound"
    )
    donated = ", nereus with donate=True" if args.donate else ""
    print(f"({mib:g} MiB state, {repeats} repeats{donated}, {time.perf_counter() - start:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            out = {"benchmark": "bench_interop", "donate": args.donate, "rows": rows}
            json.dump({**out, "plan_8b": planning}, f, indent=1)


if __name__ == "__main__":
    main()
