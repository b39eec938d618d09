"""ProcessGroupTransport: over a gloo subgroup of 4 local processes whose group ranks
are not the global ranks (reshard against a torch.chunk reference, a dead peer, a
silent peer, bad arguments), and over NCCL where a GPU is present."""

from __future__ import annotations

import datetime
import os
import queue
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nereus_comm import (
    Layout,
    PeerLostError,
    PeerTimeoutError,
    ProcessGroupTransport,
    TensorMismatchError,
    TensorSpec,
    TransportArgumentError,
    plan_reshard,
    reshard,
)
from nereus_comm.testing import LocalWorkers, WorkerContext

WORLD = 4
# Global ranks 1, 2, 3 form the subgroup: group ranks 0, 1, 2.
MEMBERS = (1, 2, 3)


@pytest.fixture(scope="module")
def pool():
    with LocalWorkers(WORLD, timeout=60) as p:
        yield p


def _subgroup(ctx: WorkerContext) -> ProcessGroupTransport | None:
    # new_group is collective over the default group: every process calls it.
    group = dist.new_group(ranks=list(MEMBERS))
    return ProcessGroupTransport(group) if ctx.rank in MEMBERS else None


class _Counting(ProcessGroupTransport):
    """Counts the batches it posts (to show that bad arguments post nothing)."""

    posted = 0

    def _issue(self, ops):
        self.posted += 1
        return super()._issue(ops)


SPECS = [
    TensorSpec("rows", (10, 6), torch.float32, 0, None),
    TensorSpec("cols", (5, 7), torch.bfloat16, 1, None),
    TensorSpec("ids", (9,), torch.int64, 0, None),
    TensorSpec("norm", (6,), torch.float32, None, None),  # replicated
]


