"""A job's control traffic on a real store: who can listen, who can join, who can command."""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import time

import pytest
from support.joiner import NO_SECRET, reap, start_joiner
from support.net import listeners

from nereus_comm.world import listen_store
from nereus_rl.runtime import Driver
from nereus_rl.runtime import protocol as P
from nereus_rl.runtime.worker import connect_store

# Multi-process: out of the fast lane (-m "not slow").
pytestmark = pytest.mark.slow


class _Touch:
    """Unpickling this creates the file ``path`` (builtins.open), as an attacker's code would."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    """A job with one spawned worker, whose stderr goes to ``driver.worker_log``."""
    d = Driver(heartbeat_timeout=2.0, call_timeout=30.0)
    d.worker_log = tmp_path_factory.mktemp("worker") / "stderr"
    try:
        # The worker inherits our fd 2: point it at a file while it starts.
        with open(d.worker_log, "w") as log:
            saved = os.dup(2)
            os.dup2(log.fileno(), 2)
            try:
                assert d.spawn_local(1, num_threads=1, method="subprocess") == [0]
            finally:
                os.dup2(saved, 2)
                os.close(saved)
        d.import_module("tests.support.runtime_commands")
        yield d
    finally:
        d.shutdown()


def test_store_listens_on_loopback_only(driver):
    # 0100007F is 127.0.0.1; the wildcard would be 00000000 (tcp) or all zeros (tcp6).
    assert listeners(driver.port) == [("/proc/net/tcp", "0100007F")]
    store = listen_store("127.0.0.1", 0, timeout=5.0)
    assert listeners(store.port) == [("/proc/net/tcp", "0100007F")]


def test_secret_is_in_no_command_line_and_its_file_is_private(driver):
    secret = P.parse_secret(driver.secret_file.read_text(), "the driver's file")
    pid = driver.infos[0].pid
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmdline = f.read()
    assert b"nereus_rl.runtime.worker" in cmdline  # the right process
    assert secret.hex().encode() not in cmdline.lower() and secret not in cmdline
    assert driver.secret_file.stat().st_mode & 0o777 == 0o600


def test_stranger_cannot_command_a_worker_or_join(driver, tmp_path, caplog):
    """The issue's attack: a process that knows only the port writes a pickled object
    under a worker's next command key, another under its reply key, and a fake
    joiner's WorkerInfo. None of them runs; each is rejected and logged; the job answers."""
    stranger = connect_store("127.0.0.1", driver.port, 10.0)
    ran = [tmp_path / f"ran-{i}" for i in range(3)]
    seq = driver._seq[0]  # the worker waits on this key now
    cmd_key = P.cmd_key(0, seq)
    stranger.set(cmd_key, b"w" + pickle.dumps(_Touch(str(ran[0]))))
    fake_rank = P.rank_of_member(stranger.add(P.WORLD_NUM_IDS_KEY, 1) - 1)
    stranger.set(P.info_key(fake_rank), pickle.dumps(_Touch(str(ran[1]))))

    # The worker rejects the command and says so on its stderr.
    deadline = time.monotonic() + 20
    while cmd_key not in driver.worker_log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert f"rejected the message under {cmd_key!r}" in driver.worker_log.read_text()

    with caplog.at_level(logging.WARNING, "nereus_rl.runtime"):
        assert driver.workers == [0]  # the fake joiner is not a worker
        assert f"rejected the message under {P.info_key(fake_rank)!r}" in caplog.text
        assert driver.call([0], "ping") == {0: 0}  # the genuine command runs after the forged one

        pending = driver.submit([0], "test.sleep", 1.0)
        reply_key = P.reply_key(0, pending.seqs[0])
        stranger.set(reply_key, b"w" + pickle.dumps(_Touch(str(ran[2]))))
        # A forged reply written before the worker's own is rejected; the genuine one,
        # written over it, is taken.
        assert driver.wait(pending) == {0: 0}
        assert f"rejected the message under {reply_key!r}" in caplog.text
    assert not any(p.exists() for p in ran)
    assert driver.call([0], "ping") == {0: 0}
    assert sorted(driver.infos) == [0]


def test_joiner_with_the_secret_file_joins_and_others_are_refused(tmp_path):
    wrong = P.write_secret_file(tmp_path / "other" / "job.secret", P.new_secret())
    d = Driver(heartbeat_timeout=2.0, call_timeout=30.0)
    refused, joiner = [], None
    try:
        refused = [
            start_joiner(d.address, "nereus_rl.runtime.worker", secret_file=NO_SECRET),
            start_joiner(d.address, secret_file=str(wrong)),
        ]
        joiner = start_joiner(d.address)
        for proc in refused:
            assert proc.wait(60) == 2  # stopped before joining, with a message
        assert d.wait_for_workers(1, timeout=60) == [0]
        assert d.infos[0].pid == joiner.pid
        assert d.call([0], "ping") == {0: 0}
        assert d.workers == [0]
    finally:
        d.shutdown()
        for proc in [*refused, joiner]:
            reap(proc)


def test_refused_joiner_says_why(driver):
    env = {k: v for k, v in os.environ.items() if k != P.SECRET_ENV}
    proc = subprocess.run(
        [sys.executable, "-m", "nereus_rl.runtime.worker", "--store", driver.address],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "--secret-file" in proc.stderr and "Traceback" not in proc.stderr


def test_shutdown_removes_the_secret_file():
    d = Driver(heartbeat_timeout=2.0)
    path = d.secret_file
    assert path.exists() and path == P.secret_file_for("127.0.0.1", d.port)
    d.shutdown()
    assert not path.exists()
