"""Startup calibration: measure this machine's stage work before the first plan decision.

The cost model starts from default efficiencies (deliberately low, the same on every
machine) and is refined only from the steps a run executes, that is, from the plans it
runs. Plans it has not run are priced with efficiencies fitted to other shapes; on a
small model on shared CPU cores, where launch overhead rather than FLOPs sets most of
the time, such prices can rank the first plan and the first urgent move wrongly.

So before the first plan is chosen the trainer runs a few probe plans on the real
workers with the real model, one at a time. Each is the best plan the model, as refined
by the probes before it, ranks at the first response length or at one of the next
bucket edges (``BUCKETS_AHEAD``) that has a stage layout (stage, dp, tp, pp, sharing
devices or not) no probe has run, and it runs at that length: a model refined on some
shapes prices the shapes it never ran badly, and a run's first moves are made for the
longer responses ahead. On each probe the stages are set up from the run's initial
states and one RL step's work runs on them (weight sync, rollout, reference / critic
inference, training). The first repeat of each probe pays one-off costs (the layout's
process groups, torch's first call on new shapes) and is not fed to the model; the
rest go to ``CostModel.observe`` exactly as a running step's do. Afterwards the trainer
sets the stages up again from the initial states, so the run's state is the same as
without calibration (the probes' training never reaches it), and the probes draw their
prompts from a generator of their own, so the run's prompts are unchanged.

The calibration's time is real work of the run: it is in ``TrainResult.timings``
(``calibration_s``) and in the run's total, not in any step's latency.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from nereus_rl.core.globalplan import GlobalPlan
from nereus_rl.core.workload import bucket_of

# Repeats per probe: the first warms up (the layout's process groups, torch's first call
# on new shapes); the others are measured, and each stage counts at its least time over
# them, since on shared cores other work only adds time. One measured repeat is too noisy
# to choose a start plan by; two cost a fraction of a second per probe on the tiny model.
REPEATS = 3
# Probes are drawn from the model's PROBE_POOL best plans at each point.
PROBE_POOL = 8
# Response lengths the probes are ranked (and run) at: the first, and the next two
# bucket edges above it. A run's first moves are made for longer responses than its
# first (the lengths RL post-training meets grow), among plans the model ranks for
# those lengths and not at the first (e.g. tp 2 or pp 2 layouts that fit the memory
# only the longer responses need). Two buckets, not the whole range: nothing is known
# of how far lengths will go.
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
    # that only shares devices differently: a model fitted on one shape of a stage
    # prices that stage's other shapes badly, whatever the placements around it.
    #   With ``stage_s`` (predicted seconds per stage of a plan at a length), the
    # best-ranked plan with a new shape of the stage that weighs most in the model's
    # best plan goes first: a new shape of a cheap stage tells the model little about
    # the step. (Each plan is weighed by the best plan's stages, not by its own new
    # stages' seconds, which would favour probing expensive layouts.)
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


def run_probe(
    setup: Callable[[GlobalPlan], None],
    step: Callable[[int], dict[str, Any]],
    plan: GlobalPlan,
    rlen: int,
    repeats: int,
    *,
    algo: str,
    worker_inference: bool = False,
) -> dict:
    """Set ``plan``'s stages up and run one RL step's work on them ``repeats`` times at
    ``rlen``-token responses.

    Arguments:
        setup: sets a plan's stages up on the workers from the run's initial states.
        step: runs one RL step's work (weight sync, rollout, inference, training) at a
            response length on the plan last set up; returns its metrics.
        plan, rlen, repeats: what to run, at which length, how many times.
        algo, worker_inference: how to read the metrics (:func:`stage_seconds`).

    Returns:
        ``setup_s``; ``runs`` (one record per repeat); ``stage_s`` (seconds per stage,
        each at its least over the repeats after the first, or None with one repeat) and
        ``step_s`` (the least whole step over the same repeats).
    """
    t_setup = time.perf_counter()
    setup(plan)
    setup_s = time.perf_counter() - t_setup
    measured: list[dict[str, float]] = []
    step_times: list[float] = []
    runs = []
    for rep in range(repeats):
        t_step = time.perf_counter()
        m = step(rlen)
        secs = stage_seconds(algo, m, worker_inference=worker_inference)
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
    adapter,
    setup: Callable[[GlobalPlan], None],
    step: Callable[[int], dict[str, Any]],
    *,
    first_len: int,
    buckets: tuple[int, ...],
    algo: str,
    worker_inference: bool,
    num_probes: int,
    repeats: int = REPEATS,
) -> tuple[dict, list[tuple]]:
    """Run the probes and feed their stage times to the adapter's cost model.

    Arguments:
        adapter: the run's :class:`~nereus_rl.trainer.adapt.adapter.Adapter` (its cost
            model, shape ratios, overhead fit and ranking are refined in place).
        setup, step: as :func:`run_probe` takes them (every probe sets its stages up
            anew; the caller sets the run's up again afterwards and gives the probes
            prompts of their own).
        first_len: the run's first response length.
        buckets: the response-length bucket edges.
        algo, worker_inference: how to read a step's metrics (:func:`stage_seconds`).
        num_probes: probe plans (0: nothing runs).
        repeats: runs per probe; the first is not fed to the model.

    Returns:
        A record (the probes, each run's stage seconds, each probe's setup seconds, the
        predictions before and after, the seconds spent) and the observations fed to the
        model, as (plan, workload, stage seconds), for a model built again later.
    """
    t0 = time.perf_counter()
    ad = adapter
    lengths = probe_lengths(first_len, buckets, BUCKETS_AHEAD)
    probes: list[GlobalPlan] = []
    before: dict[str, float] = {}
    covered: set[tuple] = set()  # stage layouts probed so far
    runs, setups, observed, steps = [], {}, [], []

    def stage_s(p: GlobalPlan, n: int) -> dict[str, float]:
        # the model's price per stage (a shape no probe ran has no measured ratio)
        est = ad.cm.step_latency(p, ad.workload(n))
        return {k: v.seconds for k, v in est.stages.items()}

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
        probe = run_probe(setup, step, p, n, repeats, algo=algo, worker_inference=worker_inference)
        setups[repr(p)] = probe["setup_s"]
        runs += probe["runs"]
        if probe["stage_s"] is not None:
            ad.cm.observe(p, wl, probe["stage_s"])
            ad.shapes.observe(p, wl, probe["stage_s"], startup=True)
            observed.append((p, wl, probe["stage_s"]))
            steps.append((p, wl, probe["step_s"]))
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
