"""reshard() and pack() refuse inputs whose bytes are not their data, check the plan
with their peers, and read describable strided views in place.

- Bad tensors (a DTensor, meta, sparse, quantized, a tensor subclass, the wrong
  device, an undescribable strided view) raise TensorMismatchError (PackError for the
  low-level API) that names the tensor and what to pass instead, before the transport
  is asked to move anything.
- Ranks whose specs differ (float32 against int32: equal byte counts; float32 against
  bfloat16: unequal ones; a route that differs) both raise PlanError naming the
  tensor and the ranks, before any data moves; no worker aborts.
- Strided source views (column slices, every other element, a slice of a 3-D
  tensor) give results equal to a torch.chunk reference written here, on every route.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from nereus_comm.errors import PackError, PlanError, TensorMismatchError
from nereus_comm.layout import Layout, TensorSpec
from nereus_comm.pack import Region, copy_regions, pack, unpack
from nereus_comm.plan import plan_reshard
from nereus_comm.reshard import reshard
from nereus_comm.reshard_program import RowView, row_view
from nereus_comm.testing import LocalWorkers, WorkerContext
from nereus_comm.transport import GlooTransport, Transport


class _NoMoves(Transport):
    """A transport that fails the test if anything is posted (validation must come first)."""

    def __init__(self, rank: int, ranks: tuple[int, ...], device_type: str = "cpu") -> None:
        super().__init__()
        self.rank, self.ranks, self.device_type = rank, ranks, device_type

    def _post(self, sends, recvs, timeout, liveness):
        # reshard posts an empty batch when all its pieces are local copies.
        if sends or recvs:
            raise AssertionError(f"posted {len(sends)} sends and {len(recvs)} receives")

    def _wait(self, state) -> None:
        pass


class _Wrapped(torch.Tensor):
    """A tensor subclass standing in for frameworks' wrappers (FakeTensor, Float8Tensor)."""


def _chunk(full: torch.Tensor, spec: TensorSpec, layout: Layout, rank: int) -> torch.Tensor | None:
    """The reference shard: torch.chunk along the split dim (the whole tensor if none)."""
    if rank not in layout:
        return None
    _, _, t = layout.coords(rank)
    if spec.split_dim is None:
        return full.clone()
    parts = torch.chunk(full, layout.tp, dim=spec.split_dim)
    if t < len(parts):
        return parts[t].clone()
    shape = list(full.shape)
    shape[spec.split_dim] = 0  # torch.chunk gave fewer parts: this rank's is empty
    return full.new_empty(shape)


def _quantized(shape: tuple[int, ...]) -> torch.Tensor:
    with warnings.catch_warnings():  # torch deprecates quantized tensors; they still exist
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.randn(shape), 0.1, 0, torch.qint8)


# ------------------------------------------------------------------ single process


SPECS = [TensorSpec("w", (8, 4), torch.float32, 0, None)]
SRC = Layout(1, 2, 1, (0, 1))
DST = Layout(1, 2, 1, (1, 0))


def _raise(tensors: dict, *, device_type: str = "cpu", rank: int = 0, **kw) -> str:
    plan = plan_reshard(SPECS, SRC, DST)
    transport = _NoMoves(rank, (0, 1), device_type)
    with pytest.raises(TensorMismatchError) as info:
        reshard(plan, rank, tensors, transport, timeout=2, **kw)
    assert transport.stats.exchanges == 0
    return str(info.value)


@pytest.mark.parametrize(
    ("make", "want"),
    [
        (lambda: torch.empty(4, 4, device="meta"), "meta device and has no data"),
        (lambda: torch.randn(4, 4).to_sparse(), "to_dense()"),
        (lambda: torch.randn(4, 4).to_sparse_csr(), "to_dense()"),
        (lambda: torch.randn(4, 4).as_subclass(_Wrapped), "tensor subclass"),
        (lambda: torch.randn(4, 4, dtype=torch.complex64).conj(), "resolve_conj()"),
    ],
    ids=["meta", "sparse_coo", "sparse_csr", "subclass", "lazy_conj"],
)
def test_tensor_whose_bytes_are_not_its_data_raises_before_anything_moves(make, want) -> None:
    t = make()
    specs = [TensorSpec("w", (8, 4), t.dtype, 0, None)]
    plan = plan_reshard(specs, SRC, DST)
    transport = _NoMoves(0, (0, 1))
    with pytest.raises(TensorMismatchError) as info:
        reshard(plan, 0, {"w": t}, transport, timeout=2)
    assert "source tensor 'w' on rank 0" in str(info.value) and want in str(info.value)
    assert transport.stats.exchanges == 0


