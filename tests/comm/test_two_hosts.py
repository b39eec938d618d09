"""reshard() between two hosts: two network namespaces joined by a veth pair.

Ranks 0 and 1 run in one namespace, ranks 2 and 3 in the other (see
tests/support/netns.py); gloo binds each namespace's veth end. The namespaces share
this machine's hostname and /dev/shm, so only the network namespace in
nereus_comm's host identity tells the hosts apart: bytes between them must go
over the network (no shared memory, no cross-memory attach): route="auto" sends
them over the socket route's TCP streams between the namespaces' addresses, while
the two ranks of one namespace still use the same-host routes.

Every destination shard must equal, byte for byte, the slice of the full tensor
that the test cuts itself (``torch.chunk`` along the split dim, the layer's
pipeline stage), for route="transport", "auto" and "net"; route="shm" towards the
other host is refused before any byte moves.

Run as a script (``--rank``), this file is one rank of the exchange.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import pytest
import torch

WORLD = 4
PORT = 29517  # the namespaces are fresh: nothing else listens there
HOST_OF = (0, 0, 1, 1)  # rank -> namespace


def _specs():
    from nereus_comm.layout import TensorSpec

    # Uneven shapes: chunking leaves the last tp rank a shorter piece.
    return [
        TensorSpec("emb", (515, 96), torch.bfloat16, split_dim=0, stage_key=0),
        TensorSpec("w0", (300, 260), torch.float32, split_dim=1, stage_key=0),
        TensorSpec("w1", (257, 1030), torch.float32, split_dim=0, stage_key=1),
        TensorSpec("b1", (1030,), torch.bfloat16, split_dim=0, stage_key=1),
        TensorSpec("norm", (96,), torch.float32, stage_key=1),
        TensorSpec("step", (4,), torch.int64),
    ]


def _full(spec, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if spec.dtype == torch.int64:
        return torch.randint(-(2**62), 2**62, spec.shape, generator=g, dtype=torch.int64)
    return torch.randn(spec.shape, generator=g).to(spec.dtype)


def _cut(full: torch.Tensor, spec, tp: int, t: int, pp: int, p: int) -> torch.Tensor | None:
    """Rank (stage p, tp index t)'s shard, by slicing: torch.chunk along the split dim,
    layer k of 2 on stage k * pp // 2 (None: not on that stage)."""
    if spec.stage_key is not None and spec.stage_key * pp // 2 != p:
        return None
    if spec.split_dim is None:
        return full.clone()
    chunks = full.chunk(tp, dim=spec.split_dim)
    if t < len(chunks):
        return chunks[t].clone()
    shape = list(full.shape)
    shape[spec.split_dim] = 0
    return full.new_empty(shape)


# src: tp 4 over ranks 0..3; dst: tp 2 x pp 2 over ranks 3, 2, 1, 0 (ranks[p * 2 + t]).
SRC_RANKS, DST_RANKS = (0, 1, 2, 3), (3, 2, 1, 0)


def _src_shards(full, specs, rank: int) -> dict[str, torch.Tensor]:
    t = SRC_RANKS.index(rank)
    return {s.name: _cut(full[s.name], s, 4, t, 1, 0) for s in specs}


