"""The nereus_comm pieces EMU uses, and a gloo Transport over a runtime group.

EMU moves state with ``nereus_comm.plan.plan_reshard`` and
``nereus_comm.reshard.reshard`` and describes it with
``nereus_comm.layout.TensorSpec`` / ``Layout``. While those modules are still
being written on other branches, this file carries small stand-ins that follow
the same contract (/work/notes/CONTRACT_COMM.md): a planner that prefers
local bytes and spreads reads over source replicas, and a reshard that packs
with torch slicing and sends a shard as it is (zero copy) when it moves whole.
The real modules win as soon as they import.
"""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from nereus_comm.errors import LayoutError, PeerTimeoutError, PlanError, TensorMismatchError

Box = tuple[tuple[int, int], ...]

try:  # pragma: no cover - depends on which branches are merged
    from nereus_comm.layout import Layout, TensorSpec

    HAVE_LAYOUT = True
except ImportError:  # pragma: no cover
    HAVE_LAYOUT = False

    def _chunk_range(n: int, parts: int, index: int) -> tuple[int, int]:
        size = -(-n // parts) if n > 0 else 0
        start = min(index * size, n)
        return start, min(start + size, n)

    @dataclass(frozen=True)
    class TensorSpec:  # type: ignore[no-redef]
        """Stand-in for nereus_comm.layout.TensorSpec (same fields)."""

        name: str
        shape: tuple[int, ...]
        dtype: torch.dtype
        split_dim: int | None = None
        stage_key: int | None = None

        @property
        def numel(self) -> int:
            return math.prod(self.shape)

        @property
        def element_size(self) -> int:
            return torch.empty((), dtype=self.dtype).element_size()

        @property
        def nbytes(self) -> int:
            return self.numel * self.element_size

    @dataclass(frozen=True)
    class Layout:  # type: ignore[no-redef]
        """Stand-in for nereus_comm.layout.Layout (same fields and rank order)."""

        dp: int
        tp: int
        pp: int
        ranks: tuple[int, ...]
        node_of: tuple[int, ...] | None = None
        num_layers: int | None = None

        def __post_init__(self) -> None:
            object.__setattr__(self, "ranks", tuple(self.ranks))
            if len(self.ranks) != self.dp * self.tp * self.pp or len(set(self.ranks)) != len(
                self.ranks
            ):
                raise LayoutError(f"bad layout {self}")

        def __contains__(self, rank: int) -> bool:
            return rank in self.ranks

        def coords(self, rank: int) -> tuple[int, int, int]:
            i = self.ranks.index(rank)
            return i // (self.pp * self.tp), (i // self.tp) % self.pp, i % self.tp

        def rank_at(self, d: int, p: int, t: int) -> int:
            return self.ranks[(d * self.pp + p) * self.tp + t]

        def stage_of(self, spec: TensorSpec, num_layers: int | None = None) -> int | None:
            if spec.stage_key is None:
                return None
            n = num_layers if num_layers is not None else self.num_layers
            base, extra = divmod(n, self.pp)
            head = extra * (base + 1)
            k = spec.stage_key
            return k // (base + 1) if k < head else extra + (k - head) // base

        def box(self, spec: TensorSpec, rank: int, num_layers: int | None = None) -> Box | None:
            _, p, t = self.coords(rank)
            stage = self.stage_of(spec, num_layers)
            if stage is not None and stage != p:
                return None
            return self.shard_box(spec, t)

        def shard_box(self, spec: TensorSpec, t: int) -> Box:
            box = [(0, s) for s in spec.shape]
            if spec.split_dim is not None:
                box[spec.split_dim] = _chunk_range(spec.shape[spec.split_dim], self.tp, t)
            return tuple(box)


try:  # pragma: no cover
    from nereus_comm.plan import plan_reshard

    HAVE_PLAN = True
except ImportError:  # pragma: no cover
    HAVE_PLAN = False

try:  # pragma: no cover
    from nereus_comm.reshard import reshard

    HAVE_RESHARD = True
except ImportError:  # pragma: no cover
    HAVE_RESHARD = False


def box_shape(box: Box) -> tuple[int, ...]:
    """Shape of the slice a box selects."""
    return tuple(b - a for a, b in box)


def box_slices(box: Box, origin: Box) -> tuple[slice, ...]:
    """Slices selecting global ``box`` inside a local shard whose global box is ``origin``."""
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, origin))


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out


# ----------------------------------------------------------------- stand-in planner


class Piece(NamedTuple):
    """One box of one tensor (index into specs)."""

    tensor: int
    box: Box


@dataclass(frozen=True)
class Message:
    """All pieces one rank sends to another, in the order both sides walk them."""

    src: int
    dst: int
    pieces: tuple[Piece, ...]
    nbytes: int


