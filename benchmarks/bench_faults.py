"""Fault injection on the stock ``nereus-rl train``: SIGKILL workers at random moments.

Each run is ``python -m nereus_rl.cli train`` in a process group of its own; this
script watches its run folder and SIGKILLs worker processes (never the driver) at a
moment chosen per run from the bench's ``--seed``:

    startup       after every worker process exists, before the first metrics row
                  (a uniform fraction of the pilot run's start-up)
    step          inside a step: a uniform 10-70% of the pilot's median step after the
                  previous step's row appeared
    weight_sync   inside the weight sync that ends a step (the pilot's median ``sync_s``
                  before the step's end)
    transition    inside a plan transition: at a step whose boundary moved in the pilot,
                  a uniform fraction of that move's seconds after the step's end (no move
                  in the pilot: a weight_sync kill instead, flagged in the row)

Kinds: ``single`` kills one worker drawn at random; ``node`` kills every worker of one
of two failure domains at once (runs started with ``--nodes 2`` when the CLI has the
option). Workers are the CLI process's descendants running ``nereus_rl.runtime.worker``
(``Driver.spawn_local``'s subprocess method), or forked by a forkserver. The driver
numbers workers, and so plan devices, in the order they join, which is not spawn order
(the workers import torch side by side and finish in any order); nothing outside the
run shows a worker's number, so a worker's device is taken as its place in the order in
which each was first seen holding a socket (its store connection, opened after its
imports, just before it joins; polled every 20 ms; unseen ones last, in spawn order).
Each row keeps the devices the recovery row says were lost beside the ones this guess
killed, and a node run says whether the lost ones were one node's (``node_aligned``).

Before the kill runs, one pilot run without a kill (same arguments) gives the timings the
moments are drawn from, and the mirror's cost is measured side by side: the same fixed
plan (``MIRROR_PLAN``), no kill, with and without ``--no-mirror``, interleaved; the cost is
the ratio of the median ``step_s`` (step 0, which pays the first weight sync, left out),
with step+boundary beside it in case the mirror's copy runs at the boundary.

A kill run "finished with the state intact" when the CLI exits 0, the run folder records
no error (no ``error.txt``, no "stopped early" in ``summary.txt``), every step is in
``metrics.jsonl`` and ``decisions.jsonl`` has a recovery row (or, for a worker killed
before it joined, the driver's log says it started another in its place: it held
nothing). Node-kill runs give each worker ``NODE_BUDGET`` bytes, under which the run
fits on the surviving node. Recovery time is that row's
measured seconds (``recovery.measured_s`` or ``outcome.measured_s`` where the row nests
them, else ``measured_transition_s``). Detection time runs from this script's
``time.time()`` at the kill to the recovery's start: a wall-clock start the row carries
(``recovery_started_at``, ``started_at``, ``detected_at``, ``wall_start``; seconds since
the epoch), else the modification time of ``decisions.jsonl`` when the row appeared
minus its measured seconds (the row is written and flushed as the recovery ends; the
row's ``detect_source`` says which). /dev/shm is listed before and after everything; a
file left behind counts unless its name carries a pid that is not one of the runs'
processes (``nereus-shm-<pidns>-<pid>-...``, ``torch_<pid>_...``: another job's).

Options the trainer may not have yet (``--nodes``, ``--no-mirror``) are looked up in
``nereus-rl train --help``: without ``--nodes`` the node runs still kill half the workers
(of a run not told about nodes, flagged); without ``--no-mirror`` the mirror's cost is
null with the reason.

    python benchmarks/bench_faults.py --quick --json /tmp/bench_faults.json
    python benchmarks/bench_faults.py --json /tmp/bench_faults.json   # 20 + 5 runs

--quick: 4 single kills (one per moment) and 1 node kill of 16-step ``--quick`` runs;
the full run: 20 single (5 per moment) and 5 node kills of 40-step default-sized runs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PHASES = ("startup", "step", "weight_sync", "transition")
SHM_DIR = "/dev/shm"
# nereus_comm.transport_shm.NAME_PREFIX (not imported: importing nereus_comm loads torch
# and the native core into a process that only watches)
SHM_PREFIX = "nereus-shm-"
# Keys a recovery row may carry its wall-clock start under (seconds since the epoch).
# The mirror's cost is measured on one fixed plan for every run (an "auto" first plan
# follows the calibration's timings and differs from run to run): disaggregated puts
# actor_train's two units on node 1, so with two nodes the stage is exposed and every
# step copies it on both units and mirrors it to node 0, the most the snapshot does.
MIRROR_PLAN = ("--no-adapt", "--plan", "disaggregated", "--nodes", "2")

# The driver's log line when a local worker died before joining and was replaced.
REPLACED = "starting another in its place"
# Node-kill runs: per-worker memory under which the run fits on one node (2 of the 4
# devices). The automatic budget is sized to force moves on all 4 and holds the later
# steps' responses on no plan of 2, so a run that lost a node could not go on there.
NODE_BUDGET = 8 << 20

WALL_KEYS = ("recovery_started_at", "started_at", "detected_at", "wall_start")
GOAL_RECOVERY_P95_S = 5.0
GOAL_MIRROR_COST = 0.05


# ------------------------------------------------------------------ pure helpers


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) by linear interpolation between order statistics
    (numpy's default); None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def shm_snapshot(path: str = SHM_DIR) -> dict[str, int]:
    """File name -> size in bytes of every entry in ``path`` (empty if unreadable)."""
    out = {}
    try:
        names = os.listdir(path)
    except OSError:
        return out
    for name in names:
        try:
            out[name] = os.stat(os.path.join(path, name)).st_size
        except OSError:  # removed between the listing and the stat
            pass
    return out


def shm_diff(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The entries of ``after`` that ``before`` did not have (name -> bytes)."""
    return {k: v for k, v in sorted(after.items()) if k not in before}


