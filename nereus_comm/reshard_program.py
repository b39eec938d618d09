"""What one rank's reshard derives from a plan alone, and the checks of its tensors.

Built once per (plan, rank, direct_min_bytes) and cached (plans are immutable):
the expected shard of every tensor on each side, the wire buffers of every
message (:func:`wire_groups`; direct or staged), the local copies, and the bytes
per peer. :func:`nereus_comm.reshard.reshard` binds them to tensors per call.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from nereus_comm.errors import TensorMismatchError
from nereus_comm.layout import Layout, TensorSpec, box_nbytes, box_shape, local_region
from nereus_comm.pack import unsupported_reason

__all__ = [
    "DIRECT_MIN_BYTES",
    "VERIFY_RECORD_BYTES",
    "RankProgram",
    "RowView",
    "Slot",
    "WireBuffer",
    "check_shards",
    "plan_table",
    "program",
    "rebind_destinations",
    "rebind_sources",
    "row_view",
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


class RowView(NamedTuple):
    """A non-contiguous shard seen as ``rows`` runs of ``width`` elements, ``stride`` apart.

    Its elements, in the order of a contiguous tensor of its shape, are row r's
    ``width`` elements from element ``r * stride`` of its ``data_ptr()``: the layout of
    a slice of a contiguous tensor along one dim (``full[:, a:b]``,
    ``full[:, :, a:b]``, ``full[::2]``). A Region's rows are runs of one row stride,
    so a piece of such a shard is one Region wherever its runs stay inside the view's
    rows (see :func:`rebind_sources`).
    """

    rows: int
    width: int
    stride: int

    @property
    def span(self) -> int:
        """Elements from the first to one past the last (the storage the view touches)."""
        return (self.rows - 1) * self.stride + self.width if self.rows and self.width else 0


def row_view(t: torch.Tensor) -> RowView | None:
    """The RowView of a strided tensor, or None when no single row stride describes it.

    Arguments:
        t: a dense strided tensor.

    Returns:
        (rows, width, stride): the trailing dims that are contiguous among themselves
        make one row (``width`` elements), the outer dims must step uniformly over
        those rows (``stride`` elements), rows must not overlap (no stride-0 expand).
        None otherwise, e.g. a transposed view (``full.t()``).
    """
    shape, strides = tuple(t.shape), t.stride()
    width, i = 1, len(shape) - 1
    while i >= 0 and (shape[i] == 1 or strides[i] == width):
        width *= shape[i]
        i -= 1
    if i < 0:
        return RowView(1, width, width)
    stride, rows = strides[i], shape[i]
    step = stride * shape[i]
    for j in range(i - 1, -1, -1):
        if shape[j] == 1:
            continue
        if strides[j] != step:
            return None
        rows *= shape[j]
        step *= shape[j]
    if rows > 1 and stride < width:
        return None
    return RowView(rows, width, stride)


def check_shards(
    tensors: Mapping[str, torch.Tensor],
    specs: Sequence[TensorSpec],
    expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    layout: Layout,
    rank: int,
    device_type: str,
    what: str,
    *,
    device: torch.device | None = None,
    strided: bool = False,
) -> dict[str, RowView]:
    """Raise TensorMismatchError unless `tensors` is exactly rank's shards in `layout`.

    Arguments:
        tensors: the shards by name.
        specs: the plan's specs (for the names).
        expected: (shape, dtype) by name (:attr:`RankProgram.src_expected`).
        layout: the layout the shards belong to.
        rank: this rank.
        device_type: the memory the transport moves ("cpu" or "cuda").
        what: "source" or "destination" (for the message).
        device: the transport's own device when it serves one (a CUDA index): a shard
            on another GPU of the same type is refused as well.
        strided: accept non-contiguous shards that a :class:`RowView` describes.

    Returns:
        The RowView of every non-contiguous shard (empty when all are contiguous).

    Raises:
        TensorMismatchError: a shard is missing or unknown, its bytes are not its data
            (a DTensor or other subclass, sparse, quantized, meta, ...), its shape,
            dtype or device differ from the spec's and the transport's, or it is
            not contiguous (and not describable when ``strided``). The message names
            the tensor and says what to pass instead.
    """
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
    views: dict[str, RowView] = {}
    for name, (shape, dtype) in expected.items():
        t = tensors.get(name)
        if t is None:
            raise TensorMismatchError(
                f"{what} tensor {name!r} is missing on rank {rank}: expected shape {tuple(shape)}, "
                f"{dtype} ({len(tensors)} of {len(expected)} given)"
            )
        kind = type(t)
        if (
            (kind is not torch.Tensor and kind is not torch.nn.Parameter)
            or t.layout is not torch.strided
            or t.is_quantized
            or t.is_nested
            or t.is_meta
            or t.is_conj()
            or t.is_neg()
        ):
            why = unsupported_reason(t)
            if why is not None:
                raise TensorMismatchError(f"{what} tensor {name!r} on rank {rank} {why}")
        try:
            null = t.data_ptr() == 0 and t.numel() > 0
        except RuntimeError:  # no storage at all (e.g. a functorch-wrapped tensor)
            null = True
        if null:
            why = unsupported_reason(t) or "has no data (data_ptr() is 0); pass a plain tensor"
            raise TensorMismatchError(f"{what} tensor {name!r} on rank {rank} {why}")
        if t.device.type != device_type or (
            device is not None and device.index is not None and t.device != device
        ):
            serves = device if device is not None and device.index is not None else device_type
            raise TensorMismatchError(
                f"{what} tensor {name!r} on rank {rank} is on {t.device}, but the transport "
                f"moves {serves} memory; move it there (t.to({str(serves)!r})) or use a "
                f"transport for {t.device.type} memory"
            )
        if t.shape != shape or t.dtype != dtype:
            raise TensorMismatchError(
                f"{what} tensor {name!r} on rank {rank}: expected shape {tuple(shape)}, "
                f"{dtype}, {device_type}, contiguous; got {_describe(t)}"
            )
        if not t.is_contiguous():
            view = row_view(t) if strided else None
            if view is None:
                how = (
                    "its strides are not rows of one stride (e.g. a transposed view)"
                    if strided
                    else "this check takes contiguous shards only"
                )
                raise TensorMismatchError(
                    f"{what} tensor {name!r} on rank {rank}: expected shape {tuple(shape)}, "
                    f"{dtype}, {device_type}, contiguous; got {_describe(t)} with strides "
                    f"{tuple(t.stride())}: {how}; pass t.contiguous()"
                )
            views[name] = view
    return views


def _translate(slot: Slot, view: RowView) -> Slot | None:
    """A slot of a contiguous shard, placed in a RowView of the same shape instead.

    The slot's rows (``row`` elements each, ``stride`` apart, from ``off``; logical
    element e lies at (e // width) * view.stride + e % width) are one Region there when
    each of its runs stays inside one of the view's rows and the runs step by whole
    view rows, or when it covers whole view rows back to back. None otherwise.
    """
    name, off, rows, row, stride = slot
    if rows == 0 or row == 0:
        return slot
    width, vstride = view.width, view.stride
    if rows == 1 or stride == row:
        run = rows * row
        r0, c0 = divmod(off, width)
        if c0 + run <= width:
            return (name, r0 * vstride + c0, 1, run, run)
        if c0 == 0 and run % width == 0:
            return (name, r0 * vstride, run // width, width, vstride)
        return None
    r0, c0 = divmod(off, width)
    if c0 + row <= width and stride % width == 0:
        return (name, r0 * vstride + c0, rows, row, stride // width * vstride)
    return None


def _is_run(slot: Slot) -> bool:
    _, _, rows, row, stride = slot
    return rows <= 1 or row == 0 or stride == row


def _rebind(
    buffers: tuple[WireBuffer, ...], local: tuple[Slot, ...], tensors: Mapping[str, torch.Tensor],
    views: Mapping[str, RowView], specs: Sequence[TensorSpec], rank: int, what: str,
) -> tuple[tuple[WireBuffer, ...], tuple[Slot, ...], dict[str, torch.Tensor]]:  # fmt: skip
    """``buffers`` and ``local`` slots placed in the RowViews of the shards in ``views``
    (see :func:`rebind_sources`), and the shards to bind them to."""
    bound = dict(tensors)
    for name, view in views.items():
        bound[name] = tensors[name].detach().as_strided((view.span,), (1,))

    def place(slot: Slot) -> Slot:
        view = views.get(slot[0])
        if view is None:
            return slot
        out = _translate(slot, view)
        if out is None:
            spec = next(s for s in specs if s.name == slot[0])
            t = tensors[slot[0]]
            raise TensorMismatchError(
                f"{what} tensor {slot[0]!r} on rank {rank}: a strided view (shape "
                f"{tuple(t.shape)}, strides {tuple(t.stride())}) that the plan cuts along dim "
                f"{spec.cut_dim} into pieces that cross its rows; no single strided region "
                "describes them. Pass t.contiguous()"
            )
        return out

    out = []
    for b in buffers:
        if not any(sl[0] in views for sl in b.slots):
            out.append(b)
            continue
        slots = tuple(place(sl) for sl in b.slots)
        direct = len(slots) == 1 and _is_run(slots[0])
        out.append(dataclasses.replace(b, slots=slots, direct=direct))
    return tuple(out), tuple(place(sl) for sl in local), bound


def rebind_sources(
    prog: RankProgram, tensors: Mapping[str, torch.Tensor], views: Mapping[str, RowView],
    specs: Sequence[TensorSpec], rank: int,
) -> tuple[tuple[WireBuffer, ...], tuple[Slot, ...], dict[str, torch.Tensor]]:  # fmt: skip
    """The program's sends and local-copy sources over non-contiguous source shards.

    Each slot of a shard in ``views`` is placed in the shard's RowView, and the shard
    is replaced by a contiguous 1-D view of the storage it spans (so every region is
    counted from its first element, as the pack path wants, and is bounds-checked
    against its storage). A send buffer that was one contiguous block but is strided
    in the view is staged (packed) instead of sent straight from the shard. Each
    buffer's ``runs`` stays the plan's, so both ends of a pair still count the same
    runs and pick the same route.

    Arguments:
        prog: the rank's program.
        tensors: the source shards as given (checked by :func:`check_shards`).
        views: the RowView of every non-contiguous shard.
        specs: the plan's specs (for the message).
        rank: this rank (for the message).

    Returns:
        (send buffers, local-copy sources, the shards to bind the regions to).

    Raises:
        TensorMismatchError: a piece of a shard in ``views`` is no single Region of
            its view (the plan cuts the shard across the view's rows).
    """
    return _rebind(prog.sends, prog.local_src, tensors, views, specs, rank, "source")


def rebind_destinations(
    prog: RankProgram, tensors: Mapping[str, torch.Tensor], views: Mapping[str, RowView],
    specs: Sequence[TensorSpec], rank: int,
) -> tuple[tuple[WireBuffer, ...], tuple[Slot, ...], dict[str, torch.Tensor]]:  # fmt: skip
    """The program's receives and local-copy targets over non-contiguous ``out`` shards.

    As :func:`rebind_sources`, for the destination side: a receive buffer that was
    one contiguous block but is strided in the view is received into the staging
    buffer and unpacked into the view (one copy), the others land in place. So a
    caller filling column blocks of a larger tensor passes those views as ``out`` and
    pays no copy of its own.

    Arguments:
        prog: the rank's program.
        tensors: the destination shards as given (checked by :func:`check_shards`).
        views: the RowView of every non-contiguous shard.
        specs: the plan's destination specs (for the message).
        rank: this rank (for the message).

    Returns:
        (receive buffers, local-copy targets, the shards to bind the regions to).

    Raises:
        TensorMismatchError: a piece of a shard in ``views`` is no single Region of
            its view.
    """
    return _rebind(prog.recvs, prog.local_dst, tensors, views, specs, rank, "destination")


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


class SlotColumns(NamedTuple):
    """Slots as columns (for :func:`nereus_comm.pack.columns_table`): the distinct
    tensor names, each slot's index into them, and its four sizes."""

    names: tuple[str, ...]
    which: np.ndarray
    sizes: np.ndarray
    slots: tuple[Slot, ...]


def slot_columns(slots: Sequence[Slot]) -> SlotColumns:
    """The columns of ``slots`` (a call binds them to tensors by name)."""
    index: dict[str, int] = {}
    which = [index.setdefault(sl[0], len(index)) for sl in slots]
    sizes = np.array([sl[1:] for sl in slots], dtype=np.int64).reshape(len(slots), 4)
    return SlotColumns(tuple(index), np.array(which, dtype=np.int64), sizes, tuple(slots))


@dataclass(frozen=True)
class WireBuffer:
    """One wire buffer: straight from/into a shard (direct) or a staging slice."""

    peer: int
    slots: tuple[Slot, ...]
    nbytes: int
    direct: bool
    #: contiguous runs of its pieces on this side plus on the peer's (both ends of the
    #: buffer compute the same; summed per peer into send_runs / recv_runs).
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
    #: per peer, a digest of the wire buffers between the two ranks (both directions,
    #: the lower rank's sends first): the peer computes the same from its own plan.
    pair_digests: dict[int, bytes] = field(default_factory=dict)
    #: SlotColumns of slot lists that calls bind again and again (local copies, a
    #: peer's socket-route message), by what they are: filled by :meth:`columns`.
    _columns: dict = field(default_factory=dict, compare=False, repr=False)

    def columns(self, key: object, slots: Sequence[Slot]) -> SlotColumns:
        """``slot_columns(slots)``, kept under ``key`` while the same slots come back."""
        got = self._columns.get(key)
        if got is None or got.slots != tuple(slots):
            got = self._columns[key] = slot_columns(slots)
        return got


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
    prog.pair_digests.update(_pair_digests(prog, rank))
    per_plan[key] = prog
    return prog


#: Bytes each rank sends each peer in reshard's plan check: its digest of the plan
#: and the call (16), of the pair's wire buffers (16), and the length of its plan
#: table (8, little-endian), which a mismatch then exchanges to name what differs.
VERIFY_RECORD_BYTES = 40

_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _spec_row(s: TensorSpec) -> list:
    return [s.name, list(s.shape), str(s.dtype).removeprefix("torch."), s.split_dim, s.stage_key]


def _layout_row(layout: Layout) -> dict:
    return {
        "dp": layout.dp,
        "tp": layout.tp,
        "pp": layout.pp,
        "ranks": list(layout.ranks),
        "node_of": None if layout.node_of is None else list(layout.node_of),
        "num_layers": layout.num_layers,
    }


def plan_table(plan) -> tuple[bytes, bytes]:
    """(16-byte digest, JSON table) of what every rank of ``plan`` must agree on, cached.

    The table holds every spec (name, shape, dtype, split dim, stage key; the
    destination's too where they differ), both layouts and the plan's totals: equal
    tables give equal plans. Built once per plan object (about 1 us per spec).

    Arguments:
        plan: a ReshardPlan.

    Returns:
        (blake2b-128 of the table, the table as UTF-8 JSON).
    """
    cached = _TABLES.get(plan)
    if cached is not None:
        return cached
    dst_specs = getattr(plan, "dst_specs", plan.specs)
    table = {
        "specs": [_spec_row(s) for s in plan.specs],
        "dst_specs": None if dst_specs is plan.specs else [_spec_row(s) for s in dst_specs],
        "src": _layout_row(plan.src),
        "dst": _layout_row(plan.dst),
        "plan": [plan.stats.total_bytes, plan.stats.num_messages],
    }
    raw = json.dumps(table, separators=(",", ":")).encode()
    out = (hashlib.blake2b(raw, digest_size=16).digest(), raw)
    _TABLES[plan] = out
    return out


def _pair_digests(prog: RankProgram, rank: int) -> dict[int, bytes]:
    """Per peer: blake2b-128 over the byte counts of the pair's wire buffers, both ways.

    Both ranks of a pair hash the lower rank's sends first, so agreeing plans give
    equal digests on both ends; any difference in how the bytes are cut into
    buffers (dtype sizes, direct_min_bytes, the planner itself) shows.
    """
    sizes: dict[tuple[int, bool], list[int]] = {}
    for bufs, outgoing in ((prog.sends, True), (prog.recvs, False)):
        for b in bufs:
            sizes.setdefault((b.peer, outgoing), []).append(b.nbytes)
    out = {}
    for peer in prog.peers:
        low_first = rank < peer
        first = sizes.get((peer, low_first), [])  # the lower rank's sends
        second = sizes.get((peer, not low_first), [])
        h = hashlib.blake2b(digest_size=16)
        h.update(repr((min(rank, peer), max(rank, peer), first, second)).encode())
        out[peer] = h.digest()
    return out
