"""The examples run as a user runs them (a subprocess from the repository root) and exit 0:
each checks every byte it moves against its own reference and exits non-zero otherwise.
The DTensor example's framework glue stays within 10 lines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _run(name: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.slow
def test_torchtitan_fsdp_tp_join() -> None:
    out = _run("torchtitan_fsdp_tp_join.py")
    assert "every byte of every parameter and Adam moment on every new rank: equal" in out
    assert "_StridedShard" in out  # fully_shard on tensor-parallel weights made them


@pytest.mark.slow
def test_megatron_tp_to_pp() -> None:
    out = _run("megatron_tp_to_pp.py")
    assert "equal to Megatron's TP2 cut" in out
    assert "query groups cannot be split evenly over tp=8" in out


@pytest.mark.slow
def test_verl_weight_sync() -> None:
    out = _run("verl_weight_sync.py")
    assert "every byte of every fused rollout buffer, every step, on every rank: equal" in out


def test_dtensor_glue_is_at_most_10_lines() -> None:
    lines = (EXAMPLES / "torchtitan_fsdp_tp_join.py").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "# glue begins")
    end = next(i for i, line in enumerate(lines) if line.strip() == "# glue ends")
    glue = [line for line in lines[start + 1 : end] if line.strip()]
    assert 0 < len(glue) <= 10, glue
    assert any("reshard_dtensors(" in line for line in glue)
