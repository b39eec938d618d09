"""reshard() across 4 local gloo processes (one pool for the module).

Random tensors (uneven shapes, fp32/bf16/int64, replicated and split, on
pipeline stages) are resharded between random layout pairs over up to 4 ranks;
every destination shard must equal (torch.equal) the slice of the full tensor,
and the bytes and messages each rank moved must be exactly the plan's. Cases
cycle through the default route (cross-memory attach: all ranks share this host
and may read each other), route="transport" (everything through gloo),
route="shm" (shared-memory segments), route="cma" and route="net" (the socket
route's TCP streams, rows straight from and into the shards).
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from support.net import ipv6_loopback

from nereus_comm.errors import PeerTimeoutError, TensorMismatchError
from nereus_comm.layout import Layout, TensorSpec
from nereus_comm.plan import plan_reshard
from nereus_comm.reshard import (
    _CMA,
    _NET,
    _SHM,
    CMA_MIN_RUN_BYTES,
    DIRECT_MIN_BYTES,
    Workspace,
    _net_for,
    reshard,
    shards_from_full,
)
from nereus_comm.reshard_program import VERIFY_RECORD_BYTES, program
from nereus_comm.testing import LocalWorkers, WorkerContext
from nereus_comm.transport import GlooTransport, TransportArgumentError

# Multi-process: out of the fast lane (-m "not slow").
pytestmark = pytest.mark.slow

WORLD = 4
DTYPES = (torch.float32, torch.bfloat16, torch.int64)


@pytest.fixture(scope="module")
def pool():
    with LocalWorkers(WORLD, timeout=60) as p:
        yield p


def _full_tensor(spec: TensorSpec, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if spec.dtype == torch.int64:
        return torch.randint(-(2**62), 2**62, spec.shape, generator=g, dtype=torch.int64)
    return torch.randn(spec.shape, generator=g).to(spec.dtype)


def _full_state(specs, seed: int) -> dict[str, torch.Tensor]:
    return {s.name: _full_tensor(s, seed * 1000 + i) for i, s in enumerate(specs)}


def _random_specs(rng: random.Random, num_layers: int) -> list[TensorSpec]:
    specs = []
    for i in range(rng.randint(2, 6)):
        ndim = rng.randint(1, 3)
        # Uneven sizes, some smaller than the tp degree (empty trailing shards).
        shape = tuple(rng.choice((1, 2, 3, 5, 7, 9, 13, 17)) for _ in range(ndim))
        split = rng.choice([None, *range(ndim)])
        stage = rng.choice([None, *range(num_layers)])
        specs.append(TensorSpec(f"t{i}", shape, rng.choice(DTYPES), split, stage))
    return specs


def _random_layout(rng: random.Random, num_layers: int, max_ranks: int = WORLD) -> Layout:
    while True:
        dp, tp, pp = rng.randint(1, 4), rng.randint(1, 4), rng.randint(1, min(3, num_layers))
        if dp * tp * pp <= max_ranks:
            break
    ranks = tuple(rng.sample(range(WORLD), dp * tp * pp))
    return Layout(dp, tp, pp, ranks, num_layers=num_layers)


def _fixed_cases() -> list[tuple]:
    specs = [
        TensorSpec("w", (13, 6), torch.float32, 0, 0),
        TensorSpec("o", (5, 9), torch.bfloat16, 1, 1),
        TensorSpec("emb", (17, 3), torch.bfloat16, 0, 0),
        TensorSpec("norm", (7,), torch.float32, None, 1),
        TensorSpec("step", (1,), torch.int64, None, None),
    ]
    L = lambda dp, tp, pp, ranks: Layout(dp, tp, pp, tuple(ranks), num_layers=2)  # noqa: E731
    return [
        (specs, L(2, 2, 1, [0, 1, 2, 3]), L(1, 4, 1, [0, 1, 2, 3])),  # dp2tp2 -> tp4
        (specs, L(1, 4, 1, [0, 1, 2, 3]), L(1, 2, 2, [3, 2, 1, 0])),  # tp4 -> tp2pp2
        (specs, L(1, 2, 1, [0, 1]), L(1, 2, 1, [2, 3])),  # disjoint rank sets
        (specs, L(1, 1, 1, [2]), L(2, 2, 1, [0, 1, 2, 3])),  # grow 1 -> 4
        (specs, L(2, 1, 2, [0, 1, 2, 3]), L(1, 1, 1, [1])),  # shrink 4 -> 1
        (specs, L(1, 3, 1, [0, 1, 2]), L(3, 1, 1, [1, 2, 3])),  # overlapping, tp3 -> dp3
        # The destination moves "w" to the last stage and "norm" to the first.
        (specs, L(1, 2, 2, [0, 1, 2, 3]), L(1, 1, 2, [3, 1]), _moved(specs, {"w": 1, "norm": 0})),
    ]


def _moved(specs: list[TensorSpec], stages: dict[str, int]) -> list[TensorSpec]:
    return [
        TensorSpec(s.name, s.shape, s.dtype, s.split_dim, stages.get(s.name, s.stage_key))
        for s in specs
    ]


def _random_cases(seed: int, n: int) -> list[tuple[list[TensorSpec], Layout, Layout]]:
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        num_layers = rng.randint(1, 3)
        specs = _random_specs(rng, num_layers)
        cases.append((specs, _random_layout(rng, num_layers), _random_layout(rng, num_layers)))
    return cases


def cma_blocked(ctx: WorkerContext) -> dict[int, str]:
    """Why this rank cannot use cross-memory attach with the others (empty: it can).

    Probes over a fresh group; where the kernel forbids it (Yama ptrace scope,
    seccomp), tests expect the fallback instead of failing.
    """
    from nereus_comm.transport_cma import CmaRoute

    transport = GlooTransport(dist.new_group(ranks=list(range(ctx.world_size))))
    peers = [p for p in range(ctx.world_size) if p != ctx.rank]
    cma = CmaRoute(transport)
    cma.prepare(peers, peers, timeout=30)
    return cma.reasons


def _transport(ctx: WorkerContext) -> GlooTransport:
    if "transport" not in ctx.scratch:
        ctx.scratch["transport"] = GlooTransport()
    return ctx.scratch["transport"]


def _run_cases(
    ctx: WorkerContext, cases, seed: int, cma_ok: bool = True, routes: tuple[str, ...] | None = None
) -> list[dict]:
    transport = _transport(ctx)
    rank = ctx.rank
    out = []
    for k, (specs, src, dst, *more) in enumerate(cases):
        dst_specs = more[0] if more else specs  # tensors that change pipeline stage
        plan = plan_reshard(specs, src, dst, dst_specs=dst_specs if more else None)
        full = _full_state(specs, seed + k)
        mine = shards_from_full(full, specs, plan.src, rank)
        before = _moved_so_far(transport)
        # Every other case reuses one workspace (staging buffers of earlier cases).
        ws = ctx.scratch.setdefault("workspace", Workspace()) if k % 2 else None
        # Every third case sends every non-empty piece as its own buffer (direct
        # where contiguous), as the default does for pieces of >= 512 KiB.
        direct = {"direct_min_bytes": 1} if k % 3 == 0 else {}
        routes_ = routes or ("auto", "transport", "shm", "cma" if cma_ok else "shm", "net")
        route = routes_[k % len(routes_)]
        res = reshard(plan, rank, mine, transport, timeout=20, workspace=ws, route=route, **direct)
        after = _moved_so_far(transport)
        want = shards_from_full(full, dst_specs, plan.dst, rank)
        involved = rank in plan.src or rank in plan.dst
        sends = plan.sends(rank) if involved else []
        recvs = plan.recvs(rank) if involved else []
        out.append(
            {
                "names_ok": sorted(res.tensors) == sorted(want),
                "bad": [n for n in want if not torch.equal(res.tensors[n], want[n])],
                "bytes_sent": res.bytes_sent,
                "bytes_received": res.bytes_received,
                "bytes_local": res.bytes_local,
                # The plan check's records go through gloo too (as many each way).
                "wire_sent": after[0] - before[0] - res.verify_bytes,
                "wire_received": after[1] - before[1] - res.verify_bytes,
                "verify_bytes": (
                    res.verify_bytes,
                    VERIFY_RECORD_BYTES * len(program(plan, rank).peers),
                ),
                "routes": (
                    res.shm_bytes_sent,
                    res.shm_bytes_received,
                    res.cma_bytes_sent,
                    res.cma_bytes_received,
                    res.net_bytes_sent,
                    res.net_bytes_received,
                ),
                "want_routes": _want_routes(route, res, plan, rank, direct, cma_ok),
                "fallback": res.fallback_reasons,
                "plan_sent": sum(m.nbytes for m in sends),
                "plan_received": sum(m.nbytes for m in recvs),
                "msgs": (res.messages_sent, res.messages_received),
                "plan_msgs": (len(sends), len(recvs)),
                "peers_ok": all(m.src == rank for m in sends) and all(m.dst == rank for m in recvs),
                "buffers_ok": res.buffers_sent <= sum(len(m.pieces) for m in sends),
                "stats": (plan.stats.total_bytes, plan.stats.local_bytes, plan.stats.num_messages),
            }
        )
    return out


def _want_routes(
    route: str, res, plan, rank: int, direct: dict, cma_ok: bool
) -> tuple[int, int, int, int, int, int]:
    """(shm sent, shm received, cma sent, cma received, net sent, net received) the
    route should give.

    Every rank is on this host and may read the others: "cma" is all cross-memory
    attach, "shm" all shared memory, "net" all over the socket route's streams,
    "transport" none of them, and "auto" (never the socket route on one host) moves all of a peer
    pair's bytes by cross-memory attach when they flow one way only (the plan has no
    message the other way) and its message's runs average CMA_MIN_RUN_BYTES, else all
    through shared memory.
    """
    both = (res.bytes_sent, res.bytes_received)
    if not cma_ok and route == "auto":
        return (*both, 0, 0, 0, 0)
    if route in ("shm", "cma", "net", "transport"):
        return tuple(x for r in ("shm", "cma", "net") for x in (both if route == r else (0, 0)))
    prog = program(plan, rank, direct.get("direct_min_bytes", DIRECT_MIN_BYTES))
    involved = rank in plan.src or rank in plan.dst
    to = {m.dst for m in plan.sends(rank) if m.dst != rank and m.nbytes} if involved else set()
    frm = {m.src for m in plan.recvs(rank) if m.src != rank and m.nbytes} if involved else set()
    cma = [
        sum(
            b.nbytes
            for b in bufs
            if b.peer not in other and totals[b.peer] >= CMA_MIN_RUN_BYTES * runs[b.peer]
        )
        for bufs, totals, runs, other in (
            (prog.sends, prog.send_totals, prog.send_runs, frm),
            (prog.recvs, prog.recv_totals, prog.recv_runs, to),
        )
    ]
    return (both[0] - cma[0], both[1] - cma[1], cma[0], cma[1], 0, 0)


def _moved_so_far(transport: GlooTransport) -> tuple[int, int]:
    """Data bytes moved by gloo, shared memory, cross-memory attach and the socket route
    (no setup records)."""
    key = transport.connection_key()
    shm, cma, net = _SHM.get(key), _CMA.get(key), _NET.get(key)
    sent, received = transport.stats.bytes_sent, transport.stats.bytes_received
    if cma is not None:
        # The CMA route's own records (probes, tables, completions) travel over gloo.
        sent, received = _cma_free(transport, cma)
        sent += cma.bytes_sent
        received += cma.bytes_received
    if shm is not None:
        sent += shm.stats.bytes_sent - shm.setup_bytes
        received += shm.stats.bytes_received - shm.setup_bytes
    if net is not None:
        sent += net.bytes_sent - net.setup_bytes
        received += net.bytes_received - net.setup_bytes
    return sent, received


def _cma_free(transport: GlooTransport, cma) -> tuple[int, int]:
    """Gloo's byte counters without the CMA route's records."""
    return transport.stats.bytes_sent - cma.control_bytes[0], (
        transport.stats.bytes_received - cma.control_bytes[1]
    )


def _check(results_by_rank: list[list[dict]], cases, cma_ok: bool) -> None:
    for k, (specs, src, dst, *_) in enumerate(cases):
        rows = [results_by_rank[r][k] for r in range(WORLD)]
        where = f"case {k}: {src!r} -> {dst!r}, specs {specs}"
        for r, row in enumerate(rows):
            assert row["names_ok"], f"{where}: rank {r} got the wrong set of tensors"
            assert not row["bad"], f"{where}: rank {r} wrong bytes in {row['bad']}"
            assert row["peers_ok"], where
            assert row["bytes_sent"] == row["plan_sent"] == row["wire_sent"], where
            assert row["bytes_received"] == row["plan_received"] == row["wire_received"], where
            assert row["msgs"] == row["plan_msgs"], where
            assert row["buffers_ok"], where
            assert row["routes"] == row["want_routes"], (where, row["routes"])
            assert row["verify_bytes"][0] == row["verify_bytes"][1], (where, row["verify_bytes"])
            if cma_ok:
                assert row["fallback"] == {}, (where, row["fallback"])
        total, local, num_messages = rows[0]["stats"]
        assert sum(row["bytes_sent"] for row in rows) == total, where
        assert sum(row["bytes_received"] for row in rows) == total, where
        assert sum(row["bytes_local"] for row in rows) == local, where
        assert sum(row["msgs"][0] for row in rows) == num_messages, where


_CMA_OK: dict[int, bool] = {}


def cma_ok(pool) -> bool:
    """Whether every pair of the pool's workers may read each other (probed once)."""
    if id(pool) not in _CMA_OK:
        _CMA_OK[id(pool)] = not any(pool.run(cma_blocked))
    return _CMA_OK[id(pool)]


