"""Live membership across real processes: a late joiner, a SIGKILLed member, and
an unreachable store; and, with a per-job secret, records written without it
(forged heartbeats, "left" flags, infos, proposals, replays) that change nothing."""

from __future__ import annotations

import datetime
import faulthandler
import hashlib
import hmac
import logging
import multiprocessing as mp
import os
import queue
import signal
import socket
import time
import traceback

import pytest
import torch
import torch.distributed as dist
from support.net import listeners

from nereus_comm.errors import MembershipError
from nereus_comm.pool import CommPool, GlooBackend
from nereus_comm.world import World

# Multi-process: out of the fast lane (-m "not slow").
pytestmark = pytest.mark.slow

INTERVAL = 0.25  # heartbeat seconds
HB_TIMEOUT = 3.0  # seconds without a heartbeat before a member is dead
SECRET = bytes(range(32))  # the job's
OTHER = bytes(range(1, 33))  # another job's
NS = "nereus/world/"  # the World's keys (its documented protocol)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _all_reduce(world: World, value: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([value])
    dist.all_reduce(t, group=world.process_group())
    return t.item()


def _report(out, role, world, value, **extra):
    out.put(
        {
            "role": role,
            "pid": os.getpid(),
            "member": world.member_id,
            "generation": world.generation,
            "members": world.members,
            "rank": world.rank,
            "sum": value,
            **extra,
        }
    )


def _wait_dead(world: World, deadline_s: float) -> tuple[frozenset, float]:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        dead = world.dead_members()
        if dead:
            return dead, time.time()
        time.sleep(0.05)
    raise AssertionError(f"no member was seen dead in {deadline_s} s")


def _member(role: str, port: int, out, secret: bytes | None) -> None:
    """Roles: "a" creates, "b" joins at start, "c" joins later; b is killed after gen 2."""
    torch.set_num_threads(1)
    # A hung member prints where it is stuck, so a failure says more than "timed out".
    faulthandler.dump_traceback_later(40, exit=False)
    world = None
    try:
        if role == "a":
            world = World.create(
                "127.0.0.1",
                port,
                min_members=2,
                heartbeat_interval=INTERVAL,
                heartbeat_timeout=HB_TIMEOUT,
                timeout=30,
                secret=secret,
            )
        else:
            world = World.join("127.0.0.1", port, timeout=30, secret=secret)
        if role in ("a", "b"):
            _report(out, role, world, _all_reduce(world, world.member_id + 1.0))
            # Generation 2: the late joiner is in; these two never restart.
            world.wait_for_members(3, timeout=30)
            assert world.pending_joiners() == {2}, world.pending_joiners()
            t0 = time.perf_counter()
            world.next_generation()
            print(f"{role}: next_generation to 2 took {time.perf_counter() - t0:.3f} s")
        _report(out, role, world, _all_reduce(world, world.member_id + 1.0))
        if role == "b":
            time.sleep(120)  # until the test kills it
            return
        dead, seen_at = _wait_dead(world, deadline_s=30)
        t0 = time.perf_counter()
        world.next_generation()
        print(f"{role}: next_generation to 3 took {time.perf_counter() - t0:.3f} s")
        value = _all_reduce(world, 10.0 * world.rank + 1)
        # The pool's gloo groups are made inside the new generation's default group.
        pool = CommPool(GlooBackend(timeout=30), capacity=2)
        comm = pool.get((1, 0))
        t = torch.tensor([float(world.member_id)])
        torch.distributed.broadcast(t, group_src=0, group=comm.handle)  # from rank 1 = "c"
        pool.destroy_all()
        _report(out, role, world, value, dead=dead, at=seen_at, pool_rank=comm.rank, bcast=t.item())
        if role == "c":
            world.leave()
            out.put({"role": role, "at": time.time()})
        else:
            # A member that leaves is gone at once, not after the heartbeat timeout.
            dead, seen_at = _wait_dead(world, deadline_s=30)
            out.put({"role": role, "dead": dead, "at": seen_at})
            world.leave()
    except BaseException:
        out.put({"role": role, "error": traceback.format_exc()})
        if world is not None:
            world.leave()


