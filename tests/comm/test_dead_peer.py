"""A peer SIGKILLed in the middle of reshard(): the survivors raise in seconds, naming it.

Three worker processes keep resharding a 48 MiB tensor (a ring: each rank's shard
moves to the next) with a 60 s exchange timeout, and learn of deaths from a World's
heartbeats (rank 0 hosts the World, the others join it). The test SIGKILLs rank 1
mid-loop; each survivor must raise PeerLostError naming rank 1 (never a live rank)
within a few seconds, and /dev/shm must hold none of the workers' segment files
afterwards. The shared-memory run goes through a new group, so new segments, on
each of its first calls, as a runtime that builds a group per transition does: the
kill lands in setup rounds as well as in data waits.
"""

from __future__ import annotations

import datetime
import os
import queue
import signal
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from nereus_comm.environment import worker_environ
from nereus_comm.transport_shm import NAME_PREFIX, SHM_DIR
from nereus_comm.world import listen_store

# Multi-process: out of the fast lane (-m "not slow").
pytestmark = pytest.mark.slow

WORLD = 3
VICTIM = 1
HEARTBEAT_S, HEARTBEAT_TIMEOUT_S = 0.25, 1.5
#: survivors must raise within this many seconds of the kill (the exchange timeout is 60 s).
BOUND_S = 5.0
#: shared-memory run: calls on fresh groups (setup rounds), then on the last one.
NUM_GROUPS = 30


def _worker(rank: int, port: int, route: str, out) -> None:
    import torch.distributed as dist

    from nereus_comm.layout import Layout, TensorSpec
    from nereus_comm.plan import plan_reshard
    from nereus_comm.reshard import reshard, shards_from_full
    from nereus_comm.transport import GlooTransport, PeerLostError
    from nereus_comm.world import World

    torch.set_num_threads(1)
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60)
    )
    if rank == 0:
        world = World.create(
            "127.0.0.1",
            min_members=1,
            heartbeat_interval=HEARTBEAT_S,
            heartbeat_timeout=HEARTBEAT_TIMEOUT_S,
        )
        store.set("world_port", str(world.port))
    else:
        store.wait(["world_port"])
        world = World.join("127.0.0.1", int(store.get("world_port")), wait=False)
    store.set(f"member/{rank}", str(world.member_id))
    member = {r: int(store.get(f"member/{r}")) for r in range(WORLD)}
    world.wait_for_members(WORLD)  # every worker's heartbeat seen

    def dead() -> set[int]:
        alive = world.alive()
        return {r for r, m in member.items() if m not in alive}

    ranks = tuple(range(WORLD))
    specs = [TensorSpec("w", (WORLD * 1024, 4096), torch.float32, 0, None)]
    ring = ranks[1:] + ranks[:1]
    plan = plan_reshard(specs, Layout(1, WORLD, 1, ranks), Layout(1, WORLD, 1, ring))
    full = {"w": torch.arange(WORLD * 1024 * 4096, dtype=torch.float32).view(WORLD * 1024, 4096)}
    mine = shards_from_full(full, specs, plan.src, rank)
    out.put((rank, "pid", os.getpid()))

    def group(i: int) -> GlooTransport:
        pg = dist.ProcessGroupGloo(dist.PrefixStore(f"pg{i}", store), rank, WORLD)
        return GlooTransport(pg, ranks, rank)

    # Groups made before anyone dies (a group's rendezvous is no part of reshard);
    # with shared memory each is new to reshard, so each call runs setup rounds.
    transports = [group(i) for i in range(1 if route == "transport" else NUM_GROUPS)]
    i = 0
    try:
        while True:
            transport = transports[min(i, len(transports) - 1)]
            route_ = route.removesuffix("-setup")
            reshard(plan, rank, mine, transport, timeout=60, route=route_, liveness=dead)
            i += 1
            if i == 2:
                out.put((rank, "warm", None))
                if route == "shm-setup" and rank == VICTIM:
                    _die_in_next_segment_round(out)
    except PeerLostError as e:
        out.put((rank, "lost", (time.time(), e.rank, e.ranks, str(e))))
    except BaseException as e:
        out.put((rank, "other", (time.time(), type(e).__name__, traceback.format_exc()[-1500:])))
    # Stay until the parent has looked at /dev/shm (the heartbeats of the World too).
    time.sleep(30)


def _die_in_next_segment_round(out) -> None:
    """SIGKILL this process once it has created a segment, before any peer maps it."""
    from nereus_comm import transport_shm

    swap = transport_shm.ShmTransport._swap

    def dying_swap(self, records, *args):
        if any(transport_shm._parse(rec, p)[2] for p, rec in records.items()):
            out.put((VICTIM, "dying", time.time()))
            time.sleep(0.5)  # the message must leave before the process dies
            os.kill(os.getpid(), signal.SIGKILL)
        return swap(self, records, *args)

    transport_shm.ShmTransport._swap = dying_swap


def _files(pids) -> list[str]:
    mine = tuple(f"-{p}-" for p in pids)
    names = [n for n in os.listdir(SHM_DIR) if n.startswith(NAME_PREFIX)]
    return [n for n in names if any(m in n for m in mine)]


@pytest.mark.parametrize("route", ["transport", "shm", "shm-setup"])
def test_sigkill_mid_reshard_is_named_within_seconds_and_leaves_no_file(route: str) -> None:
    """route "shm-setup": the victim kills itself in a segment round, its new segment
    created and named in its setup record but mapped by no peer yet."""
    ctx = mp.get_context("forkserver")
    store = listen_store("127.0.0.1", 0, timeout=60)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(r, store.port, route, results), daemon=True)
        for r in range(WORLD)
    ]
    # In the worker environment (as LocalWorkers starts its pool): the forkserver this
    # may start serves every later pool of this pytest process, and keeps the environment
    # it had.
    with worker_environ():
        for p in procs:
            p.start()
    try:
        pids, warm, lost, other = {}, set(), {}, {}
        while len(warm) < WORLD:
            r, kind, value = results.get(timeout=120)
            pids.setdefault(r, value) if kind == "pid" else None
            if kind == "warm":
                warm.add(r)
            assert kind in ("pid", "warm"), (r, kind, value)
        if route == "shm-setup":
            r, kind, killed = results.get(timeout=60)
            assert (r, kind) == (VICTIM, "dying"), (r, kind)
        else:
            time.sleep(0.3)  # somewhere inside the next exchange
            os.kill(pids[VICTIM], signal.SIGKILL)
            killed = time.time()
        while len(lost) + len(other) < WORLD - 1:
            try:
                r, kind, value = results.get(timeout=70)
            except queue.Empty:
                break
            (lost if kind == "lost" else other)[r] = value
        # Before the survivors exit: what they left is what a live job would keep.
        left = _files(pids.values())
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
    leftover_after_exit = _files(pids.values())
    for name in leftover_after_exit:  # never leave the machine dirty, even on failure
        os.unlink(os.path.join(SHM_DIR, name))
    assert not other, [v[2] for v in other.values()]
    assert sorted(lost) == [r for r in range(WORLD) if r != VICTIM], lost
    for r, (at, dead_rank, dead_ranks, message) in lost.items():
        assert dead_rank == VICTIM and dead_ranks == (VICTIM,), (r, message)
        assert f"rank {VICTIM} died" in message, message
        assert at - killed < BOUND_S, (r, at - killed, message)
    assert left == [] and leftover_after_exit == [], (left, leftover_after_exit)
