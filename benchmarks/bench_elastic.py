"""Elasticity end to end: a node lost, then nodes arriving, during one GRPO run.

One run of ``steps`` GRPO steps on ``devices`` local worker processes split into nodes
of two (failure domains). After step ``loss_at - 1`` every worker of the last node is
SIGKILLed; after step ``arrive_at - 1`` ``arrivals`` new nodes of two workers start. Three
ways to carry on, each run here, one after another, in this process:

    nereus      live recovery from the intact units on the survivors, then the
                arrivals admitted at the next boundary (``max_devices``) and the
                planner free to move onto them (Extend).
    restart     checkpoint/restart as verl and OpenRLHF do it: the training state is
                written to disk every ``K`` steps (the trainer's disk checkpoint of the
                actor's weights, Adam moments and step); at each event the job stops
                (every worker process exits) and a new job starts on the new device
                set: new worker processes, the stages built again, the last checkpoint
                loaded (written by this run, read back from disk: ``TrainConfig.resume``,
                which goes on from the step after it with that step's prompts), and the
                steps since it run again. Process start, model build and load are
                measured.
    fixed       live recovery as nereus, the arrivals left unused (the survivors only).

Every run uses the same options (adaptive planner, fixed response length, the
in-memory snapshot every step); only the events' handling differs.

Every job (each way's first, and each restarted one) starts its workers from nothing,
as a launched job does: a new forkserver imports torch and the worker's modules once
and forks the job's workers (the wall of one process start, as a cluster's nodes start
theirs side by side). The arrivals fork from the running job's forkserver.

Reported per run: total wall time to finish (from the first worker's start to the last
step's end, less the arrivals' own process start, which on a cluster runs on the new
node while the job goes on), steps recomputed, the pause at each event (the step that
follows the event less the median step before it; for restart, the stop, new start and
reload plus the steps run again), the mean step after the arrivals, and the ratios
side by side (restart / nereus, fixed / nereus).

What an arrival adds on one 2-core machine: with ``--core-share C`` (default 0.25, where
this process may make cgroups: root with the cgroup v1 cpu controller or cgroup v2),
every worker process runs in a cgroup of its own whose CPU quota is C of a core per
``--cfs-period-ms`` (default 10: short enough that a worker runs at about its share all
the time, as a slower device would; see :class:`CoreShares`), and the trainer prices
each worker at C cores (``worker_cores``). Six workers then hold 1.5 of the two cores,
the four survivors 1.0 and the eight after the arrivals 2.0: an arriving node brings
half a core, as a node of a cluster brings its devices. ``--core-share 0`` lets every
worker share both cores instead; an arrival then adds worker processes and their memory
budget, no cores.

What an arrival's memory adds: each worker's memory budget (what the planner may place
on it) is by default the trainer's, just above the start plan's peak; on the tiny model
no plan over more workers then runs faster, as a step is mostly per-call overhead that a
wider stage does not share out. ``--memory-budget-mib M`` sets it instead: at 1.3 the
survivors of the full scenario can hold the three stages only with the rollout split two
ways beside the reference, which the arrivals' memory lets spread out again.

    python benchmarks/bench_elastic.py --quick --json /tmp/bench_elastic.json
    python benchmarks/bench_elastic.py --json /tmp/bench_elastic.json   # 30 steps, 6 devices

--quick: 10 steps on 4 devices (2 nodes of 2), a node lost after step 3 and one node
arriving after step 6, a checkpoint every 3 steps; the full run: 30 steps on 6 devices
(3 nodes of 2), a node lost after step 9, two nodes arriving after step 19, K = 5.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing.forkserver
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nereus_rl.runtime import Driver
from nereus_rl.trainer.trainer import TrainConfig, Trainer


@dataclass(frozen=True)
class Scenario:
    """One elastic run's shape.

    Attributes:
        steps: RL steps.
        devices: devices at start (nodes of ``per_node``).
        per_node: devices per node.
        loss_at: the first step after the last node is lost.
        arrive_at: the first step after ``arrivals`` nodes arrive.
        arrivals: nodes that arrive.
        every: the restart baseline's checkpoint interval (steps).
        options: further TrainConfig options (the same for every way).
    """

    steps: int
    devices: int
    per_node: int
    loss_at: int
    arrive_at: int
    arrivals: int
    every: int
    options: dict[str, Any]

    @property
    def survivors(self) -> int:
        return self.devices - self.per_node

    @property
    def max_devices(self) -> int:
        return self.survivors + self.arrivals * self.per_node


COMMON = {
    "algo": "grpo",
    "model": "tiny",
    "length_start": 8,
    "length_end": 8,
    "calibration_probes": 0,
    "snapshot_budget": float("inf"),
    "heartbeat_timeout": 60.0,
}
QUICK = Scenario(
    steps=10, devices=4, per_node=2, loss_at=4, arrive_at=7, arrivals=1, every=3,
    options={**COMMON, "warm_steps": 30, "batch": 4, "group_size": 2},
)  # fmt: skip
FULL = Scenario(
    steps=30, devices=6, per_node=2, loss_at=10, arrive_at=20, arrivals=2, every=5,
    options={**COMMON, "warm_steps": 100, "batch": 8, "group_size": 4},
)  # fmt: skip


class CoreShares:
    """A CPU quota of its own for each worker process: one cgroup per worker (the cgroup
    v1 cpu controller, else cgroup v2's cpu.max) whose CFS quota is ``share`` of a core
    per ``period_us``. :meth:`close` removes every cgroup it made.

    The period sets how much a worker that idled can burst: it runs at full speed until
    its quota for the period is spent. With 100 ms (the kernel's default) a stage of up
    to 25 ms of CPU on a worker that idled runs at full speed, so two stages on one
    worker in one step draw on one quota while two on different workers get one each: a
    step's time then depends on which stages share a worker beyond what a device of a
    quarter core's speed would make of it. With a period of a few ms a worker runs at
    about its share all the time, as a slower device does; that is what the cost model
    prices (``worker_cores``).

    Raises:
        OSError: the cgroups cannot be made here (not root, no cpu controller).
    """

    def __init__(self, share: float, period_us: int = 10_000) -> None:
        self.share = share
        self.period_us = period_us
        v1 = Path("/sys/fs/cgroup/cpu")
        if (v1 / "cpu.cfs_quota_us").exists():
            root, self.v2 = v1, False
        elif Path("/sys/fs/cgroup/cgroup.controllers").exists():
            root, self.v2 = Path("/sys/fs/cgroup"), True
        else:
            raise OSError("no cgroup cpu controller at /sys/fs/cgroup/cpu or /sys/fs/cgroup")
        self.root = root
        self.base = root / f"nereus-bench-elastic-{os.getpid()}"
        self.base.mkdir()
        if self.v2:
            (self.base / "cgroup.subtree_control").write_text("+cpu")
        self._groups: list[Path] = []

    def place(self, pid: int) -> None:
        """Move process ``pid`` (all its threads) into a new cgroup of ``share`` cores."""
        group = self.base / f"pid{pid}"
        group.mkdir()
        self._groups.append(group)
        quota = round(self.share * self.period_us)  # main() keeps it >= the kernel's 1 ms
        if self.v2:
            (group / "cpu.max").write_text(f"{quota} {self.period_us}")
        else:
            (group / "cpu.cfs_period_us").write_text(str(self.period_us))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        (group / "cgroup.procs").write_text(str(pid))

    def close(self) -> None:
        """Move any process left back to the root cgroup and remove every cgroup made."""
        for group in [*self._groups, self.base]:
            try:
                for pid in (group / "cgroup.procs").read_text().split():
                    try:
                        (self.root / "cgroup.procs").write_text(pid)
                    except OSError:
                        pass  # exited meanwhile
                group.rmdir()
            except OSError:
                pass
        self._groups = []


#: The cgroups of this run's workers (None: every worker shares the machine's cores).
SHARES: CoreShares | None = None


def _spawn(driver: Driver, n: int, new_job: bool) -> tuple[list[int], float]:
    """Start ``n`` workers; returns their ranks and the seconds it took.

    ``new_job``: the workers are a new job's, which starts from nothing: the
    forkserver the workers fork from is stopped first, so this spawn starts a new one
    (a fresh interpreter importing torch and the worker's modules, about 1.7 s here)
    and forks the workers from it. That is the wall time of one process start, which
    is what a cluster's job start takes with each node starting its processes side by
    side (started as separate interpreters here, ``n`` imports would share two cores).
    Otherwise (a node arriving at a running job) the running forkserver forks them.
    """
    t0 = time.perf_counter()
    if new_job:
        # The stdlib has no public way to restart the forkserver; _stop() is what its
        # own tests use, and the next spawn starts a new one.
        multiprocessing.forkserver._forkserver._stop()
    ranks = driver.spawn_local(n, method="forkserver")
    if SHARES is not None:
        for r in ranks:
            SHARES.place(driver.pid(r))
    return ranks, time.perf_counter() - t0


def _parent_pid(pid: int) -> int:
    """Process ``pid``'s parent (field 4 of /proc/PID/stat; the name before it may hold
    spaces, so it is split after the name's closing parenthesis)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def _pause(ends: list[float], step: int, before: list[float], extra: float = 0.0) -> float:
    """The step after an event less the median step before it (seconds); ``extra``
    (work of the benchmark's own, not the job's, inside that interval) is left out."""
    took = ends[step] - ends[step - 1] - extra
    return max(0.0, took - statistics.median(before))


def run_live(sc: Scenario, arrivals: bool, seed: int) -> dict[str, Any]:
    """nereus (``arrivals``) or fixed: one trainer, live recovery, arrivals admitted."""
    cfg = TrainConfig(
        steps=sc.steps, devices=sc.devices, nodes=sc.devices // sc.per_node, seed=seed,
        max_devices=sc.max_devices if arrivals else None, **sc.options,
    )  # fmt: skip
    driver = Driver(heartbeat_timeout=60.0, call_timeout=600.0)
    ends: dict[int, float] = {}
    side: dict[int, float] = {}  # step -> the benchmark's own seconds inside it
    t_start = time.perf_counter()
    try:
        _, spawn_s = _spawn(driver, sc.devices, new_job=True)
        tr = Trainer(cfg, driver=driver)
        try:
            tr.start()

            def progress(step: int, m: dict[str, Any]) -> None:
                ends[step] = time.perf_counter()
                if step == sc.loss_at - 1 and "lost" not in side:
                    side["lost"] = 1
                    last_node = range(sc.devices - sc.per_node, sc.devices)
                    for d in last_node:
                        driver.kill(tr.device_worker[d])
                elif step == sc.arrive_at - 1 and arrivals and "arrived" not in side:
                    side["arrived"] = 1
                    t0 = time.perf_counter()
                    _spawn(driver, sc.arrivals * sc.per_node, new_job=False)
                    # A node's process start runs outside the job on a cluster.
                    side[sc.arrive_at] = time.perf_counter() - t0

            tr.progress = progress
            res = tr.run()
        finally:
            tr.close()
    finally:
        driver.shutdown()
    # The arrivals' own process start is left out: a node's processes start on that
    # node while the job runs (here the spawn blocks the loop, on the same cores).
    total = time.perf_counter() - t_start - side.get(sc.arrive_at, 0.0)
    if res.error:
        raise RuntimeError(f"{'nereus' if arrivals else 'fixed'} run failed: {res.error}")
    order = [ends[s] for s in range(sc.steps)]
    # steady steps before the loss (step 0 pays the first weight sync and warm-ups)
    steady = [order[s] - order[s - 1] for s in range(min(2, sc.loss_at - 1), sc.loss_at)]
    recomputed = sum(len(d.get("rolled_back_steps", ())) for d in res.decisions)
    after = [order[s] - order[s - 1] for s in range(sc.arrive_at + 1, sc.steps)]
    moves = [d for d in res.decisions if d.get("taken") and d["step"] >= sc.arrive_at - 1]
    grown = [d for d in res.decisions if d.get("path") == "grow"]
    return {
        "way": "nereus" if arrivals else "fixed",
        "total_s": total,
        "spawn_s": spawn_s,
        "steps_recomputed": recomputed,
        "loss_pause_s": _pause(order, sc.loss_at, steady),
        "arrival_pause_s": _pause(order, sc.arrive_at, steady, side.get(sc.arrive_at, 0.0))
        if arrivals
        else 0.0,
        "arrival_process_start_s": side.get(sc.arrive_at, 0.0),
        "step_after_arrivals_s": statistics.mean(after) if after else None,
        "devices_at_end": len(res.plans[-1][1].devices),
        "devices_held_at_end": len(tr.group.device_worker),
        "admitted": sum(len(d["joined"]) for d in grown),
        "moves_after_arrivals": [
            {"step": d["step"], "trigger": d["trigger"], "primitives": d.get("executed_primitives")}
            for d in moves
        ],
        # every decision from the arrivals on, taken or not, with its reason
        "decisions_after_arrivals": [
            {k: d.get(k) for k in ("step", "trigger", "path", "taken", "reason", "candidate")}
            for d in res.decisions
            if d["step"] >= sc.arrive_at - 1
        ],
        "final_plan": repr(res.plans[-1][1]),
        # every step's wall time (from the previous step's end; step 0 from the start)
        "steps_s": [round(b - a, 4) for a, b in zip([t_start, *order], order)],
        # (first step, plan) each time the plan was set or changed
        "plans": [(step, repr(plan)) for step, plan in res.plans],
    }


def _segment(
    sc: Scenario, devices: int, end: int, seed: int, ckpt_dir: Path, resume: Path | None
) -> dict[str, Any]:
    """One job of the restart baseline: start ``devices`` workers, build the stages
    (from ``resume``'s checkpoint, ``TrainConfig.resume``: its states, and the steps from
    the one after its own), run until step ``end`` writing a checkpoint every
    ``sc.every``, stop every worker. Returns its timings and the last checkpoint."""
    nodes = max(1, devices // sc.per_node)
    cfg = TrainConfig(
        steps=end, devices=devices, nodes=nodes, seed=seed, checkpoint_every=sc.every,
        checkpoint_dir=str(ckpt_dir), resume=None if resume is None else str(resume),
        **sc.options,
    )  # fmt: skip
    t0 = time.perf_counter()
    driver = Driver(heartbeat_timeout=60.0, call_timeout=600.0)
    ends: list[float] = []
    try:
        ranks, spawn_s = _spawn(driver, devices, new_job=True)
        parents = {_parent_pid(driver.pid(r)) for r in ranks}
        t_build = time.perf_counter()
        tr = Trainer(cfg, driver=driver)  # reads and checks the checkpoint
        try:
            tr.start()
            load_s = tr.result.timings.get("resume_s", 0.0)
            build_s = time.perf_counter() - t_build - load_s
            t_run = time.perf_counter()
            tr.progress = lambda step, m: ends.append(time.perf_counter())
            res = tr.run()
            run_s = time.perf_counter() - t_run
            disk = tr._disk_checkpoint
            version = disk.version if disk is not None and disk.exists() else None
        finally:
            tr.close()
    finally:
        t_stop = time.perf_counter()
        driver.shutdown()
        stop_s = time.perf_counter() - t_stop
    if res.error:
        raise RuntimeError(f"restart job failed: {res.error}")
    # the checkpoint this job leaves, as the next job finds it: a copy, since the next
    # job writes its own into the same folder
    kept = None
    if version is not None:
        kept = ckpt_dir / f"kept-{time.monotonic_ns()}.pt"
        kept.write_bytes((ckpt_dir / "checkpoint.pt").read_bytes())
    steps_s = [b - a for a, b in zip([t_run, *ends], ends)]
    return {
        "wall_s": time.perf_counter() - t0,
        "spawn_s": spawn_s,
        "build_s": build_s,
        "load_s": load_s,
        "stop_s": stop_s,
        "run_s": run_s,
        "step_s": steps_s,
        "checkpoint": kept,
        "version": version,
        "parent_pids": sorted(parents),
    }


def run_restart(sc: Scenario, seed: int) -> dict[str, Any]:
    """checkpoint/restart: a job per device set, each started from the last checkpoint."""
    ckpt_dir = Path(tempfile.mkdtemp(prefix="bench-elastic-"))
    jobs = []
    t_start = time.perf_counter()
    # job 1 runs until the loss; its steps after the last checkpoint are lost
    j1 = _segment(sc, sc.devices, sc.loss_at, seed, ckpt_dir, None)
    done1 = 0 if j1["version"] is None else j1["version"] + 1
    lost1 = sc.loss_at - done1
    # job 2 on the survivors, from that checkpoint, until the arrivals; a scale-up also
    # restarts from the last checkpoint (the arrivals are used only by a new job)
    j2 = _segment(sc, sc.survivors, sc.arrive_at, seed, ckpt_dir, j1["checkpoint"])
    done2 = done1 if j2["version"] is None else j2["version"] + 1
    if j2["checkpoint"] is None:
        j2["checkpoint"] = j1["checkpoint"]
    lost2 = sc.arrive_at - done2
    j3 = _segment(sc, sc.max_devices, sc.steps, seed, ckpt_dir, j2["checkpoint"])
    jobs = [j1, j2, j3]
    total = time.perf_counter() - t_start
    for p in ckpt_dir.iterdir():
        p.unlink()
    ckpt_dir.rmdir()

    def pause(prev: dict, nxt: dict, lost: int) -> float:
        # the stop, the new job's start (processes, stages, checkpoint load) and the
        # steps run again
        return (
            prev["stop_s"]
            + nxt["spawn_s"]
            + nxt["build_s"]
            + nxt["load_s"]
            + sum(nxt["step_s"][:lost])
        )

    after = j3["step_s"][max(1, lost2 + 1) :]
    return {
        "way": "restart",
        "total_s": total,
        "spawn_s": j1["spawn_s"],
        "steps_recomputed": lost1 + lost2,
        "loss_pause_s": pause(j1, j2, lost1),
        "arrival_pause_s": pause(j2, j3, lost2),
        "arrival_process_start_s": j3["spawn_s"],
        "restart_spawn_s": [j["spawn_s"] for j in jobs[1:]],
        "restart_build_s": [j["build_s"] for j in jobs[1:]],
        "restart_load_s": [j["load_s"] for j in jobs[1:]],
        # each job's workers' parent: the forkserver that job started
        "job_forkserver_pids": [j["parent_pids"] for j in jobs],
        "step_after_arrivals_s": statistics.mean(after) if after else None,
        "devices_at_end": sc.max_devices,
    }


def prime(sc: Scenario, seed: int) -> None:
    """Warm-start the policy once, before any clock starts: every way then finds it in
    the trainer's in-process cache (a restarted job of a real run reloads it too). And
    start a forkserver once, so that the files it loads are in the page cache for every
    way alike (each job then starts a forkserver of its own; see :func:`_spawn`)."""
    driver = Driver()
    try:
        driver.spawn_local(1, method="forkserver")
    finally:
        driver.shutdown()
    cfg = TrainConfig(steps=sc.steps, devices=sc.devices, seed=seed, **sc.options)
    driver = Driver()
    try:
        Trainer(cfg, driver=driver)._initial_states()
    finally:
        driver.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="10 steps on 4 devices")
    ap.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ways", default="nereus,restart,fixed", help="comma-separated subset")
    ap.add_argument(
        "--core-share", type=float, default=0.25, metavar="C",
        help="CPU quota of each worker, in cores (a cgroup each; 0: share the machine's)",
    )  # fmt: skip
    ap.add_argument(
        "--memory-budget-mib", type=float, default=None, metavar="M",
        help="each worker's memory budget for the planner (default: the trainer's, just above "
        "the start plan's peak; too small a one fails the run at the loss, naming what fits)",
    )  # fmt: skip
    ap.add_argument(
        "--cfs-period-ms", type=float, default=10.0, metavar="MS",
        help="the quota's CFS period (1-1000 ms; see CoreShares for what it changes)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    sc = QUICK if args.quick else FULL
    if args.memory_budget_mib is not None:
        if not args.memory_budget_mib > 0:
            ap.error(f"--memory-budget-mib {args.memory_budget_mib} must be positive")
        budget = round(args.memory_budget_mib * 2**20)
        sc = dataclasses.replace(sc, options={**sc.options, "memory_budget": budget})
    global SHARES
    if args.core_share:
        if not 0 < args.core_share <= 1:
            ap.error(f"--core-share {args.core_share} must be in (0, 1], or 0 to share cores")
        if not 1 <= args.cfs_period_ms <= 1000:
            ap.error(f"--cfs-period-ms {args.cfs_period_ms} must be in [1, 1000] ms")
        if args.core_share * args.cfs_period_ms < 1:
            ap.error(
                f"--core-share {args.core_share} of a {args.cfs_period_ms} ms period is under "
                "the kernel's 1 ms minimum quota: raise --cfs-period-ms"
            )
        try:
            SHARES = CoreShares(args.core_share, round(args.cfs_period_ms * 1000))
        except OSError as e:
            ap.error(f"--core-share needs cgroups this process can make ({e}); pass 0")
        sc = dataclasses.replace(sc, options={**sc.options, "worker_cores": args.core_share})
    try:
        return _run(sc, args)
    finally:
        if SHARES is not None:
            SHARES.close()


def _run(sc: Scenario, args: argparse.Namespace) -> int:
    prime(sc, args.seed)
    runs = {"nereus": lambda: run_live(sc, True, args.seed),
            "restart": lambda: run_restart(sc, args.seed),
            "fixed": lambda: run_live(sc, False, args.seed)}  # fmt: skip
    rows = []
    for way in args.ways.split(","):
        row = runs[way]()
        rows.append(row)
        print(
            f"{way:8s} total {row['total_s']:7.2f} s  recomputed {row['steps_recomputed']}  "
            f"pause loss {row['loss_pause_s']:6.2f} s  arrivals {row['arrival_pause_s']:6.2f} s"
            f"  step after arrivals {row['step_after_arrivals_s'] or 0.0:6.3f} s  devices at "
            f"end {row['devices_at_end']}",
            flush=True,
        )
    by = {r["way"]: r for r in rows}
    if "nereus" in by:
        base = by["nereus"]
        for r in rows:
            r["total_vs_nereus_x"] = r["total_s"] / base["total_s"]
            if r["step_after_arrivals_s"] and base["step_after_arrivals_s"]:
                r["step_after_arrivals_vs_nereus_x"] = (
                    r["step_after_arrivals_s"] / base["step_after_arrivals_s"]
                )
        print("ratios (total wall time / nereus's): " + ", ".join(
            f"{r['way']} {r['total_vs_nereus_x']:.2f}x" for r in rows
        ))  # fmt: skip
    out = {
        "benchmark": "bench_elastic",
        "core_share": None if SHARES is None else SHARES.share,
        "cfs_period_ms": None if SHARES is None else SHARES.period_us / 1000,
        "scenario": {k: v for k, v in sc.__dict__.items() if k != "options"},
        "options": {k: v for k, v in sc.options.items() if k != "snapshot_budget"},
        "rows": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
