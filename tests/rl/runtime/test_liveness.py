"""A worker's death is known to the driver within milliseconds through its liveness
connection, for joined workers as for spawned ones, and strangers cannot use the
listener to mark anyone dead."""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket
import subprocess
import threading
import time

import pytest
from support.joiner import reap, start_joiner

from nereus_comm.world import World
from nereus_rl.runtime import Driver, WorkerLostError
from nereus_rl.runtime import liveness as L
from nereus_rl.runtime import protocol as P
from nereus_rl.runtime.abort import socket_inodes

SECRET = bytes(range(32))
# Well above what detection takes (milliseconds), far below the heartbeat's 30 s.
DETECT_BOUND_S = 2.0


def _listener(num_ranks: int = 2, deaths: list[int] | None = None) -> L.LivenessListener:
    return L.LivenessListener(
        "127.0.0.1", SECRET, lambda: num_ranks, None if deaths is None else deaths.append
    )


def _until(cond, timeout: float = DETECT_BOUND_S) -> float:
    """Seconds until ``cond()`` is true; fails after ``timeout``."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "not within the bound"
        time.sleep(0.002)
    return time.monotonic() - t0


def _closed_by_peer(sock: socket.socket, timeout: float = 5.0) -> bool:
    """True once the other end has closed ``sock`` (EOF or a reset)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
    except (ConnectionResetError, BrokenPipeError):
        pass
    except TimeoutError:
        return False
    return True


def _greeted(address: tuple[str, int]) -> tuple[socket.socket, bytes]:
    """A raw connection to the listener and the nonce it was sent."""
    sock = socket.create_connection(address, timeout=5.0)
    greeting = b""
    while len(greeting) < len(L.MAGIC) + L.NONCE_BYTES:
        greeting += sock.recv(64)
    assert greeting.startswith(L.MAGIC)
    return sock, greeting[len(L.MAGIC) :]


# ---------------------------------------------------------------- the listener alone


def test_a_connection_that_ends_without_goodbye_is_a_death():
    deaths: list[int] = []
    lst = _listener(deaths=deaths)
    try:
        assert lst.address[0] == "127.0.0.1"  # loopback only, as the store
        conn = L.connect("127.0.0.1", lst.port, SECRET, 1)
        _until(lambda: lst.connected() == {1})
        assert lst.dead() == frozenset() and lst.deaths == 0
        conn.close()  # as the kernel does for a killed process
        took = _until(lambda: lst.dead() == {1})
        assert lst.deaths == 1 and lst.left() == frozenset()
        _until(lambda: deaths == [1])  # the callback runs after the death is recorded
        print(f"death seen after {took * 1e3:.1f} ms")
    finally:
        lst.close()


def test_goodbye_or_an_expected_exit_is_no_death():
    lst = _listener()
    try:
        a = L.connect("127.0.0.1", lst.port, SECRET, 0)
        b = L.connect("127.0.0.1", lst.port, SECRET, 1)
        a.close(bye=True)
        _until(lambda: lst.left() == {0})
        lst.expect_exit()  # the driver told its workers to exit
        b.close()
        _until(lambda: lst.left() == {0, 1})
        assert lst.dead() == frozenset() and lst.deaths == 0
    finally:
        lst.close()


def _answer_wrong_secret(sock, nonce):
    sock.sendall(L.answer(b"x" * 32, nonce, 0))


def _answer_replayed(sock, nonce):
    # A genuine answer to another connection's nonce.
    sock.sendall(L.answer(SECRET, b"\0" * L.NONCE_BYTES, 0))


def _answer_garbage(sock, nonce):
    sock.sendall(os.urandom(L.HELLO_BYTES))


def _answer_oversized(sock, nonce):
    # A length prefix announcing 4 GiB, then a megabyte: read as too many bytes.
    try:
        sock.sendall(b"\xff\xff\xff\xff" + b"\0" * (1 << 20))
    except (ConnectionResetError, BrokenPipeError):
        pass  # closed on us midway


def _answer_unregistered_rank(sock, nonce):
    sock.sendall(L.answer(SECRET, nonce, 7))  # the right secret, a rank nobody has


def _answer_taken_rank(sock, nonce):
    sock.sendall(L.answer(SECRET, nonce, 0))  # rank 0 is connected already


def _answer_nothing(sock, nonce):
    pass  # silent until the handshake deadline


def _answer_close(sock, nonce):
    sock.close()


