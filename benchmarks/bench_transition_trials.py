"""Randomized concurrent transition trials: the Nereus DAG against per-component migration.

For each transition type (scale_up, scale_down, rebalance, tp_pp_change,
device_loss) and each trial, a random current/target pair is drawn on a 12-device
cluster shared by six model-stages (``nereus_rl.baselines.scenarios``: random
device assignment; 40 GB devices, 8 GB per inference replica and 24 GB per training
replica at tp1 pp1; the current plan fills at least half of its devices' memory on
average, so stages share devices densely). Both methods
run the *same* pair on the real executors with sleeping primitives:

- Nereus: ``compile_transition`` then ``execute_dag`` (thread pool, resource
  manager); each primitive sleeps a random 2-6 ms plus a random launch delay
  (0-1 ms, ``--jitter-ms``). Success = it ends in exactly the target placement.
- per-component (DynaRL-style, ``run_per_component``): every stage migrates on its
  own thread after a random launch delay (0-1 ms), acquiring its new devices in a
  random order, holding them, copying, then releasing its old units; a wait that
  outlasts the timeout gives up. Failures are classified by the wait-for graph:
  deadlock (a cycle of stages waiting on each other's devices) or timeout.

A drawn pair whose target no order can reach (the compiler proves no safe order,
e.g. a single unit that must move onto devices its own stage holds) is redrawn
and counted in ``redrawn_unreachable``; those pairs are run by neither method.
``--no-stage-slots`` compiles with ``stage_slots=False`` (only memory limits how
units share a device, the rule the per-component baseline always uses), which
makes most of those pairs reachable.

Usage: python benchmarks/bench_transition_trials.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import threading
import time

from nereus_rl.baselines.migration import run_per_component
from nereus_rl.baselines.scenarios import (
    SCENARIO_CAPACITY,
    TRANSITION_TYPES,
    draw_reachable,
    scenario_unit_memory,
    write_benchmark_json,
)
from nereus_rl.transition import TransitionError
from nereus_rl.transition.execute import execute_dag

NUM_DEVICES = 12
MIN_FILL = 0.5  # current plans fill at least half of their devices' memory on average
MAX_DP = 4


def _impls(rng: random.Random, jitter_s: float):
    """Sleeping primitives: random 2-6 ms duration plus a random launch delay, per call."""
    lock = threading.Lock()

    def run(p):
        with lock:
            dt = rng.uniform(0.002, 0.006) + rng.uniform(0.0, jitter_s)
        time.sleep(dt)

    return {k: run for k in ("extend", "destroy", "split", "merge")}


def run_type(
    kind: str,
    trials: int,
    seed: int,
    timeout_s: float,
    jitter_s: float,
    min_fill: float,
    stage_slots: bool = True,
) -> dict:
    rng = random.Random(seed)
    redrawn = 0
    nereus_ok = 0
    nereus_fail: collections.Counter[str] = collections.Counter()
    edges: list[int] = []
    early: list[int] = []
    prims: list[int] = []
    nereus_ms: list[float] = []
    pc: collections.Counter[str] = collections.Counter()
    pc_ms: list[float] = []
    for t in range(trials):
        sc, dag, unreachable = draw_reachable(
            kind,
            rng,
            num_devices=NUM_DEVICES,
            min_fill=min_fill,
            max_dp=MAX_DP,
            stage_slots=stage_slots,
        )
        redrawn += unreachable
        try:
            rep = execute_dag(dag, _impls(random.Random(rng.random()), jitter_s))
            if rep.final.matches(sc.target):
                nereus_ok += 1
                nereus_ms.append(rep.makespan_s * 1e3)
            else:
                nereus_fail["wrong_placement"] += 1
        except (TransitionError, RuntimeError) as e:
            nereus_fail[type(e).__name__] += 1
        edges.append(dag.num_resource_edges)
        early.append(len(dag.early_destroys))
        prims.append(len(dag.primitives))
        delays = {n: rng.uniform(0.0, jitter_s) for n in sc.target.stage_names}
        res = run_per_component(
            sc.current,
            sc.target,
            _impls(random.Random(rng.random()), 0.0),
            devices=sc.devices,
            lost_devices=sc.lost,
            unit_memory=scenario_unit_memory,
            capacity=SCENARIO_CAPACITY,
            timeout_s=timeout_s,
            launch_delay_s=delays,
            seed=seed * 1000 + t,
        )
        pc[res.failure or "ok"] += 1
        if res.success:
            pc_ms.append(res.elapsed_s * 1e3)
    return {
        "transition": kind,
        "min_fill": min_fill,
        "stage_slots": stage_slots,
        "trials": trials,
        "redrawn_unreachable": redrawn,
        "nereus_success_pct": 100.0 * nereus_ok / trials,
        "nereus_failures": dict(nereus_fail),
        "resource_edges_mean": statistics.fmean(edges),
        "resource_edges_min": min(edges),
        "resource_edges_max": max(edges),
        "early_destroys_mean": statistics.fmean(early),
        "primitives_mean": statistics.fmean(prims),
        "nereus_makespan_ms_mean": statistics.fmean(nereus_ms) if nereus_ms else float("nan"),
        "per_component_success_pct": 100.0 * pc["ok"] / trials,
        "per_component_deadlock": pc["deadlock"],
        "per_component_timeout": pc["timeout"],
        "per_component_other": trials - pc["ok"] - pc["deadlock"] - pc["timeout"],
        "per_component_makespan_ms_mean": statistics.fmean(pc_ms) if pc_ms else float("nan"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="20 trials per type instead of 100")
    ap.add_argument("--trials", type=int, default=None, help="trials per type")
    ap.add_argument("--timeout", type=float, default=0.5, help="per-component wait timeout (s)")
    ap.add_argument("--jitter-ms", type=float, default=1.0, help="random launch delay, 0..this")
    ap.add_argument(
        "--min-fill", type=float, default=MIN_FILL, help="least mean memory fill of current plans"
    )
    ap.add_argument(
        "--no-stage-slots",
        action="store_true",
        help="let a new unit share devices with an old unit of its stage (memory only)",
    )
    ap.add_argument("--json", type=str, default=None, help="write the rows here")
    args = ap.parse_args()
    trials = args.trials or (20 if args.quick else 100)
    print(
        f"{trials} trials per type, launch jitter 0-{args.jitter_ms} ms, timeout "
        f"{args.timeout} s, current plans >= {args.min_fill:.0%} memory full, stage slots "
        f"{'off' if args.no_stage_slots else 'on'}"
    )
    rows = []
    hdr = (
        f"{'transition':>13} {'trials':>6} {'redrawn':>7} | {'nereus ok%':>10} "
        f"{'res.edges mean[min-max]':>23} {'early D':>7} | {'per-comp ok%':>12} "
        f"{'deadlock':>8} {'timeout':>7} {'other':>5} | {'ok ratio':>8}"
    )
    print(hdr)
    for i, kind in enumerate(TRANSITION_TYPES):
        r = run_type(
            kind,
            trials,
            1 + i,
            args.timeout,
            args.jitter_ms * 1e-3,
            args.min_fill,
            not args.no_stage_slots,
        )
        rows.append(r)
        ratio = r["nereus_success_pct"] / max(r["per_component_success_pct"], 1e-9)
        span = f"[{r['resource_edges_min']}-{r['resource_edges_max']}]"
        r["success_ratio_x"] = ratio
        print(
            f"{kind:>13} {trials:>6} {r['redrawn_unreachable']:>7} | "
            f"{r['nereus_success_pct']:>10.1f} "
            f"{r['resource_edges_mean']:>12.2f} {span:<10} {r['early_destroys_mean']:>7.2f} | "
            f"{r['per_component_success_pct']:>12.1f} {r['per_component_deadlock']:>8} "
            f"{r['per_component_timeout']:>7} {r['per_component_other']:>5} | {ratio:>7.2f}x",
            flush=True,
        )
    goal = all(r["nereus_success_pct"] == 100.0 for r in rows)
    print(f"goal (Nereus 100% in every type): {'met' if goal else 'NOT met'}")
    if args.json:
        write_benchmark_json(args.json, "bench_transition_trials", rows)


if __name__ == "__main__":
    main()
