"""The native sharded planner (``_C.sharded_plan``) behind ``plan_sharded``.

Random shardings (Shard / Replicate / StridedShard, shard_order, node ids) against a
reference planner written out here: each rank's global indices per tensor dim come from
torch.chunk on index ranges, its boxes are the products of their maximal runs, and the
pieces follow the documented order and holder rule. The plan must match it piece for
piece (order, holder, boxes, bytes) and send exactly the lower bound. Crafted arrays
passed straight to the binding (negative, huge, mismatched, malformed) must raise,
never crash.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus_comm import _C
from nereus_comm.errors import LayoutError, PlanError
from nereus_comm.layout import TensorSpec
from nereus_comm.placement import (
    RankMesh,
    Replicate,
    Shard,
    Sharding,
    StridedShard,
    plan_sharded,
)
from nereus_comm.testing.states import llama_8b_fsdp_tp

POOL = 10  # global ranks 0..9


# -- the reference ---------------------------------------------------------------------------


def _chunk(idx: torch.Tensor, n: int, c: int) -> torch.Tensor:
    parts = torch.chunk(idx, n)
    return parts[c] if c < len(parts) else idx[:0]


def _dim_indices(length: int, sh: Sharding, coords: tuple[int, ...], d: int) -> list[int]:
    """The global indices of tensor dim ``d`` a rank at ``coords`` holds, in local order."""
    order = dict(sh.shard_order or ())
    if d in order:
        mesh_dims = list(order[d])
    else:
        mesh_dims = [
            m for m, p in enumerate(sh.placements) if not isinstance(p, Replicate) and p.dim == d
        ]
    idx = torch.arange(length)
    for m in mesh_dims:
        p, n, c = sh.placements[m], sh.mesh.shape[m], coords[m]
        if isinstance(p, StridedShard):
            idx = torch.cat([_chunk(q, n, c) for q in _pieces(idx, p.split_factor)])
        else:
            idx = _chunk(idx, n, c)
    return idx.tolist()


def _pieces(idx: torch.Tensor, f: int) -> list[torch.Tensor]:
    return [_chunk(idx, f, j) for j in range(f)]


def _runs(indices: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive indices: (global start, global stop, local origin)."""
    out: list[list[int]] = []
    for at, g in enumerate(indices):
        if out and out[-1][1] == g:
            out[-1][1] = g + 1
        else:
            out.append([g, g + 1, at])
    return [tuple(r) for r in out]  # type: ignore[misc]


def _boxes(shape, sh: Sharding, rank: int):
    """(global box, local origin) of every box ``rank`` holds, last dim fastest."""
    i = sh.mesh.ranks.index(rank)
    coords = []
    for size in reversed(sh.mesh.shape):
        i, c = divmod(i, size)
        coords.append(c)
    coords = tuple(reversed(coords))
    per_dim = [_runs(_dim_indices(n, sh, coords, d)) for d, n in enumerate(shape)]
    out = [((), ())]
    for runs in per_dim:
        out = [((*box, (a, b)), (*org, o)) for box, org in out for a, b, o in runs]
    return out


def _node(sh: Sharding, rank: int) -> int:
    return 0 if sh.mesh.node_of is None else sh.mesh.node_of[sh.mesh.ranks.index(rank)]


def _overlap(a, b):
    """The intersection of two boxes, None when empty."""
    cut = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return None if any(x >= y for x, y in cut) else cut


def _local(cut, box, origin):
    """``cut`` (inside ``box``, which starts at ``origin`` locally) in local coordinates."""
    return tuple((a - g0 + o, b - g0 + o) for (a, b), (g0, _), o in zip(cut, box, origin))


