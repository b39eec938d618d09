"""Startup calibration: measure this machine's stage work before the first plan decision.

The cost model starts from default efficiencies (deliberately low, the same on every
machine) and is refined only from the steps a run executes, that is, from the plans it
runs. Plans it has not run are priced with efficiencies fitted to other shapes, and on
a small model on shared CPU cores (where launch overhead, not FLOPs, sets most of the
time) that ranked the first plan and the first urgent move wrongly: bench_e2e's step-0
move went to a plan that then measured slower than the plan it found by payback six
steps later.

So before the first plan is chosen the trainer runs a few probe plans on the real
workers with the real model, one at a time: each is the best plan the model, as refined
by the probes before it, ranks at the first response length or at one of the next two
bucket edges (see ``BUCKETS_AHEAD``) that has a stage layout (stage, dp, tp, pp,
sharing devices or not) no probe has run, and it runs at that length. A model refined
on some shapes prices shapes it never ran badly: a first version probed the planner's
top three at the first length only (all tp 1) and its refined model then made its
urgent moves to tp 2 and pp 2 layouts, which measured slower than the tp 1 plan that
held the whole trace. On each probe the stages are set up from the run's initial
states and one RL step's work runs on them (weight sync, rollout, reference / critic
inference, training). The first repeat of each probe pays one-off costs (the layout's
process groups, torch's first call on new shapes) and is not fed to the model; the
rest go to ``CostModel.observe`` exactly as a running step's do. Afterwards the stages
are set up again from the initial states, so the run's state is the same as without
calibration (the probes' training never reaches it), and the prompts come from a
generator of their own, so the run's prompts are unchanged.

The calibration's time is real work of the run: it is in ``TrainResult.timings``
(``calibration_s``) and in the run's total, not in any step's latency.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from nereus_rl.core.globalplan import GlobalPlan
from nereus_rl.core.workload import bucket_of

# Repeats per probe: the first warms up (the layout's process groups, torch's first call
# on new shapes), the others are measured and each stage counts at its least time over
# them: on shared cores other work only adds time (about 0.3-0.5 s per probe on the tiny
# model at 4 workers, setup included). With one measured repeat, eight startups of
# bench_e2e's GRPO sync setting (quick, idle) chose four different start plans. Eight
# startups each way, their plans then run fixed side by side: the plans chosen with one
# measured repeat ran 1.085x the best of them on average, with the least of two 1.046x
# (within that run's noise; calibration 2.2 s and 2.0 s).
REPEATS = 3
# Probes are drawn from the model's PROBE_POOL best plans at each point.
PROBE_POOL = 8
# Response lengths the probes are ranked (and run) at: the first, and the next two
# bucket edges above it. A run's first moves are made for longer responses than its
# first (the lengths RL post-training meets grow), among plans the model ranks for
# those lengths, which at the first length alone it never ranks high (at 4 workers:
# tp 2 and pp 2 layouts that fit the memory only the longer responses need). Two
# buckets, not the whole range: nothing is known of how far lengths will go.
BUCKETS_AHEAD = 2


def stage_seconds(algo: str, m: dict[str, Any], worker_inference: bool = False) -> dict[str, float]:
    """Measured seconds per stage of one step, as ``CostModel.observe`` reads them.

    Rollout's time includes the weight sync (the model prices the sync into rollout).
    By default the inference phase as the driver times it; for PPO the critic inference
    and training run beside their actor counterparts, so the inference time is not
    attributed to the reference alone. With ``worker_inference`` (an async run, its
    probes too, so that both measure alike): each inference stage as its workers time it
    (``inference_work_s``), since the driver's time holds the wait behind the next
    step's rollout on workers the two share.
    """
    out = {
        "rollout": m["stage_s"]["rollout"] + m.get("sync_s", 0.0),
        "reference": m["stage_s"]["inference"],
        "actor_train": m["stage_s"]["train"],
    }
    if worker_inference and "inference_work_s" in m:
        out.pop("reference")
        out.update(m["inference_work_s"])
    elif algo == "ppo":
        out.pop("reference")
    return out


def layouts(plan: GlobalPlan) -> set[tuple]:
    """The plan's stage layouts as (stage, dp, tp, pp, shares devices with another stage)."""
    out = set()
    for sp in plan.stages:
        shared = any(o.stage != sp.stage and o.devices & sp.devices for o in plan.stages)
        out.add((sp.stage, sp.dp, sp.tp, sp.pp, shared))
    return out


