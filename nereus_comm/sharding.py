"""Sharded layouts over N-D meshes of ranks: what each rank of a mesh holds of a tensor.

A :class:`Sharding` says how one tensor is laid out over a :class:`RankMesh` (an
N-D array of global ranks, any rank set): each mesh dim is :class:`Shard` (``dim``),
:class:`Replicate` or :class:`StridedShard` (``dim``, ``split_factor``), with the
semantics of torch DTensor's ``Shard``, ``Replicate`` and ``_StridedShard``:

- mesh dims are applied left to right, each to the local tensor the previous ones
  left; several mesh dims sharding one tensor dim nest (the second chunks the first's
  shard);
- ``Shard`` follows ``torch.chunk``: chunk = ceil(n / parts), trailing shards may be
  smaller or empty;
- ``StridedShard(dim, split_factor=f)`` over a mesh dim of size m first chunks the
  local dim into f pieces, chunks each piece into m, and gives coordinate c the
  concatenation of the c-th chunk of every piece (what FSDP2 makes of a
  tensor-parallel parameter: ``_StridedShard``).

So a rank holds, per tensor dim, an ordered list of global intervals; its local
shard is their cartesian product, concatenated in that order. Each product cell is a
:class:`Fragment` (a global box and where it starts in the local shard); a plain
``Shard`` layout gives one fragment per rank, a strided one several.

:mod:`nereus_comm.placement` plans and runs the moves between two such layouts (and
re-exports these names).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from nereus_comm.errors import LayoutError, as_int
from nereus_comm.layout import Box, Layout, TensorSpec, chunk_range

__all__ = [
    "Fragment",
    "MeshPlacement",
    "RankMesh",
    "Replicate",
    "Shard",
    "Sharding",
    "StridedShard",
    "sharding_from_layout",
]

_MAX_ID = 2**31 - 1


@dataclass(frozen=True)
class Shard:
    """The mesh dim cuts tensor dim ``dim`` (torch.chunk semantics)."""

    dim: int

    def __repr__(self) -> str:
        return f"Shard({self.dim})"


@dataclass(frozen=True)
class Replicate:
    """Every coordinate of the mesh dim holds the same data."""

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class StridedShard:
    """The mesh dim cuts tensor dim ``dim`` in ``split_factor`` strided runs (``_StridedShard``).

    The local dim is chunked into ``split_factor`` pieces, each piece into as many
    chunks as the mesh dim has coordinates, and coordinate c holds the c-th chunk of
    every piece, concatenated in piece order.
    """

    dim: int
    split_factor: int

    def __repr__(self) -> str:
        return f"StridedShard({self.dim}, sf={self.split_factor})"


MeshPlacement = Shard | Replicate | StridedShard
"""What one mesh dim does to a tensor."""


@dataclass(frozen=True)
class RankMesh:
    """An N-D array of distinct global ranks (row-major in ``ranks``).

    Arguments:
        shape: the mesh shape (each size >= 1).
        ranks: prod(shape) distinct global rank ids, row-major.
        node_of: node id of each entry of ``ranks`` (same length); None puts every
            rank on node 0. Used to keep fetches on-node where a choice exists.

    Raises:
        LayoutError: a size < 1, the wrong number of ranks, repeated ranks, node_of
            of the wrong length.
    """

    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    node_of: tuple[int, ...] | None = None
    _pos: dict[int, int] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        shape = tuple(as_int(s, "RankMesh size", LayoutError, lo=1, hi=_MAX_ID) for s in self.shape)
        ranks = tuple(as_int(r, "RankMesh rank", LayoutError, lo=0, hi=_MAX_ID) for r in self.ranks)
        if len(ranks) != math.prod(shape):
            raise LayoutError(
                f"RankMesh of shape {shape} needs {math.prod(shape)} ranks, got {len(ranks)}"
            )
        pos = {r: i for i, r in enumerate(ranks)}
        if len(pos) != len(ranks):
            raise LayoutError(f"RankMesh ranks must be distinct, got {ranks}")
        if self.node_of is not None:
            node_of = tuple(as_int(n, "RankMesh node id", LayoutError) for n in self.node_of)
            if len(node_of) != len(ranks):
                raise LayoutError(
                    f"RankMesh node_of has {len(node_of)} entries for {len(ranks)} ranks"
                )
            object.__setattr__(self, "node_of", node_of)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "ranks", ranks)
        object.__setattr__(self, "_pos", pos)

    @classmethod
    def of(cls, ranks: object, node_of: Sequence[int] | None = None) -> RankMesh:
        """A mesh from a nested list (or tensor / ndarray) of ranks, e.g. ``[[0, 1], [2, 3]]``.

        Raises:
            LayoutError: ragged nesting, or what the constructor refuses.
        """
        if isinstance(ranks, torch.Tensor):
            return cls(tuple(ranks.shape), tuple(ranks.reshape(-1).tolist()), node_of)
        if hasattr(ranks, "tolist") and hasattr(ranks, "shape"):  # numpy
            return cls(tuple(ranks.shape), tuple(ranks.reshape(-1).tolist()), node_of)
        shape: list[int] = []
        level = ranks
        while isinstance(level, (list, tuple)):
            shape.append(len(level))
            if not level:
                break
            level = level[0]
        flat: list[int] = []

        def walk(x: object, depth: int) -> None:
            if depth == len(shape):
                if isinstance(x, (list, tuple)):
                    raise LayoutError(f"ragged RankMesh nesting: {ranks!r}")
                flat.append(x)  # type: ignore[arg-type]
                return
            if not isinstance(x, (list, tuple)) or len(x) != shape[depth]:
                raise LayoutError(f"ragged RankMesh nesting: {ranks!r}")
            for y in x:
                walk(y, depth + 1)

        walk(ranks, 0)
        return cls(tuple(shape), tuple(flat), None if node_of is None else tuple(node_of))

    @property
    def ndim(self) -> int:
        """Number of mesh dims."""
        return len(self.shape)

    def __contains__(self, rank: object) -> bool:
        return rank in self._pos

    def coords(self, rank: int) -> tuple[int, ...]:
        """The mesh coordinates of ``rank``.

        Raises:
            LayoutError: the rank is not in the mesh.
        """
        try:
            i = self._pos[rank]
        except (KeyError, TypeError):
            raise LayoutError(f"rank {rank!r} is not in {self!r}") from None
        return _unravel(i, self.shape)

    def node(self, rank: int) -> int:
        """Node id of ``rank`` (0 when node_of is None)."""
        return 0 if self.node_of is None else self.node_of[self._pos[rank]]

    def __repr__(self) -> str:
        return f"RankMesh({list(self.shape)} ranks={list(self.ranks)})"


@lru_cache(maxsize=65536)
def _unravel(i: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for s in reversed(shape):
        i, c = divmod(i, s)
        out.append(c)
    return tuple(reversed(out))


@dataclass(frozen=True)
class Fragment:
    """One box of a tensor a rank holds: ``box`` (global) starts at ``origin`` locally."""

    box: Box
    origin: tuple[int, ...]


def _select(intervals: tuple[tuple[int, int], ...], ranges: list[tuple[int, int]]):
    """The global intervals of local ranges ``ranges`` of a dim whose local order is
    ``intervals`` (adjacent results merged)."""
    out: list[tuple[int, int]] = []
    for lo, hi in ranges:
        at = 0
        for g0, g1 in intervals:
            n = g1 - g0
            a, b = max(lo, at), min(hi, at + n)
            if a < b:
                ga, gb = g0 + a - at, g0 + b - at
                if out and out[-1][1] == ga:
                    out[-1] = (out[-1][0], gb)
                else:
                    out.append((ga, gb))
            at += n
    return tuple(out)


@lru_cache(maxsize=65536)
def _dim_intervals(
    length: int, ops: tuple[tuple[int, int, int], ...]
) -> tuple[tuple[int, int], ...]:
    """Global intervals (in local order) of a dim of ``length`` after the shard ops
    ``ops``: (parts, coordinate, split_factor; 0 for a plain Shard), applied in order."""
    intervals: tuple[tuple[int, int], ...] = ((0, length),) if length else ()
    for parts, c, sf in ops:
        n = sum(b - a for a, b in intervals)
        if sf == 0:
            ranges = [chunk_range(n, parts, c)]
        else:
            ranges = []
            for j in range(sf):
                fa, fb = chunk_range(n, sf, j)
                a, b = chunk_range(fb - fa, parts, c)
                ranges.append((fa + a, fa + b))
        intervals = _select(intervals, ranges)
    return intervals


@dataclass(frozen=True)
class Sharding:
    """How one tensor lies over a mesh: one MeshPlacement per mesh dim.

    Arguments:
        mesh: the ranks.
        placements: one per mesh dim (Shard, Replicate, StridedShard).
        shard_order: for a tensor dim sharded by several mesh dims, the order they
            apply in, as ((tensor_dim, (mesh_dim, ...)), ...) (DTensor's
            ``shard_order``); None applies mesh dims left to right.

    Raises:
        LayoutError: a placement count that differs from the mesh's dims, an
            unknown placement, a negative dim, a split_factor < 1.
    """

    mesh: RankMesh
    placements: tuple[MeshPlacement, ...]
    shard_order: tuple[tuple[int, tuple[int, ...]], ...] | None = None

    def __post_init__(self) -> None:
        placements = tuple(self.placements)
        object.__setattr__(self, "placements", placements)
        if not isinstance(self.mesh, RankMesh):
            raise LayoutError(f"Sharding mesh must be a RankMesh, got {type(self.mesh).__name__}")
        if len(placements) != self.mesh.ndim:
            raise LayoutError(
                f"Sharding over a {self.mesh.ndim}-D mesh needs {self.mesh.ndim} placements, "
                f"got {len(placements)}: {placements}"
            )
        for p in placements:
            if isinstance(p, Replicate):
                continue
            if not isinstance(p, (Shard, StridedShard)):
                raise LayoutError(
                    f"unsupported placement {p!r}: use Shard, Replicate or StridedShard "
                    "(a Partial holds unreduced values, not a piece of the tensor)"
                )
            as_int(p.dim, f"{p!r} dim", LayoutError, lo=0, hi=_MAX_ID)
            if isinstance(p, StridedShard):
                as_int(p.split_factor, f"{p!r} split_factor", LayoutError, lo=1, hi=_MAX_ID)
        if self.shard_order is not None:
            order = tuple((int(d), tuple(int(m) for m in ms)) for d, ms in self.shard_order)
            for d, ms in order:
                for m in ms:
                    p = placements[m] if 0 <= m < len(placements) else None
                    if not isinstance(p, (Shard, StridedShard)) or p.dim != d:
                        raise LayoutError(
                            f"shard_order entry ({d}, {ms}) names mesh dim {m}, whose placement "
                            f"{p!r} does not shard tensor dim {d}"
                        )
            object.__setattr__(self, "shard_order", order)

    def check_dims(self, ndim: int, name: str = "?") -> None:
        """Check that every placement shards a dim a tensor of ``ndim`` dims has.

        Raises:
            LayoutError: one does not (naming tensor ``name``).
        """
        self._ops(ndim, (0,) * self.mesh.ndim, name)

    def _ops(self, ndim: int, coords: tuple[int, ...], name: str) -> list[tuple]:
        ops: list[list[tuple[int, int, int]]] = [[] for _ in range(ndim)]
        order = dict(self.shard_order or ())
        for m, p in enumerate(self.placements):
            if isinstance(p, Replicate):
                continue
            if p.dim >= ndim:
                raise LayoutError(
                    f"tensor {name!r}: {p!r} on mesh dim {m} shards dim {p.dim}, but the "
                    f"tensor has {ndim} dims"
                )
        for m, p in enumerate(self.placements):
            if isinstance(p, Replicate) or p.dim in order:
                continue
            sf = p.split_factor if isinstance(p, StridedShard) else 0
            ops[p.dim].append((self.mesh.shape[m], coords[m], sf))
        for d, ms in order.items():
            for m in ms:
                p = self.placements[m]
                sf = p.split_factor if isinstance(p, StridedShard) else 0
                ops[d].append((self.mesh.shape[m], coords[m], sf))
        return [tuple(o) for o in ops]

    def intervals(
        self, shape: Sequence[int], rank: int, name: str = "?"
    ) -> tuple[tuple[tuple[int, int], ...], ...] | None:
        """Per tensor dim, the global intervals ``rank`` holds, in local order.

        Returns:
            None when the rank is not in the mesh. A dim of which the rank holds
            nothing has an empty tuple.

        Raises:
            LayoutError: a placement shards a dim the tensor lacks.
        """
        if rank not in self.mesh:
            return None
        ops = self._ops(len(shape), self.mesh.coords(rank), name)
        return tuple(_dim_intervals(int(n), o) for n, o in zip(shape, ops))

    def local_shape(
        self, shape: Sequence[int], rank: int, name: str = "?"
    ) -> tuple[int, ...] | None:
        """The shape of ``rank``'s local shard (None when the rank is not in the mesh)."""
        iv = self.intervals(shape, rank, name)
        if iv is None:
            return None
        return tuple(sum(b - a for a, b in dim) for dim in iv)

    def fragments(
        self, shape: Sequence[int], rank: int, name: str = "?"
    ) -> tuple[Fragment, ...] | None:
        """The boxes ``rank`` holds, each with its origin in the local shard.

        Returns:
            None when the rank is not in the mesh; an empty tuple when it holds no
            element (an empty chunk).
        """
        iv = self.intervals(shape, rank, name)
        if iv is None:
            return None
        return _product(iv)

    def __repr__(self) -> str:
        order = "" if self.shard_order is None else f" order={self.shard_order}"
        return f"Sharding({list(self.placements)} over {self.mesh!r}{order})"


