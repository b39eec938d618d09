"""What one rank's reshard derives from a plan alone, and the checks of its tensors.

Built once per (plan, rank, direct_min_bytes) and cached (plans are immutable):
the expected shard of every tensor on each side, the wire buffers of every
message (:func:`wire_groups`; direct or staged), the local copies, and the bytes
per peer. :func:`nereus_comm.reshard.reshard` binds them to tensors per call.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from nereus_comm.errors import TensorMismatchError
from nereus_comm.layout import Layout, TensorSpec, box_nbytes, box_shape, local_region

__all__ = [
    "DIRECT_MIN_BYTES",
    "RankProgram",
    "Slot",
    "WireBuffer",
    "check_shards",
    "program",
    "wire_groups",
]

#: Pieces at least this large travel as their own wire buffer; smaller ones of a
#: message share one staged buffer. Each gloo send or receive costs ~25-40 us of
#: CPU, about what copying 200-350 KiB costs: 64 MiB between two ranks as pieces
#: of 64/128/256/512/1024 KiB cost 93/84/50/44/38 ms CPU sent one buffer each,
#: 45/46/38/48/51 ms staged (both ranks; benchmarks/results/bench_reshard.md).
DIRECT_MIN_BYTES = 512 << 10


def _describe(t: torch.Tensor) -> str:
    contiguous = "" if t.is_contiguous() else ", non-contiguous"
    return f"shape {tuple(t.shape)}, {t.dtype}, {t.device.type}{contiguous}"


def _expected_shards(
    specs: Sequence[TensorSpec], layout: Layout, rank: int
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """(local shard shape, dtype) of every tensor `rank` holds in `layout`, by name."""
    expected: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    if rank in layout:
        for spec in specs:
            box = layout.box(spec, rank)
            if box is not None:
                expected[spec.name] = (torch.Size(box_shape(box)), spec.dtype)
    return expected


def check_shards(
    tensors: Mapping[str, torch.Tensor],
    specs: Sequence[TensorSpec],
    expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    layout: Layout,
    rank: int,
    device_type: str,
    what: str,
) -> None:
    """Raise TensorMismatchError unless `tensors` is exactly rank's shards in `layout`."""
    by_name = None
    if len(tensors) != len(expected) or any(name not in expected for name in tensors):
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
    for name, (shape, dtype) in expected.items():
        t = tensors.get(name)
        if t is None:
            raise TensorMismatchError(
                f"{what} tensor {name!r} is missing on rank {rank}: expected shape {tuple(shape)}, "
                f"{dtype} ({len(tensors)} of {len(expected)} given)"
            )
        if not isinstance(t, torch.Tensor):
            raise TensorMismatchError(f"{what} tensor {name!r} is a {type(t).__name__}")
        ok = (
            t.shape == shape
            and t.dtype == dtype
            and t.device.type == device_type
            and t.is_contiguous()
        )
        if not ok:
            raise TensorMismatchError(
                f"{what} tensor {name!r} on rank {rank}: expected shape {tuple(shape)}, "
                f"{dtype}, {device_type}, contiguous; got {_describe(t)}"
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


#: (tensor name, offset, num_rows, row_elems, row_stride): a Region without its
#: tensor, in elements of the tensor's dtype (see nereus_comm.pack.Region); a call
#: binds it to the tensor of that name.
Slot = tuple[str, int, int, int, int]


@dataclass(frozen=True)
class WireBuffer:
    """One wire buffer: straight from/into a shard (direct) or a staging slice."""

    peer: int
    slots: tuple[Slot, ...]
    nbytes: int
    direct: bool
    #: contiguous runs of its pieces on this side plus on the peer's (both ends of the
    #: buffer compute the same: reshard's route choice per buffer reads it).
    runs: int = 0


@dataclass(frozen=True)
class RankProgram:
    """Everything one rank's reshard derives from the plan alone, built once per
    (plan, rank, direct_min_bytes): the plan's views, the layout's box arithmetic
    and the wire grouping cost tens of ms per call on a 1,000-tensor state, the
    same on every call.

    ``local_src[i]`` and ``local_dst[i]`` are the two ends of the plan's local copy i
    on this rank (source shard, destination shard)."""

    src_expected: dict[str, tuple[torch.Size, torch.dtype]]
    dst_expected: dict[str, tuple[torch.Size, torch.dtype]]
    sends: tuple[WireBuffer, ...]
    recvs: tuple[WireBuffer, ...]
    local_src: tuple[Slot, ...]
    local_dst: tuple[Slot, ...]
    bytes_local: int
    messages_sent: int
    messages_received: int
    peers: frozenset[int]
    #: bytes per peer, for the shared-memory route (one message per peer).
    send_totals: dict[int, int]
    recv_totals: dict[int, int]
    #: contiguous runs per peer's message, counted on both of its sides (the rows a
    #: cross-memory-attach read is cut into, at most): both ends compute the same.
    send_runs: dict[int, int]
    recv_runs: dict[int, int]


def _slot(spec: TensorSpec, layout: Layout, rank: int, piece) -> Slot:
    off, rows, row, stride = local_region(spec, layout, rank, piece.box)
    return (spec.name, off, rows, row, stride)


def _runs(spec: TensorSpec, layout: Layout, rank: int, piece) -> int:
    """Contiguous runs of a piece in rank's shard (1 when it is one block)."""
    _, rows, row, stride = local_region(spec, layout, rank, piece.box)
    return 1 if rows <= 1 or stride == row else rows


def _slot_runs(slot: Slot) -> int:
    _, _, rows, row, stride = slot
    return 1 if rows <= 1 or stride == row else rows


def _slot_nbytes(slot: Slot, itemsize: int) -> int:
    return slot[2] * slot[3] * itemsize


def _wire_buffers(
    plan, specs, other_specs, messages, layout: Layout, other: Layout, rank: int,
    min_bytes: int, outgoing: bool,
):  # fmt: skip
    """The wire buffers of this rank's side of ``messages`` (``layout``, ``specs``); the
    peer's side (``other``, ``other_specs``) only counts each buffer's runs."""
    out = []
    for m in messages:
        peer = m.dst if outgoing else m.src
        for group in wire_groups(plan, m, min_bytes):
            pieces = [m.pieces[i] for i in group]
            slots = tuple(_slot(specs[p.tensor], layout, rank, p) for p in pieces)
            nbytes = sum(
                _slot_nbytes(sl, specs[p.tensor].dtype.itemsize) for sl, p in zip(slots, pieces)
            )
            runs = sum(
                _slot_runs(sl) + _runs(other_specs[p.tensor], other, peer, p)
                for sl, p in zip(slots, pieces)
            )
            _, _, rows, row, stride = slots[0]
            direct = len(slots) == 1 and (rows <= 1 or row == 0 or stride == row)
            out.append(WireBuffer(peer, slots, nbytes, direct, runs))
    return tuple(out)


_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def program(plan, rank: int, min_bytes: int = DIRECT_MIN_BYTES) -> RankProgram:
    """What ``rank``'s reshard of ``plan`` derives from the plan alone, cached.

    Plans are immutable, so the program is built once per (plan, rank, min_bytes)
    and kept as long as the plan object lives.

    Arguments:
        plan: a ReshardPlan.
        rank: the global rank (a rank in neither layout gets an empty program).
        min_bytes: the reshard's ``direct_min_bytes`` (see :func:`wire_groups`).

    Returns:
        The rank's program.
    """
    per_plan = _PROGRAMS.setdefault(plan, {})
    key = (rank, min_bytes)
    prog = per_plan.get(key)
    if prog is not None:
        return prog
    specs, src, dst = plan.specs, plan.src, plan.dst
    # The destination may place tensors on other stages (plan_reshard's dst_specs).
    dst_specs = getattr(plan, "dst_specs", specs)
    involved = rank in src or rank in dst
    sends = plan.sends(rank) if involved else []
    recvs = plan.recvs(rank) if involved else []
    local = plan.local_copies(rank) if involved else []
    local_dst = tuple(_slot(dst_specs[p.tensor], dst, rank, p) for p in local)
    prog = RankProgram(
        src_expected=_expected_shards(specs, src, rank),
        dst_expected=_expected_shards(dst_specs, dst, rank),
        sends=_wire_buffers(plan, specs, dst_specs, sends, src, dst, rank, min_bytes, True),
        recvs=_wire_buffers(plan, dst_specs, specs, recvs, dst, src, rank, min_bytes, False),
        local_src=tuple(_slot(specs[p.tensor], src, rank, p) for p in local),
        local_dst=local_dst,
        bytes_local=sum(
            _slot_nbytes(sl, dst_specs[p.tensor].dtype.itemsize) for sl, p in zip(local_dst, local)
        ),
        messages_sent=len(sends),
        messages_received=len(recvs),
        peers=frozenset(m.dst for m in sends) | frozenset(m.src for m in recvs),
        send_totals={},
        recv_totals={},
        send_runs={},
        recv_runs={},
    )
    for bufs, totals, runs in ((prog.sends, prog.send_totals, prog.send_runs),
                               (prog.recvs, prog.recv_totals, prog.recv_runs)):  # fmt: skip
        for b in bufs:
            totals[b.peer] = totals.get(b.peer, 0) + b.nbytes
            runs[b.peer] = runs.get(b.peer, 0) + b.runs
    per_plan[key] = prog
    return prog
