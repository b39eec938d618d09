"""bench_interop: the lower bound it counts by index sets and the 8B plan (fast), and
(slow) one ``--quick`` run at a tiny state, its JSON rows checked."""

from __future__ import annotations

import glob
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.bench_interop import MiB, lower_bound_bytes, plan_8b, plan_bytes

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("case", ["a", "b", "c"])
def test_plan_sends_the_lower_bound(case) -> None:
    sent, bound = plan_bytes(case, 2 * MiB)
    assert sent == bound == lower_bound_bytes(case, 2 * MiB) > 0


def test_the_8b_plan_sends_the_lower_bound() -> None:
    got = plan_8b(repeats=1)
    assert got["tensors"] == 4 * (1 + 32 * 9)
    assert got["bytes_sent"] == got["lower_bound_bytes"] > 0 and got["remote_pieces"] > 0


@pytest.mark.slow
def test_quick_run_at_a_tiny_state(tmp_path) -> None:
    before = set(glob.glob("/dev/shm/nereus_bench_interop_*"))
    out = tmp_path / "interop.json"
    cmd = [sys.executable, "benchmarks/bench_interop.py", "--quick", "--mib", "2"]
    cmd += ["--repeats", "1", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["case"] for r in rows] == ["a", "b", "c"]
    for r in rows:
        assert r["bytes_sent"] == r["lower_bound_bytes"] == r["plan_lower_bound_bytes"]
        assert r["nereus_s"] > 0 and r["dcp_s"] > 0 and r["speedup_vs_dcp_x"] > 0
    assert rows[0]["redistribute_s"] > 0 and rows[2]["redistribute_s"] is None
    assert "(a) TP2 x DP2 -> TP4" in proc.stdout
    assert set(glob.glob("/dev/shm/nereus_bench_interop_*")) == before  # cleaned up
