"""Planner decision time against OR-Tools SCIP and CP-SAT, and whether the optima match.

The headline planner is the default one: its search compiled (``nereus_rl._native``)
when the module is built. The same calls are made with the Python search
(``Planner(native=False)``, the reference) side by side, with the ratio of their CPU
times (``py/nat``, unprepared and prepared), and ``same`` says whether every call of
every repeat returned the same plans and objectives on both.

For each cluster size (H200 nodes of 8) the benchmark makes a sequence of planner calls
in which the signals change from one call to the next (response-length bucket,
available devices, a refinement of the efficiencies), with one persistent Planner (its
caches are kept across calls, as in a running job), and reports the median decision
time: wall (``plan_ms``) and CPU time of the process (``plan_cpu_ms``, less sensitive to
a shared machine's load). ``plan_prepared_ms``/``plan_prepared_cpu_ms``: the same with
``Planner.prepare`` called at start-up for the sequence's response buckets (a job knows
its bucket edges), so a bucket change does not price every layout on the decision
path. It also reports the median of the same calls made cold (a fresh Planner each
time: nothing cached). Each sequence runs ``--repeats`` times (a fresh Planner each
time) and the medians are over every call of every repeat after each one's first (one
sequence of five or nine calls is too few on a shared machine); ``calls`` in the JSON
gives the median CPU time of each call of the sequence and how many set partitions it
searched. SCIP and CP-SAT solve the first call's problem with a time limit; a solver
that stops without proof is reported as such.

A refinement also rebuilds the persistent planner's latest context (the cost
model's refine listener), so each refinement's CPU is timed and printed apart
(``refine_cpu_ms``) beside the call right after it (``after_refine_prepared_cpu_ms``),
and a loop of refine-then-decide on one bucket and device count (a job's steps) gives
both medians (``refine_loop_plan_cpu_ms``, ``refine_loop_refine_cpu_ms``): the work a
refinement moves out of the decision is not hidden from the total.

Workload: PPO, Llama-3.1-8B actor, critic, reference and reward model, batch 2 x
devices prompts of 1,024 tokens. All latencies are cost-model predictions. The same
sequence is also planned for the asynchronous workload (the rollout one step ahead,
ranked by its overlapped step: ``planner.overlap_search``), CPU ms apart
(``async_plan_cpu_ms``).

    python benchmarks/bench_planner.py --quick --json out.json
    python benchmarks/bench_planner.py --quick --json new.json --compare old.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from nereus_rl.baselines.planner_milp import solve_cpsat, solve_scip
from nereus_rl.core.spec import cluster_preset
from nereus_rl.core.workload import make_workload
from nereus_rl.costmodel.costmodel import CostModel
from nereus_rl.planner import native as planner_native
from nereus_rl.planner.planner import Planner

REFINE_CPU_MS: list[float] = []  # CPU of each refinement made by _calls, in order

# (response bucket, devices lost, refine efficiencies before the call)
SIGNALS = [
    (2048, 0, False),
    (4096, 0, False),
    (4096, 8, False),
    (1024, 8, False),
    (1024, 0, True),
    (2048, 0, False),
    (2048, 16, False),
    (4096, 16, True),
    (8192, 0, False),
    (1024, 0, False),
]


def _repeated(
    n_dev: int,
    signals,
    persistent: bool,
    repeats: int,
    prepare: bool = False,
    native: bool | None = None,
    answers: list | None = None,
    ahead: bool = False,
):
    """Wall and CPU ms of the calls of ``repeats`` runs of the sequence (each run's first
    call left out when the planner is persistent), and each call's median CPU ms. Each
    call's (latency, k-best) is appended to ``answers`` when given."""
    wall, cpu, per_call = [], [], [[] for _ in signals]
    for _ in range(repeats):
        w, c, parts = _calls(n_dev, signals, persistent, prepare, native, answers, ahead)
        skip = 1 if persistent else 0
        wall += w[skip:]
        cpu += c[skip:]
        for j, v in enumerate(c):
            per_call[j].append(v)
    return wall, cpu, [statistics.median(v) for v in per_call], parts


