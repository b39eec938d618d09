"""How EMU moves state: nereus_comm's planner and reshard over a runtime gloo group.

Runtime workers do not share a torch.distributed default group (workers join
and leave while the job runs); each group is a standalone ProcessGroupGloo
that the driver names by id (``WorkerContext.group``).
``GlooTransport(pg, ranks, rank)`` runs over such a group, so
``nereus_comm.reshard`` runs unchanged on it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import torch

from nereus_comm.layout import Layout, TensorSpec
from nereus_comm.plan import plan_reshard
from nereus_comm.remap import local_page_moves
from nereus_comm.reshard import (
    DIRECT_MIN_BYTES,
    ReshardResult,
    Workspace,
    prepare_reshard,
    reshard,
)
from nereus_comm.transport import Liveness, Transport

__all__ = [
    "PLAN_CACHE_SIZE",
    "Layout",
    "TensorSpec",
    "box_slices",
    "cached_plan",
    "move_state",
]

#: Plans kept per process (least recently used dropped first). A job moves between a
#: few layouts again and again (a Split and the Merge back, each stage's extends), and
#: a plan's per-rank program (nereus_comm.reshard.prepare_reshard, kept per plan object)
#: costs ~12 ms of CPU per rank on bench_extend's 119-tensor state, ~10% of a Split.
PLAN_CACHE_SIZE = 16
_PLANS: OrderedDict = OrderedDict()
_PLANS_LOCK = threading.Lock()


def cached_plan(specs: Sequence[TensorSpec], src: Layout, dst: Layout):
    """plan_reshard(specs, src, dst), the same plan object for equal arguments.

    Plans are immutable and depend on their arguments alone (every rank computes the
    same one), so a cached plan is the plan; keeping the object also keeps its
    per-rank programs cached.
    """
    key = (tuple(specs), src, dst)
    with _PLANS_LOCK:
        plan = _PLANS.get(key)
        if plan is not None:
            _PLANS.move_to_end(key)
            return plan
    plan = plan_reshard(specs, src, dst)
    with _PLANS_LOCK:
        _PLANS[key] = plan
        while len(_PLANS) > PLAN_CACHE_SIZE:
            _PLANS.popitem(last=False)
    return plan


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
    consume_sources: bool = False,
    liveness: Liveness | None = None,
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
        consume_sources: ``tensors`` are this rank's to give up (a Split or Merge drops
            them after): with ``out`` in host memory, the local copies that can be page
            moves instead (:func:`nereus_comm.remap.local_page_moves`) are left out of
            the exchange and returned as ``"moves"``; the caller makes them
            (:func:`nereus_comm.remap.move_ranges`) after this returns (every peer is
            done reading the sources then), before anything reads ``out``, and swaps
            them back should the primitive fail.
        liveness: the ranks known dead (nereus_comm's ``Liveness``): a transfer waiting
            on one raises PeerLostError at once, on every route.

    Returns:
        (nereus_comm's ReshardResult, {"plan_s" (the plan and this rank's program of
        it; ~0 when cached), "bytes_packed", "bytes_direct",
        "moves", "bytes_remapped"}), bytes counted on the sending side; "moves" the
        (source address, destination address, bytes) still to move, "bytes_remapped"
        their bytes.
    """
    t0 = time.perf_counter()
    plan = cached_plan(specs, src, dst)
    same = (src.tp, src.pp) == (dst.tp, dst.pp)
    direct_min_bytes = 1 if same else DIRECT_MIN_BYTES
    prepare_reshard(plan, rank, direct_min_bytes=direct_min_bytes)  # counted as planning
    plan_s = time.perf_counter() - t0
    pairs, done = [], frozenset()
    if consume_sources and out:
        pairs, done = local_page_moves(plan, rank, tensors, out, direct_min_bytes=direct_min_bytes)
    result = reshard(
        plan,
        rank,
        tensors,
        transport,
        timeout=timeout,
        direct_min_bytes=direct_min_bytes,
        workspace=workspace,
        out=out,
        local_done=done,
        liveness=liveness,
        # every rank derives the plan from the manager's one description of the move
        verify_plan=False,
    )
    packed = result.staged_bytes_sent
    return result, {
        "plan_s": plan_s,
        "bytes_packed": packed,
        "bytes_direct": result.bytes_sent - packed,
        "moves": pairs,
        "bytes_remapped": sum(n for _, _, n in pairs),
    }