def _next(out, waiting_for: str, timeout: float = 45.0) -> dict:
    try:
        msg = out.get(timeout=timeout)
    except queue.Empty:
        raise AssertionError(
            f"no report within {timeout} s while waiting for {waiting_for}"
        ) from None
    assert "error" not in msg, f"{msg['role']}: {msg['error']}"
    return msg


@pytest.mark.timeout(150)
@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "secret"])
def test_late_join_and_sigkill_form_new_generations(secret):
    ctx = mp.get_context("spawn")
    # One queue per member: a process killed while writing to a shared queue
    # could die holding its lock and block everyone else's reports.
    outs = {r: ctx.Queue() for r in "abc"}
    port = _free_port()
    procs = {r: ctx.Process(target=_member, args=(r, port, outs[r], secret)) for r in "abc"}

    def reports(what: str, roles: str) -> dict:
        return {r: _next(outs[r], f"{what} from {r}") for r in roles}

    try:
        procs["a"].start()
        procs["b"].start()
        gen1 = reports("gen 1", "ab")
        assert {m["generation"] for m in gen1.values()} == {1}
        assert gen1["a"]["members"] == (0, 1) and gen1["a"]["sum"] == 3.0
        assert (gen1["a"]["rank"], gen1["b"]["rank"]) == (0, 1)

        procs["c"].start()
        gen2 = reports("gen 2", "abc")
        for m in gen2.values():
            assert m["generation"] == 2 and m["members"] == (0, 1, 2), m
            assert m["sum"] == 6.0
        for role in "ab":  # same processes as in generation 1
            assert gen2[role]["pid"] == gen1[role]["pid"] == procs[role].pid

        killed_at = time.time()
        os.kill(procs["b"].pid, signal.SIGKILL)
        gen3 = reports("gen 3", "ac")
        for role in "ac":
            m = gen3[role]
            assert m["dead"] == {1}
            assert m["generation"] == 3 and m["members"] == (0, 2)
            assert m["sum"] == 1.0 + 11.0  # ranks 0 and 1 of the new group
            assert m["pid"] == gen2[role]["pid"]
            waited = m["at"] - killed_at
            print(f"{role} saw member 1 dead after {waited:.2f} s")
            # Seen dead by the heartbeat timeout, not sooner (no false alarm) and
            # not much later (interval + polling + a loaded machine's slack).
            assert HB_TIMEOUT - 2 * INTERVAL <= waited <= HB_TIMEOUT + 2.0, waited
        assert (gen3["a"]["rank"], gen3["c"]["rank"]) == (0, 1)
        assert (gen3["a"]["pool_rank"], gen3["c"]["pool_rank"]) == (1, 0)
        assert gen3["a"]["bcast"] == gen3["c"]["bcast"] == 2.0  # c's member id

        leave = reports("leave", "ac")
        assert leave["a"]["dead"] == {2}
        assert leave["a"]["at"] - leave["c"]["at"] < HB_TIMEOUT / 2
    finally:
        for p in procs.values():
            if p.pid is not None:
                p.join(timeout=10 if p is not procs["b"] else 0)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)


def test_join_unreachable_store_fails_in_bounded_time():
    port = _free_port()  # nothing listens there
    start = time.monotonic()
    with pytest.raises(MembershipError, match=rf"127\.0\.0\.1:{port}"):
        World.join("127.0.0.1", port, timeout=2.0)
    assert time.monotonic() - start < 10.0