def _calls(
    n_dev: int,
    signals,
    persistent: bool,
    prepare: bool = False,
    native: bool | None = None,
    answers: list | None = None,
    ahead: bool = False,
):
    """Wall and CPU (process) milliseconds of each call of the signal sequence, and the
    number of set partitions each call searched (``native``: see ``Planner``; ``ahead``:
    the asynchronous workload, ranked by its overlapped step)."""
    c = cluster_preset(f"h200x{n_dev}")
    cm = CostModel(c)
    base = make_workload(
        "ppo", reward="llama-3.1-8b", batch=2 * n_dev, prompt_len=1024, response_len=2048,
        rollout_ahead=ahead,
    )  # fmt: skip
    planner = Planner(c, cm, native=native)
    if prepare:  # a job knows its bucket edges: price their layouts at start-up
        planner.prepare(base.with_response_len(r) for r in sorted({s[0] for s in signals}))
    wall, cpu, parts = [], [], []
    prev = None
    for resp, lost, refine in signals:
        assert (resp, lost, refine) != prev
        prev = (resp, lost, refine)
        w = base.with_response_len(resp)
        if refine:  # a measured step moves the efficiencies (version bump)
            c0 = time.process_time()
            cm.observe_work({"gemm": 1.0, "mem": 0.5, "allreduce:intra": 0.1}, 3.1)
            # A refinement also rebuilds the persistent planner's latest context (its
            # listener): timed apart, so a decision's gain is not hidden from the total.
            REFINE_CPU_MS.append((time.process_time() - c0) * 1e3)
        devs = range(n_dev - lost) if lost < n_dev else range(n_dev)
        p = planner if persistent else Planner(c, cm, native=native)
        t0, c0 = time.perf_counter(), time.process_time()
        res = p.plan(w, devices=devs)
        cpu.append((time.process_time() - c0) * 1e3)
        wall.append((time.perf_counter() - t0) * 1e3)
        parts.append(res.timings.get("partitions", 0))
        if answers is not None:
            answers.append(res.k_best)
    return wall, cpu, parts