def test_fixed_layout_changes(pool) -> None:
    cases = _fixed_cases()
    _check(pool.run(_run_cases, cases, 7, cma_ok(pool)), cases, cma_ok(pool))


def _over_ipv6(ctx: WorkerContext, cases, seed: int) -> list[dict]:
    """The cases over the socket route on a new group whose streams use IPv6 loopback."""
    import os

    from nereus_comm.transport_net import NET_ADDRESS_ENV

    before = os.environ.get(NET_ADDRESS_ENV), ctx.scratch.get("transport")
    os.environ[NET_ADDRESS_ENV] = "::1"  # read when the group's route is first used
    ctx.scratch["transport"] = GlooTransport(dist.new_group(list(range(ctx.world_size))))
    try:
        rows = _run_cases(ctx, cases, seed, routes=("net",))
        return [{**row, "net_address": _net_for(ctx.scratch["transport"]).address} for row in rows]
    finally:
        if before[0] is None:
            os.environ.pop(NET_ADDRESS_ENV)
        else:
            os.environ[NET_ADDRESS_ENV] = before[0]
        ctx.scratch["transport"] = before[1]


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")
def test_fixed_layout_changes_over_ipv6_streams(pool) -> None:
    cases = _fixed_cases()
    results = pool.run(_over_ipv6, cases, 9)
    _check(results, cases, cma_ok(pool))
    assert {row["net_address"] for rows in results for row in rows} == {"::1"}