def _full(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for s in SPECS:
        if s.dtype.is_floating_point:
            out[s.name] = torch.randn(s.shape, generator=g).to(s.dtype)
        else:
            out[s.name] = torch.randint(-(2**40), 2**40, s.shape, generator=g, dtype=s.dtype)
    return out


def _reference(full: dict[str, torch.Tensor], tp_ranks: tuple[int, ...], rank: int) -> dict:
    """Rank's shards of a dp=1, pp=1 layout, cut by torch.chunk (not by the planner)."""
    t = tp_ranks.index(rank)
    out = {}
    for s in SPECS:
        if s.split_dim is None:
            out[s.name] = full[s.name].clone()
            continue
        pieces = torch.chunk(full[s.name], len(tp_ranks), dim=s.split_dim)
        if t < len(pieces):
            out[s.name] = pieces[t].contiguous()
        else:  # torch.chunk returned fewer pieces: this rank's range is empty
            shape = list(s.shape)
            shape[s.split_dim] = 0
            out[s.name] = torch.empty(shape, dtype=s.dtype)
    return out


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


# tp over global ranks 1, 2, 3 -> tp over 3, 1, 2: every member sends and receives.
SRC_TP, DST_TP = (1, 2, 3), (3, 1, 2)


def _reshard_on_subgroup(ctx: WorkerContext, seed: int, route: str) -> dict:
    t = _subgroup(ctx)
    if t is None:
        return {}
    full = _full(seed)
    plan = plan_reshard(SPECS, Layout(1, 3, 1, SRC_TP), Layout(1, 3, 1, DST_TP))
    mine = _reference(full, SRC_TP, ctx.rank)
    res = reshard(plan, ctx.rank, mine, t, timeout=30, route=route)
    want = _reference(full, DST_TP, ctx.rank)
    return {
        "names": sorted(res.tensors) == sorted(want),
        "bad": [n for n in want if not _bytes_equal(res.tensors[n], want[n])],
        "ranks": t.ranks,
        "group_rank": dist.get_group_rank(t.group, ctx.rank),
        # the transport also carried the plan check's records
        "bytes_sent": t.stats.bytes_sent - res.verify_bytes,
        "plan_sent": sum(m.nbytes for m in plan.sends(ctx.rank)),
        "repr": repr(t),
    }


@pytest.mark.slow
@pytest.mark.parametrize("route", ["transport", "auto"])
def test_reshard_on_a_subgroup_matches_torch_chunk(pool, route) -> None:
    out = pool.run(_reshard_on_subgroup, 7, route)
    assert out[0] == {}
    for r in MEMBERS:
        res = out[r]
        assert res["names"] and res["bad"] == [], (r, res)
        assert res["ranks"] == MEMBERS
        assert res["group_rank"] == r - 1  # global ranks are not group ranks
        if route == "transport":  # every byte went over the group
            assert res["bytes_sent"] == res["plan_sent"] > 0, res
        assert res["repr"].startswith(f"ProcessGroupTransport(rank={r}, ranks=[1, 2, 3]")


def _bad_args(ctx: WorkerContext) -> list[str] | None:
    group = dist.new_group(ranks=list(MEMBERS))
    if ctx.rank not in MEMBERS:
        return None
    t = _Counting(group)
    me, other = ctx.rank, MEMBERS[(MEMBERS.index(ctx.rank) + 1) % len(MEMBERS)]
    cases = [
        ([(me, torch.zeros(2))], []),  # self
        ([(0, torch.zeros(2))], []),  # global rank 0 is outside the group
        ([], [(4, torch.zeros(2))]),  # no such rank
        ([(other, torch.zeros(4, 4).t())], []),  # non-contiguous
        ([(other, torch.zeros(2))], [(other, torch.zeros(4, 4)[:, 1])]),  # a good send first
    ]
    errors = []
    for sends, recvs in cases:
        try:
            t.exchange(sends, recvs, timeout=5)
            errors.append("no error")
        except (TransportArgumentError, TensorMismatchError) as e:
            errors.append(type(e).__name__)
    assert t.posted == 0 and t.stats.exchanges == 0, "something was posted"
    return errors


@pytest.mark.slow
def test_bad_arguments_raise_before_posting(pool) -> None:
    out = pool.run(_bad_args)
    assert out[0] is None
    for r in MEMBERS:
        assert out[r] == [
            "TransportArgumentError",
            "TransportArgumentError",
            "TransportArgumentError",
            "TensorMismatchError",
            "TensorMismatchError",
        ], r


def _construction_errors(ctx: WorkerContext) -> list[str]:
    group = dist.new_group(ranks=list(MEMBERS))
    cases = []
    if ctx.rank not in MEMBERS:
        cases.append(lambda: ProcessGroupTransport(group))  # not a member
    else:
        cases.append(lambda: ProcessGroupTransport(group, device_type="tpu"))
        cases.append(lambda: ProcessGroupTransport(group, chunk_bytes=0))
        if not torch.cuda.is_available():
            cases.append(lambda: ProcessGroupTransport(group, device_type="cuda"))
    messages = []
    for make in cases:
        try:
            make()
            messages.append("no error")
        except TransportArgumentError as e:
            messages.append(str(e))
    # The default group: every process, global ranks == group ranks.
    t = ProcessGroupTransport()
    assert (t.rank, t.ranks, t.device_type, t.backend) == (ctx.rank, (0, 1, 2, 3), "cpu", "gloo")
    return messages


@pytest.mark.slow
def test_construction_checks(pool) -> None:
    out = pool.run(_construction_errors)
    assert "not a member" in out[0][0]
    for r in MEMBERS:
        assert "device_type must be" in out[r][0]
        assert "chunk_bytes must be >= 1" in out[r][1]
        if len(out[r]) > 2:
            assert "CUDA is not available" in out[r][2]


def _silent_peer(ctx: WorkerContext, timeout: float) -> dict:
    # A fresh group: a gloo timeout closes the pairs for good. Global rank 2 never
    # posts (looks dead to rank 1); rank 3 is a healthy peer of the same batch.
    t = _subgroup(ctx)
    if ctx.rank == 2:
        time.sleep(timeout + 1.0)
    if ctx.rank != 1:
        if ctx.rank == 3:
            t.exchange([(1, torch.ones(8))], [], timeout=timeout)
        return {}
    start = time.monotonic()
    try:
        t.exchange([], [(2, torch.empty(8)), (3, torch.empty(8))], timeout=timeout)
    except PeerTimeoutError as e:
        elapsed = time.monotonic() - start
        try:
            t.exchange([], [(3, torch.empty(8))], timeout=timeout)
            again = None
        except TransportArgumentError as e2:
            again = str(e2)
        return {"error": str(e), "lost": isinstance(e, PeerLostError), "elapsed": elapsed,
                "again": again}  # fmt: skip
    return {"error": None}


@pytest.mark.slow
def test_silent_peer_times_out_naming_it(pool) -> None:
    timeout = 1.0
    res = pool.run(_silent_peer, timeout, timeout=30)[1]
    assert res["error"] is not None, "no PeerTimeoutError"
    assert not res["lost"]  # no liveness: a timeout, not a known death
    assert "peers 2 " in res["error"] and "recv from 2" in res["error"], res
    assert "recv from 3" not in res["error"]  # the healthy peer is not blamed
    assert timeout * 0.9 <= res["elapsed"] < timeout + 2.0
    assert "broke earlier" in res["again"]


def _dead_peer(ctx: WorkerContext, timeout: float) -> dict:
    # Global rank 2 never posts; liveness reports it dead after 0.5 s. Rank 0 is
    # outside the group: its reported death must not end the group's exchange.
    t = _subgroup(ctx)
    if ctx.rank == 2:
        time.sleep(3.0)
        return {}
    if ctx.rank == 3:
        t.exchange([(1, torch.ones(8))], [], timeout=timeout, liveness=lambda: {0})
        try:
            t.exchange([(1, torch.ones(8))], [], timeout=timeout, liveness=lambda: {2})
        except PeerLostError:
            pass
        return {}
    if ctx.rank == 0:
        return {}
    got = torch.zeros(8)
    t.exchange([], [(3, got)], timeout=timeout, liveness=lambda: {0})
    start = time.monotonic()

    def liveness() -> set[int]:
        return {0, 2} if time.monotonic() > start + 0.5 else {0}

    try:
        t.exchange([], [(2, torch.empty(8)), (3, torch.empty(8))], timeout=timeout,
                   liveness=liveness)  # fmt: skip
    except PeerLostError as e:
        return {"delivered": bool(got.eq(1).all()), "ranks": e.ranks, "error": str(e),
                "elapsed": time.monotonic() - start}  # fmt: skip
    return {"error": None}


@pytest.mark.slow
def test_dead_peer_with_liveness_raises_naming_it(pool) -> None:
    res = pool.run(_dead_peer, 30.0, timeout=60)[1]
    assert res["error"] is not None, "no PeerLostError"
    assert res["delivered"], "a death outside the group ended an exchange of the group"
    assert res["ranks"] == (2,), res
    assert "rank 2 died" in res["error"], res
    assert 0.4 < res["elapsed"] < 3.0, res  # not the 30 s timeout


def _empty_and_chunked(ctx: WorkerContext) -> dict:
    t = _subgroup(ctx)
    if t is None:
        return {}
    small = ProcessGroupTransport(t.group, chunk_bytes=7)
    me = ctx.rank
    others = [r for r in MEMBERS if r != me]
    ok = True
    for tr in (t, small):
        tr.exchange([], [], timeout=5)  # nothing to move: returns at once
        sends = [(p, torch.arange(100, dtype=torch.int16) + 1000 * me) for p in others]
        sends.append((others[0], torch.empty(0)))  # empty buffers are skipped
        recvs = [(p, torch.empty(100, dtype=torch.int16)) for p in others]
        tr.exchange(sends, recvs, timeout=30)
        ok &= all(torch.equal(b, torch.arange(100, dtype=torch.int16) + 1000 * p) for p, b in recvs)
    return {"ok": ok, "stats": small.stats}


@pytest.mark.slow
def test_empty_buffers_and_chunks(pool) -> None:
    out = pool.run(_empty_and_chunked)
    for r in MEMBERS:
        assert out[r]["ok"], r
        s = out[r]["stats"]
        assert s.exchanges == 2 and s.messages_sent == 2 and s.bytes_sent == 2 * 200


def test_needs_initialized_distributed() -> None:
    if dist.is_initialized():
        pytest.skip("this process already joined a group")
    with pytest.raises(TransportArgumentError, match="not initialized"):
        ProcessGroupTransport()


# ---------------------------------------------------------------- NCCL (GPU only)

_NO_GPU = not torch.cuda.is_available()


def _nccl_main(rank: int, world: int, path: str, case: str, results) -> None:
    try:
        torch.cuda.set_device(rank)
        store = dist.FileStore(path, world)
        dist.init_process_group(
            "nccl", store=store, rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=60),
            device_id=torch.device("cuda", rank),
        )  # fmt: skip
        results.put((rank, _NCCL_CASES[case](rank, world)))
    except BaseException as e:  # reported to the parent, which fails the test
        results.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        # An aborted group may not tear down cleanly: leave without waiting on it.
        os._exit(0)


