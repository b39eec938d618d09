"""Driver/worker runtime on local CPU workers: calls, errors, timeouts, joins, loss."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nereus_rl.runtime import (
    Driver,
    RemoteError,
    RuntimeUserError,
    StoreUnreachableError,
    WorkerLostError,
    WorkerTimeoutError,
)
from nereus_rl.runtime.protocol import SECRET_ENV
from nereus_rl.runtime.worker import connect_store
from nereus_rl.runtime.worker import main as worker_main

# Multi-process: out of the fast lane (-m "not slow").
pytestmark = pytest.mark.slow

ROOT = str(Path(__file__).resolve().parents[3])


@pytest.fixture(scope="module")
def driver():
    d = Driver(heartbeat_timeout=2.0, call_timeout=30.0)
    try:
        ranks = d.spawn_local(2, num_threads=1, method="forkserver")
        assert sorted(ranks) == [0, 1]
        d.import_module("tests.support.runtime_commands")
        yield d
    finally:
        d.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_call_returns_each_workers_value(driver):
    assert driver.call([0, 1], "ping") == {0: 0, 1: 1}
    assert driver.call([1], "ping") == {1: 1}
    assert driver.call([0, 1], "test.threads") == {0: 1, 1: 1}
    # each spawned worker's process id (a benchmark places it in a cgroup of its own)
    assert driver.call([0, 1], "test.pid") == {r: driver.pid(r) for r in (0, 1)}
    with pytest.raises(RuntimeUserError, match="worker 7 was not spawned by this driver"):
        driver.pid(7)


@pytest.mark.skipif(
    not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
    reason="no transparent huge pages in this kernel",
)
def test_local_workers_allocate_transparent_huge_pages(driver):
    # Fresh state faults in 2 MiB pages: torch's allocator aligns and madvises.
    assert driver.call([0, 1], "test.huge_page_advised") == {0: ("1", True), 1: ("1", True)}


def test_remote_error_names_worker_and_carries_traceback(driver):
    with pytest.raises(RemoteError) as e:
        driver.call([0, 1], "test.fail", "boom")
    assert e.value.rank == 0 and e.value.error_type == "ValueError"
    assert "boom on 0" in str(e.value) and "runtime_commands.py" in e.value.remote_traceback
    # The workers survive a failed command.
    assert driver.call([0, 1], "ping") == {0: 0, 1: 1}


def test_messages_over_the_store_limit_travel_in_parts(driver):
    n = 20 * 2**20 + 3  # the store refuses single values over 8 MiB
    got = driver.call([0, 1], "test.big", n)
    want = torch.arange(n, dtype=torch.int64).to(torch.uint8)
    assert all(torch.equal(t, want) for t in got.values())
    with pytest.raises(RemoteError, match="cannot be pickled"):
        driver.call([1], "test.unpicklable")
    assert driver.call([0, 1], "ping") == {0: 0, 1: 1}


def test_unknown_command_and_rank_are_user_errors(driver):
    with pytest.raises(RemoteError, match="no command 'nope'"):
        driver.call([1], "nope")
    with pytest.raises(RuntimeUserError, match="no joined worker with rank"):
        driver.call([7], "ping")


def test_timeout_names_the_silent_worker(driver):
    t0 = time.monotonic()
    with pytest.raises(WorkerTimeoutError) as e:
        driver.call([0, 1], "test.sleep", 2.0, only=(1,), timeout=0.5)
    assert time.monotonic() - t0 < 1.5
    assert e.value.ranks == (1,) and "[1]" in str(e.value)
    # The late command still runs; the next call queues behind it.
    assert driver.call([0, 1], "ping", timeout=10) == {0: 0, 1: 1}


def test_gloo_group_between_workers_is_created_once(driver):
    first = driver.call([0, 1], "test.allreduce", 1001, (0, 1))
    assert {r: v[0] for r, v in first.items()} == {0: 3.0, 1: 3.0}
    again = driver.call([0, 1], "test.allreduce", 1001, (0, 1))
    assert all(v == (3.0, 0.0) for v in again.values())  # cached: no setup time
    assert driver.call([0, 1], "groups") == {0: [1001], 1: [1001]}
    assert driver.call([0, 1], "release_groups", [1001]) == {0: 1, 1: 1}
    assert driver.call([0, 1], "groups") == {0: [], 1: []}


def test_memory_report(driver):
    mem = driver.call([0], "memory")[0]
    assert mem["rss_bytes"] > 10 * 2**20 and mem["held_tensor_bytes"] == 0


def test_unreachable_store_is_named_after_bounded_wait(capsys, monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "00" * 32)
    port = _free_port()
    t0 = time.monotonic()
    with pytest.raises(StoreUnreachableError, match=f"127.0.0.1:{port}"):
        connect_store("127.0.0.1", port, 1.0)
    assert time.monotonic() - t0 < 10
    # The worker's entry point (what `python -m nereus_rl.runtime.worker` runs).
    t0 = time.monotonic()
    assert worker_main(["--store", f"127.0.0.1:{port}", "--connect-timeout", "1"]) == 2
    assert time.monotonic() - t0 < 10
    assert f"127.0.0.1:{port}" in capsys.readouterr().err


def test_worker_started_by_hand_joins_and_its_loss_is_noticed(driver):
    proc = subprocess.Popen(
        [sys.executable, "-m", "nereus_rl.runtime.worker", "--store", driver.address,
         "--secret-file", str(driver.secret_file)],
        cwd=ROOT, env={**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"},
    )  # fmt: skip
    try:
        ranks = driver.wait_for_workers(3, timeout=60)
        assert ranks == [0, 1, 2] and driver.infos[2].pid == proc.pid
        # It learned the test commands the others were told to import.
        assert driver.call([2], "test.threads") == {2: 1}
        assert driver.check_liveness() == ()
        pending = driver.submit([2], "test.sleep", 30.0)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        t0 = time.monotonic()
        with pytest.raises(WorkerLostError) as e:
            driver.wait(pending)
        assert e.value.ranks == (2,)
        # seen through its liveness connection, before its heartbeat could say it
        assert time.monotonic() - t0 < min(1.5, driver.heartbeat_timeout)
        assert driver.workers == [0, 1]
        with pytest.raises(WorkerLostError, match="lost") as e:
            driver.call([2], "ping")
        assert e.value.ranks == (2,)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
