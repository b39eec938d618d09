"""How EMU moves state: nereus_comm's planner and reshard over a runtime gloo group.

Runtime workers do not share a torch.distributed default group (workers join
and leave while the job runs); each group is a standalone ProcessGroupGloo
that the driver names by id (``WorkerContext.group``).
``GlooTransport(pg, ranks, rank)`` runs over such a group, so
``nereus_comm.reshard`` runs unchanged on it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch

from nereus_comm.layout import Layout, TensorSpec
from nereus_comm.plan import plan_reshard
from nereus_comm.reshard import DIRECT_MIN_BYTES, ReshardResult, Workspace, reshard
from nereus_comm.transport import Transport

__all__ = [
    "Layout",
    "TensorSpec",
    "box_slices",
    "move_state",
]


def box_slices(
    box: tuple[tuple[int, int], ...], origin: tuple[tuple[int, int], ...]
) -> tuple[slice, ...]:
    """Slices selecting global ``box`` inside a local shard whose global box is ``origin``."""
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, origin))


def move_state(
    specs: Sequence[TensorSpec],
    src: Layout,
    dst: Layout,
    rank: int,
    tensors: Mapping[str, torch.Tensor],
    transport: Transport,
    *,
    timeout: float,
    workspace: Workspace | None = None,
    out: Mapping[str, torch.Tensor] | None = None,
) -> tuple[ReshardResult, dict[str, float]]:
    """This rank's part of moving a stage's state from layout src to layout dst.

    When the two layouts have the same (tp, pp), every piece is a whole shard on
    both ends and travels as its own buffer straight from the source tensor into
    the new one (zero copy); otherwise small pieces share a staged buffer per
    message (nereus_comm's default).

    Arguments:
        specs: the stage's tensors.
        src, dst: the layouts (each with num_layers set).
        rank: this rank.
        tensors: this rank's src shards (empty if not in src).
        transport: a transport reaching every rank of src and dst.
        timeout: seconds the exchange may take.
        workspace: staging buffers to reuse across calls.
        out: this rank's dst shards to write into (e.g. carved from the worker's
            arena); default: allocated by reshard.

    Returns:
        (nereus_comm's ReshardResult, {"plan_s", "bytes_packed", "bytes_direct"}),
        bytes counted on the sending side.
    """
    t0 = time.perf_counter()
    plan = plan_reshard(specs, src, dst)
    plan_s = time.perf_counter() - t0
    same = (src.tp, src.pp) == (dst.tp, dst.pp)
    result = reshard(
        plan,
        rank,
        tensors,
        transport,
        timeout=timeout,
        direct_min_bytes=1 if same else DIRECT_MIN_BYTES,
        workspace=workspace,
        out=out,
    )
    packed = result.staged_bytes_sent
    return result, {
        "plan_s": plan_s,
        "bytes_packed": packed,
        "bytes_direct": result.bytes_sent - packed,
    }
