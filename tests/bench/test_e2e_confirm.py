"""bench_e2e's confirmation phase: the selected best fixed plan measured again against
adaptive in held-out interleaved rounds, its rows built from those rounds only, and the
best_fixed goal judged on them (synthetic runs, no workers)."""

from __future__ import annotations

import pytest

from benchmarks.lib.e2e_confirm import confirm_best_fixed, run_rounds, variant_row
from benchmarks.lib.e2e_verdict import goal_verdicts, paired_range, print_verdicts

PLAN = "GlobalPlan(rollout[dp1 tp1 pp1 @ 0] | reference[dp1 tp1 pp1 @ 1] | actor[...])"
BUDGET = 2_560_000


def _run(lat: float, frac: float = 0.9) -> dict:
    """One run as bench_e2e's _run_row gives it."""
    return {
        "step_latency_s": lat,
        "transitions": 1,
        "reward_mean": 0.025,
        "peak_memory_fraction": frac,
        "error": None,
        "calibration_s": 1.0,
        "plans": [(0, "P")],
        "phases": None,
        "steps": [[0, 0, lat, 0.0]],
        "moves": [],
    }


def _selection_row() -> dict:
    """best_fixed's selection row over 3 repeats: fixed 0.10 s vs adaptive 0.20 s."""
    sel = [_run(0.10), _run(0.11), _run(0.09)]
    base = [0.20, 0.21, 0.19]
    return {**variant_row("grpo", "sync", "enum00", PLAN, sel, base, BUDGET),
            "variant": "best_fixed (enum00)", "model_check": {}}  # fmt: skip


class Runner:
    """Gives the confirmation rounds' runs in call order and records the calls."""

    def __init__(self, adaptive: list[float], fixed: list[float]):
        self.lat = {"adaptive": list(adaptive), "fixed": list(fixed)}
        self.calls: list[str] = []

    def __call__(self, which: str) -> dict:
        self.calls.append(which)
        return _run(self.lat[which].pop(0))


def test_rounds_alternate_which_runs_first():
    calls = []
    out = run_rounds(3, lambda w: calls.append(w) or _run(len(calls)))
    assert calls == ["adaptive", "fixed", "fixed", "adaptive", "adaptive", "fixed"]
    # index i of both lists is round i
    assert [r["step_latency_s"] for r in out["adaptive"]] == [1, 4, 5]
    assert [r["step_latency_s"] for r in out["fixed"]] == [2, 3, 6]
    assert run_rounds(0, lambda w: pytest.fail("ran")) == {"adaptive": [], "fixed": []}
    with pytest.raises(ValueError, match="0 disables"):
        run_rounds(-1, lambda w: pytest.fail("ran"))


def test_confirmed_rows_come_from_the_confirmation_rounds_only():
    sel = _selection_row()
    ad, fx = [0.20, 0.25, 0.16], [0.19, 0.26, 0.18]
    runner = Runner(ad, fx)
    rows = confirm_best_fixed(sel, 3, runner)
    assert sorted(runner.calls) == ["adaptive"] * 3 + ["fixed"] * 3  # fresh runs only
    a, b = rows
    assert a["variant"] == "adaptive_confirmed" and b["variant"] == "best_fixed_confirmed (enum00)"
    assert a["phase"] == b["phase"] == "confirmation"
    assert b["plan"] == PLAN and a["plan"] is None
    assert a["repeats"] == b["repeats"] == 3
    # the confirmed figures are the confirmation runs', paired round by round
    assert b["step_latency_s"] == pytest.approx(sum(fx) / 3)
    assert (b["step_latency_min_s"], b["step_latency_max_s"]) == (0.18, 0.26)
    ratios = [f / x for f, x in zip(fx, ad)]
    assert (b["paired_geomean_x"], b["ci_lo_x"], b["ci_hi_x"]) == paired_range(ratios)
    assert b["latency_vs_adaptive_x"] == pytest.approx(sum(fx) / sum(ad))
    assert [s[0][2] for s in b["steps_per_repeat"]] == fx
    assert a["step_latency_s"] == pytest.approx(sum(ad) / 3)
    assert (a["paired_geomean_x"], a["ci_lo_x"], a["ci_hi_x"]) == (1.0, 1.0, 1.0)
    assert a["plans_per_repeat"] == [[(0, "P")]] * 3 and b["plans_per_repeat"] is None
    # and none of the selection's: its fixed mean was 0.10 s at 0.5x adaptive
    assert b["step_latency_s"] != pytest.approx(sel["step_latency_s"])
    assert b["paired_geomean_x"] > 0.9 > sel["paired_geomean_x"]
    assert "model_check" not in b and "predicted" not in b
    assert sel["variant"] == "best_fixed (enum00)"  # the selection row is left as it was