@dataclass
class _FallbackPlan:
    specs: tuple
    src: Any
    dst: Any
    num_layers: int | None
    _local: dict[int, list[Piece]] = field(default_factory=dict)
    _sends: dict[int, list[Message]] = field(default_factory=dict)
    _recvs: dict[int, list[Message]] = field(default_factory=dict)

    def local_copies(self, rank: int) -> list[Piece]:
        return self._local.get(rank, [])

    def sends(self, rank: int) -> list[Message]:
        return self._sends.get(rank, [])

    def recvs(self, rank: int) -> list[Message]:
        return self._recvs.get(rank, [])


def _fallback_plan(specs: Sequence[TensorSpec], src, dst, num_layers: int | None) -> _FallbackPlan:
    """Which bytes go where: local bytes first, the rest from one source replica.

    The replica a destination rank reads from rotates with its position, so
    a new unit reads from every source replica at once.
    """
    pieces: dict[tuple[int, int], list[Piece]] = {}
    for i, dst_rank in enumerate(dst.ranks):
        replica = i % src.dp
        for k, spec in enumerate(specs):
            want = dst.box(spec, dst_rank, num_layers)
            if want is None or math.prod(box_shape(want)) == 0:
                continue
            todo = [want]
            if dst_rank in src:
                own = src.box(spec, dst_rank, num_layers)
                if own is not None:
                    got = _intersect(want, own)
                    if got is not None and math.prod(box_shape(got)) > 0:
                        pieces.setdefault((dst_rank, dst_rank), []).append(Piece(k, got))
                        todo = _subtract(want, got, spec.split_dim)
            stage = src.stage_of(spec, num_layers)
            p = 0 if stage is None else stage
            for box in todo:
                for t in range(src.tp) if spec.split_dim is not None else [i % src.tp]:
                    src_rank = src.rank_at(replica, p, t)
                    got = _intersect(box, src.shard_box(spec, t))
                    if got is not None and math.prod(box_shape(got)) > 0:
                        pieces.setdefault((src_rank, dst_rank), []).append(Piece(k, got))
    plan = _FallbackPlan(tuple(specs), src, dst, num_layers)
    for (s, d), ps in sorted(pieces.items()):
        if s == d:
            plan._local[d] = ps
            continue
        nbytes = sum(math.prod(box_shape(p.box)) * specs[p.tensor].element_size for p in ps)
        m = Message(s, d, tuple(ps), nbytes)
        plan._sends.setdefault(s, []).append(m)
        plan._recvs.setdefault(d, []).append(m)
    for table, key in ((plan._sends, "dst"), (plan._recvs, "src")):
        for msgs in table.values():
            msgs.sort(key=lambda m: getattr(m, key))
    return plan


def _subtract(want: Box, got: Box, dim: int | None) -> list[Box]:
    if dim is None:
        return []
    (a, b), (c, d) = want[dim], got[dim]
    out = []
    for lo, hi in ((a, c), (d, b)):
        if lo < hi:
            box = list(want)
            box[dim] = (lo, hi)
            out.append(tuple(box))
    return out


def make_plan(specs: Sequence[TensorSpec], src, dst, num_layers: int | None):
    """plan_reshard from nereus_comm when present, else the stand-in above."""
    if HAVE_PLAN:
        return plan_reshard(specs, src, dst, num_layers)
    return _fallback_plan(specs, src, dst, num_layers)


# ----------------------------------------------------------------- transport


class GroupTransport:
    """Transport over one gloo group of the runtime (peers named by global rank).

    Arguments:
        pg: the gloo process group.
        ranks: global rank of each group rank.
    """

    def __init__(self, pg: dist.ProcessGroup, ranks: Sequence[int]) -> None:
        self.pg = pg
        self.index = {r: i for i, r in enumerate(ranks)}
        self.num_sends = 0

    def exchange(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, torch.Tensor]],
        *,
        timeout: float,
    ) -> None:
        """Post every send and receive, then wait for all of them.

        Raises:
            PeerTimeoutError: names the peers whose transfers were still pending.
        """
        works = []
        for peer, t in sends:
            works.append((peer, self.pg.send([_flat(t)], self.index[peer], 0)))
            self.num_sends += 1
        for peer, t in recvs:
            works.append((peer, self.pg.recv([_flat(t)], self.index[peer], 0)))
        deadline = time.monotonic() + timeout
        pending = []
        for peer, w in works:
            left = max(0.001, deadline - time.monotonic())
            try:
                w.wait(datetime.timedelta(seconds=left))
            except RuntimeError as e:
                pending.append((peer, str(e).splitlines()[0]))
        if pending:
            peers = sorted({p for p, _ in pending})
            raise PeerTimeoutError(
                f"transfers with peer(s) {peers} did not complete within {timeout:g} s "
                f"(first error: {pending[0][1]}); the peer may have died"
            )


def _flat(t: torch.Tensor) -> torch.Tensor:
    assert t.is_contiguous(), "transport buffers must be contiguous"
    return t.view(-1).view(torch.uint8) if t.numel() else t.reshape(-1)


# ----------------------------------------------------------------- stand-in reshard


@dataclass(frozen=True)
class ReshardResult:
    """Same fields as nereus_comm.reshard.ReshardResult, plus how many bytes were packed."""

    tensors: dict[str, torch.Tensor]
    seconds: float
    bytes_sent: int
    bytes_received: int
    bytes_local: int
    bytes_packed: int = 0


