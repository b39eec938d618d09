"""Random shardings (Shard / Replicate / StridedShard) on 1-D to 3-D meshes of up to 8
ranks, uneven and empty sizes, against a reference that slices with torch.chunk here.

Fast lane (no processes): each rank's fragments reassemble exactly its reference shard;
a plan between two random shardings, carried out here piece by piece, fills every
destination element exactly once with the right value and sends exactly the lower bound
(elements a destination rank lacks in the source, counted by index sets). Slow: a few
random training states (bf16 parameters, fp32 master and Adam moments, a plain step)
resharded by ``reshard_sharded`` over 8 local gloo ranks, some into strided ``out``
views, every byte compared with the reference.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus_comm.layout import TensorSpec
from nereus_comm.placement import (
    RankMesh,
    Replicate,
    Shard,
    Sharding,
    StridedShard,
    plan_sharded,
    reshard_sharded,
)
from nereus_comm.testing import LocalWorkers, WorkerContext

MAX_RANKS = 8
FUZZ = settings(max_examples=150, deadline=None)


# -- the reference ------------------------------------------------------------------------------


def _chunk(t: torch.Tensor, n: int, dim: int, c: int) -> torch.Tensor:
    parts = torch.chunk(t, n, dim=dim)
    return parts[c] if c < len(parts) else t.narrow(dim, t.shape[dim], 0)


def reference(full: torch.Tensor, mesh: RankMesh, placements, rank: int) -> torch.Tensor | None:
    """``rank``'s shard: torch.chunk per mesh dim, left to right; a strided shard chunks
    each of its split_factor pieces and concatenates the rank's chunk of each."""
    if rank not in mesh.ranks:
        return None
    i = mesh.ranks.index(rank)
    coords = []
    for size in reversed(mesh.shape):
        i, c = divmod(i, size)
        coords.append(c)
    coords.reverse()
    t = full
    for n, c, p in zip(mesh.shape, coords, placements):
        if isinstance(p, StridedShard):
            f = p.split_factor
            t = torch.cat([_chunk(_chunk(t, f, p.dim, j), n, p.dim, c) for j in range(f)], p.dim)
        elif isinstance(p, Shard):
            t = _chunk(t, n, p.dim, c)
    return t.contiguous()


def _index(shape) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return torch.arange(n, dtype=torch.int64).reshape(shape)


def _lower_bound(spec: TensorSpec, src: Sharding, dst: Sharding) -> int:
    full = _index(spec.shape)
    missing = 0
    for r in dst.mesh.ranks:
        want = reference(full, dst.mesh, dst.placements, r)
        have = reference(full, src.mesh, src.placements, r)
        if have is None:
            missing += want.numel()
        else:
            missing += int((~torch.isin(want.reshape(-1), have.reshape(-1))).sum())
    return missing * spec.element_size


# -- random cases ----------------------------------------------------------------------------------


@st.composite
def meshes(draw, pool: int = MAX_RANKS) -> RankMesh:
    shape: list[int] = []
    for _ in range(draw(st.integers(1, 3))):
        room = MAX_RANKS // max(1, _prod(shape))
        shape.append(draw(st.integers(1, max(1, room))))
    ranks = draw(st.permutations(list(range(pool))))[: _prod(shape)]
    return RankMesh(tuple(shape), tuple(ranks))


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


@st.composite
def shardings(draw, ndim: int) -> Sharding:
    mesh = draw(meshes())
    choices = [st.just(Replicate())]
    if ndim:
        dims = st.integers(0, ndim - 1)
        choices.append(dims.map(Shard))
        choices.append(st.builds(StridedShard, dims, st.integers(1, 3)))
    placements = tuple(draw(st.one_of(*choices)) for _ in mesh.shape)
    return Sharding(mesh, placements)


shapes = st.integers(0, 3).flatmap(lambda n: st.tuples(*[st.integers(0, 9)] * n))