@pytest.mark.parametrize("seed", [1, 2])
def test_random_layout_pairs(pool, seed: int) -> None:
    cases = _random_cases(seed, 12)
    _check(pool.run(_run_cases, cases, 100 * seed, cma_ok(pool)), cases, cma_ok(pool))


SMALL = 64 * 1024  # a direct_min_bytes that makes most pieces here "large"


def _large_pieces(ctx: WorkerContext) -> dict:
    # Pieces above direct_min_bytes that are contiguous on both ends go without packing.
    specs = [
        TensorSpec("col", (512, 256), torch.float32, 0, None),  # dim-0 split: contiguous
        TensorSpec("row", (256, 512), torch.float32, 1, None),  # dim-1 split: strided
        TensorSpec("bias", (512,), torch.bfloat16, 0, None),
    ]
    src = Layout(2, 2, 1, (0, 1, 2, 3))
    dst = Layout(1, 4, 1, (3, 2, 1, 0))
    plan = plan_reshard(specs, src, dst)
    transport = _transport(ctx)
    # Two calls with the same plan (its derived buffers are cached per plan and rank)
    # and different tensors: the second must move the second state's bytes.
    first = _full_state(specs, 4)
    # Through gloo: the wire buffers are what this test checks.
    again = reshard(
        plan, ctx.rank, shards_from_full(first, specs, src, ctx.rank), transport, route="transport"
    )
    full = _full_state(specs, 5)
    mine = shards_from_full(full, specs, src, ctx.rank)
    res = reshard(plan, ctx.rank, mine, transport, direct_min_bytes=SMALL, route="transport")
    want = shards_from_full(full, specs, dst, ctx.rank)
    want_first = shards_from_full(first, specs, dst, ctx.rank)
    # Pieces of >= direct_min_bytes get their own buffer; the rest of a message share one.
    expected = 0
    for m in plan.sends(ctx.rank):
        large = [p for p in m.pieces if p.nbytes >= SMALL]
        expected += len(large) + (1 if m.nbytes > sum(p.nbytes for p in large) else 0)
    # "col" pieces (tensor 0, dim-0 split) are contiguous on both sides: never staged.
    col = sum(p.nbytes for m in plan.sends(ctx.rank) for p in m.pieces if p.tensor == 0)
    return {
        "equal": all(torch.equal(res.tensors[n], want[n]) for n in want),
        "first_equal": all(torch.equal(again.tensors[n], want_first[n]) for n in want_first),
        "states_differ": any(not torch.equal(want[n], want_first[n]) for n in want),
        "default_buffers": (again.buffers_sent, len(plan.sends(ctx.rank))),
        "buffers": (res.buffers_sent, expected),
        "messages": res.messages_sent,
        "bytes": (res.bytes_sent, sum(m.nbytes for m in plan.sends(ctx.rank))),
        "staged": (res.staged_bytes_sent, res.bytes_sent - col),
    }


