"""Lookahead on the urgent path: pure computation on the local-cpu cost model and planner."""

import pytest

from nereus_rl.controller import Controller
from nereus_rl.costmodel import CostModel
from nereus_rl.lookahead import LookaheadError, choose
from nereus_rl.planner import plan as plan_best
from nereus_rl.spec import local_cpu_cluster, model_preset
from nereus_rl.trainer_adapt import compile_priced
from nereus_rl.workload import bucket_of, make_workload

BUCKETS = (8, 12, 16, 24, 32, 48, 64)
# bench_e2e's default rise (6 -> 20 tokens) and a budget (bytes per worker) at which the
# planner's best plan for 13 tokens holds 16 but not the 24-token bucket two steps on.
TRACE = [6, 10, 13, 17, 20, 20, 20, 17, 15, 13]
BUDGET = 3_700_000
MODEL = model_preset("tiny")
HORIZON = 4  # the next step and 3 forecast ones (the trainer's LOOKAHEAD_STEPS may differ)


def wl(rlen):
    return make_workload("grpo", actor=MODEL, batch=4, prompt_len=8,
                         response_len=bucket_of(rlen, BUCKETS), group_size=4,
                         micro_batch=2, dtype="fp32")  # fmt: skip


@pytest.fixture(scope="module")
def cm():
    return CostModel(local_cpu_cluster(4, 2.0, memory_bytes=BUDGET * 4))


def ranked(cm, rlen):
    return [p for _, p in plan_best(wl(rlen), cm.cluster, cm, k=64).k_best]


def tcost(cm):
    return lambda a, b: compile_priced(cm, MODEL, range(4), a, b)[1]


def run(cm, lookahead):
    """Walk the trace as the adapter does: before step s+1 the controller sees only the
    lengths so far; an urgent move happens when the plan cannot hold the next length."""
    ctl = Controller(buckets=BUCKETS, hysteresis=0.0, window=5)
    plan = ranked(cm, TRACE[0])[0]
    moves, choices = [], []
    for s in range(len(TRACE) - 1):
        nxt = TRACE[s + 1]
        ctl.update(s, seq_len=nxt)
        if not cm.memory_violations(plan, wl(nxt)):
            continue
        moves.append(s)
        cands = ranked(cm, nxt)
        if lookahead:
            ahead = ctl.seq_len.forecast_lengths(HORIZON - 1)
            lengths = (bucket_of(nxt, BUCKETS), *ahead)
            ch = choose(plan, cands, [wl(n) for n in lengths], lengths, cm, tcost(cm))
            choices.append(ch)
            plan = ch.plan
        else:
            plan = cands[0]
    return moves, choices


def test_lookahead_avoids_the_second_urgent_move(cm):
    old_moves, _ = run(cm, lookahead=False)
    la_moves, (ch,) = run(cm, lookahead=True)
    assert old_moves == [1, 2]  # 13 tokens, then 17 (bucket 24) two steps later
    assert la_moves == [1]
    # At step 1 the signal had seen 10, 13: its trend says 16, 19, 22 -> 16, 24, 24.
    assert ch.lengths == (16, 16, 24, 24) and ch.horizon == HORIZON
    assert not ch.fallback and ch.rank > 0 and ch.old_over_at == 2
    assert ch.score_s < ch.old_score_s
    assert not any(cm.memory_violations(ch.plan, wl(n)) for n in ch.lengths)
    rec = ch.record()
    assert rec["lookahead_lengths"] == [16, 16, 24, 24]
    assert "goes over memory at horizon step 2" in rec["lookahead_reason"]


def test_keeps_the_old_choice_when_it_fits_the_horizon(cm):
    cands = ranked(cm, 13)
    ch = choose(cands[1], cands, [wl(16)] * 3, (16, 16, 16), cm, tcost(cm))
    assert ch.rank == 0 and ch.plan == cands[0] and not ch.fallback
    assert "fits every forecast length; kept" in ch.reason


def test_falls_back_when_no_candidate_fits_the_horizon(cm):
    cands = ranked(cm, 13)
    # No plan on these devices holds 128-token responses within the budget.
    assert all(cm.memory_violations(p, wl(128)) for p in cands)
    ch = choose(cands[1], cands, [wl(16), wl(128)], (16, 128), cm, tcost(cm))
    assert ch.fallback and ch.rank == 0 and ch.plan == cands[0]
    assert ch.old_over_at == 1 and "no candidate" in ch.reason


def test_bad_input(cm):
    cands = ranked(cm, 13)
    with pytest.raises(LookaheadError, match="one length per workload"):
        choose(cands[0], cands, [], (), cm, tcost(cm))
    with pytest.raises(LookaheadError, match="no candidate fits the next step"):
        choose(cands[0], cands, [wl(128)], (128,), cm, tcost(cm))
