"""Resharding between sharded layouts over N-D meshes of ranks.

What a rank of a mesh holds of a tensor (:class:`Sharding` over a :class:`RankMesh`,
with :class:`Shard`, :class:`Replicate` and :class:`StridedShard` per mesh dim) is
:mod:`nereus_comm.sharding`'s; its names are re-exported here.

:func:`plan_sharded` plans moving a set of tensors from one sharding to another
(any meshes, rank sets and sizes): every destination fragment is cut by the source
fragments it overlaps; a cut the destination rank already holds is copied locally,
each other cut is fetched once, from one of its holders (holders on the receiver's
node first, then the least loaded). The native planner (csrc/remap/sharded.h) does
this, once per distinct (shape, source, destination sharding), and returns the pieces
as arrays; the plan builds Python objects from them only when asked. The fetches
become the tensors of an ordinary :class:`~nereus_comm.plan.ReshardPlan` (each lives
on one source and one destination rank), so :func:`reshard_sharded` runs them through
:func:`~nereus_comm.reshard.reshard`: plan check between peers, one batched exchange,
C++ pack/unpack, same-host routes.
The bytes sent equal the lower bound: the bytes of each destination shard that its
rank does not hold in the source.

Example (on every rank of both sides)::

    mesh = RankMesh.of([[0, 1], [2, 3]])
    src = Sharding(mesh, (Shard(0), Shard(1)))          # FSDP x TP
    dst = Sharding(RankMesh.of([0, 1, 2]), (Shard(0),))  # 3 ranks
    plan = plan_sharded([TensorSpec("w", (8, 8), torch.float32)], src, dst)
    out = reshard_sharded(plan, rank, {"w": my_local_shard}, transport)
    out.tensors["w"]                                      # this rank's new shard
"""

from __future__ import annotations

import hashlib
import operator
import re
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from nereus_comm import _C
from nereus_comm.errors import LayoutError, PlanError, TensorMismatchError
from nereus_comm.layout import Box, Layout, TensorSpec
from nereus_comm.pack import unsupported_reason
from nereus_comm.plan import ReshardPlan
from nereus_comm.reshard import ReshardResult, reshard
from nereus_comm.reshard_program import row_view
from nereus_comm.sharding import (
    Fragment,
    MeshPlacement,
    RankMesh,
    Replicate,
    Shard,
    Sharding,
    StridedShard,
    sharding_from_layout,
)
from nereus_comm.transport import Transport

__all__ = [
    "Fragment",
    "MeshPlacement",
    "RankMesh",
    "Replicate",
    "Shard",
    "ShardedPiece",
    "ShardedPlan",
    "ShardedResult",
    "Sharding",
    "StridedShard",
    "plan_sharded",
    "reshard_sharded",
    "sharding_from_layout",
]

# -- planning ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardedPiece:
    """A box of one tensor that moves (or is copied) from ``src`` to ``dst``.

    Arguments:
        tensor: index into the plan's specs.
        src, dst: global ranks (equal for a local copy).
        box: the global box.
        src_local, dst_local: the same box in the source and destination local shards.
        nbytes: bytes in the box.
        name: the name of the inner plan's tensor that carries it (None for a local copy).
    """

    tensor: int
    src: int
    dst: int
    box: Box
    src_local: Box
    dst_local: Box
    nbytes: int
    name: str | None = None


