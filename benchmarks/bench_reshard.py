"""Effective bandwidth of reshard() against raw gloo send/recv of the same bytes.

A transformer's training state (bf16 weights, fp32 master weights, both Adam
moments) of 64 MiB .. 1 GiB is resharded across 2 or 4 local worker processes
in two scenarios (see layouts()): "resize" (tp W -> tp W/2 x pp 2 on the same
ranks: sends, receives, packing and local copies) and "sync" (training layout
on half the ranks -> a rollout layout on the other half: nothing is local).

Three reshard variants: "reshard" (route="transport": every byte through the
GlooTransport), "shm" (route="shm": the workers share this host, so
every byte goes through shared-memory segments, packed straight into them; see
nereus_comm.transport_shm) and "cma" (route="cma": each receiver reads the
senders' shards straight into its own by cross-memory attach, one copy; see
nereus_comm.transport_cma; route="auto" picks it for a peer pair whose bytes flow
one way in long runs, here sync on 2 workers only). A fourth, "auto" (route="auto",
in a process group of its own so that no other variant's segments serve it),
shows which route the default takes on a repeated reshard (its MiB by cma and by
shm, per call) and how it compares with the forced routes, and with the faster of
them per case (goal: within 10%, i.e. >= 0.9x). Baselines, run in the
same worker pool and the same process group, interleaved with both round by round
(the order rotates every round):

- raw: for every peer pair of the plan, its message's bytes as ONE contiguous
  preallocated buffer, plain dist.isend/irecv; no packing, no local copy.
- raw_copy: raw plus one memcpy of the bytes the rank keeps (the plan's local
  copies, as one contiguous block) while the transfers run: the least work any
  reshard must do. Equal to raw where nothing is local (sync).
- raw_shm: the same contiguous buffers through ShmTransport (copied into the
  peer's segment and out of it: two memcpys, no packing) plus raw_copy's local
  memcpy while they travel: the floor for reshard over shared memory.

Each run is timed from a barrier to the slowest rank's end (wall) and by the
CPU seconds of all ranks' processes together (every thread, kernel time
included): on a shared, loaded machine the wall time mostly measures the
other tenants, the CPU time what the work costs. Ratios are per round (the
variants of a round ran back to back), then the median and the min..max over
rounds. MiB/s counts the bytes sent between ranks only, not the local copies.

With ``--hosts netns`` (Linux, root) the workers run on two "hosts" instead: two
network namespaces joined by a veth pair that the benchmark makes and removes
(tests/support/netns.py), half of the ranks in each, gloo bound to the veth ends.
nereus_comm sees two hosts there, so bytes between them can only take the
transport: reshard(route="transport") and route="auto" are compared with raw gloo
between the same processes (the same-host variants do not apply).

    python benchmarks/bench_reshard.py [--quick] [--json PATH] [--repeats N] [--hosts netns]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from nereus_comm.layout import Layout, box_shape
from nereus_comm.plan import plan_reshard
from nereus_comm.reshard import Workspace, reshard
from nereus_comm.specs import transformer_state_specs
from nereus_comm.testing import LocalWorkers, WorkerContext
from nereus_comm.transport import GlooTransport
from nereus_comm.transport_shm import ShmTransport

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
VARIANTS = ("reshard", "net", "shm", "cma", "auto", "raw", "raw_copy", "raw_shm")


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


def _worker(
    ctx: WorkerContext,
    target_bytes: int,
    scenario: str,
    repeats: int,
    variants: tuple[str, ...] = VARIANTS,
) -> dict:
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
    local_bytes = sum(p.nbytes for p in plan.local_copies(rank)) if rank in plan.dst else 0
    local_src = torch.ones(local_bytes, dtype=torch.uint8)
    local_dst = torch.zeros(local_bytes, dtype=torch.uint8)

    def raw(local_copy: bool = False) -> None:
        works = [dist.irecv(b, p) for p, b in recvs] + [dist.isend(b, p) for p, b in sends]
        if local_copy and local_bytes:
            local_dst.copy_(local_src)
        for w in works:
            w.wait(timeout)

    workspace = Workspace()  # staging reused across runs, as raw reuses its buffers

    def shm_copy() -> None:
        pending = raw_shm.start(sends, recvs, timeout=300)  # the sends are written here
        if local_bytes:
            local_dst.copy_(local_src)
        pending.wait()

    # Its own segments, set up in the warm-up round (same-host variants only).
    raw_shm = ShmTransport(transport) if "raw_shm" in variants else None

    last = {}
    # route="auto" over its own group: its own CmaRoute and segments.
    auto_transport = GlooTransport(dist.new_group(ranks=list(range(ctx.world_size))))
    auto_routes = []

    def resharded(route: str = "transport") -> None:
        last[route] = reshard(
            plan, rank, shards, transport, out=out, timeout=300, workspace=workspace, route=route
        )

    def auto() -> None:
        res = reshard(plan, rank, shards, auto_transport, out=out, timeout=300,
                      workspace=workspace)  # fmt: skip
        auto_routes.append((res.cma_bytes_sent, res.shm_bytes_sent))

    fns = [
        ("reshard", resharded),
        ("net", lambda: resharded("net")),
        ("shm", lambda: resharded("shm")),
        ("cma", lambda: resharded("cma")),
        ("auto", auto),
        ("raw", raw),
        ("raw_copy", lambda: raw(local_copy=True)),
        ("raw_shm", shm_copy),
    ]
    fns = [(key, fn) for key, fn in fns if key in variants]
    times: dict[str, list[tuple[float, float]]] = {key: [] for key, _ in fns}
    for i in range(repeats + 1):  # the first round warms pages, connections, the plan cache
        # Rotate the order so that no variant always runs on a warmer machine.
        k = i % len(fns)
        for key, fn in fns[k:] + fns[:k]:
            dist.barrier()
            cpu, start = time.process_time(), time.perf_counter()
            fn()
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            if i:
                times[key].append((wall, cpu))
    res = last["transport"]
    shm, cma, net = last.get("shm"), last.get("cma"), last.get("net")
    times["counts"] = [
        (
            res.buffers_sent,
            res.staged_bytes_sent + res.staged_bytes_received,
            res.bytes_local,
            shm.shm_bytes_sent if shm is not None else 0,
            cma.cma_bytes_sent if cma is not None else 0,
            net.net_bytes_sent if net is not None else 0,
        )
    ]
    times["auto_routes"] = auto_routes  # (cma, shm) bytes sent per call, warm-up first
    return times


def _stats(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def run(sizes_mib: list[int], workers: list[int], repeats: int) -> list[dict]:
    rows = []
    for w in workers:
        with LocalWorkers(w, timeout=600) as pool:
            for scenario, size in itertools.product(SCENARIOS, sizes_mib):
                specs, layers = state_specs(size * MiB)
                plan = plan_reshard(specs, *layouts(w, scenario))
                per_rank = pool.run(_worker, size * MiB, scenario, repeats, timeout=1200)
                # A run lasts until its slowest rank ends; its CPU is every rank's.
                wall = {
                    k: [max(r[k][i][0] for r in per_rank) for i in range(repeats)] for k in VARIANTS
                }
                cpu = {
                    k: [sum(r[k][i][1] for r in per_rank) for i in range(repeats)] for k in VARIANTS
                }

                def ratio(base: str, d: dict, of: str) -> tuple[float, float, float]:
                    return _stats([b / a for a, b in zip(d[of], d[base])])

                moved = plan.stats.total_bytes
                row = {
                    "scenario": scenario,
                    "workers": w,
                    "state_mib": round(sum(s.nbytes for s in specs) / MiB, 1),
                    "layers": layers,
                    "tensors": len(specs),
                    "moved_mib": round(moved / MiB, 1),
                    "local_mib": round(plan.stats.local_bytes / MiB, 1),
                    "messages": plan.stats.num_messages,
                    # gloo sends (before chunking) and bytes packed or unpacked, all ranks.
                    "wire_buffers": sum(r["counts"][0][0] for r in per_rank),
                    "staged_mib": round(sum(r["counts"][0][1] for r in per_rank) / MiB, 1),
                    # bytes the shm variant moved through shared memory (all of them here).
                    "shm_mib": round(sum(r["counts"][0][3] for r in per_rank) / MiB, 1),
                    "cma_mib": round(sum(r["counts"][0][4] for r in per_rank) / MiB, 1),
                    "net_mib": round(sum(r["counts"][0][5] for r in per_rank) / MiB, 1),
                    # route="auto", per call (warm-up first): MiB by cma, MiB by shm.
                    "auto_calls_mib": [
                        [
                            round(sum(r["auto_routes"][i][j] for r in per_rank) / MiB, 1)
                            for j in (0, 1)
                        ]
                        for i in range(repeats + 1)
                    ],
                    "repeats": repeats,
                }
                for k in VARIANTS:
                    med, lo, hi = _stats(wall[k])
                    row[f"{k}_ms"] = round(med * 1e3, 1)
                    row[f"{k}_ms_min"] = round(lo * 1e3, 1)
                    row[f"{k}_ms_max"] = round(hi * 1e3, 1)
                    row[f"{k}_cpu_ms"] = round(statistics.median(cpu[k]) * 1e3, 1)
                    row[f"{k}_mib_per_s"] = round(moved / MiB / med, 1)
                for name, base, d, of in (
                    ("ratio_x", "raw", wall, "reshard"),
                    ("ratio_copy_x", "raw_copy", wall, "reshard"),
                    ("cpu_ratio_x", "raw", cpu, "reshard"),
                    ("cpu_ratio_copy_x", "raw_copy", cpu, "reshard"),
                    ("shm_ratio_x", "raw", wall, "shm"),
                    ("shm_ratio_copy_x", "raw_copy", wall, "shm"),
                    ("shm_cpu_ratio_x", "raw", cpu, "shm"),
                    ("shm_cpu_ratio_copy_x", "raw_copy", cpu, "shm"),
                    ("shm_ratio_rawshm_x", "raw_shm", wall, "shm"),
                    ("shm_cpu_ratio_rawshm_x", "raw_shm", cpu, "shm"),
                    # > 1: shared memory faster than reshard over gloo.
                    ("shm_vs_gloo_x", "reshard", wall, "shm"),
                    ("shm_vs_gloo_cpu_x", "reshard", cpu, "shm"),
                    ("net_ratio_x", "raw", wall, "net"),
                    ("net_ratio_copy_x", "raw_copy", wall, "net"),
                    ("net_cpu_ratio_x", "raw", cpu, "net"),
                    ("net_cpu_ratio_copy_x", "raw_copy", cpu, "net"),
                    # > 1: the socket route faster than reshard over gloo.
                    ("net_vs_gloo_x", "reshard", wall, "net"),
                    ("cma_ratio_x", "raw", wall, "cma"),
                    ("cma_cpu_ratio_x", "raw", cpu, "cma"),
                    # > 1: cross-memory attach faster than shared memory.
                    ("cma_vs_shm_x", "shm", wall, "cma"),
                    ("cma_vs_shm_cpu_x", "shm", cpu, "cma"),
                    # > 1: route="auto" (repeated) faster than forced shm / cma.
                    ("auto_vs_shm_x", "shm", wall, "auto"),
                    ("auto_vs_shm_cpu_x", "shm", cpu, "auto"),
                    ("auto_vs_cma_x", "cma", wall, "auto"),
                    ("auto_vs_cma_cpu_x", "cma", cpu, "auto"),
                ):
                    med, lo, hi = ratio(base, d, of)
                    row[name] = round(med, 3)
                    row[f"{name}_min"] = round(lo, 3)
                    row[f"{name}_max"] = round(hi, 3)
                # > 1: route="auto" faster than the faster forced route of this case (the
                # one of lower median wall; a per-round minimum of two noisy routes would
                # favour the baseline by the noise alone).
                best = min(("shm", "cma", "net"), key=lambda k: statistics.median(wall[k]))
                med, lo, hi = ratio(best, wall, "auto")
                row["auto_best_route"] = best
                row["auto_vs_best_x"] = round(med, 3)
                row["auto_vs_best_x_min"] = round(lo, 3)
                row["auto_vs_best_x_max"] = round(hi, 3)
                rows.append(row)
                r = row
                print(
                    f"{scenario:6s} {w}w state {r['state_mib']:6.1f} MiB moved "
                    f"{r['moved_mib']:6.1f} local {r['local_mib']:6.1f} staged "
                    f"{r['staged_mib']:6.1f}"
                    f" in {r['messages']} msgs/{r['wire_buffers']} bufs | wall ms med "
                    f"[min-max]: reshard {r['reshard_ms']:.0f} [{r['reshard_ms_min']:.0f}-"
                    f"{r['reshard_ms_max']:.0f}] raw {r['raw_ms']:.0f} [{r['raw_ms_min']:.0f}-"
                    f"{r['raw_ms_max']:.0f}] raw+copy {r['raw_copy_ms']:.0f} | cpu ms: reshard "
                    f"{r['reshard_cpu_ms']:.0f} raw {r['raw_cpu_ms']:.0f} raw+copy "
                    f"{r['raw_copy_cpu_ms']:.0f} | reshard/raw wall {r['ratio_x']:.2f} "
                    f"[{r['ratio_x_min']:.2f}-{r['ratio_x_max']:.2f}] cpu {r['cpu_ratio_x']:.2f}"
                    f" | /raw+copy wall {r['ratio_copy_x']:.2f} cpu {r['cpu_ratio_copy_x']:.2f}",
                    flush=True,
                )
                print(
                    f"{'':6s} {w}w shm: {r['shm_mib']:.1f} MiB through shared memory | wall ms "
                    f"{r['shm_ms']:.0f} [{r['shm_ms_min']:.0f}-{r['shm_ms_max']:.0f}] cpu ms "
                    f"{r['shm_cpu_ms']:.0f} | shm/raw wall {r['shm_ratio_x']:.2f} "
                    f"[{r['shm_ratio_x_min']:.2f}-{r['shm_ratio_x_max']:.2f}] cpu "
                    f"{r['shm_cpu_ratio_x']:.2f} | /raw+copy wall {r['shm_ratio_copy_x']:.2f} "
                    f"cpu {r['shm_cpu_ratio_copy_x']:.2f} | raw shm {r['raw_shm_ms']:.0f} ms, "
                    f"cpu {r['raw_shm_cpu_ms']:.0f} ms, shm/raw shm wall "
                    f"{r['shm_ratio_rawshm_x']:.2f} cpu {r['shm_cpu_ratio_rawshm_x']:.2f} | "
                    f"shm vs reshard(gloo) wall "
                    f"{r['shm_vs_gloo_x']:.2f} cpu {r['shm_vs_gloo_cpu_x']:.2f}",
                    flush=True,
                )
                print(
                    f"{'':6s} {w}w net: {r['net_mib']:.1f} MiB over the socket route | wall ms "
                    f"{r['net_ms']:.0f} [{r['net_ms_min']:.0f}-{r['net_ms_max']:.0f}] cpu ms "
                    f"{r['net_cpu_ms']:.0f} | net/raw wall {r['net_ratio_x']:.2f} "
                    f"[{r['net_ratio_x_min']:.2f}-{r['net_ratio_x_max']:.2f}] cpu "
                    f"{r['net_cpu_ratio_x']:.2f} | /raw+copy wall {r['net_ratio_copy_x']:.2f} "
                    f"cpu {r['net_cpu_ratio_copy_x']:.2f} | net vs reshard(gloo) wall "
                    f"{r['net_vs_gloo_x']:.2f}",
                    flush=True,
                )
                print(
                    f"{'':6s} {w}w cma: {r['cma_mib']:.1f} MiB by cross-memory attach | wall ms "
                    f"{r['cma_ms']:.0f} [{r['cma_ms_min']:.0f}-{r['cma_ms_max']:.0f}] cpu ms "
                    f"{r['cma_cpu_ms']:.0f} | cma/raw wall {r['cma_ratio_x']:.2f} cpu "
                    f"{r['cma_cpu_ratio_x']:.2f} | cma vs shm wall {r['cma_vs_shm_x']:.2f} "
                    f"[{r['cma_vs_shm_x_min']:.2f}-{r['cma_vs_shm_x_max']:.2f}] cpu "
                    f"{r['cma_vs_shm_cpu_x']:.2f}",
                    flush=True,
                )
                print(
                    f"{'':6s} {w}w auto: [cma, shm] MiB per call {r['auto_calls_mib']} | wall ms "
                    f"{r['auto_ms']:.0f} [{r['auto_ms_min']:.0f}-{r['auto_ms_max']:.0f}] cpu ms "
                    f"{r['auto_cpu_ms']:.0f} | auto vs shm wall {r['auto_vs_shm_x']:.2f} "
                    f"[{r['auto_vs_shm_x_min']:.2f}-{r['auto_vs_shm_x_max']:.2f}] cpu "
                    f"{r['auto_vs_shm_cpu_x']:.2f} | auto vs cma wall {r['auto_vs_cma_x']:.2f} "
                    f"[{r['auto_vs_cma_x_min']:.2f}-{r['auto_vs_cma_x_max']:.2f}] cpu "
                    f"{r['auto_vs_cma_cpu_x']:.2f} | auto vs the best forced route "
                    f"({r['auto_best_route']}) wall {r['auto_vs_best_x']:.2f}",
                    flush=True,
                )
    return rows


#: The variants that apply between hosts (no shared memory, no cross-memory attach).
NETNS_VARIANTS = ("reshard", "net", "auto", "raw", "raw_copy")
_NETNS_PORT = 29531  # in a namespace of the benchmark's own: nothing else listens there


def _netns_rank(rank: int, world: int, store_host: str, cases: list, repeats: int) -> None:
    """One rank on one of the two hosts: every case's timings as JSON on stdout."""
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=600)
    store = dist.TCPStore(store_host, _NETNS_PORT, world, is_master=rank == 0, timeout=timeout)
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=world, timeout=timeout
    )
    ctx = WorkerContext(rank, world, store)
    out = [_worker(ctx, size * MiB, scenario, repeats, NETNS_VARIANTS) for scenario, size in cases]
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(out), flush=True)


