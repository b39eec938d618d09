"""Payback admission against replan-on-every-trigger and no adaptation, on synthetic traces.

A trace is a run of RL steps on h200x64 (PPO, Llama-3.1-8B actor, critic, reference
and reward model, 512 prompts of 1,024 tokens): the response length rises and falls
(600 + 3,000 sin(pi t / T) tokens, times 1 + N(0, noise)), 8 devices are lost at 30%
of the run and come back at 45%, 16 are lost at 70% and come back at 85%.
Each step costs the cost model's predicted latency of the running plan under that
step's actual response-length bucket. All three policies share the controller
(bucketed length with 10% hysteresis, device changes) and the exact planner:

    static   no adaptation: replans only when forced (the plan uses a lost device or
             does not fit memory for this step's length): the urgent path only;
    every    replan on every trigger and move whenever the plan differs;
    payback  urgent path as static; on other triggers, move only when the saving per
             step x the controller's forecast of steps until the next crossing repays
             the transition (nereus_rl.policy.admission).

Transition cost (a simple stand-in for the transition DAG's completion time): the
sum over stages whose layout or devices change of one Extend's predicted cost
(CostModel.primitive_cost), plus a fixed cost per transition of 0 s or 30 s (a
sensitivity case standing for engine re-initialisation and warm-up, which the primitive
costs do not include). All times are predicted (cost model), none measured.

    python benchmarks/bench_admission.py --quick --json out.json
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np

from nereus_rl.core.spec import cluster_preset
from nereus_rl.core.workload import bucket_of, make_workload
from nereus_rl.costmodel.costmodel import CostModel, UnitLayout
from nereus_rl.planner.planner import Planner
from nereus_rl.policy.admission import Admission
from nereus_rl.policy.controller import Controller

BUCKETS = (512, 1024, 2048, 4096, 8192)


def transition_cost(cm: CostModel, workload, cur, cand, fixed_s: float = 0.0) -> float:
    """Sum over changed stages of one Extend of the new layout, plus ``fixed_s`` if any."""
    if cur is None:
        return 0.0
    total = fixed_s if cur != cand else 0.0
    for sw in workload.planned_stages:
        a, b = cur.stage(sw.stage), cand.stage(sw.stage)
        if a == b:
            continue
        src = UnitLayout(a.tp, a.pp, a.units[0])
        dst = UnitLayout(b.tp, b.pp, b.units[0])
        total += cm.primitive_cost(
            "extend", sw.model_spec, trains=sw.trains, src=(src,), dst=(dst,)
        ).seconds
    return total


def make_trace(steps: int, seed: int, noise: float):
    rng = np.random.default_rng(seed)
    t = np.arange(steps)
    length = (600 + 3000 * np.sin(np.pi * t / steps)) * (1 + rng.normal(0, noise, steps))
    avail = []
    for i in range(steps):
        f = i / steps
        n = 64
        if 0.30 <= f < 0.45:
            n = 56
        elif 0.70 <= f < 0.85:
            n = 48
        avail.append(n)
    return np.maximum(length, 1.0), avail


def run(policy: str, length, avail, cm: CostModel, planner: Planner, base, fixed_s) -> dict:
    ctl = Controller(buckets=BUCKETS, hysteresis=0.1, window=8, horizon=100)
    adm = Admission(cm)
    plan = None
    total = trans_total = 0.0
    moves = declined = urgent = 0
    for step, (ell, n) in enumerate(zip(length, avail)):
        devs = range(n)
        trig = ctl.update(
            step,
            seq_len=float(ell),
            available_devices=devs,
            in_use=plan.devices if plan else (),
        )
        actual = base.with_response_len(bucket_of(ell, BUCKETS))
        planning = base.with_response_len(max(ctl.seq_len.bucket, actual.response_len))
        must = plan is None or not cm.feasible(plan, actual, devs)
        if must or (trig and policy != "static"):
            cand = planner.plan(planning, devices=devs).plan
            cost = transition_cost(cm, planning, plan, cand, fixed_s)
            if must:
                take = True
                urgent += 1
            elif policy == "every":
                take = cand != plan
            else:
                sig = trig[0].signal
                d = adm.decide(
                    plan,
                    cand,
                    planning,
                    forecast_steps=ctl.forecast(sig),
                    transition_cost=cost,
                    available_devices=devs,
                    trigger=sig,
                )
                take = d.taken
                declined += not take
            if take and cand != plan:
                if plan is not None:
                    moves += 1
                    trans_total += cost
                plan = cand
        total += cm.step_latency(plan, actual).total_s
    return {
        "policy": policy,
        "step_time_s": total,
        "transition_s": trans_total,
        "total_s": total + trans_total,
        "transitions": moves,
        "urgent": urgent,
        "declined": declined,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    steps = 120 if args.quick else 300
    seeds = [0, 1] if args.quick else [0, 1, 2, 3, 4]
    noises = [0.05, 0.15]
    fixed = [0.0, 30.0]
    c = cluster_preset("h200x64")
    cm = CostModel(c)
    planner = Planner(c, cm)
    base = make_workload("ppo", reward="llama-3.1-8b", batch=512, prompt_len=1024)
    rows = []
    print(
        f"{'fixed':>5} {'seed':>4} {'noise':>5} {'policy':>8} {'total_s':>10} {'steps_s':>10} "
        f"{'trans_s':>8} {'moves':>5} {'urgent':>6} {'declined':>8} {'vs_payback_x':>12}"
    )
    ok = True
    for fx, noise, seed in [(f, n, s) for f in fixed for n in noises for s in seeds]:
        length, avail = make_trace(steps, seed, noise)
        res = {
            p: run(p, length, avail, cm, planner, base, fx) for p in ("payback", "every", "static")
        }
        pb = res["payback"]["total_s"]
        for p, r in res.items():
            r.update(
                fixed_s=fx, seed=seed, noise=noise, steps=steps, vs_payback_x=r["total_s"] / pb
            )
            rows.append(r)
            print(
                f"{fx:>5.0f} {seed:>4} {noise:>5} {p:>8} {r['total_s']:>10.1f} "
                f"{r['step_time_s']:>10.1f} "
                f"{r['transition_s']:>8.1f} {r['transitions']:>5} {r['urgent']:>6} "
                f"{r['declined']:>8} {r['vs_payback_x']:>12.4f}"
            )
        ok &= all(pb <= r["total_s"] * (1 + 1e-12) for r in res.values())
    for fx in fixed:
        for p in ("every", "static"):
            xs = [r["vs_payback_x"] for r in rows if r["policy"] == p and r["fixed_s"] == fx]
            gm = math.exp(np.mean(np.log(xs)))
            print(f"fixed {fx:.0f} s: {p} / payback: geomean {gm:.4f}, min {min(xs):.4f}")
    print("payback never loses:", ok)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {"benchmark": "bench_admission", "rows": rows, "payback_never_loses": ok},
                fh,
                indent=1,
            )


if __name__ == "__main__":
    main()