class _Pieces:
    """The native planner's pieces (``_C.ShardedPieces``), read as Python values on demand.

    Remote piece ``j`` is row ``remote_idx[j]`` of the arrays; its inner-plan tensor is
    named ``"<tensor name>@<receiver>#<j>"``.
    """

    def __init__(self, raw, specs: tuple[TensorSpec, ...]) -> None:
        self.raw = raw
        self.specs = specs
        remote = raw.remote.view(np.bool_)
        self.remote_idx = np.flatnonzero(remote)
        self.local_idx = np.flatnonzero(~remote)
        self.remote_src = raw.src[self.remote_idx]
        self.remote_dst = raw.dst[self.remote_idx]
        self.local_dst = raw.dst[self.local_idx]
        self._rows: tuple[list, ...] | None = None
        self._index: tuple[list[int], list[int]] | None = None

    def rows(self) -> tuple[list, ...]:
        """(tensor, src, dst, nbytes, box_offset, box, src_local, dst_local) as lists."""
        if self._rows is None:
            raw = self.raw
            self._rows = tuple(
                a.tolist()
                for a in (
                    raw.tensor,
                    raw.src,
                    raw.dst,
                    raw.nbytes,
                    raw.box_offset,
                    raw.box,
                    raw.src_local,
                    raw.dst_local,
                )
            )
        return self._rows

    def index(self) -> tuple[list[int], list[int]]:
        """(remote_idx, local_idx) as lists."""
        if self._index is None:
            self._index = (self.remote_idx.tolist(), self.local_idx.tolist())
        return self._index

    def name(self, j: int) -> str:
        """The inner-plan tensor name of remote piece ``j``."""
        tensor, _, dst, *_ = self.rows()
        i = self.index()[0][j]
        return f"{self.specs[tensor[i]].name}@{dst[i]}#{j}"

    def boxes(self, i: int) -> tuple[Box, Box, Box]:
        """(global, src-local, dst-local) box of row ``i``."""
        rows = self.rows()
        a, b = rows[4][i], rows[4][i + 1]
        return tuple(tuple(zip(v[a:b:2], v[a + 1 : b : 2])) for v in rows[5:])  # type: ignore[return-value]

    def piece(self, i: int, name: str | None) -> ShardedPiece:
        """Row ``i`` as a ShardedPiece."""
        tensor, src, dst, nbytes, *_ = self.rows()
        box, src_local, dst_local = self.boxes(i)
        return ShardedPiece(tensor[i], src[i], dst[i], box, src_local, dst_local, nbytes[i], name)

    def remote(self, js: Iterable[int]) -> tuple[ShardedPiece, ...]:
        """Remote pieces ``js`` (indices into the remote pieces)."""
        idx = self.index()[0]
        return tuple(self.piece(idx[j], self.name(j)) for j in js)

    def local(self, ks: Iterable[int]) -> tuple[ShardedPiece, ...]:
        """Local copies ``ks`` (indices into the local copies)."""
        idx = self.index()[1]
        return tuple(self.piece(idx[k], None) for k in ks)


_new_object = object.__new__
_set_attr = object.__setattr__


def _piece_spec(name: str, shape: tuple[int, ...], dtype: torch.dtype, stage: int) -> TensorSpec:
    """A TensorSpec of a remote piece, whose values the planner already checked: built
    without TensorSpec's per-field validation (equal to ``TensorSpec(name, shape, dtype,
    None, stage)``)."""
    spec = _new_object(TensorSpec)
    _set_attr(
        spec,
        "__dict__",
        {"name": name, "shape": shape, "dtype": dtype, "split_dim": None, "stage_key": stage},
    )
    return spec