def _refine_loop(n_dev: int, steps: int = 30) -> tuple[float, float]:
    """A job's pattern: after every step a refinement (each a little different), then a
    decision on the same bucket and devices, with a prepared persistent planner. Median
    CPU ms of (the decisions, the refinements); the first step is left out."""
    c = cluster_preset(f"h200x{n_dev}")
    cm = CostModel(c)
    w = make_workload(
        "ppo", reward="llama-3.1-8b", batch=2 * n_dev, prompt_len=1024, response_len=2048
    )
    planner = Planner(c, cm)
    planner.prepare([w])
    plan_cpu, refine_cpu = [], []
    for i in range(steps + 1):
        c0 = time.process_time()
        cm.observe_work({"gemm": 1.0, "mem": 0.5, "allreduce:intra": 0.1}, 3.1 + 0.01 * i)
        c1 = time.process_time()
        planner.plan(w)
        c2 = time.process_time()
        if i:
            refine_cpu.append((c1 - c0) * 1e3)
            plan_cpu.append((c2 - c1) * 1e3)
    return statistics.median(plan_cpu), statistics.median(refine_cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer calls, MILP only at 32-64")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--milp-limit-s", type=float, default=None)
    ap.add_argument("--repeats", type=int, default=3, help="runs of the call sequence")
    ap.add_argument(
        "--compare", metavar="PATH", help="a previous --json output: print old, new, old/new"
    )
    args = ap.parse_args()
    sizes = [32, 64, 128, 256, 512, 1024, 4096]
    signals = SIGNALS[:6] if args.quick else SIGNALS
    milp_sizes = {32, 64} if args.quick else set(sizes)
    limit = args.milp_limit_s or (20.0 if args.quick else 120.0)
    rows = []
    native = planner_native.AVAILABLE
    print(f"headline search: {'compiled (nereus_rl._native)' if native else 'Python'}; CPU ms")
    hdr = (
        f"{'devices':>7} {'plan_ms':>9} {'cpu_ms':>8} {'prep_ms':>8} {'prep_cpu':>8} {'min_ms':>8} "
        f"{'cold_ms':>9} {'py_cpu':>8} {'py/nat':>6} {'py_prep':>8} {'py/nat':>6} {'same':>5} "
        f"{'scip_ms':>10} {'scip':>9} "
        f"{'cpsat_ms':>10} {'cpsat':>9} {'step_s':>8} {'=scip':>6} {'=cpsat':>6} {'scip/plan':>9}"
    )
    print(hdr)
    for n in sizes:
        # Medians over calls whose signals differ from the previous call's: all but the
        # first call of each run of the persistent planner (it has no previous call).
        nat_ans, py_ans = [], []
        warm, warm_cpu, warm_calls, parts = _repeated(
            n, signals, True, args.repeats, answers=nat_ans
        )
        REFINE_CPU_MS.clear()
        prep, prep_cpu, prep_calls, _ = _repeated(
            n, signals, True, args.repeats, prepare=True, answers=nat_ans
        )
        refine_cpu = statistics.median(REFINE_CPU_MS) if REFINE_CPU_MS else None
        # The calls right after a refinement: what a job that refines every step pays.
        after = [i for i, sig in enumerate(signals) if sig[2]]
        after_refine = [prep_calls[i] for i in after]
        cold, _, _, _ = _repeated(n, signals, False, 1)
        # The Python search on the same calls (the reference; same answers expected).
        _, py_cpu, py_calls, _ = _repeated(
            n, signals, True, args.repeats, native=False, answers=py_ans
        )
        _, py_prep_cpu, py_prep_calls, _ = _repeated(
            n, signals, True, args.repeats, prepare=True, native=False, answers=py_ans
        )
        same = nat_ans == py_ans
        plan_ms = statistics.median(warm)
        cold_ms = statistics.median(cold)
        c = cluster_preset(f"h200x{n}")
        cm = CostModel(c)
        w = make_workload("ppo", reward="llama-3.1-8b", batch=2 * n, response_len=2048)
        best = Planner(c, cm).plan(w)
        row = {
            "devices": n,
            "plan_ms": plan_ms,
            "plan_cpu_ms": statistics.median(warm_cpu),
            "plan_prepared_ms": statistics.median(prep),
            "plan_prepared_cpu_ms": statistics.median(prep_cpu),
            "refine_cpu_ms": refine_cpu,
            "after_refine_prepared_cpu_ms": statistics.median(after_refine) if after else None,
            "plan_cold_ms": cold_ms,
            "plan_min_ms": min(warm),
            "plan_max_ms": max(warm),
            "num_calls": len(warm),
            "native": native,
            "python_cpu_ms": statistics.median(py_cpu),
            "python_prepared_cpu_ms": statistics.median(py_prep_cpu),
            "same_answers_as_python": same,
            "calls": [
                {
                    "signal": list(sig),
                    "cpu_ms": a,
                    "prepared_cpu_ms": b,
                    "python_cpu_ms": c_,
                    "python_prepared_cpu_ms": d_,
                    "partitions": np_,
                }
                for sig, a, b, c_, d_, np_ in zip(
                    signals, warm_calls, prep_calls, py_calls, py_prep_calls, parts
                )
            ],
            "objective_s": best.latency_s,
        }
        for name, fn in (("scip", solve_scip), ("cpsat", solve_cpsat)):
            if n in milp_sizes:
                r = fn(w, c, cm, time_limit_s=limit)
                row[f"{name}_ms"] = r.solve_ms
                row[f"{name}_status"] = "proven" if r.proven else r.status
                row[f"{name}_objective_s"] = r.objective_s
                row[f"{name}_match"] = (
                    r.objective_s is not None
                    and abs(r.objective_s - best.latency_s) <= 1e-6 * best.latency_s + 1e-5
                )
            else:
                row[f"{name}_ms"] = None
                row[f"{name}_status"] = "not run"
                row[f"{name}_objective_s"] = None
                row[f"{name}_match"] = None
        row["scip_over_plan_x"] = row["scip_ms"] / plan_ms if row["scip_ms"] else None
        row["python_over_native_x"] = row["python_cpu_ms"] / row["plan_cpu_ms"]
        row["python_over_native_prepared_x"] = (
            row["python_prepared_cpu_ms"] / row["plan_prepared_cpu_ms"]
        )
        rows.append(row)

        def f(v, fmt):
            return "-" if v is None else format(str(v) if isinstance(v, bool) else v, fmt)

        print(
            f"{n:>7} {plan_ms:>9.2f} {row['plan_cpu_ms']:>8.2f} {row['plan_prepared_ms']:>8.2f} "
            f"{row['plan_prepared_cpu_ms']:>8.2f} {min(warm):>8.2f} {cold_ms:>9.2f} "
            f"{row['python_cpu_ms']:>8.2f} {row['python_over_native_x']:>6.1f} "
            f"{row['python_prepared_cpu_ms']:>8.2f} {row['python_over_native_prepared_x']:>6.1f} "
            f"{f(same, '>5')} "
            f"{f(row['scip_ms'], '>10.0f')} "
            f"{row['scip_status'][:9]:>9} {f(row['cpsat_ms'], '>10.0f')} "
            f"{row['cpsat_status'][:9]:>9} {best.latency_s:>8.2f} "
            f"{f(row['scip_match'], '>6')} {f(row['cpsat_match'], '>6')} "
            f"{f(row['scip_over_plan_x'], '>9.0f')}",
            flush=True,
        )
        # The asynchronous workload (rollout one step ahead), ranked by its overlapped
        # step (planner.overlap_search): the same signal sequence, a persistent planner.
        _, async_cpu, _, _ = _repeated(n, signals, True, args.repeats, ahead=True)
        row["async_plan_cpu_ms"] = statistics.median(async_cpu)
        row["async_plan_max_cpu_ms"] = max(async_cpu)
        print(
            f"{'':>7} asynchronous PPO (overlapped step), same signals: decision CPU median "
            f"{row['async_plan_cpu_ms']:.2f} ms, max {row['async_plan_max_cpu_ms']:.2f} ms",
            flush=True,
        )
        row["refine_loop_plan_cpu_ms"], row["refine_loop_refine_cpu_ms"] = _refine_loop(n)
        print(
            f"{'':>7} refine then decide, same bucket and devices (a job's steps): decision "
            f"CPU {row['refine_loop_plan_cpu_ms']:.3f} ms, refinement "
            f"{row['refine_loop_refine_cpu_ms']:.3f} ms",
            flush=True,
        )
        if after:
            print(
                f"{'':>7} prepared, calls right after a refinement: CPU "
                f"{row['after_refine_prepared_cpu_ms']:.3f} ms; the refinement itself "
                f"(observe_work, and the planner's listener) {refine_cpu:.3f} ms",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"benchmark": "bench_planner", "rows": rows}, fh, indent=1)
    if args.compare:
        _compare(args.compare, rows)