def test_store_listens_on_the_address_asked_for_only():
    world = World.create("127.0.0.1", 0, heartbeat_interval=INTERVAL, heartbeat_timeout=HB_TIMEOUT)
    try:
        # 127.0.0.1 only: neither the IPv4 wildcard (00000000) nor the IPv6 one.
        assert listeners(world.port) == [("/proc/net/tcp", "0100007F")]
        joined = World.join("127.0.0.1", world.port, timeout=10.0, wait=False)
        joined.leave()
    finally:
        world.leave()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        taken = s.getsockname()[1]
        s.listen()
        with pytest.raises(MembershipError, match=f"127.0.0.1:{taken}"):
            World.create("127.0.0.1", taken)


# -- with a secret: what a process without it writes changes nothing ------------------

FAST_INTERVAL = 0.1
FAST_TIMEOUT = 1.0


def _sealed(secret: bytes, key: str, text: str) -> bytes:
    """A record as the World documents it: HMAC-SHA256 over (full key, NUL, text), then text."""
    data = text.encode()
    return hmac.new(secret, (NS + key).encode() + b"\0" + data, hashlib.sha256).digest() + data


def _client(world: World) -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1", world.port, is_master=False, timeout=datetime.timedelta(seconds=10)
    )


def _register(store: dist.TCPStore) -> int:
    """A member written by hand with the job's secret: takes an id, writes its info."""
    m = int(store.add(NS + "num_ids", 1)) - 1
    store.set(NS + f"member/{m}/info", _sealed(SECRET, f"member/{m}/info", "elsewhere 4242"))
    return m


