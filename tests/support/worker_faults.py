"""Worker-side fault injection for the recovery tests.

Imported on one worker only (``driver.call([rank], "import", "tests.support.worker_faults")``):
``faults.die_after`` arms that worker to SIGKILL itself right after it ran a
command (whose keyword arguments match), before it replies. Its peers finish the
command's collectives with it, so the survivors' state is whatever the command
left, and only the driver sees the death, at a chosen point and without waiting
out a group timeout. ``faults.die_before`` kills it as the command starts instead,
so its peers meet the death inside the command's collectives.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from nereus_rl.runtime.context import COMMANDS, WorkerContext, register


@register("faults.die_after")
def die_after(ctx: WorkerContext, fn: str, match: dict[str, Any] | None = None) -> None:
    """Die after the next run of command ``fn`` whose kwargs include ``match``."""
    real = COMMANDS[fn]

    def wrapped(c: WorkerContext, *args: Any, **kwargs: Any) -> Any:
        out = real(c, *args, **kwargs)
        if all(kwargs.get(k) == v for k, v in (match or {}).items()):
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    COMMANDS[fn] = wrapped


@register("faults.die_before")
def die_before(ctx: WorkerContext, fn: str, match: dict[str, Any] | None = None) -> None:
    """Die as the next run of command ``fn`` whose kwargs include ``match`` starts."""
    real = COMMANDS[fn]

    def wrapped(c: WorkerContext, *args: Any, **kwargs: Any) -> Any:
        if all(kwargs.get(k) == v for k, v in (match or {}).items()):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(c, *args, **kwargs)

    COMMANDS[fn] = wrapped