def test_quantized_tensor_raises_even_when_its_dtype_is_the_specs() -> None:
    specs = [TensorSpec("w", (8, 4), torch.qint8, 0, None)]
    plan = plan_reshard(specs, SRC, DST)
    transport = _NoMoves(0, (0, 1))
    with pytest.raises(TensorMismatchError, match=r"'w'.*quantized.*dequantize\(\)"):
        reshard(plan, 0, {"w": _quantized((4, 4))}, transport, timeout=2)
    assert transport.stats.exchanges == 0


def test_tensor_on_a_device_the_transport_does_not_serve_raises() -> None:
    # CPU shards on a transport that moves CUDA memory (an NCCL one).
    msg = _raise({"w": torch.zeros(4, 4)}, device_type="cuda")
    assert "'w'" in msg and "is on cpu" in msg and "moves cuda memory" in msg, msg
    assert "t.to('cuda')" in msg, msg


@pytest.mark.gpu
def test_cuda_tensor_on_a_host_transport_raises() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    msg = _raise({"w": torch.zeros(4, 4, device="cuda")})
    assert "'w'" in msg and "is on cuda:0" in msg and "t.to('cpu')" in msg, msg


def test_transposed_view_is_refused_with_contiguous_advice() -> None:
    shard = torch.randn(4, 4).t().contiguous().t()  # right shape, column-major strides
    msg = _raise({"w": shard})
    assert "'w'" in msg and "strides (1, 4)" in msg and "t.contiguous()" in msg, msg


def test_view_whose_pieces_cross_its_rows_is_refused() -> None:
    # A [2, 3, 4] slice of a [2, 6, 4] tensor, split along dim 2: each piece is 2 x 3
    # runs of 2, which no single row stride describes.
    specs = [TensorSpec("x", (2, 3, 8), torch.float32, 2, None)]
    plan = plan_reshard(specs, Layout(1, 2, 1, (0, 1)), Layout(1, 4, 1, (0, 1, 2, 3)))
    shard = torch.randn(2, 6, 4)[:, 1:4, :]
    assert row_view(shard) == RowView(2, 12, 24)
    transport = _NoMoves(0, (0, 1, 2, 3))
    with pytest.raises(TensorMismatchError, match=r"'x'.*cross its rows.*contiguous\(\)"):
        reshard(plan, 0, {"x": shard}, transport, timeout=2)
    assert transport.stats.exchanges == 0


def test_row_view_describes_slices_and_refuses_the_rest() -> None:
    full = torch.zeros(6, 10)
    assert row_view(full[:, 2:5]) == RowView(6, 3, 10)
    assert row_view(torch.zeros(12)[::2]) == RowView(6, 1, 2)
    assert row_view(torch.zeros(3, 4, 10)[:, :, 1:9]) == RowView(12, 8, 10)
    assert row_view(torch.zeros(3, 4, 10)[:, 1:3, :]) == RowView(3, 20, 40)
    assert row_view(full.t()) is None
    assert row_view(torch.zeros(1, 5).expand(4, 5)) is None  # rows overlap