class _PieceSpecs(Sequence[TensorSpec]):
    """The inner plan's specs, one per remote piece (its box's shape, its tensor's dtype,
    ``stages[j]`` as stage_key), built on first access."""

    def __init__(self, pieces: _Pieces, stages: np.ndarray) -> None:
        self._pieces = pieces
        self._stages = stages
        self._built: dict[int, TensorSpec] = {}
        self._all: tuple[TensorSpec, ...] | None = None

    def __len__(self) -> int:
        return len(self._stages)

    def _build(self, j: int, i: int, stage: int, rows: tuple[list, ...]) -> TensorSpec:
        """The spec of remote piece ``j`` (row ``i`` of ``rows``, the pieces' lists)."""
        tensor, _, dst, _, offset, box, *_ = rows
        v = box[offset[i] : offset[i + 1]]
        t = self._pieces.specs[tensor[i]]
        shape = tuple(b - a for a, b in zip(v[0::2], v[1::2]))
        return _piece_spec(f"{t.name}@{dst[i]}#{j}", shape, t.dtype, stage)

    def __getitem__(self, j):  # type: ignore[override]
        if self._all is not None:
            return self._all[j]
        if isinstance(j, slice):
            return tuple(self[k] for k in range(*j.indices(len(self))))
        j = operator.index(j)
        if j < 0:
            j += len(self)
        if not 0 <= j < len(self):
            raise IndexError(f"piece spec {j} out of range for {len(self)} pieces")
        spec = self._built.get(j)
        if spec is None:
            p = self._pieces
            i = p.index()[0][j]
            spec = self._built[j] = self._build(j, i, int(self._stages[j]), p.rows())
        return spec

    def __iter__(self):
        if self._all is None:
            p = self._pieces
            rows, built, build = p.rows(), self._built, self._build
            self._all = tuple(
                built.get(j) or build(j, i, stage, rows)
                for j, (i, stage) in enumerate(zip(p.index()[0], self._stages.tolist()))
            )
        return iter(self._all)

    def __repr__(self) -> str:
        return f"<{len(self)} piece specs>"


class ShardedPlan:
    """A plan moving tensors between two Shardings each (build with :func:`plan_sharded`).

    Attributes:
        specs: the tensors (name, shape, dtype; split_dim and stage_key unused).
        src, dst: the Sharding of each tensor on each side, by spec order.
        local: the pieces copied on their own rank.
        remote: the pieces that travel, each one tensor of ``inner``.
        inner: the ReshardPlan that carries ``remote`` (None when nothing travels).
        total_bytes: bytes sent; lower_bound_bytes: bytes of destination shards their
            rank does not hold in the source (equal to total_bytes); local_bytes.
        ranks: every rank of either side, ascending.

    ``local`` and ``remote`` are built from the native planner's arrays on first use;
    ``sends`` and ``recvs`` build only the rank's pieces.
    """

    def __init__(
        self,
        specs: tuple[TensorSpec, ...],
        src: tuple[Sharding, ...],
        dst: tuple[Sharding, ...],
        pieces: _Pieces,
        inner: ReshardPlan | None,
        ranks: tuple[int, ...],
    ) -> None:
        self.specs = specs
        self.src = src
        self.dst = dst
        self.inner = inner
        self._pieces = pieces
        raw = pieces.raw
        self.total_bytes: int = raw.remote_bytes
        self.local_bytes: int = raw.local_bytes
        self.lower_bound_bytes: int = raw.lower_bound_bytes
        self.ranks = ranks
        self._local: tuple[ShardedPiece, ...] | None = None
        self._remote: tuple[ShardedPiece, ...] | None = None
        self._digest: bytes | None = None

    @property
    def local(self) -> tuple[ShardedPiece, ...]:
        """The pieces copied on their own rank, in planning order."""
        if self._local is None:
            self._local = self._pieces.local(range(len(self._pieces.local_idx)))
        return self._local

    @property
    def remote(self) -> tuple[ShardedPiece, ...]:
        """The pieces that travel, in planning order (piece j is ``inner``'s tensor j)."""
        if self._remote is None:
            self._remote = self._pieces.remote(range(len(self._pieces.remote_idx)))
        return self._remote

    @property
    def digest(self) -> bytes:
        """A 16-byte digest of what fixes the plan (specs, both sides' shardings): equal
        on every process that planned the same move, different otherwise."""
        if self._digest is None:
            rows = [
                (s.name, tuple(s.shape), str(s.dtype), _sharding_row(a), _sharding_row(b))
                for s, a, b in zip(self.specs, self.src, self.dst)
            ]
            self._digest = hashlib.blake2b(repr(rows).encode(), digest_size=16).digest()
        return self._digest

    def src_shapes(self, rank: int) -> dict[str, tuple[int, ...]]:
        """The local shard shape of every tensor ``rank`` holds in the source, by name."""
        out = {}
        for spec, s in zip(self.specs, self.src):
            shape = s.local_shape(spec.shape, rank, spec.name)
            if shape is not None:
                out[spec.name] = shape
        return out

    def dst_shapes(self, rank: int) -> dict[str, tuple[int, ...]]:
        """The local shard shape of every tensor ``rank`` holds in the destination, by name."""
        out = {}
        for spec, s in zip(self.specs, self.dst):
            shape = s.local_shape(spec.shape, rank, spec.name)
            if shape is not None:
                out[spec.name] = shape
        return out

    def _remote_of(self, side: np.ndarray, rank: int) -> list[ShardedPiece]:
        js = np.flatnonzero(side == rank).tolist()
        if self._remote is not None:
            return [self._remote[j] for j in js]
        return list(self._pieces.remote(js))

    def _local_to(self, rank: int) -> list[ShardedPiece]:
        """The local copies on ``rank``."""
        ks = np.flatnonzero(self._pieces.local_dst == rank).tolist()
        if self._local is not None:
            return [self._local[k] for k in ks]
        return list(self._pieces.local(ks))

    def sends(self, rank: int) -> list[ShardedPiece]:
        """The remote pieces ``rank`` sends."""
        return self._remote_of(self._pieces.remote_src, rank)

    def recvs(self, rank: int) -> list[ShardedPiece]:
        """The remote pieces ``rank`` receives."""
        return self._remote_of(self._pieces.remote_dst, rank)

    def __repr__(self) -> str:
        return (
            f"ShardedPlan({len(self.specs)} tensors, {len(self.ranks)} ranks, "
            f"{self.total_bytes}B sent (lower bound {self.lower_bound_bytes}B), "
            f"{self.local_bytes}B local, {len(self._pieces.remote_idx)} remote pieces)"
        )