def shm_owner(name: str) -> int | None:
    """The creator's pid a /dev/shm file name carries, where its naming is known."""
    m = re.match(re.escape(SHM_PREFIX) + r"\d+-(\d+)-", name) or re.match(r"torch_(\d+)_", name)
    return int(m.group(1)) if m else None


def split_left(left: dict[str, int], ours: set[int]) -> tuple[dict[str, int], dict[str, int]]:
    """(counted, foreign): files left behind, those whose name names a pid outside
    ``ours`` (another job's) apart; a file with no pid in its name is counted."""
    counted, foreign = {}, {}
    for name, size in left.items():
        pid = shm_owner(name)
        (foreign if pid is not None and pid not in ours else counted)[name] = size
    return counted, foreign


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    pgrp: int
    state: str
    start: int  # clock ticks after boot
    cmdline: str


def proc_table() -> dict[int, Proc]:
    """Every process visible in /proc (those that vanish while read are left out)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        # after the command name, which may hold spaces and parentheses
        fields = stat.rpartition(")")[2].split()
        out[int(entry)] = Proc(
            int(entry), int(fields[1]), int(fields[2]), fields[0], int(fields[19]), cmd
        )
    return out


def descendants(pid: int, table: dict[int, Proc] | None = None) -> list[Proc]:
    """Every live (not zombie) descendant of ``pid``, parents before children."""
    table = proc_table() if table is None else table
    children: dict[int, list[Proc]] = {}
    for p in table.values():
        children.setdefault(p.ppid, []).append(p)
    out, todo = [], [pid]
    while todo:
        for c in sorted(children.get(todo.pop(0), []), key=lambda p: p.pid):
            if c.state not in ("Z", "X"):
                out.append(c)
            todo.append(c.pid)
    return out


def find_workers(cli_pid: int, table: dict[int, Proc] | None = None) -> list[int]:
    """The worker processes under ``cli_pid`` in spawn order (start time, then pid).

    A subprocess worker runs ``python -m nereus_rl.runtime.worker``; a forked one keeps
    its forkserver's command line, so it is a child of a forkserver. The forkserver and
    multiprocessing's resource tracker are not workers."""
    table = proc_table() if table is None else table
    desc = descendants(cli_pid, table)
    workers = [p for p in desc if "nereus_rl.runtime.worker" in p.cmdline]
    if not workers:
        servers = {p.pid for p in desc if "forkserver" in p.cmdline}
        workers = [p for p in desc if p.ppid in servers and "resource_tracker" not in p.cmdline]
    return [p.pid for p in sorted(workers, key=lambda p: (p.start, p.pid))]


