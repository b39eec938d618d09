"""Reshard plans: which box of which tensor goes from which rank to which.

`plan_reshard(specs, src, dst)` asks the C++ planner (csrc/remap) for a
compact plan and wraps it in a `ReshardPlan` whose per-rank views
(`local_copies`, `sends`, `recvs`) are built lazily. Rules the planner keeps:

- a byte the destination rank already holds in `src` is copied locally,
  never sent; every other byte it needs is received exactly once, so the
  bytes sent equal the lower bound (what the destination lacks);
- among the source replicas of a byte (dp copies, tp-replicated tensors,
  tensors on every pipeline stage) sources are chosen to balance bytes sent
  per source rank: the holders are filled to a common level, each receiver's
  block handed out front to back in contiguous shares (cut inside a tensor
  along its `TensorSpec.cut_dim` where needed, never below 256 KiB), first
  from holders already sending to the receiver (saves a message), then from
  holders on its node (saves cross-node bytes), then from any holder;
- all pieces between two ranks form one `Message`, the same on both sides.

Every rank computes the same plan independently: no communication.
tests/support/reference_planner.py states the source-choice rules in plain Python.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from nereus_comm import _C
from nereus_comm.errors import LayoutError, PlanError, as_int
from nereus_comm.layout import Box, Layout, TensorSpec, infer_num_layers

__all__ = [
    "Message",
    "Piece",
    "PlanStats",
    "PreparedPlan",
    "ReshardPlan",
    "plan_reshard",
    "prepare_plan",
]


@dataclass(frozen=True)
class Piece:
    """A box of one tensor.

    Arguments:
        tensor: index into the plan's specs.
        box: global (start, stop) per dim; full in every dim but the spec's cut_dim.
        nbytes: bytes in the box.
    """

    tensor: int
    box: Box
    nbytes: int

    def __repr__(self) -> str:
        box = ",".join(f"{a}:{b}" for a, b in self.box)
        return f"Piece(t{self.tensor}[{box}] {self.nbytes}B)"


@dataclass(frozen=True)
class Message:
    """Everything `src` sends to `dst`: pieces in (tensor, start) order, same on both sides."""

    src: int
    dst: int
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        """Bytes in the message."""
        return sum(p.nbytes for p in self.pieces)

    def __repr__(self) -> str:
        return f"Message({self.src}->{self.dst} {len(self.pieces)} pieces {self.nbytes}B)"


@dataclass(frozen=True)
class PlanStats:
    """Totals of a plan, in bytes (num_messages: count of (src, dst) pairs)."""

    total_bytes: int
    lower_bound_bytes: int
    local_bytes: int
    max_send_bytes: int
    max_recv_bytes: int
    cross_node_bytes: int
    num_messages: int

    def __repr__(self) -> str:
        return (
            f"PlanStats(sent {_fmt(self.total_bytes)} (lower bound "
            f"{_fmt(self.lower_bound_bytes)}), local {_fmt(self.local_bytes)}, max send "
            f"{_fmt(self.max_send_bytes)}, max recv {_fmt(self.max_recv_bytes)}, cross-node "
            f"{_fmt(self.cross_node_bytes)}, {self.num_messages} messages)"
        )


def _fmt(nbytes: int) -> str:
    """Bytes in a short human unit (B, KiB, MiB, GiB, TiB)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{nbytes}B" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return f"{value:.1f}TiB"