def test_strided_sources_copied_locally_equal_the_chunk_reference() -> None:
    # One rank, two layouts of its own: every piece is a local copy.
    specs = [
        TensorSpec("col", (6, 10), torch.float32, 1, None),
        TensorSpec("row", (9, 4), torch.bfloat16, 0, None),
        TensorSpec("vec", (7,), torch.int64, None, None),
    ]
    src, dst = Layout(1, 1, 1, (0,)), Layout(1, 1, 1, (0,), num_layers=1)
    full = {s.name: (torch.randn(s.shape) * 100).to(s.dtype) for s in specs}
    wide = torch.zeros(6, 16)
    wide[:, 3:13] = full["col"]
    every_other = torch.zeros(14, dtype=torch.int64)
    every_other[::2] = full["vec"]
    shards = {"col": wide[:, 3:13], "row": full["row"], "vec": every_other[::2]}
    res = reshard(plan_reshard(specs, src, dst), 0, shards, _NoMoves(0, (0,)), timeout=2)
    for s in specs:
        assert torch.equal(res.tensors[s.name], _chunk(full[s.name], s, dst, 0)), s.name


def test_pack_refuses_tensors_whose_bytes_are_not_their_data() -> None:
    cases = {
        "meta device": torch.empty(8, device="meta"),
        "to_dense()": torch.randn(2, 4).to_sparse(),
        "dequantize()": _quantized((8,)),
        "tensor subclass": torch.zeros(8).as_subclass(_Wrapped),
        "resolve_conj()": torch.zeros(8, dtype=torch.complex64).conj(),
    }
    for want, t in cases.items():
        with pytest.raises(PackError, match=f"region 0: tensor .*{want}"):
            pack([Region(t, 0, 1, 4, 4)])
        with pytest.raises(PackError, match=want):
            unpack(torch.zeros(64, dtype=torch.uint8), [Region(t, 0, 1, 4, 4)])
        with pytest.raises(PackError, match=want):
            copy_regions([Region(torch.zeros(8), 0, 1, 4, 4)], [Region(t, 0, 1, 4, 4)])


# ------------------------------------------------------------------ two local ranks

pytest_slow = pytest.mark.slow


@pytest.fixture(scope="module")
def pool():
    with LocalWorkers(2, timeout=60) as p:
        yield p


def _transport(ctx: WorkerContext) -> GlooTransport:
    if "transport" not in ctx.scratch:
        ctx.scratch["transport"] = GlooTransport()
    return ctx.scratch["transport"]


def _dtensor_and_friends(ctx: WorkerContext) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    # Rank 0 holds "a" (stage 0) and rank 1 "b" (stage 1); the destination swaps them.
    specs = [
        TensorSpec("a", (8, 4), torch.float32, None, 0),
        TensorSpec("b", (8, 4), torch.float32, None, 1),
    ]
    src, dst = Layout(1, 1, 2, (0, 1), num_layers=2), Layout(1, 1, 2, (1, 0), num_layers=2)
    plan = plan_reshard(specs, src, dst)
    full = {"a": torch.arange(32.0).view(8, 4), "b": -torch.arange(32.0).view(8, 4)}
    mine = "a" if ctx.rank == 0 else "b"
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    # Replicated: its shape is the spec's, so only what it is tells it apart.
    dt = {n: distribute_tensor(full[n], mesh, [Replicate()]) for n in ("a", "b")}[mine]
    transport = _transport(ctx)
    exchanges = transport.stats.exchanges
    bad = {
        "dtensor": dt,
        "meta": torch.empty(8, 4, device="meta"),
        "sparse": full[mine].to_sparse(),
        "quantized": _quantized((8, 4)),
    }
    messages = {}
    for what, t in bad.items():
        try:
            reshard(plan, ctx.rank, {mine: t}, transport, timeout=5)
            messages[what] = "no error"
        except TensorMismatchError as e:
            messages[what] = str(e)
    quiet = transport.stats.exchanges == exchanges
    # The fix the message names works.
    res = reshard(plan, ctx.rank, {mine: dt.to_local()}, transport, timeout=10)
    theirs = "b" if mine == "a" else "a"
    return {
        "name": mine,
        "messages": messages,
        "quiet": quiet,
        "fixed": torch.equal(res.tensors[theirs], full[theirs]),
    }


