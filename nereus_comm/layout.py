"""Sharded-state layouts: which box of which tensor each rank holds.

A `TensorSpec` describes one logical tensor of a model's state (a weight, an
Adam moment, a step counter). A `Layout` arranges ranks as dp x pp x tp and
gives every rank a `Box` (global (start, stop) per dim) of every tensor:

- tensors with a `split_dim` are cut over tp with `torch.chunk` semantics
  (chunk = ceil(n / tp); trailing ranks may get a smaller or an EMPTY range),
  the others are replicated over tp;
- tensors with a `stage_key` (a layer index) live on one pipeline stage only;
  layers split over pp like `numpy.array_split` (earlier stages take the
  remainder); tensors without one are on every stage;
- every dp replica holds the same boxes as the others.

Rank order inside `Layout.ranks` is dp-major, then pp, then tp (tp fastest):
`ranks[(d * pp + p) * tp + t]`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from nereus_comm.errors import LayoutError, as_int

#: Ranks, node ids, degrees and layer keys go to the native planner as int32.
_MAX_ID = 2**31 - 1
#: Tensor sizes: a dim of more than 2**63 - 1 elements has no int64 byte count.
_MAX_SIZE = 2**63 - 1

Box = tuple[tuple[int, int], ...]
"""A region of a tensor: one (start, stop) pair per dim, in global coordinates."""

__all__ = [
    "Box",
    "Layout",
    "TensorSpec",
    "box_nbytes",
    "box_numel",
    "box_shape",
    "chunk_range",
    "infer_num_layers",
    "layer_range",
    "local_region",
    "stage_of_layer",
]


def chunk_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """The range of `torch.chunk(x, parts)[index]` along a dim of length n.

    Arguments:
        n: length of the dim.
        parts: number of chunks asked for (the tp degree).
        index: which chunk.

    Returns:
        (start, stop) with start <= stop; empty (start == stop == n) when
        torch.chunk returns fewer than `parts` chunks and `index` is past them.
    """
    size = -(-n // parts) if n > 0 else 0
    start = min(index * size, n)
    return start, min(start + size, n)


def layer_range(num_layers: int, pp: int, stage: int) -> tuple[int, int]:
    """The layers [start, stop) of pipeline stage `stage` (numpy.array_split rule).

    Arguments:
        num_layers: number of layers split over the stages.
        pp: number of pipeline stages.
        stage: which stage.

    Returns:
        (start, stop): earlier stages hold one extra layer each while the
        remainder num_layers % pp lasts.
    """
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return start, start + base + (1 if stage < extra else 0)


def stage_of_layer(layer: int, num_layers: int, pp: int) -> int:
    """The pipeline stage that holds `layer` (inverse of `layer_range`)."""
    base, extra = divmod(num_layers, pp)
    # The first `extra` stages have base + 1 layers each.
    head = extra * (base + 1)
    if layer < head:
        return layer // (base + 1)
    return extra + (layer - head) // base


def box_shape(box: Box) -> tuple[int, ...]:
    """The shape of the tensor slice a box selects."""
    return tuple(stop - start for start, stop in box)


def box_numel(box: Box) -> int:
    """The number of elements in a box."""
    return math.prod(stop - start for start, stop in box)


def box_nbytes(box: Box, spec: TensorSpec) -> int:
    """The number of bytes a box of `spec` holds."""
    return box_numel(box) * spec.element_size


@dataclass(frozen=True)
class TensorSpec:
    """One logical tensor of sharded state.

    Arguments:
        name: unique name (the key of the tensor in `reshard`'s mappings).
        shape: the full (unsharded) shape.
        dtype: element type.
        split_dim: the dim cut over tp (torch.chunk semantics); None means
            every tp rank holds the whole tensor. A negative dim counts from
            the end, as in torch, and is stored normalized.
        stage_key: the layer the tensor belongs to (embedding: 0, final norm
            and lm head: num_layers - 1); None means it is on every pipeline stage.

    Raises:
        LayoutError: malformed name, shape, dtype, split_dim or stage_key.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    split_dim: int | None = None
    stage_key: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise LayoutError(f"TensorSpec name must be a non-empty str, got {self.name!r}")
        try:
            dims = tuple(self.shape)
        except TypeError:
            raise LayoutError(
                f"TensorSpec {self.name!r}: shape must be a sequence of ints, got {self.shape!r}"
            ) from None
        what = f"TensorSpec {self.name!r}: each size of shape {self.shape!r}"
        shape = tuple(as_int(s, what, LayoutError, hi=_MAX_SIZE) for s in dims)
        if any(s < 0 for s in shape):
            raise LayoutError(f"TensorSpec {self.name!r}: negative size in shape {shape}")
        object.__setattr__(self, "shape", shape)
        if not isinstance(self.dtype, torch.dtype):
            raise LayoutError(
                f"TensorSpec {self.name!r}: dtype must be a torch.dtype, got {self.dtype!r}"
            )
        if self.split_dim is not None:
            ndim = len(shape)
            split_dim = as_int(self.split_dim, f"TensorSpec {self.name!r}: split_dim", LayoutError)
            if not -ndim <= split_dim < ndim:
                raise LayoutError(
                    f"TensorSpec {self.name!r}: split_dim {split_dim} is out of range for "
                    f"shape {shape} ({ndim} dims); pick a dim in [0, {ndim}) or None to replicate"
                )
            object.__setattr__(self, "split_dim", split_dim % ndim)
        if self.stage_key is not None:
            what = f"TensorSpec {self.name!r}: stage_key (a layer index, or None)"
            stage_key = as_int(self.stage_key, what, LayoutError, lo=0, hi=_MAX_ID)
            object.__setattr__(self, "stage_key", stage_key)

    @property
    def numel(self) -> int:
        """Number of elements of the full tensor."""
        return math.prod(self.shape)

    @property
    def element_size(self) -> int:
        """Bytes per element."""
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of the full tensor."""
        return self.numel * self.element_size

    @property
    def cut_dim(self) -> int | None:
        """The one dim that plan pieces may cut (so each stays one strided block).

        The split dim; for a replicated tensor its outermost dim longer than 1
        (a cut there leaves contiguous pieces); None when there is no such dim.
        """
        if self.split_dim is not None:
            return self.split_dim
        return next((d for d, n in enumerate(self.shape) if n > 1), None)

    def full_box(self) -> Box:
        """The box covering the whole tensor."""
        return tuple((0, s) for s in self.shape)

    def __repr__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        extra = ""
        if self.split_dim is not None:
            extra += f" split={self.split_dim}"
        if self.stage_key is not None:
            extra += f" layer={self.stage_key}"
        return f"TensorSpec({self.name} {list(self.shape)} {dtype}{extra})"


def infer_num_layers(specs) -> int:
    """max(stage_key) + 1 over `specs` (1 when no spec has a stage_key)."""
    keys = [s.stage_key for s in specs if s.stage_key is not None]
    return max(keys) + 1 if keys else 1


def _compress_ranks(ranks: tuple[int, ...]) -> str:
    parts = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    text = ",".join(parts)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class Layout:
    """How one unit's ranks hold sharded state: dp x pp x tp over `ranks`.

    Arguments:
        dp, tp, pp: data, tensor and pipeline parallel degrees (>= 1).
        ranks: dp*tp*pp distinct global rank ids, ordered
            ranks[(d * pp + p) * tp + t].
        node_of: node id of each entry of `ranks` (same length); None puts
            every rank on node 0.
        num_layers: how many layers the pp split divides; None lets the
            caller decide (plan_reshard infers max stage_key + 1).

    Raises:
        LayoutError: degrees < 1, wrong number of ranks, duplicate ranks,
            node_of of the wrong length, fewer layers than pipeline stages.
    """

    dp: int
    tp: int
    pp: int
    ranks: tuple[int, ...]
    node_of: tuple[int, ...] | None = None
    num_layers: int | None = None
    _pos: dict[int, int] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        for axis in ("dp", "tp", "pp"):
            value = as_int(getattr(self, axis), f"Layout {axis}", LayoutError, lo=1, hi=_MAX_ID)
            object.__setattr__(self, axis, value)
        try:
            given = tuple(self.ranks)
        except TypeError:
            raise LayoutError(
                f"Layout ranks must be a sequence of ints, got {self.ranks!r}"
            ) from None
        ranks = tuple(as_int(r, "Layout rank", LayoutError, lo=0, hi=_MAX_ID) for r in given)
        object.__setattr__(self, "ranks", ranks)
        want = self.dp * self.tp * self.pp
        if len(ranks) != want:
            raise LayoutError(
                f"Layout dp={self.dp} x tp={self.tp} x pp={self.pp} needs {want} ranks, "
                f"got {len(ranks)}; pass exactly dp*tp*pp rank ids"
            )
        pos = {r: i for i, r in enumerate(ranks)}
        if len(pos) != len(ranks):
            seen: set[int] = set()
            dups = sorted({r for r in ranks if r in seen or seen.add(r)})
            raise LayoutError(f"Layout ranks must be distinct; repeated: {dups[:10]}")
        object.__setattr__(self, "_pos", pos)
        if self.node_of is not None:
            try:
                given = tuple(self.node_of)
            except TypeError:
                raise LayoutError(
                    f"Layout node_of must be a sequence of ints or None, got {self.node_of!r}"
                ) from None
            node_of = tuple(
                as_int(n, "Layout node id", LayoutError, lo=-_MAX_ID - 1, hi=_MAX_ID) for n in given
            )
            if len(node_of) != len(ranks):
                raise LayoutError(
                    f"Layout node_of has {len(node_of)} entries for {len(ranks)} ranks; "
                    "give one node id per entry of ranks (or None for a single node)"
                )
            object.__setattr__(self, "node_of", node_of)
        if self.num_layers is not None:
            num_layers = as_int(self.num_layers, "Layout num_layers", LayoutError, lo=1, hi=_MAX_ID)
            object.__setattr__(self, "num_layers", num_layers)
            if self.num_layers < self.pp:
                raise LayoutError(
                    f"Layout pp={self.pp} exceeds num_layers={self.num_layers}: a pipeline "
                    "stage would hold no layer; lower pp"
                )

    @property
    def world_size(self) -> int:
        """Number of ranks (dp * tp * pp)."""
        return len(self.ranks)

    def __contains__(self, rank: int) -> bool:
        return rank in self._pos

    def position(self, rank: int) -> int:
        """Index of `rank` in `ranks`.

        Raises:
            LayoutError: the rank is not in this layout.
        """
        # A dict lookup takes True for rank 1 and 1.0 for rank 1: ranks are ints.
        if type(rank) is not int:
            rank = as_int(rank, "rank", LayoutError)
        try:
            return self._pos[rank]
        except (KeyError, TypeError):
            raise LayoutError(
                f"rank {rank!r} is not in {self!r}; ask only about ranks of the layout"
            ) from None

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(d, p, t) coordinates of `rank`.

        Raises:
            LayoutError: the rank is not in this layout.
        """
        i = self.position(rank)
        return i // (self.pp * self.tp), (i // self.tp) % self.pp, i % self.tp

    def rank_at(self, d: int, p: int, t: int) -> int:
        """The rank at coordinates (d, p, t)."""
        return self.ranks[(d * self.pp + p) * self.tp + t]

    def node(self, rank: int) -> int:
        """Node id of `rank` (0 when node_of is None)."""
        i = self.position(rank)
        return 0 if self.node_of is None else self.node_of[i]

    def resolve_num_layers(self, num_layers: int | None) -> int | None:
        """`num_layers` if given, else the layout's own (may be None)."""
        return num_layers if num_layers is not None else self.num_layers

    def stage_of(self, spec: TensorSpec, num_layers: int | None = None) -> int | None:
        """The pipeline stage holding `spec`; None when it is on every stage.

        Raises:
            LayoutError: spec.stage_key is set but num_layers is unknown, or
                the stage_key is not below num_layers.
        """
        if spec.stage_key is None:
            return None
        n = self.resolve_num_layers(num_layers)
        if n is None and self.pp == 1:
            return 0  # one stage holds every layer
        if n is None:
            raise LayoutError(
                f"{spec!r} has a stage_key but num_layers is unknown; pass num_layers "
                "or set Layout.num_layers"
            )
        if n < self.pp:
            raise LayoutError(
                f"Layout pp={self.pp} exceeds num_layers={n}: a pipeline stage would hold "
                "no layer; lower pp"
            )
        if spec.stage_key >= n:
            raise LayoutError(
                f"{spec!r}: stage_key {spec.stage_key} is not below num_layers={n}; "
                "fix the spec or the layout's num_layers"
            )
        return stage_of_layer(spec.stage_key, n, self.pp)

    def box(self, spec: TensorSpec, rank: int, num_layers: int | None = None) -> Box | None:
        """The box of `spec` that `rank` holds.

        Arguments:
            spec: the tensor.
            rank: a rank of this layout.
            num_layers: overrides Layout.num_layers when given.

        Returns:
            The box (possibly empty along the split dim), or None when the
            tensor is not on the rank's pipeline stage.

        Raises:
            LayoutError: the rank is not in the layout; num_layers unknown or
                too small for the spec.
        """
        _, p, t = self.coords(rank)
        stage = self.stage_of(spec, num_layers)
        if stage is not None and stage != p:
            return None
        return self.shard_box(spec, t)

    def shard_box(self, spec: TensorSpec, t: int) -> Box:
        """The box of `spec` held at tp coordinate `t` (ignores the pipeline stage)."""
        box = list(spec.full_box())
        if spec.split_dim is not None:
            box[spec.split_dim] = chunk_range(spec.shape[spec.split_dim], self.tp, t)
        return tuple(box)

    def __repr__(self) -> str:
        nodes = "" if self.node_of is None else f" nodes={len(set(self.node_of))}"
        layers = "" if self.num_layers is None else f" layers={self.num_layers}"
        return (
            f"Layout(dp{self.dp} tp{self.tp} pp{self.pp} ranks={_compress_ranks(self.ranks)}"
            f"{nodes}{layers})"
        )


def local_region(
    spec: TensorSpec,
    layout: Layout,
    rank: int,
    box: Box,
    num_layers: int | None = None,
) -> tuple[int, int, int, int]:
    """Where a global `box` lives inside `rank`'s local contiguous shard of `spec`.

    Arguments:
        spec: the tensor.
        layout: the layout the shard belongs to.
        rank: the rank holding the shard.
        box: a global box contained in the rank's own box, full in every dim
            except `spec.cut_dim` (every plan piece is).
        num_layers: overrides Layout.num_layers when given.

    Returns:
        (offset_elems, num_rows, row_elems, row_stride_elems): num_rows rows
        of row_elems contiguous elements, row r starting at offset_elems +
        r * row_stride_elems. A contiguous block is returned as one row
        (num_rows == 1, row_stride_elems == row_elems).

    Raises:
        LayoutError: the rank does not hold the tensor, or `box` is not
            inside the rank's box or not full outside spec.cut_dim.
    """
    own = layout.box(spec, rank, num_layers)
    if own is None:
        raise LayoutError(f"rank {rank} of {layout!r} does not hold {spec!r} (other stage)")
    if len(box) != len(own):
        raise LayoutError(f"box {box} has {len(box)} dims, {spec!r} has {len(own)}")
    k = spec.cut_dim
    for dim, ((a, b), (lo, hi)) in enumerate(zip(box, own)):
        full = dim == k or (a, b) == (lo, hi)
        if not (lo <= a <= b <= hi) or not full:
            raise LayoutError(
                f"box {box} is not a piece of rank {rank}'s box {own} of {spec!r}: dim {dim} "
                f"must lie inside the rank's range and be full unless it is the cut dim ({k})"
            )
    numel = box_numel(box)
    if k is None or numel == 0:
        return 0, 1, numel, numel
    outer = math.prod(spec.shape[:k])
    inner = math.prod(spec.shape[k + 1 :])
    (a, b), (lo, hi) = box[k], own[k]
    offset = (a - lo) * inner
    row, stride = (b - a) * inner, (hi - lo) * inner
    if row == stride:  # the whole local range: one contiguous block
        return offset, 1, outer * row, outer * row
    if outer == 1:
        return offset, 1, row, row
    return offset, outer, row, stride
