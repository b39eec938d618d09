"""Where adaptive loses against the best fixed plan, step by step.

This runs adaptive (a first unrecorded run, then ``--runs - 1`` recorded ones) on
bench_e2e's quick trace and sizes, prints each step's plan, step_s and transition_s and
each decision (taken or not, predicted saving, forecast steps, predicted and measured
transition), then runs the same trace fixed on every plan adaptive used and on the
``--top`` fixed plans the calibrated model ranks best (bench_e2e's enumeration), and
splits adaptive's excess over the best of them:

    adaptive - best = transitions (measured, per step)
                    + plan choice (per step: the fixed run of the plan adaptive ran at
                      that step minus the best fixed plan's, i.e. start plan and moves)
                    + rest (one-off costs on a new layout, and noise)

The startup calibration (probes) runs outside the steps; its seconds are printed.

    python tools/diag_adapt_steps.py [--algo grpo] [--mode sync]
        [--runs 2] [--top 4] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

# The repo root on sys.path, so that `benchmarks.lib` imports (see benchmarks/__init__.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lib.e2e_plans import enumerate_fixed, write_trace
from nereus_rl.runtime import Driver
from nereus_rl.trainer.trainer import TrainConfig, Trainer, train


def _rows(res) -> list[dict]:
    return [
        {"step": m["step"], "plan": m["plan"], "step_s": round(m["step_s"], 4),
         "transition_s": round(m.get("transition_s", 0.0), 4), "rlen": m["response_len"]}
        for m in res.metrics
    ]  # fmt: skip


def _mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def _decisions(res) -> None:
    for d in res.decisions:
        meas = d.get("measured_transition_s")
        print(
            f"    decision @{d['step']} {d.get('signal')} {d.get('path', '-')} "
            f"taken={d.get('taken')} saving={d.get('predicted_saving_s', 0):.4f} "
            f"fc={d.get('forecast_steps', '-')} tcost={d.get('predicted_transition_s', 0):.3f} "
            f"meas={'-' if meas is None else f'{meas:.3f}'}: {d.get('reason', '')[:150]}"
        )


def breakdown(adaptive: list[dict], fixed: dict[str, list[float]]) -> dict:
    """Split adaptive's mean step latency over the best fixed plan's (module doc)."""
    n = len(adaptive)
    best = min(fixed, key=lambda p: _mean(fixed[p]))
    ad = _mean([r["step_s"] + r["transition_s"] for r in adaptive])
    trans = sum(r["transition_s"] for r in adaptive) / n
    choice = _mean([fixed[r["plan"]][r["step"]] - fixed[best][r["step"]] for r in adaptive])
    start = _mean(fixed[adaptive[0]["plan"]]) - _mean(fixed[best])
    return {
        "adaptive_s": ad, "best_fixed_s": _mean(fixed[best]), "best_plan": best,
        "excess_s": ad - _mean(fixed[best]), "transitions_s": trans, "plan_choice_s": choice,
        "start_plan_excess_s": start, "rest_s": ad - _mean(fixed[best]) - trans - choice,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algo", default="grpo")
    ap.add_argument("--mode", default="sync")
    ap.add_argument("--runs", type=int, default=2, help="adaptive runs (the first unrecorded)")
    ap.add_argument("--top", type=int, default=4, help="best-ranked fixed plans to run too")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory()
    trace = str(write_trace(Path(tmp.name) / "trace.csv", 10))
    common = dict(algo=args.algo, mode=args.mode, devices=4, warm_steps=20, batch=4,
                  group_size=4, seed=0, steps=10, trace=trace)  # fmt: skip
    d = Driver(heartbeat_timeout=60.0, call_timeout=600.0)
    d.spawn_local(4)
    out = {"loadavg_start": os.getloadavg(), "runs": [], "breakdowns": []}
    try:
        probe = Trainer(TrainConfig(**common), driver=d)
        probe.start()
        budget = probe.adapter.budget
        lengths = [probe.response_len(i) for i in range(10)]
        enum, _ = enumerate_fixed(probe.adapter, lengths, [])
        probe.close()
        print(f"{args.algo} {args.mode}: budget {budget} B; top {args.top} of {len(enum)}")
        kw = dict(driver=d, memory_budget=budget, **common)
        adaptive, by_repr = [], {repr(p): p for _, p in enum}
        for i in range(args.runs):
            res = train(adapt=True, **kw)
            rows = _rows(res)
            cal = res.timings.get("calibration_s", 0.0)
            out["runs"].append({"kind": "adaptive", "recorded": i > 0, "steps": rows,
                                "calibration_s": cal, "decisions": res.decisions})  # fmt: skip
            print(f"adaptive run {i} ({'recorded' if i else 'warm-up'}), calibration {cal:.2f} s:")
            for r in rows:
                print(f"  {r['step']:2d} len {r['rlen']:2d} step {r['step_s']:.3f} "
                      f"trans {r['transition_s']:.3f}  {r['plan']}")  # fmt: skip
            _decisions(res)
            if i > 0:
                adaptive.append(rows)
                by_repr.update((repr(p), p) for _, p in res.plans)
        plans = {r["plan"] for rows in adaptive for r in rows}
        plans |= {repr(p) for _, p in enum[: args.top]}
        fixed: dict[str, list[float]] = {}
        for pr in sorted(plans):
            p = by_repr[pr]
            fx = train(adapt=False, plan=p, **kw)
            rows = _rows(fx)
            fixed[pr] = [r["step_s"] for r in rows]
            out["runs"].append({"kind": "fixed", "plan": pr, "steps": rows})
            each = " ".join(f"{x:.3f}" for x in fixed[pr])
            print(f"fixed mean {_mean(fixed[pr]):.3f}: {each}  {pr}")
        for rows in adaptive:
            if all(r["plan"] in fixed for r in rows):
                b = breakdown(rows, fixed)
                out["breakdowns"].append(b)
                print("breakdown (s/step): " + ", ".join(
                    f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in b.items()
                ))  # fmt: skip
            else:
                print("breakdown: a plan adaptive ran was not run fixed")
    finally:
        d.shutdown()
    out["loadavg_end"] = os.getloadavg()
    la, lb = out["loadavg_start"][0], out["loadavg_end"][0]
    print(f"load average (1 min) start/end: {la:.1f} / {lb:.1f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
