"""A worker process started by hand that joins a running job (``--store``), for tests."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start_joiner(address: str, module: str = "nereus_rl.cli") -> subprocess.Popen:
    """Start ``python -m <module> [worker] --store ADDRESS`` from the repository root.

    ``nereus_rl.cli`` runs it as a user would (``nereus-rl worker``);
    ``nereus_rl.runtime.worker`` is the worker's own entry point.
    """
    cmd = [sys.executable, "-m", module]
    if module == "nereus_rl.cli":
        cmd.append("worker")
    cmd += ["--store", address]
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"})


def reap(proc: subprocess.Popen | None) -> None:
    """Wait for a joiner to exit (its driver shut down), killing it after 10 s."""
    if proc is None:
        return
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
