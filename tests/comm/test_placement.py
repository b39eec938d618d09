"""Shardings over N-D meshes: boxes against slices written out here with torch.chunk,
Layout as a Sharding, plan bytes against an independently counted lower bound, and
resharding on 4 local gloo ranks (FSDP x TP to TP, shrink, grow, another rank set,
2-D replication, uneven and empty shards, strided shards) compared bit for bit."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from nereus_comm import GlooTransport, Layout, LayoutError, PlanError, TensorMismatchError
from nereus_comm.layout import TensorSpec, box_shape
from nereus_comm.placement import (
    RankMesh,
    Replicate,
    Shard,
    Sharding,
    StridedShard,
    plan_sharded,
    reshard_sharded,
    sharding_from_layout,
)
from nereus_comm.plan import plan_reshard
from nereus_comm.reshard import reshard
from nereus_comm.testing import LocalWorkers, WorkerContext
from nereus_comm.transport import Transport

WORLD = 4


# -- the independent reference: slicing written out with torch.chunk --------------------


def _chunk(t: torch.Tensor, n: int, dim: int, c: int) -> torch.Tensor:
    """torch.chunk(t, n, dim)[c], or the empty slice where torch.chunk returns fewer."""
    parts = torch.chunk(t, n, dim=dim)
    return parts[c] if c < len(parts) else t.narrow(dim, t.shape[dim], 0)


def reference_local(
    full: torch.Tensor, mesh: list, rank: int, placements: tuple
) -> torch.Tensor | None:
    """The local shard DTensor gives `rank`: placements applied left to right with
    torch.chunk (a strided shard: chunk into split_factor pieces, chunk each, concatenate
    the rank's chunk of every piece)."""
    import numpy as np

    arr = np.array(mesh)
    where = np.argwhere(arr == rank)
    if len(where) == 0:
        return None
    coords = tuple(int(c) for c in where[0])
    t = full
    for m, p in enumerate(placements):
        n, c = arr.shape[m], coords[m]
        if isinstance(p, Replicate):
            continue
        if isinstance(p, StridedShard):
            pieces = [_chunk(t, p.split_factor, p.dim, j) for j in range(p.split_factor)]
            t = torch.cat([_chunk(q, n, p.dim, c) for q in pieces], dim=p.dim)
        else:
            t = _chunk(t, n, p.dim, c)
    return t.contiguous()


def _mesh_ranks(mesh) -> list[int]:
    import numpy as np

    return [int(r) for r in np.array(mesh).reshape(-1)]


def _full(shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-(2**40), 2**40, shape, generator=g, dtype=dtype)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8),
            b.contiguous().reshape(-1).view(torch.uint8),
        )
    )


def lower_bound(tensors, src, dst) -> int:
    """Bytes each destination rank needs but does not hold in the source, counted by
    slicing tensors of element ids (not by the planner's boxes)."""
    total = 0
    for name, shape, dtype in tensors:
        ids = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
        smesh, splace = src[name]
        dmesh, dplace = dst[name]
        for r in set(_mesh_ranks(dmesh)):
            need = reference_local(ids, dmesh, r, dplace)
            have = reference_local(ids, smesh, r, splace)
            held = set() if have is None else set(have.reshape(-1).tolist())
            missing = sum(1 for i in need.reshape(-1).tolist() if i not in held)
            total += missing * dtype.itemsize
    return total


# -- cases: (tensors, src, dst) with meshes as nested lists of ranks ----------------------

M22 = [[0, 1], [2, 3]]
FSDP_TP = (Shard(0), Shard(1))
MIXED = [
    ("w", (8, 12), torch.float32),
    ("b", (7,), torch.bfloat16),  # 7 over 4: chunks of 2, 2, 2, 1
    ("e", (3, 5), torch.int64),  # 3 over 4: the last shard is empty
    ("s", (), torch.float32),  # a scalar, replicated
]