def run_netns(sizes_mib: list[int], workers: list[int], repeats: int) -> list[dict]:
    """reshard (transport, auto) vs raw gloo between two network namespaces."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.support.netns import netns_unavailable, two_hosts

    reason = netns_unavailable()
    if reason:
        raise SystemExit(f"--hosts netns: {reason}")
    cases = list(itertools.product(SCENARIOS, sizes_mib))
    rows = []
    for w in workers:
        with two_hosts() as hosts:
            procs = [
                hosts.popen(
                    0 if r < w // 2 else 1,
                    [
                        sys.executable,
                        os.path.abspath(__file__),
                        "--netns-rank",
                        str(r),
                        "--netns-world",
                        str(w),
                        "--netns-store",
                        hosts.addresses[0],
                        "--netns-cases",
                        json.dumps(cases),
                        "--repeats",
                        str(repeats),
                    ],
                    stdout=subprocess.PIPE,
                    text=True,
                    env={"OMP_NUM_THREADS": "1"},
                )
                for r in range(w)
            ]
            try:
                per_rank = []
                for p in procs:
                    out, _ = p.communicate(timeout=1800)
                    if p.returncode:
                        raise RuntimeError(f"a rank on the namespaces failed ({p.returncode})")
                    per_rank.append(json.loads(out.strip().splitlines()[-1]))
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
        for i, (scenario, size) in enumerate(cases):
            res = [r[i] for r in per_rank]
            specs, _ = state_specs(size * MiB)
            plan = plan_reshard(specs, *layouts(w, scenario))
            wall = {
                k: [max(r[k][j][0] for r in res) for j in range(repeats)] for k in NETNS_VARIANTS
            }
            cpu = {
                k: [sum(r[k][j][1] for r in res) for j in range(repeats)] for k in NETNS_VARIANTS
            }
            row = {
                "hosts": "netns",
                "scenario": scenario,
                "workers": w,
                "moved_mib": round(plan.stats.total_bytes / MiB, 1),
                "local_mib": round(plan.stats.local_bytes / MiB, 1),
                "repeats": repeats,
            }
            for k in NETNS_VARIANTS:
                med, lo, hi = _stats(wall[k])
                row[f"{k}_ms"], row[f"{k}_ms_min"], row[f"{k}_ms_max"] = (
                    round(med * 1e3, 1),
                    round(lo * 1e3, 1),
                    round(hi * 1e3, 1),
                )
                row[f"{k}_cpu_ms"] = round(statistics.median(cpu[k]) * 1e3, 1)
            for name, base, d, of in (
                ("ratio_x", "raw", wall, "reshard"),
                ("ratio_copy_x", "raw_copy", wall, "reshard"),
                ("cpu_ratio_x", "raw", cpu, "reshard"),
                ("auto_ratio_x", "raw", wall, "auto"),
                ("net_ratio_x", "raw", wall, "net"),
                ("net_ratio_copy_x", "raw_copy", wall, "net"),
                ("net_cpu_ratio_x", "raw", cpu, "net"),
            ):
                med, lo, hi = _stats([b / a for a, b in zip(d[of], d[base])])
                row[name], row[f"{name}_min"], row[f"{name}_max"] = (
                    round(med, 3),
                    round(lo, 3),
                    round(hi, 3),
                )
            rows.append(row)
            r = row
            print(
                f"netns {scenario:6s} {w}w {size:4d} MiB moved {r['moved_mib']:6.1f} local "
                f"{r['local_mib']:6.1f} | wall ms med [min-max]: reshard {r['reshard_ms']:.0f} "
                f"[{r['reshard_ms_min']:.0f}-{r['reshard_ms_max']:.0f}] net {r['net_ms']:.0f} "
                f"[{r['net_ms_min']:.0f}-{r['net_ms_max']:.0f}] auto {r['auto_ms']:.0f} "
                f"raw {r['raw_ms']:.0f} [{r['raw_ms_min']:.0f}-{r['raw_ms_max']:.0f}] raw+copy "
                f"{r['raw_copy_ms']:.0f} | reshard/raw wall {r['ratio_x']:.2f} "
                f"[{r['ratio_x_min']:.2f}-{r['ratio_x_max']:.2f}] cpu {r['cpu_ratio_x']:.2f} | "
                f"/raw+copy wall {r['ratio_copy_x']:.2f} | net/raw wall {r['net_ratio_x']:.2f} "
                f"[{r['net_ratio_x_min']:.2f}-{r['net_ratio_x_max']:.2f}] cpu "
                f"{r['net_cpu_ratio_x']:.2f} | auto/raw wall {r['auto_ratio_x']:.2f}",
                flush=True,
            )
    for key, what in (("ratio_x", "reshard(gloo)"), ("net_ratio_x", "reshard(net)"),
                      ("auto_ratio_x", "reshard(auto)")):  # fmt: skip
        for scenario in SCENARIOS:
            got = [r[key] for r in rows if r["scenario"] == scenario]
            print(
                f"netns {scenario:6s} {what} speed as a share of wall vs raw: medians "
                f"{min(got):.0%}..{max(got):.0%} (goal: >= 80%)"
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 and 256 MiB only (< 2 min)")
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--hosts",
        choices=("local", "netns"),
        default="local",
        help="local: one host (default); netns: two network namespaces as two hosts (root)",
    )
    # One rank of --hosts netns (started by the benchmark inside a namespace).
    parser.add_argument("--netns-rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--netns-world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--netns-store", help=argparse.SUPPRESS)
    parser.add_argument("--netns-cases", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [64, 256] if args.quick else [64, 256, 1024]
    repeats = args.repeats or (11 if args.quick else 9)
    if args.netns_rank is not None:
        cases = [tuple(c) for c in json.loads(args.netns_cases)]
        _netns_rank(args.netns_rank, args.netns_world, args.netns_store, cases, repeats)
        return
    if args.hosts == "netns":
        rows = run_netns(sizes, [2, 4], repeats)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {"benchmark": "bench_reshard", "hosts": "netns", "rows": rows}, f, indent=2
                )
        return
    rows = run(sizes, [2, 4], repeats)
    for variant, prefix in (
        ("reshard(gloo)", ""),
        ("reshard(net)", "net_"),
        ("reshard(shm)", "shm_"),
        ("reshard(cma)", "cma_"),
    ):
        for key, what in (
            ("ratio_x", "wall vs raw"),
            *([] if prefix == "cma_" else [("ratio_copy_x", "wall vs raw + local copy")]),
            ("cpu_ratio_x", "CPU vs raw"),
            *([] if prefix == "cma_" else [("cpu_ratio_copy_x", "CPU vs raw + local copy")]),
            *(
                [("ratio_rawshm_x", "wall vs raw shm"), ("cpu_ratio_rawshm_x", "CPU vs raw shm")]
                if prefix == "shm_"
                else []
            ),
        ):
            for scenario in SCENARIOS:
                got = [r[prefix + key] for r in rows if r["scenario"] == scenario]
                print(
                    f"{scenario:6s} {variant} speed as a share of {what}: medians "
                    f"{min(got):.0%}..{max(got):.0%} (goal: >= 80%)"
                )
    got = [r["auto_vs_best_x"] for r in rows]
    print(
        f"route='auto' speed against the best forced route of each case (wall): medians "
        f"{min(got):.2f}x..{max(got):.2f}x (goal: >= 0.9x)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "bench_reshard", "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