def has_socket(pid: int) -> bool:
    """Whether process ``pid`` holds a socket (a worker's first is its store connection,
    opened after its imports, just before it joins the job)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:"):
                return True
        except OSError:
            continue
    return False


def join_order(workers: list[int], connected: dict[int, float]) -> list[int]:
    """``workers`` (in spawn order) ordered by when each was first seen connected; those
    not seen connected last, in spawn order."""
    spawn = {p: i for i, p in enumerate(workers)}
    return sorted(workers, key=lambda p: (connected.get(p, float("inf")), spawn[p]))


def group_members(pgid: int) -> list[int]:
    """Live processes of process group ``pgid``."""
    return sorted(p.pid for p in proc_table().values() if p.pgrp == pgid and p.state != "Z")


def kill_group(pgid: int) -> None:
    """SIGKILL process group ``pgid`` (gone already: nothing to do)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class JsonlTail:
    """Reads the rows appended to a JSON-lines file since the last call, with the
    ``time.time()`` and file mtime at which each was first seen."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""
        self.rows: list[dict[str, Any]] = []
        self.seen: list[tuple[float, float]] = []  # (time seen, file mtime)

    def poll(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                mtime = os.fstat(f.fileno()).st_mtime
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        now = time.time()
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()  # a line not yet ended stays for the next poll
        new = []
        for line in lines:
            if line.strip():
                try:
                    new.append(json.loads(line))
                except ValueError:
                    continue
        self.rows += new
        self.seen += [(now, mtime)] * len(new)
        return new


def is_recovery(row: dict[str, Any]) -> bool:
    """Whether a decisions.jsonl row is a recovery's (urgent, with a recovery record)."""
    return row.get("path") == "urgent" and row.get("recovery") is not None


def recovery_seconds(row: dict[str, Any]) -> float | None:
    """A recovery row's measured seconds, wherever the row keeps them."""
    for nested in (row.get("recovery"), row.get("outcome")):
        if isinstance(nested, dict) and nested.get("measured_s") is not None:
            return float(nested["measured_s"])
    v = row.get("measured_s", row.get("measured_transition_s"))
    return None if v is None else float(v)


def recovery_wall_start(row: dict[str, Any]) -> float | None:
    """The wall-clock start a recovery row carries (seconds since the epoch), if any."""
    for d in (row, row.get("recovery"), row.get("outcome")):
        if isinstance(d, dict):
            for k in WALL_KEYS:
                if isinstance(d.get(k), (int, float)):
                    return float(d[k])
    return None


def lost_devices(row: dict[str, Any]) -> list[int]:
    """Plan devices a recovery row says were lost (over its rounds)."""
    rounds = row.get("recovery_rounds")
    if rounds is None and isinstance(row.get("recovery"), dict):
        rounds = row["recovery"].get("rounds")
    return sorted({d for r in rounds or [] for d in r.get("lost_devices", [])})


# ------------------------------------------------------------------ one run


@dataclass
class KillSpec:
    """What a run kills and when; drawn up front from the bench's seed."""

    index: int
    kind: str  # "single" or "node"
    phase: str
    frac: float  # where in the phase's window, 0..1
    step: int  # the step inside which (step, weight_sync, transition)
    victim: int  # single: index into spawn order; node: which node (0 or 1)


@dataclass
class Timings:
    """The pilot run's timings that kill moments are drawn from."""

    startup_s: float = 8.0  # all workers up -> first metrics row
    step_s: float = 0.06
    sync_s: float = 0.005
    moves: dict[int, float] = field(default_factory=dict)  # step -> its move's seconds


def kill_specs(
    seed: int, singles: int, nodes: int, steps: int, move_steps: list[int]
) -> list[KillSpec]:
    """Per run: its moment (each phase equally often, in shuffled order), fraction, step
    and victim."""
    rng = random.Random(seed)
    out: list[KillSpec] = []
    for kind, n in (("single", singles), ("node", nodes)):
        phases = [PHASES[i % len(PHASES)] for i in range(n)]
        rng.shuffle(phases)
        for phase in phases:
            if phase == "transition" and move_steps:
                step = rng.choice(move_steps)
            else:
                step = rng.randint(1, max(1, steps - 2))
            victim = rng.randrange(2) if kind == "node" else rng.randrange(1 << 16)
            out.append(KillSpec(len(out), kind, phase, rng.random(), step, victim))
    return out


