"""`nereus-rl train --quick`, the README's main-job command in its CI form, end to end; and
the checks of the command's arguments, which run before anything starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nereus_rl import cli
from nereus_rl.cli import MAX_WORKERS_PER_CORE, _is_loopback, build_parser, check_args, main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # multi-process: out of the fast lane (-m "not slow")
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
    out, err = capsys.readouterr()
    assert "unknown algorithm 'dpo'" in err and "grpo" in err
    assert out == ""  # checked before the banner


def test_resume_from_what_is_not_a_checkpoint_is_a_one_line_error(tmp_path, capsys):
    missing = tmp_path / "checkpoint.pt"
    assert main(["train", "--resume", str(missing), "--steps", "4"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert f"resume={str(missing)!r} is not a file" in err and "Traceback" not in err


def test_run_dir_that_is_a_file_is_a_one_line_error(tmp_path, capsys):
    path = tmp_path / "a_file"
    path.write_text("x")
    for run_dir, why in ((path, "is a file, not a folder"), (path / "sub", "is a file")):
        assert main(["train", "--run-dir", str(run_dir), "--steps", "1"]) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.strip().splitlines()) == 1
        assert why in err and str(path) in err and "Traceback" not in err


def test_run_dir_that_is_not_writable_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.geteuid() == 0:  # root writes any folder: let access() answer as for a user
        access = os.access
        monkeypatch.setattr(os, "access", lambda p, m: p != locked and access(p, m))
    try:
        assert main(["train", "--run-dir", str(locked), "--steps", "1"]) == 2
        assert main(["train", "--run-dir", str(locked / "run"), "--steps", "1"]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("not writable") == 2
    finally:
        locked.chmod(0o700)


def test_more_local_workers_than_the_machine_holds_is_refused(capsys):
    limit = MAX_WORKERS_PER_CORE * (os.cpu_count() or 1)
    assert main(["train", "--devices", str(limit + 1), "--steps", "1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "--allow-oversubscribe" in err and f"({limit})" in err
    # Explicitly allowed; and workers on other machines do not count against this one.
    for extra in (["--allow-oversubscribe"], ["--local-workers", "1"]):
        check_args(build_parser().parse_args(["train", "--devices", str(limit + 1), *extra]))
    check_args(build_parser().parse_args(["train", "--devices", str(limit)]))


def test_bad_worker_and_port_figures_are_clear_errors(capsys):
    for argv, why in (
        (["--local-workers", "5"], "--local-workers 5 must be between 0 and --devices (4)"),
        (["--port", "70000"], "--port 70000 is not a port"),
        (["--join-timeout", "0"], "--join-timeout 0 must be positive"),
    ):
        assert main(["train", *argv]) == 2
        out, err = capsys.readouterr()
        assert out == "" and why in err


def test_help_says_what_an_exposed_address_means(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "disrupt the job" in out and "run code on its workers" in out
    assert "0.0.0.0" not in out and "0.0.0.0" not in cli.__doc__


def test_a_host_of_its_own_makes_the_store_listen_there(monkeypatch, capsys):
    # --host without --port used to be ignored (the trainer made its own store on the
    # default address). A stand-in Driver records where it was asked to listen and stops.
    import nereus_rl.runtime as runtime

    seen = []

    class Stop(ValueError):
        pass

    def fake_driver(host, port, **kwargs):
        seen.append((host, port))
        raise Stop("stand-in driver: stop here")

    monkeypatch.setattr(runtime, "Driver", fake_driver)
    assert main(["train", "--host", "127.0.0.2", "--quick"]) == 2
    assert seen == [("127.0.0.2", 0)]
    assert "stand-in driver" in capsys.readouterr().err


def test_loopback_addresses():
    assert _is_loopback("127.0.0.1") and _is_loopback("::1") and _is_loopback("localhost")
    assert not _is_loopback("0.0.0.0") and not _is_loopback("10.1.2.3")


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