def test_confirmation_checks_its_input_before_running():
    assert confirm_best_fixed(_selection_row(), 0, lambda w: pytest.fail("ran")) == []
    not_best = {**_selection_row(), "variant": "enum00"}
    with pytest.raises(ValueError, match="selection row"):
        confirm_best_fixed(not_best, 3, lambda w: pytest.fail("ran"))
    with pytest.raises(ValueError, match="0 disables"):
        confirm_best_fixed(_selection_row(), -2, lambda w: pytest.fail("ran"))


def _row(v, lo, hi, fits=True, repeats=3):
    return {"variant": v, "ci_lo_x": lo, "ci_hi_x": hi, "paired_geomean_x": (lo + hi) / 2,
            "fits_budget": fits, "repeats": repeats}  # fmt: skip


def _goal(verdicts):
    """The best_fixed goal's verdict: the entry not labelled as the selection's."""
    (v,) = [
        v
        for v in verdicts
        if v["goal"] == "best_fixed" and not v["verdict"].startswith("selection (biased low)")
    ]
    return v


@pytest.mark.parametrize(
    "sel, conf, want",
    [((0.80, 0.90), (1.00, 1.10), "met"), ((0.97, 1.10), (0.80, 0.90), "missed")],
)
def test_best_fixed_goal_is_judged_on_the_confirmed_row(sel, conf, want, capsys):
    base = [_row("adaptive", 1.0, 1.0), _row("replan_always", 0.9, 1.1)]
    rows = [*base, _row("best_fixed (enum00)", *sel), _row("adaptive_confirmed", 1.0, 1.0),
            _row("best_fixed_confirmed (enum00)", *conf, repeats=2)]  # fmt: skip
    out = goal_verdicts(rows)
    goal = _goal(out)
    assert goal["variant"] == "best_fixed_confirmed (enum00)" and goal["verdict"] == want
    assert "2 held-out confirmation rounds" in goal["note"]
    (selection,) = [v for v in out if v["variant"] == "best_fixed (enum00)"]
    other = "missed" if want == "met" else "met"
    assert selection["verdict"] == f"selection (biased low): {other}"
    assert [v["variant"] for v in out] == [
        "replan_always",
        "best_fixed (enum00)",
        "best_fixed_confirmed (enum00)",
    ]
    print_verdicts("grpo", "sync", out)
    text = capsys.readouterr().out
    assert f"selection (biased low): {other}" in text
    assert f"{want} (judged on 2 held-out confirmation rounds" in text
    # without confirmation rounds the selection row is the goal's, said to be biased low
    plain = goal_verdicts([*base, _row("best_fixed (enum00)", *sel)])
    assert _goal(plain)["verdict"] == other and "biased low" in _goal(plain)["note"]


def test_three_variants_rotate_and_an_extra_row_is_paired_with_both():
    calls = []
    out = run_rounds(3, lambda w: calls.append(w) or _run(len(calls)), ("a", "f", "b"))
    assert calls == ["a", "f", "b", "f", "b", "a", "b", "a", "f"]  # each first once
    assert [r["step_latency_s"] for r in out["b"]] == [3, 5, 7]
    sel = _selection_row()
    ad, fx, bl = [0.20, 0.25, 0.16], [0.19, 0.26, 0.18], [0.22, 0.30, 0.16]
    lat = {"adaptive": list(ad), "fixed": list(fx), "adaptive_blind": list(bl)}
    rows = confirm_best_fixed(sel, 3, lambda w: _run(lat[w].pop(0)), extra=("adaptive_blind",))
    assert [r["variant"] for r in rows] == [
        "adaptive_confirmed", "best_fixed_confirmed (enum00)", "adaptive_blind_confirmed",
    ]  # fmt: skip
    b = rows[2]
    assert b["plan"] is None and b["phase"] == "confirmation" and b["repeats"] == 3
    assert b["paired_geomean_x"] == paired_range([x / a for x, a in zip(bl, ad)])[0]
    vb = b["vs_best_fixed"]
    assert (vb["paired_geomean_x"], vb["ci_lo_x"], vb["ci_hi_x"]) == paired_range(
        [f / x for f, x in zip(fx, bl)]
    )
    assert "vs_best_fixed" not in rows[0] and "vs_best_fixed" not in rows[1]
