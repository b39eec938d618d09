"""DTensor state dicts resharded to another DeviceMesh in one exchange.

:func:`reshard_dtensors` takes a state dict of DTensors (and plain tensors and other
values, e.g. an optimizer's step counters and hyperparameters), a destination
DeviceMesh and placements, and returns the state as DTensors there. The destination
mesh may have any shape, rank count and rank set (growing, shrinking, moving to other
ranks), where ``DTensor.redistribute`` needs the same mesh. Each DTensor's placements
become a :class:`~nereus_comm.sharding.Sharding` (``Shard``, ``Replicate``,
``_StridedShard`` and a non-default ``shard_order``), and one
:func:`~nereus_comm.placement.plan_sharded` plan moves every tensor at once, the
bytes sent equal to what the destination ranks lack.

Every rank of ``group`` calls it. The ranks first swap a 56-byte fingerprint (a
digest of what they hold, one of the plan they would run or of the destination they
were given, the description's length).
A call that repeats the last one over the group (same descriptions on every rank, same
destination: a weight sync every step) stops there and runs the cached plan with no
further check. Otherwise the descriptions themselves follow (names, shapes, dtypes,
meshes, placements; one all_gather padded to the longest), so a rank outside every
source mesh learns what to receive and every rank refuses the same bad input (a
Partial placement, ranks that disagree on a tensor, a destination shape that differs
from the source's, a placement for a dim the tensor lacks, a value that does not
pickle) with the same error, naming the tensor, before any tensor byte moves.

Plain tensors (e.g. a per-parameter ``step``) are taken as replicated on the ranks
that passed a state and are returned as plain tensors on every destination rank;
other values travel in the metadata exchange.

Example (every rank of the default group)::

    new_mesh = init_device_mesh("cpu", (6,))
    out = reshard_dtensors(model.state_dict(), new_mesh, [Shard(0)])
"""

from __future__ import annotations

import hashlib
import pickle
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement as TorchPlacement
from torch.distributed.tensor.placement_types import _StridedShard

from nereus_comm.errors import LayoutError, NereusCommError, PlanError
from nereus_comm.layout import TensorSpec
from nereus_comm.placement import ShardedPlan, plan_sharded, reshard_sharded
from nereus_comm.sharding import (
    MeshPlacement,
    RankMesh,
    Replicate,
    Shard,
    Sharding,
    StridedShard,
)
from nereus_comm.transport import Transport
from nereus_comm.transport_pg import ProcessGroupTransport

__all__ = [
    "DTensorReshardError",
    "DstPlacements",
    "from_torch_placements",
    "plan_dtensors",
    "reshard_dtensors",
    "sharding_of",
]


class DTensorReshardError(NereusCommError, ValueError):
    """A DTensor state that :func:`reshard_dtensors` cannot move (the message names the
    tensor); raised on every rank of the group before any tensor byte moves."""


DstPlacements = (
    Sequence[TorchPlacement]
    | Mapping[str, "Sequence[TorchPlacement] | DTensor"]
    | Callable[[str, tuple[int, ...]], Sequence[TorchPlacement]]
)
"""The destination placements: one list for every DTensor, a mapping by name (a list,
or a DTensor on the destination mesh whose placements and shape are taken), or a
callable (name, global shape) -> list."""


def from_torch_placements(
    placements: Sequence[TorchPlacement], ndim: int, name: str = "?"
) -> tuple[MeshPlacement, ...]:
    """nereus_comm placements for torch DTensor placements.

    Arguments:
        placements: ``Shard``, ``Replicate`` or ``_StridedShard`` per mesh dim.
        ndim: the tensor's number of dims (normalizes a negative Shard dim).
        name: the tensor's name, for errors.

    Raises:
        DTensorReshardError: a Partial (or any other) placement, or a dim the tensor
            lacks.
    """
    out: list[MeshPlacement] = []
    for m, p in enumerate(placements):
        if isinstance(p, _StridedShard):
            dim = p.dim
            q = StridedShard(dim + ndim if dim < 0 else dim, int(p.split_factor))
        elif isinstance(p, TorchShard):
            dim = p.dim
            q = Shard(dim + ndim if dim < 0 else dim)
        elif isinstance(p, TorchReplicate):
            out.append(Replicate())
            continue
        else:
            what = "a Partial (unreduced values)" if p.is_partial() else repr(p)
            raise DTensorReshardError(
                f"tensor {name!r}: placement {p!r} on mesh dim {m} is {what}; only Shard, "
                "Replicate and _StridedShard can be resharded (reduce it first, e.g. "
                "dtensor.redistribute(mesh, [Replicate()]) or full_tensor())"
            )
        if not 0 <= q.dim < ndim:
            raise DTensorReshardError(
                f"tensor {name!r}: {p!r} on mesh dim {m} shards dim {p.dim} of a {ndim}-D tensor"
            )
        out.append(q)
    return tuple(out)