def _dst_shards(full, specs, rank: int) -> dict[str, torch.Tensor]:
    i = DST_RANKS.index(rank)
    p, t = divmod(i, 2)
    out = {s.name: _cut(full[s.name], s, 2, t, 2, p) for s in specs}
    return {k: v for k, v in out.items() if v is not None}


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def _rank_main(rank: int, store_host: str) -> dict:
    """One rank: reshard by each route, check every byte, report what went where."""
    import torch.distributed as dist

    from nereus_comm.errors import TransportArgumentError
    from nereus_comm.layout import Layout
    from nereus_comm.plan import plan_reshard
    from nereus_comm.reshard import _net_for, _shm_for, reshard
    from nereus_comm.transport import GlooTransport

    torch.set_num_threads(1)
    store = dist.TCPStore(
        store_host, PORT, WORLD, is_master=rank == 0, timeout=datetime.timedelta(seconds=60)
    )
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60)
    )
    specs = _specs()
    full = {s.name: _full(s, 1000 + i) for i, s in enumerate(specs)}
    plan = plan_reshard(specs, Layout(1, 4, 1, SRC_RANKS), Layout(1, 2, 2, DST_RANKS))
    transport = GlooTransport()
    expected = _dst_shards(full, specs, rank)
    report: dict = {"rank": rank, "routes": {}}
    same_host = {p for p in range(WORLD) if HOST_OF[p] == HOST_OF[rank] and p != rank}
    to_same = sum(m.nbytes for m in plan.sends(rank) if m.dst in same_host)
    to_other = sum(m.nbytes for m in plan.sends(rank) if m.dst != rank and m.dst not in same_host)
    # The second round of each: warm (streams and segments set up, plans cached).
    for route in ("transport", "auto", "net", "transport", "auto", "net"):
        res = reshard(plan, rank, _src_shards(full, specs, rank), transport, route=route)
        wrong = sorted(
            n
            for n, t in expected.items()
            if n not in res.tensors or not _same_bytes(res.tensors[n], t)
        )
        extra = sorted(set(res.tensors) - set(expected))
        report["routes"].setdefault(route, []).append(
            {
                "wrong": wrong,
                "extra": extra,
                "bytes_sent": res.bytes_sent,
                "same_host_routes_sent": res.shm_bytes_sent + res.cma_bytes_sent,
                "to_same_host": to_same,
                "net_sent": res.net_bytes_sent,
                "to_other_host": to_other,
                "fallback": {str(k): v for k, v in res.fallback_reasons.items()},
            }
        )
    net = _net_for(transport)
    # The streams' far ends: the other namespace's address, never anything else.
    report["stream_peers"] = sorted(
        {s.getpeername()[0] for p, s in net._streams.items() if HOST_OF[p] != HOST_OF[rank]}
    )
    shm = _shm_for(transport)
    report["same_host"] = {str(p): shm.same_host(p) for p in sorted(plan_peers(plan, rank))}
    try:
        reshard(plan, rank, _src_shards(full, specs, rank), transport, route="shm")
        report["shm_refused"] = None
    except TransportArgumentError as e:
        report["shm_refused"] = str(e)
    dist.barrier()
    dist.destroy_process_group()
    return report


def plan_peers(plan, rank: int) -> set[int]:
    """The ranks this rank exchanges bytes with."""
    return {m.dst for m in plan.sends(rank)} | {m.src for m in plan.recvs(rank)}


@pytest.fixture(scope="module")
def hosts():
    from support.netns import netns_unavailable, two_hosts

    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    with two_hosts() as h:
        yield h


@pytest.mark.slow
def test_reshard_between_two_hosts_is_exact_and_uses_the_transport_across(hosts):
    import subprocess

    procs = [
        hosts.popen(
            HOST_OF[r],
            [sys.executable, __file__, "--rank", str(r), "--store", hosts.addresses[0]],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(WORLD)
    ]
    reports = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, err[-4000:]
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rep in reports:
        rank = rep["rank"]
        for route, rounds in rep["routes"].items():
            for r in rounds:
                assert r["wrong"] == [] and r["extra"] == [], (rank, route, r)
                if route == "transport":
                    assert r["same_host_routes_sent"] == 0 and r["net_sent"] == 0, (rank, r)
                elif route == "net":
                    assert r["same_host_routes_sent"] == 0, (rank, r)
                    assert r["net_sent"] == r["bytes_sent"], (rank, r)
                else:
                    # auto: the same-host peer's bytes by shm/cma, the other host's by gloo.
                    assert r["same_host_routes_sent"] == r["to_same_host"], (rank, r)
                    assert r["net_sent"] == r["to_other_host"], (rank, r)
                    for peer, why in r["fallback"].items():
                        if HOST_OF[int(peer)] != HOST_OF[rank]:
                            parts = [x.split(": ", 1)[1] for x in why.split("; ")]
                            assert set(parts) == {"another host"}, (rank, peer, why)
        for peer, same in rep["same_host"].items():
            # None: never asked (cross-memory attach took all of that peer's bytes).
            want = HOST_OF[int(peer)] == HOST_OF[rank]
            assert same is want or (want and same is None), (rank, peer, same)
        other = hosts.addresses[1 - HOST_OF[rank]]
        assert rep["stream_peers"] in ([], [other]), (rank, rep["stream_peers"])
        assert rep["shm_refused"] and "shared memory" in rep["shm_refused"], rep["shm_refused"]
    # Every rank sent through the transport exactly what went to the other host.
    assert sum(r["routes"]["transport"][0]["bytes_sent"] for r in reports) > 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--store", required=True, help="the store's host (rank 0's address)")
    args = ap.parse_args()
    print(json.dumps(_rank_main(args.rank, args.store)), flush=True)


if __name__ == "__main__":
    main()