def _same(tensors, mesh, placements_of):
    return {name: (mesh, placements_of(len(shape))) for name, shape, _ in tensors}


def _case(key: str):
    rep = lambda nd: (Replicate(),) * 2  # noqa: E731

    def fsdp_tp(nd):
        return (Shard(0), Shard(1)) if nd == 2 else ((Shard(0), Replicate()) if nd else rep(nd))

    def one(d):
        return lambda nd: (Shard(min(d, nd - 1)),) if nd else (Replicate(),)

    def grid(nd):
        return (Shard(0), Shard(1)) if nd == 2 else ((Shard(0), Replicate()) if nd else rep(nd))

    if key == "fsdp_tp_to_tp4":
        return MIXED, _same(MIXED, M22, fsdp_tp), _same(MIXED, [0, 1, 2, 3], one(1))
    if key == "fsdp_tp_to_2":
        return MIXED, _same(MIXED, M22, fsdp_tp), _same(MIXED, [0, 1], one(0))
    if key == "4_to_3":
        return MIXED, _same(MIXED, M22, fsdp_tp), _same(MIXED, [1, 2, 3], one(0))
    if key == "2_to_4":
        return MIXED, _same(MIXED, [0, 1], one(0)), _same(MIXED, [3, 2, 1, 0], one(0))
    if key == "other_ranks":
        return MIXED, _same(MIXED, [0, 1], one(0)), _same(MIXED, [2, 3], one(1))
    if key == "replicate_2d":
        dst = _same(MIXED, [[3, 1], [0, 2]], lambda nd: (Replicate(), Shard(0)) if nd else rep(nd))
        return MIXED, _same(MIXED, M22, rep), dst
    if key == "strided":
        tensors = [("w", (12, 8), torch.float32), ("b", (11,), torch.bfloat16)]
        fsdp = _same(tensors, M22, lambda nd: (StridedShard(0, 2), Shard(0)))
        return tensors, fsdp, _same(tensors, [0, 1, 2, 3], one(0))
    if key == "to_strided":
        tensors = [("w", (12, 8), torch.float32), ("b", (10,), torch.float32)]
        src = _same(tensors, [2, 3], one(0))
        return tensors, src, _same(tensors, M22, lambda nd: (StridedShard(0, 2), Shard(0)))
    if key == "nested_3d":
        tensors = [("w", (9, 6), torch.float32), ("v", (5, 4, 3), torch.float64)]
        src = _same(tensors, [[[0, 1]], [[2, 3]]], lambda nd: (Shard(0), Replicate(), Shard(0)))
        dst = _same(tensors, [[0, 2], [1, 3]], lambda nd: (Shard(1), Shard(0)))
        return tensors, src, dst
    if key == "grow_to_6":  # ranks 4 and 5 join
        return MIXED, _same(MIXED, M22, fsdp_tp), _same(MIXED, [[0, 1, 2], [3, 4, 5]], grid)
    raise KeyError(key)


CASES = [
    "fsdp_tp_to_tp4",
    "fsdp_tp_to_2",
    "4_to_3",
    "2_to_4",
    "other_ranks",
    "replicate_2d",
    "strided",
    "to_strided",
    "nested_3d",
]


def _build(key: str):
    tensors, src, dst = _case(key)
    specs = [TensorSpec(n, shape, dtype) for n, shape, dtype in tensors]
    src_sh = {n: Sharding(RankMesh.of(m), p) for n, (m, p) in src.items()}
    dst_sh = {n: Sharding(RankMesh.of(m), p) for n, (m, p) in dst.items()}
    return tensors, src, dst, specs, src_sh, dst_sh


# -- single process ----------------------------------------------------------------------