def _sharding_row(s: Sharding) -> tuple:
    """A Sharding as plain values whose repr is the same in every process."""
    m = s.mesh
    return (m.shape, m.ranks, m.node_of, tuple(repr(p) for p in s.placements), s.shard_order)


def _per_tensor(what, specs, side: str) -> tuple[Sharding, ...]:
    if isinstance(what, Sharding):
        return (what,) * len(specs)
    if not isinstance(what, Mapping):
        raise LayoutError(f"{side} must be a Sharding or a mapping name -> Sharding")
    out = []
    for s in specs:
        sh = what.get(s.name)
        if sh is None:
            raise PlanError(f"tensor {s.name!r} has no {side} Sharding")
        if not isinstance(sh, Sharding):
            raise LayoutError(f"tensor {s.name!r}: {side} is a {type(sh).__name__}, not a Sharding")
        out.append(sh)
    extra = sorted(set(what) - {s.name for s in specs})
    if extra:
        raise PlanError(f"{side} names tensors that are not in specs: {extra[:10]}")
    return tuple(out)


#: The most bytes a plan can count (int64).
_MAX_BYTES = 2**63 - 1


def _native_input(shardings: Sequence[Sharding]) -> list[np.ndarray]:
    """The sharding arrays of ``_C.sharded_plan`` (mesh_ndim ... order), node ids
    renumbered densely (the planner only compares them; a mesh without node_of is on
    node 0, as ``RankMesh.node`` says)."""
    node_ids: dict[int, int] = {0: 0}
    mesh_ndim, mesh_shape, kind, dim, split, ranks, nodes = [], [], [], [], [], [], []
    order_offset, order = [0], []
    for sh in shardings:
        mesh = sh.mesh
        mesh_ndim.append(mesh.ndim)
        mesh_shape.extend(mesh.shape)
        for p in sh.placements:
            if isinstance(p, StridedShard):
                kind.append(2)
                split.append(p.split_factor)
            else:
                kind.append(1 if isinstance(p, Shard) else 0)
                split.append(0)
            dim.append(getattr(p, "dim", 0))
        ranks.extend(mesh.ranks)
        if mesh.node_of is None:
            nodes.extend([0] * len(mesh.ranks))
        else:
            nodes.extend(node_ids.setdefault(n, len(node_ids)) for n in mesh.node_of)
        for d, ms in sh.shard_order or ():
            order.extend((d, len(ms), *ms))
        order_offset.append(len(order))
    return [
        np.array(a, np.int64)
        for a in (mesh_ndim, mesh_shape, kind, dim, split, ranks, nodes, order_offset, order)
    ]