#: RankMesh of each DeviceMesh seen, by id (with a weak reference that tells a reused
#: id apart): DeviceMesh.mesh rebuilds its rank tensor on every access.
_MESHES: dict[int, tuple[weakref.ref, RankMesh]] = {}
_SHARDINGS: dict[tuple, Sharding] = {}
_CACHE_MAX = 4096


def _rank_mesh(mesh: DeviceMesh) -> RankMesh:
    hit = _MESHES.get(id(mesh))
    if hit is not None and hit[0]() is mesh:
        return hit[1]
    rank_mesh = RankMesh.of(mesh.mesh)
    try:
        ref = weakref.ref(mesh)
    except TypeError:  # not weakly referenceable: not cached
        return rank_mesh
    if len(_MESHES) >= _CACHE_MAX:
        _MESHES.clear()
    _MESHES[id(mesh)] = (ref, rank_mesh)
    return rank_mesh


def _shard_order(dt: DTensor, placements: tuple[MeshPlacement, ...]):
    """The DTensor's shard_order where it is not the left-to-right default, else None."""
    order = getattr(dt._spec, "shard_order", None)
    if not order:
        return None
    given = tuple((int(e.tensor_dim), tuple(int(m) for m in e.mesh_dims)) for e in order)
    default: dict[int, list[int]] = {}
    for m, p in enumerate(placements):
        if isinstance(p, (Shard, StridedShard)):
            default.setdefault(p.dim, []).append(m)
    if given == tuple((d, tuple(ms)) for d, ms in sorted(default.items())):
        return None
    return given


def sharding_of(dt: DTensor, name: str = "?") -> Sharding:
    """The Sharding of a DTensor (its mesh's global ranks, its placements and shard order).

    Raises:
        DTensorReshardError: a placement that cannot be resharded (Partial).
    """
    mesh = _rank_mesh(dt.device_mesh)
    order = getattr(dt._spec, "shard_order", None)
    key = (mesh, tuple(dt.placements), dt.ndim, order)
    try:
        hit = _SHARDINGS.get(key)
    except TypeError:  # an unhashable placement or order: not cached
        key, hit = None, None
    if hit is not None:
        return hit
    placements = from_torch_placements(dt.placements, dt.ndim, name)
    try:
        sharding = Sharding(mesh, placements, _shard_order(dt, placements))
    except LayoutError as e:
        raise DTensorReshardError(f"tensor {name!r}: {e}") from None
    if key is not None:
        if len(_SHARDINGS) >= _CACHE_MAX:
            _SHARDINGS.clear()
        _SHARDINGS[key] = sharding
    return sharding


def _describe(name: str, value: Any):
    """(kind, shape, dtype, sharding or value) of one state entry; an error string
    where the entry cannot be moved."""
    if isinstance(value, DTensor):
        try:
            sh = sharding_of(value, name)
        except NereusCommError as e:
            return ("error", str(e))
        return ("dtensor", tuple(value.shape), value.dtype, sh)
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and type(value) is not torch.nn.Parameter:
            return ("error", f"tensor {name!r} is a {type(value).__name__}, not a plain tensor")
        return ("tensor", tuple(value.shape), value.dtype, None)
    return ("value", None, None, value)