def _nccl_validation(rank: int, world: int) -> str:
    t = ProcessGroupTransport()
    assert (t.device_type, t.backend, t.device) == ("cuda", "nccl", torch.device("cuda", rank))
    with pytest.raises(TransportArgumentError, match="this rank"):
        t.exchange([(rank, torch.ones(4, device="cuda"))], [], timeout=5)
    with pytest.raises(TransportArgumentError, match="not among"):
        t.exchange([], [(world, torch.ones(4, device="cuda"))], timeout=5)
    t.exchange([], [], timeout=5)
    return "ok"


def _nccl_reshard(rank: int, world: int) -> str:
    dist.barrier()  # batch_isend_irecv on NCCL wants a collective on the group first
    t = ProcessGroupTransport()
    other = (rank + 1) % world
    with pytest.raises(TensorMismatchError, match="moves cuda"):
        t.exchange([(other, torch.ones(4))], [], timeout=5)  # host memory
    with pytest.raises(TensorMismatchError, match=f"moves cuda:{rank}"):
        t.exchange([], [(other, torch.ones(4, device=f"cuda:{other}"))], timeout=5)
    ranks = tuple(range(world))
    full = {k: v.cuda() for k, v in _full(3).items()}
    plan = plan_reshard(SPECS, Layout(1, world, 1, ranks), Layout(1, world, 1, ranks[::-1]))
    mine = {k: v.cuda() for k, v in _reference(full, ranks, rank).items()}
    res = reshard(plan, rank, mine, t, timeout=60, route="transport")
    want = _reference(full, ranks[::-1], rank)
    bad = [n for n in want if not _bytes_equal(res.tensors[n].cpu(), want[n].cpu())]
    return "ok" if not bad else f"wrong bytes: {bad}"