def plan_sharded(
    specs: Sequence[TensorSpec],
    src: Sharding | Mapping[str, Sharding],
    dst: Sharding | Mapping[str, Sharding],
) -> ShardedPlan:
    """Plan moving tensors from their ``src`` Shardings to their ``dst`` Shardings.

    Every rank computes the same plan without communication. The cuts and the choice
    of holders are computed by the native planner (``_C.sharded_plan``, csrc/remap/
    sharded.h), once per distinct (shape, src sharding, dst sharding).

    Arguments:
        specs: the tensors (name, full shape, dtype).
        src, dst: one Sharding for every tensor, or a mapping name -> Sharding.
            Meshes may differ in shape, size and rank set between tensors and sides.

    Returns:
        The plan: local copies, remote pieces (one fetch per destination cut, from one
        holder: the receiver's node first, then the holder with the fewest bytes to
        send so far, then one already sending to the receiver, then the lowest rank),
        and the inner ReshardPlan that carries them.

    Raises:
        LayoutError: duplicate names, a placement that shards a dim the tensor lacks.
        PlanError: a tensor without a Sharding on one side, a Sharding for an unknown
            tensor; byte counts past 2**63 - 1; shardings that cut a tensor into more
            pieces than a plan holds.
    """
    specs = tuple(specs)
    names = set()
    for s in specs:
        if not isinstance(s, TensorSpec):
            raise LayoutError(f"specs must be TensorSpec objects, got {type(s).__name__}")
        if s.name in names:
            raise LayoutError(f"two specs are named {s.name!r}")
        names.add(s.name)
    srcs, dsts = _per_tensor(src, specs, "src"), _per_tensor(dst, specs, "dst")
    # Distinct shardings, so that equal geometry is computed once: by identity, then by
    # (mesh object, placements), then by value (hashing a mesh's ranks costs the most).
    by_id: dict[int, int] = {}
    by_mesh: dict[tuple, int] = {}
    by_value: dict[Sharding, int] = {}
    shardings: list[Sharding] = []
    fits: set[tuple[int, int]] = set()  # (sharding, ndim) whose placements fit the dims
    ndims, shape, esize, src_index, dst_index = [], [], [], [], []
    for spec, s, d in zip(specs, srcs, dsts):
        ndim = len(spec.shape)
        for sh, out in ((s, src_index), (d, dst_index)):
            i = by_id.get(id(sh))
            if i is None:
                key = (id(sh.mesh), sh.placements, sh.shard_order)
                i = by_mesh.get(key)
                if i is None:
                    i = by_mesh[key] = by_value.setdefault(sh, len(shardings))
                    if i == len(shardings):
                        shardings.append(sh)
                by_id[id(sh)] = i
            if (i, ndim) not in fits:
                sh.check_dims(ndim, spec.name)  # raises, naming the tensor
                fits.add((i, ndim))
            out.append(i)
        if spec.nbytes > _MAX_BYTES:
            raise PlanError(
                f"{spec!r} holds {spec.nbytes} bytes: more than the 2**63 - 1 bytes a plan can "
                "count; split the state into smaller tensors"
            )
        ndims.append(ndim)
        shape.extend(spec.shape)
        esize.append(spec.element_size)
    arrays = [np.array(a, np.int64) for a in (ndims, shape, esize, src_index, dst_index)]
    try:
        raw = _C.sharded_plan(*arrays, *_native_input(shardings))
    except ValueError as e:
        found = re.search(r"tensor #(\d+): ", str(e))
        what = f"tensor {specs[int(found.group(1))].name!r}" if found else "these tensors"
        raise PlanError(f"cannot plan {what}: {e}") from None
    pieces = _Pieces(raw, specs)
    ranks = tuple(sorted({r for sh in shardings for r in sh.mesh.ranks}))
    inner = _inner_plan(pieces, srcs, dsts) if raw.num_remote else None
    return ShardedPlan(specs, srcs, dsts, pieces, inner, ranks)