def _kill_at(spec: KillSpec, t: Timings, t_workers: float | None, row_times: list[float]):
    """The wall-clock moment to kill at, once what it hangs on has happened; else None."""
    if spec.phase == "startup":
        if t_workers is None:
            return None
        at = t_workers + spec.frac * t.startup_s
        # A start-up shorter than the pilot's (load varies): the kill lands at the first
        # step at the latest, never after the run (it is then marked off its phase).
        return min(at, row_times[0]) if row_times else at
    if len(row_times) < spec.step:
        return None
    t_row = row_times[spec.step - 1]  # the previous step's row: step `spec.step` runs
    if spec.phase == "step":
        return t_row + (0.1 + 0.6 * spec.frac) * t.step_s
    if spec.phase == "transition" and spec.step in t.moves:
        return t_row + t.step_s + spec.frac * t.moves[spec.step]
    return t_row + t.step_s - spec.frac * t.sync_s  # weight_sync (or a move missing)


def train_command(steps: int, run_dir: Path, quick: bool, extra: list[str]) -> list[str]:
    base = [sys.executable, "-m", "nereus_rl.cli", "train", "--steps", str(steps)]
    return base + (["--quick"] if quick else []) + ["--run-dir", str(run_dir), *extra]


def run_one(
    name: str,
    cmd: list[str],
    run_dir: Path,
    steps: int,
    *,
    devices: int = 4,
    spec: KillSpec | None = None,
    timings: Timings | None = None,
    timeout: float = 120.0,
    pids: set[int] | None = None,
) -> dict[str, Any]:
    """Run ``cmd`` (a ``nereus-rl train``) in its own process group, SIGKILL workers as
    ``spec`` says (None: no kill), and read the run folder. The group is killed at the
    end whatever happened; every pid seen in it is added to ``pids``."""
    timings = timings or Timings()
    pids = set() if pids is None else pids
    run_dir.mkdir(parents=True, exist_ok=True)
    log = open(run_dir.parent / f"{name}.log", "wb")
    t0 = time.time()
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=run_dir.parent
    )
    metrics = JsonlTail(run_dir / "metrics.jsonl")
    decisions = JsonlTail(run_dir / "decisions.jsonl")
    row: dict[str, Any] = {"run": name, "kind": spec.kind if spec else None}
    if spec is not None:
        row.update(phase=spec.phase, frac=round(spec.frac, 3), step_target=spec.step)
    pids.add(proc.pid)
    t_workers = t_kill = kill_at = None
    workers: list[int] = []
    found: list[int] = []
    connected: dict[int, float] = {}  # worker pid -> when first seen with a socket
    victims: list[int] = []
    last_scan = last_sock = 0.0
    timed_out = False
    try:
        while proc.poll() is None:
            now = time.time()
            if now - t0 > timeout:
                timed_out = True
                break
            metrics.poll()
            if t_kill is not None:
                decisions.poll()
            # Process scans cost a few ms each: often only while waiting for the workers.
            if now - last_scan > (0.05 if t_workers is None else 0.5):
                last_scan = now
                table = proc_table()
                found = find_workers(proc.pid, table)
                pids.update(p.pid for p in descendants(proc.pid, table))
                if len(found) >= devices and t_workers is None:
                    t_workers, workers = now, found
            if len(connected) < devices and now - last_sock > 0.02:
                last_sock = now
                # The driver numbers workers (plan devices) in the order they join: that
                # order, not spawn order, maps pids to devices (module docstring).
                for pid in workers or found:
                    if pid not in connected and has_socket(pid):
                        connected[pid] = time.time()
            wait = 0.005
            if spec is not None and t_kill is None:
                if kill_at is None:
                    kill_at = _kill_at(spec, timings, t_workers, [s for s, _ in metrics.seen])
                if kill_at is not None:
                    if now >= kill_at:
                        # The run folder's device -> pid map where it is written yet
                        # (workers.jsonl); before that, the join order's estimate.
                        workers = device_pids(run_dir) or join_order(
                            find_workers(proc.pid) or workers, connected
                        )
                        victims = _victims(spec, workers)
                        t_kill = time.time()
                        for pid in victims:
                            try:
                                os.kill(pid, signal.SIGKILL)
                            except ProcessLookupError:
                                pass
                        row.update(
                            t_kill_s=round(t_kill - t0, 3),
                            rows_at_kill=len(metrics.rows),
                            victims=victims,
                            victim_devices=[workers.index(v) for v in victims],
                            workers=workers,
                            workers_joined=sum(p in connected for p in workers),
                        )
                        continue
                    wait = min(wait, max(0.0, kill_at - now))
            time.sleep(wait)
    finally:
        # Processes of the run that outlived its CLI (reparented workers): counted; the
        # whole group is ended whatever happened (a timeout, an exception here).
        left = group_members(proc.pid) if proc.poll() is not None else []
        kill_group(proc.pid)
        proc.wait()
        log.close()
    rc = None if timed_out else proc.returncode
    metrics.poll()
    decisions.poll()
    row.update(rc=rc, timed_out=timed_out, wall_s=round(time.time() - t0, 2), stragglers=left)
    row["t_workers_s"] = None if t_workers is None else round(t_workers - t0, 3)
    row["t_first_row_s"] = round(metrics.seen[0][0] - t0, 3) if metrics.seen else None
    _read_result(row, run_dir, steps, metrics, decisions, t_kill, spec)
    row["log_tail"] = _tail(run_dir.parent / f"{name}.log")
    try:
        log_text = (run_dir.parent / f"{name}.log").read_text(errors="replace")
    except OSError:
        log_text = ""
    if row["why"] == "no recovery row" and REPLACED in log_text:
        # Killed before it joined: it held nothing, and the driver started another in
        # its place; nothing was there to recover.
        row.update(intact=True, why=None, handled="replaced before joining")
    return row


