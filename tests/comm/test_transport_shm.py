"""ShmTransport and reshard() over shared memory, across 4 local gloo processes.

All workers share this host; with cross-memory attach turned off (NEREUS_CMA=0,
as where the kernel forbids it) the default route moves every byte through
/dev/shm; workers given different NEREUS_SHM_HOST values act as two hosts, so
that some pairs use shared memory and the others gloo. Every destination shard
must equal (torch.equal) the slice of the full tensor, and which path moved how
many bytes is checked against the plan.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from test_reshard import _full_state, _random_cases

from nereus_comm.errors import PeerTimeoutError
from nereus_comm.layout import Layout, TensorSpec
from nereus_comm.plan import plan_reshard
from nereus_comm.reshard import _SHM, reshard, shards_from_full
from nereus_comm.testing import LocalWorkers, WorkerContext, WorkerError
from nereus_comm.transport import GlooTransport, TransportArgumentError
from nereus_comm.transport_cma import CMA_ENV
from nereus_comm.transport_shm import HOST_ENV, NAME_PREFIX, SHM_DIR, ShmTransport, owner_prefix

# Multi-process: out of the fast lane (-m "not slow").
pytestmark = pytest.mark.slow

WORLD = 4


@pytest.fixture(scope="module")
def pool():
    with LocalWorkers(WORLD, timeout=60) as p:
        yield p


def _leftovers(pids) -> list[str]:
    """Segment files in /dev/shm created by any of these processes."""
    prefixes = tuple(owner_prefix(pid) for pid in pids)
    return [n for n in os.listdir(SHM_DIR) if n.startswith(prefixes)]


def _fresh_group(ctx: WorkerContext, host: str | None) -> GlooTransport:
    # A new group: a new ShmTransport (it is kept per group), reading HOST_ENV anew.
    # Cross-memory attach off: route="auto" falls back to shared memory (the path
    # these tests check), as where the kernel refuses process_vm_readv.
    os.environ[CMA_ENV] = "0"
    if host is None:
        os.environ.pop(HOST_ENV, None)
    else:
        os.environ[HOST_ENV] = host
    return GlooTransport(dist.new_group(ranks=list(range(ctx.world_size))))


def _random_pairs(ctx: WorkerContext, seed: int, route: str) -> dict:
    transport = _fresh_group(ctx, None)
    out = []
    for k, (specs, src, dst) in enumerate(_random_cases(seed, 8)):
        plan = plan_reshard(specs, src, dst)
        row = {"bad": [], "shm": [], "rounds": [], "same_segments": True}
        for call in range(3):  # repeated calls (per-step weight sync) reuse the segments
            full = _full_state(specs, seed * 100 + 10 * k + call)
            mine = shards_from_full(full, specs, src, ctx.rank)
            shm = _SHM.get(transport.connection_key())
            segs = None if shm is None else {**shm._out, **{-p - 1: s for p, s in shm._in.items()}}
            res = reshard(plan, ctx.rank, mine, transport, timeout=20, route=route)
            shm = _SHM.get(transport.connection_key())
            want = shards_from_full(full, specs, dst, ctx.rank)
            row["bad"] += [n for n in want if not torch.equal(res.tensors[n], want[n])]
            row["names_ok"] = sorted(res.tensors) == sorted(want)
            row["shm"].append((res.shm_bytes_sent, res.shm_bytes_received))
            row["plan"] = (res.bytes_sent, res.bytes_received)
            row["fallback"] = res.fallback_reasons
            row["rounds"].append(0 if shm is None else shm.setup_rounds)
            if call and segs is not None and shm is not None:
                now = {**shm._out, **{-p - 1: s for p, s in shm._in.items()}}
                row["same_segments"] &= all(now.get(key) is s for key, s in segs.items())
        out.append(row)
    shm = _SHM.get(transport.connection_key())
    names = [] if shm is None else _leftovers([os.getpid()])
    return {"rows": out, "named_files": names, "pid": os.getpid()}


@pytest.mark.parametrize("route", ["shm", "auto"])
def test_random_layout_pairs_exact_and_all_through_shm(pool, route: str) -> None:
    results = pool.run(_random_pairs, 3 if route == "shm" else 4, route)
    for r, res in enumerate(results):
        # Receivers unlink a segment's name as soon as they map it: nothing lingers.
        assert res["named_files"] == [], f"rank {r}: {res['named_files']}"
        for k, row in enumerate(res["rows"]):
            where = f"rank {r} case {k}"
            assert row["names_ok"] and not row["bad"], f"{where}: wrong bytes in {row['bad']}"
            assert all(s == row["plan"] for s in row["shm"]), f"{where}: {row}"
            # route="auto" says why its peers did not take cross-memory attach.
            why = row["fallback"].values() if route == "auto" else ["disabled by NEREUS_CMA"]
            assert all("disabled by NEREUS_CMA" in w for w in why), f"{where}: {row}"
            # The second and third call spend no setup round and keep the segments.
            assert row["rounds"][1] == row["rounds"][2] == row["rounds"][0], f"{where}: {row}"
            assert row["same_segments"], where
    assert _leftovers(r["pid"] for r in results) == []


def _mixed(ctx: WorkerContext) -> dict:
    # Ranks 0, 1 play host "a", ranks 2, 3 host "b".
    transport = _fresh_group(ctx, "a" if ctx.rank < 2 else "b")
    specs = [
        TensorSpec("w", (13, 7), torch.float32, 0, None),
        TensorSpec("o", (6, 11), torch.bfloat16, 1, None),
        TensorSpec("step", (3,), torch.int64, None, None),
    ]
    src = Layout(1, 4, 1, (0, 1, 2, 3))
    dst = Layout(1, 4, 1, (1, 2, 3, 0))
    plan = plan_reshard(specs, src, dst)
    rows = []
    for call in range(2):
        full = _full_state(specs, 40 + call)
        res = reshard(plan, ctx.rank, shards_from_full(full, specs, src, ctx.rank), transport)
        want = shards_from_full(full, specs, dst, ctx.rank)
        rows.append(all(torch.equal(res.tensors[n], want[n]) for n in want))
    host = ctx.rank // 2
    same = {m.dst: m.nbytes for m in plan.sends(ctx.rank) if m.dst // 2 == host}
    same_in = {m.src: m.nbytes for m in plan.recvs(ctx.rank) if m.src // 2 == host}
    try:
        mine = shards_from_full(full, specs, src, ctx.rank)
        reshard(plan, ctx.rank, mine, transport, route="shm")
        forced = "no error"
    except TransportArgumentError as e:
        forced = str(e)
    os.environ.pop(HOST_ENV, None)
    return {
        "equal": rows,
        "shm": (res.shm_bytes_sent, res.shm_bytes_received),
        "want_shm": (sum(same.values()), sum(same_in.values())),
        "total": (res.bytes_sent, res.bytes_received),
        "forced": forced,
    }


def test_mixed_hosts_route_per_pair(pool) -> None:
    results = pool.run(_mixed)
    for r, res in enumerate(results):
        assert all(res["equal"]), f"rank {r}"
        assert res["shm"] == res["want_shm"], f"rank {r}: {res}"
        assert "another host" in res["forced"], f"rank {r}: {res['forced']}"
    # Half the messages stay on a "host" (shared memory), half cross (gloo).
    shm = sum(r["shm"][0] for r in results)
    assert 0 < shm < sum(r["total"][0] for r in results), results


def _payload(call: int, src: int, dst: int, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * call + 100 * src + 10 * dst + i)
    return torch.randn(3 + i * 5 + src, generator=g).to(torch.bfloat16)


def _exchange(ctx: WorkerContext) -> dict:
    # The Transport interface: several buffers per peer, matched in order.
    control = _fresh_group(ctx, None)  # held: ShmTransport keeps it only weakly
    shm = ShmTransport(control)
    peers = [p for p in range(ctx.world_size) if p != ctx.rank]
    ok = []
    for call in range(2):
        sends = [(p, _payload(call, ctx.rank, p, i)) for p in peers for i in range(3)]
        want = [(p, _payload(call, p, ctx.rank, i)) for p in peers for i in range(3)]
        recvs = [(p, torch.empty_like(t)) for p, t in want]
        shm.exchange(sends, recvs, timeout=20)
        ok.append(all(torch.equal(t, w) for (_, t), (_, w) in zip(recvs, want)))
    shm.close()
    return {"ok": ok, "stats": shm.stats, "want": sum(t.nbytes for _, t in sends) * 2}


def test_transport_interface_all_to_all(pool) -> None:
    for r, res in enumerate(pool.run(_exchange)):
        assert all(res["ok"]), f"rank {r}"
        s = res["stats"]
        assert s.exchanges == 2 and s.messages_sent == 2 * 3 * (WORLD - 1), s
        assert s.bytes_sent == res["want"], s


def _dies_midway(ctx: WorkerContext, timeout: float) -> None:
    transport = _fresh_group(ctx, None)
    specs = [TensorSpec("w", (64, 8), torch.float32, 0, None)]
    plan = plan_reshard(specs, Layout(1, 2, 1, (0, 1)), Layout(1, 2, 1, (1, 0)))
    full = _full_state(specs, 9)
    mine = shards_from_full(full, specs, plan.src, ctx.rank)
    reshard(plan, ctx.rank, mine, transport, timeout=20, route="shm")  # sets up, works
    if ctx.rank == 1:
        os._exit(1)  # dies holding the data rank 0 waits for
    start = time.monotonic()
    try:
        # the plan check would meet the death first, over the transport: this test is
        # about the shared-memory route's own wait
        reshard(plan, 0, mine, transport, timeout=timeout, route="shm", verify_plan=False)
        result = "no error"
    except PeerTimeoutError as e:
        result = str(e)
    ctx.store.set("shm_test/dead_peer", f"{time.monotonic() - start:.3f}|{os.getpid()}|{result}")


def test_dead_peer_times_out_naming_it_and_leaves_no_file() -> None:
    with LocalWorkers(2, timeout=60) as pool:
        pids = pool.run(_pid)
        with pytest.raises(WorkerError, match="rank 1"):
            pool.run(_dies_midway, 2.0, timeout=30)
        got = pool.store.get("shm_test/dead_peer").decode()
    elapsed, _, error = got.split("|", 2)
    assert "peers 1 did not send their message within 2 s" in error, error
    assert 1.9 < float(elapsed) < 5.0, got
    assert _leftovers(pids) == []


def _pid(ctx: WorkerContext) -> int:
    return os.getpid()


_EXIT_WITHOUT_CLOSE = """
import sys, torch.distributed as dist
from nereus_comm.transport import GlooTransport
from nereus_comm.transport_shm import ShmTransport, _Segment
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
shm = ShmTransport(GlooTransport())
shm._out[1] = _Segment(sys.argv[1], 4096, create=True)  # a peer that never maps it
kept = ShmTransport(GlooTransport())
kept._out[1] = _Segment(sys.argv[2], 4096, create=True)
kept.close()
print("closed", flush=True)
"""


def _segment_script(tmp_path, source: str, tag: str):
    """Run ``source`` in a fresh process with two segment names of this test's own as
    its arguments; (the finished process, the names)."""
    names = [f"{NAME_PREFIX}{os.getpid()}-{tag}{i}" for i in range(2)]
    script = tmp_path / f"shm_{tag}.py"
    script.write_text(source)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, str(script), *names], capture_output=True, text=True, env=env, timeout=120
    )
    return out, names


def test_unmapped_segments_are_removed_on_close_and_exit(tmp_path) -> None:
    out, names = _segment_script(tmp_path, _EXIT_WITHOUT_CLOSE, "test")
    assert out.returncode == 0 and "closed" in out.stdout, out.stderr
    assert not [n for n in names if os.path.exists(os.path.join(SHM_DIR, n))]


_LOST_ELSEWHERE = """
import os, sys, torch.distributed as dist
from nereus_comm.transport import GlooTransport
from nereus_comm.transport_shm import SHM_DIR, ShmTransport, _Segment, peers_lost
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
# Two groups' transports, as if over ranks (0, 1) and (0, 2): each created a segment for
# its peer, which has not mapped it yet.
a, b = ShmTransport(GlooTransport()), ShmTransport(GlooTransport())
a.ranks, b.ranks = (0, 1), (0, 2)
a._out[1] = _Segment(sys.argv[1], 4096, create=True)
b._out[2] = _Segment(sys.argv[2], 4096, create=True)
peers_lost([1])  # learnt from a plan check over a third group, say
print(os.path.exists(os.path.join(SHM_DIR, sys.argv[1])),
      os.path.exists(os.path.join(SHM_DIR, sys.argv[2])), a._broken, b._broken, flush=True)
