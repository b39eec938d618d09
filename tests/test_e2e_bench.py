"""bench_e2e's enumeration of fixed plans: every feasible plan, each once up to device
relabeling (the worker processes are identical), none of the named baselines again."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_e2e import canonical, enumerate_fixed, write_trace

from nereus_rl.globalplan import GlobalPlan, StagePlan
from nereus_rl.trainer import TrainConfig, Trainer


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
    lengths = [trainer._response_len(i) for i in range(10)]
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
