"""A worker process started by hand that joins a running job (``--store``), for tests."""

from __future__ import annotations

import os
import subprocess
import sys

from nereus_rl.runtime.protocol import SECRET_ENV, secret_file_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: ``secret_file`` value for a joiner started without any secret.
NO_SECRET = ""


def start_joiner(
    address: str, module: str = "nereus_rl.cli", *, secret_file: str | None = None
) -> subprocess.Popen:
    """Start ``python -m <module> [worker] --store ADDRESS --secret-file PATH`` from the root.

    ``nereus_rl.cli`` runs it as a user would (``nereus-rl worker``);
    ``nereus_rl.runtime.worker`` is the worker's own entry point. ``secret_file``
    defaults to the file the job's driver wrote (as an operator on the driver's machine
    would pass it); :data:`NO_SECRET` starts the joiner without one.
    """
    host, _, port = address.rpartition(":")
    if secret_file is None:
        secret_file = str(secret_file_for(host, int(port)))
    cmd = [sys.executable, "-m", module]
    if module == "nereus_rl.cli":
        cmd.append("worker")
    cmd += ["--store", address]
    if secret_file:
        cmd += ["--secret-file", secret_file]
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    return subprocess.Popen(cmd, cwd=ROOT, env={**env, "TORCH_CPP_LOG_LEVEL": "ERROR"})


def reap(proc: subprocess.Popen | None) -> None:
    """Wait for a joiner to exit (its driver shut down), killing it after 10 s."""
    if proc is None:
        return
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
