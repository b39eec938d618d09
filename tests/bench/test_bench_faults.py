"""bench_faults's helpers: percentiles, the /dev/shm diff and its attribution, finding
a run's worker processes in /proc, kill moments and recovery rows; and (slow) one short
``nereus-rl train`` with one worker killed mid-step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from benchmarks.bench_faults import (
    JsonlTail,
    KillSpec,
    Timings,
    _kill_at,
    descendants,
    find_workers,
    group_members,
    kill_group,
    kill_specs,
    lost_devices,
    percentile,
    recovery_seconds,
    recovery_wall_start,
    run_one,
    shm_diff,
    shm_owner,
    shm_snapshot,
    split_left,
    train_command,
)


def test_percentile_interpolates_like_numpy():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 5.0
    assert percentile(xs, 95) == pytest.approx(4.8)  # numpy.percentile(xs, 95)
    assert percentile([2.0], 95) == 2.0
    assert percentile([], 50) is None


def test_shm_diff_and_attribution(tmp_path):
    (tmp_path / "old").write_bytes(b"x" * 3)
    before = shm_snapshot(str(tmp_path))
    (tmp_path / "nereus-shm-4026531836-111-r0to1-abc").write_bytes(b"y" * 10)
    (tmp_path / "nereus-shm-4026531836-222-r1to0-def").write_bytes(b"y" * 7)
    (tmp_path / "torch_333_1_0").write_bytes(b"")
    (tmp_path / "sem.mp-zz").write_bytes(b"z")
    (tmp_path / "old").write_bytes(b"x" * 30)  # there before: never counted
    left = shm_diff(before, shm_snapshot(str(tmp_path)))
    assert left == {
        "nereus-shm-4026531836-111-r0to1-abc": 10,
        "nereus-shm-4026531836-222-r1to0-def": 7,
        "sem.mp-zz": 1,
        "torch_333_1_0": 0,
    }
    assert shm_owner("nereus-shm-4026531836-111-r0to1-abc") == 111
    assert shm_owner("torch_333_1_0") == 333 and shm_owner("sem.mp-zz") is None
    counted, foreign = split_left(left, ours={111, 333})
    # a file naming another pid is another job's; one naming none is counted
    assert set(counted) == {"nereus-shm-4026531836-111-r0to1-abc", "sem.mp-zz", "torch_333_1_0"}
    assert set(foreign) == {"nereus-shm-4026531836-222-r1to0-def"}
    assert shm_snapshot(str(tmp_path / "absent")) == {}


_TREE = """
import subprocess, sys, time
kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                          "nereus_rl.runtime.worker"]) for _ in range(3)]
other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(" ".join(str(p.pid) for p in kids + [other]), flush=True)
time.sleep(60)
"""


def test_find_workers_in_a_process_tree_and_kill_the_group():
    # A "driver" with three worker-like children (the runtime's module name on their
    # command line, spawned in order) and one other child, in a process group of its own.
    root = subprocess.Popen(
        [sys.executable, "-c", _TREE], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        pids = [int(x) for x in root.stdout.readline().split()]
        kids, other = pids[:3], pids[3]
        assert {p.pid for p in descendants(root.pid)} == set(pids)
        assert find_workers(root.pid) == kids  # spawn order
        assert set(group_members(root.pid)) == {root.pid, *pids}
        os.kill(kids[1], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while kids[1] in find_workers(root.pid) and time.monotonic() < deadline:
            time.sleep(0.05)  # a zombie until its parent reaps it: not a worker either way
        assert find_workers(root.pid) == [kids[0], kids[2]]
        assert other not in find_workers(root.pid)
    finally:
        kill_group(root.pid)
        root.wait(timeout=10)
    deadline = time.monotonic() + 10
    while group_members(root.pid) and time.monotonic() < deadline:
        time.sleep(0.05)  # the orphans are reaped by init
    assert group_members(root.pid) == []
    kill_group(root.pid)  # gone already: nothing to do


def test_kill_specs_repeatable_and_every_phase():
    a = kill_specs(7, 20, 5, 40, move_steps=[12, 30])
    assert a == kill_specs(7, 20, 5, 40, move_steps=[12, 30])
    assert a != kill_specs(8, 20, 5, 40, move_steps=[12, 30])
    singles = [s for s in a if s.kind == "single"]
    assert len(singles) == 20 and len([s for s in a if s.kind == "node"]) == 5
    assert sorted(s.phase for s in singles).count("startup") == 5
    assert all(s.step in (12, 30) for s in a if s.phase == "transition")
    assert all(1 <= s.step <= 38 and 0 <= s.frac < 1 for s in a)


def test_kill_moments():
    t = Timings(startup_s=4.0, step_s=0.1, sync_s=0.02, moves={3: 0.5})
    start = KillSpec(0, "single", "startup", 0.5, 2, 0)
    assert _kill_at(start, t, None, []) is None  # workers not all there yet
    assert _kill_at(start, t, 100.0, []) == pytest.approx(102.0)
    step = KillSpec(0, "single", "step", 0.5, 3, 0)
    assert _kill_at(step, t, 100.0, [110.0, 110.1]) is None  # step 3 not started
    rows = [110.0, 110.1, 110.2]
    assert _kill_at(step, t, 100.0, rows) == pytest.approx(110.2 + 0.04)
    sync = KillSpec(0, "single", "weight_sync", 0.5, 3, 0)
    assert _kill_at(sync, t, 100.0, rows) == pytest.approx(110.2 + 0.1 - 0.01)
    move = KillSpec(0, "single", "transition", 0.5, 3, 0)
    assert _kill_at(move, t, 100.0, rows) == pytest.approx(110.2 + 0.1 + 0.25)


def test_recovery_row_fields():
    flat = {"path": "urgent", "recovery": "emu", "measured_transition_s": 0.4,
            "recovery_rounds": [{"lost_devices": [2]}, {"lost_devices": [3, 2]}]}  # fmt: skip
    assert recovery_seconds(flat) == 0.4 and lost_devices(flat) == [2, 3]
    assert recovery_wall_start(flat) is None
    nested = {"path": "urgent", "recovery": {"measured_s": 1.5, "rounds": [{"lost_devices": [0]}],
              "started_at": 1700000000.5}, "measured_transition_s": 9.0}  # fmt: skip
    assert recovery_seconds(nested) == 1.5 and lost_devices(nested) == [0]
    assert recovery_wall_start(nested) == 1700000000.5


def test_jsonl_tail_reads_whole_lines_only(tmp_path):
    path = tmp_path / "m.jsonl"
    tail = JsonlTail(path)
    assert tail.poll() == []  # not there yet
    with open(path, "w") as f:
        f.write(json.dumps({"step": 0}) + "\n" + '{"step": ')
    assert tail.poll() == [{"step": 0}]
    with open(path, "a") as f:
        f.write("1}\n")
    assert tail.poll() == [{"step": 1}] and len(tail.seen) == 2


@pytest.mark.slow  # one short `nereus-rl train` (~15 s on 2 idle cores)
def test_one_run_with_a_worker_killed_mid_step(tmp_path):
    steps = 6
    run_dir = tmp_path / "run"
    spec = KillSpec(0, "single", "step", 0.5, 3, 1)
    row = run_one(
        "kill", train_command(steps, run_dir, True, []), run_dir, steps, spec=spec, timeout=150
    )
    assert row["stragglers"] == [] and row.get("victims")
    assert row["intact"], row["why"] + "\n" + row["log_tail"]
    assert row["recover_s"] is not None and row["detect_s"] is not None