def _distinct(shardings: Sequence[Sharding]) -> list[Sharding]:
    """The shardings without repeats, in order of first appearance."""
    return list({id(s): s for s in shardings}.values())


def _rank_nodes(ranks: list[int], shardings: list[Sharding]) -> tuple[int, ...] | None:
    """Each rank's node: from the first sharding whose mesh has node_of and the rank
    (0 where none says); None when no mesh has node_of."""
    known: dict[int, int] = {}
    for sh in shardings:
        if sh.mesh.node_of is not None:
            for r, n in zip(sh.mesh.ranks, sh.mesh.node_of):
                known.setdefault(r, n)
    return tuple(known.get(r, 0) for r in ranks) if known else None


def _inner_plan(pieces: _Pieces, srcs, dsts) -> ReshardPlan:
    """A ReshardPlan with one tensor per remote piece, each on one pipeline stage of a
    pp-only layout (one rank per stage): stage = its sender in the source, its receiver
    in the destination. The planner's input is built here from the piece arrays, as
    :func:`~nereus_comm.plan.prepare_plan` would build it from one spec per piece."""
    srcs, dsts = _distinct(srcs), _distinct(dsts)
    src_ranks = sorted({r for s in srcs for r in s.mesh.ranks})
    dst_ranks = sorted({r for d in dsts for r in d.mesh.ranks})
    src_nodes, dst_nodes = _rank_nodes(src_ranks, srcs), _rank_nodes(dst_ranks, dsts)
    if src_nodes is not None and dst_nodes is not None:
        # A rank's node must agree between the sides; where one side lacks it, take the other's.
        src_node = dict(zip(src_ranks, src_nodes))
        dst_nodes = tuple(src_node.get(r, n) for r, n in zip(dst_ranks, dst_nodes))
    num_src, num_dst = len(src_ranks), len(dst_ranks)
    src_layout = Layout(1, 1, num_src, tuple(src_ranks), src_nodes, num_src)
    dst_layout = Layout(1, 1, num_dst, tuple(dst_ranks), dst_nodes, num_dst)
    raw = pieces.raw
    total, ranks = raw.remote_bytes, max(num_src, num_dst)
    if total * ranks > _MAX_BYTES:
        raise PlanError(
            f"the {raw.num_remote} tensors hold {total} bytes, which times {ranks} ranks exceeds "
            "the 2**63 - 1 bytes a plan can count; plan fewer tensors at a time"
        )
    src_stage = np.searchsorted(np.array(src_ranks, np.int64), pieces.remote_src)
    dst_stage = np.searchsorted(np.array(dst_ranks, np.int64), pieces.remote_dst)
    length = raw.cut_length[pieces.remote_idx]
    src_pos = {r: i for i, r in enumerate(src_ranks)}
    nodes = [
        np.zeros(n, np.int32) if ns is None else np.asarray(ns, np.int32)
        for n, ns in ((num_src, src_nodes), (num_dst, dst_nodes))
    ]
    plan = _C.remap_plan(
        (1, 1, num_src),
        nodes[0],
        (1, 1, num_dst),
        nodes[1],
        np.array([src_pos.get(r, -1) for r in dst_ranks], np.int64),
        length,
        raw.nbytes[pieces.remote_idx] // length,
        np.zeros(len(length), np.int32),
        src_stage.astype(np.int32),
        dst_stage.astype(np.int32),
    )
    specs = _PieceSpecs(pieces, src_stage)
    return ReshardPlan(specs, src_layout, dst_layout, plan, _PieceSpecs(pieces, dst_stage))  # type: ignore[arg-type]