def _merge(gathered: list, group_ranks: list[int]) -> tuple[dict, list[int]]:
    """The one description of every entry that all state-holding ranks agree on,
    and those ranks; raises DTensorReshardError (the same on every rank) otherwise."""
    holders = [r for r, m in zip(group_ranks, gathered) if m is not None]
    for r, m in zip(group_ranks, gathered):
        for d in (m or {}).values():
            if d[0] == "error":
                raise DTensorReshardError(f"rank {r}: {d[1]}")
    if not holders:
        return {}, []
    first = holders[0]
    ref = gathered[group_ranks.index(first)]
    for r in holders[1:]:
        m = gathered[group_ranks.index(r)]
        if list(m) != list(ref):
            diff = sorted(set(m) ^ set(ref)) or ["(order)"]
            raise DTensorReshardError(
                f"ranks {first} and {r} pass different state entries: {diff[:10]}"
            )
        for name, d in m.items():
            e = ref[name]
            if d[0] == "value":
                continue  # a value comes from the first holder
            if d[:3] != e[:3] or (d[0] == "dtensor" and d[3] != e[3]):
                raise DTensorReshardError(
                    f"tensor {name!r}: rank {first} holds {_text(e)} but rank {r} holds {_text(d)}"
                )
    return ref, holders


def _text(d) -> str:
    kind, shape, dtype, sh = d
    where = f" as {sh!r}" if kind == "dtensor" else ""
    return f"a {kind} {list(shape)} {dtype}{where}"


def _dst_placements(dst: DstPlacements, name: str, shape: tuple[int, ...], mesh: DeviceMesh):
    if callable(dst) and not isinstance(dst, Mapping):
        return tuple(dst(name, shape))
    if isinstance(dst, Mapping):
        if name not in dst:
            raise DTensorReshardError(f"tensor {name!r} has no destination placements")
        p = dst[name]
        if isinstance(p, DTensor):
            if tuple(p.shape) != tuple(shape):
                raise DTensorReshardError(
                    f"tensor {name!r} is {list(shape)} in the source but its destination "
                    f"template is {list(p.shape)}; a reshard keeps the global shape"
                )
            if p.device_mesh != mesh:
                raise DTensorReshardError(
                    f"tensor {name!r}: its destination template lies on {p.device_mesh}, "
                    f"not on the destination mesh {mesh}"
                )
            return tuple(p.placements)
        return tuple(p)
    return tuple(dst)


#: Plans by their input (specs, source and destination shardings), oldest first.
_PLANS: dict[tuple, ShardedPlan] = {}
#: Plans by (id of a merged metadata dict, holders, destination): (that dict, plan).
_FAST: dict[tuple, tuple[dict, ShardedPlan]] = {}
_MAX_PLANS = 8


def plan_dtensors(
    meta: Mapping[str, tuple],
    holders: Sequence[int],
    dst_mesh: DeviceMesh,
    placements: DstPlacements,
) -> tuple[ShardedPlan, dict[str, tuple[TorchPlacement, ...]]]:
    """The plan for the tensors of ``meta`` (as :func:`reshard_dtensors` merges it) and
    the torch placements of each DTensor on the destination mesh."""
    dst_rank_mesh = _rank_mesh(dst_mesh)
    torch_pl = {}
    for name, (kind, shape, _dtype, _sh) in meta.items():
        if kind == "dtensor":
            pl = _dst_placements(placements, name, shape, dst_mesh)
            if len(pl) != dst_mesh.ndim:
                raise DTensorReshardError(
                    f"tensor {name!r}: {len(pl)} placements for a {dst_mesh.ndim}-D "
                    f"destination mesh: {list(pl)}"
                )
            torch_pl[name] = pl
    # A repeated call (the metadata a fingerprint matched) finds its plan by the
    # metadata object and the destination alone: no specs or Shardings rebuilt.
    fast_key = (id(meta), tuple(holders), dst_rank_mesh, tuple(torch_pl.values()))
    try:
        hit = _FAST.get(fast_key)
    except TypeError:  # an unhashable placement: plan below
        fast_key, hit = None, None
    if hit is not None and hit[0] is meta:
        return hit[1], torch_pl
    flat_dst = RankMesh((len(dst_rank_mesh.ranks),), dst_rank_mesh.ranks)
    flat_src = RankMesh((len(holders),), tuple(holders)) if holders else None
    specs, src, dst = [], {}, {}
    for name, (kind, shape, dtype, sh) in meta.items():
        if kind == "value":
            continue
        specs.append(TensorSpec(name, shape, dtype))
        if kind == "dtensor":
            pl = torch_pl[name]
            src[name] = sh
            dst[name] = Sharding(dst_rank_mesh, from_torch_placements(pl, len(shape), name))
        else:  # a plain tensor: the same on every holder, wanted on every destination rank
            src[name] = Sharding(flat_src, (Replicate(),))
            dst[name] = Sharding(flat_dst, (Replicate(),))
    key = (tuple(specs), tuple(src[s.name] for s in specs), tuple(dst[s.name] for s in specs))
    plan = _PLANS.get(key)
    if plan is None:
        try:
            plan = plan_sharded(specs, src, dst)
        except (LayoutError, PlanError) as e:
            raise DTensorReshardError(str(e)) from None
        # The same state moved again (a weight sync every step) reuses the plan, and with
        # it reshard's per-plan program.
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[key] = plan
    if fast_key is not None:
        if len(_FAST) >= _MAX_PLANS:
            _FAST.pop(next(iter(_FAST)))
        _FAST[fast_key] = (meta, plan)  # meta kept alive: its id stays its own
    return plan, torch_pl