class ReshardPlan:
    """A transfer plan from `src` to `dst` (build with `plan_reshard`).

    The compact C++ plan (`raw`, a `nereus_comm._C.RemapPlan`) is the truth;
    per-rank lists of `Piece` and `Message` are built on first use and cached.

    Attributes:
        specs: the tensors (Piece.tensor indexes this tuple).
        dst_specs: the tensors as the destination holds them (== specs unless
            plan_reshard was given dst_specs).
        src, dst: the layouts, with num_layers filled in.
        num_layers: the destination's number of layers (src.num_layers may differ).
        stats: PlanStats.
        raw: the compact plan (read-only numpy arrays, positions are indices
            into src.ranks / dst.ranks): items (item_tensor, item_start,
            item_stop, item_bytes; an interval of the spec's cut_dim, (0, 1)
            for a tensor without one), blocks (item ranges, block_offset),
            sends (asg_dst, asg_src, asg_begin, asg_end, asg_lo, asg_hi,
            asg_bytes: items [begin, end) from src to dst, the first from
            asg_lo, the last up to asg_hi, sorted by (dst, src); send_order
            sorts them by (src, dst)), local copies (local_dst, local_block),
            per-rank totals (send_bytes, recv_bytes, local_bytes).
    """

    def __init__(
        self,
        specs: tuple[TensorSpec, ...],
        src: Layout,
        dst: Layout,
        raw: _C.RemapPlan,
        dst_specs: tuple[TensorSpec, ...] | None = None,
    ) -> None:
        self.specs = specs
        self.dst_specs = specs if dst_specs is None else dst_specs
        self.src = src
        self.dst = dst
        self.num_layers = dst.num_layers
        self.raw = raw
        self.stats = PlanStats(
            total_bytes=raw.total_bytes,
            lower_bound_bytes=raw.lower_bound_bytes,
            local_bytes=raw.local_total,
            max_send_bytes=raw.max_send_bytes,
            max_recv_bytes=raw.max_recv_bytes,
            cross_node_bytes=raw.cross_node_bytes,
            num_messages=raw.num_messages,
        )
        self._pieces: dict[int, Piece] = {}
        self._item_lists: tuple[list[int], list[int], list[int], list[int]] | None = None
        self._send_src: np.ndarray | None = None
        self._cache: dict[tuple[str, int], list] = {}

    # -- per-rank views -------------------------------------------------------------

    def _check_rank(self, rank: int) -> None:
        # A dict lookup takes True for rank 1 and 1.0 for rank 1: ranks are ints.
        if type(rank) is not int:
            as_int(rank, "rank", LayoutError)
        if rank not in self.src and rank not in self.dst:
            raise LayoutError(
                f"rank {rank!r} is in neither the source {self.src!r} nor the destination "
                f"{self.dst!r}; ask only about ranks of the plan"
            )

    def _items(self) -> tuple[list[int], list[int], list[int], list[int]]:
        if self._item_lists is None:
            raw = self.raw
            self._item_lists = (
                raw.item_tensor.tolist(),
                raw.item_start.tolist(),
                raw.item_stop.tolist(),
                raw.item_bytes.tolist(),
            )
        return self._item_lists

    def _piece(self, item: int) -> Piece:
        # Pieces are immutable and shared by every dp replica of a shard class,
        # so one object per item serves all ranks.
        piece = self._pieces.get(item)
        if piece is None:
            _, starts, stops, _ = self._items()
            piece = self._cut(item, starts[item], stops[item])
            self._pieces[item] = piece
        return piece

    def _cut(self, item: int, start: int, stop: int) -> Piece:
        """Item `item` restricted to [start, stop) of its tensor's cut axis."""
        tensors, starts, stops, nbytes = self._items()
        t = tensors[item]
        spec = self.specs[t]
        k = spec.cut_dim
        box = spec.full_box()
        if k is not None:
            box = (*box[:k], (start, stop), *box[k + 1 :])
        size = nbytes[item] * (stop - start) // (stops[item] - starts[item])
        return Piece(t, box, size)

    def _sorted_pieces(self, items: list[int]) -> tuple[Piece, ...]:
        tensors, starts, _, _ = self._items()
        items.sort(key=lambda i: (tensors[i], starts[i]))
        return tuple(self._piece(i) for i in items)

    def _messages(self, indices: np.ndarray, *, outgoing: bool) -> list[Message]:
        raw = self.raw
        _, starts, stops, _ = self._items()
        pairs: dict[tuple[int, int], list[Piece]] = {}
        for s, d, a, b, lo, hi in zip(
            raw.asg_src[indices].tolist(),
            raw.asg_dst[indices].tolist(),
            raw.asg_begin[indices].tolist(),
            raw.asg_end[indices].tolist(),
            raw.asg_lo[indices].tolist(),
            raw.asg_hi[indices].tolist(),
        ):
            out_pieces = pairs.setdefault((s, d), [])
            for i in range(a, b):
                # the first and last item of a share may be cut
                start = lo if i == a else starts[i]
                stop = hi if i == b - 1 else stops[i]
                whole = start == starts[i] and stop == stops[i]
                out_pieces.append(self._piece(i) if whole else self._cut(i, start, stop))
        out = []
        for (s, d), ps in pairs.items():
            ps.sort(key=lambda p: (p.tensor, p.box))
            out.append(Message(self.src.ranks[s], self.dst.ranks[d], tuple(ps)))
        out.sort(key=(lambda m: m.dst) if outgoing else (lambda m: m.src))
        return out

    def local_copies(self, rank: int) -> list[Piece]:
        """Pieces `rank` holds in src and needs in dst (copied locally, never sent).

        Raises:
            LayoutError: the rank is in neither layout.
        """
        self._check_rank(rank)
        if rank not in self.dst:
            return []
        key = ("local", rank)
        if key not in self._cache:
            raw, r = self.raw, self.dst.position(rank)
            lo, hi = np.searchsorted(raw.local_dst, [r, r + 1])
            items: list[int] = []
            offsets = raw.block_offset
            for b in raw.local_block[lo:hi].tolist():
                items.extend(range(int(offsets[b]), int(offsets[b + 1])))
            self._cache[key] = list(self._sorted_pieces(items))
        return list(self._cache[key])

    def recvs(self, rank: int) -> list[Message]:
        """Messages `rank` receives, sorted by source rank.

        Raises:
            LayoutError: the rank is in neither layout.
        """
        self._check_rank(rank)
        if rank not in self.dst:
            return []
        key = ("recv", rank)
        if key not in self._cache:
            r = self.dst.position(rank)
            lo, hi = np.searchsorted(self.raw.asg_dst, [r, r + 1])
            self._cache[key] = self._messages(np.arange(lo, hi), outgoing=False)
        return list(self._cache[key])

    def sends(self, rank: int) -> list[Message]:
        """Messages `rank` sends, sorted by destination rank.

        Raises:
            LayoutError: the rank is in neither layout.
        """
        self._check_rank(rank)
        if rank not in self.src:
            return []
        key = ("send", rank)
        if key not in self._cache:
            if self._send_src is None:
                self._send_src = self.raw.asg_src[self.raw.send_order]
            s = self.src.position(rank)
            lo, hi = np.searchsorted(self._send_src, [s, s + 1])
            self._cache[key] = self._messages(self.raw.send_order[lo:hi], outgoing=True)
        return list(self._cache[key])

    def rank_bytes(self, rank: int) -> tuple[int, int, int]:
        """(bytes sent, bytes received, bytes copied locally) of `rank`, without building views.

        Raises:
            LayoutError: the rank is in neither layout.
        """
        self._check_rank(rank)
        raw = self.raw
        sent = int(raw.send_bytes[self.src.position(rank)]) if rank in self.src else 0
        if rank not in self.dst:
            return sent, 0, 0
        r = self.dst.position(rank)
        return sent, int(raw.recv_bytes[r]), int(raw.local_bytes[r])

    # -- printing ---------------------------------------------------------------------

    def describe(
        self, ranks: Sequence[int] | None = None, max_ranks: int = 16, *, pieces: bool = False
    ) -> str:
        """A per-rank listing of local copies, sends and receives.

        Arguments:
            ranks: ranks to show (default: every rank of src and dst, in order).
            max_ranks: show at most this many ranks.
            pieces: also list every piece (tensor name and box).

        Returns:
            A multi-line string.
        """
        if ranks is None:
            ranks = sorted(set(self.src.ranks) | set(self.dst.ranks))
        ranks = list(ranks)

        def listing(items: Sequence[Piece]) -> list[str]:
            if not pieces:
                return []
            return [
                f"      {self.specs[p.tensor].name}"
                f"[{','.join(f'{a}:{b}' for a, b in p.box)}] {_fmt(p.nbytes)}"
                for p in items
            ]

        lines = [repr(self), f"  src {self.src!r}", f"  dst {self.dst!r}", f"  {self.stats!r}"]
        for rank in ranks[:max_ranks]:
            local = self.local_copies(rank)
            local_bytes = _fmt(sum(p.nbytes for p in local))
            lines.append(f"  rank {rank}: local {len(local)} pieces {local_bytes}")
            lines += listing(local)
            for m in self.sends(rank):
                lines.append(f"    send -> {m.dst}: {len(m.pieces)} pieces {_fmt(m.nbytes)}")
            for m in self.recvs(rank):
                lines.append(f"    recv <- {m.src}: {len(m.pieces)} pieces {_fmt(m.nbytes)}")
                lines += listing(m.pieces)
        if len(ranks) > max_ranks:
            lines.append(f"  ... {len(ranks) - max_ranks} more ranks")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"ReshardPlan({len(self.specs)} tensors, {self.src.world_size}->"
            f"{self.dst.world_size} ranks, {self.stats.total_bytes}B sent, "
            f"{self.stats.num_messages} messages)"
        )