def _product(iv) -> tuple[Fragment, ...]:
    frags: list[tuple[Box, tuple[int, ...]]] = [((), ())]
    for dim in iv:
        nxt = []
        for box, origin in frags:
            at = 0
            for a, b in dim:
                nxt.append(((*box, (a, b)), (*origin, at)))
                at += b - a
        frags = nxt
    return tuple(Fragment(box, origin) for box, origin in frags)


def sharding_from_layout(
    layout: Layout, spec: TensorSpec, num_layers: int | None = None
) -> Sharding:
    """The Sharding that gives every rank the same box as ``layout.box(spec, rank)``.

    A tensor on one pipeline stage lies over a (dp, tp) mesh of that stage's ranks,
    one on every stage over a (dp, pp, tp) mesh; tp is Shard(split_dim) or Replicate.

    Raises:
        LayoutError: as Layout.stage_of (a stage_key without num_layers, ...).
    """
    tp = Replicate() if spec.split_dim is None else Shard(spec.split_dim)
    stage = layout.stage_of(spec, num_layers)
    node = layout.node_of
    if stage is None:
        mesh = RankMesh((layout.dp, layout.pp, layout.tp), layout.ranks, node)
        return Sharding(mesh, (Replicate(), Replicate(), tp))
    pos = [
        (d * layout.pp + stage) * layout.tp + t for d in range(layout.dp) for t in range(layout.tp)
    ]
    ranks = tuple(layout.ranks[i] for i in pos)
    nodes = None if node is None else tuple(node[i] for i in pos)
    return Sharding(RankMesh((layout.dp, layout.tp), ranks, nodes), (Replicate(), tp))