def _nccl_timeout(rank: int, world: int) -> str:
    dist.barrier()  # the communicator exists before rank 1 goes silent
    t = ProcessGroupTransport()
    if rank == 1:
        time.sleep(4.0)
        return "ok"
    start = time.monotonic()
    try:
        t.exchange([], [(1, torch.empty(8, device="cuda"))], timeout=1.0)
    except PeerTimeoutError as e:
        if "peers 1 " not in str(e) or not 0.9 <= time.monotonic() - start < 3.5:
            return f"bad timeout: {e}"
        return "ok"
    return "no PeerTimeoutError"


_NCCL_CASES = {"validation": _nccl_validation, "reshard": _nccl_reshard, "timeout": _nccl_timeout}


def _run_nccl(case: str, world: int, tmp_path) -> list[str]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    path = str(tmp_path / f"store_{case}")
    procs = [ctx.Process(target=_nccl_main, args=(r, world, path, case, results))
             for r in range(world)]  # fmt: skip
    for p in procs:
        p.start()
    out: dict[int, str] = {}
    try:
        for _ in range(world):
            rank, res = results.get(timeout=120)
            out[rank] = res
    except queue.Empty:
        pass
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    return [out.get(r, "no result") for r in range(world)]


@pytest.mark.gpu
@pytest.mark.skipif(_NO_GPU, reason="needs a CUDA device")
def test_nccl_group_validates_on_device(tmp_path) -> None:
    assert _run_nccl("validation", 1, tmp_path) == ["ok"]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(_NO_GPU or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_nccl_reshard_matches_torch_chunk(tmp_path) -> None:
    assert _run_nccl("reshard", 2, tmp_path) == ["ok", "ok"]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(_NO_GPU or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_nccl_silent_peer_times_out(tmp_path) -> None:
    assert _run_nccl("timeout", 2, tmp_path)[0] == "ok"