@pytest.mark.parametrize(
    "attack",
    [
        _answer_wrong_secret,
        _answer_replayed,
        _answer_garbage,
        _answer_oversized,
        _answer_unregistered_rank,
        _answer_taken_rank,
        _answer_nothing,
        _answer_close,
    ],
)
def test_a_stranger_is_refused_and_marks_nobody_dead(attack, monkeypatch, caplog):
    monkeypatch.setattr(L, "HANDSHAKE_TIMEOUT_S", 0.3)
    deaths: list[int] = []
    lst = _listener(num_ranks=2, deaths=deaths)
    try:
        worker = L.connect("127.0.0.1", lst.port, SECRET, 0)
        sock, nonce = _greeted(lst.address)
        with caplog.at_level(logging.WARNING, logger="nereus_rl.runtime"):
            attack(sock, nonce)
            if sock.fileno() >= 0:
                assert _closed_by_peer(sock)
                sock.close()
                _until(lambda: lst.rejected == 1)
                assert "refused the connection" in caplog.text
            time.sleep(0.05)
        assert lst.connected() == {0}
        assert lst.dead() == frozenset() and deaths == [] and lst.deaths == 0
        # The listener still works, and the worker's death is still seen.
        other = L.connect("127.0.0.1", lst.port, SECRET, 1)
        assert _until(lambda: lst.connected() == {0, 1}) < 1.0
        worker.close()
        _until(lambda: lst.dead() == {0})
        other.close(bye=True)
    finally:
        lst.close()


def test_a_refused_answer_fails_the_worker_side_connect():
    lst = _listener(num_ranks=1)
    try:
        with pytest.raises(ConnectionError):
            L.connect("127.0.0.1", lst.port, b"y" * 32, 0)
        with pytest.raises(ConnectionError):
            L.connect("127.0.0.1", lst.port, SECRET, 5)
        assert lst.rejected == 2 and lst.connected() == frozenset()
    finally:
        lst.close()


def test_surplus_unauthenticated_connections_are_closed(monkeypatch):
    monkeypatch.setattr(L, "MAX_PENDING", 2)
    lst = _listener()
    socks = []
    try:
        socks = [_greeted(lst.address)[0] for _ in range(2)]
        extra = socket.create_connection(lst.address, timeout=5.0)
        socks.append(extra)
        assert _closed_by_peer(extra)  # refused without a greeting
        # The pending ones do not keep a worker out once they are gone.
        for s in socks[:2]:
            s.close()
        _until(lambda: not lst._conns)  # the listener has read both ends
        assert lst.rejected == 1
        L.connect("127.0.0.1", lst.port, SECRET, 0).close(bye=True)
    finally:
        for s in socks:
            s.close()
        lst.close()


def test_close_stops_the_thread_and_closes_every_socket():
    before = socket_inodes()
    lst = _listener()
    conn = L.connect("127.0.0.1", lst.port, SECRET, 0)
    stranger, _ = _greeted(lst.address)
    lst.close()
    assert not lst._thread.is_alive()
    assert _closed_by_peer(stranger)
    stranger.close()
    conn.close()
    assert socket_inodes() - before == set()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(lst.address, timeout=5.0)
    assert lst.dead() == frozenset()  # closing is no death
    lst.close()  # idempotent


# ---------------------------------------------------------------- the driver


class _FakeWorker:
    """A worker's membership without a worker process: joins the World, connects its
    liveness connection and writes its WorkerInfo, as worker.serve does."""

    def __init__(self, d: Driver) -> None:
        secret = P.load_secret(d.secret_file)
        self.world = World.join(d.host, d.port, wait=False, secret=secret)
        self.rank = P.rank_of_member(self.world.member_id)
        port = P.unseal(secret, P.LIVENESS_KEY, bytes(d.store.get(P.LIVENESS_KEY)))
        self.conn = L.connect(d.host, port, secret, self.rank)
        key = P.info_key(self.rank)
        info = P.WorkerInfo(self.rank, socket.gethostname(), os.getpid(), 1)
        d.store.set(key, P.seal(secret, key, info))

    def leave(self) -> None:
        self.conn.close(bye=True)
        self.world.leave()


def test_driver_listens_where_its_store_does_and_publishes_the_port_sealed():
    d = Driver(heartbeat_timeout=30.0)
    try:
        port = P.unseal(P.load_secret(d.secret_file), P.LIVENESS_KEY, d.store.get(P.LIVENESS_KEY))
        assert d._liveness.address == ("127.0.0.1", port)
        with pytest.raises(P.UnauthenticatedMessageError):
            P.unseal(P.new_secret(), P.LIVENESS_KEY, d.store.get(P.LIVENESS_KEY))
    finally:
        d.shutdown()


def test_driver_sees_a_closed_connection_at_once_and_publishes_the_abort():
    d = Driver(heartbeat_timeout=30.0)
    workers: list[_FakeWorker] = []
    try:
        workers = [_FakeWorker(d) for _ in range(2)]
        assert d.wait_for_workers(2, timeout=10) == [0, 1]
        assert d.check_liveness() == ()
        # A command the dead worker never answers: the wait ends at the death.
        pending = d.submit([0, 1], "ping")
        t0 = time.monotonic()
        threading.Timer(0.3, workers[0].conn.close).start()
        with pytest.raises(WorkerLostError) as e:
            d.wait(pending, timeout=20)
        took = time.monotonic() - t0 - 0.3
        assert e.value.ranks == (0,) and took < DETECT_BOUND_S, took
        assert d.check_liveness() == (0,) and d.workers == [1]
        notice = P.unseal(P.load_secret(d.secret_file), P.abort_key(1), d.store.get(P.abort_key(1)))
        assert notice.new == (0,)
        print(f"Driver.wait raised after {took * 1e3:.1f} ms")
    finally:
        for w in workers:
            w.leave()
        d.shutdown()