@FUZZ
@given(data=st.data())
def test_fragments_reassemble_the_reference_shard(data) -> None:
    shape = data.draw(shapes)
    sh = data.draw(shardings(len(shape)))
    full = _index(shape)
    for r in range(MAX_RANKS):
        want = reference(full, sh.mesh, sh.placements, r)
        frags = sh.fragments(shape, r)
        if want is None:
            assert frags is None and sh.local_shape(shape, r) is None
            continue
        assert sh.local_shape(shape, r) == tuple(want.shape)
        got = torch.full(want.shape, -1, dtype=torch.int64)
        for f in frags:
            local = tuple(slice(o, o + b - a) for o, (a, b) in zip(f.origin, f.box))
            got[local] = full[tuple(slice(a, b) for a, b in f.box)]
        assert torch.equal(got, want), (sh, r)


def _training_specs(shape, other_shape):
    """A bf16 parameter with its fp32 master and Adam moments, a second parameter and a
    0-dim step: the shardings of a parameter serve its optimizer state."""
    return [
        TensorSpec("w", shape, torch.bfloat16),
        TensorSpec("master.w", shape, torch.float32),
        TensorSpec("optim.exp_avg.w", shape, torch.float32),
        TensorSpec("optim.exp_avg_sq.w", shape, torch.float32),
        TensorSpec("b", other_shape, torch.bfloat16),
        TensorSpec("optim.step.w", (), torch.float32),
    ]


def _case(data):
    shape, other = data.draw(shapes), data.draw(shapes)
    specs = _training_specs(shape, other)
    src_w, dst_w = data.draw(shardings(len(shape))), data.draw(shardings(len(shape)))
    src_b, dst_b = data.draw(shardings(len(other))), data.draw(shardings(len(other)))
    src_s, dst_s = data.draw(shardings(0)), data.draw(shardings(0))
    src = {s.name: src_w for s in specs[:4]} | {"b": src_b, "optim.step.w": src_s}
    dst = {s.name: dst_w for s in specs[:4]} | {"b": dst_b, "optim.step.w": dst_s}
    return specs, src, dst


@FUZZ
@given(data=st.data())
def test_plan_fills_every_element_once_and_sends_the_lower_bound(data) -> None:
    specs, src, dst = _case(data)
    plan = plan_sharded(specs, src, dst)
    bound = sum(_lower_bound(s, src[s.name], dst[s.name]) for s in specs)
    assert plan.total_bytes == plan.lower_bound_bytes == bound
    for t, spec in enumerate(specs):
        full = _index(spec.shape)
        s, d = src[spec.name], dst[spec.name]
        held = {r: reference(full, s.mesh, s.placements, r) for r in s.mesh.ranks}
        for r in d.mesh.ranks:
            want = reference(full, d.mesh, d.placements, r)
            got = torch.full(want.shape, -1, dtype=torch.int64)
            count = torch.zeros(want.shape, dtype=torch.int64)
            for p in (*plan.local, *plan.remote):
                if p.tensor != t or p.dst != r:
                    continue
                assert p.src in held and (p.src == r) == (p.name is None)
                dsl = tuple(slice(a, b) for a, b in p.dst_local)
                got[dsl] = held[p.src][tuple(slice(a, b) for a, b in p.src_local)]
                count[dsl] += 1
            assert torch.equal(got, want), (spec.name, r)
            assert bool((count == 1).all()), (spec.name, r, "an element filled twice or never")


# -- slow: the real exchange over 8 gloo ranks ----------------------------------------------


