"""bench_elastic on a tiny scenario: a node lost, a node arriving; nereus recovers live
(nothing recomputed) and admits the arrivals, checkpoint/restart stops, restarts and
reloads its own checkpoint."""

from __future__ import annotations

import pytest

from benchmarks.bench_elastic import COMMON, Scenario, prime, run_live, run_restart

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
    # its pause at the loss holds the new job's whole start (on a tiny model that start,
    # forked from a warm forkserver, can be as short as Nereus's live recovery)
    start = [restart[f"restart_{k}_s"][0] for k in ("spawn", "build", "load")]
    assert restart["loss_pause_s"] >= sum(start) > 0, restart
