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
by the probes before it, ranks at the first response length that has a stage layout
(stage, dp, tp, pp, sharing devices or not) no probe has run. A model refined on some
shapes can price a shape it never ran too well (a first version probed the planner's
initial top three, all tp 1; its refined model then picked tp 2 layouts for
bench_e2e's fixed baselines, which measured 1.5-2x slower), so what the model now
ranks best is what gets measured next. On each probe the stages are set up from the
run's initial states and one RL step's work runs on them (weight sync, rollout,
reference / critic inference, training) with the first step's shapes. The first
repeat of each probe pays one-off costs (the layout's process groups, torch's first
call on new shapes) and is not fed to the model; the rest go to ``CostModel.observe``
exactly as a running step's do. Afterwards the stages are set up again from the
initial states, so the run's state is the same as without calibration (the probes'
training never reaches it), and the prompts come from a generator of their own, so
the run's prompts are unchanged.

The calibration's time is real work of the run: it is in ``TrainResult.timings``
(``calibration_s``) and in the run's total, not in any step's latency.
"""

from __future__ import annotations

import random
import time
from typing import Any

from nereus_rl.globalplan import GlobalPlan

# Repeats per probe: the first warms up, one more is measured (about 0.3-0.5 s per probe
# on the tiny model at 4 workers, setup included). Probes are drawn from the model's
# PROBE_POOL best plans at each point.
REPEATS = 2
PROBE_POOL = 8


def stage_seconds(algo: str, m: dict[str, Any]) -> dict[str, float]:
    """Measured seconds per stage of one step, as ``CostModel.observe`` reads them.

    Rollout's time includes the weight sync (the model prices the sync into rollout);
    for PPO the critic inference and training run beside their actor counterparts, so
    the inference time is not attributed to the reference alone.
    """
    out = {
        "rollout": m["stage_s"]["rollout"] + m.get("sync_s", 0.0),
        "reference": m["stage_s"]["inference"],
        "actor_train": m["stage_s"]["train"],
    }
    if algo == "ppo":
        out.pop("reference")
    return out


def layouts(plan: GlobalPlan) -> set[tuple]:
    """The plan's stage layouts as (stage, dp, tp, pp, shares devices with another stage)."""
    out = set()
    for sp in plan.stages:
        shared = any(o.stage != sp.stage and o.devices & sp.devices for o in plan.stages)
        out.add((sp.stage, sp.dp, sp.tp, sp.pp, shared))
    return out


def next_probe(ranked: list[GlobalPlan], measured: set[tuple], pool: int) -> GlobalPlan | None:
    """The best-ranked plan among ``ranked[:pool]`` with a stage layout not in ``measured``
    (see :func:`layouts`), or None when the model's ``pool`` best are all measured.

    Raises:
        ValueError: ``pool`` is not positive.
    """
    if pool < 1:
        raise ValueError(f"pool={pool} must be >= 1")
    return next((p for p in ranked[:pool] if layouts(p) - measured), None)


def calibrate(
    trainer, full_states: dict, num_probes: int, repeats: int = REPEATS
) -> tuple[dict, list[tuple]]:
    """Run the probes on ``trainer``'s workers and feed their stage times to its cost model.

    Arguments:
        trainer: a started :class:`~nereus_rl.trainer.Trainer` (workers joined, no stage
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
    wl = ad.workload(rlen)
    probes: list[GlobalPlan] = []
    before: dict[str, float] = {}
    covered: set[tuple] = set()  # stage layouts probed so far
    saved = trainer.rng, trainer.plan
    # Its own prompts: the run's prompt stream must not depend on calibration.
    trainer.rng = random.Random(trainer.cfg.seed * 7919 + 1)
    runs, setups, observed = [], {}, []
    try:
        while len(probes) < num_probes:
            # Ranked by the model as refined so far: each probe measures a layout the
            # model now ranks among its best without having run it.
            p = next_probe([q for _, q in ad.ranked_plans(rlen)], covered, PROBE_POOL)
            if p is None:
                break
            probes.append(p)
            covered |= layouts(p)
            before[repr(p)] = ad.cm.step_latency(p, wl).total_s
            trainer.plan = p
            descs = [trainer._desc(sp) for sp in p.stages]
            t_setup = time.perf_counter()
            trainer._all("rl.setup", descs, trainer.mc, full_states, trainer.cfg.hyper())
            setups[repr(p)] = time.perf_counter() - t_setup
            for rep in range(repeats):
                t_step = time.perf_counter()
                sync = trainer.weight_sync()
                job = trainer._rollout_wait(trainer._rollout_submit(0))
                m = trainer._train_on(job)
                m.update(sync)
                secs = stage_seconds(trainer.cfg.algo, m)
                if rep > 0:  # the first run pays the layout's one-off costs
                    ad.cm.observe(p, wl, secs)
                    observed.append((p, wl, secs))
                runs.append(
                    {"plan": repr(p), "repeat": rep, "step_s": time.perf_counter() - t_step,
                     "stage_s": secs, "observed": rep > 0}
                )  # fmt: skip
    finally:
        trainer.rng, trainer.plan = saved
    after = {repr(p): ad.cm.step_latency(p, wl).total_s for p in probes}
    rec = {
        "probes": [repr(p) for p in probes],
        "response_len": rlen,
        "runs": runs,
        "setup_s": setups,
        "predicted_before_s": before,
        "predicted_after_s": after,
        "seconds": time.perf_counter() - t0,
    }
    return rec, observed