def _random_sharding(rng: random.Random, ndim: int) -> Sharding:
    shape: list[int] = []
    for _ in range(rng.randint(1, 3)):
        shape.append(rng.randint(1, max(1, MAX_RANKS // max(1, _prod(shape)))))
    ranks = rng.sample(range(MAX_RANKS), _prod(shape))
    placements = []
    for _ in shape:
        k = rng.random()
        if ndim == 0 or k < 0.3:
            placements.append(Replicate())
        elif k < 0.7:
            placements.append(Shard(rng.randrange(ndim)))
        else:
            placements.append(StridedShard(rng.randrange(ndim), rng.randint(1, 3)))
    return Sharding(RankMesh(tuple(shape), tuple(ranks)), tuple(placements))


def _random_case(seed: int):
    rng = random.Random(seed)
    shape = tuple(rng.randint(0, 37) for _ in range(rng.randint(1, 3)))
    other = tuple(rng.randint(1, 19) for _ in range(rng.randint(1, 2)))
    specs = _training_specs(shape, other)
    sw, dw = _random_sharding(rng, len(shape)), _random_sharding(rng, len(shape))
    src = {s.name: sw for s in specs[:4]} | {"b": _random_sharding(rng, len(other))}
    dst = {s.name: dw for s in specs[:4]} | {"b": _random_sharding(rng, len(other))}
    src["optim.step.w"], dst["optim.step.w"] = _random_sharding(rng, 0), _random_sharding(rng, 0)
    return specs, src, dst


def _full(spec: TensorSpec) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, spec.name)))
    return (torch.randn(spec.shape, generator=g) * 100).to(spec.dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _exchange(ctx: WorkerContext, seeds: list[int], route: str, strided_out: bool) -> list:
    from nereus_comm import GlooTransport

    transport = ctx.scratch.setdefault("fuzz_transport", GlooTransport())
    bad = []
    for seed in seeds:
        specs, src, dst = _random_case(seed)
        plan = plan_sharded(specs, src, dst)
        fulls = {s.name: _full(s) for s in specs}
        mine = {}
        for s in specs:
            shard = reference(fulls[s.name], src[s.name].mesh, src[s.name].placements, ctx.rank)
            if shard is not None:
                mine[s.name] = shard
        out = None
        if strided_out:  # each destination shard a column block of a wider buffer
            out = {}
            for s in specs:
                shape = dst[s.name].local_shape(s.shape, ctx.rank)
                if shape is None:
                    continue
                if len(shape) >= 2:
                    wide = torch.zeros(*shape[:-1], shape[-1] + 3, dtype=s.dtype)
                    out[s.name] = wide[..., 1 : 1 + shape[-1]]
                else:
                    out[s.name] = torch.zeros(shape, dtype=s.dtype)
        res = reshard_sharded(plan, ctx.rank, mine, transport, out=out, route=route, timeout=60)
        for s in specs:
            want = reference(fulls[s.name], dst[s.name].mesh, dst[s.name].placements, ctx.rank)
            got = res.tensors.get(s.name)
            if want is None:
                if got is not None:
                    bad.append((seed, s.name, "a shard on a rank outside the destination"))
                continue
            if got is None or got.shape != want.shape or not torch.equal(_bits(got), _bits(want)):
                bad.append((seed, s.name))
            elif out is not None and got.data_ptr() != out[s.name].data_ptr():
                bad.append((seed, s.name, "not written into out"))
        if plan.total_bytes != plan.lower_bound_bytes:
            bad.append((seed, "bytes", plan.total_bytes, plan.lower_bound_bytes))
    return bad


@pytest.fixture(scope="module")
def pool():
    with LocalWorkers(MAX_RANKS, timeout=120) as p:
        yield p


@pytest.mark.slow
@pytest.mark.parametrize(
    ("route", "strided_out"),
    [("auto", False), ("transport", False), ("auto", True), ("transport", True)],
)
def test_random_training_states_over_8_ranks(pool, route, strided_out) -> None:
    seeds = list(range(100, 106)) if not strided_out else list(range(200, 206))
    for r, bad in enumerate(pool.run(_exchange, seeds, route, strided_out, timeout=300)):
        assert not bad, f"rank {r}: {bad[:5]}"