# -- planning -----------------------------------------------------------------------------


#: The most bytes the native planner can count (int64).
_MAX_BYTES = 2**63 - 1


def _resolve_layers(layout: Layout, num_layers: int | None, inferred: int, side: str) -> Layout:
    if layout.num_layers is not None and num_layers is not None and layout.num_layers != num_layers:
        raise PlanError(
            f"{side}.num_layers={layout.num_layers} but num_layers={num_layers} was passed; "
            "drop one of them"
        )
    n = layout.num_layers or num_layers or inferred
    if n < layout.pp:
        raise LayoutError(
            f"{side} pp={layout.pp} exceeds num_layers={n}: a pipeline stage would hold no "
            "layer; lower pp"
        )
    return layout if layout.num_layers == n else dataclasses.replace(layout, num_layers=n)


def _stages(keys: np.ndarray, num_layers: int, pp: int) -> np.ndarray:
    """Pipeline stage of each layer key (-1 stays -1: every stage)."""
    base, extra = divmod(num_layers, pp)
    head = extra * (base + 1)
    k = np.maximum(keys, 0)
    stage = np.where(k < head, k // (base + 1), extra + (k - head) // max(base, 1))
    return np.where(keys < 0, -1, stage).astype(np.int32)


def _check_specs(specs: Sequence[TensorSpec], dst_specs: Sequence[TensorSpec] | None) -> None:
    names: set[str] = set()
    for s in specs:
        if not isinstance(s, TensorSpec):
            raise LayoutError(f"specs must be TensorSpec objects, got {type(s).__name__}")
        if s.name in names:
            raise LayoutError(f"two specs are named {s.name!r}; give every tensor a unique name")
        names.add(s.name)
    if dst_specs is None:
        return
    if len(dst_specs) != len(specs):
        raise PlanError(
            f"src has {len(specs)} specs but dst has {len(dst_specs)}; both sides must "
            "describe the same tensors in the same order"
        )
    for a, b in zip(specs, dst_specs):
        if (a.name, a.shape, a.dtype, a.split_dim) != (b.name, b.shape, b.dtype, b.split_dim):
            raise PlanError(
                f"src spec {a!r} and dst spec {b!r} disagree; name, shape, dtype and split_dim "
                "must match (only stage_key may change)"
            )


def _node_array(layout: Layout) -> np.ndarray:
    if layout.node_of is None:
        return np.zeros(layout.world_size, dtype=np.int32)
    return np.asarray(layout.node_of, dtype=np.int32)


def plan_reshard(
    specs: Sequence[TensorSpec],
    src: Layout,
    dst: Layout,
    num_layers: int | None = None,
    *,
    dst_specs: Sequence[TensorSpec] | None = None,
) -> ReshardPlan:
    """Plan moving sharded state from layout `src` to layout `dst`.

    Arguments:
        specs: the tensors (as the source holds them).
        src, dst: the layouts; any degrees, any rank sets (overlapping or not).
        num_layers: layers the pp split divides, for a layout whose
            num_layers is None (default: max stage_key + 1).
        dst_specs: the tensors as the destination holds them, when their
            stage_key differs (same names, shapes, dtypes, split dims, order).

    Returns:
        A ReshardPlan (deterministic: every rank computes the same one).

    Raises:
        LayoutError: malformed specs (duplicate names), a pipeline stage with
            no layer, num_layers not an int >= 1.
        PlanError: src and dst disagree on the specs or on num_layers; a
            destination byte no source holds; the tensors' bytes (times the ranks)
            exceed what int64 counts.
    """
    prepared = prepare_plan(specs, src, dst, num_layers, dst_specs=dst_specs)
    return ReshardPlan(
        prepared.specs,
        prepared.src,
        prepared.dst,
        _C.remap_plan(*prepared.args),
        prepared.dst_specs,
    )


class PreparedPlan(NamedTuple):
    """Checked planner input: `_C.remap_plan(*args)` plans it (benchmarks time that alone)."""

    specs: tuple[TensorSpec, ...]
    dst_specs: tuple[TensorSpec, ...]
    src: Layout
    dst: Layout
    args: tuple


def prepare_plan(
    specs: Sequence[TensorSpec],
    src: Layout,
    dst: Layout,
    num_layers: int | None = None,
    *,
    dst_specs: Sequence[TensorSpec] | None = None,
) -> PreparedPlan:
    """Check the input of `plan_reshard` and turn it into the C++ planner's arrays.

    Arguments and Raises: as `plan_reshard`.
    """
    specs = tuple(specs)
    if num_layers is not None:
        num_layers = as_int(num_layers, "num_layers", LayoutError, lo=1, hi=2**31 - 1)
    _check_specs(specs, dst_specs)
    dspecs = specs if dst_specs is None else tuple(dst_specs)
    inferred = max(infer_num_layers(specs), infer_num_layers(dspecs))
    src = _resolve_layers(src, num_layers, inferred, "src")
    dst = _resolve_layers(dst, num_layers, inferred, "dst")
    n = len(specs)
    src_keys = np.fromiter((-1 if s.stage_key is None else s.stage_key for s in specs), np.int64, n)
    dst_keys = np.fromiter(
        (-1 if s.stage_key is None else s.stage_key for s in dspecs), np.int64, n
    )
    for keys, layout, side in ((dst_keys, dst, "dst"), (src_keys, src, "src")):
        bad = np.nonzero(keys >= layout.num_layers)[0]
        if len(bad):
            s = specs[int(bad[0])]
            what = "no source rank holds" if side == "src" else "the destination cannot place"
            raise PlanError(
                f"{what} {s!r}: its stage_key is not below {side}.num_layers="
                f"{layout.num_layers} ({len(bad)} such tensors); src and dst must cover the "
                "same layers"
            )
    # The planner counts bytes in int64: every tensor's, all tensors' together, and that
    # times the ranks (the most any of its sums can reach) must fit.
    total = 0
    for s in specs:
        total += s.nbytes
        if s.nbytes > _MAX_BYTES or total > _MAX_BYTES:
            raise PlanError(
                f"{s!r} holds {s.nbytes} bytes, {total} with the tensors before it: more than "
                f"the 2**63 - 1 bytes a plan can count; split the state into smaller tensors"
            )
    ranks = max(src.world_size, dst.world_size)
    if total * ranks > _MAX_BYTES:
        raise PlanError(
            f"the {len(specs)} tensors hold {total} bytes, which times {ranks} ranks exceeds "
            "the 2**63 - 1 bytes a plan can count; plan fewer tensors at a time"
        )
    length, unit, split = [], [], []
    for s in specs:
        size = 1 if s.cut_dim is None else s.shape[s.cut_dim]
        length.append(size)
        unit.append(s.nbytes // size if size else 0)
        split.append(s.split_dim is not None)
    pos = src._pos
    dst_in_src = np.fromiter((pos.get(r, -1) for r in dst.ranks), np.int64, dst.world_size)
    src_node, dst_node = _node_array(src), _node_array(dst)
    if src.node_of is not None and dst.node_of is not None:
        both = np.nonzero(dst_in_src >= 0)[0]
        clash = both[src_node[dst_in_src[both]] != dst_node[both]]
        if len(clash):
            r = dst.ranks[int(clash[0])]
            raise LayoutError(
                f"rank {r} is on node {src.node(r)} in src but node {dst.node(r)} in dst; "
                "a rank is one device, give it one node"
            )
    args = (
        (src.dp, src.tp, src.pp),
        src_node,
        (dst.dp, dst.tp, dst.pp),
        dst_node,
        dst_in_src,
        np.array(length, np.int64),
        np.array(unit, np.int64),
        np.array(split, np.int32),
        _stages(src_keys, src.num_layers, src.pp),
        _stages(dst_keys, dst.num_layers, dst.pp),
    )
    return PreparedPlan(specs, dspecs, src, dst, args)