def device_pids(run_dir: Path) -> list[int]:
    """The worker pid of each plan device, in device order, from the run folder's last
    workers.jsonl row (empty when it is not written yet)."""
    try:
        lines = (run_dir / "workers.jsonl").read_text().splitlines()
        pids = json.loads(lines[-1])["pids"]
    except (OSError, IndexError, ValueError, KeyError):
        return []
    return [pids[k] for k in sorted(pids, key=int)]


def _victims(spec: KillSpec, workers: list[int]) -> list[int]:
    if not workers:
        return []
    if spec.kind == "single":
        return [workers[spec.victim % len(workers)]]
    half = len(workers) // 2
    return workers[half:] if spec.victim else workers[:half]


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").replace("\r", "\n")
    except OSError:
        return ""
    return "\n".join([x for x in text.splitlines() if x.strip()][-lines:])


def _read_result(row, run_dir, steps, metrics, decisions, t_kill, spec) -> None:
    done = sorted({r.get("step") for r in metrics.rows if isinstance(r.get("step"), int)})
    row["steps_done"] = len(done)
    summary = run_dir / "summary.txt"
    text = summary.read_text() if summary.exists() else ""
    err = run_dir / "error.txt"
    row["error"] = err.read_text().strip()[:300] if err.exists() else None
    if row["error"] is None and "stopped early" in text:
        row["error"] = text.split("stopped early:", 1)[1].splitlines()[0].strip()[:300]
    rec = [(r, seen) for r, seen in zip(decisions.rows, decisions.seen) if is_recovery(r)]
    row["recoveries"] = len(rec)
    why = []
    if row["timed_out"]:
        why.append("timed out")
    elif row["rc"] != 0:
        why.append(f"exit {row['rc']}")
    if row["error"]:
        why.append("error recorded")
    if done != list(range(steps)):
        why.append(f"{len(done)}/{steps} steps")
    if spec is not None and t_kill is None:
        why.append("no kill landed")
    if spec is not None and not rec:
        why.append("no recovery row")
    row["intact"] = not why
    row["why"] = ", ".join(why) or None
    row.update(detect_s=None, recover_s=None, detect_source=None, lost_devices=None)
    if rec:
        first, (_, mtime) = rec[0]
        measured = [recovery_seconds(r) for r, _ in rec]
        timed = [x for x in measured if x is not None]
        row["recover_s"] = sum(timed) if timed else None
        row["interrupted"] = first.get("interrupted")
        row["recovery_method"] = first.get("recovery")
        row["lost_devices"] = sorted({d for r, _ in rec for d in lost_devices(r)})
        wall = recovery_wall_start(first)
        if t_kill is not None and wall is not None:
            row["detect_s"], row["detect_source"] = wall - t_kill, "row wall-clock start"
        elif t_kill is not None and measured[0] is not None:
            row["detect_s"] = mtime - measured[0] - t_kill
            row["detect_source"] = "decisions.jsonl mtime - measured"
    if spec is not None and t_kill is not None:
        # Whether the kill fell where it was aimed: before the first row (startup), else
        # while step `spec.step` or its boundary ran (its row not written yet).
        want = 0 if spec.phase == "startup" else spec.step
        row["landed"] = row["rows_at_kill"] == want
        if spec.phase == "transition":
            row["moved_at_target"] = any(
                r.get("step") == spec.step and r.get("taken") and not is_recovery(r)
                for r in decisions.rows
            )
    if spec is not None and spec.kind == "node" and row["lost_devices"] is not None:
        n = len(row.get("workers") or []) // 2
        row["node_aligned"] = row["lost_devices"] in (list(range(n)), list(range(n, 2 * n)))


