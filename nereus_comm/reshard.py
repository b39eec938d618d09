"""reshard(): execute a ReshardPlan on one rank.

Every rank of the source and destination layouts calls :func:`reshard` with the
same plan. Each rank:

1. validates every tensor it was handed (and every ``out`` tensor) against its
   spec and its box in the layout: name, shape, dtype, device, contiguity.
   Nothing moves before all checks pass;
2. builds the wire buffers of each message (:func:`wire_groups`): every piece
   of at least 64 KiB travels as its own buffer, the smaller ones share one.
   A buffer that is one contiguous block of a shard is sent from, or received
   into, the shard's own storage (zero copy); the others go through one
   staging buffer, filled by a single :func:`~nereus_comm.pack.pack` call.
   So a piece is copied only on a side where it is strided. Both sides derive
   the same buffers from the plan alone: no extra communication;
3. posts every buffer in one batched transport call and, while the bytes
   travel, copies the bytes it already holds and needs (the plan's local
   copies) with one :func:`~nereus_comm.pack.copy_regions` call;
4. drains the receive staging buffer with a single
   :func:`~nereus_comm.pack.unpack` call.

Example::

    plan = plan_reshard(specs, src_layout, dst_layout)
    result = reshard(plan, rank, my_src_shards, GlooTransport())
    result.tensors            # my destination shards, keyed by spec name
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from nereus_comm.errors import TensorMismatchError
from nereus_comm.layout import Layout, TensorSpec, box_nbytes, box_shape, local_region
from nereus_comm.pack import (
    Region,
    copy_regions,
    is_contiguous_region,
    pack,
    packed_nbytes,
    region_view,
    unpack,
)
from nereus_comm.transport import Transport

__all__ = [
    "DIRECT_MIN_BYTES",
    "ReshardResult",
    "Workspace",
    "reshard",
    "shards_from_full",
    "wire_groups",
]

#: Pieces at least this large travel as their own wire buffer; smaller ones of a
#: message share one (a buffer costs a handshake, a small copy costs less).
DIRECT_MIN_BYTES = 64 * 1024


@dataclass(frozen=True)
class ReshardResult:
    """What one rank's reshard produced and measured.

    ``tensors`` are the rank's destination shards by spec name (empty when the rank
    is not in the destination layout). Seconds are wall-clock on this rank, from the
    end of validation to the end of unpacking (device work included).
    """

    tensors: dict[str, torch.Tensor] = field(repr=False)
    seconds: float
    bytes_sent: int
    bytes_received: int
    bytes_local: int
    messages_sent: int
    messages_received: int
    buffers_sent: int
    buffers_received: int
    staged_bytes_sent: int = 0
    staged_bytes_received: int = 0
    pack_seconds: float = 0.0
    #: posting, local copies and waiting for the transfers.
    exchange_seconds: float = 0.0
    unpack_seconds: float = 0.0

    def __repr__(self) -> str:
        return (
            f"ReshardResult({len(self.tensors)} tensors, {self.seconds * 1e3:.1f} ms, "
            f"sent {self.bytes_sent} B in {self.messages_sent} msgs/{self.buffers_sent} bufs, "
            f"received {self.bytes_received} B, local {self.bytes_local} B)"
        )


def _describe(t: torch.Tensor) -> str:
    contiguous = "" if t.is_contiguous() else ", non-contiguous"
    return f"shape {tuple(t.shape)}, {t.dtype}, {t.device.type}{contiguous}"


def _check_shards(
    tensors: Mapping[str, torch.Tensor],
    specs: Sequence[TensorSpec],
    layout: Layout,
    rank: int,
    num_layers: int | None,
    device_type: str,
    what: str,
) -> None:
    """Raise TensorMismatchError unless `tensors` is exactly rank's shards in `layout`."""
    expected: dict[str, tuple[int, ...]] = {}
    if rank in layout:
        for spec in specs:
            box = layout.box(spec, rank, num_layers)
            if box is not None:
                expected[spec.name] = box_shape(box)
    by_name = {s.name: s for s in specs}
    for name in tensors:
        if name not in expected:
            why = (
                "is not a tensor of the plan"
                if name not in by_name
                else f"is not held by rank {rank} in the {what} layout {layout!r}"
            )
            raise TensorMismatchError(
                f"{what} tensor {name!r} {why}; pass exactly the rank's {what} shards"
            )
    for name, shape in expected.items():
        if name not in tensors:
            raise TensorMismatchError(
                f"{what} tensor {name!r} is missing on rank {rank}: expected shape {shape}, "
                f"{by_name[name].dtype} ({len(tensors)} of {len(expected)} given)"
            )
        t = tensors[name]
        spec = by_name[name]
        if not isinstance(t, torch.Tensor):
            raise TensorMismatchError(f"{what} tensor {name!r} is a {type(t).__name__}")
        ok = (
            tuple(t.shape) == shape
            and t.dtype == spec.dtype
            and t.device.type == device_type
            and t.is_contiguous()
        )
        if not ok:
            raise TensorMismatchError(
                f"{what} tensor {name!r} on rank {rank}: expected shape {shape}, {spec.dtype}, "
                f"{device_type}, contiguous; got {_describe(t)}"
            )


