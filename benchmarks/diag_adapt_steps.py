"""Per-step latency of adaptive GRPO runs beside fixed runs of the plans they used.

bench_e2e --quick measured adaptive at 1.6-2x its own start plan run fixed
(planner_fixed) under load 9-12 while its plans were among the faster fixed ones;
this prints each adaptive step's plan, step_s and transition_s, then the same
trace on each plan it ran, fixed (setup outside the steps), so one can see which
steps carry the excess. Quick sizes as bench_e2e --quick (GRPO sync, 10 steps).

    PYTHONPATH=. python benchmarks/diag_adapt_steps.py [--runs 2] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from bench_e2e import write_trace

from nereus_rl.runtime import Driver
from nereus_rl.trainer import train


def _rows(res) -> list[dict]:
    return [
        {"step": m["step"], "plan": m["plan"], "step_s": round(m["step_s"], 4),
         "transition_s": round(m.get("transition_s", 0.0), 4), "rlen": m["response_len"]}
        for m in res.metrics
    ]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2, help="adaptive runs (the first unrecorded)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory()
    trace = str(write_trace(Path(tmp.name) / "trace.csv", 10))
    common = dict(algo="grpo", mode="sync", devices=4, warm_steps=20, batch=4, group_size=4,
                  seed=0, steps=10, trace=trace)  # fmt: skip
    d = Driver(heartbeat_timeout=60.0, call_timeout=600.0)
    d.spawn_local(4)
    out = {"loadavg_start": os.getloadavg(), "runs": []}
    try:
        for i in range(args.runs):
            res = train(adapt=True, driver=d, **common)
            rows = _rows(res)
            out["runs"].append({"kind": "adaptive", "recorded": i > 0, "steps": rows})
            print(f"adaptive run {i} ({'recorded' if i else 'warm-up'}):")
            for r in rows:
                print(f"  {r['step']:2d} len {r['rlen']:2d} step {r['step_s']:.3f} "
                      f"trans {r['transition_s']:.3f}  {r['plan']}")  # fmt: skip
            budget = res.metrics[0]["memory_budget_bytes"]
            for _, p in res.plans if i == args.runs - 1 else []:
                fx = train(adapt=False, plan=p, driver=d, memory_budget=budget, **common)
                rows = _rows(fx)
                out["runs"].append({"kind": "fixed", "plan": repr(p), "steps": rows})
                mean = sum(r["step_s"] for r in rows) / len(rows)
                each = " ".join(f"{r['step_s']:.3f}" for r in rows)
                print(f"fixed {p!r}: mean {mean:.3f}: {each}")
    finally:
        d.shutdown()
    out["loadavg_end"] = os.getloadavg()
    la, lb = out["loadavg_start"][0], out["loadavg_end"][0]
    print(f"load average (1 min) start/end: {la:.1f} / {lb:.1f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
