"""bench_costmodel's figures from repetitions: per-process minima, the cleanest set."""

import numpy as np
import pytest

from benchmarks import bench_costmodel as bench
from benchmarks.lib import costmodel_figures as figures
from benchmarks.lib import costmodel_scoring as scoring


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
    assert figures.cpu_estimate(reps, "step") == pytest.approx(1.1)
    assert figures.cpu_estimate(reps, "parts") == pytest.approx(1.1)


def test_parts_sum_each_parts_fastest_repetition():
    reps = [_rep((1.0,)), _rep((1.0,))]
    reps[0]["parts_each"] = [[0.3, 0.9]]  # (micro-batch, optimizer step)
    reps[1]["parts_each"] = [[0.5, 0.6]]
    assert figures.cpu_estimate(reps, "parts") == pytest.approx(0.9)
    assert figures.cpu_estimate(reps, "step") == pytest.approx(1.0)


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


def _rep_parts(parts_each, rnd):
    """One repetition whose processes ran the given parts (micro-batches, then optimizer)."""
    each = [sum(p) for p in parts_each]
    return {
        "round": rnd,
        "wall": max(each),
        "cpu": max(each),
        "parts": list(np.max(parts_each, axis=0)),
        "cpu_each": each,
        "parts_each": [list(p) for p in parts_each],
        "clean": False,
        "steal": 0,
    }


def _host_rounds(mb_part, opt_part, speeds, procs=1):
    """A plan's repetitions over rounds in which the host ran at the given speed factors
    (every part of a round slowed alike), two repetitions per round."""
    return [
        _rep_parts([[mb_part * s, opt_part * s]] * procs, rnd)
        for rnd, s in enumerate(speeds)
        for _ in range(2)
    ]


def test_probe_rescales_each_round_to_the_runs_host_speed():
    # Plan a (12 ms of work) happened to run in two fast rounds of three, plan b (22 ms)
    # in two slow ones: as measured, a looks 0.38x b; its work is 12 / 22 = 0.545x b.
    a, b = ("tiny", 8, 32, "1p"), ("tiny", 4, 32, "1p")
    measured = [
        (a, _host_rounds(10.0, 2.0, [0.7, 0.7, 1.0])),
        (b, _host_rounds(20.0, 2.0, [1.0, 1.0, 0.7])),
    ]
    raw = {
        (r["micro_batch"]): r["cpu_measured_ms"]
        for r in bench._rows(measured, "parts", speed="raw")
    }
    assert raw[8] / raw[4] == pytest.approx(8.4 / 22.0)
    rows = bench._rows(measured, "parts")
    got = {r["micro_batch"]: r for r in rows}
    assert got[8]["cpu_measured_ms"] / got[4]["cpu_measured_ms"] == pytest.approx(12.0 / 22.0)
    # Reference: the median over every round of both plans of the optimizer part
    # (1.4 x 3, 2.0 x 3): 1.7 ms, so a's figure is 12 x 1.7 / 2.
    assert got[8]["cpu_measured_ms"] == pytest.approx(12.0 * 1.7 / 2.0 * 1e3)
    assert got[8]["cpuraw_measured_ms"] == pytest.approx(8.4e3)
    assert got[8]["speed"] == "probe"
    # The minimum over every repetition (--across min) takes the figures as measured.
    assert bench._rows(measured, "parts", "min")[0]["speed"] == "raw"


def test_probe_reference_is_per_preset_and_layout_and_per_process():
    a = ("tiny", 8, 32, "1p")
    alone = bench._rows([(a, _host_rounds(10.0, 2.0, [1.0, 0.7, 1.0]))], "parts")[0]
    # Another layout's optimizer step (two workers time-slicing a core) is other work:
    # it leaves the 1-process reference alone.
    other = ("tiny", 8, 32, "2p-1core")
    rows = bench._rows(
        [
            (a, _host_rounds(10.0, 2.0, [1.0, 0.7, 1.0])),
            (other, _host_rounds(5.0, 3.0, [1, 1, 1], 2)),
        ],
        "parts",
    )
    assert rows[0]["cpu_measured_ms"] == pytest.approx(alone["cpu_measured_ms"])
    assert rows[1]["cpu_measured_ms"] == pytest.approx(8.0e3)
    # Two processes, one of them on a slow core in every round: each is rescaled by its
    # own optimizer part, so both come out at their work (8 ms) at the reference speed.
    reps = [_rep_parts([[5.0, 3.0], [7.5, 4.5]], rnd) for rnd in range(3)]
    (row,) = bench._rows([(other, reps)], "parts")
    ref = np.median([3.0, 4.5] * 3)
    assert row["cpu_measured_ms"] == pytest.approx(8.0 / 3.0 * ref * 1e3)
    assert row["cpuraw_measured_ms"] == pytest.approx(12.0e3)
