"""End to end: Nereus adaptive vs fixed plans on the same length trace and devices.

Variants, all on the same worker processes, seed, warm start, memory budget and
response-length trace, run in interleaved repeats (every variant once per repeat, in
the same order), so slow spells of the shared machine fall on all of them. Before
them, unrecorded: a 2-step fixed run and one run of each adaptive variant, so that
one-off costs of fresh workers and of a layout's first use (its communicators) fall
on no recorded variant (a fixed plan pays those in its setup, outside its steps);
the warm-up runs' transition times are printed:

    adaptive         the planner's first plan, adaptation with payback admission
    replan_always    adaptation that executes every candidate (replan on each trigger)
    colocated        verl-like: every stage on every device, fixed; each stage's
                     (dp, tp, pp) chosen at startup by the planner's cost model (before
                     any measurement) under the same memory budget (the fastest
                     predicted colocated layout)
    disaggregated    OpenRLHF-like: rollout on the first half of the devices, every
                     other stage on the second half, fixed, chosen the same way
    planner_fixed    the planner's first plan (adaptive's start, after its startup
                     calibration in the warm-up run), never changed
    *_max            the same three chosen for the trace's longest responses instead
                     of its first ones: a static configuration sized for the whole run
    enumNN           every other feasible fixed plan: the planner's k-best at the
                     trace's longest responses under the budget (so each fits at every
                     step), deduplicated up to a relabeling of the identical devices
                     and against the plans above, ranked by predicted mean step latency
                     over the trace (the model after the probe's startup calibration);
                     --quick runs the top 6 (--fixed-top), a full run all of them
    best_fixed       the fastest fixed plan (named or enumerated) whose predicted peak
                     stays within the budget at every step: the empirical best fixed
                     plan among every feasible one run

A fixed plan whose predicted peak exceeds the per-worker memory budget at some step
could not run on devices with that memory: its row says "NO" under "fits" and it is
never best_fixed (on this CPU machine it still runs, since the budget is enforced on
the cost model's prediction only, so its time is shown). Reported per variant: mean
over repeats of the mean step latency (transitions included), its spread (min..max over
repeats), the paired ratio to adaptive (each repeat's variant / adaptive: mean and
range), transitions, reward and the largest peak/budget.
Per setting also the model check (``e2e_model_error``): each fitting fixed plan's
predicted step latency (the calibrated model) beside the
measured one, per phase, with the rank correlation and whether the model's pick
measured within 5% of the empirical best.

The default trace (``--steps N``): response length rising 6 -> 20 tokens over the first
half, holding, then falling to 13 over the last quarter (the fall gives opportunistic,
non-urgent moves where payback and replan-always differ).

    python benchmarks/bench_e2e.py --quick --json out.json    # GRPO sync; ~3 min at load 10
    python benchmarks/bench_e2e.py --quick --algos ppo --modes async --json out.json
    python benchmarks/bench_e2e.py --steps 20 --repeats 2 --fixed-top 12 --json out.json
    python benchmarks/bench_e2e.py --steps 20 --repeats 2 --json out.json  # every plan: hours

--quick runs 6 enumerated plans (about 5 s each at two repeats on an idle machine;
192 s for the whole GRPO sync run at load 9-12, against 63 s idle for the run before
the enumeration); a full run runs every one (32-77 per setting on 4 workers, ~12 s
each at 20 steps and two repeats: 6-15 min per setting).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from e2e_model_error import mean_phases, predicted_phases, print_table

from nereus_rl.costmodel import CostModel
from nereus_rl.globalplan import GlobalPlan, StagePlan
from nereus_rl.runtime import Driver
from nereus_rl.trainer import TrainConfig, Trainer, train
from nereus_rl.trainer_config import stage_names

FIXED = ("colocated", "disaggregated", "planner_fixed")
# Enumerated fixed plans --quick runs (the best by predicted mean latency over the trace):
# each adds ~5 s (two repeats of 10 steps) to a run of ~60 s on an idle machine.
QUICK_FIXED_TOP = 6
# The planner's k for the enumeration: larger than the Pareto-pruned plan space at a few
# devices (grpo / ppo / remax on 4 workers: 77 / 55 / 32 plans), so k-best is all of it.
ENUM_K = 1000


def _mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def write_trace(path: Path, steps: int, lo: int = 6, hi: int = 20) -> Path:
    """Rise lo -> hi over the first half, hold a quarter, fall to (lo+hi)/2."""
    rise, hold = max(2, steps // 2), max(1, steps // 4)
    fall = max(1, steps - rise - hold)
    mid = (lo + hi) // 2
    lens = [round(lo + (hi - lo) * i / (rise - 1)) for i in range(rise)]
    lens += [hi] * hold
    lens += [round(hi + (mid - hi) * (i + 1) / fall) for i in range(fall)]
    lines = ["step,response_len"] + [f"{i},{n}" for i, n in enumerate(lens[:steps])]
    path.write_text("\n".join(lines) + "\n")
    return path


def structured_plan(probe: Trainer, kind: str, rlen: int) -> tuple[GlobalPlan, bool]:
    """The fastest predicted plan of a fixed structure, and whether it fits the budget.

    ``kind``: ``"colocated"`` (every stage on all devices) or ``"disaggregated"``
    (rollout on the first half, the rest on the second half). Each stage's (dp, tp,
    pp) is free (powers of two, runnable on the model), priced by the probe's cost
    model (the planner's, before any measurement) under the workload at ``rlen``.
    When no layout fits the budget, the one with the smallest peak is returned.
    """
    ad = probe.adapter
    n = probe.cfg.devices
    wl = ad.workload(rlen)
    planned = {s.stage for s in wl.planned_stages}
    names = [x for x in stage_names(probe.cfg.algo) if x[0] in planned]
    half = n // 2
    options = []
    for name, model, trains in names:
        devs = list(range(half)) if kind == "disaggregated" and name == "rollout" else None
        if devs is None:
            devs = list(range(half, n)) if kind == "disaggregated" else list(range(n))
        opts = []
        d = len(devs)
        for tp, pp in itertools.product([1, 2, 4, 8], repeat=2):
            if d % (tp * pp):
                continue
            dp = d // (tp * pp)
            units = tuple(tuple(devs[u * tp * pp : (u + 1) * tp * pp]) for u in range(dp))
            opts.append(StagePlan(name, model, trains, dp, tp, pp, units))
        options.append(opts)
    best, best_key = None, None
    for combo in itertools.product(*options):
        plan = GlobalPlan(tuple(combo))
        if not ad._runnable(plan):
            continue
        peak = max(ad.cm.peak_memory(plan, wl).values())
        fits = peak <= ad.budget
        lat = ad.cm.step_latency(plan, wl).total_s
        key = (not fits, lat if fits else peak)
        if best_key is None or key < best_key:
            best, best_key = plan, key
    if best is None:
        raise RuntimeError(f"no runnable {kind} plan for {probe.cfg.algo} on {n} devices")
    return best, not best_key[0]


def canonical(plan: GlobalPlan, num_devices: int) -> tuple:
    """``plan`` up to a relabeling of the devices (identical worker processes on one
    host, so relabeled plans run the same work): the smallest key over all relabelings
    (exact up to 6 devices; beyond, the plan as it is)."""

    def key(perm) -> tuple:
        def units(sp):
            return tuple(sorted(tuple(perm[d] for d in u) for u in sp.units))

        return tuple(sorted((sp.stage, sp.dp, sp.tp, sp.pp, units(sp)) for sp in plan.stages))

    if num_devices > 6:
        return key(range(num_devices))
    return min(key(p) for p in itertools.permutations(range(num_devices)))


def enumerate_fixed(ad, lengths: list[int], named: list[GlobalPlan]) -> tuple[list, dict]:
    """Every feasible fixed plan not among ``named``, best predicted first.

    Feasible: among the planner's k-best (``ENUM_K``) for the longest response length of
    ``lengths`` under ``ad``'s budget (peak memory grows with length, so such a plan fits
    at every step) and runnable on the model. Deduplicated up to device relabeling (and
    against ``named``); ranked by ``ad``'s model's mean predicted step latency over
    ``lengths``. Returns [(predicted mean s, plan)] and counts for the printout.
    """
    n = ad.cfg.devices
    ranked = [p for _, p in ad.ranked_plans(max(lengths), k=ENUM_K)]
    named_keys = {canonical(p, n) for p in named}
    seen = set(named_keys)
    wls = {rl: ad.workload(rl) for rl in set(lengths)}
    pm = ad.priced()
    out = []
    dup_named = dup = 0
    for p in ranked:
        c = canonical(p, n)
        if c in seen:
            dup_named += c in named_keys
            dup += 1
            continue
        seen.add(c)
        # as the decisions price it: measured shapes at their ratio (shape_correction)
        pred = _mean([pm.stage_price(p, wls[rl]).total_s for rl in lengths])
        pred += ad.overhead.predict(p)  # the measured unpriced rest (step_overhead)
        out.append((pred, p))
    out.sort(key=lambda x: x[0])
    return out, {"k_best": len(ranked), "duplicates": dup, "same_as_named": dup_named}


def _run_row(res) -> dict:
    m = res.metrics
    lat = [x["step_s"] + x.get("transition_s", 0.0) for x in m]
    frac = max((x.get("peak_memory_fraction") or 0.0) for x in m) if m else float("nan")
    return {
        "step_latency_s": _mean(lat),
        "transitions": res.num_transitions,
        "reward_mean": _mean([x["reward_mean"] for x in m]),
        "peak_memory_fraction": frac,
        "error": res.error,
        # the startup calibration (adaptive runs): run time outside the step latencies
        "calibration_s": res.timings.get("calibration_s", 0.0),
        # (step, plan) each time the plan was set or changed: which plans adaptive ran
        "plans": [(s, repr(p)) for s, p in res.plans],
        # measured seconds per phase (fixed runs: the model check, e2e_model_error)
        "phases": mean_phases(m) if m else None,
    }


def run_setting(
    driver, algo, mode, common, repeats, max_len, budget_rule="calibrated", fixed_top=None
):
    """Every variant of one (algo, mode) setting, ``repeats`` interleaved rounds.

    ``budget_rule``: ``"calibrated"``, the rule a run without a budget uses (1.08x the
    predicted peak of the plan it starts on, after its startup calibration);
    ``"uncalibrated"``, the same rule on the plan the default cost model picks (what
    the bench used before the startup calibration existed). ``fixed_top``: how many
    enumerated fixed plans to run (None: all).
    """
    # The memory budget follows the rule a run uses (just above the predicted peak of
    # the plan it starts on), after the same startup calibration an adaptive run does,
    # on these workers. The fixed layouts are chosen as on main: by the planner's cost
    # model before any measurement (a run of the calibrated model's choices measured
    # 1.5-2x slower: it priced tp 2 layouts it never ran too well), so they are the same
    # baselines as before, not weaker ones.
    probe = Trainer(TrainConfig(algo=algo, mode=mode, **common), driver=driver)
    probe.start()
    print(
        f"{algo} {mode}: startup calibration {probe.result.timings['calibration_s']:.2f} s, "
        f"probes {probe.result.calibration['probes']}"
    )
    # The budget and the fixed layouts come from one planner: the probe's (calibrated
    # budget) or, by the uncalibrated rule, a planner-only trainer's (main's budget);
    # the calibrated rule falls back to the latter when no plan fits the longest
    # responses under it (PPO at batch 4: the calibrated start spreads every stage
    # over its own device, and 1.08x its peak holds nothing at 20 tokens).
    rule, chooser, planner_only = budget_rule, probe, None
    if rule == "calibrated":
        try:
            probe.adapter.ranked_plans(max_len)
        except ValueError:
            rule = "uncalibrated"
            print(f"{algo} {mode}: nothing fits {max_len} tokens under the calibrated budget")
    if rule == "uncalibrated":
        planner_only = Trainer(TrainConfig(algo=algo, mode=mode, **common))
        chooser = planner_only
    print(f"{algo} {mode}: budget rule {rule}")
    ad = chooser.adapter
    budget = ad.budget
    first_len = probe._response_len(0)
    plans = {"planner_fixed": (probe.first_plan, True)}
    calibrated, ad.cm = ad.cm, CostModel(ad.cluster)
    for kind in ("colocated", "disaggregated"):
        plans[kind] = structured_plan(chooser, kind, first_len)
        plans[kind + "_max"] = structured_plan(chooser, kind, max_len)
        for v, n in ((kind, first_len), (kind + "_max", max_len)):
            if not plans[v][1]:  # its row then says NO under fits: say why here
                print(
                    f"{algo} {mode}: no {kind} layout fits the budget at {n} tokens; "
                    f"{v} is the one with the smallest predicted peak"
                )
    best_max, _ = ad.best_plan(max_len)
    plans["planner_fixed_max"] = (best_max, True)
    ad.cm = calibrated
    # Every other feasible fixed plan, ranked by the calibrated model where there is
    # one (the probe's: measured on these workers) over the trace's lengths.
    lengths = [probe._response_len(i) for i in range(common["steps"])]
    ranker = probe.adapter if chooser is probe else chooser.adapter
    enum, counts = enumerate_fixed(ranker, lengths, [p for p, _ in plans.values()])
    # The model that ranked them, and the trace's workloads, for the model check
    rank_cm, rank_wls = ranker.cm, [ranker.workload(n) for n in lengths]
    rank_ovh, rank_shapes = ranker.overhead, ranker.shapes
    top = len(enum) if fixed_top is None else min(fixed_top, len(enum))
    print(
        f"{algo} {mode}: {counts['k_best']} feasible fixed plans (planner k-best at "
        f"{max_len} tokens under the budget), {counts['duplicates']} duplicates up to device "
        f"relabeling ({counts['same_as_named']} of the named plans), {len(enum)} others; "
        f"running the top {top} by predicted mean step latency over the trace"
        + ("" if top == len(enum) else " (--fixed-top; a full run runs all)")
    )
    for i, (pred, p) in enumerate(enum[:top]):
        plans[f"enum{i:02d}"] = (p, True)
        print(f"  enum{i:02d} predicted {pred:.3f} s/step: {p!r}")
    if planner_only is not None:
        planner_only.driver.shutdown()  # it planned only; it started no workers
    probe.close()  # the workers are the bench's driver's: they keep running
    kw = dict(algo=algo, mode=mode, driver=driver, memory_budget=budget, **common)
    variants = ["adaptive", "replan_always"] + [v for f in FIXED for v in (f, f + "_max")]
    variants += [v for v in plans if v.startswith("enum")]
    runs = {v: [] for v in variants}
    # Not recorded: the first run on fresh workers pays one-off costs (allocator,
    # communicators) that would fall on whichever variant went first. A fixed plan
    # pays its layout's one-off costs in its setup, which no variant's step latency
    # counts; an adaptive run pays those of each layout it moves to inside its steps
    # (communicators for the new units: seconds on this machine, against ~0.1 s for
    # a transition that finds them), and only the first run in the process pays them.
    # So one unrecorded run of each adaptive variant goes first too (replan-always
    # visits other layouts), and what they paid is reported.
    train(adapt=False, plan=plans["planner_fixed"][0], **{**kw, "steps": 2})
    warm_trans = {}
    for v, extra in (("adaptive", {}), ("replan_always", {"admission": "always"})):
        warm = train(adapt=True, **extra, **kw)
        warm_trans[v] = [d["measured_transition_s"] for d in warm.decisions if d.get("taken")]
        if v == "adaptive":
            # adaptive's start is chosen after its startup calibration (measured on
            # these workers), so planner_fixed is the plan the warm-up run started on
            plans["planner_fixed"] = (warm.plans[0][1], True)
    for rep in range(repeats):
        # Each repeat starts one variant later, so no variant always runs first.
        for v in variants[rep % len(variants) :] + variants[: rep % len(variants)]:
            if v == "adaptive":
                res = train(adapt=True, **kw)
            elif v == "replan_always":
                res = train(adapt=True, admission="always", **kw)
            else:
                res = train(adapt=False, plan=plans[v][0], **kw)
            runs[v].append(_run_row(res))
    rows = []
    base = [r["step_latency_s"] for r in runs["adaptive"]]
    for v in variants:
        rs = runs[v]
        lat = [r["step_latency_s"] for r in rs]
        ratios = [a / b for a, b in zip(lat, base)]
        frac = max(r["peak_memory_fraction"] for r in rs)
        adaptive = v in ("adaptive", "replan_always")
        row = {
            "algo": algo,
            "mode": mode,
            "variant": v,
            "plan": None if adaptive else repr(plans[v][0]),
            "repeats": len(rs),
            "step_latency_s": _mean(lat),
            "step_latency_min_s": min(lat),
            "step_latency_max_s": max(lat),
            "step_latency_stdev_s": statistics.stdev(lat) if len(lat) > 1 else 0.0,
            "latency_vs_adaptive_x": _mean(lat) / _mean(base),
            "paired_ratio_mean_x": _mean(ratios),
            "paired_ratio_min_x": min(ratios),
            "paired_ratio_max_x": max(ratios),
            "transitions": _mean([r["transitions"] for r in rs]),
            "calibration_s": _mean([r["calibration_s"] for r in rs]),
            "reward_mean": _mean([r["reward_mean"] for r in rs]),
            "peak_memory_fraction": frac,
            # adaptive runs move away before the next step when the signal passes 1
            "fits_budget": adaptive or frac <= 1.0,
            "memory_budget_bytes": budget,
            "errors": [r["error"] for r in rs if r["error"]],
            "plans_per_repeat": [r["plans"] for r in rs] if adaptive else None,
            # the unrecorded warm-up run's transitions (first use of layouts)
            "warmup_transition_s": warm_trans.get(v),
        }
        if not adaptive:
            ph = [r["phases"] for r in rs if r["phases"]]
            row["predicted"] = predicted_phases(
                rank_cm, plans[v][0], rank_wls, rank_ovh, rank_shapes
            )
            row["measured"] = {k: _mean([x[k] for x in ph]) for k in ph[0]}
        rows.append(row)
    model_check = print_table(
        algo, mode, [r for r in rows if "predicted" in r and r["fits_budget"]]
    )
    fixed = [r for r in rows if r["plan"] is not None]
    fits = [r for r in fixed if r["fits_budget"]]
    best = min(fits or fixed, key=lambda r: r["step_latency_s"])
    label = best["variant"] if fits else f"{best['variant']}, NONE fits the budget"
    rows.append({**best, "variant": f"best_fixed ({label})", "model_check": model_check})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="10 steps, 2 repeats, batch 4; GRPO sync unless --algos/--modes are given",
    )
    ap.add_argument("--algos", default=None, help="default grpo,ppo,remax (quick: grpo)")
    ap.add_argument("--modes", default=None, help="default sync,async (quick: sync)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2, help="interleaved rounds per setting")
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--trace", default=None, help="response-length trace (CSV or JSON)")
    ap.add_argument(
        "--budget-rule",
        choices=("calibrated", "uncalibrated"),
        default="calibrated",
        help="memory budget: 1.08x the peak of the start plan after (default) or before "
        "the startup calibration",
    )
    ap.add_argument(
        "--fixed-top",
        type=int,
        default=None,
        help=f"enumerated fixed plans to run per setting (default: all; --quick {QUICK_FIXED_TOP})",
    )
    ap.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = ap.parse_args(argv)
    algos = (args.algos or ("grpo" if args.quick else "grpo,ppo,remax")).split(",")
    modes = (args.modes or ("sync" if args.quick else "sync,async")).split(",")
    steps, repeats = args.steps, args.repeats
    common = dict(devices=args.devices, warm_steps=60, batch=8, group_size=4, seed=0)
    fixed_top = args.fixed_top
    if args.quick:
        steps, repeats = 10, 2
        common.update(warm_steps=20, batch=4)
        fixed_top = QUICK_FIXED_TOP if fixed_top is None else fixed_top
    tmp = tempfile.TemporaryDirectory()
    trace = args.trace or str(write_trace(Path(tmp.name) / "trace.csv", steps))
    from nereus_rl.tasks import LengthTrace

    lt = LengthTrace.from_file(trace)
    max_len = max(lt.response_len(i) for i in range(steps))
    common.update(steps=steps, trace=trace)
    load_start = os.getloadavg()
    t0 = time.perf_counter()
    driver = Driver(heartbeat_timeout=60.0, call_timeout=600.0)
    rows = []
    try:
        driver.spawn_local(args.devices)
        for algo in algos:
            for mode in modes:
                rows += run_setting(
                    driver, algo, mode, common, repeats, max_len, args.budget_rule, fixed_top
                )
    finally:
        driver.shutdown()
        tmp.cleanup()
    print(f"trace {lt!r}, {steps} steps, {repeats} interleaved repeats per variant")
    head = (
        f"{'algo':5} {'mode':5} {'variant':42} {'step_s':>6} {'min..max':>11} "
        f"{'vs_adapt':>8} {'paired range':>12} {'trans':>5} {'reward':>6} {'mem/bud':>7} fits"
    )
    print(head)
    for r in rows:
        fits = "yes" if r["fits_budget"] else "NO"
        print(
            f"{r['algo']:5} {r['mode']:5} {r['variant']:42} {r['step_latency_s']:6.3f} "
            f"{r['step_latency_min_s']:5.3f}..{r['step_latency_max_s']:5.3f} "
            f"{r['latency_vs_adaptive_x']:7.2f}x "
            f"{r['paired_ratio_min_x']:5.2f}..{r['paired_ratio_max_x']:4.2f}x "
            f"{r['transitions']:5.1f} {r['reward_mean']:6.3f} "
            f"{r['peak_memory_fraction']:7.2f} {fits}"
            + (f"  ERRORS {r['errors']}" if r["errors"] else "")
        )
    for r in rows:
        if r.get("warmup_transition_s") is not None and not r["variant"].startswith("best"):
            w = ", ".join(f"{x:.3f}" for x in r["warmup_transition_s"])
            print(
                f"  {r['algo']} {r['mode']} {r['variant']} unrecorded warm-up run, "
                f"transitions (s): {w or 'none'}"
            )
    for r in rows:
        if r["calibration_s"] and not r["variant"].startswith("best"):
            steps_s = r["step_latency_s"] * steps
            print(
                f"  {r['algo']} {r['mode']} {r['variant']} startup calibration "
                f"{r['calibration_s']:.2f} s per run (steps {steps_s:.2f} s; with it "
                f"{(steps_s + r['calibration_s']) / steps:.3f} s/step)"
            )
    for r in rows:
        if r["plan"] is not None and not r["variant"].startswith("best_fixed"):
            print(f"  {r['algo']} {r['mode']} {r['variant']}: {r['plan']}")
    load_end = os.getloadavg()
    print(
        f"bench_e2e: {time.perf_counter() - t0:.0f} s; load average (1 min) start/end: "
        f"{load_start[0]:.1f} / {load_end[0]:.1f}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        out = {
            "benchmark": "bench_e2e",
            "trace": repr(lt),
            "steps": steps,
            "budget_rule": args.budget_rule,
            "loadavg_start": load_start,
            "loadavg_end": load_end,
            "rows": rows,
        }
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
