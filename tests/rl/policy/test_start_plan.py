"""The adaptive run's start plan: lookahead over the configured lengths (start_plan,
lookahead.choose_start). Pure computation: table cost models and a planner-only trainer
(no worker process is started)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_lookahead import TableCM, move

from nereus_rl.policy.lookahead import LookaheadError, choose, choose_start
from nereus_rl.policy.start_plan import StartPlanError, start_candidates, start_lengths
from nereus_rl.trainer.config import TrainConfig, TrainConfigError
from nereus_rl.trainer.trainer import Trainer

# bench_e2e --quick's trace (rise 6 -> 20, hold, fall) and its GRPO startup budget
TRACE = [6, 9, 12, 16, 20, 20, 20, 20, 17, 13]
BUDGET = int(2.442 * 2**20)


def test_start_pays_no_move_to_its_plan_and_prices_the_forced_one():
    # A (fastest at step 0) goes over at step 1 and must move to B: 1.0 + 0.5 + 3 x 1.2 =
    # 5.1; B holds all four steps: 4 x 1.2 = 4.8 (no move into the start plan is paid).
    cm = TableCM({"A": 1.0, "B": 1.2}, {"A": 1, "B": 4})
    ch = choose_start(["A", "B"], [0, 1, 2, 3], (8, 12, 16, 16), cm, move(0.5))
    assert ch.plan == "B" and ch.rank == 1 and ch.over_at is None
    assert ch.score_s == pytest.approx(4.8) and ch.old_score_s == pytest.approx(5.1)
    assert ch.reason.startswith("start plan: ")
    assert "goes over memory at horizon step 1" in ch.reason
    # a cheap forced move makes A's crossing worth it: 1.0 + 0.1 + 3 x 1.2 = 4.7
    assert choose_start(["A", "B"], [0, 1, 2, 3], (8,) * 4, cm, move(0.1)).plan == "A"
    # ... unless the model's error band calls it a tie: B needs no move
    tied = choose_start(["A", "B"], [0, 1, 2, 3], (8,) * 4, cm, move(0.1), tie_margin=0.05)
    assert tied.plan == "B" and "near tie" in tied.reason


def test_start_keeps_the_planners_best_when_it_holds_every_length():
    cm = TableCM({"A": 1.0, "B": 0.5}, {"A": 9, "B": 9})
    ch = choose_start(["A", "B"], [0, 1, 2], (8, 8, 8), cm, move(0.0))
    assert ch.plan == "A" and ch.rank == 0 and "fits every forecast length; kept" in ch.reason
    with pytest.raises(LookaheadError, match="no candidate fits"):
        choose_start(["A"], [9], (64,), cm, move(0.0))
    with pytest.raises(LookaheadError, match="tie_margin"):
        choose_start(["A"], [0], (8,), cm, move(0.0), tie_margin=-1)


class Named(str):
    """A table plan with the devices it uses (the tie rule reads ``plan.devices``)."""

    def __new__(cls, name: str, devices: int):
        obj = super().__new__(cls, name)
        obj.devices = frozenset(range(devices))
        return obj


def test_start_near_tie_goes_to_the_fewest_devices():
    # A (the planner's best, 4 devices) and B (3 devices, 5% slower) both hold every
    # length: within a 10% band B is taken; C (2 devices) is 30% slower, out of the band;
    # D (1 device) is within it but goes over at step 2 (a forced move: not a tie).
    a, b, c, d = Named("A", 4), Named("B", 3), Named("C", 2), Named("D", 1)
    cm = TableCM({a: 1.0, b: 1.05, c: 1.3, d: 1.0}, {a: 9, b: 9, c: 9, d: 2})
    args = ([a, b, c, d], [0, 1, 2, 3], (8,) * 4, cm, move(0.1))
    ch = choose_start(*args, tie_margin=0.1)
    assert ch.plan == "B" and ch.rank == 1 and ch.score_s == pytest.approx(4.2)
    assert ch.old_score_s == pytest.approx(4.0) and ch.over_at is None
    assert "near tie" in ch.reason and "on 3 devices instead of 4" in ch.reason
    # no band (or a narrower one): the planner's best stands
    assert choose_start(*args).plan == "A"
    assert choose_start(*args, tie_margin=0.04).plan == "A"
    # a move's choice keeps its old rule: the planner's best holds, so it is kept
    moved = choose(a, [a, b, c, d], [0, 1, 2, 3], (8,) * 4, cm, move(0.1), tie_margin=0.1)
    assert moved.plan == "A"


def test_start_near_tie_after_a_crossing_prefers_fewer_devices_at_equal_moves():
    # The planner's best A goes over at step 1 (a forced move): among B (4 devices) and
    # E (2 devices), both holding every length and within 10% of each other, E wins.
    a, b, e = Named("A", 4), Named("B", 4), Named("E", 2)
    cm = TableCM({a: 0.5, b: 1.0, e: 1.05}, {a: 1, b: 9, e: 9})
    ch = choose_start([a, b, e], [0, 1, 2, 3], (8, 12, 16, 16), cm, move(2.0), tie_margin=0.1)
    assert ch.plan == "E" and "on 2 devices instead of 4" in ch.reason
    assert choose_start([a, b, e], [0, 1, 2, 3], (8, 12, 16, 16), cm, move(2.0)).plan == "B"


def test_start_near_tie_prefers_stage_shapes_the_calibration_measured():
    # Within the band, the candidate with fewer stages of an unmeasured shape wins
    # before the devices count: after a crossing (A goes over at step 1; B the best
    # score, on 2 devices, E within 10% of it on 4) and when the planner's best holds
    # every length (C and D below).
    a, b, e = Named("A", 4), Named("B", 2), Named("E", 4)
    cm = TableCM({a: 0.5, b: 1.0, e: 1.05}, {a: 1, b: 9, e: 9})
    unm = {a: 0, b: 1, e: 0}.__getitem__
    args = ([a, b, e], [0, 1, 2, 3], (8, 12, 16, 16), cm, move(2.0))
    ch = choose_start(*args, tie_margin=0.1, unmeasured=unm)
    assert ch.plan == "E" and "near tie" in ch.reason
    assert "with 0 stage(s) of a shape the calibration did not run instead of 1" in ch.reason
    # every shape measured (or none counted): the best score, on the fewest devices
    assert choose_start(*args, tie_margin=0.1, unmeasured=lambda p: 0).plan == "B"
    assert choose_start(*args, tie_margin=0.1).plan == "B"
    # out of the band, the score decides whatever was measured
    assert choose_start(*args, tie_margin=0.01, unmeasured=unm).plan == "B"
    c, d = Named("C", 4), Named("D", 3)  # C: the planner's best, holding every length
    cm2 = TableCM({c: 1.0, d: 1.05}, {c: 9, d: 9})
    args2 = ([c, d], [0, 1, 2, 3], (8,) * 4, cm2, move(0.1))
    assert choose_start(*args2, tie_margin=0.1, unmeasured={c: 1, d: 0}.__getitem__).plan == "D"
    kept = choose_start(*args2, tie_margin=0.1, unmeasured={c: 0, d: 1}.__getitem__)
    assert kept.plan == "C" and "kept" in kept.reason  # fewer devices, but extrapolated
    assert choose_start(*args2, tie_margin=0.1).plan == "D"  # on 3 devices


def test_unmeasured_stages_counts_shapes_no_probe_or_step_priced(tmp_path):
    ad = _trainer(tmp_path, adapt=True).adapter
    plan = ad.ranked_plans(12)[0][1]
    assert ad.unmeasured_stages(plan) == len(plan.stages)  # nothing measured yet
    wl = ad.workload(12)
    first = plan.stages[0]
    ad.shapes.observe(plan, wl, {first.stage: 0.01}, startup=True)
    assert ad.unmeasured_stages(plan) == len(plan.stages) - 1


def _trainer(tmp_path: Path, adapt: bool, budget=BUDGET, **extra) -> Trainer:
    trace = tmp_path / "trace.csv"
    trace.write_text("step,response_len\n" + "".join(f"{i},{n}\n" for i, n in enumerate(TRACE)))
    cfg = TrainConfig(
        algo="grpo", devices=4, warm_steps=20, batch=4, group_size=4, seed=0,
        steps=len(TRACE), trace=str(trace), memory_budget=budget, adapt=adapt, **extra,
    )  # fmt: skip
    return Trainer(cfg, driver=object())  # planner only: nothing is spawned


def _peak(ad, plan, rlen):
    return max(ad.cm.peak_memory(plan, ad.workload(rlen)).values())


def test_adaptive_start_holds_the_configured_lengths(tmp_path):
    tr = _trainer(tmp_path, adapt=True)
    ad = tr.adapter
    best = ad.ranked_plans(TRACE[0])[0][1]
    # the planner's best at 6 tokens goes over the budget as the trace rises
    assert max(_peak(ad, best, n) for n in TRACE) > ad.budget
    # the adaptive run starts on a plan that holds every length of its trace, and says why
    assert all(_peak(ad, tr.first_plan, n) <= ad.budget for n in TRACE)
    row = ad.start_decision.to_row()
    assert row["path"] == "start" and row["taken"] is False
    assert row["candidate"] == repr(tr.first_plan)
    assert row["lookahead_horizon"] == len(TRACE) and row["lookahead_old_over_at"] is not None
    # the run's lengths, bucketed, each repeat as "length xsteps"
    assert (
        "start plan: lookahead over 10 steps at lengths [8, 12 x2, 16, 24 x5, 16]"
        in (row["reason"])
    )
    # a fixed run (adapt=False) cannot move: it keeps the planner's best
    assert _trainer(tmp_path, adapt=False).first_plan == best
    # an adaptive run told not to read its schedule chooses by the same rules over the
    # first step's length only: a plan that fits it, not one that holds the trace
    blind = _trainer(tmp_path, adapt=True, start_lengths="first")
    ad = blind.adapter
    assert _peak(ad, blind.first_plan, TRACE[0]) <= ad.budget
    assert max(_peak(ad, blind.first_plan, n) for n in TRACE) > ad.budget
    first = ad.start_decision.to_row()
    assert first["lookahead_horizon"] == 1
    assert "start: the first step's length only" in first["trigger"]
    assert "lookahead over 1 steps at lengths [8]" in first["reason"]
    # knowing the cap, it looks over the first length and then the longest at every step
    cap = _trainer(tmp_path, adapt=True, start_lengths="cap").adapter.start_decision
    assert "lookahead over 10 steps at lengths [8, 24 x9]" in cap.reason
    assert "then the longest (10 steps)" in cap.trigger
    with pytest.raises(TrainConfigError, match="unknown start_lengths 'all'"):
        _trainer(tmp_path, adapt=True, start_lengths="all")


def test_no_budget_keeps_the_auto_budgets_sized_plan(tmp_path):
    tr = _trainer(tmp_path, adapt=True, budget=None)
    assert tr.first_plan == tr.adapter.sized_plan and tr.adapter.start_decision is None


def test_start_candidates_add_the_planners_best_at_later_lengths(tmp_path):
    # The planner's search at one length drops layouts another layout on the same
    # devices beats there, so the k-best at the first length lacks plans that hold the
    # later lengths (bench_e2e ReMax async: the best fixed plan was not among them).
    tr = _trainer(tmp_path, adapt=True)
    ad = tr.adapter
    schedule = [tr.response_len(s) for s in range(tr.cfg.steps)]
    lengths = start_lengths(schedule, tr.cfg.buckets, tr.cfg.start_lengths)
    first = [p for _, p in ad.ranked_plans(lengths[0])]
    cands = start_candidates(first, lengths, lambda n: [p for _, p in ad.ranked_plans(n)])
    assert cands[: len(first)] == first and len(set(cands)) == len(cands)
    later = {p for n in set(lengths[1:]) for _, p in ad.ranked_plans(n)}
    assert later <= set(cands) and later - set(first)  # some are new
    # the start plan is among them and holds every length
    assert tr.first_plan in cands


def test_start_candidates_skip_a_length_nothing_fits():
    def ranked_at(n):
        if n == 24:
            raise StartPlanError("nothing fits at 24")
        return ["B", f"C{n}"]

    assert start_candidates(["A", "B"], [8, 16, 24, 16], ranked_at) == ["A", "B", "C16"]
    # the lengths a start looks over, by TrainConfig.start_lengths
    assert start_lengths([6, 9, 20], (8, 12, 16, 24), "schedule") == [8, 12, 24]
    assert start_lengths([6, 9, 20], (8, 12, 16, 24), "cap") == [8, 24, 24]
    assert start_lengths([6, 9, 20], (8, 12, 16, 24), "first") == [8]


def test_urgent_candidates_add_the_planners_best_at_the_horizons_longest_length(tmp_path):
    # An urgent move's lookahead needs the plans that hold the lengths the forecast
    # rises to; the k-best at the next length can lack them, as at the start.
    ad = _trainer(tmp_path, adapt=True).adapter
    for step, n in enumerate((6, 8, 10, 12)):
        ad.controller.seq_len.update(step, n)
    devices = [0, 1, 2, 3]
    ranked = [p for _, p in ad.ranked_plans(12, devices=devices)]
    longest = max(ad.horizon_lengths(12, steps_left=8))
    assert longest > 12
    cands = ad.urgent_candidates(ranked, 12, 8, devices)
    assert cands[: len(ranked)] == ranked and len(set(cands)) == len(cands)
    added = set(cands[len(ranked) :])
    assert added and added == {p for _, p in ad.ranked_plans(longest, devices=devices)} - set(
        ranked
    )
    assert all(p.devices <= set(devices) for p in added)
    # a horizon of the next step alone (one step left) adds none
    assert ad.urgent_candidates(ranked, 12, 1, devices) == ranked
