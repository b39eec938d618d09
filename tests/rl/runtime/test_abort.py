"""Aborting survivors' collectives when the driver learns of a death.

The failure ended here: survivor 0 waits in a gloo op on survivor 1, which is
alive but has left it, while worker 2 dies; without an abort, 0 waits out its
group timeout (60 s).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch.distributed as dist

from nereus_rl.runtime import Driver, RemoteError
from nereus_rl.runtime import protocol as P
from nereus_rl.runtime.abort import AbortState, AbortWatcher

ROOT = str(Path(__file__).resolve().parents[3])
SECRET = bytes(range(32))
GROUP_TIMEOUT = 60.0
# Detection plus abort for a local worker: the driver's kill (or its next 0.2 s
# liveness check) writes the notice; the watchers are woken by its arrival.
ABORT_BOUND_S = 5.0


class _Touch:
    """Unpickling this creates the file ``path``, as an attacker's code would."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _until(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_forged_abort_notices_are_ignored(tmp_path, caplog):
    store = dist.HashStore()
    state = AbortState(0)
    watcher = AbortWatcher(store, SECRET, state).start()
    try:
        state.begin(0)  # a command runs: a genuine notice marks it aborted
        with caplog.at_level(logging.WARNING, logger="nereus_rl.runtime"):
            # Another secret's tag: rejected before anything is unpickled.
            forged = P.seal(bytes(32), P.abort_key(1), _Touch(str(tmp_path / "ran")))
            store.set(P.abort_key(1), forged)
            assert _until(lambda: "ignored an abort notice" in caplog.text)
        time.sleep(2 * 0.2)
        assert not (tmp_path / "ran").exists()
        assert state.epoch == 0 and state.lost_ranks() == frozenset() and not state.aborted()

        # The driver's own notice, written over the forgery, is taken.
        genuine = P.seal(SECRET, P.abort_key(1), P.AbortNotice(1, (2,), (2,)))
        store.set(P.abort_key(1), genuine)
        assert _until(lambda: state.epoch == 1)
        assert state.lost_ranks() == {2} and state.aborted()

        # A genuine notice copied under the next epoch's key fails its check, and so
        # does a tagged message that is not a notice of that epoch.
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="nereus_rl.runtime"):
            store.set(P.abort_key(2), genuine)
            assert _until(lambda: "ignored an abort notice" in caplog.text)
            caplog.clear()
            store.set(P.abort_key(2), P.seal(SECRET, P.abort_key(2), P.AbortNotice(5, (7,), (7,))))
            assert _until(lambda: "ignored an abort notice" in caplog.text)
        time.sleep(2 * 0.2)
        assert state.epoch == 1 and state.lost_ranks() == {2}

        store.set(P.abort_key(2), P.seal(SECRET, P.abort_key(2), P.AbortNotice(2, (2, 3), (3,))))
        assert _until(lambda: state.epoch == 2)
        assert state.lost_ranks() == {2, 3}
    finally:
        state.end()
        watcher._stop.set()
        store.set(P.abort_key(state.epoch + 1), b"")  # wakes its wait: it sees the stop
        watcher.stop()
        assert not watcher._thread.is_alive()


def test_abort_hooks_run_for_groups_with_a_lost_member_while_a_command_runs(caplog):
    # The hook stands in for an NCCL communicator's abort (no GPU here): what is tested
    # is when AbortState calls it, not NCCL.
    state = AbortState(0)
    calls: list[str] = []
    with state.track("world", (0, 1, 2)):
        pass
    with state.track("pair", (0, 1)):
        pass
    state.on_abort("world", lambda: calls.append("world"))
    state.on_abort("pair", lambda: calls.append("pair"))

    state.apply(P.AbortNotice(1, (2,), (2,)))  # idle: nothing in flight to abort
    assert calls == []
    state.begin(1)  # a command sent after notice 1: notice 1 is not its
    state.apply(P.AbortNotice(1, (2,), (2,)))
    assert calls == []
    state.apply(P.AbortNotice(2, (2, 3), (3,)))  # 2 and 3 lost: only "world" has them
    assert calls == ["world"]
    state.end()

    def broken() -> None:
        raise RuntimeError("abort failed")

    state.on_abort("world", broken)
    state.begin(2)
    with caplog.at_level(logging.WARNING, logger="nereus_rl.runtime"):
        state.apply(P.AbortNotice(3, (1, 2, 3), (1,)))  # now "pair" too
    assert calls == ["world", "pair"]  # the failing hook is logged, the other still runs
    assert "abort hook failed" in caplog.text
    state.untrack("pair")
    state.begin(3)
    state.apply(P.AbortNotice(4, (0, 1, 2, 3), (0,)))
    assert calls == ["world", "pair"]  # an untracked group's hook is gone
    state.end()


