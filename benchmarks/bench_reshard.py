"""Effective bandwidth of reshard() against raw gloo send/recv of the same bytes.

A transformer's training state (bf16 weights, fp32 master weights, both Adam
moments) of 64 MiB .. 1 GiB is resharded across 2 or 4 local worker processes
in two scenarios (see layouts()): "resize" (tp W -> tp W/2 x pp 2 on the same
ranks: sends, receives, packing and local copies) and "sync" (training layout
on half the ranks -> a rollout layout on the other half). The baseline sends
exactly the plan's messages, one contiguous preallocated buffer per peer pair,
with plain gloo isend/irecv over the same process group; a second baseline
sends the same buffers cut into GlooTransport's chunks, and a third adds one
memcpy of the bytes a rank keeps (what any reshard must copy). All are timed from a
barrier to the slowest rank's end; the best of --repeats runs is reported, with
reshard's speed as a share of each baseline's.

    python benchmarks/bench_reshard.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import time

import torch
import torch.distributed as dist

from nereus_comm.layout import Layout, box_shape
from nereus_comm.local_workers import LocalWorkers, WorkerContext
from nereus_comm.plan import plan_reshard
from nereus_comm.reshard import Workspace, reshard
from nereus_comm.specs import transformer_state_specs
from nereus_comm.transport import GlooTransport

MiB = 2**20
MODEL = dict(hidden=384, ffn=1024, num_heads=6, num_kv_heads=3, vocab=2048)


def state_specs(target_bytes: int):
    """Transformer state specs with as many layers as bring it closest to target_bytes."""
    one = sum(s.nbytes for s in transformer_state_specs(num_layers=1, **MODEL))
    two = sum(s.nbytes for s in transformer_state_specs(num_layers=2, **MODEL))
    per_layer = two - one
    layers = max(2, round((target_bytes - (one - per_layer)) / per_layer))
    return transformer_state_specs(num_layers=layers, **MODEL), layers


SCENARIOS = ("resize", "sync")


def layouts(num_workers: int, scenario: str = "resize") -> tuple[Layout, Layout]:
    """The layout change of a scenario over ranks 0..num_workers-1.

    resize: tp W -> tp W/2 x pp 2 on the same ranks in reverse order (every rank
        sends, receives and copies locally; row-split tensors need packing).
    sync: tp W/2 on the first half of the ranks -> pp W/2 on the other half (like
        a weight sync from a training to a rollout layout: nothing is local).
    """
    ranks = tuple(range(num_workers))
    half = num_workers // 2
    if scenario == "sync":
        return Layout(1, half, 1, ranks[:half]), Layout(1, 1, half, ranks[half:])
    return Layout(1, num_workers, 1, ranks), Layout(1, half, 2, ranks[::-1])


def _allocate(specs, layout: Layout, rank: int, fill: float) -> dict[str, torch.Tensor]:
    out = {}
    if rank in layout:
        for s in specs:
            box = layout.box(s, rank)
            if box is not None:
                out[s.name] = torch.full(box_shape(box), fill, dtype=s.dtype)
    return out


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _worker(ctx: WorkerContext, target_bytes: int, scenario: str, repeats: int) -> dict:
    specs, _ = state_specs(target_bytes)
    src, dst = layouts(ctx.world_size, scenario)
    plan = plan_reshard(specs, src, dst)
    rank = ctx.rank
    transport = GlooTransport()
    shards = _allocate(specs, plan.src, rank, float(rank + 1))
    out = _allocate(specs, plan.dst, rank, 0.0)
    sends = [(m.dst, torch.ones(m.nbytes, dtype=torch.uint8)) for m in plan.sends(rank)]
    recvs = [(m.src, torch.empty(m.nbytes, dtype=torch.uint8)) for m in plan.recvs(rank)]
    timeout = datetime.timedelta(seconds=300)

    def raw() -> None:
        works = [dist.irecv(b, p) for p, b in recvs] + [dist.isend(b, p) for p, b in sends]
        for w in works:
            w.wait(timeout)

    local_bytes = sum(p.nbytes for p in plan.local_copies(rank)) if rank in plan.dst else 0
    local_src = torch.ones(local_bytes, dtype=torch.uint8)
    local_dst = torch.zeros(local_bytes, dtype=torch.uint8)

    def raw_chunked(local_copy: bool = False) -> None:
        # The same bytes, split as GlooTransport splits them; with local_copy, also one
        # memcpy of the bytes the rank keeps, while the transfers run: the least work
        # any reshard must do.
        c = transport.chunk_bytes
        works = [dist.irecv(b[i : i + c], p) for p, b in recvs for i in range(0, b.numel(), c)]
        works += [dist.isend(b[i : i + c], p) for p, b in sends for i in range(0, b.numel(), c)]
        if local_copy:
            local_dst.copy_(local_src)
        for w in works:
            w.wait(timeout)

    workspace = Workspace()  # staging reused across runs, as raw reuses its buffers

    def resharded() -> None:
        reshard(plan, rank, shards, transport, out=out, timeout=300, workspace=workspace)

    fns = [
        ("reshard_s", resharded),
        ("raw_s", raw),
        ("raw_chunked_s", raw_chunked),
        ("raw_copy_s", lambda: raw_chunked(local_copy=True)),
    ]
    times: dict[str, list[float]] = {key: [] for key, _ in fns}
    for i in range(repeats + 1):  # the first round warms pages and connections
        # Rotate the order so that no variant always runs on a warmer machine.
        k = i % len(fns)
        for key, fn in fns[k:] + fns[:k]:
            t = _timed(fn)
            if i:
                times[key].append(t)
    return times


def run(sizes_mib: list[int], workers: list[int], repeats: int) -> list[dict]:
    rows = []
    for w in workers:
        with LocalWorkers(w, timeout=600) as pool:
            for scenario, size in itertools.product(SCENARIOS, sizes_mib):
                specs, layers = state_specs(size * MiB)
                plan = plan_reshard(specs, *layouts(w, scenario))
                per_rank = pool.run(_worker, size * MiB, scenario, repeats, timeout=1200)
                # A run lasts until its slowest rank ends; best run over repeats.
                reshard_s, raw_s, chunked_s, copy_s = (
                    min(max(r[key][i] for r in per_rank) for i in range(repeats))
                    for key in ("reshard_s", "raw_s", "raw_chunked_s", "raw_copy_s")
                )
                moved = plan.stats.total_bytes
                rows.append(
                    {
                        "scenario": scenario,
                        "workers": w,
                        "state_mib": round(sum(s.nbytes for s in specs) / MiB, 1),
                        "layers": layers,
                        "tensors": len(specs),
                        "moved_mib": round(moved / MiB, 1),
                        "local_mib": round(plan.stats.local_bytes / MiB, 1),
                        "messages": plan.stats.num_messages,
                        "reshard_ms": round(reshard_s * 1e3, 1),
                        "raw_ms": round(raw_s * 1e3, 1),
                        "reshard_mib_per_s": round(moved / MiB / reshard_s, 1),
                        "raw_mib_per_s": round(moved / MiB / raw_s, 1),
                        "raw_chunked_ms": round(chunked_s * 1e3, 1),
                        "ratio_x": round(raw_s / reshard_s, 3),
                        "raw_copy_ms": round(copy_s * 1e3, 1),
                        "ratio_chunked_x": round(chunked_s / reshard_s, 3),
                        "ratio_copy_x": round(copy_s / reshard_s, 3),
                    }
                )
                r = rows[-1]
                print(
                    f"{scenario:6s} {w} workers  state {r['state_mib']:6.1f} MiB "
                    f"({r['tensors']} tensors)  moved {r['moved_mib']:6.1f} MiB  local "
                    f"{r['local_mib']:6.1f} MiB  reshard {r['reshard_ms']:8.1f} ms "
                    f"({r['reshard_mib_per_s']:7.1f} MiB/s)  raw {r['raw_ms']:8.1f} ms "
                    f"({r['raw_mib_per_s']:7.1f} MiB/s)  "
                    f"chunked {r['raw_chunked_ms']:7.1f} ms  +copy {r['raw_copy_ms']:7.1f} ms  "
                    f"reshard/raw {r['ratio_x']:.2f}  /chunked {r['ratio_chunked_x']:.2f}  "
                    f"/chunked+copy {r['ratio_copy_x']:.2f}",
                    flush=True,
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 and 256 MiB only (< 2 min)")
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    sizes = [64, 256] if args.quick else [64, 256, 1024]
    repeats = args.repeats or (2 if args.quick else 3)
    rows = run(sizes, [2, 4], repeats)
    worst = min(r["ratio_x"] for r in rows)
    worst_chunked = min(r["ratio_chunked_x"] for r in rows)
    worst_copy = min(r["ratio_copy_x"] for r in rows)
    print(
        f"reshard reaches, at worst, {worst:.0%} of raw gloo, {worst_chunked:.0%} of raw gloo "
        f"sending the same chunks, {worst_copy:.0%} of that plus the local memcpy "
        "(goal: >= 80%)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "bench_reshard", "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