_COMPARED = ("plan_cpu_ms", "plan_prepared_cpu_ms", "plan_ms", "plan_cold_ms")
_COMPARED_NEW = (
    "after_refine_prepared_cpu_ms",
    "refine_cpu_ms",
    "refine_loop_plan_cpu_ms",
    "refine_loop_refine_cpu_ms",
)
_COMPARED_PY = ("python_cpu_ms", "python_prepared_cpu_ms")


def _compare(path: str, rows: list[dict]) -> None:
    """Print each size's timings from ``path`` beside this run's, with old/new ratios."""
    with open(path) as fh:
        old = {r["devices"]: r for r in json.load(fh)["rows"]}
    print(f"\nvs {path} (old -> new, old / new = speed-up)")
    for r in rows:
        o = old.get(r["devices"])
        if o is None:
            continue
        # The Python search's own figures, when both runs have them.
        keys = _COMPARED + tuple(k for k in _COMPARED_PY + _COMPARED_NEW if o.get(k) and r.get(k))
        cells = [f"{k}: {o[k]:.2f} -> {r[k]:.2f} ({o[k] / r[k]:.1f}x)" for k in keys]
        same = abs(o["objective_s"] - r["objective_s"]) <= 1e-9 * r["objective_s"]
        print(f"{r['devices']:>7} " + "  ".join(cells) + f"  same optimum: {same}")


if __name__ == "__main__":
    main()