@pytest_slow
def test_dtensor_meta_sparse_quantized_raise_on_each_rank_before_any_byte_moves(pool) -> None:
    for r, res in enumerate(pool.run(_dtensor_and_friends)):
        msgs, name = res["messages"], f"'{res['name']}' on rank {r}"
        assert name in msgs["dtensor"] and "DTensor" in msgs["dtensor"], msgs["dtensor"]
        assert "to_local()" in msgs["dtensor"], msgs["dtensor"]
        assert name in msgs["meta"] and "meta device" in msgs["meta"], msgs["meta"]
        assert name in msgs["sparse"] and "to_dense()" in msgs["sparse"], msgs["sparse"]
        assert name in msgs["quantized"] and "dequantize()" in msgs["quantized"], msgs["quantized"]
        assert res["quiet"], f"rank {r} exchanged bytes despite bad input"
        assert res["fixed"], f"rank {r}: to_local() gave wrong bytes"


def _disagreeing(ctx: WorkerContext, rank1_dtype: torch.dtype, kw1: dict, route: str) -> dict:
    """Rank 1 declares w with rank1_dtype (and passes kw1); rank 0 float32; both route."""
    dtype = torch.float32 if ctx.rank == 0 else rank1_dtype
    specs = [
        TensorSpec("bias", (6,), torch.float32, None, None),
        TensorSpec("w", (64, 8), dtype, 0, None),
    ]
    src, dst = Layout(1, 2, 1, (0, 1)), Layout(1, 2, 1, (1, 0))
    plan = plan_reshard(specs, src, dst)
    full = {s.name: torch.ones(s.shape, dtype=s.dtype) for s in specs}
    mine = {s.name: _chunk(full[s.name], s, src, ctx.rank) for s in specs}
    out = {s.name: torch.full_like(_chunk(full[s.name], s, dst, ctx.rank), 7) for s in specs}
    transport = _transport(ctx)
    kw = {"route": route, **(kw1 if ctx.rank == 1 else {})}
    try:
        reshard(plan, ctx.rank, mine, transport, out=out, timeout=10, **kw)
        error = None
    except PlanError as e:
        error = str(e)
    untouched = all(bool((t == 7).all()) for t in out.values())
    # The transport is still whole: an agreeing reshard right after works.
    agree = [TensorSpec("w", (64, 8), torch.float32, 0, None)]
    again = plan_reshard(agree, src, dst)
    w = torch.arange(512.0).view(64, 8)
    res = reshard(again, ctx.rank, {"w": _chunk(w, agree[0], src, ctx.rank)}, transport, timeout=10)
    ok = torch.equal(res.tensors["w"], _chunk(w, agree[0], dst, ctx.rank))
    return {"error": error, "untouched": untouched, "after": ok}


@pytest_slow
@pytest.mark.parametrize(
    ("rank1_dtype", "kw1", "route", "want"),
    [
        # Through gloo, equal byte counts moved garbage and unequal ones aborted a worker.
        (torch.int32, {}, "transport", ["'w'", "float32 [64, 8]", "int32 [64, 8]"]),
        (torch.bfloat16, {}, "transport", ["'w'", "float32 [64, 8]", "bfloat16 [64, 8]"]),
        (torch.bfloat16, {}, "auto", ["'w'", "float32 [64, 8]", "bfloat16 [64, 8]"]),
        (torch.float32, {"route": "shm"}, "auto", ["route=", "'auto' on rank", "'shm' on rank"]),
        (torch.float32, {"direct_min_bytes": 1}, "transport", ["direct_min_bytes="]),
    ],
    ids=["dtype_equal_bytes", "dtype_unequal_bytes", "dtype_auto_route", "route", "direct"],
)
def test_ranks_whose_plans_differ_both_raise_naming_what_differs(
    pool, rank1_dtype, kw1, route, want
) -> None:
    results = pool.run(_disagreeing, rank1_dtype, kw1, route, timeout=60)
    for r, res in enumerate(results):
        err = res["error"]
        assert err is not None, f"rank {r} did not raise"
        assert f"rank {r}: its reshard plan differs" in err, err
        assert f"with rank {1 - r}" in err, err
        for w in want:
            assert w in err, (w, err)
        assert "'bias'" not in err, err  # only what differs is named
        assert res["untouched"], f"rank {r} wrote into out"
        assert res["after"], f"rank {r}: the next reshard failed"