# -- execution ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardedResult:
    """One rank's destination shards (by tensor name) and the inner reshard's result
    (None when nothing travelled to or from this rank)."""

    tensors: dict[str, torch.Tensor] = field(repr=False)
    result: ReshardResult | None


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def _check_inputs(
    plan: ShardedPlan, rank: int, tensors: Mapping[str, torch.Tensor], what: str, expected
):
    unknown = [n for n in tensors if n not in expected]
    if unknown:
        raise TensorMismatchError(
            f"rank {rank}: {what} tensors {sorted(unknown)[:10]} are not this rank's in the plan"
        )
    for name, (shape, dtype) in expected.items():
        t = tensors.get(name)
        if t is None:
            raise TensorMismatchError(f"rank {rank}: {what} tensor {name!r} is missing")
        why = unsupported_reason(t)
        if why is not None:
            raise TensorMismatchError(f"rank {rank}: {what} tensor {name!r} {why}")
        if t.shape != shape or t.dtype != dtype:
            raise TensorMismatchError(
                f"rank {rank}: {what} tensor {name!r} is {tuple(t.shape)} {t.dtype}; its "
                f"sharding gives this rank {tuple(shape)} {dtype}"
            )
        # A source is only read (piece by piece, each in place where one row stride
        # describes it); a destination must not overlap itself.
        if what == "destination" and not t.is_contiguous() and row_view(t) is None:
            raise TensorMismatchError(
                f"rank {rank}: {what} tensor {name!r} (strides {tuple(t.stride())}) is not "
                "contiguous nor rows of one stride; pass a contiguous tensor"
            )


@dataclass(frozen=True)
class _RankWork:
    """What one rank's :func:`reshard_sharded` derives from the plan alone (cached per
    plan and rank): expected shards, and the slices of every piece it sends, receives
    or copies, by tensor name."""

    src_expected: dict[str, tuple[torch.Size, torch.dtype]]
    dst_expected: dict[str, tuple[torch.Size, torch.dtype]]
    sends: tuple[tuple[str, str, tuple[slice, ...]], ...]  # (piece name, tensor, slices)
    recvs: tuple[tuple[str, str, tuple[slice, ...]], ...]
    local: tuple[tuple[str, tuple[slice, ...], tuple[slice, ...]], ...]
    in_inner: bool


_WORK: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _rank_work(plan: ShardedPlan, rank: int) -> _RankWork:
    per_plan = _WORK.setdefault(plan, {})
    work = per_plan.get(rank)
    if work is not None:
        return work
    by_name = {s.name: s for s in plan.specs}

    def expected(shapes):
        return {n: (torch.Size(sh), by_name[n].dtype) for n, sh in shapes.items()}

    names = [s.name for s in plan.specs]
    inner = plan.inner
    work = _RankWork(
        src_expected=expected(plan.src_shapes(rank)),
        dst_expected=expected(plan.dst_shapes(rank)),
        sends=tuple((p.name, names[p.tensor], _slices(p.src_local)) for p in plan.sends(rank)),
        recvs=tuple((p.name, names[p.tensor], _slices(p.dst_local)) for p in plan.recvs(rank)),
        local=tuple(
            (names[p.tensor], _slices(p.src_local), _slices(p.dst_local))
            for p in plan._local_to(rank)
        ),
        in_inner=inner is not None and (rank in inner.src or rank in inner.dst),
    )
    per_plan[rank] = work
    return work


