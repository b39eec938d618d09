"""Worker-side switch for the trainer's GPU staging semantics, on CPU workers.

On a GPU worker (``device="cuda"``) ``nereus_rl.trainer.worker_device.host`` returns
host copies of the shards (for the weight sync, reshards and EMU primitives) and
``on_device`` copies the driver's tensors onto the device; on CPU both return the
very tensors they get. ``staging.copy`` makes them copy on CPU too, so that a CPU run
takes the GPU path's data flow: nothing may rely on a primitive or a reshard reading
the live shards. Imported on every worker
(``driver.import_module("tests.support.worker_staging")``).
"""

from __future__ import annotations

from typing import Any

import torch

import nereus_rl.trainer.worker_device as wd
from nereus_rl.runtime.context import WorkerContext, register

_REAL = {"host": wd.host, "on_device": wd.on_device}
COPIES = {"host": 0, "device": 0}


def _host_copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    COPIES["host"] += len(state)
    return {k: v.clone() for k, v in state.items()}


def _on_device_copy(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        COPIES["device"] += 1
        return x.to(device, copy=True)
    if isinstance(x, dict):
        return {k: _on_device_copy(v, device) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_on_device_copy(v, device) for v in x)
    return x


@register("staging.copy")
def copy(ctx: WorkerContext, on: bool) -> dict[str, int]:
    """Make the staging helpers copy (``on``) or restore them; returns the copies made
    since the last call and resets the counts."""
    wd.host = _host_copy if on else _REAL["host"]
    wd.on_device = _on_device_copy if on else _REAL["on_device"]
    out = dict(COPIES)
    COPIES.update(host=0, device=0)
    return out