def test_driver_publishes_the_abort_without_anyone_waiting():
    # Nobody calls check_liveness: the listener's thread publishes the notice itself.
    d = Driver(heartbeat_timeout=30.0)
    w = None
    try:
        w = _FakeWorker(d)
        d.wait_for_workers(1, timeout=10)
        w.conn.close()
        _until(lambda: d.store.check([P.abort_key(1)]))
        assert d._lost == {0}
    finally:
        if w is not None:
            w.leave()
        d.shutdown()


def test_a_stranger_against_a_running_job_changes_nothing(caplog):
    d = Driver(heartbeat_timeout=30.0)
    w = None
    try:
        w = _FakeWorker(d)
        d.wait_for_workers(1, timeout=10)
        with caplog.at_level(logging.WARNING, logger="nereus_rl.runtime"):
            for attack in (_answer_wrong_secret, _answer_garbage, _answer_oversized):
                sock, nonce = _greeted(d._liveness.address)
                attack(sock, nonce)
                assert _closed_by_peer(sock)
                sock.close()
        _until(lambda: d._liveness.rejected == 3)
        assert caplog.text.count("refused the connection") == 3
        assert d.check_liveness() == () and d._liveness.connected() == {0}
        assert not d.store.check([P.abort_key(1)])
    finally:
        if w is not None:
            w.leave()
        d.shutdown()


def test_driver_shutdown_stops_the_listener_and_reports_nobody_lost():
    gc.collect()
    before = socket_inodes()
    d = Driver(heartbeat_timeout=30.0)
    w = _FakeWorker(d)
    try:
        d.wait_for_workers(1, timeout=10)
    finally:
        d.shutdown()
        w.leave()
    assert d._lost == set() and d._liveness.dead() == frozenset()
    assert not any(t.name == "nereus-liveness" for t in threading.enumerate())
    del d, w
    gc.collect()
    assert socket_inodes() - before == set()


# ---------------------------------------------------------------- real workers


def _joiner(d: Driver) -> subprocess.Popen:
    # `nereus-rl worker --store HOST:PORT --secret-file PATH`, the secret from a file.
    return start_joiner(d.address, "nereus_rl.runtime.worker")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


@pytest.mark.slow
def test_a_joined_workers_sigkill_is_seen_within_seconds_not_at_the_heartbeat_timeout():
    d = Driver(heartbeat_timeout=30.0, call_timeout=60.0)
    procs: list[subprocess.Popen] = []
    try:
        procs = [_joiner(d), _joiner(d)]
        assert d.wait_for_workers(2, timeout=60) == [0, 1]
        d.import_module("tests.support.runtime_commands")
        by_pid = {p.pid: p for p in procs}
        victim = by_pid[d.infos[0].pid]
        # A stranger first: refused, and the job is unharmed.
        sock, nonce = _greeted(d._liveness.address)
        _answer_wrong_secret(sock, nonce)
        assert _closed_by_peer(sock)
        sock.close()
        assert d.call([0, 1], "ping") == {0: 0, 1: 1}
        assert d.check_liveness() == ()

        pending = d.submit([0], "test.sleep", 30.0)
        time.sleep(0.2)
        os.kill(victim.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerLostError) as e:
            d.wait(pending)
        took = time.monotonic() - t0
        print(f"joined worker's SIGKILL seen after {took:.3f} s (heartbeat timeout 30 s)")
        assert e.value.ranks == (0,)
        assert took < DETECT_BOUND_S, f"took {took:.1f} s"
        assert d.workers == [1] and d.call([1], "ping") == {1: 1}
    finally:
        d.shutdown()
        for p in procs:
            _stop(p)


@pytest.mark.slow
def test_a_job_with_spawned_and_joined_workers_shuts_down_with_nobody_lost():
    d = Driver(heartbeat_timeout=30.0)
    proc = None
    try:
        d.spawn_local(1, method="forkserver")
        proc = _joiner(d)
        assert d.wait_for_workers(2, timeout=60) == [0, 1]
        _until(lambda: d._liveness.connected() == {0, 1}, timeout=10)
        assert d.call([0, 1], "ping") == {0: 0, 1: 1}
    finally:
        d.shutdown()
        if proc is not None:
            reap(proc)  # it exits on its own once told to
    assert proc.returncode == 0
    assert d._lost == set() and d._liveness.dead() == frozenset()
    assert not any(t.name == "nereus-liveness" for t in threading.enumerate())