@pytest.mark.parametrize("key", CASES)
def test_fragments_match_torch_chunk(key: str) -> None:
    tensors, src, dst, _, src_sh, dst_sh = _build(key)
    for name, shape, dtype in tensors:
        full = _full(shape, dtype, 1)
        for side, shardings in ((src, src_sh), (dst, dst_sh)):
            mesh, placements = side[name]
            sh = shardings[name]
            for r in range(WORLD):
                want = reference_local(full, mesh, r, placements)
                frags = sh.fragments(shape, r, name)
                if want is None:
                    assert frags is None
                    continue
                local = torch.empty(sh.local_shape(shape, r, name), dtype=dtype)
                assert tuple(local.shape) == tuple(want.shape), (key, name, r)
                for f in frags:
                    dst_sl = tuple(slice(o, o + b - a) for (a, b), o in zip(f.box, f.origin))
                    local[dst_sl] = full[tuple(slice(a, b) for a, b in f.box)]
                assert _bits_equal(local, want), (key, name, r)


@pytest.mark.parametrize("key", CASES)
def test_plan_bytes_equal_lower_bound(key: str) -> None:
    tensors, src, dst, specs, src_sh, dst_sh = _build(key)
    plan = plan_sharded(specs, src_sh, dst_sh)
    want = lower_bound(tensors, src, dst)
    assert plan.total_bytes == plan.lower_bound_bytes == want
    if plan.inner is not None:
        assert plan.inner.stats.total_bytes == want
    # every destination byte arrives exactly once: remote + local = destination bytes
    dst_bytes = sum(
        math.prod(reference_local(torch.zeros(shape), dst[name][0], r, dst[name][1]).shape)
        * dtype.itemsize
        for name, shape, dtype in tensors
        for r in set(_mesh_ranks(dst[name][0]))
    )
    assert plan.total_bytes + plan.local_bytes == dst_bytes


def test_replicated_sources_spread_the_fetches() -> None:
    # Four replicas, four receivers elsewhere: each replica serves one.
    spec = TensorSpec("w", (16, 4), torch.float32)
    src = Sharding(RankMesh.of([[0, 1], [2, 3]]), (Replicate(), Replicate()))
    dst = Sharding(RankMesh.of([4, 5, 6, 7]), (Shard(0),))
    plan = plan_sharded([spec], src, dst)
    assert sorted(p.src for p in plan.remote) == [0, 1, 2, 3]
    assert plan.total_bytes == 16 * 4 * 4


def test_layout_as_sharding_gives_identical_boxes() -> None:
    specs = [
        TensorSpec("emb", (11, 6), torch.float32, 0, 0),
        TensorSpec("q", (10, 7), torch.bfloat16, 1, 1),
        TensorSpec("norm", (7,), torch.float32, None, 2),
        TensorSpec("bias", (5,), torch.float32, 0, None),
        TensorSpec("step", (), torch.float32, None, None),
    ]
    layouts = [
        Layout(2, 2, 1, (0, 1, 2, 3)),
        Layout(1, 3, 2, (5, 4, 3, 2, 1, 0), num_layers=3),
        Layout(2, 1, 3, tuple(range(10, 16)), num_layers=3),
        Layout(2, 4, 1, tuple(range(8)), node_of=(0,) * 4 + (1,) * 4),
    ]
    for layout in layouts:
        for spec in specs:
            sh = sharding_from_layout(layout, spec, 3)
            for r in layout.ranks:
                box = layout.box(spec, r, 3)
                frags = sh.fragments(spec.shape, r, spec.name)
                if box is None:
                    assert frags is None, (layout, spec, r)
                elif math.prod(b - a for a, b in box) == 0:  # an empty chunk: no fragment
                    assert frags == () and sh.local_shape(spec.shape, r) == box_shape(box)
                else:
                    assert frags is not None and len(frags) == 1, (layout, spec, r)
                    assert frags[0].box == box and not any(frags[0].origin)


