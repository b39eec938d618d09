"""End to end: Nereus adaptive vs fixed plans on the same length schedule and devices.

Variants, all on the same worker processes, seed, warm start and response-length
schedule (the default curriculum, or --trace FILE):

    adaptive       the planner's first plan, adaptation with payback admission
    colocated      every stage on every device, fixed (as verl chooses at startup)
    disaggregated  rollout on half the devices, the rest on the other half (OpenRLHF)
    replan_always  adaptation that executes every candidate (replan on each trigger)
    best_fixed     the fastest of the fixed plans tried (colocated, disaggregated and
                   the planner's first plan kept fixed): the empirical best fixed plan

Reported per variant: mean step latency (transitions included), total seconds,
transitions, mean reward, and whether the fixed plan exceeded the per-worker memory
budget (predicted peak / budget > 1 at some step: a plan that a device with that
memory could not run; on this CPU machine it still runs, since the budget is enforced
on the cost model's prediction). best_fixed is chosen among the fixed plans that fit.
Ratios are against the adaptive run.

    python benchmarks/bench_e2e.py --quick
    python benchmarks/bench_e2e.py --algos grpo,ppo,remax --modes sync,async --steps 20
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from nereus_rl.runtime import Driver
from nereus_rl.trainer import TrainConfig, Trainer, simple_plan, train


def _mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def _row(name, algo, mode, res, budget):
    m = res.metrics
    lat = [x["step_s"] + x.get("transition_s", 0.0) for x in m]
    frac = max((x.get("peak_memory_fraction") or 0.0) for x in m) if m else float("nan")
    return {
        "algo": algo,
        "mode": mode,
        "variant": name,
        "step_latency_s": _mean(lat),
        "total_s": sum(lat),
        "transitions": res.num_transitions,
        "reward_mean": _mean([x["reward_mean"] for x in m]),
        "peak_memory_fraction": frac,
        # adaptive runs move away before the next step when the signal passes 1
        "fits_budget": frac <= 1.0 or res.num_transitions > 0,
        "memory_budget_bytes": budget,
        "plans": len(res.plans),
        "error": res.error,
    }


def run_setting(driver, algo, mode, common):
    """All variants of one (algo, mode) setting; returns their rows."""
    devices = common["devices"]
    probe = Trainer(TrainConfig(algo=algo, mode=mode, **common))
    budget = probe.adapter.budget
    first = probe.first_plan
    probe.driver.shutdown()  # the probe planned only; it started no workers
    kw = dict(algo=algo, mode=mode, driver=driver, memory_budget=budget, **common)
    rows = []
    res = train(adapt=True, **kw)
    rows.append(_row("adaptive", algo, mode, res, budget))
    res = train(adapt=True, admission="always", **kw)
    rows.append(_row("replan_always", algo, mode, res, budget))
    fixed = []
    for name, plan in (
        ("colocated", simple_plan(algo, devices, "colocated")),
        ("disaggregated", simple_plan(algo, devices, "disaggregated")),
        ("planner_first_fixed", first),
    ):
        res = train(adapt=False, plan=plan, **kw)
        row = _row(name, algo, mode, res, budget)
        fixed.append(row)
        if name != "planner_first_fixed":
            rows.append(row)
    # A fixed plan whose predicted peak exceeds the per-worker budget at some step could
    # not run on devices with that memory; the best fixed plan is chosen among the others.
    fits = [r for r in fixed if r["fits_budget"]]
    best = min(fits or fixed, key=lambda r: r["step_latency_s"])
    label = best["variant"] if fits else f"{best['variant']}, none fits the budget"
    rows.append({**best, "variant": f"best_fixed ({label})"})
    base = rows[0]["step_latency_s"]
    for r in rows:
        r["latency_vs_adaptive_x"] = r["step_latency_s"] / base
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="GRPO sync only, few steps")
    ap.add_argument("--algos", default="grpo,ppo,remax")
    ap.add_argument("--modes", default="sync,async")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--trace", default=None, help="response-length trace (CSV or JSON)")
    ap.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = ap.parse_args(argv)
    algos, modes = args.algos.split(","), args.modes.split(",")
    steps = args.steps
    common = dict(devices=args.devices, warm_steps=60, batch=8, group_size=4, seed=0)
    if args.quick:
        algos, modes, steps = ["grpo"], ["sync"], 6
        common.update(warm_steps=20, batch=4)
    common.update(steps=steps, length_start=6, length_end=20)
    if args.trace:
        common["trace"] = args.trace
    t0 = time.perf_counter()
    driver = Driver(heartbeat_timeout=60.0, call_timeout=600.0)
    rows = []
    try:
        driver.spawn_local(args.devices)
        for algo in algos:
            for mode in modes:
                rows += run_setting(driver, algo, mode, common)
    finally:
        driver.shutdown()
    head = (
        f"{'algo':6} {'mode':5} {'variant':44} {'step_s':>8} {'total_s':>8} {'vs_adapt':>8} "
        f"{'trans':>5} {'reward':>7} {'mem/budget':>10} fits"
    )
    print(head)
    for r in rows:
        fits = "yes" if r["fits_budget"] else "NO"
        print(
            f"{r['algo']:6} {r['mode']:5} {r['variant']:44} {r['step_latency_s']:8.3f} "
            f"{r['total_s']:8.2f} {r['latency_vs_adaptive_x']:8.2f}x {r['transitions']:5d} "
            f"{r['reward_mean']:7.3f} {r['peak_memory_fraction']:10.2f} {fits}"
            + (f"  ERROR {r['error']}" if r["error"] else "")
        )
    print(f"bench_e2e: {time.perf_counter() - t0:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"benchmark": "bench_e2e", "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
