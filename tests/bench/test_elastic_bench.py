"""bench_elastic on a tiny scenario: a node lost, a node arriving; nereus recovers live
(nothing recomputed) and admits the arrivals, checkpoint/restart stops, restarts and
reloads its own checkpoint."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks.bench_elastic import COMMON, CoreShares, Scenario, prime, run_live, run_restart

pytestmark = pytest.mark.slow

TINY = Scenario(
    steps=5, devices=4, per_node=2, loss_at=2, arrive_at=3, arrivals=1, every=1,
    # a fixed plan: the restarts' start is then the processes, the stages and the load
    options={**COMMON, "warm_steps": 30, "batch": 4, "group_size": 2, "adapt": False},
)  # fmt: skip


def test_tiny_elastic_run_nereus_against_checkpoint_restart():
    prime(TINY, 0)
    nereus = run_live(TINY, True, 0)
    assert nereus["steps_recomputed"] == 0
    assert nereus["admitted"] == 2 and nereus["devices_held_at_end"] == 4, nereus
    restart = run_restart(TINY, 0)
    # a restart pays a new job's start at each event; its build and load are measured
    assert len(restart["restart_build_s"]) == 2 and all(x > 0 for x in restart["restart_build_s"])
    assert all(x > 0 for x in restart["restart_load_s"]), restart
    # its pause at the loss holds the new job's whole start
    start = [restart[f"restart_{k}_s"][0] for k in ("spawn", "build", "load")]
    assert restart["loss_pause_s"] >= sum(start) > 0, restart
    # every job started its processes from nothing: a forkserver of its own each
    pids = restart["job_forkserver_pids"]
    assert len(pids) == 3 and all(len(p) == 1 for p in pids), pids
    assert len({p[0] for p in pids}) == 3, pids


def test_core_shares_give_each_process_its_quota_and_period():
    try:
        shares = CoreShares(0.25, 10_000)
    except OSError as e:
        pytest.skip(f"no cgroups to make here: {e}")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        shares.place(proc.pid)
        group = shares.base / f"pid{proc.pid}"
        if shares.v2:
            assert (group / "cpu.max").read_text().split() == ["2500", "10000"]
        else:
            assert (group / "cpu.cfs_quota_us").read_text().strip() == "2500"
            assert (group / "cpu.cfs_period_us").read_text().strip() == "10000"
        assert (group / "cgroup.procs").read_text().split() == [str(proc.pid)]
    finally:
        proc.kill()
        proc.wait()
        shares.close()
    assert not shares.base.exists()
