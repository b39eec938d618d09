"""Cost model: predicted against measured training-step compute on held-out plans.

It measures what can run on the local CPU: one training step (forward + backward over
all micro-batches, then one ``torch.optim.AdamW(foreach=False)`` step) of the project's
model, ``nereus_rl.models.model.Decoder``, in the ``tiny`` and ``small`` presets, fp32, one
thread per process. A "plan" is (preset, processes, micro-batch, sequence length); 8
sequences per step are split over the processes (data parallel, no gradient all-reduce:
compute only). Process layouts:

    1p        one process on core 0                  (local-cpu, 1 worker per core)
    2p-2core  two processes, one on each core        (2 workers, 1 per core)
    2p-1core  two processes pinned to core 0         (2 workers, 2 per core)

The cost model's efficiencies (gemm, attention, mem, elementwise, launch and the two
co-runner classes, interference and contention) are fitted with
``CostModel.observe_work`` on the ``fit`` plans only: half of the 1p plans (a
checkerboard over micro-batch x sequence length) and a quarter of each 2-process
layout's (every other cell of that checkerboard; ``--fit 1p`` leaves them out).
Co-runners cannot be learnt from one process. Every other plan is held out and only
predicted; the split is fixed by the grid, not chosen by the errors. Measures, each
fitted and scored on its own:

    wall    wall-clock step time; predicted with the local-cpu sharing model (two
            workers on one core get half a core each);
    cpu     the process's CPU time for the step (time.thread_time); predicted as the
            layout's work times the share of a core a worker gets (time-slicing adds
            wall time, not CPU time), so the model still tells co-runners that share a
            core (interference) from those on the other core (contention);
    cpuraw  the same, on the CPU figures as measured (no host-speed probe, see below);
    cpu1    the CPU figures scored by a simpler model: every worker priced as if it
            had a core, one co-runner class for both 2-process layouts (an A/B on the
            same measurements).

Measurement (``benchmarks.lib.costmodel_measure``): on a shared machine identical work
takes 1-2x its fastest CPU time from one repetition to the next, so each repetition
records whether it is *clean*: no steal, no other runnable task and (a worker per core)
no preemption. With ``--across min`` a plan's figures come from its clean repetitions
when it has ``MIN_CLEAN``, else its steal-free ones, else all; the median over rounds
takes every repetition.

The grid is measured in rounds (4 with --quick, 32 without), a plan at a time, in a
new order each round (seeded: a plan does not always follow the same neighbours, whose
disturbances then average out instead of sticking to it): a warm-up step, then as many
repetitions as fit 0.1 s at its warm-up speed (2 to 8: cheap plans get many, the small
preset 2). A round's CPU figure of a plan is, per process, the sum over the step's
parts (each micro-batch's forward + backward, the optimizer step) of the part's fastest
repetition in that round, then the slower process (``--estimator step``: each
process's fastest whole step). Per process, not the slower process per repetition: the
maximum of two independent noises would bias every 2-process figure up against the
1-process ones, and the model would learn that bias as interference. The plan's figure
is the median of its rounds' figures (``--across median``, the default). A shared
machine's noise is per round (slow phases last longer than a plan's repetitions), and a
median over rounds is robust to it, whereas ``--across min`` (the sum of each part's
fastest repetition over all rounds) is a minimum over more draws the more repetitions a
plan has (cheap plans, many micro-batches): a bias that grows with the rounds.

Host speed (``--speed probe``, the default): the host moves a step's CPU time 1.5-2x
between moments (other guests; no trace in the guest's counters), and the rounds need
not sample it alike for every plan: a plan whose rounds fall in fast moments more often
than its neighbours' would look mispredicted. The optimizer step is the same work in
every plan of a preset and layout and runs inside the step, so each round's figure is
scaled, per process, by a reference optimizer time (``costmodel_figures.speed_refs``)
over that round's fastest optimizer part (what the micro-batches leave in the caches
still moves it a few % between plans, a bias the probe passes on); ``cpuraw`` scores
the raw figures beside it. Wall time (raw): per round the slower process per repetition,
the fastest of those, then the median over rounds. The rounds' spread is kept to show
the noise, and the load average.

Beside the error it prints a noise floor that needs no model
(``benchmarks.lib.costmodel_scoring``): identical-work twins, even against odd rounds,
and, given several runs' outputs, what persists across runs (the model's error) against
what averages out (noise), and the error on each plan's least figure over the runs.

    python benchmarks/bench_costmodel.py --quick --json out.json
    python benchmarks/bench_costmodel.py --measurements out.json   # re-score, no measuring
    python benchmarks/bench_costmodel.py --measurements run1.json run2.json run3.json
    python benchmarks/bench_costmodel.py --json full.json     # 32 rounds (8x --quick)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

# The repo root on sys.path, so that `benchmarks.lib` imports (see benchmarks/__init__.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lib import costmodel_figures as figures
from benchmarks.lib import costmodel_scoring as scoring
from benchmarks.lib.costmodel_measure import BATCH, LAYOUTS, measure
from nereus_rl.core.spec import local_cpu_cluster, model_preset
from nereus_rl.core.workload import StageWork
from nereus_rl.costmodel.work import CLASS_INDEX, stage_work

MIN_CLEAN = 3  # a plan's figures come from its clean repetitions when it has this many


def _work(preset, dp, wpc, mb, seq):
    spec = model_preset(preset)
    sw = StageWork("actor_train", "actor", "train", spec, False, BATCH, seq, 0, mb, 1)
    cluster = local_cpu_cluster(dp, wpc)
    w = stage_work(sw, dp, 1, 1, ("intra", "intra", "intra"), cluster, "fp32")
    w[CLASS_INDEX["allreduce:intra"]] = 0.0  # compute only: no gradient all-reduce here
    return w


def _pct(flags) -> str:
    flags = list(flags)
    return f"{100.0 * sum(flags) / max(len(flags), 1):.0f}%"


def _rows(measured, estimator: str, across: str = "median", speed: str = "probe") -> list[dict]:
    """One row per plan: its figures from the clean repetitions when there are enough
    (``across``: ``median`` of the rounds' figures, or ``min`` over every repetition).

    ``speed``: ``probe`` (with the median over rounds) scales each round's CPU figure to
    the run's typical host speed (``costmodel_figures.speed_refs``); ``raw`` takes it as
    measured (scored beside it as ``cpuraw``). Wall time is always raw.
    """
    refs = figures.speed_refs(measured) if speed == "probe" and across == "median" else {}
    rows = []
    for (preset, mb, seq, lay), reps in measured:
        ref = refs.get((preset, lay))
        clean = [r for r in reps if r["clean"]]
        no_steal = [r for r in reps if r.get("steal", 1) == 0]
        if across == "min":
            # The cleanest set that has MIN_CLEAN repetitions: clean, else steal-free, else all.
            use = next(u for u in (clean, no_steal, reps) if len(u) >= MIN_CLEAN or u is reps)
            cpu_s, wall_s = figures.cpu_estimate(use, estimator), min(r["wall"] for r in use)
            raw_s = cpu_s
        else:
            # Every round counts: clean repetitions are rare, so keeping only them would
            # leave a median over a few rounds; the median over rounds is what makes a
            # disturbed round harmless.
            use = reps
            cpu_s, wall_s = figures.median_over_rounds(use, estimator, ref)
            raw_s = figures.median_over_rounds(use, estimator)[0] if ref is not None else cpu_s
        row = {
            "preset": preset,
            "layout": lay,
            "processes": LAYOUTS[lay][0],
            "micro_batch": mb,
            "seq_len": seq,
            "reps": len(reps),
            "rounds": len({r["round"] for r in reps}),
            "clean_reps": len(clean),
            "steal_free_reps": len(no_steal),
            "figure_from": "clean" if use is clean else "steal-free" if use is no_steal else "all",
            "wall_measured_ms": wall_s * 1e3,
            "cpu_measured_ms": cpu_s * 1e3,
            "cpuraw_measured_ms": raw_s * 1e3,
            "speed": "probe" if ref is not None else "raw",
            "wall_median_ms": float(np.median([r["wall"] for r in reps])) * 1e3,
            "cpu_median_ms": float(np.median([r["cpu"] for r in reps])) * 1e3,
        }
        # Repeatability: the same figure from each round's repetitions alone (its clean
        # ones if it has any), and how far apart the rounds' figures are.
        per_round = {}
        for r in reps:
            per_round.setdefault(r["round"], []).append(r)
        wall, cpu, cpu_probe = [], [], []
        for got in per_round.values():
            got = [r for r in got if r["clean"]] or got
            wall.append(min(r["wall"] for r in got))
            cpu.append(figures.cpu_estimate(got, estimator))
            cpu_probe.append(figures.cpu_estimate(got, estimator, ref))
        row["wall_round_spread_pct"] = 100.0 * (max(wall) / min(wall) - 1.0)
        row["cpu_round_spread_pct"] = 100.0 * (max(cpu) / min(cpu) - 1.0)
        # The rounds' middle half, raw and at the reference speed: what the probe removes.
        row["cpuraw_round_iqr_pct"] = figures.iqr_pct(cpu)
        row["cpu_round_iqr_pct"] = figures.iqr_pct(cpu_probe)
        rows.append(row)
    return rows


def _works(rows: list[dict]) -> dict:
    """Ideal work per class of each row, per metric (see the module docstring)."""
    works: dict = {"wall": [], "cpu": [], "cpuraw": [], "cpu1": []}
    for r in rows:
        dp, wpc, _ = LAYOUTS[r["layout"]]
        w = _work(r["preset"], dp, wpc, r["micro_batch"], r["seq_len"])
        works["wall"].append(w)
        # CPU time: the same layout's work at the share of a core the worker gets
        # (time-slicing adds wall time, not CPU time), so the model still knows which
        # co-runners share a core and which run beside it on another.
        works["cpu"].append(w / wpc)
        works["cpuraw"].append(w / wpc)  # the same model on the raw CPU figures
        # A simpler model, scored on the same figures: every worker priced as if it
        # had a core, so both 2-process layouts alike and one co-runner class (all of
        # it lands in ``contention``; ``interference`` stays at its start, unused).
        works["cpu1"].append(_work(r["preset"], dp, 1.0, r["micro_batch"], r["seq_len"]))
    return works


def _scored(
    measured,
    estimator: str,
    fit: str,
    metrics=("wall", "cpu", "cpuraw", "cpu1"),
    across: str = "median",
    speed: str = "probe",
):
    """Rows of ``measured`` scored: (rows, summary, efficiencies)."""
    rows = _rows(measured, estimator, across, speed)
    works = {m: w for m, w in _works(rows).items() if m in metrics}
    summary, effs = scoring.score(rows, works, fit, LAYOUTS)
    return rows, summary, effs


def _load(path: str):
    with open(path) as fh:
        saved = json.load(fh)
    measured = [(tuple(m["plan"]), m["reps"]) for m in saved["repetitions"]]
    return measured, saved["loadavg_start"], saved["loadavg_end"]


def _noise_floor(
    measured, rows, estimator: str, fit: str, across: str = "median", speed: str = "probe"
) -> dict:
    """Model-free noise estimates beside the error (see costmodel_scoring)."""
    out: dict = {"twins": scoring.twins(rows, BATCH, {k: v[0] for k, v in LAYOUTS.items()})}
    halves = []
    for parity in (0, 1) if measured else ():
        part = [(p, [r for r in reps if r["round"] % 2 == parity]) for p, reps in measured]
        if all(reps for _, reps in part):
            halves.append(_scored(part, estimator, fit, ("cpu",), across, speed))
    if len(halves) == 2:
        out["halves_spread_pct"] = scoring.halves_spread(halves[0][0], halves[1][0])
        out["halves_held_out_pct"] = [scoring.held_out(h[1]) for h in halves]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument(
        "--measurements",
        metavar="PATH",
        nargs="+",
        help="re-score the measured rows of saved --json outputs instead of measuring; "
        "with several, also each run alone, the runs pooled and what persists across them",
    )
    ap.add_argument(
        "--fit",
        choices=("mixed", "1p"),
        default="mixed",
        help="fit set: 'mixed' (default) half of the 1p plans and a quarter of each "
        "2-process layout's; '1p' half of the 1p plans only",
    )
    ap.add_argument(
        "--estimator",
        choices=("parts", "step"),
        default="parts",
        help="CPU figure of a plan: 'parts' (default) the sum of each part's fastest "
        "clean repetition; 'step' the fastest clean repetition of the whole step",
    )
    ap.add_argument(
        "--across",
        choices=("median", "min"),
        default="median",
        help="a plan's figure over its rounds: 'median' (default) of the rounds' figures; "
        "'min' each part's fastest repetition over every round",
    )
    ap.add_argument(
        "--speed",
        choices=("probe", "raw"),
        default="probe",
        help="CPU figures: 'probe' (default) each round's scaled to the run's typical host "
        "speed, measured by the optimizer step (the same work in every plan of a preset "
        "and layout); 'raw' as measured. Both are scored either way "
        "(cpu, cpuraw); with --across min, raw",
    )
    ap.add_argument("--rounds", type=int, help="rounds of the grid (default 4 quick, 32 full)")
    ap.add_argument(
        "--wide",
        action="store_true",
        help="the small preset over the tiny preset's whole grid (72 plans, not 48)",
    )
    args = ap.parse_args()
    grid = {
        "tiny": ([1, 2, 4, 8], [32, 64, 128]),
        "small": ([1, 2, 4, 8], [32, 64, 128]) if args.wide else ([2, 8], [32, 64]),
    }
    # The noise is per round (slow phases of a shared machine last longer than a plan's
    # repetitions), so the full run is 8x the rounds of --quick, each as short, on the
    # same 48 plans: more rounds, not longer ones, are what narrow the median.
    rounds, budget_s, max_reps = (4, 0.1, 8) if args.quick else (32, 0.1, 8)
    if args.rounds is not None:
        if args.rounds < 1:
            raise SystemExit(f"--rounds {args.rounds}: give at least 1 round")
        rounds = args.rounds
    t_start = time.perf_counter()
    runs, per_run = [], []
    if args.measurements:
        runs = [_load(p) for p in args.measurements]
        measured = runs[0][0]
        load_start, load_end = runs[0][1], runs[-1][2]
    else:
        load_start = os.getloadavg()
        measured = measure(grid, rounds, budget_s, max_reps)
        load_end = os.getloadavg()
    if len(runs) > 1:
        # Several runs: each scored alone, and every plan's figure from all the runs'
        # rounds taken together (the same rule as one run's, over more rounds).
        per_run = [
            _scored(ms, args.estimator, args.fit, across=args.across, speed=args.speed)[0]
            for ms, *_ in runs
        ]
        measured = scoring.pooled([ms for ms, _, _ in runs])
    rows, summary, effs = _scored(
        measured, args.estimator, args.fit, across=args.across, speed=args.speed
    )
    print(
        f"{'preset':>6} {'layout':>9} {'mb':>3} {'seq':>4} {'role':>8} {'wall_ms':>8} "
        f"{'pred_ms':>8} {'err_%':>6} {'cpu_ms':>8} {'pred_ms':>8} {'err_%':>6} {'raw_ms':>8}"
    )
    for r in rows:
        print(
            f"{r['preset']:>6} {r['layout']:>9} {r['micro_batch']:>3} {r['seq_len']:>4} "
            f"{r['role']:>8} {r['wall_measured_ms']:>8.2f} {r['wall_predicted_ms']:>8.2f} "
            f"{r['wall_error_pct']:>6.1f} {r['cpu_measured_ms']:>8.2f} "
            f"{r['cpu_predicted_ms']:>8.2f} {r['cpu_error_pct']:>6.1f} "
            f"{r['cpuraw_measured_ms']:>8.2f}"
        )
    if len(runs) > 1:
        print(f"\n(measured figures above: over the {len(runs)} runs' rounds taken together)")
    print(f"\n{'metric':>6} {'set':>18} {'plans':>5} {'mean_abs_err_%':>14} {'max_abs_err_%':>13}")
    for s in summary:
        print(
            f"{s['metric']:>6} {s['set']:>18} {s['num_plans']:>5} "
            f"{s['mean_abs_error_pct']:>14.2f} {s['max_abs_error_pct']:>13.2f}"
        )
    for m in ("wall", "cpu"):
        spread = [r[f"{m}_round_spread_pct"] for r in rows if f"{m}_round_spread_pct" in r]
        if spread:
            print(
                f"{m}: spread between rounds' fastest repetitions (noise): "
                f"mean {np.mean(spread):.1f}%, max {np.max(spread):.1f}%"
            )
    if any(r["speed"] == "probe" for r in rows):
        print(
            "cpu: rounds' middle half (IQR, % of the median), mean over plans: raw "
            f"{np.mean([r['cpuraw_round_iqr_pct'] for r in rows]):.1f}%, at the reference "
            f"host speed {np.mean([r['cpu_round_iqr_pct'] for r in rows]):.1f}% (cpu: probe, "
            "cpuraw: as measured)"
        )
    noise = _noise_floor(measured, rows, args.estimator, args.fit, args.across, args.speed)
    mean, mx = scoring.held_out(summary)
    print(f"noise floor beside the held-out CPU error ({mean:.2f}% mean, {mx:.2f}% max):")
    for m, tw in noise["twins"].items():
        if tw:
            print(
                f"  {m}: identical-work twins measured {tw[0]:.1f}% apart on average "
                f"(max {tw[1]:.1f}%, {tw[2]} pairs); a perfect model is off by ~0.7x that"
            )
    if "halves_spread_pct" in noise:
        (a, b), (c, d) = noise["halves_held_out_pct"]
        print(
            "  cpu: even vs odd rounds' figures {:.1f}% apart (max {:.1f}%); held-out error "
            "fitted within each half {:.2f}% / {:.2f}% mean, {:.2f}% / {:.2f}% max".format(
                *noise["halves_spread_pct"], a, c, b, d
            )
        )
    if len(runs) > 1:
        noise["runs"] = scoring.across_runs(per_run)
        nr = noise["runs"]
        print(
            f"  cpu over {nr['runs']} runs: held-out mean per run "
            + " / ".join(f"{v:.1f}" for v in nr["per_run_held_out_mean_pct"])
            + f"%; a plan's error moves {nr['noise_sd_pct']:.1f}% (sd) between runs; "
            f"|mean over runs| {nr['systematic_pct']:.2f}% against "
            f"{nr['expected_from_noise_pct']:.2f}% expected from noise alone; "
            "persistent (|mean| > 2.5 s.e.): "
            + (", ".join(f"{k} {m:+.1f}% (t {t})" for k, m, t in nr["persistent"]) or "none")
        )
    every = [(LAYOUTS[plan[3]], r) for plan, reps in measured for r in reps]
    if every and all("steal" in r for _, r in every):
        own = [r for (_, wpc, _), r in every if wpc == 1]
        print(
            f"repetitions steal-free {_pct(r['steal'] == 0 for _, r in every)}, "
            f"never preempted (a worker per core) {_pct(r['preempted'] == 0 for r in own)}, "
            f"no other task runnable {_pct(r['running'] <= dp for (dp, _, _), r in every)}"
        )
    num_reps = sum(r["reps"] for r in rows)
    num_clean = sum(r["clean_reps"] for r in rows)
    print(
        f"repetitions: {num_reps}, clean {num_clean} ({100.0 * num_clean / num_reps:.0f}%); "
        "plans' figures from clean / steal-free / all repetitions: "
        + " / ".join(
            str(sum(r["figure_from"] == k for r in rows)) for k in ("clean", "steal-free", "all")
        )
    )
    print("fitted efficiencies:", effs, f"; wall {time.perf_counter() - t_start:.0f} s")
    print("load average (1 min) start/end of the measuring:", load_start[0], load_end[0])
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "benchmark": "bench_costmodel",
                    "rows": rows + summary,
                    "noise_floor": noise,
                    "repetitions": [{"plan": list(p), "reps": r} for p, r in measured],
                    "efficiencies": effs,
                    "settings": {
                        "rounds": rounds if not runs else None,
                        "across": args.across,
                        "speed": args.speed,
                        "estimator": args.estimator,
                        "fit": args.fit,
                        "runs_pooled": len(runs),
                        "wall_s": time.perf_counter() - t_start,
                    },
                    "loadavg_start": load_start,
                    "loadavg_end": load_end,
                },
                fh,
                indent=1,
            )


if __name__ == "__main__":
    main()
