"""Local workers that die while starting: replaced, or a clear error and no process left."""

from __future__ import annotations

import subprocess
import sys

import pytest

import nereus_rl.runtime.driver as driver_mod
from nereus_rl.runtime import Driver, WorkerLostError

# Multi-process: out of the fast lane (-m "not slow").
pytestmark = pytest.mark.slow


def _failing_popen(fail: int, started: list):
    """subprocess.Popen whose first ``fail`` calls start a process that exits at once."""
    real = subprocess.Popen

    def popen(cmd, *args, **kwargs):
        if len(started) < fail:
            cmd = [sys.executable, "-c", "import sys; sys.exit(3)"]
        p = real(cmd, *args, **kwargs)
        started.append(p)
        return p

    return popen


def test_a_worker_that_dies_before_joining_is_replaced(monkeypatch):
    started: list = []
    monkeypatch.setattr(driver_mod.subprocess, "Popen", _failing_popen(1, started))
    with Driver(heartbeat_timeout=30.0) as d:
        ranks = d.spawn_local(2)
        assert len(ranks) == 2 and sorted(d.workers) == sorted(ranks)
        assert d.call(ranks, "ping") == {r: r for r in ranks}
    assert len(started) == 3  # the one that died, and two that joined


def test_workers_that_keep_dying_end_the_start_with_a_clear_error_and_no_process_left(
    monkeypatch,
):
    started: list = []
    monkeypatch.setattr(driver_mod.subprocess, "Popen", _failing_popen(100, started))
    with Driver(heartbeat_timeout=30.0) as d:
        with pytest.raises(WorkerLostError, match="before joining, after 3 restarts"):
            d.spawn_local(2)
    assert len(started) == 2 + driver_mod.SPAWN_RESTARTS
    assert all(p.poll() is not None for p in started)
