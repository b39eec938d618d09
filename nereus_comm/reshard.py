"""reshard(): execute a ReshardPlan on one rank.

Every rank of the source and destination layouts calls :func:`reshard` with the
same plan. Each rank:

1. validates every tensor it was handed (and every ``out`` tensor) against its
   spec and its box in the layout: name, shape, dtype, device, contiguity.
   Nothing moves before all checks pass;
2. copies the bytes it already holds and needs (the plan's local copies) with
   one :func:`~nereus_comm.pack.copy_regions` call;
3. builds the wire buffers of each message: a piece that is contiguous in both
   the sender's and the receiver's shard (and not tiny) travels on its own,
   straight from and into the tensors' storage (zero copy); the other pieces of
   the message are packed into one buffer. Both sides derive the same split
   from the plan alone, so buffers match without any extra communication;
4. exchanges every buffer in one batched transport call;
5. unpacks the packed buffers into the destination shards.

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
    "reshard",
    "shards_from_full",
    "wire_layout",
]

#: Pieces at least this large that are contiguous on both ends skip packing.
#: Smaller ones are cheaper to pack than to send as their own buffer.
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
    pack_seconds: float = 0.0
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


@dataclass(frozen=True)
class _Wire:
    """How one message travels: the packed pieces and the direct pieces, by index."""

    packed: tuple[int, ...]
    direct: tuple[int, ...]


def wire_layout(plan, message, direct_min_bytes: int = DIRECT_MIN_BYTES) -> _Wire:
    """Split a message's pieces into one packed buffer and zero-copy direct buffers.

    A piece goes direct when it has at least ``direct_min_bytes`` bytes and is one
    contiguous block in both the sender's source shard and the receiver's destination
    shard (messages of a single piece also never pack on a side where it is
    contiguous). Sender and receiver compute the same answer from the plan.

    Arguments:
        plan: the ReshardPlan.
        message: one of its Messages.
        direct_min_bytes: the size threshold.

    Returns:
        The piece indices packed (in order, one buffer, sent first) and sent direct.
    """
    packed, direct = [], []
    nl = None  # each layout carries its own num_layers
    for i, piece in enumerate(message.pieces):
        spec = plan.specs[piece.tensor]
        # local_region returns a contiguous block as a single row.
        both = (
            box_nbytes(piece.box, spec) >= max(direct_min_bytes, 1)
            and local_region(spec, plan.src, message.src, piece.box, nl)[1] <= 1
            and local_region(spec, plan.dst, message.dst, piece.box, nl)[1] <= 1
        )
        (direct if both else packed).append(i)
    return _Wire(tuple(packed), tuple(direct))


def _regions(plan, pieces, layout: Layout, rank: int, tensors) -> list[Region]:
    out = []
    for piece in pieces:
        spec = plan.specs[piece.tensor]
        off, rows, row, stride = local_region(spec, layout, rank, piece.box)
        out.append(Region(tensors[spec.name], off, rows, row, stride))
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
        direct_min_bytes: see :func:`wire_layout`.

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
    if rank != transport.rank:
        raise TransportArgumentError(
            f"reshard on rank {rank} with a transport of rank {transport.rank}"
        )
    device_type = transport.device_type
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
        _check_shards(out, specs, dst, rank, nl, device_type, "destination")
        dst_tensors = dict(out)
    else:
        device = getattr(transport, "device", None) or torch.device(device_type)
        dst_tensors = {}
        if rank in dst:
            for spec in specs:
                box = dst.box(spec, rank, nl)
                if box is not None:
                    dst_tensors[spec.name] = torch.empty(
                        box_shape(box), dtype=spec.dtype, device=device
                    )

    start = time.perf_counter()
    local = plan.local_copies(rank) if involved else []
    bytes_local = 0
    if local:
        src_regions = _regions(plan, local, src, rank, tensors)
        dst_regions = _regions(plan, local, dst, rank, dst_tensors)
        copy_regions(src_regions, dst_regions)
        bytes_local = sum(r.nbytes for r in dst_regions)

    send_bufs: list[tuple[int, torch.Tensor]] = []
    for m in sends:
        wire = wire_layout(plan, m, direct_min_bytes)
        regions = _regions(plan, m.pieces, src, rank, tensors)
        packed = [regions[i] for i in wire.packed]
        if len(packed) == 1 and is_contiguous_region(packed[0]):
            send_bufs.append((m.dst, region_view(packed[0])))
        elif packed:
            send_bufs.append((m.dst, pack(packed)))
        send_bufs.extend((m.dst, region_view(regions[i])) for i in wire.direct)

    to_unpack: list[tuple[torch.Tensor, list[Region]]] = []
    recv_bufs: list[tuple[int, torch.Tensor]] = []
    for m in recvs:
        wire = wire_layout(plan, m, direct_min_bytes)
        regions = _regions(plan, m.pieces, dst, rank, dst_tensors)
        packed = [regions[i] for i in wire.packed]
        if len(packed) == 1 and is_contiguous_region(packed[0]):
            recv_bufs.append((m.src, region_view(packed[0])))
        elif packed:
            device = packed[0].tensor.device
            buf = torch.empty(packed_nbytes(packed), dtype=torch.uint8, device=device)
            recv_bufs.append((m.src, buf))
            to_unpack.append((buf, packed))
        recv_bufs.extend((m.src, region_view(regions[i])) for i in wire.direct)
    packed_at = time.perf_counter()

    transport.exchange(send_bufs, recv_bufs, timeout=timeout)
    exchanged_at = time.perf_counter()
    for buf, regions in to_unpack:
        unpack(buf, regions)
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