def test_bad_input_is_refused_naming_the_tensor() -> None:
    mesh = RankMesh.of([0, 1])
    spec = TensorSpec("bias", (4,), torch.float32)
    with pytest.raises(LayoutError, match=r"'bias'.*shards dim 1"):
        plan_sharded([spec], Sharding(mesh, (Shard(1),)), Sharding(mesh, (Shard(0),)))
    with pytest.raises(PlanError, match="'bias' has no dst Sharding"):
        plan_sharded([spec], Sharding(mesh, (Shard(0),)), {})
    with pytest.raises(LayoutError, match="needs 1 placements"):
        Sharding(mesh, (Shard(0), Shard(0)))
    with pytest.raises(LayoutError, match="Partial"):
        Sharding(mesh, ("partial",))
    with pytest.raises(LayoutError, match="distinct"):
        RankMesh.of([0, 0])
    with pytest.raises(LayoutError, match="ragged"):
        RankMesh.of([[0, 1], [2]])
    plan = plan_sharded(
        [spec], Sharding(mesh, (Shard(0),)), Sharding(RankMesh.of([1, 0]), (Shard(0),))
    )
    # A wrong shard shape and a DTensor-like are refused before anything moves.
    with pytest.raises(TensorMismatchError, match=r"'bias' is \(3,\)"):
        reshard_sharded(plan, 0, {"bias": torch.zeros(3)}, None)
    with pytest.raises(TensorMismatchError, match="'bias' is missing"):
        reshard_sharded(plan, 0, {}, None)


# -- on 4 gloo ranks ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool():
    with LocalWorkers(WORLD, timeout=60) as p:
        yield p


def _transport(ctx: WorkerContext) -> GlooTransport:
    if "transport" not in ctx.scratch:
        ctx.scratch["transport"] = GlooTransport(dist.group.WORLD)
    return ctx.scratch["transport"]


def _run_case(ctx: WorkerContext, key: str, route: str) -> dict:
    tensors, src, dst, specs, src_sh, dst_sh = _build(key)
    full = {n: _full(shape, dtype, 7) for n, shape, dtype in tensors}
    mine = {}
    for n in full:
        t = reference_local(full[n], src[n][0], ctx.rank, src[n][1])
        if t is not None:
            mine[n] = t
    plan = plan_sharded(specs, src_sh, dst_sh)
    res = reshard_sharded(plan, ctx.rank, mine, _transport(ctx), timeout=30, route=route)
    bad, names = [], []
    for n in full:
        want = reference_local(full[n], dst[n][0], ctx.rank, dst[n][1])
        if want is None:
            continue
        names.append(n)
        if n not in res.tensors or not _bits_equal(res.tensors[n], want):
            bad.append(n)
    return {
        "bad": bad,
        "names": sorted(names) == sorted(res.tensors),
        "sent": 0 if res.result is None else res.result.bytes_sent,
        "plan": plan.total_bytes,
        # the sources are untouched
        "src_ok": all(
            _bits_equal(mine[n], reference_local(full[n], src[n][0], ctx.rank, src[n][1]))
            for n in mine
        ),
    }


@pytest.mark.parametrize("key", CASES)
def test_reshard_matches_reference(pool, key: str) -> None:
    out = pool.run(_run_case, key, "transport")
    for r, res in enumerate(out):
        assert res["bad"] == [] and res["names"] and res["src_ok"], (key, r, res)
    assert sum(res["sent"] for res in out) == out[0]["plan"]


@pytest.mark.slow
@pytest.mark.parametrize("key", ["fsdp_tp_to_tp4", "strided", "4_to_3"])
def test_reshard_over_same_host_routes(pool, key: str) -> None:
    out = pool.run(_run_case, key, "auto")
    for r, res in enumerate(out):
        assert res["bad"] == [] and res["names"], (key, r, res)


@pytest.mark.slow
def test_grow_from_4_to_6_ranks() -> None:
    tensors, src, dst, *_ = _build("grow_to_6")
    with LocalWorkers(6, timeout=60) as pool6:
        out = pool6.run(_run_case, "grow_to_6", "auto")
    for r, res in enumerate(out):
        assert res["bad"] == [] and res["names"] and res["src_ok"], (r, res)
    assert sum(res["sent"] for res in out) == out[0]["plan"] == lower_bound(tensors, src, dst)