def test_abort_breaks_only_the_running_commands_connections():
    # In a process of its own: it shuts down TCP connections of the process it runs in.
    out = subprocess.run(
        [sys.executable, "-c", "from tests.support.abort_commands import "
         "check_break_connections as c; c()"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr


# ---------------------------------------------------------------- multi-process


def _start(joined: bool) -> tuple[Driver, subprocess.Popen | None]:
    """A driver with workers 0 and 1 local, and 2 local or started by hand (then with a
    30 s heartbeat timeout: its death must be seen through its liveness connection)."""
    d = Driver(heartbeat_timeout=30.0 if joined else 2.0, call_timeout=120.0)
    proc = None
    try:
        d.spawn_local(2 if joined else 3, group_timeout=GROUP_TIMEOUT, method="forkserver")
        if joined:
            proc = subprocess.Popen(
                [sys.executable, "-m", "nereus_rl.runtime.worker", "--store", d.address,
                 "--secret-file", str(d.secret_file), "--group-timeout", str(GROUP_TIMEOUT)],
                cwd=ROOT, env={**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"},
            )  # fmt: skip
        assert d.wait_for_workers(3, timeout=60) == [0, 1, 2]
        d.import_module("tests.support.abort_commands")
    except BaseException:
        _stop(d, proc)
        raise
    return d, proc


def _stop(d: Driver, proc: subprocess.Popen | None) -> None:
    d.shutdown()
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()


def _init_world(d: Driver, workers: list[int]) -> None:
    prefix = f"test.world.{uuid.uuid4().hex[:8]}/"
    pend = [
        d.submit([w], "abort.init_world", i, len(workers), prefix) for i, w in enumerate(workers)
    ]
    for p in pend:
        d.wait(p)


@pytest.mark.slow
@pytest.mark.parametrize(
    "dead, group",
    [("local", "runtime"), ("local", "world"), ("joined", "runtime")],
)
def test_survivor_waiting_on_a_live_peer_is_aborted_at_once(dead, group):
    d, proc = _start(joined=dead == "joined")
    try:
        # A group of survivors only: an abort leaves it usable.
        assert d.call([0, 1], "abort.allreduce", 2001, (0, 1)) == {0: 3.0, 1: 3.0}
        if group == "runtime":
            d.call([0, 1, 2], "make_group", 1001, (0, 1, 2))
            pending = d.submit([0, 1], "abort.wait_on_peer", 1001, (0, 1, 2), 0, 1)
        else:  # the default group, formed as the trainer's rl.init does
            _init_world(d, [0, 1, 2])
            pending = d.submit([0, 1], "abort.world_wait_on_peer", (0, 1, 2), 0, 1)
        time.sleep(0.5)  # 0 waits on 1, which returned: it left the op
        if dead == "local":
            t0 = time.monotonic()
            d.kill(2)
            bound = ABORT_BOUND_S
        else:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            t0 = time.monotonic()
            bound = ABORT_BOUND_S  # its liveness connection closed, not its heartbeat
        with pytest.raises(RemoteError) as e:
            d.wait(pending)
        took = time.monotonic() - t0
        print(f"abort after {took:.2f} s ({dead} death, {group} group)")
        assert e.value.rank == 0
        assert took < bound, f"took {took:.1f} s: {e.value}"
        assert "aborted=True" in e.value.error and "lost=[2]" in e.value.error, e.value.error
        assert d.check_liveness() == (2,)

        state = d.call([0, 1], "abort.state")
        # Worker 1 was idle (its command had returned): nothing of its broke.
        assert state == {0: (1, [2], 1), 1: (1, [2], 0)}
        assert d.call([0, 1], "abort.allreduce", 2001, (0, 1)) == {0: 3.0, 1: 3.0}
        # Recovery: new groups over the survivors work.
        _init_world(d, [0, 1])
        assert d.call([0, 1], "abort.world_allreduce") == {0: 3.0, 1: 3.0}
        assert d.call([0, 1], "abort.allreduce", 3001, (0, 1)) == {0: 3.0, 1: 3.0}
        # The recovery's commands were sent after the notice: they were not broken.
        assert d.call([0, 1], "abort.state") == state
    finally:
        _stop(d, proc)


@pytest.mark.slow
def test_a_worker_joining_after_an_abort_learns_the_losses_and_is_not_broken():
    d, proc = _start(joined=False)
    try:
        d.kill(2)
        joiner = subprocess.Popen(
            [sys.executable, "-m", "nereus_rl.runtime.worker", "--store", d.address,
             "--secret-file", str(d.secret_file)],
            cwd=ROOT, env={**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"},
        )  # fmt: skip
        try:
            assert d.wait_for_workers(4, timeout=60) == [0, 1, 2, 3]
            assert d.call([0, 1, 3], "abort.allreduce", 4001, (0, 1, 3)) == {
                0: 7.0, 1: 7.0, 3: 7.0
            }  # fmt: skip
            assert d.call([3], "abort.state") == {3: (1, [2], 0)}
        finally:
            d.shutdown()
            if joiner.poll() is None:
                joiner.kill()
            joiner.wait()
    finally:
        _stop(d, proc)


def test_watcher_thread_is_a_daemon():
    # A worker's main loop returning must end its process whatever the watcher does.
    w = AbortWatcher(dist.HashStore(), SECRET, AbortState(0))
    assert w._thread.daemon and isinstance(w._thread, threading.Thread)