def test_large_contiguous_pieces_go_direct(pool) -> None:
    results = pool.run(_large_pieces)
    for r, res in enumerate(results):
        assert res["equal"], f"rank {r}"
        assert res["first_equal"] and res["states_differ"], f"rank {r}"
        # These pieces are < DIRECT_MIN_BYTES: by default one buffer per message.
        assert res["default_buffers"][0] == res["default_buffers"][1], res
        assert res["bytes"][0] == res["bytes"][1]
        assert res["buffers"][0] == res["buffers"][1], res
        assert res["staged"][0] <= res["staged"][1], res
    assert sum(r["buffers"][0] for r in results) > sum(r["messages"] for r in results)


def _error_cases(ctx: WorkerContext) -> list[str]:
    specs = [
        TensorSpec("a", (8, 4), torch.float32, 0, None),
        TensorSpec("b", (5,), torch.bfloat16, None, None),
    ]
    src = Layout(2, 2, 1, (0, 1, 2, 3))
    dst = Layout(1, 4, 1, (0, 1, 2, 3))
    plan = plan_reshard(specs, src, dst)
    transport = _transport(ctx)
    good = shards_from_full(_full_state(specs, 3), specs, src, ctx.rank)
    out_sentinel = {
        n: torch.full_like(t, 7)
        for n, t in shards_from_full(_full_state(specs, 3), specs, dst, ctx.rank).items()
    }
    bad_inputs = [
        ({**good, "a": good["a"][:-1].clone()}, None),  # wrong shape
        ({**good, "b": good["b"].float()}, None),  # wrong dtype
        ({"a": good["a"]}, None),  # missing tensor
        ({**good, "zzz": torch.zeros(1)}, None),  # unknown tensor
        ({**good, "a": torch.zeros(4, 4).t()[:, :4]}, None),  # non-contiguous (right shape)
        (good, {**out_sentinel, "a": out_sentinel["a"][:1].clone()}),  # bad out
    ]
    try:  # staging memory of the wrong device
        reshard(plan, ctx.rank, good, transport, workspace=Workspace("meta"), timeout=5)
        wrong_workspace = "no error"
    except TransportArgumentError as e:
        wrong_workspace = str(e)
    messages = []
    exchanges = transport.stats.exchanges
    for tensors, out in bad_inputs:
        try:
            reshard(plan, ctx.rank, tensors, transport, out=out, timeout=5)
            messages.append("no error")
        except TensorMismatchError as e:
            messages.append(str(e))
    untouched = all(bool((t == 7).all()) for n, t in out_sentinel.items() if n != "a")
    return [*messages, wrong_workspace, transport.stats.exchanges == exchanges, untouched]