def _donated(work: _RankWork, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The destination shards that are wholly one contiguous block of a source shard
    (one local piece covering the shard), as views of that block."""
    out = {}
    for name, src_sl, dst_sl in work.local:
        shape = work.dst_expected[name][0]
        whole = all(sl.start == 0 and sl.stop == n for sl, n in zip(dst_sl, shape))
        if not whole or name in out:
            continue
        view = tensors[name][src_sl]
        if view.shape == shape and view.is_contiguous():
            out[name] = view
    return out


def reshard_sharded(
    plan: ShardedPlan,
    rank: int,
    tensors: Mapping[str, torch.Tensor],
    transport: Transport | None,
    *,
    out: Mapping[str, torch.Tensor] | None = None,
    donate: bool = False,
    **kwargs,
) -> ShardedResult:
    """Run ``plan`` on ``rank``: every rank of the plan calls it with the same plan.

    Every piece is read from the source shard, and written into the destination
    shard, in place wherever one row stride describes it there (a column block of a
    row-major shard is); only a piece that is no such view on a side is copied once
    more on that side.

    Arguments:
        plan: from :func:`plan_sharded`.
        rank: this rank (the transport's).
        tensors: this rank's source local shards, by name (plain dense tensors of any
            strides, shapes as their Sharding gives); empty for a rank outside every
            source mesh.
        transport: carries the remote pieces (GlooTransport, ProcessGroupTransport, ...);
            may be None when the plan moves nothing.
        out: destination local shards to fill, by name (contiguous, or rows of one
            stride such as a column block of a larger tensor); default: fresh.
        donate: the caller gives up ``tensors``: a destination shard that is wholly one
            contiguous block of this rank's source shard is returned as that block (a
            view of the source's memory, no copy). The sources must not be used or
            changed afterwards. Ignored with ``out``.
        kwargs: passed to :func:`~nereus_comm.reshard.reshard` (timeout, route,
            verify_plan, ...).

    Returns:
        The rank's destination shards (empty for a rank outside every destination mesh).

    Raises:
        TensorMismatchError: a shard missing, unknown, of the wrong shape or dtype,
            not a plain tensor, or an ``out`` shard that is no row view (names it);
            before any byte moves.
        As reshard for the exchange itself.
    """
    work = _rank_work(plan, rank)
    _check_inputs(plan, rank, tensors, "source", work.src_expected)
    # Fresh shards live where the transport moves bytes (host memory for gloo).
    device = getattr(transport, "device", None) or torch.device(
        getattr(transport, "device_type", "cpu")
    )
    if out is not None:
        _check_inputs(plan, rank, out, "destination", work.dst_expected)
        result = dict(out)
    else:
        aliased = _donated(work, tensors) if donate else {}
        result = {
            n: aliased[n] if n in aliased else torch.empty(sh, dtype=dt, device=device)
            for n, (sh, dt) in work.dst_expected.items()
        }
    sends: dict[str, torch.Tensor] = {}
    outs: dict[str, torch.Tensor] = {}
    later: list[tuple[torch.Tensor, torch.Tensor]] = []
    for piece, name, sl in work.sends:
        view = tensors[name][sl]
        # reshard reads a strided piece in place where one row stride describes it;
        # any other view is copied once here.
        sends[piece] = view if row_view(view) is not None else view.contiguous()
    for piece, name, sl in work.recvs:
        view = result[name][sl]
        if row_view(view) is not None:  # reshard writes it in place
            outs[piece] = view
        else:  # no single row stride: land it beside, copy it in after
            tmp = torch.empty(view.shape, dtype=view.dtype, device=view.device)
            outs[piece] = tmp
            later.append((view, tmp))
    res = None
    if work.in_inner:
        if transport is None:
            raise TensorMismatchError(f"rank {rank}: the plan moves bytes but transport is None")
        res = reshard(plan.inner, rank, sends, transport, out=outs, **kwargs)
    for name, src_sl, dst_sl in work.local:
        dst_view, src_view = result[name][dst_sl], tensors[name][src_sl]
        if dst_view.data_ptr() == src_view.data_ptr() and dst_view.stride() == src_view.stride():
            continue  # a donated block: already in place
        dst_view.copy_(src_view)
    for view, tmp in later:
        view.copy_(tmp)
    return ShardedResult(result, res)