class _Seen:
    """What the last metadata exchange over a group agreed on: every rank's digest of
    its state's description, the merged description and the ranks that held state."""

    def __init__(self, digests: tuple[bytes, ...], meta: dict, holders: list[int]) -> None:
        self.digests = digests
        self.meta = meta
        self.holders = holders


#: Per process group: the last agreed metadata (see _Seen), and a default transport.
_SEEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TRANSPORTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_DIGEST = 16
_NONE = bytes(_DIGEST)


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=_DIGEST).digest()


def _fingerprints(
    group: dist.ProcessGroup, mine: bytes, plan_digest: bytes, dst_digest: bytes, nbytes: int
) -> list[tuple[bytes, bytes, bytes, int]]:
    """Every rank's (description digest, plan digest, destination digest, description
    length in bytes or -1 where it does not pickle): one all_gather of 56 bytes each."""
    raw = mine + plan_digest + dst_digest + int(nbytes).to_bytes(8, "little", signed=True)
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    got = [torch.empty(len(raw), dtype=torch.uint8) for _ in range(dist.get_world_size(group))]
    dist.all_gather(got, t, group=group)
    out = []
    for g in got:
        b = g.numpy().tobytes()
        d = _DIGEST
        out.append(
            (
                b[:d],
                b[d : 2 * d],
                b[2 * d : 3 * d],
                int.from_bytes(b[3 * d :], "little", signed=True),
            )
        )
    return out


def _destination_digest(dst_mesh: DeviceMesh, placements: DstPlacements, route: str) -> bytes:
    """A digest of a call's destination (mesh, placements, route) that fixes the plan
    together with the merged descriptions; _NONE for a callable, which only its
    results describe."""
    if callable(placements) and not isinstance(placements, Mapping):
        return _NONE
    mesh = _rank_mesh(dst_mesh)
    try:
        if isinstance(placements, Mapping):
            rows = []
            for name in sorted(placements):
                p = placements[name]
                if isinstance(p, DTensor):
                    m = _rank_mesh(p.device_mesh)
                    rows.append((name, tuple(p.placements), tuple(p.shape), m.shape, m.ranks))
                else:
                    rows.append((name, tuple(p)))
            what = repr(rows)
        else:
            what = repr(tuple(placements))
    except TypeError:  # e.g. an unsortable name: the per-peer check covers it
        return _NONE
    return _digest(repr((route, mesh.shape, mesh.ranks, what)).encode())


def _gather_descriptions(
    group: dist.ProcessGroup, payload: bytes, lengths: Sequence[int]
) -> list[Any]:
    """Every rank's pickled state description, in one all_gather padded to the longest
    (whose length every rank learned from the fingerprints)."""
    cap = max(1, *lengths)
    buf = torch.zeros(cap, dtype=torch.uint8)
    if payload:
        buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    got = [torch.empty(cap, dtype=torch.uint8) for _ in lengths]
    dist.all_gather(got, buf, group=group)
    ranks = dist.get_process_group_ranks(group)
    out = []
    for r, g, n in zip(ranks, got, lengths):
        try:
            out.append(pickle.loads(g[:n].numpy().tobytes()))
        except Exception as e:  # a peer's bytes that do not unpickle here
            raise DTensorReshardError(
                f"rank {r}'s state description does not unpickle here ({e}); every rank "
                "must run the same torch and nereus_comm versions"
            ) from None
    return out


