"""reshard() by cross-memory attach (process_vm_readv) across 4 local gloo processes.

Every destination shard must equal (torch.equal) the slice of the full tensor, for
dp, tp and pp changes, strided pieces of thousands of rows (several 1,024-iovec
batches, two reading threads) and repeated calls; the bytes each route moved are
checked against the plan. The fallback is real: a sender that is not dumpable,
read by processes without CAP_SYS_PTRACE, makes the kernel answer EPERM, and
route="auto" must then take shared memory for that direction only.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
from test_reshard import _fixed_cases, _full_state, _random_cases, cma_ok

from nereus_comm import _C
from nereus_comm.layout import Layout, TensorSpec
from nereus_comm.plan import plan_reshard
from nereus_comm.reshard import (
    _CMA,
    _SHM,
    CMA_MIN_RUN_BYTES,
    DIRECT_MIN_BYTES,
    reshard,
    shards_from_full,
)
from nereus_comm.reshard_program import program
from nereus_comm.testing import LocalWorkers, WorkerContext
from nereus_comm.transport import GlooTransport, TransportArgumentError
from nereus_comm.transport_cma import CMA_ENV
from nereus_comm.transport_shm import HOST_ENV

# Multi-process: out of the fast lane (-m "not slow").
pytestmark = pytest.mark.slow

WORLD = 4


@pytest.fixture(scope="module")
def pool():
    with LocalWorkers(WORLD, timeout=60) as p:
        if not cma_ok(p):
            pytest.skip("the kernel forbids cross-memory attach between these workers")
        yield p


THP = os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")


def _fresh_group(ctx: WorkerContext, host: str | None = None) -> GlooTransport:
    # A new group: a new CmaRoute (kept per group) that probes its peers anew.
    os.environ.pop(CMA_ENV, None)
    if host is None:
        os.environ.pop(HOST_ENV, None)
    else:
        os.environ[HOST_ENV] = host
    return GlooTransport(dist.new_group(ranks=list(range(ctx.world_size))))


def _big_cases() -> list[tuple]:
    # Split on dim 1: every piece is 3,000 strided rows (several iovec batches) and a
    # peer's bytes (> 512 KiB) are read by two threads.
    specs = [
        TensorSpec("w", (3000, 96), torch.float32, 1, 0),
        TensorSpec("b", (96,), torch.bfloat16, 0, 1),
        TensorSpec("m", (257, 33), torch.float32, 0, 1),
    ]
    L = lambda dp, tp, pp, ranks: Layout(dp, tp, pp, tuple(ranks), num_layers=2)  # noqa: E731
    return [
        (specs, L(1, 2, 1, [0, 1]), L(1, 3, 1, [3, 2, 1])),  # tp 2 -> 3
        (specs, L(1, 2, 2, [0, 1, 2, 3]), L(2, 2, 1, [3, 2, 1, 0])),  # pp 2 -> dp 2
        (specs, L(1, 1, 1, [0]), L(4, 1, 1, [3, 2, 1, 0])),  # dp 1 -> 4
    ]


def _routes(res) -> tuple[int, int, int, int]:
    return res.cma_bytes_sent, res.cma_bytes_received, res.shm_bytes_sent, res.shm_bytes_received


def _cma_cases(ctx: WorkerContext, seed: int) -> list[dict]:
    transport = _fresh_group(ctx)
    cases = _fixed_cases() + _big_cases() + _random_cases(seed, 6)
    out = []
    for k, (specs, src, dst, *more) in enumerate(cases):
        dst_specs = more[0] if more else specs
        plan = plan_reshard(specs, src, dst, dst_specs=dst_specs if more else None)
        row = {"bad": [], "routes": [], "probe_rounds": []}
        for call in range(2):  # the second call spends no probe round
            full = _full_state(specs, seed + 10 * k + call)
            mine = shards_from_full(full, specs, plan.src, ctx.rank)
            res = reshard(plan, ctx.rank, mine, transport, timeout=30, route="cma")
            want = shards_from_full(full, dst_specs, plan.dst, ctx.rank)
            row["names_ok"] = sorted(res.tensors) == sorted(want)
            row["bad"] += [n for n in want if not torch.equal(res.tensors[n], want[n])]
            row["routes"].append(_routes(res))
            row["plan"] = (res.bytes_sent, res.bytes_received, 0, 0)
            cma = _CMA.get(transport.connection_key())
            row["probe_rounds"].append(0 if cma is None else cma.probe_rounds)
        out.append(row)
    return {"rows": out, "shm": _SHM.get(transport.connection_key()) is not None}


def test_cma_route_exact_for_dp_tp_pp_changes(pool) -> None:
    for r, res in enumerate(pool.run(_cma_cases, 11)):
        assert not res["shm"], f"rank {r}: a shared-memory segment was made"
        for k, row in enumerate(res["rows"]):
            where = f"rank {r} case {k}"
            assert row["names_ok"] and not row["bad"], f"{where}: wrong bytes in {row['bad']}"
            assert all(x == row["plan"] for x in row["routes"]), f"{where}: {row}"
            # Probed once per peer: two rounds each time new peers show up, at most
            # WORLD - 1 times, and never on a repeated call.
            assert row["probe_rounds"][0] == row["probe_rounds"][1], f"{where}: {row}"
        assert res["rows"][-1]["probe_rounds"][-1] <= 2 * (WORLD - 1), res["rows"][-1]


# -- a real EPERM: the fallback -------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_DUMPABLE = 4
_CAP_SYS_PTRACE = 19


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]  # fmt: skip


def _ptrace_cap(on: bool | None) -> bool:
    """Set CAP_SYS_PTRACE in the effective set (None: leave it); return whether it was."""
    header, data = _CapHeader(0x20080522, 0), (_CapData * 2)()
    if _libc.capget(ctypes.byref(header), data) != 0:
        return False
    bit = 1 << _CAP_SYS_PTRACE
    was = bool(data[0].effective & bit)
    if on is not None:
        data[0].effective = (data[0].effective | bit) if on else (data[0].effective & ~bit)
        _libc.capset(ctypes.byref(header), data)
    return was


def _eperm(ctx: WorkerContext) -> dict:
    # Rank 1 becomes undumpable and nobody may override that: reading rank 1 fails
    # with EPERM, so its sends take shared memory; every other direction stays on CMA.
    # A rotation: every pair's bytes flow one way, as route="auto" reads by CMA.
    had_cap = _ptrace_cap(False)
    if ctx.rank == 1:
        _libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    try:
        transport = _fresh_group(ctx)
        # Long runs (64 KiB blocks): route="auto" reads them by CMA where it may.
        specs = [TensorSpec("w", (4096, 16), torch.float32, 0, None)]
        ranks = tuple(range(ctx.world_size))
        plan = plan_reshard(specs, Layout(1, 4, 1, ranks), Layout(1, 4, 1, _rotated(ranks)))
        rows = []
        for call in range(2):
            full = _full_state(specs, 70 + call)
            mine = shards_from_full(full, specs, plan.src, ctx.rank)
            res = reshard(plan, ctx.rank, mine, transport, timeout=30)
            want = shards_from_full(full, specs, plan.dst, ctx.rank)
            rows.append(all(torch.equal(res.tensors[n], want[n]) for n in want))
        peers = (plan.sends(ctx.rank)[0].dst, plan.recvs(ctx.rank)[0].src)
        # Forced CMA refuses on the ranks that cannot read or be read; with pairs that
        # swap (0 <-> 3, 1 <-> 2) the other pair completes.
        plan = plan_reshard(specs, Layout(1, 4, 1, ranks), Layout(1, 4, 1, ranks[::-1]))
        mine = shards_from_full(full, specs, plan.src, ctx.rank)
        try:
            reshard(plan, ctx.rank, mine, transport, timeout=30, route="cma")
            forced = "no error"
        except TransportArgumentError as e:
            forced = str(e)
    finally:
        if ctx.rank == 1:
            _libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
        _ptrace_cap(had_cap)
    return {
        "equal": rows,
        "routes": _routes(res),
        "total": (res.bytes_sent, res.bytes_received),
        "reasons": res.fallback_reasons,
        "forced": forced,
        "peers": peers,
    }


def test_eperm_falls_back_to_shared_memory_per_direction(pool) -> None:
    for r, res in enumerate(pool.run(_eperm)):
        assert all(res["equal"]), f"rank {r}"
        _, frm = res["peers"]
        sent, received = res["total"]
        # Only rank 1's memory is unreadable: its sends go through shared memory.
        by_cma_out, by_cma_in = r != 1, frm != 1
        assert res["routes"] == (
            sent if by_cma_out else 0,
            received if by_cma_in else 0,
            0 if by_cma_out else sent,
            0 if by_cma_in else received,
        ), (r, res)
        # rank 1's probe fails for every peer of rank 1's (it reads, or is read by, 1)
        if 1 in (r, frm, res["peers"][0]):
            assert "EPERM" in str(res["reasons"]), (r, res["reasons"])
        else:
            assert res["reasons"] == {}, (r, res)
        # forced CMA over the swapped pairs: refused by rank 1 and by rank 2, its pair
        if r in (1, 2):
            assert "EPERM" in res["forced"], (r, res["forced"])
        else:
            assert res["forced"] == "no error", (r, res)


def _other_hosts(ctx: WorkerContext) -> dict:
    # Ranks 0, 1 play host "a", ranks 2, 3 host "b": CMA within a host, gloo across.
    transport = _fresh_group(ctx, "a" if ctx.rank < 2 else "b")
    specs = [TensorSpec("w", (4096, 16), torch.float32, 0, None)]
    ranks = tuple(range(ctx.world_size))
    plan = plan_reshard(specs, Layout(1, 4, 1, ranks), Layout(1, 4, 1, (1, 2, 3, 0)))
    full = _full_state(specs, 3)
    mine = shards_from_full(full, specs, plan.src, ctx.rank)
    res = reshard(plan, ctx.rank, mine, transport, timeout=30)
    want = shards_from_full(full, specs, plan.dst, ctx.rank)
    os.environ.pop(HOST_ENV, None)
    same = sum(m.nbytes for m in plan.sends(ctx.rank) if m.dst // 2 == ctx.rank // 2)
    return {
        "equal": torch.equal(res.tensors["w"], want["w"]),
        "cma_sent": res.cma_bytes_sent,
        "want": same,
        "reasons": res.fallback_reasons,
    }


def test_other_hosts_take_the_transport(pool) -> None:
    results = pool.run(_other_hosts)
    for r, res in enumerate(results):
        assert res["equal"], f"rank {r}"
        assert res["cma_sent"] == res["want"], (r, res)
        assert all("another host" in why for why in res["reasons"].values()), res
    assert any(res["reasons"] for res in results)


def _disabled(ctx: WorkerContext) -> dict:
    transport = _fresh_group(ctx)
    if ctx.rank == 2:
        os.environ[CMA_ENV] = "0"
    specs = [TensorSpec("w", (16, 4), torch.float32, 0, None)]
    ranks = tuple(range(ctx.world_size))
    plan = plan_reshard(specs, Layout(1, 4, 1, ranks), Layout(1, 4, 1, ranks[::-1]))
    full = _full_state(specs, 4)
    res = reshard(plan, ctx.rank, shards_from_full(full, specs, plan.src, ctx.rank), transport)
    os.environ.pop(CMA_ENV, None)
    want = shards_from_full(full, specs, plan.dst, ctx.rank)
    return {"equal": torch.equal(res.tensors["w"], want["w"]), "reasons": res.fallback_reasons}


def test_env_turns_the_route_off_for_that_process(pool) -> None:
    results = pool.run(_disabled)
    for r, res in enumerate(results):
        assert res["equal"], f"rank {r}"
        # Rank 2 exchanges with rank 1 (3 - r): that pair falls back, both ways.
        if r in (1, 2):
            assert f"disabled by {CMA_ENV}" in str(res["reasons"]), (r, res)
        else:
            assert res["reasons"] == {}, (r, res)


def test_cma_read_reports_errno_without_raising() -> None:
    # A dead pid and an unmapped source address: errno back, nothing written.
    dst = np.zeros(4, dtype=np.int64)
    table = np.array([[8, dst.ctypes.data, 1, 32, 32, 32]], dtype=np.int64)
    assert _C.cma_read(os.getpid(), table, 1) == (0, 14)  # EFAULT
    src = np.arange(4, dtype=np.int64)
    table[0, 0] = src.ctypes.data
    assert _C.cma_read(os.getpid(), table, 1) == (32, 0)
    assert np.array_equal(dst, src)
    with pytest.raises(ValueError, match="null address"):
        _C.cma_read(os.getpid(), np.array([[0, 1, 1, 8, 8, 8]], dtype=np.int64), 1)


def test_cma_route_refuses_device_memory() -> None:
    from test_transport_shm import _DeviceTransport

    specs = [TensorSpec("w", (4, 4), torch.float32, 0, None)]
    plan = plan_reshard(specs, Layout(1, 1, 1, (0,)), Layout(1, 1, 1, (1,)))
    with pytest.raises(TransportArgumentError, match="route='cma' moves host memory"):
        reshard(plan, 0, {}, _DeviceTransport(), route="cma")


@pytest.mark.skipif(not THP, reason="no transparent huge pages in this kernel")
def test_local_workers_allocate_transparent_huge_pages(pool) -> None:
    from support.runtime_commands import huge_page_advised

    assert pool.run(huge_page_advised) == [("1", True)] * WORLD


def _short_runs(ctx: WorkerContext) -> dict:
    # Rows of 64 B (split on dim 1), flowing one way per pair:
    # route="auto" takes a segment, route="cma" reads.
    transport = _fresh_group(ctx)
    specs = [TensorSpec("w", (256, 64), torch.float32, 1, None)]
    ranks = tuple(range(ctx.world_size))
    plan = plan_reshard(specs, Layout(1, 4, 1, ranks), Layout(1, 4, 1, _rotated(ranks)))
    full = _full_state(specs, 5)
    mine = shards_from_full(full, specs, plan.src, ctx.rank)
    want = shards_from_full(full, specs, plan.dst, ctx.rank)
    out = {}
    for route in ("auto", "cma"):
        res = reshard(plan, ctx.rank, mine, transport, timeout=30, route=route)
        out[route] = (torch.equal(res.tensors["w"], want["w"]), _routes(res), res.bytes_sent)
    return out


def test_auto_takes_shared_memory_for_short_runs(pool) -> None:
    for r, res in enumerate(pool.run(_short_runs)):
        (ok_auto, auto, n), (ok_cma, cma, _) = res["auto"], res["cma"]
        assert ok_auto and ok_cma, f"rank {r}"
        assert auto == (0, 0, n, n) and cma == (n, n, 0, 0), (r, res)


def _rotated(ranks: tuple[int, ...]) -> tuple[int, ...]:
    """``ranks`` moved by one: shard i goes from rank i to rank i + 1 (one way per pair)."""
    return ranks[1:] + ranks[:1]


def _by_cma(peer: int, this_way: dict, other_way: dict, runs: dict) -> bool:
    """Whether route="auto" moves this direction's bytes with ``peer`` by CMA: the pair's
    bytes flow one way only, in runs of CMA_MIN_RUN_BYTES on average."""
    return peer not in other_way and this_way[peer] >= CMA_MIN_RUN_BYTES * runs[peer]


def _pair_routes(ctx: WorkerContext) -> list[dict]:
    # Three plans over 4 ranks: whole 1 MiB shards one way per pair (a rotation); the
    # same shards swapped between pairs (both ways); and tp 2 on ranks 0, 1 -> dp 2 on
    # ranks 2, 3, whose messages add 256 rows of 128 B of "w" to 2 MiB of "a".
    transport = _fresh_group(ctx)
    a = TensorSpec("a", (1024, 1024), torch.float32, 0, None)
    w = TensorSpec("w", (256, 64), torch.float32, 1, None)
    ranks = tuple(range(ctx.world_size))
    cases = (
        ([a], Layout(1, 4, 1, ranks), Layout(1, 4, 1, _rotated(ranks))),
        ([a], Layout(1, 4, 1, ranks), Layout(1, 4, 1, ranks[::-1])),
        ([a, w], Layout(1, 2, 1, ranks[:2]), Layout(2, 1, 1, ranks[2:])),
    )
    out = []
    for k, (specs, src, dst) in enumerate(cases):
        plan = plan_reshard(specs, src, dst)
        full = _full_state(specs, 6 + k)
        mine = shards_from_full(full, specs, plan.src, ctx.rank)
        want = shards_from_full(full, specs, plan.dst, ctx.rank)
        res = reshard(plan, ctx.rank, mine, transport, timeout=30, route="auto")
        # Independently of reshard: a pair's direction from the plan's messages, its runs
        # from the wire program; a pair takes CMA iff one way and long runs on average.
        sent = {m.dst: m.nbytes for m in plan.sends(ctx.rank) if m.dst != ctx.rank}
        received = {m.src: m.nbytes for m in plan.recvs(ctx.rank) if m.src != ctx.rank}
        prog = program(plan, ctx.rank, DIRECT_MIN_BYTES)

        cma_out = sum(n for p, n in sent.items() if _by_cma(p, sent, received, prog.send_runs))
        cma_in = sum(n for p, n in received.items() if _by_cma(p, received, sent, prog.recv_runs))
        out.append(
            {
                "exact": all(torch.equal(res.tensors[n], want[n]) for n in want),
                "routes": _routes(res),
                "want": (
                    cma_out,
                    cma_in,
                    sum(sent.values()) - cma_out,
                    sum(received.values()) - cma_in,
                ),
                "one_way": all(p not in received for p in sent),
            }
        )
    return out


def test_auto_chooses_one_route_per_peer_pair(pool) -> None:
    """route="auto": all of a pair's bytes by cross-memory attach where they flow one way
    in long runs, all through shared memory where the pair exchanges both ways or the
    runs are short; never a pair split over both routes."""
    results = pool.run(_pair_routes)
    for r, cases in enumerate(results):
        for k, res in enumerate(cases):
            assert res["exact"], (r, k)
            assert res["routes"] == res["want"], (r, k, res)
        rotation, swapped, mixed = cases
        assert rotation["one_way"] and rotation["routes"][2:] == (0, 0), (r, rotation)
        assert rotation["routes"][0] > 0, (r, rotation)  # long runs one way: all by CMA
        assert not swapped["one_way"] and swapped["routes"][:2] == (0, 0), (r, swapped)
        assert mixed["one_way"] and mixed["routes"][:2] == (0, 0), (r, mixed)  # short runs