def reference_plan(specs, srcs, dsts):
    """(local, remote) as tuples (tensor, src, dst, box, src_local, dst_local, nbytes):
    per tensor, destination ranks ascending, their boxes, the source boxes they overlap
    (sorted); a remote cut from a holder on the receiver's node, then the least loaded,
    then one already sending to the receiver, then the lowest rank."""
    local, remote = [], []
    load: dict[int, int] = {}
    pairs: set[tuple[int, int]] = set()
    for t, (spec, s, d) in enumerate(zip(specs, srcs, dsts)):
        holders: dict = {}
        for h in sorted(s.mesh.ranks):
            for box, org in _boxes(spec.shape, s, h):
                holders.setdefault(box, []).append((h, org))
        for r in sorted(d.mesh.ranks):
            for fbox, forg in _boxes(spec.shape, d, r):
                for sbox in sorted(holders):
                    cut = _overlap(fbox, sbox)
                    if cut is None:
                        continue
                    dloc = _local(cut, fbox, forg)
                    nbytes = math.prod(b - a for a, b in cut) * spec.element_size
                    mine = [org for h, org in holders[sbox] if h == r]
                    if mine:
                        local.append((t, r, r, cut, _local(cut, sbox, mine[0]), dloc, nbytes))
                        continue
                    here = _node(d, r)
                    h, org = min(
                        holders[sbox],
                        key=lambda x, r=r, here=here, s=s: (
                            _node(s, x[0]) != here,
                            load.get(x[0], 0),
                            (x[0], r) not in pairs,
                            x[0],
                        ),
                    )
                    load[h] = load.get(h, 0) + nbytes
                    pairs.add((h, r))
                    remote.append((t, h, r, cut, _local(cut, sbox, org), dloc, nbytes))
    return local, remote


def _lower_bound(specs, srcs, dsts) -> int:
    """Bytes of destination shards their rank does not hold in the source (index sets)."""
    total = 0
    for spec, s, d in zip(specs, srcs, dsts):
        for r in d.mesh.ranks:
            have = set()
            if r in s.mesh.ranks:
                for box, _ in _boxes(spec.shape, s, r):
                    have.update(_cells(box))
            for box, _ in _boxes(spec.shape, d, r):
                total += sum(c not in have for c in _cells(box)) * spec.element_size
    return total


def _cells(box):
    out = [()]
    for a, b in box:
        out = [(*c, i) for c in out for i in range(a, b)]
    return out


# -- random cases ------------------------------------------------------------------------------