def next_probe(
    ranked: dict[int, list[GlobalPlan]],
    covered: set[tuple],
    pool: int,
    stage_s: Callable[[GlobalPlan, int], dict[str, float]] | None = None,
) -> tuple[GlobalPlan, int] | None:
    """The next probe and the response length to run it at.

    ``ranked`` holds the model's ranking at each length. Going down the ranks (the best
    of every length first, shorter lengths first within a rank, to depth ``pool``), the
    first plan with a stage layout not in ``covered`` (see :func:`layouts`); None when
    there is none. A plan with a new stage shape (stage, dp, tp, pp) goes before one
    whose layouts differ only in which stages share devices; with ``stage_s`` (the
    model's seconds per stage of a plan at a length) a new shape of the stage that
    weighs most in the best-ranked plan goes first.

    Raises:
        ValueError: ``pool`` is not positive.
    """
    if pool < 1:
        raise ValueError(f"pool={pool} must be >= 1")
    # First a plan with a stage shape (stage, dp, tp, pp) no probe has run, then one
    # that only shares devices differently: bench_e2e's model check (GRPO sync quick)
    # had all three probes train on dp 2 (the reference and rollout placements told
    # them apart), and the model, fitted on that shape alone, priced a dp 1 training
    # at 0.14 s and a pp 2 one at 0.12 s where they measured 0.03-0.04 s: the planner
    # ranked the plans the bench then measured fastest 4th to 6th.
    #   With ``stage_s`` (predicted seconds per stage of a plan at a length), the
    # best-ranked plan with a new shape of the stage that weighs most in the model's
    # best plan goes first: the next GRPO run probed a dp 1 and a pp 2 reference
    # (0.02-0.03 s) before the training shapes it still priced at 0.10-0.15 s and
    # measured at 0.03-0.04 s. (Weighing each plan by its own new stages' seconds
    # probed an expensive dp 2 x tp 2 reference instead: 6.7 s of calibration.)
    shapes = {lay[:4] for lay in covered}
    order = [(r, n) for r in range(pool) for n in sorted(ranked) if r < len(ranked[n])]
    new_shapes = [{lay[:4] for lay in layouts(ranked[n][r])} - shapes for r, n in order]
    if stage_s is not None and order:
        r0, n0 = order[0]
        weight = stage_s(ranked[n0][r0], n0)
        scored = [
            (max(weight.get(s[0], 0.0) for s in new), -i) for i, new in enumerate(new_shapes) if new
        ]
        if scored:
            i = -max(scored)[1]
            r, n = order[i]
            return ranked[n][r], n
    for (r, n), new in zip(order, new_shapes):
        if new:
            return ranked[n][r], n
    for r, n in order:
        if layouts(ranked[n][r]) - covered:
            return ranked[n][r], n
    return None


def probe_lengths(first: int, buckets: tuple[int, ...], ahead: int) -> list[int]:
    """The first response length and the next ``ahead`` bucket edges above its bucket."""
    edges = sorted(b for b in buckets if b > bucket_of(first, buckets))
    return [first, *edges[:ahead]]


def run_probe(trainer, plan: GlobalPlan, rlen: int, full_states: dict, repeats: int) -> dict:
    """Set ``plan``'s stages up from ``full_states`` and run one RL step's work on them
    ``repeats`` times at ``rlen``-token responses (the caller restores the trainer's plan
    and prompt generator afterwards).

    Returns:
        ``setup_s``; ``runs`` (one record per repeat); ``stage_s`` (seconds per stage,
        each at its least over the repeats after the first, or None with one repeat) and
        ``step_s`` (the least whole step over the same repeats).
    """
    trainer.plan = plan
    descs = [trainer._desc(sp) for sp in plan.stages]
    t_setup = time.perf_counter()
    trainer._all("rl.setup", descs, trainer.mc, full_states, trainer.cfg.hyper())
    setup_s = time.perf_counter() - t_setup
    measured: list[dict[str, float]] = []
    step_times: list[float] = []
    runs = []
    for rep in range(repeats):
        t_step = time.perf_counter()
        sync = trainer.weight_sync()
        job = trainer._rollout_wait(trainer._rollout_submit(0, rlen=rlen))
        m = trainer._train_on(job)
        m.update(sync)
        secs = stage_seconds(trainer.cfg.algo, m, worker_inference=trainer.cfg.mode == "async")
        step_s = time.perf_counter() - t_step
        if rep > 0:  # the first run pays the layout's one-off costs
            measured.append(secs)
            step_times.append(step_s)
        runs.append(
            {"plan": repr(plan), "response_len": rlen, "repeat": rep,
             "step_s": step_s, "stage_s": secs, "observed": rep > 0}
        )  # fmt: skip
    if not measured:
        return {"setup_s": setup_s, "runs": runs, "stage_s": None, "step_s": None}
    # Each stage at its least time over the measured repeats: on shared cores other work
    # only ever adds time, so the least is the probe's own cost (see REPEATS).
    least = {k: min(x[k] for x in measured) for k in measured[0]}
    return {"setup_s": setup_s, "runs": runs, "stage_s": least, "step_s": min(step_times)}


