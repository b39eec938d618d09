"""GlooTransport across 4 local processes (one pool for the module), over the default
group, a subgroup and a standalone group; NcclTransport on a device."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from nereus_comm.errors import PeerTimeoutError, TensorMismatchError
from nereus_comm.testing import LocalWorkers, WorkerContext, WorkerError
from nereus_comm.transport import GlooTransport, PeerLostError, TransportArgumentError

# Multi-process: out of the fast lane (-m "not slow").
pytestmark = pytest.mark.slow

WORLD = 4


@pytest.fixture(scope="module")
def pool():
    with LocalWorkers(WORLD, timeout=60) as p:
        yield p


def _payload(src: int, dst: int, i: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * src + 10 * dst + i)
    n = 1 + (src * 7 + dst * 3 + i * 5) % 50
    if dtype.is_floating_point:
        return torch.randn(n, 3, generator=g).to(dtype)
    return torch.randint(-(2**40), 2**40, (n, 3), generator=g, dtype=dtype)


def _all_to_all(ctx: WorkerContext, dtype: torch.dtype, per_peer: int, chunk: int) -> dict:
    t = GlooTransport(chunk_bytes=chunk)
    me = ctx.rank
    others = [r for r in range(ctx.world_size) if r != me]
    sends = [(p, _payload(me, p, i, dtype)) for p in others for i in range(per_peer)]
    recvs = [
        (p, torch.empty_like(_payload(p, me, i, dtype))) for p in others for i in range(per_peer)
    ]
    sends.append((others[0], torch.empty(0, dtype=dtype)))  # empty buffers are skipped
    recvs.append((others[-1], torch.empty(0, dtype=dtype)))
    # A receive buffer's storage must be written in place (zero copy).
    ptrs = [b.data_ptr() for _, b in recvs]
    t.exchange(sends, recvs, timeout=30)
    ok = all(
        torch.equal(buf, _payload(p, me, i % per_peer, dtype))
        for i, (p, buf) in enumerate(recvs[:-1])
    )
    same_storage = ptrs == [b.data_ptr() for _, b in recvs]
    return {"ok": ok, "same_storage": same_storage, "stats": t.stats}


@pytest.mark.parametrize(
    ("dtype", "chunk"),
    [
        (torch.float32, 1 << 20),
        (torch.bfloat16, 1 << 20),
        (torch.int64, 1 << 20),
        (torch.bfloat16, 7),
    ],
)
def test_all_to_all_exact_and_counted(pool, dtype, chunk) -> None:
    # chunk=7 splits every buffer into odd-sized chunks (and a short last one).
    per_peer = 2
    out = pool.run(_all_to_all, dtype, per_peer, chunk)
    for r, res in enumerate(out):
        assert res["ok"], f"rank {r} received wrong bytes"
        assert res["same_storage"]
        s = res["stats"]
        assert s.exchanges == 1
        assert s.messages_sent == s.messages_received == (WORLD - 1) * per_peer
        expected = sum(
            _payload(r, p, i, dtype).nbytes for p in range(WORLD) if p != r for i in range(per_peer)
        )
        assert s.bytes_sent == expected


def _bad_args(ctx: WorkerContext) -> list[str]:
    t = GlooTransport()
    me = ctx.rank
    errors = []
    cases = [
        ([(me, torch.zeros(2))], []),  # self
        ([(99, torch.zeros(2))], []),  # not in group
        ([((me + 1) % ctx.world_size, torch.zeros(4, 4).t())], []),  # non-contiguous
        ([], [((me + 1) % ctx.world_size, "not a tensor")]),
    ]
    for sends, recvs in cases:
        try:
            t.exchange(sends, recvs, timeout=5)
            errors.append("no error")
        except (TransportArgumentError, TensorMismatchError) as e:
            errors.append(type(e).__name__)
    assert t.stats.exchanges == 0  # nothing was posted
    return errors


def test_bad_arguments_raise_before_posting(pool) -> None:
    for errs in pool.run(_bad_args):
        assert errs == [
            "TransportArgumentError",
            "TransportArgumentError",
            "TensorMismatchError",
            "TensorMismatchError",
        ]


def _silent_peer(ctx: WorkerContext, timeout: float) -> dict:
    # A fresh group: a gloo timeout closes the pair with the silent peer for good.
    group = dist.new_group(ranks=[0, 1, 2])
    if ctx.rank not in (0, 1, 2):
        return {}
    t = GlooTransport(group)
    if ctx.rank == 1:
        time.sleep(timeout + 1.0)  # never posts its send: looks dead to rank 0
        return {}
    if ctx.rank == 2:  # a healthy peer of rank 0 in the same batch
        t.exchange([(0, torch.ones(8))], [], timeout=timeout)
        return {}
    start = time.monotonic()
    try:
        t.exchange([], [(1, torch.empty(8)), (2, torch.empty(8))], timeout=timeout)
    except PeerTimeoutError as e:
        elapsed = time.monotonic() - start
        again = None
        try:
            t.exchange([], [(2, torch.empty(8))], timeout=timeout)
        except TransportArgumentError as e2:
            again = str(e2)
        return {"error": str(e), "elapsed": elapsed, "again": again}
    return {"error": None}


def test_silent_peer_times_out_naming_it(pool) -> None:
    timeout = 1.0
    res = pool.run(_silent_peer, timeout, timeout=30)[0]
    assert res["error"] is not None, "no PeerTimeoutError"
    assert "peers 1 " in res["error"] and "recv from 1" in res["error"]
    assert "recv from 2" not in res["error"]  # the healthy peer is not blamed
    assert timeout * 0.9 <= res["elapsed"] < timeout + 2.0
    assert "broke earlier" in res["again"]


def _reported_dead(ctx: WorkerContext, timeout: float) -> dict:
    # Rank 1 never posts; liveness reports it dead after 0.5 s. Rank 3 is not in the
    # group: its reported death must not end an exchange of the group.
    group = dist.new_group(ranks=[0, 1, 2])
    if ctx.rank not in (0, 2):
        if ctx.rank == 1:
            time.sleep(3.0)
        return {}
    t = GlooTransport(group)
    if ctx.rank == 2:
        t.exchange([(0, torch.ones(8))], [], timeout=timeout, liveness=lambda: {3})
        try:
            t.exchange([(0, torch.ones(8))], [], timeout=timeout, liveness=lambda: {1})
        except PeerLostError:
            pass
        return {}
    got = torch.zeros(8)
    t.exchange([], [(2, got)], timeout=timeout, liveness=lambda: {3})
    start = time.monotonic()
    dead_after = start + 0.5

    def liveness() -> set[int]:
        return {1, 3} if time.monotonic() > dead_after else {3}

    try:
        t.exchange([], [(1, torch.empty(8)), (2, torch.empty(8))], timeout=timeout,
                   liveness=liveness)  # fmt: skip
    except PeerLostError as e:
        return {"delivered": bool(got.eq(1).all()), "rank": e.rank, "ranks": e.ranks,
                "error": str(e), "elapsed": time.monotonic() - start,
                "timeout_error": isinstance(e, PeerTimeoutError)}  # fmt: skip
    return {"error": None}


def test_liveness_ends_the_wait_naming_the_dead_rank(pool) -> None:
    res = pool.run(_reported_dead, 30.0, timeout=60)[0]
    assert res["error"] is not None, "no PeerLostError"
    assert res["delivered"], "an exchange failed for a death outside its group"
    assert res["rank"] == 1 and res["ranks"] == (1,), res
    assert res["timeout_error"] and "rank 1 died" in res["error"], res
    assert 0.4 < res["elapsed"] < 3.0, res  # not the 30 s timeout


def test_gloo_transport_needs_initialized_distributed() -> None:
    if dist.is_initialized():
        pytest.skip("this process already joined a group")
    with pytest.raises(TransportArgumentError, match="init_process_group"):
        GlooTransport()


class _CountingGroup:
    """Forwards to a real gloo group and counts the point-to-point ops posted on it."""

    def __init__(self, pg) -> None:
        self.pg, self.sends, self.recvs = pg, 0, 0

    def size(self) -> int:
        return self.pg.size()

    def rank(self) -> int:
        return self.pg.rank()

    def send(self, tensors, dst, tag):
        self.sends += 1
        return self.pg.send(tensors, dst, tag)

    def recv(self, tensors, src, tag):
        self.recvs += 1
        return self.pg.recv(tensors, src, tag)


# Processes 3, 1, 2 form a standalone group (group ranks 0, 1, 2) whose global
# ranks are 30, 10, 20: neither the default group's ranks nor its order.
_MEMBERS = (3, 1, 2)


def _standalone(ctx: WorkerContext, dtype: torch.dtype, per_peer: int, chunk: int) -> dict:
    if ctx.rank not in _MEMBERS:
        return {}
    ranks = [10 * p for p in _MEMBERS]
    store = dist.PrefixStore(f"standalone/{dtype}/{chunk}", ctx.store)
    pg = dist.ProcessGroupGloo(store, _MEMBERS.index(ctx.rank), len(_MEMBERS))
    group = _CountingGroup(pg)
    me = 10 * ctx.rank
    t = GlooTransport(group, ranks, me, chunk_bytes=chunk)
    others = [r for r in ranks if r != me]
    sends = [(p, _payload(me, p, i, dtype)) for p in others for i in range(per_peer)]
    recvs = [
        (p, torch.empty_like(_payload(p, me, i, dtype))) for p in others for i in range(per_peer)
    ]
    t.exchange(sends, recvs, timeout=30)
    ok = all(
        torch.equal(buf, _payload(p, me, i % per_peer, dtype)) for i, (p, buf) in enumerate(recvs)
    )
    ops = [-(-b.nbytes // chunk) for _, b in sends], [-(-b.nbytes // chunk) for _, b in recvs]
    return {
        "ok": ok,
        "stats": t.stats,
        "sends": group.sends,
        "recvs": group.recvs,
        "expected_ops": (sum(ops[0]), sum(ops[1])),
        "repr": repr(t),
    }


@pytest.mark.parametrize(("dtype", "chunk"), [(torch.int64, 1 << 20), (torch.bfloat16, 7)])
def test_standalone_group_exact_and_counted(pool, dtype, chunk) -> None:
    per_peer = 2
    out = pool.run(_standalone, dtype, per_peer, chunk)
    assert out[0] == {}
    for r in _MEMBERS:
        res = out[r]
        assert res["ok"], f"process {r} received wrong bytes"
        s = res["stats"]
        assert s.exchanges == 1
        assert s.messages_sent == s.messages_received == (len(_MEMBERS) - 1) * per_peer
        # One gloo op per chunk, each posted on the standalone group itself.
        assert (res["sends"], res["recvs"]) == res["expected_ops"]
        if chunk == 7:
            assert res["sends"] > s.messages_sent  # buffers really were chunked
        assert res["repr"] == f"GlooTransport(rank={10 * r}, ranks=[30, 10, 20])"


def test_standalone_group_needs_no_default_group_and_checks_ranks() -> None:
    # A one-rank standalone group in this process (no init_process_group).
    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    t = GlooTransport(pg, [7], 7)
    assert (t.rank, t.ranks) == (7, (7,))
    t.exchange([], [], timeout=5)
    with pytest.raises(TransportArgumentError, match="this rank"):
        t.exchange([(7, torch.ones(2))], [], timeout=5)
    with pytest.raises(TransportArgumentError, match="not among"):
        t.exchange([(8, torch.ones(2))], [], timeout=5)
    bad = [
        ((pg, [7], None), "needs all of group, ranks and rank"),
        ((None, [7], 7), "needs all of group, ranks and rank"),
        ((pg, [7, 8], 7), "the group has 1 ranks"),
        ((pg, [7, 7], 7), "duplicates"),
        ((pg, [8], 7), "not in ranks"),
    ]
    # A group whose size fits but where this process is group rank 1, not 0.
    two = type("TwoRankGroup", (), {"size": lambda self: 2, "rank": lambda self: 1})()
    bad.append(((two, [7, 8], 7), "is group rank 1"))
    for args, match in bad:
        with pytest.raises(TransportArgumentError, match=match):
            GlooTransport(*args)


def _nccl_self_exchange() -> None:
    from nereus_comm.transport import NcclTransport

    store = dist.HashStore()
    t = NcclTransport(store, 0, [0], 0)
    with pytest.raises(TransportArgumentError, match="this rank"):
        t.exchange([(0, torch.ones(4, device="cuda"))], [], timeout=5)
    with pytest.raises(TransportArgumentError, match="not among"):
        t.exchange([], [(1, torch.ones(4, device="cuda"))], timeout=5)
    t.close()


@pytest.mark.gpu
def test_nccl_transport_validates_on_device() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    try:
        from nereus_comm.nccl import load_nccl

        load_nccl()
    except Exception as e:
        pytest.skip(f"NCCL not loadable: {e}")
    _nccl_self_exchange()


def _die(ctx: WorkerContext) -> None:
    os._exit(3)


def test_a_dead_worker_is_reported_not_waited_for() -> None:
    with LocalWorkers(1, timeout=60) as pool:
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"rank 0 \(exit code 3\) died"):
            pool.run(_die)
        assert time.monotonic() - start < 10