#: DTensorSpecs of the destination DTensors, by (mesh, placements, shape, dtype): equal
#: specs are shared, as torch shares them between DTensors it makes.
_SPECS: dict[tuple, tuple[weakref.ref, Any]] = {}


def _to_dtensor(local: torch.Tensor, mesh: DeviceMesh, placements, shape) -> DTensor:
    """A DTensor of ``local`` on ``mesh`` (what DTensor.from_local(run_check=False) makes,
    without its autograd function, which costs ~0.5-7 ms a call)."""
    key = (id(mesh), tuple(placements), tuple(shape), local.dtype)
    try:
        hit = _SPECS.get(key)
        spec = hit[1] if hit is not None and hit[0]() is mesh else None
        if spec is None:
            meta = TensorMeta(torch.Size(shape), _contiguous_stride(shape), local.dtype)
            spec = DTensorSpec(mesh, tuple(placements), tensor_meta=meta)
            if len(_SPECS) >= _CACHE_MAX:
                _SPECS.clear()
            _SPECS[key] = (weakref.ref(mesh), spec)
        return DTensor(local, spec, requires_grad=False)
    except (TypeError, AttributeError, RuntimeError):  # a torch whose internals differ
        return DTensor.from_local(
            local,
            mesh,
            placements,
            run_check=False,
            shape=torch.Size(shape),
            stride=_contiguous_stride(shape),
        )


