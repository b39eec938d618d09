"""Where an adaptive step's time goes: fixed plan P vs an adaptive run started on P.

Both run on the same workers, seed, budget and a constant response length, so the
adaptive run (startup calibration, a boundary after every step: controller, planner,
lookahead, admission) normally never leaves P; runs that moved are left out of the
medians. Per step it reports wall step_s and CPU seconds (the workers' from
/proc/<pid>/stat, the driver's from time.process_time), inside the step and at the
boundary (which no step latency counts). CPU time is the figure to compare on a
shared machine; wall time follows the load.

    python tools/diag_adapt_cpu.py --quick --json out.json   # ~1 min idle
    python tools/diag_adapt_cpu.py --algo remax --runs 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import nereus_rl.trainer.trainer as trainer_mod
from nereus_rl.runtime import Driver
from nereus_rl.trainer.adapt import adapter as trainer_adapt
from nereus_rl.trainer.trainer import train

_TCK = os.sysconf("SC_CLK_TCK")


def workers_cpu(pids: list[int]) -> float:
    """User + system CPU seconds of the given processes so far."""
    total = 0
    for p in pids:
        fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / _TCK


class _Meter:
    """Wraps Trainer.run and Adapter.boundary to split CPU time into step and boundary."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.on = False
        self.rows: dict[str, list[float]] = {}
        self._run, self._boundary = trainer_mod.Trainer.run, trainer_adapt.Adapter.boundary
        meter = self

        def run(tr):
            meter.last = (workers_cpu(pids), time.process_time())
            return meter._run(tr)

        def boundary(ad, step, m):
            if not meter.on:
                return meter._boundary(ad, step, m)
            w0, d0 = workers_cpu(pids), time.process_time()
            meter.rows["step_workers"].append(w0 - meter.last[0])
            meter.rows["step_driver"].append(d0 - meter.last[1])
            out = meter._boundary(ad, step, m)
            meter.last = (workers_cpu(pids), time.process_time())
            meter.rows["boundary_workers"].append(meter.last[0] - w0)
            meter.rows["boundary_driver"].append(meter.last[1] - d0)
            return out

        trainer_mod.Trainer.run, trainer_adapt.Adapter.boundary = run, boundary

    def start(self) -> None:
        self.on = True
        self.rows = {k: [] for k in ("step_workers", "step_driver", "boundary_workers",
                                     "boundary_driver")}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 runs of each (default 6)")
    ap.add_argument("--algo", default="grpo")
    ap.add_argument("--mode", default="sync")
    ap.add_argument("--runs", type=int, default=None, help="runs of each variant")
    ap.add_argument("--length", type=int, default=8, help="constant response length")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    runs = args.runs or (4 if args.quick else 6)
    tmp = tempfile.TemporaryDirectory()
    trace = Path(tmp.name) / "const.csv"
    trace.write_text("step,response_len\n" + "".join(f"{i},{args.length}\n" for i in range(10)))
    common = dict(devices=4, warm_steps=20, batch=4, group_size=4, seed=0, steps=10,
                  trace=str(trace), algo=args.algo, mode=args.mode)  # fmt: skip
    load0 = os.getloadavg()[0]
    driver = Driver(heartbeat_timeout=60.0, call_timeout=600.0)
    out: dict[str, list[dict]] = {"fixed": [], "adaptive": []}
    try:
        driver.spawn_local(4)
        meter = _Meter([driver._procs[r].pid for r in sorted(driver._procs)])
        warm = train(adapt=True, driver=driver, **common)  # unrecorded; picks P and budget
        plan, budget = warm.plans[0][1], warm.metrics[0]["memory_budget_bytes"]
        for i in range(runs):
            order = ("fixed", "adaptive") if i % 2 == 0 else ("adaptive", "fixed")
            for name in order:
                meter.start()
                res = train(adapt=name == "adaptive", plan=plan, memory_budget=budget,
                            driver=driver, **common)  # fmt: skip
                row = {k: statistics.mean(v) for k, v in meter.rows.items()}
                row["step_s"] = statistics.mean(m["step_s"] for m in res.metrics[:-1])
                row["stayed"] = [p for _, p in res.plans] == [plan]
                out[name].append(row)
                vals = " ".join(f"{k} {v:.4f}" for k, v in row.items() if k != "stayed")
                print(f"{name:8} {vals} stayed {row['stayed']}")
    finally:
        driver.shutdown()
        tmp.cleanup()
    keys = ("step_s", "step_workers", "step_driver", "boundary_workers", "boundary_driver")
    summary = {}
    for name, rows in out.items():
        kept = [r for r in rows if r["stayed"]]
        summary[name] = {k: statistics.median(r[k] for r in kept) for k in keys} if kept else {}
        print(f"{name:8} median of {len(kept)} runs on the plan: "
              + " ".join(f"{k} {v:.4f}" for k, v in summary[name].items()))  # fmt: skip
    # Paired: each adaptive run that stayed against the fixed run of the same round
    # (adjacent in time, so they met about the same load).
    pairs = [(a, f) for a, f in zip(out["adaptive"], out["fixed"]) if a["stayed"]]
    summary["paired"] = {}
    for k in ("step_s", "step_workers", "step_driver"):
        ratios = [a[k] / f[k] for a, f in pairs]
        summary["paired"][k] = ratios
        if ratios:
            med, lo, hi = statistics.median(ratios), min(ratios), max(ratios)
            n = len(ratios)
            print(f"adaptive / fixed, paired ({n}): {k} median {med:.2f}x, {lo:.2f}..{hi:.2f}x")
    load1 = os.getloadavg()[0]
    print(f"plan {plan!r}; load average (1 min) start/end {load0:.1f} / {load1:.1f}")
    if args.json:
        args.json.write_text(json.dumps({"plan": repr(plan), "runs": out, "summary": summary,
                                         "load": [load0, load1]}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
