"""bench_e2e's fixed plans and verdicts: the enumeration of fixed plans (every feasible
plan, each once up to device relabeling, none of the named baselines again), the default
budget rule (every startup structure has a layout for the whole trace), and the
noise-aware goal verdicts."""

from __future__ import annotations

import math

import pytest

from benchmarks.lib.e2e_plans import (
    STRUCTURES,
    canonical,
    enumerate_fixed,
    peak_over,
    startup_budget,
    structured_plan,
    write_trace,
)
from benchmarks.lib.e2e_verdict import T95, goal_verdicts, paired_range, verdict
from nereus_rl.core.globalplan import GlobalPlan, StagePlan
from nereus_rl.trainer.trainer import TrainConfig, Trainer


def _plan(rollout, ref, train):
    return GlobalPlan(
        (
            StagePlan("rollout", "actor", False, len(rollout), 1, 1, tuple((d,) for d in rollout)),
            StagePlan("reference", "reference", False, len(ref), 1, 1, tuple((d,) for d in ref)),
            StagePlan("actor_train", "actor", True, len(train), 1, 1, tuple((d,) for d in train)),
        )
    )


def test_canonical_is_relabeling_invariant_and_keeps_sharing():
    a = _plan([0], [2, 3], [0, 1])
    assert canonical(a, 4) == canonical(_plan([3], [0, 1], [3, 2]), 4)
    assert canonical(a, 4) == canonical(_plan([1], [2, 3], [1, 0]), 4)
    # rollout off the training devices is another plan, not a relabeling
    assert canonical(a, 4) != canonical(_plan([2], [2, 3], [0, 1]), 4)
    assert canonical(a, 4) != canonical(_plan([0], [0, 1], [0, 1]), 4)


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    trace = write_trace(tmp_path_factory.mktemp("t") / "trace.csv", 10)
    t = Trainer(
        TrainConfig(algo="grpo", devices=4, warm_steps=20, batch=4, group_size=4, seed=0,
                    steps=10, trace=str(trace))
    )  # fmt: skip
    yield t
    t.driver.shutdown()  # planned only; no worker started


def test_enumerate_fixed_every_feasible_plan_once(trainer):
    ad = trainer.adapter
    lengths = [trainer.response_len(i) for i in range(10)]
    named = [trainer.first_plan]
    out, counts = enumerate_fixed(ad, lengths, named)
    plans = [p for _, p in out]
    keys = [canonical(p, 4) for p in plans]
    assert len(set(keys)) == len(keys) == counts["k_best"] - counts["duplicates"]
    assert canonical(named[0], 4) not in keys
    assert len(plans) > 10  # more than the six named plans: the whole k-best
    # each fits the budget at the longest responses, so at every step
    wl = ad.workload(max(lengths))
    assert all(max(ad.cm.peak_memory(p, wl).values()) <= ad.budget for p in plans)
    preds = [x for x, _ in out]
    assert preds == sorted(preds)
    # a relabeled named plan is recognized as named
    first = named[0]
    perm = {0: 3, 1: 2, 2: 1, 3: 0}
    relabeled = GlobalPlan(
        tuple(
            StagePlan(s.stage, s.model, s.trains, s.dp, s.tp, s.pp,
                      tuple(tuple(perm[d] for d in u) for u in s.units))
            for s in first.stages
        )
    )  # fmt: skip
    out2, _ = enumerate_fixed(ad, lengths, [relabeled])
    assert [p for _, p in out2] == plans


def test_startup_budget_leaves_every_startup_structure_a_layout(trainer):
    ad = trainer.adapter
    lengths = [trainer.response_len(i) for i in range(10)]
    budget, least = startup_budget(ad, lengths)
    assert budget == max(least.values())  # the least at which both structures fit
    cfg = trainer.cfg
    sized = Trainer(
        TrainConfig(algo="grpo", devices=4, warm_steps=20, batch=4, group_size=4, seed=0,
                    steps=10, trace=cfg.trace, memory_budget=budget)
    )  # fmt: skip
    try:
        sa = sized.adapter
        for kind in STRUCTURES:  # sized for the first and for the longest responses
            for n in (lengths[0], max(lengths)):
                plan, fits = structured_plan(sa, kind, n, lengths)
                assert fits and peak_over(sa, plan, lengths) <= budget
        sa.best_plan(max(lengths))  # the planner's best for the longest length exists
        # one byte less and the tighter structure has no layout for the whole trace
        tight = max(least, key=least.get)
        sa.budget = budget - 1
        assert not structured_plan(sa, tight, max(lengths), lengths)[1]
    finally:
        sized.driver.shutdown()


def test_paired_range_is_a_t_interval_of_the_log_ratios():
    geo, lo, hi = paired_range([1.0, 1.0, 1.0])
    assert (geo, lo, hi) == (1.0, 1.0, 1.0)
    geo, lo, hi = paired_range([1.1, 1.2, 1.3])
    logs = [math.log(x) for x in (1.1, 1.2, 1.3)]
    m = sum(logs) / 3
    sd = math.sqrt(sum((x - m) ** 2 for x in logs) / 2)
    assert geo == pytest.approx(math.exp(m))
    assert lo == pytest.approx(math.exp(m - T95[1] * sd / math.sqrt(3)))
    assert hi == pytest.approx(math.exp(m + T95[1] * sd / math.sqrt(3)))
    assert lo < 1.1 and hi > 1.3  # three repeats: wider than their spread
    assert math.isnan(paired_range([1.2])[1])


def test_verdicts_say_within_noise_when_the_range_straddles():
    assert verdict(1.40, 1.60, 1 / 0.75) == "met"
    assert verdict(1.10, 1.30, 1 / 0.75) == "missed"
    assert verdict(1.20, 1.40, 1 / 0.75) == "within noise"
    assert verdict(float("nan"), float("nan"), 1.0) == "one repeat"

    def row(v, lo, hi, fits=True):
        return {"variant": v, "ci_lo_x": lo, "ci_hi_x": hi, "paired_geomean_x": (lo + hi) / 2,
                "fits_budget": fits}  # fmt: skip

    rows = [
        row("adaptive", 1.0, 1.0),
        row("replan_always", 0.9, 1.1),
        row("colocated_max", 1.5, 2.0),
        row("disaggregated_max", 1.5, 2.0, fits=False),
        row("best_fixed (enum00)", 0.80, 0.90),
    ]
    got = {(v["goal"], v["variant"]): v["verdict"] for v in goal_verdicts(rows)}
    assert got == {
        ("startup", "colocated_max"): "met",
        ("startup", "disaggregated_max"): "not judged: does not fit the budget",
        ("replan", "replan_always"): "within noise",
        ("best_fixed", "best_fixed (enum00)"): "missed",
    }
