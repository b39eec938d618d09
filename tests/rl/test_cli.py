"""`nereus-rl train --quick`, the README's main-job command in its CI form, end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nereus_rl.cli import build_parser, main

# Multi-process: out of the fast lane (-m "not slow").
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_train_quick_end_to_end(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = tmp_path / "run"
    # Generous: the quick run takes about a minute on a quiet 2-core box, but several
    # minutes when the box is shared; the bound only turns a hang into a failure.
    proc = subprocess.run(
        [sys.executable, "-m", "nereus_rl.cli", "train", "--quick", "--run-dir", str(run)],
        capture_output=True, text=True, timeout=290, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "reward (last quarter)" in proc.stdout and "plans:" in proc.stdout
    for name in ("metrics.jsonl", "decisions.jsonl", "plans.jsonl", "summary.txt",
                 "latency_plan.png", "reward_kl.png", "config.json"):  # fmt: skip
        assert (run / name).exists(), name
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 8
    decisions = [json.loads(x) for x in (run / "decisions.jsonl").read_text().splitlines()]
    assert any(d["taken"] for d in decisions), "the default run must make a transition: " + str(
        [(d["step"], d.get("signal"), d.get("reason")) for d in decisions]
    )


def test_bad_algorithm_is_a_clear_message(capsys):
    assert main(["train", "--algo", "dpo", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "unknown algorithm 'dpo'" in err and "grpo" in err


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "train" in out and "worker" in out


def test_parser_defaults():
    args = build_parser().parse_args(["train"])
    assert (args.algo, args.model, args.task, args.devices) == ("grpo", "tiny", "sort", 4)
    assert not args.no_adapt
    with pytest.raises(SystemExit):
        build_parser().parse_args(["frobnicate"])