def reshard_dtensors(
    state: Mapping[str, Any] | None,
    dst_mesh: DeviceMesh,
    placements: DstPlacements,
    *,
    group: dist.ProcessGroup | None = None,
    transport: Transport | None = None,
    timeout: float = 300.0,
    route: str = "auto",
    donate: bool = False,
) -> dict[str, Any]:
    """Reshard a DTensor state dict onto ``dst_mesh``: every rank of ``group`` calls it.

    The ranks first agree on what they hold: each sends the others a 16-byte digest of
    its state's description and one of the plan it would run (one all_gather). When
    every rank's description is what it was on the last call over ``group`` and every
    rank derives the same plan (a training loop's weight sync, a repeated reshard), the
    cached plan runs at once; otherwise the descriptions themselves are exchanged (one
    more all_gather, padded to the longest, whose length came with the digests), merged
    and checked. Where every rank was given the same destination (compared by a digest
    in the first all_gather; not for a callable ``placements``) they plan alike;
    otherwise the reshard checks its plan with each peer before any byte moves.

    Arguments:
        state: this rank's state dict (DTensors, plain tensors, other values); None or
            empty on a rank outside every source mesh. Every rank that passes one
            passes the same names, shapes, dtypes and DTensor placements.
        dst_mesh: the destination DeviceMesh (any shape, ranks and size; built on every
            rank, as torch builds meshes).
        placements: the destination placements of each DTensor (see
            :data:`DstPlacements`).
        group: the process group holding every source and destination rank (default:
            the default group); the metadata exchange and the bytes go over it.
        transport: carries the bytes (default: a ProcessGroupTransport over ``group``).
        timeout: seconds for the exchange.
        route: as :func:`~nereus_comm.reshard.reshard` ("auto" uses shared memory or
            cross-memory attach between ranks on one host).
        donate: the caller gives ``state`` up (a layout change whose old state is
            dropped): a destination shard that is wholly one contiguous block of this
            rank's source shard is that block, with no copy (see
            :func:`~nereus_comm.placement.reshard_sharded`). The source tensors must not
            be used or changed afterwards.

    Returns:
        On a rank of ``dst_mesh``: every entry of the state, DTensors on ``dst_mesh`` with
        their new placements, plain tensors and values as they were. Elsewhere: {}.

    Raises:
        DTensorReshardError: on every rank, before any tensor byte moves: a Partial
            placement, ranks that disagree on an entry, a destination template whose
            shape differs, a placement for a dim the tensor lacks, a missing destination
            placement (each names the tensor).
        TensorMismatchError, PlanError, TransportError: as reshard.
    """
    group = group if group is not None else dist.group.WORLD
    rank = dist.get_rank()
    # to_local() outside autograd is the local tensor itself, with no autograd node.
    with torch.no_grad():
        local = {name: _describe(name, v) for name, v in state.items()} if state else None
        try:
            payload = pickle.dumps(local, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            payload, unpicklable = None, str(e)
        mine = None if payload is None else _digest(payload)
        seen = _SEEN.get(group)
        plan = torch_pl = None
        plan_digest = _NONE
        if seen is not None and mine is not None and seen.meta:
            try:
                plan, torch_pl = plan_dtensors(seen.meta, seen.holders, dst_mesh, placements)
            except DTensorReshardError:
                plan = None  # the full exchange below raises it on every rank
            else:
                call = repr((route, _rank_mesh(dst_mesh).ranks)).encode()
                plan_digest = _digest(b"".join(seen.digests) + plan.digest + call)
        nbytes = -1 if payload is None else len(payload)
        # Without a cached plan to vouch for it, the destination itself is compared.
        dst_digest = _destination_digest(dst_mesh, placements, route) if plan is None else _NONE
        prints = _fingerprints(group, mine or _NONE, plan_digest, dst_digest, nbytes)
        agreed = (
            plan is not None
            and all(p == plan_digest for _, p, _t, _n in prints)
            and tuple(d for d, _p, _t, _n in prints) == seen.digests
        )
        # Equal descriptions merge alike on every rank, and an equal destination then
        # gives every rank the same plan: the per-peer plan check would only repeat it.
        same_destination = dst_digest != _NONE and all(t == dst_digest for *_, t, _n in prints)
        if agreed:
            meta, holders = seen.meta, seen.holders
        else:
            lengths = [n for *_, n in prints]
            if min(lengths) < 0:  # refused on every rank, before any tensor byte moves
                ranks = dist.get_process_group_ranks(group)
                bad = [r for r, n in zip(ranks, lengths) if n < 0]
                why = f": {unpicklable}" if payload is None else ""
                raise DTensorReshardError(
                    f"rank(s) {bad} pass a state entry that does not pickle{why}; values "
                    "other than tensors travel pickled, so pass plain Python values"
                )
            gathered = _gather_descriptions(group, payload, lengths)
            meta, holders = _merge(gathered, dist.get_process_group_ranks(group))
            _SEEN[group] = _Seen(tuple(d for d, *_ in prints), meta, holders)
            if not meta:
                return {}
            plan, torch_pl = plan_dtensors(meta, holders, dst_mesh, placements)
        assert plan is not None and torch_pl is not None
        plan_index = {s.name: i for i, s in enumerate(plan.specs)}
        shards: dict[str, torch.Tensor] = {}
        if state:
            for name, (kind, *_rest) in meta.items():
                # A DTensor on a rank outside its own mesh holds nothing of it.
                if kind == "dtensor" and rank in plan.src[plan_index[name]].mesh:
                    shards[name] = state[name].to_local()
                elif kind == "tensor":
                    shards[name] = state[name].detach()
        if plan.inner is not None and transport is None:
            transport = _TRANSPORTS.get(group)
            if transport is None:
                transport = _TRANSPORTS[group] = ProcessGroupTransport(group)
        # Agreed digests cover every rank's specs, shardings, destination and route,
        # so the per-peer plan check would only repeat them.
        res = reshard_sharded(
            plan,
            rank,
            shards,
            transport,
            timeout=timeout,
            route=route,
            verify_plan=not (agreed or same_destination),
            donate=donate,
        )
        dst_rank_mesh = _rank_mesh(dst_mesh)
        if rank not in dst_rank_mesh:
            return {}
        out: dict[str, Any] = {}
        for name, (kind, shape, _dtype, value) in meta.items():
            if kind == "value":
                out[name] = value
            elif kind == "tensor":
                out[name] = res.tensors[name]
            else:
                out[name] = _to_dtensor(res.tensors[name], dst_mesh, torch_pl[name], shape)
        return out


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))