b.close()
"""


def test_a_death_learnt_elsewhere_removes_this_process_segments_to_the_dead(tmp_path) -> None:
    out, names = _segment_script(tmp_path, _LOST_ELSEWHERE, "lost")
    assert out.returncode == 0, out.stderr
    # The dead peer's segment is gone, its group's transport broken; the other group's
    # segment and transport are untouched until it closes.
    assert out.stdout.split() == ["False", "True", "ranks", "[1]", "died", "None"], out.stdout
    assert not [n for n in names if os.path.exists(os.path.join(SHM_DIR, n))]


def test_orphans_of_dead_processes_are_swept_and_no_others() -> None:
    from nereus_comm.transport_shm import _PIDNS, sweep_orphans

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    dead_pid = int(gone.stdout)  # exited and reaped: no process has this pid now
    names = {
        "dead": f"{owner_prefix(dead_pid)}r1to0-orphan",
        "alive": f"{owner_prefix(os.getpid())}r0to1-mine",
        "other_namespace": f"{owner_prefix(dead_pid, _PIDNS + 1)}r1to0-theirs",
    }
    try:
        for name in names.values():
            with open(os.path.join(SHM_DIR, name), "wb"):
                pass
        removed = sweep_orphans()
        left = {k for k, n in names.items() if os.path.exists(os.path.join(SHM_DIR, n))}
    finally:
        for name in names.values():
            if os.path.exists(os.path.join(SHM_DIR, name)):
                os.unlink(os.path.join(SHM_DIR, name))
    assert removed == [names["dead"]], removed
    assert left == {"alive", "other_namespace"}, left


def test_route_is_checked_before_anything_moves() -> None:
    with pytest.raises(TransportArgumentError, match="route must be one of"):
        reshard(None, 0, {}, GlooTransport.__new__(GlooTransport), route="nvlink")


def _group_lifetime(ctx: WorkerContext) -> dict:
    # A standalone group, as the EMU runtime builds per transition: when the group
    # goes, its ShmTransport and segments must go too (nothing may keep the group).
    import gc
    import weakref

    os.environ[CMA_ENV] = "0"
    store = dist.PrefixStore("shm_test/lifetime", ctx.store)
    pg = dist.ProcessGroupGloo(store, ctx.rank, ctx.world_size)
    ranks = tuple(range(ctx.world_size))
    specs = [TensorSpec("w", (16, 8), torch.float32, 0, None)]
    plan = plan_reshard(specs, Layout(1, 4, 1, ranks), Layout(1, 4, 1, ranks[::-1]))
    full = _full_state(specs, 2)
    res = reshard(plan, ctx.rank, shards_from_full(full, specs, plan.src, ctx.rank),
                  GlooTransport(pg, ranks, ctx.rank))  # fmt: skip
    shm = weakref.ref(_SHM[pg])
    del pg
    gc.collect()
    return {"shm_bytes": res.shm_bytes_sent, "alive": shm() is not None}


def test_dropping_the_group_frees_its_segments(pool) -> None:
    for r, res in enumerate(pool.run(_group_lifetime)):
        assert res["shm_bytes"] > 0, res
        assert not res["alive"], f"rank {r}: the ShmTransport outlived its group"


class _DeviceTransport(GlooTransport):
    """Only what reshard reads before it moves anything, for a device transport."""

    device_type = "cuda"

    def __init__(self) -> None:
        self.rank, self.ranks = 0, (0, 1)


def test_shm_route_refuses_device_memory() -> None:
    specs = [TensorSpec("w", (4, 4), torch.float32, 0, None)]
    plan = plan_reshard(specs, Layout(1, 1, 1, (0,)), Layout(1, 1, 1, (1,)))
    with pytest.raises(TransportArgumentError, match="route='shm' moves host memory"):
        reshard(plan, 0, {}, _DeviceTransport(), route="shm")


def _no_room(ctx: WorkerContext) -> dict:
    # Rank 1 finds /dev/shm full (fallocate fails as on a full tmpfs): its messages
    # must go through gloo under route="auto" and be refused under route="shm".
    import errno

    from nereus_comm import transport_shm

    transport = _fresh_group(ctx, None)
    real = transport_shm.os.posix_fallocate

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    if ctx.rank == 1:
        transport_shm.os.posix_fallocate = full
    try:
        ranks = tuple(range(ctx.world_size))
        specs = [TensorSpec("w", (16, 8), torch.float32, 0, None)]
        plan = plan_reshard(specs, Layout(1, 4, 1, ranks), Layout(1, 4, 1, ranks[::-1]))
        full_state = _full_state(specs, 5)
        mine = shards_from_full(full_state, specs, plan.src, ctx.rank)
        res = reshard(plan, ctx.rank, mine, transport, timeout=20)
        want = shards_from_full(full_state, specs, plan.dst, ctx.rank)
        try:
            reshard(plan, ctx.rank, mine, transport, timeout=20, route="shm")
            forced = "no error"
        except TransportArgumentError as e:
            forced = str(e)
    finally:
        transport_shm.os.posix_fallocate = real
    return {
        "equal": torch.equal(res.tensors["w"], want["w"]),
        "shm": (res.shm_bytes_sent, res.shm_bytes_received),
        "total": (res.bytes_sent, res.bytes_received),
        "forced": forced,
        "files": _leftovers([os.getpid()]),
    }


def test_full_dev_shm_falls_back_to_the_transport(pool) -> None:
    results = pool.run(_no_room)
    for r, res in enumerate(results):
        assert res["equal"], f"rank {r}"
        assert res["files"] == [], res
        # Rank r sends its shard to rank 3 - r: rank 1 -> 2 has no segment.
        sent_by_shm = r != 1
        received_by_shm = r != 2
        assert res["shm"] == (
            res["total"][0] if sent_by_shm else 0,
            res["total"][1] if received_by_shm else 0,
        ), (r, res)
        if r in (1, 2):
            assert "no room in /dev/shm" in res["forced"], (r, res["forced"])
        else:
            assert res["forced"] == "no error", (r, res["forced"])