def _wait_until(cond, what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(FAST_INTERVAL / 2)


def _warnings_about(caplog, key: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if repr(NS + key) in r.getMessage()]


@pytest.fixture
def world(caplog):
    caplog.set_level(logging.WARNING, logger="nereus_comm.world")
    w = World.create(
        "127.0.0.1",
        0,
        heartbeat_interval=FAST_INTERVAL,
        heartbeat_timeout=FAST_TIMEOUT,
        timeout=10,
        secret=SECRET,
    )
    try:
        yield w
    finally:
        w.leave()


def test_forged_heartbeat_does_not_keep_a_stopped_member_alive(world, caplog):
    store = _client(world)
    m = _register(store)
    key = f"member/{m}/hb"
    store.set(NS + key, _sealed(SECRET, key, "1"))
    _wait_until(lambda: m in world.alive(), "the genuine heartbeat is seen")
    # m beats no more. A stranger keeps its heartbeat "moving" every way it can
    # without the secret: plain counters, a bad tag, another job's tag, and the
    # creator's genuine heartbeat copied under m's key.
    genuine_other = bytes(store.get(NS + "member/0/hb"))
    end = time.monotonic() + FAST_TIMEOUT + 1.0
    n = 2
    while time.monotonic() < end:
        for forged in (
            str(n).encode(),
            b"x" * 32 + str(n).encode(),
            _sealed(OTHER, key, str(n)),
            genuine_other,
        ):
            store.set(NS + key, forged)
            time.sleep(FAST_INTERVAL / 4)
        n += 1
    assert m not in world.alive()
    assert len(_warnings_about(caplog, key)) == 1  # once per key, not once per poll


def test_replayed_older_heartbeat_is_ignored(world, caplog):
    store = _client(world)
    m = _register(store)
    key = f"member/{m}/hb"
    recorded = []
    for n in range(1, 6):
        store.set(NS + key, _sealed(SECRET, key, str(n)))
        recorded.append(bytes(store.get(NS + key)))
        time.sleep(FAST_INTERVAL * 1.5)
    assert m in world.alive()
    # m stops; a stranger replays its genuine records, older ones and the newest.
    end = time.monotonic() + 2 * FAST_TIMEOUT
    while time.monotonic() < end:
        for value in recorded:
            store.set(NS + key, value)
            time.sleep(FAST_INTERVAL / 2)
    assert m not in world.alive()
    assert len(_warnings_about(caplog, key)) == 1
    assert "replay" in _warnings_about(caplog, key)[0]


def test_forged_left_does_not_mark_a_live_member_left(world, caplog):
    joined = World.join("127.0.0.1", world.port, timeout=10, wait=False, secret=SECRET)
    gone = World.join("127.0.0.1", world.port, timeout=10, wait=False, secret=SECRET)
    m = joined.member_id
    try:
        _wait_until(lambda: {m, gone.member_id} <= world.alive(), "both joiners are seen")
        gone.leave()
        _wait_until(lambda: gone.member_id not in world.alive(), "a genuine leave is seen")
        store = _client(world)
        key = f"member/{m}/left"
        genuine_other = bytes(store.get(NS + f"member/{gone.member_id}/left"))
        for forged in (b"1", _sealed(OTHER, key, "1"), genuine_other):
            store.set(NS + key, forged)
            for _ in range(4):
                time.sleep(FAST_INTERVAL)
                assert m in world.alive() and m in world.pending_joiners()
        assert len(_warnings_about(caplog, key)) == 1
        joined.leave()  # its own, tagged "left" is taken at once
        _wait_until(lambda: m not in world.alive(), "the genuine leave is seen", FAST_TIMEOUT / 2)
    finally:
        joined.leave()


def test_forged_member_info_and_generation_records_are_ignored(world, caplog):
    store = _client(world)
    assert world.member_info(0) == (socket.gethostname(), os.getpid())
    # A stranger registers and writes what a member writes, without the secret.
    s = int(store.add(NS + "num_ids", 1)) - 1
    store.set(NS + f"member/{s}/info", "stranger 1")
    store.set(NS + "member/0/info", "stranger 1")
    for n in range(1, 6):
        store.set(NS + f"member/{s}/hb", str(n))
        time.sleep(FAST_INTERVAL)
    assert s not in world.alive() and not world.pending_joiners()
    assert world.member_info(s) is None and world.member_info(s) is None
    assert world.member_info(0) == (socket.gethostname(), os.getpid())

    # A proposal written first by the stranger loses to the members' own.
    store.set(NS + "gen/2/members", f"0,{s}")
    assert world.next_generation() == 2 and world.members == (0,)
    assert bytes(store.get(NS + "gen/2/members")) == _sealed(SECRET, "gen/2/members", "0")
    for key in (f"member/{s}/info", f"member/{s}/hb", "gen/2/members"):
        assert len(_warnings_about(caplog, key)) == 1, key  # once per key, not once per poll

    # A forged hint does not send a joiner ahead, and a forged generation listing
    # it does not admit it.
    store.set(NS + "gen/latest", "1000")
    joined = World.join("127.0.0.1", world.port, timeout=10, wait=False, secret=SECRET)
    try:
        assert joined.generation == 0
        store.set(NS + "gen/3/members", f"0,{joined.member_id}")
        with pytest.raises(MembershipError, match="was not taken into a generation"):
            joined.wait_until_admitted(timeout=1.0)
        assert joined.generation == 0
    finally:
        joined.leave()
    # Each World warns once per key (the joiner's own watcher meets the stranger too).
    for key in ("gen/latest", "gen/3/members"):
        assert len(_warnings_about(caplog, key)) == 1, key


def test_joiner_without_the_secret_is_refused_before_taking_an_id(world, caplog):
    store = _client(world)
    registered = int(store.add(NS + "num_ids", 0))
    for secret in (OTHER, None):
        with pytest.raises(MembershipError, match="secret"):
            World.join("127.0.0.1", world.port, timeout=5, wait=False, secret=secret)
    assert int(store.add(NS + "num_ids", 0)) == registered
    assert len(_warnings_about(caplog, "config")) == 1
    with pytest.raises(ValueError, match="16 bytes"):
        World.join("127.0.0.1", world.port, timeout=5, wait=False, secret=b"short")
    joined = World.join("127.0.0.1", world.port, timeout=5, wait=False, secret=SECRET)
    try:
        _wait_until(lambda: joined.member_id in world.pending_joiners(), "the joiner is seen")
    finally:
        joined.leave()