@st.composite
def shardings(draw, ndim: int, nodes: list[int] | None) -> Sharding:
    shape: list[int] = []
    for _ in range(draw(st.integers(1, 3))):
        shape.append(draw(st.integers(1, max(1, 8 // max(1, math.prod(shape))))))
    ranks = draw(st.permutations(list(range(POOL))))[: math.prod(shape)]
    choices = [st.just(Replicate())]
    if ndim:
        dims = st.integers(0, ndim - 1)
        choices += [dims.map(Shard), st.builds(StridedShard, dims, st.integers(1, 4))]
    placements = tuple(draw(st.one_of(*choices)) for _ in shape)
    order = None
    if draw(st.booleans()):
        by_dim: dict[int, list[int]] = {}
        for m, p in enumerate(placements):
            if not isinstance(p, Replicate):
                by_dim.setdefault(p.dim, []).append(m)
        groups = []
        for d, ms in by_dim.items():
            picked = draw(st.permutations(ms))
            groups.append((d, tuple(picked[: draw(st.integers(0, len(picked)))])))
        order = tuple(groups) or None
    node_of = None
    if nodes is not None and draw(st.booleans()):
        node_of = tuple(nodes[r] for r in ranks)
    return Sharding(RankMesh(tuple(shape), tuple(ranks), node_of), placements, order)


shapes = st.integers(0, 3).flatmap(lambda n: st.tuples(*[st.integers(0, 9)] * n))
dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.int8])


@st.composite
def cases(draw):
    nodes = draw(st.none() | st.lists(st.sampled_from([0, 1, 5, -2]), min_size=POOL, max_size=POOL))
    specs, srcs, dsts = [], [], []
    for t in range(draw(st.integers(1, 4))):
        shape = draw(shapes)
        specs.append(TensorSpec(f"t{t}", shape, draw(dtypes)))
        # A tensor of the same rank may share the shardings of the one before (as a
        # parameter's optimizer state does), so loads carry over between tensors.
        same = bool(srcs) and len(specs[-2].shape) == len(shape) and draw(st.booleans())
        src, dst = (srcs[-1], dsts[-1]) if same else (None, None)
        srcs.append(src or draw(shardings(len(shape), nodes)))
        dsts.append(dst or draw(shardings(len(shape), nodes)))
    return specs, srcs, dsts


def _rows(pieces):
    return [(p.tensor, p.src, p.dst, p.box, p.src_local, p.dst_local, p.nbytes) for p in pieces]


@settings(max_examples=200, deadline=None)
@given(case=cases())
def test_plan_matches_the_reference_piece_for_piece(case) -> None:
    specs, srcs, dsts = case
    names = [s.name for s in specs]
    plan = plan_sharded(specs, dict(zip(names, srcs)), dict(zip(names, dsts)))
    local, remote = reference_plan(specs, srcs, dsts)
    assert _rows(plan.remote) == remote
    assert _rows(plan.local) == local
    bound = _lower_bound(specs, srcs, dsts)
    assert plan.total_bytes == plan.lower_bound_bytes == bound
    assert plan.local_bytes == sum(p[-1] for p in local)
    for j, p in enumerate(plan.remote):
        assert p.name == f"{names[p.tensor]}@{p.dst}#{j}"
    if plan.inner is None:
        assert not remote
        return
    assert plan.inner.stats.total_bytes == bound
    # The inner plan's specs equal what TensorSpec's checked constructor makes.
    src_ranks, dst_ranks = plan.inner.src.ranks, plan.inner.dst.ranks
    for spec, dspec, p in zip(plan.inner.specs, plan.inner.dst_specs, plan.remote):
        shape = tuple(b - a for a, b in p.box)
        dtype = specs[p.tensor].dtype
        assert spec == TensorSpec(p.name, shape, dtype, None, src_ranks.index(p.src))
        assert dspec == TensorSpec(p.name, shape, dtype, None, dst_ranks.index(p.dst))
    assert len(plan.inner.specs) == len(plan.remote)


def test_per_rank_views_agree_with_the_piece_lists() -> None:
    src = Sharding(RankMesh.of([[0, 1], [2, 3]]), (StridedShard(0, 2), Shard(0)))
    dst = Sharding(RankMesh.of([3, 1, 4]), (Shard(1),))
    specs = [TensorSpec(f"w{i}", (9, 7), torch.float32) for i in range(3)]
    lazy = plan_sharded(specs, src, dst)
    views = {r: (lazy.sends(r), lazy.recvs(r)) for r in lazy.ranks}  # before remote is built
    for r in lazy.ranks:
        assert views[r][0] == [p for p in lazy.remote if p.src == r]
        assert views[r][1] == [p for p in lazy.remote if p.dst == r]
        assert lazy.sends(r) == views[r][0]
        assert lazy._local_to(r) == [p for p in lazy.local if p.dst == r]
    assert lazy.ranks == (0, 1, 2, 3, 4)
    assert repr(lazy).endswith(f"{len(lazy.remote)} remote pieces)")
    # sequence protocol of the inner specs: index, negative index, slice, iteration
    inner = lazy.inner.specs
    assert inner[-1] == list(inner)[-1] and inner[1:3] == tuple(list(inner)[1:3])
    with pytest.raises(IndexError):
        inner[len(inner)]


def test_an_8b_shaped_state_plans_at_the_lower_bound() -> None:
    # The layout of a Llama-3-8B-shaped state: FSDP2 x TP4 on (2, 4) -> FSDP16 on 16 ranks.
    copies = (("", torch.bfloat16), ("m.", torch.float32), ("a.", torch.float32))
    specs, srcs, dst = llama_8b_fsdp_tp(copies)
    plan = plan_sharded(specs, srcs, dst)
    # every element moves but the ones rank r holds in both (computed per tensor kind)
    assert plan.total_bytes == plan.lower_bound_bytes
    assert plan.total_bytes + plan.local_bytes == sum(s.nbytes for s in specs)
    assert len(plan.remote) == 21069 and plan.inner.stats.total_bytes == plan.total_bytes


# -- errors through plan_sharded ---------------------------------------------------------------


def test_errors_name_the_tensor() -> None:
    mesh = RankMesh.of([0, 1])
    spec = TensorSpec("bias", (4,), torch.float32)
    with pytest.raises(LayoutError, match=r"'bias'.*shards dim 1"):
        plan_sharded([spec], Sharding(mesh, (Replicate(),)), Sharding(mesh, (Shard(1),)))
    huge = TensorSpec("huge", (2**62, 4), torch.float32)
    with pytest.raises(PlanError, match=r"huge.*2\*\*63 - 1 bytes"):
        plan_sharded([spec, huge], Sharding(mesh, (Shard(0),)), Sharding(mesh, (Shard(0),)))
    # A split factor that cuts a dim into billions of runs is refused, not attempted.
    long = TensorSpec("long", (2**40,), torch.int8)
    fine = Sharding(mesh, (StridedShard(0, 2**31 - 1),))
    with pytest.raises(PlanError, match=r"cannot plan tensor 'long'.*too finely"):
        plan_sharded([spec, long], Sharding(mesh, (Shard(0),)), fine)


# -- crafted arrays straight into the binding ------------------------------------------------

FIELDS = (
    "tensor_ndim",
    "tensor_shape",
    "tensor_elem_size",
    "tensor_src",
    "tensor_dst",
    "mesh_ndim",
    "mesh_shape",
    "kind",
    "dim",
    "split_factor",
    "ranks",
    "nodes",
    "order_offset",
    "order",
)


def _valid() -> dict[str, np.ndarray]:
    """Two tensors over a (2, 2) FSDP x TP sharding (with a shard_order) and a 3-rank one."""
    a = {
        "tensor_ndim": [2, 1],
        "tensor_shape": [8, 6, 5],
        "tensor_elem_size": [4, 2],
        "tensor_src": [0, 0],
        "tensor_dst": [1, 1],
        "mesh_ndim": [2, 1],
        "mesh_shape": [2, 2, 3],
        "kind": [2, 1, 1],
        "dim": [0, 0, 0],
        "split_factor": [2, 0, 0],
        "ranks": [0, 1, 2, 3, 1, 2, 4],
        "nodes": [0, 0, 1, 1, 0, 1, 1],
        "order_offset": [0, 4, 4],
        "order": [0, 2, 1, 0],
    }
    return {k: np.array(v, np.int64) for k, v in a.items()}


def _call(arrays: dict[str, np.ndarray]):
    return _C.sharded_plan(*(arrays[k] for k in FIELDS))


def test_the_binding_plans_the_valid_input() -> None:
    raw = _call(_valid())
    assert raw.lower_bound_bytes == raw.remote_bytes > 0
    assert len(raw.box_offset) == len(raw.tensor) + 1 and raw.num_remote == raw.remote.sum()
    with pytest.raises(ValueError, match="read-only"):
        raw.tensor[0] = 1


BAD = [
    ("tensor_ndim", [2, -1], "negative number of dims"),
    ("tensor_ndim", [2, 2], "fewer sizes"),
    ("tensor_ndim", [2**62, 2**62], "past 2\\^63 - 1|fewer sizes"),
    ("tensor_ndim", [2], "one element size"),
    ("tensor_shape", [8, -6, 5], "negative tensor size"),
    ("tensor_shape", [8, 6, 5, 1], "tensor_shape holds"),
    ("tensor_shape", [2**62, 2**62, 5], "bytes exceed"),
    ("tensor_elem_size", [4, 0], "element size"),
    ("tensor_elem_size", [2**62, 2], "bytes exceed"),
    ("tensor_src", [0, 2], "sharding index"),
    ("tensor_dst", [-1, 1], "sharding index"),
    ("mesh_ndim", [2, -1], "mesh_ndim out of range"),
    ("mesh_ndim", [2, 2], "mesh_ndim out of range"),
    ("mesh_ndim", [1, 1], "shard_order names mesh dim 1"),
    ("mesh_shape", [2, 0, 3], "mesh size"),
    ("mesh_shape", [2**40, 2**40, 3], "more entries than ranks"),
    ("mesh_shape", [2, 2, 4], "more entries than ranks"),
    ("mesh_shape", [2, 2, 2], "ranks holds more entries"),
    ("kind", [2, 1, 7], "unknown placement kind"),
    ("kind", [-1, 1, 1], "unknown placement kind"),
    ("dim", [0, 0, -3], "negative tensor dim"),
    ("dim", [0, 0, 5], "shards dim 5"),
    ("split_factor", [0, 0, 0], "split factor"),
    ("ranks", [0, 1, 2, 3, 1, 2, -4], "negative rank"),
    ("ranks", [0, 1, 2, 2, 1, 2, 4], "repeated rank"),
    ("ranks", [0, 1, 2, 3, 1, 2], "one entry per mesh entry"),
    ("nodes", [0, 0, 1], "one entry per mesh entry"),
    ("order_offset", [0, 4], "order_offset needs"),
    ("order_offset", [0, 5, 4], "must not decrease|cut off|malformed"),
    ("order_offset", [1, 4, 4], "start at 0"),
    ("order", [0, 3, 1, 0], "malformed shard_order"),
    ("order", [0, 2, 1, 9], "names mesh dim 9"),
    ("order", [1, 2, 1, 0], "does not shard"),
    ("order", [-1, 2, 1, 0], "malformed shard_order"),
]


@pytest.mark.parametrize(("field", "value", "message"), BAD)
def test_crafted_arrays_raise(field: str, value: list[int], message: str) -> None:
    arrays = _valid()
    arrays[field] = np.array(value, np.int64)
    with pytest.raises(ValueError, match=message):
        _call(arrays)


def test_arrays_of_the_wrong_kind_raise() -> None:
    arrays = _valid()
    arrays["ranks"] = arrays["ranks"].reshape(1, -1)
    with pytest.raises(ValueError, match="1-D"):
        _call(arrays)
    arrays = _valid()
    arrays["tensor_shape"] = arrays["tensor_shape"].astype(np.float64) + 0.5
    with pytest.raises(TypeError):
        _call(arrays)
    with pytest.raises(TypeError):
        _C.sharded_plan(*([np.array([2**70], dtype=object)] * len(FIELDS)))


def test_work_is_bounded() -> None:
    # A dim of 2**56 split 2**40 ways, and a mesh of 2**20 size-1 dims each splitting a
    # dim 2**20 ways: refused after a bounded number of steps, not carried out.
    arrays = _valid()
    arrays["tensor_shape"] = np.array([2**56, 1, 5], np.int64)
    arrays["split_factor"] = np.array([2**40, 0, 0], np.int64)
    with pytest.raises(ValueError, match="too finely"):
        _call(arrays)
    many = 2**20
    arrays = _valid()
    arrays["mesh_ndim"] = np.array([many, 1], np.int64)
    arrays["mesh_shape"] = np.ones(many + 1, np.int64)
    arrays["kind"] = np.full(many + 1, 2, np.int64)
    arrays["dim"] = np.zeros(many + 1, np.int64)
    arrays["split_factor"] = np.full(many + 1, 2**20, np.int64)
    arrays["ranks"] = np.array([0, 1], np.int64)
    arrays["nodes"] = np.array([0, 0], np.int64)
    arrays["order_offset"] = np.array([0, 0, 0], np.int64)
    arrays["order"] = np.array([], np.int64)
    arrays["tensor_shape"] = np.array([10**9, 6, 5], np.int64)
    with pytest.raises(ValueError, match="too finely"):
        _call(arrays)


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    field=st.sampled_from(FIELDS),
    values=st.lists(
        st.one_of(st.integers(-3, 12), st.sampled_from([2**31, 2**62, 2**63 - 1, -(2**63)])),
        max_size=12,
    ),
)
def test_random_arrays_raise_or_plan(seed: int, field: str, values: list[int]) -> None:
    """Any array in any field: a plan or a ValueError, never a crash or a hang."""
    arrays = _valid()
    arrays[field] = np.array(values, np.int64)
    rng = random.Random(seed)
    if rng.random() < 0.5:  # and one value of another field replaced
        other = rng.choice(FIELDS)
        if len(arrays[other]):
            arrays[other] = arrays[other].copy()
            arrays[other][rng.randrange(len(arrays[other]))] = rng.choice([-1, 0, 3, 2**40])
    try:
        raw = _call(arrays)
    except ValueError:
        return
    n = len(raw.tensor)
    assert len(raw.box_offset) == n + 1 and raw.box_offset[-1] == len(raw.box)
    assert raw.remote_bytes == raw.lower_bound_bytes == int(raw.nbytes[raw.remote == 1].sum())