def wire_groups(plan, message, min_bytes: int = DIRECT_MIN_BYTES) -> list[tuple[int, ...]]:
    """Split a message's pieces into the buffers that carry them on the wire.

    Every piece of at least ``min_bytes`` bytes travels as its own buffer; the
    smaller ones share one buffer, which comes first. Each side then moves a
    buffer straight from or into the tensor's storage when it is one contiguous
    block there (zero copy), and through a staging buffer otherwise, so a piece is
    copied only on the side where it is strided. Sender and receiver derive the
    same groups from the plan alone.

    Arguments:
        plan: the ReshardPlan.
        message: one of its Messages.
        min_bytes: the size from which a piece gets its own buffer.

    Returns:
        Tuples of piece indices, one per buffer, in wire order (empty pieces left out).
    """
    small, large = [], []
    for i, piece in enumerate(message.pieces):
        nbytes = box_nbytes(piece.box, plan.specs[piece.tensor])
        if nbytes >= min_bytes:
            large.append((i,))
        elif nbytes:
            small.append(i)
    return ([tuple(small)] if small else []) + large


def _regions(specs, pieces, layout: Layout, rank: int, tensors) -> list[Region]:
    out = []
    for piece in pieces:
        spec = specs[piece.tensor]
        off, rows, row, stride = local_region(spec, layout, rank, piece.box)
        out.append(Region(tensors[spec.name], off, rows, row, stride))
    return out


class Workspace:
    """Staging buffers that successive reshards reuse (no fresh pages per call).

    Grows to the largest staging need seen; one per process and device is plenty.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, kind: str, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of exactly nbytes, backed by the cached buffer for kind."""
        buf = self._buffers.get(kind)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._buffers[kind] = buf
        return buf[:nbytes]


def _buffer_plan(plan, specs, messages, layout: Layout, rank, tensors, min_bytes, *, outgoing):
    """(peer, view or None, staged regions or None) per wire buffer of the messages."""
    out = []
    for m in messages:
        peer = m.dst if outgoing else m.src
        regions = _regions(specs, m.pieces, layout, rank, tensors)
        for group in wire_groups(plan, m, min_bytes):
            rs = [regions[i] for i in group]
            if len(rs) == 1 and is_contiguous_region(rs[0]):
                out.append((peer, region_view(rs[0]), None))
            else:
                out.append((peer, None, rs))
    return out


