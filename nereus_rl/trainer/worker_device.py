"""Where a trainer worker holds its stages, and how state crosses between host and device.

A worker is one device: host memory with ``device="cpu"`` (a gloo default group), or
one GPU with ``device="cuda"`` (``cpu:gloo,cuda:nccl``). The CPU run is the
``device="cpu"`` case of the same code: every command moves what the driver sends onto
the worker's device (:func:`on_device`) and what it returns back to host memory, and
the EMU primitives, which move their units' host memory over the runtime's gloo groups,
read host copies of a GPU worker's shards (:func:`host`). On CPU both give back the very
tensors they get, so nothing is copied.

``rl.move`` (the per-step weight sync, and the fallback reshard of a whole stage) goes
over the worker's *move transport* (:func:`move_transport`): gloo on the default group
on CPU; on GPU one :class:`~nereus_comm.transport.NcclTransport` over all the job's
workers, so the shards go device to device with no host copy.

The other worker modules call :func:`host` and :func:`on_device` through this module
(``worker_device.host``), so that tests can swap them for copying versions
(``tests/support/worker_staging.py``).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from nereus_comm.transport import GlooTransport, NcclTransport, Transport
from nereus_rl.trainer.config import DEVICE_KINDS

CPU = torch.device("cpu")


def worker_device(kind: str, rank: int) -> torch.device:
    """The device a worker of rank ``rank`` holds its stages on, for ``kind``.

    ``"cuda"``: the GPU ``LOCAL_RANK`` names (torchrun-style, for workers started by
    hand on a cluster node), else ``rank`` modulo the GPUs this process sees (workers
    spawned on one machine, one per GPU).

    Raises:
        ValueError: an unknown kind, or ``"cuda"`` where this process sees no GPU.
    """
    if kind == "cpu":
        return torch.device("cpu")
    if kind != "cuda":
        raise ValueError(f"unknown device kind {kind!r}; use one of {DEVICE_KINDS}")
    if not torch.cuda.is_available():
        raise ValueError(
            f"device='cuda' but worker {rank} sees no GPU (torch.cuda.is_available() is "
            "False); run it where one is, or use device='cpu'"
        )
    local = os.environ.get("LOCAL_RANK")
    return torch.device("cuda", (int(local) if local else rank) % torch.cuda.device_count())


def device_of(rl: dict[str, Any]) -> torch.device:
    """The device ``rl.init`` chose for this worker (host memory before it ran)."""
    return rl.get("device", CPU)


def on_device(x: Any, device: torch.device) -> Any:
    """``x`` (a tensor, or a dict or list of them and of plain values) on ``device``;
    the same objects when they are there already (every CPU run)."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return {k: on_device(v, device) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(on_device(v, device) for v in x)
    return x


def host(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Shards in host memory, for gloo: the tensors themselves when they are there (a
    CPU run moves and reads the live shards, no copy), else host copies."""
    return {k: v.cpu() for k, v in state.items()}


def move_transport(rl: dict[str, Any]) -> Transport:
    """The transport ``rl.move`` reshards over, for the worker's device.

    CPU: gloo on the default group (a new object per move costs nothing; the group is
    the connection). GPU: one :class:`NcclTransport` over every worker of the world,
    created at the first move after ``rl.init`` (every move is collective over all
    workers, so all of them create it together) and kept until the next ``rl.init``.
    A transport that broke (a peer timed out) is not rebuilt here: the peers would not
    rebuild theirs at the same moment; the run's recovery calls ``rl.init`` instead.
    """
    dev = device_of(rl)
    if dev.type == "cpu":
        return GlooTransport()
    t = rl.get("nccl_move")
    if t is None:
        store, world_size = rl["world"]
        # The store carries this init's fresh prefix, so the key is unique per world.
        t = rl["nccl_move"] = NcclTransport(
            store, rl["rank"], range(world_size), dev, key="nereus_rl/move",
            init_timeout=rl["timeout"],
        )  # fmt: skip
    return t


def drop_move_transport(rl: dict[str, Any]) -> None:
    """Abort the GPU move transport of the last world (``rl.init`` builds a new one).

    Abort, not destroy: when a worker died, a destroy could wait on it.
    """
    t = rl.pop("nccl_move", None)
    if t is not None:
        t.abort()