# -- strided destinations and sources: filled and read in place -------------------------------


class _Local(Transport):
    """A one-rank transport that refuses to post anything (every piece is local)."""

    def __init__(self) -> None:
        super().__init__()
        self.rank, self.ranks, self.device_type = 0, (0,), "cpu"

    def _post(self, sends, recvs, timeout, liveness):
        if sends or recvs:
            raise AssertionError(f"posted {len(sends)} sends and {len(recvs)} receives")

    def _wait(self, state) -> None:
        pass


def test_reshard_writes_local_copies_into_strided_out_views() -> None:
    specs = [
        TensorSpec("col", (6, 10), torch.float32, 1, None),
        TensorSpec("cube", (3, 4, 10), torch.bfloat16, 2, None),
        TensorSpec("vec", (7,), torch.int64, None, None),
    ]
    one = Layout(1, 1, 1, (0,))
    plan = plan_reshard(specs, one, Layout(1, 1, 1, (0,), num_layers=1))
    full = {s.name: _full(s.shape, s.dtype, 3) for s in specs}
    wide = torch.zeros(6, 16)
    big = torch.zeros(3, 4, 13, dtype=torch.bfloat16)
    spread = torch.zeros(14, dtype=torch.int64)
    out = {"col": wide[:, 3:13], "cube": big[:, :, 2:12], "vec": spread[::2]}
    res = reshard(plan, 0, dict(full), _Local(), out=out, timeout=2)
    for s in specs:
        assert res.tensors[s.name] is out[s.name]
        assert _bits_equal(out[s.name], full[s.name]), s.name
    assert not wide[:, :3].any() and not wide[:, 13:].any() and not spread[1::2].any()
    # A view no single row stride describes is refused before anything is written.
    with pytest.raises(TensorMismatchError, match=r"'col'.*strides"):
        reshard(plan, 0, dict(full), _Local(), out={**out, "col": torch.zeros(10, 6).t()})


def _strided_case(ctx: WorkerContext, route: str) -> dict:
    # FSDP x TP -> TP4 and back: pieces are column blocks on one side or the other.
    tensors, src, dst, specs, src_sh, dst_sh = _build("fsdp_tp_to_tp4")
    full = {n: _full(shape, dtype, 11) for n, shape, dtype in tensors}
    mine, out, wide = {}, {}, {}
    for n in full:
        t = reference_local(full[n], src[n][0], ctx.rank, src[n][1])
        if t is not None and t.dim() == 2:  # a source read as a transposed copy's view
            t = t.t().contiguous().t()
        if t is not None:
            mine[n] = t
        shape = dst_sh[n].local_shape(full[n].shape, ctx.rank)
        if shape is not None and len(shape) == 2:
            wide[n] = torch.zeros(shape[0], shape[1] + 5, dtype=full[n].dtype)
            out[n] = wide[n][:, 2 : 2 + shape[1]]
        elif shape is not None:
            out[n] = torch.zeros(shape, dtype=full[n].dtype)
    plan = plan_sharded(specs, src_sh, dst_sh)
    res = reshard_sharded(plan, ctx.rank, mine, _transport(ctx), out=out, route=route, timeout=30)
    bad = []
    for n in full:
        want = reference_local(full[n], dst[n][0], ctx.rank, dst[n][1])
        if want is None:
            continue
        if res.tensors[n].data_ptr() != out[n].data_ptr() or not _bits_equal(out[n], want):
            bad.append(n)
        if n in wide and (wide[n][:, :2].any() or wide[n][:, 2 + want.shape[1] :].any()):
            bad.append(f"{n}: wrote outside its view")
    return {"bad": bad}


@pytest.mark.parametrize("route", ["transport", "auto"])
def test_strided_sources_and_destinations_over_4_ranks(pool, route: str) -> None:
    for r, res in enumerate(pool.run(_strided_case, route)):
        assert res["bad"] == [], (r, res)
