"""bench_costmodel's figures from repetitions: per-process minima, the cleanest set."""

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_costmodel.py"
_spec = importlib.util.spec_from_file_location("bench_costmodel", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)
scoring = bench.scoring


def _rep(each, rnd=0, clean=False, steal=0):
    """One repetition of two processes with one part each (CPU seconds per process)."""
    return {
        "round": rnd,
        "wall": max(each),
        "cpu": max(each),
        "parts": [max(each)],
        "cpu_each": list(each),
        "parts_each": [[c] for c in each],
        "clean": clean,
        "steal": steal,
    }


def test_cpu_figure_is_per_process_minimum_then_slower_process():
    # Each process is slow in the other's fastest repetition: the slower process per
    # repetition would give 2.0; each one's own fastest is 1.0 and 1.1.
    reps = [_rep((1.0, 2.0)), _rep((2.0, 1.1))]
    assert bench._cpu_estimate(reps, "step") == pytest.approx(1.1)
    assert bench._cpu_estimate(reps, "parts") == pytest.approx(1.1)


def test_parts_sum_each_parts_fastest_repetition():
    reps = [_rep((1.0,)), _rep((1.0,))]
    reps[0]["parts_each"] = [[0.3, 0.9]]  # (micro-batch, optimizer step)
    reps[1]["parts_each"] = [[0.5, 0.6]]
    assert bench._cpu_estimate(reps, "parts") == pytest.approx(0.9)
    assert bench._cpu_estimate(reps, "step") == pytest.approx(1.0)


def test_figure_from_cleanest_set_with_enough_repetitions():
    fast_dirty = [_rep((1.0,), steal=1) for _ in range(3)]
    steal_free = [_rep((2.0,)) for _ in range(3)]
    clean = [_rep((3.0,), clean=True) for _ in range(2)]
    plan = ("tiny", 1, 32, "1p")
    (row,) = bench._rows([(plan, fast_dirty + steal_free + clean)], "step", "min")
    # Two clean repetitions are too few: the steal-free ones (clean among them) count.
    assert row["figure_from"] == "steal-free"
    assert row["cpu_measured_ms"] == pytest.approx(2000.0)
    (row,) = bench._rows([(plan, fast_dirty + clean + [_rep((3.5,), clean=True)])], "step", "min")
    assert row["figure_from"] == "clean"
    assert row["cpu_measured_ms"] == pytest.approx(3000.0)


def test_median_over_rounds_of_each_rounds_figure():
    # Round 1 is fast in one repetition only (a minimum over all rounds would take 1.0);
    # per round the fastest is 3.0, 1.0, 2.0, 2.5 (round 2's dirty repetition counts:
    # every round's repetitions do), and the median of those is 2.25.
    reps = [_rep((3.0,), rnd=0), _rep((4.0,), rnd=0), _rep((1.0,), rnd=1), _rep((9.0,), rnd=1)]
    reps += [_rep((2.0,), rnd=2, steal=3), _rep((2.5,), rnd=3, clean=True)]
    plan = ("tiny", 1, 32, "1p")
    (row,) = bench._rows([(plan, reps)], "step")
    assert row["cpu_measured_ms"] == pytest.approx(2250.0)
    assert row["rounds"] == 4
    (row,) = bench._rows([(plan, reps)], "step", "min")
    assert row["cpu_measured_ms"] == pytest.approx(1000.0)


def test_pooled_runs_number_rounds_after_each_other():
    plan = ("tiny", 1, 32, "1p")
    a = [(plan, [_rep((1.0,), rnd=0), _rep((2.0,), rnd=1)])]
    b = [(plan, [_rep((3.0,), rnd=0)])]
    ((p, reps),) = scoring.pooled([a, b])
    assert p == plan and [r["round"] for r in reps] == [0, 1, 2]
    with pytest.raises(ValueError, match="another grid"):
        scoring.pooled([a, [(("tiny", 2, 32, "1p"), [_rep((1.0,))])]])


def _row(layout, mb, seq, cpu, role="held_out", err=0.0):
    return {
        "preset": "tiny",
        "layout": layout,
        "micro_batch": mb,
        "seq_len": seq,
        "cpu_measured_ms": cpu,
        "wall_measured_ms": cpu,
        "role": role,
        "cpu_error_pct": err,
    }


def test_twins_pair_plans_of_identical_work_only():
    # On 2 processes of 4 sequences each, micro-batch 8 runs as 4: those two are twins;
    # on 1 process (8 sequences) they are different work.
    rows = [_row("2p-2core", 4, 32, 10.0), _row("2p-2core", 8, 32, 11.0)]
    rows += [_row("1p", 4, 32, 10.0), _row("1p", 8, 32, 30.0)]
    tw = scoring.twins(rows, bench.BATCH, {k: v[0] for k, v in bench.LAYOUTS.items()})
    assert tw["cpu"] == pytest.approx((10.0, 10.0, 1))


def test_across_runs_separates_persistent_error_from_noise():
    runs = []
    for i, (a, b) in enumerate([(10, 10), (11, -10), (9, 10), (10, -10)]):
        runs.append([_row("1p", 1, 32, 1.0, err=a), _row("1p", 2, 32, 1.0, err=b)])
        runs[-1].append(_row("1p", 4, 32, 1.0, role="fit", err=50.0 * i))  # not scored
    got = scoring.across_runs(runs)
    # Plan 1 is off by +10% in every run (the model's), plan 2 by +-10% (noise).
    assert got["systematic_pct"] == pytest.approx((10.0 + 0.0) / 2)
    assert [k for k, _, _ in got["persistent"]] == [("tiny", "1p", 1, 32)]
    assert got["per_run_held_out_mean_pct"] == pytest.approx([10.0, 10.5, 9.5, 10.0])