# ------------------------------------------------------------------ the bench


def cli_options() -> set[str]:
    """The option strings ``nereus-rl train --help`` lists."""
    out = subprocess.run(
        [sys.executable, "-m", "nereus_rl.cli", "train", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return set(re.findall(r"--[a-z][a-z0-9-]*", out))


def pilot_timings(row: dict[str, Any], run_dir: Path) -> Timings:
    """Kill-moment timings from a run without a kill (defaults where it has none)."""
    t = Timings()
    m = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    if row.get("t_workers_s") is not None and row.get("t_first_row_s") is not None:
        t.startup_s = max(0.1, row["t_first_row_s"] - row["t_workers_s"])
    if len(m) > 1:
        t.step_s = statistics.median(x["step_s"] for x in m[1:])
        t.sync_s = statistics.median(x.get("sync_s", 0.0) for x in m[1:]) or t.sync_s
    t.moves = {x["step"]: x["transition_s"] for x in m if x.get("transition_s")}
    return t


def mirror_cost(
    rows_on: list[dict[str, Any]], rows_off: list[dict[str, Any]]
) -> dict[str, float | None]:
    """Median step_s (and step+boundary) with the mirror over without, minus one; step 0
    (the first weight sync, first use of every group) left out."""

    def med(rows, key):
        xs = [
            r["step_s"] + (r.get("boundary_s", 0.0) if key == "total" else 0.0)
            for r in rows
            if r.get("step", 0) > 0
        ]
        return statistics.median(xs) if xs else None

    out: dict[str, float | None] = {}
    for key in ("step", "total"):
        on, off = med(rows_on, key), med(rows_off, key)
        out[f"{key}_s_mirror"], out[f"{key}_s_no_mirror"] = on, off
        out[f"{key}_cost"] = None if not on or not off else on / off - 1.0
    return out


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


HEADER = (
    f"{'run':>6} {'kind':>6} {'phase':>11} {'killed':>6} {'lost':>5} {'hit':>3} {'t_kill':>6} "
    f"{'rows':>4} {'rc':>4} {'intact':>6} {'detect':>6} {'recover':>7}  cut short / why not"
)


def table_line(r: dict[str, Any]) -> str:
    """One kill run's line: devices killed (by join order) and lost (the recovery row's),
    whether the kill fell in its phase, the outcome and its seconds."""

    def devs(xs):
        return ",".join(str(d) for d in xs) if xs else "-"

    hit = {True: "y", False: "n", None: "-"}[r.get("landed")]
    note = r["why"] or (f"cut: {r['interrupted']}" if r.get("interrupted") else "")
    return (
        f"{r['run']:>6} {r['kind']:>6} {r['phase']:>11} {devs(r.get('victim_devices')):>6} "
        f"{devs(r.get('lost_devices')):>5} {hit:>3} {_fmt(r.get('t_kill_s'), '.1f'):>6} "
        f"{r.get('rows_at_kill', '-')!s:>4} {r['rc']!s:>4} {'yes' if r['intact'] else 'NO':>6} "
        f"{_fmt(r['detect_s']):>6} {_fmt(r['recover_s']):>7}  {note}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 + 1 kill runs of short runs")
    ap.add_argument("--json", metavar="PATH", help="write every run's row and the summary")
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill moments and victims")
    ap.add_argument("--singles", type=int, default=None, help="single-worker kills (20)")
    ap.add_argument("--nodes", type=int, default=None, help="node kills (5)")
    ap.add_argument("--steps", type=int, default=None, help="RL steps per run (40; --quick 16)")
    ap.add_argument("--mirror-repeats", type=int, default=None, help="pairs of mirror runs")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per run (180)")
    ap.add_argument("--keep", metavar="DIR", help="keep the run folders and logs here")
    args = ap.parse_args(argv)
    quick = args.quick
    singles = args.singles if args.singles is not None else (4 if quick else 20)
    nodes = args.nodes if args.nodes is not None else (1 if quick else 5)
    steps = args.steps or (16 if quick else 40)
    repeats = args.mirror_repeats or (1 if quick else 2)
    # A death the trainer notices only at gloo's group timeout (60 s) still fits.
    timeout = args.timeout or 180.0
    devices = 4  # the CLI's default

    shm_before = shm_snapshot()
    work = Path(args.keep or tempfile.mkdtemp(prefix="bench_faults_")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    opts = cli_options()
    has_nodes, has_mirror = "--nodes" in opts, "--no-mirror" in opts
    print(
        f"nereus-rl train: --nodes {'yes' if has_nodes else 'MISSING'}, --no-mirror "
        f"{'yes' if has_mirror else 'MISSING'}; {steps} steps per run, work dir {work}"
    )
    pids: set[int] = set()
    t_bench = time.time()

    def go(name, extra, spec=None, timings=None):
        run_dir = work / name
        cmd = train_command(steps, run_dir, quick, extra)
        r = run_one(name, cmd, run_dir, steps, devices=devices, spec=spec,
                    timings=timings, timeout=timeout, pids=pids)  # fmt: skip
        r["command"] = cmd[1:]
        return r

    pilot = go("pilot", [])
    timings = pilot_timings(pilot, work / "pilot")
    print(f"pilot: exit {pilot['rc']}, {pilot['steps_done']}/{steps} steps, start-up "
          f"{timings.startup_s:.2f} s, step {timings.step_s:.3f} s, sync {timings.sync_s:.4f} s, "
          f"moves at steps {sorted(timings.moves)}")  # fmt: skip

    # The mirror's cost: interleaved on/off pairs of the same fixed plan, no kill.
    mirror: dict[str, Any] = {"reason": None}
    mirror_rows: list[dict[str, Any]] = []
    if has_mirror:
        on, off = [], []
        for i in range(repeats):
            order = [False, True] if i % 2 else [True, False]
            for with_mirror in order:
                name = f"mirror{i}_{'on' if with_mirror else 'off'}"
                extra = list(MIRROR_PLAN) + ([] if with_mirror else ["--no-mirror"])
                r = go(name, extra)
                mirror_rows.append(r)
                m = JsonlTail(work / name / "metrics.jsonl")
                m.poll()
                (on if with_mirror else off).extend(m.rows)
        mirror.update(mirror_cost(on, off))
        if any(not r["intact"] for r in mirror_rows):
            mirror["reason"] = "a mirror run did not finish: " + "; ".join(
                f"{r['run']}: {r['why']}" for r in mirror_rows if not r["intact"]
            )
    else:
        mirror.update(step_cost=None, total_cost=None)
        mirror["reason"] = "nereus-rl train has no --no-mirror option yet"

    specs = kill_specs(args.seed, singles, nodes, steps, sorted(timings.moves))
    rows = []
    print(HEADER)
    for spec in specs:
        extra = []
        if spec.kind == "node" and has_nodes:
            extra = ["--nodes", "2", "--memory-budget", str(NODE_BUDGET)]
        r = go(f"kill{spec.index:02d}", extra, spec, timings)
        if spec.phase == "transition" and spec.step not in timings.moves:
            r["phase_note"] = "no move in the pilot at that step: killed at its weight sync"
        if spec.kind == "node" and not has_nodes:
            r["phase_note"] = "nereus-rl train has no --nodes: half the workers of a plain run"
        rows.append(r)
        print(table_line(r), flush=True)
        if not r["intact"] and r["log_tail"]:
            print("         " + r["log_tail"].splitlines()[-1][:150])

    # Every run's group was killed as it ended; the files still there are left behind.
    shm_after = shm_snapshot()
    left = shm_diff(shm_before, shm_after)
    counted, foreign = split_left(left, pids)
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)

    def part(kind):
        rs = [r for r in rows if r["kind"] == kind]
        return sum(r["intact"] for r in rs), len(rs)

    det = [r["detect_s"] for r in rows if r["detect_s"] is not None]
    rec = [r["recover_s"] for r in rows if r["recover_s"] is not None]
    (s_ok, s_n), (n_ok, n_n) = part("single"), part("node")
    summary = {
        "single_intact": s_ok, "single_runs": s_n, "node_intact": n_ok, "node_runs": n_n,
        "detect_median_s": percentile(det, 50), "detect_p95_s": percentile(det, 95),
        "recover_median_s": percentile(rec, 50), "recover_p95_s": percentile(rec, 95),
        "recoveries_timed": len(rec),
        "detect_source": sorted({r["detect_source"] for r in rows if r["detect_source"]}),
        "mirror": mirror,
        "shm_left": counted, "shm_left_bytes": sum(counted.values()),
        "shm_left_other_jobs": foreign,
        "stragglers": sum(len(r["stragglers"]) for r in rows + mirror_rows + [pilot]),
        "kills_off_phase": [r["run"] for r in rows if r.get("landed") is False],
        "node_kills_misaligned": [r["run"] for r in rows if r.get("node_aligned") is False],
        "has_nodes_option": has_nodes, "has_no_mirror_option": has_mirror,
        "bench_s": round(time.time() - t_bench, 1),
    }  # fmt: skip
    p95 = summary["recover_p95_s"]
    cost = mirror.get("step_cost")
    goals = {
        "single_all_intact": s_ok == s_n,
        "node_all_intact": (n_ok == n_n) if has_nodes else None,
        "recover_p95_under_5s": None if p95 is None else p95 < GOAL_RECOVERY_P95_S,
        "mirror_cost_under_5pct": None if cost is None else cost < GOAL_MIRROR_COST,
        "no_shm_left": not counted,
    }
    reasons = {
        "node_all_intact": None
        if has_nodes
        else f"no --nodes option yet (half the workers of a plain run: {n_ok}/{n_n} intact)",
        "recover_p95_under_5s": None if p95 is not None else "no recovery row to time",
        "mirror_cost_under_5pct": None if cost is not None else mirror["reason"],
    }

    print(
        f"single kills: {s_ok}/{s_n} finished with the state intact; node kills: "
        f"{n_ok}/{n_n}{'' if has_nodes else ' (no --nodes: half the workers of a plain run)'}"
    )
    print(
        f"detection (s): median {_fmt(summary['detect_median_s'])} p95 "
        f"{_fmt(summary['detect_p95_s'])}; recovery (s): median "
        f"{_fmt(summary['recover_median_s'])} p95 {_fmt(p95)} ({len(rec)} timed; detection "
        f"from {', '.join(summary['detect_source']) or '-'})"
    )
    if cost is not None:
        print(
            f"mirror: median step {_fmt(mirror['step_s_mirror'], '.4f')} s with, "
            f"{_fmt(mirror['step_s_no_mirror'], '.4f')} s without: x{1 + cost:.3f} "
            f"({cost:+.1%}); step+boundary x{1 + mirror['total_cost']:.3f}"
        )
    else:
        print(f"mirror cost: null ({mirror['reason']})")
    print(
        f"/dev/shm left behind: {len(counted)} files, {sum(counted.values())} bytes"
        + (f" ({', '.join(list(counted)[:5])})" if counted else "")
        + (f"; {len(foreign)} more of other jobs' pids, not counted" if foreign else "")
    )
    if summary["kills_off_phase"]:
        # the run's timing drifted from the pilot's (a loaded machine): still a kill
        print(f"kills that fell outside their phase: {', '.join(summary['kills_off_phase'])}")
    if summary["node_kills_misaligned"]:
        print(
            "node kills whose lost devices were not one node's (pid -> device guessed "
            f"wrong): {', '.join(summary['node_kills_misaligned'])}"
        )
    if summary["stragglers"]:
        print(f"processes that outlived their run's CLI (killed): {summary['stragglers']}")
    for k, v in goals.items():
        verdict = "n/a" if v is None else ("met" if v else "NOT MET")
        print(f"  goal {k}: {verdict}" + (f" ({reasons[k]})" if reasons.get(k) else ""))
    print(f"bench: {summary['bench_s']} s")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        out = {
            "benchmark": "bench_faults",
            "args": vars(args), "steps": steps, "pilot": pilot,
            "timings": asdict(timings), "specs": [asdict(s) for s in specs],
            "rows": rows, "mirror_rows": mirror_rows, "summary": summary,
            "goals": goals, "goal_reasons": reasons,
        }  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