def _stage(regions, workspace: Workspace | None, kind: str, device_type: str) -> torch.Tensor:
    nbytes = packed_nbytes(regions) if regions else 0
    if workspace is not None:
        return workspace.get(kind, nbytes)
    device = regions[0].tensor.device if regions else torch.device(device_type)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _buffers(buffer_plan, stage: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """The wire buffers: views, or consecutive slices of the staging buffer."""
    out, at = [], 0
    for peer, view, regions in buffer_plan:
        if view is None:
            n = sum(r.nbytes for r in regions)
            view = stage[at : at + n]
            at += n
        out.append((peer, view))
    return out


def reshard(
    plan,
    rank: int,
    tensors: Mapping[str, torch.Tensor],
    transport: Transport,
    *,
    out: Mapping[str, torch.Tensor] | None = None,
    timeout: float = 60.0,
    direct_min_bytes: int = DIRECT_MIN_BYTES,
    workspace: Workspace | None = None,
) -> ReshardResult:
    """Move this rank's part of a reshard: local copies, pack, one batched exchange, unpack.

    Arguments:
        plan: the ReshardPlan (the same on every rank).
        rank: this process's global rank (must be the transport's).
        tensors: this rank's source shards by spec name (empty if not in plan.src).
        transport: moves the bytes (GlooTransport for host memory, NcclTransport for
            device memory); must reach every peer of this rank in the plan.
        out: preallocated destination shards by spec name (default: allocated here).
        timeout: seconds for the exchange.
        direct_min_bytes: pieces from this size travel as their own buffer (see
            :func:`wire_groups`).
        workspace: reuse its staging buffers (default: allocate per call). It must be
            on the transport's device.

    Returns:
        The destination shards and what was measured.

    Raises:
        TensorMismatchError: a tensor is missing, unknown, or differs from its spec
            (shape vs its box, dtype, device, contiguity); raised before any byte moves.
        TransportArgumentError: rank is not the transport's or a peer is unreachable;
            raised before any byte moves.
        PeerTimeoutError: a peer did not complete within ``timeout`` (names the peer).
    """
    from nereus_comm.transport import TransportArgumentError

    # The plan resolved num_layers into each layout (src and dst may differ): nl=None
    # makes every box query use the layout's own.
    specs, src, dst, nl = plan.specs, plan.src, plan.dst, None
    # The destination may place tensors on other stages (plan_reshard's dst_specs).
    dst_specs = getattr(plan, "dst_specs", specs)
    if rank != transport.rank:
        raise TransportArgumentError(
            f"reshard on rank {rank} with a transport of rank {transport.rank}"
        )
    device_type = transport.device_type
    if workspace is not None and workspace.device.type != device_type:
        raise TransportArgumentError(
            f"the workspace holds {workspace.device} memory but {transport!r} moves "
            f"{device_type} memory; use Workspace({device_type!r})"
        )
    _check_shards(tensors, specs, src, rank, nl, device_type, "source")
    involved = rank in src or rank in dst
    sends = plan.sends(rank) if involved else []
    recvs = plan.recvs(rank) if involved else []
    reachable = set(transport.ranks)
    for m in (*sends, *recvs):
        peer = m.dst if m.src == rank else m.src
        if peer not in reachable:
            raise TransportArgumentError(
                f"rank {rank} exchanges with rank {peer}, which {transport!r} cannot reach"
            )
    if out is not None:
        _check_shards(out, dst_specs, dst, rank, nl, device_type, "destination")
        dst_tensors = dict(out)
    else:
        device = getattr(transport, "device", None) or torch.device(device_type)
        dst_tensors = {}
        if rank in dst:
            for spec in dst_specs:
                box = dst.box(spec, rank, nl)
                if box is not None:
                    dst_tensors[spec.name] = torch.empty(
                        box_shape(box), dtype=spec.dtype, device=device
                    )

    start = time.perf_counter()
    # One buffer per wire group: a view of the tensor where the group is one
    # contiguous block on this side, else a slice of one staging buffer that a
    # single pack (before) or unpack (after the exchange) call fills or drains.
    send_plan = _buffer_plan(
        plan, specs, sends, src, rank, tensors, direct_min_bytes, outgoing=True
    )
    recv_plan = _buffer_plan(
        plan, dst_specs, recvs, dst, rank, dst_tensors, direct_min_bytes, outgoing=False
    )
    send_staged = [r for _, _, regions in send_plan if regions is not None for r in regions]
    recv_staged = [r for _, _, regions in recv_plan if regions is not None for r in regions]
    send_stage = _stage(send_staged, workspace, "send", device_type)
    if send_staged:
        pack(send_staged, out=send_stage)
    recv_stage = _stage(recv_staged, workspace, "recv", device_type)
    send_bufs = _buffers(send_plan, send_stage)
    recv_bufs = _buffers(recv_plan, recv_stage)
    packed_at = time.perf_counter()

    # The local copies run while the bytes are on the wire.
    pending = transport.start(send_bufs, recv_bufs, timeout=timeout)
    local = plan.local_copies(rank) if involved else []
    bytes_local = 0
    if local:
        src_regions = _regions(specs, local, src, rank, tensors)
        dst_regions = _regions(dst_specs, local, dst, rank, dst_tensors)
        copy_regions(src_regions, dst_regions)
        bytes_local = sum(r.nbytes for r in dst_regions)
    pending.wait()
    exchanged_at = time.perf_counter()
    if recv_staged:
        unpack(recv_stage, recv_staged)
    if device_type == "cuda":
        torch.cuda.synchronize()
    end = time.perf_counter()

    return ReshardResult(
        tensors=dst_tensors,
        seconds=end - start,
        bytes_sent=sum(t.nbytes for _, t in send_bufs),
        bytes_received=sum(t.nbytes for _, t in recv_bufs),
        bytes_local=bytes_local,
        messages_sent=len(sends),
        messages_received=len(recvs),
        buffers_sent=sum(1 for _, t in send_bufs if t.nbytes),
        buffers_received=sum(1 for _, t in recv_bufs if t.nbytes),
        staged_bytes_sent=send_stage.nbytes,
        staged_bytes_received=recv_stage.nbytes,
        pack_seconds=packed_at - start,
        exchange_seconds=exchanged_at - packed_at,
        unpack_seconds=end - exchanged_at,
    )


def shards_from_full(
    full: Mapping[str, torch.Tensor],
    specs: Sequence[TensorSpec],
    layout: Layout,
    rank: int,
    num_layers: int | None = None,
) -> dict[str, torch.Tensor]:
    """Cut a rank's shards out of full tensors by slicing (the reference for tests).

    Arguments:
        full: the full tensor of every spec, by name.
        specs: the specs.
        layout: the layout to cut for.
        rank: the rank (an empty dict if it is not in the layout).
        num_layers: overrides layout.num_layers.

    Returns:
        Fresh contiguous copies of the rank's boxes, by spec name.
    """
    if rank not in layout:
        return {}
    out = {}
    for spec in specs:
        box = layout.box(spec, rank, num_layers)
        if box is not None:
            out[spec.name] = full[spec.name][tuple(slice(a, b) for a, b in box)].clone()
    return out