def test_bad_input_raises_before_any_byte_moves(pool) -> None:
    for r, res in enumerate(pool.run(_error_cases)):
        shape_msg, dtype_msg, missing_msg, unknown_msg, contig_msg, out_msg, ws_msg, *rest = res
        quiet, kept = rest
        assert "'a'" in shape_msg and "expected shape (4, 4)" in shape_msg, shape_msg
        assert "got shape (3, 4)" in shape_msg
        assert "'b'" in dtype_msg and "torch.bfloat16" in dtype_msg and "float32" in dtype_msg
        assert "'b'" in missing_msg and "missing" in missing_msg
        assert "'zzz'" in unknown_msg and "not a tensor of the plan" in unknown_msg
        assert "non-contiguous" in contig_msg
        assert "destination tensor 'a'" in out_msg
        assert "workspace holds meta memory" in ws_msg
        assert quiet, f"rank {r} exchanged bytes despite bad input"
        assert kept, f"rank {r} wrote into out despite bad input"


def _silent_sender(ctx: WorkerContext, timeout: float) -> dict:
    # A fresh group: after a gloo timeout the pair with the silent peer is closed.
    group = dist.new_group(ranks=list(range(ctx.world_size)))
    specs = [TensorSpec("w", (64, 8), torch.float32, 0, None)]
    plan = plan_reshard(specs, Layout(1, 1, 1, (1,)), Layout(1, 1, 1, (0,)))
    if ctx.rank != 0:
        if ctx.rank == 1:
            time.sleep(timeout + 1.0)  # holds the data but never sends it
        return {}
    start = time.monotonic()
    try:
        reshard(plan, 0, {}, GlooTransport(group), timeout=timeout)
    except PeerTimeoutError as e:
        return {"error": str(e), "elapsed": time.monotonic() - start}
    return {"error": None}


def test_silent_peer_gives_timeout_naming_it(pool) -> None:
    res = pool.run(_silent_sender, 1.5, timeout=30)[0]
    assert res["error"] is not None
    assert "peers 1 " in res["error"], res["error"]
    assert 1.3 < res["elapsed"] < 4.0


def test_reshard_demo_example_checks_every_byte() -> None:
    # Run as a user runs it: a script by path, its worker function in __main__.
    example = Path(__file__).resolve().parents[2] / "examples" / "reshard_demo.py"
    proc = subprocess.run(
        [sys.executable, str(example), "--workers", "2", "--hidden", "64"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count("all equal to the reference") == 2 and "OK in" in proc.stdout