def _strided_sources(ctx: WorkerContext, route: str, direct: int) -> dict:
    specs = [
        TensorSpec("col_split", (6, 40), torch.float32, 1, None),  # columns of a wider matrix
        TensorSpec("row_split", (9, 20), torch.bfloat16, 0, None),
        TensorSpec("vec", (11,), torch.int64, 0, None),  # every other element
        TensorSpec("cube", (3, 4, 10), torch.float32, 2, None),  # a slice of a 3-D tensor
        TensorSpec("bias", (5,), torch.float32, None, None),
    ]
    layouts = [
        (Layout(1, 2, 1, (0, 1)), Layout(1, 2, 1, (1, 0))),  # everything crosses
        (Layout(1, 2, 1, (0, 1)), Layout(2, 1, 1, (0, 1))),  # each gathers the whole
        (Layout(1, 2, 1, (0, 1)), Layout(1, 1, 1, (1,))),  # rank 1 gathers, rank 0 sends
    ]
    g = torch.Generator().manual_seed(5)
    full = {s.name: (torch.randn(s.shape, generator=g) * 1000).to(s.dtype) for s in specs}
    transport = _transport(ctx)
    bad, staged = [], []
    for k, (src, dst) in enumerate(layouts):
        plan = plan_reshard(specs, src, dst)
        mine = {}
        for s in specs:
            shard = _chunk(full[s.name], s, src, ctx.rank)
            if s.name == "col_split" or s.name == "row_split":
                wide = torch.zeros(shard.shape[0], shard.shape[1] + 7, dtype=s.dtype)
                wide[:, 3 : 3 + shard.shape[1]] = shard
                mine[s.name] = wide[:, 3 : 3 + shard.shape[1]]
            elif s.name == "vec":
                spread = torch.zeros(2 * shard.numel(), dtype=s.dtype)
                spread[::2] = shard
                mine[s.name] = spread[::2]
            elif s.name == "cube":
                big = torch.zeros(shard.shape[0], shard.shape[1], shard.shape[2] + 3)
                big[:, :, 1 : 1 + shard.shape[2]] = shard
                mine[s.name] = big[:, :, 1 : 1 + shard.shape[2]]
            else:
                mine[s.name] = shard
        assert any(not t.is_contiguous() for t in mine.values() if t.numel() > 1)
        before = {n: t.clone() for n, t in mine.items()}
        res = reshard(
            plan, ctx.rank, mine, transport, timeout=10, route=route, direct_min_bytes=direct
        )
        for s in specs:
            want = _chunk(full[s.name], s, dst, ctx.rank)
            if want is not None and not torch.equal(res.tensors[s.name], want):
                bad.append((k, s.name))
        bad += [(k, f"{n} changed") for n in mine if not torch.equal(mine[n], before[n])]
        staged.append(res.staged_bytes_sent)
    return {"bad": bad, "staged": staged}


@pytest_slow
@pytest.mark.parametrize(
    ("route", "direct"),
    [("transport", 1), ("transport", 1 << 19), ("shm", 1), ("auto", 1), ("cma", 1)],
)
def test_strided_sources_equal_the_chunk_reference(pool, route: str, direct: int) -> None:
    if route == "cma" and any(pool.run(_cma_blocked)):
        pytest.skip("cross-memory attach is not allowed here")
    for r, res in enumerate(pool.run(_strided_sources, route, direct)):
        assert not res["bad"], f"rank {r}: {res['bad']}"


def _cma_blocked(ctx: WorkerContext) -> dict[int, str]:
    from nereus_comm.transport_cma import CmaRoute

    peers = [p for p in range(ctx.world_size) if p != ctx.rank]
    # Kept in a name: the route holds its control transport weakly.
    control = GlooTransport(dist.new_group(ranks=list(range(ctx.world_size))))
    cma = CmaRoute(control)
    cma.prepare(peers, peers, timeout=30)
    return cma.reasons