def _fallback_reshard(
    plan,
    rank: int,
    tensors: Mapping[str, torch.Tensor],
    transport,
    *,
    timeout: float = 60.0,
) -> ReshardResult:
    t0 = time.perf_counter()
    specs, src, dst, nl = plan.specs, plan.src, plan.dst, plan.num_layers
    src_box = {}
    if rank in src:
        for spec in specs:
            box = src.box(spec, rank, nl)
            if box is None:
                continue
            t = tensors.get(spec.name)
            if t is None or tuple(t.shape) != box_shape(box) or t.dtype != spec.dtype:
                raise TensorMismatchError(
                    f"rank {rank}: tensor {spec.name!r} must have shape {box_shape(box)} and "
                    f"dtype {spec.dtype}, got "
                    f"{None if t is None else (tuple(t.shape), t.dtype)}"
                )
            src_box[spec.name] = box
    out: dict[str, torch.Tensor] = {}
    dst_box = {}
    if rank in dst:
        for spec in specs:
            box = dst.box(spec, rank, nl)
            if box is not None:
                dst_box[spec.name] = box
                out[spec.name] = torch.empty(box_shape(box), dtype=spec.dtype)
    bytes_local = 0
    for piece in plan.local_copies(rank):
        name = specs[piece.tensor].name
        view = out[name][box_slices(piece.box, dst_box[name])]
        view.copy_(tensors[name][box_slices(piece.box, src_box[name])])
        bytes_local += view.numel() * view.element_size()

    def direct(m: Message) -> bool:
        # Both sides decide alike: every piece is one contiguous block in the
        # sender's shard and in the receiver's, so it moves without packing.
        for p in m.pieces:
            spec = specs[p.tensor]
            if not (
                _contiguous_in(spec, p.box, src.box(spec, m.src, nl))
                and _contiguous_in(spec, p.box, dst.box(spec, m.dst, nl))
            ):
                return False
        return True

    def view(boxes: dict[str, Box], store: Mapping[str, torch.Tensor], p: Piece) -> torch.Tensor:
        name = specs[p.tensor].name
        return store[name][box_slices(p.box, boxes[name])]

    sends, recvs, unpack = [], [], []
    packed = sent = received = 0
    for m in plan.sends(rank):
        if direct(m):
            sends += [(m.dst, view(src_box, tensors, p)) for p in m.pieces]
        else:
            parts = [view(src_box, tensors, p) for p in m.pieces]
            buf = torch.cat([x.reshape(-1).view(torch.uint8) for x in parts])
            packed += buf.numel()
            sends.append((m.dst, buf))
        sent += m.nbytes
    for m in plan.recvs(rank):
        if direct(m):
            recvs += [(m.src, view(dst_box, out, p)) for p in m.pieces]
        else:
            buf = torch.empty(m.nbytes, dtype=torch.uint8)
            recvs.append((m.src, buf))
            unpack.append((m, buf))
        received += m.nbytes
    transport.exchange(sends, recvs, timeout=timeout)
    for m, buf in unpack:
        offset = 0
        for p in m.pieces:
            name = specs[p.tensor].name
            view = out[name][box_slices(p.box, dst_box[name])]
            n = view.numel() * view.element_size()
            view.copy_(_typed(buf[offset : offset + n], view.dtype).view(view.shape))
            offset += n
        packed += offset
    return ReshardResult(out, time.perf_counter() - t0, sent, received, bytes_local, packed)


def _contiguous_in(spec: TensorSpec, box: Box, own: Box) -> bool:
    """Whether global ``box`` is one contiguous block of the shard whose box is ``own``."""
    for dim, ((a, b), (lo, hi)) in enumerate(zip(box, own)):
        if (a, b) != (lo, hi):
            # Only the first partial dim may be cut, and every dim before it has size 1.
            return all(o1 - o0 == 1 for o0, o1 in own[:dim]) and all(
                box[j] == own[j] for j in range(dim + 1, len(own))
            )
    return True


def _typed(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    try:
        return raw.view(dtype)
    except RuntimeError:  # the piece starts at an offset not aligned for dtype
        return raw.clone().view(dtype)


def run_reshard(
    plan, rank: int, tensors: Mapping[str, torch.Tensor], transport, *, timeout: float
) -> Any:
    """reshard from nereus_comm when present, else the stand-in above.

    Raises:
        TensorMismatchError: a source tensor does not match its spec.
        PeerTimeoutError: a peer did not complete its transfers in time.
    """
    if HAVE_RESHARD:
        return reshard(plan, rank, tensors, transport, timeout=timeout)
    return _fallback_reshard(plan, rank, tensors, transport, timeout=timeout)


__all__ = [
    "HAVE_LAYOUT",
    "HAVE_PLAN",
    "HAVE_RESHARD",
    "Box",
    "GroupTransport",
    "Layout",
    "PlanError",
    "TensorSpec",
    "box_shape",
    "box_slices",
    "make_plan",
    "run_reshard",
]