def calibrate(
    trainer, full_states: dict, num_probes: int, repeats: int = REPEATS
) -> tuple[dict, list[tuple]]:
    """Run the probes on ``trainer``'s workers and feed their stage times to its cost model.

    Arguments:
        trainer: a started :class:`~nereus_rl.trainer.trainer.Trainer` (workers joined, no stage
            set up yet, or any: every probe sets its stages up anew).
        full_states: the run's initial states (the probes set up from them).
        num_probes: probe plans (0: nothing runs).
        repeats: runs per probe; the first is not fed to the model.

    Returns:
        A record (the probes, each run's stage seconds, each probe's setup seconds, the
        predictions before and after, the seconds spent) and the observations fed to the
        model, as (plan, workload, stage seconds), for a model built again later.
    """
    t0 = time.perf_counter()
    ad = trainer.adapter
    rlen = trainer._response_len(0)
    lengths = probe_lengths(rlen, trainer.cfg.buckets, BUCKETS_AHEAD)
    probes: list[GlobalPlan] = []
    before: dict[str, float] = {}
    covered: set[tuple] = set()  # stage layouts probed so far
    saved = trainer.rng, trainer.plan
    # Its own prompts: the run's prompt stream must not depend on calibration.
    trainer.rng = random.Random(trainer.cfg.seed * 7919 + 1)
    runs, setups, observed, steps = [], {}, [], []

    def stage_s(p: GlobalPlan, n: int) -> dict[str, float]:
        # the model's price per stage (a shape no probe ran has no measured ratio)
        est = ad.cm.step_latency(p, ad.workload(n))
        return {k: v.seconds for k, v in est.stages.items()}

    try:
        while len(probes) < num_probes:
            # Ranked by the model as refined so far: each probe measures a layout the
            # model now ranks among its best without having run it.
            ranked = {}
            for n in lengths:
                try:
                    ranked[n] = [q for _, q in ad.ranked_plans(n)]
                except ValueError:  # nothing fits at n: the run will stop before it
                    pass
            nxt = next_probe(ranked, covered, PROBE_POOL, stage_s=stage_s)
            if nxt is None:
                break
            p, n = nxt
            wl = ad.workload(n)
            probes.append(p)
            covered |= layouts(p)
            before[repr(p)] = ad.cm.step_latency(p, wl).total_s
            probe = run_probe(trainer, p, n, full_states, repeats)
            setups[repr(p)] = probe["setup_s"]
            runs += probe["runs"]
            if probe["stage_s"] is not None:
                ad.cm.observe(p, wl, probe["stage_s"])
                ad.shapes.observe(p, wl, probe["stage_s"], startup=True)
                observed.append((p, wl, probe["stage_s"]))
                steps.append((p, wl, probe["step_s"]))
    finally:
        trainer.rng, trainer.plan = saved
    after = {repr(p): ad.cm.step_latency(p, w).total_s for p, w, _ in observed}
    # Each probe's whole step against the refined model's price: the unpriced rest per
    # worker call (nereus_rl.costmodel.step_overhead), fitted over plans with different call counts
    # (priced with the measured shapes' ratios, so the residual is the rest no stage
    # time holds, not the model's error on a stage)
    pm = ad.priced()
    for p, w, step_s in steps:
        # a probe runs its step's phases one after another, even in an async run
        w = replace(w, rollout_ahead=False)
        ad.overhead.observe(p, pm.stage_price(p, w).total_s, step_s)
    rec = {
        "probes": [repr(p) for p in probes],
        "response_lens": lengths,
        "runs": runs,
        "setup_s": setups,
        "predicted_before_s": before,
        "predicted_after_s": after,
        "overhead": ad.overhead.record(),
        **ad.shapes.record(ad.cm),
        "seconds": time.perf_counter() - t0,
    }
    return rec, observed
