"""Communicator pool: the C++ decision core through CommPool with a recording
backend, and the real gloo backend across three processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback

import pytest
import torch

from nereus_comm.pool import CommPool, Communicator, PoolBackend, PoolError, PoolStats


class RecordingBackend(PoolBackend):
    """Stands in for a communication library: records every call, makes tokens."""

    def __init__(self, *, rank=0, world_size=8, split=True, shrink=True, grow=True, fail=False):
        self.rank = rank
        self.world_size = world_size
        self.can_split, self.can_shrink, self.can_grow = split, shrink, grow
        self.fail = fail
        self.calls: list[tuple] = []
        self.destroyed: list[tuple] = []

    def _make(self, op, ranks, parent=None):
        if self.fail:
            raise RuntimeError("library said no")
        self.calls.append((op, tuple(ranks), parent and tuple(parent)))
        return (op, tuple(ranks)) if self.rank in ranks else None

    def init(self, ranks, tag):
        return self._make("init", ranks)

    def split(self, parent, parent_ranks, ranks, tag):
        assert parent is not None or self.rank not in parent_ranks
        return self._make("split", ranks, parent_ranks)

    def shrink(self, parent, parent_ranks, dead, tag):
        return self._make("shrink", [r for r in parent_ranks if r not in dead], parent_ranks)

    def grow(self, parent, parent_ranks, ranks, tag):
        return self._make("grow", ranks, parent_ranks)

    def destroy(self, obj, broken):
        self.destroyed.append((obj[1], broken))


def test_reuse_counts_one_creation():
    be = RecordingBackend()
    pool = CommPool(be, capacity=4)
    a = pool.get([0, 1, 2])
    pool.release(a)
    b = pool.get((0, 1, 2))
    assert (a.how, b.how) == ("init", "hit")
    assert b.handle == a.handle and b.rank == 0
    assert be.calls == [("init", (0, 1, 2), None)]
    s = pool.stats
    assert (s.hits, s.misses, s.inits, s.size) == (1, 1, 1, 1)
    assert s.create_seconds >= 0.0
    # Order matters: (2, 1, 0) is another communicator; gloo (no split) inits it.
    pool2 = CommPool(RecordingBackend(split=False), capacity=4)
    pool2.get((0, 1, 2))
    assert pool2.get((2, 1, 0)).how == "init"


def test_reported_build_seconds_count_in_create_seconds():
    # Driver-directed mode: the members' builds end after init returned; the caller
    # reports their seconds and the counter holds them.
    pool = CommPool(RecordingBackend(), capacity=4)
    pool.get((0, 1))
    base = pool.stats.create_seconds
    pool.record_build_seconds(0.25)
    assert pool.stats.create_seconds == pytest.approx(base + 0.25)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(PoolError, match="build seconds"):
            pool.record_build_seconds(bad)
    assert pool.stats.create_seconds == pytest.approx(base + 0.25)


def test_split_from_smallest_covering_parent():
    be = RecordingBackend()
    pool = CommPool(be, capacity=8)
    for key in [(0, 1, 2, 3, 4, 5, 6, 7), (0, 1, 2, 3), (4, 5, 6, 7)]:
        pool.release(pool.get(key))
    world = (0, 1, 2, 3, 4, 5, 6, 7)
    assert be.calls == [
        ("init", world, None),
        ("split", (0, 1, 2, 3), world),
        ("split", (4, 5, 6, 7), world),
    ]
    be.calls.clear()
    c = pool.get((3, 0))
    assert c.how == "split" and c.rank == 1
    # (0,1,2,3) covers {0,3} and is smaller than the full world.
    assert be.calls == [("split", (3, 0), (0, 1, 2, 3))]
    pool.release(c)
    be.calls.clear()
    # {3, 4} spans both halves: only the full world covers it.
    assert pool.get((3, 4)).how == "split"
    assert be.calls == [("split", (3, 4), (0, 1, 2, 3, 4, 5, 6, 7))]
    assert pool.stats.splits == 4 and pool.stats.inits == 1


def test_split_tie_goes_to_smaller_key_and_not_from_broken():
    be = RecordingBackend(shrink=False)
    pool = CommPool(be, capacity=8)
    pool.release(pool.get((0, 2, 1)))
    pool.release(pool.get((0, 1, 3)))
    be.calls.clear()
    pool.get((1, 0))
    assert be.calls == [("split", (1, 0), (0, 1, 3))]  # (0,1,3) < (0,2,1)

    be = RecordingBackend(shrink=False)
    pool = CommPool(be, capacity=8)
    pool.release(pool.get((0, 1, 2, 4)))
    pool.release(pool.get((0, 1, 3)))
    pool.on_ranks_lost({3})
    be.calls.clear()
    assert pool.get((1, 0)).how == "split"
    assert be.calls == [("split", (1, 0), (0, 1, 2, 4))]  # the broken (0,1,3) is skipped


def test_shrink_on_loss_then_broken_source_aborted():
    be = RecordingBackend()
    pool = CommPool(be, capacity=8)
    pool.release(pool.get((0, 1, 2, 3)))
    assert pool.on_ranks_lost([2]) == [(0, 1, 2, 3)]
    assert pool.is_broken((0, 1, 2, 3))
    be.calls.clear()
    c = pool.get((0, 1, 3))
    assert c.how == "shrink"
    assert be.calls == [("shrink", (0, 1, 3), (0, 1, 2, 3))]
    assert be.destroyed == [((0, 1, 2, 3), True)]  # aborted, not destroyed
    assert pool.cached() == [(0, 1, 3)]
    # A lost rank cannot be requested again.
    with pytest.raises(PoolError, match=r"rank 2 .* was reported lost"):
        pool.get((0, 2))
    # Survivors in another order do not match the shrink: split from (0, 1, 3).
    assert pool.get((3, 1)).how == "split"
    assert pool.stats.shrinks == 1


def test_shrink_unsupported_falls_back_to_init():
    be = RecordingBackend(shrink=False, split=False)
    pool = CommPool(be, capacity=8)
    pool.release(pool.get((0, 1, 2)))
    pool.on_ranks_lost([1])
    assert pool.get((0, 2)).how == "init"
    assert pool.stats.shrinks == 0 and pool.stats.inits == 2


def test_grow_when_supported_else_init():
    be = RecordingBackend(split=False)
    pool = CommPool(be, capacity=8)
    pool.release(pool.get((0, 1)))
    pool.release(pool.get((0, 1, 2)))
    assert be.calls[1] == ("grow", (0, 1, 2), (0, 1))
    be.calls.clear()
    # Largest strict prefix of (0, 1, 2, 5) is (0, 1, 2).
    assert pool.get((0, 1, 2, 5)).how == "grow"
    assert be.calls == [("grow", (0, 1, 2, 5), (0, 1, 2))]
    # (5, 0, 1) has no cached prefix: grow does not apply.
    assert pool.get((5, 0, 1)).how == "init"

    no_grow = CommPool(RecordingBackend(split=False, grow=False), capacity=8)
    no_grow.get((0, 1))
    assert no_grow.get((0, 1, 2)).how == "init"
    assert no_grow.stats.grows == 0


def test_lru_eviction_order_and_pinned_never_evicted():
    be = RecordingBackend(split=False, grow=False)
    pool = CommPool(be, capacity=2)
    a = pool.get((0, 1))
    pool.release(pool.get((0, 2)))
    pool.release(a)
    pool.release(pool.get((0, 1)))  # touch (0,1): (0,2) is now least recent
    assert pool.cached() == [(0, 2), (0, 1)]
    pool.release(pool.get((0, 3)))
    assert be.destroyed == [((0, 2), False)]
    assert pool.cached() == [(0, 1), (0, 3)]
    assert pool.stats.evictions == 1

    # Hold both cached ones: a third goes over capacity instead of evicting them.
    held = [pool.get((0, 1)), pool.get((0, 3))]
    c = pool.get((0, 4))
    assert pool.stats.size == 3 and pool.stats.evictions == 1
    pool.release(held[0])  # now (0,1) is free and the least recent: evicted
    assert be.destroyed[-1] == ((0, 1), False)
    assert pool.stats.size == 2
    pool.release(held[1])
    pool.release(c)
    pool.destroy_all()
    assert sorted(k for k, _ in be.destroyed[1:]) == [(0, 1), (0, 3), (0, 4)]
    assert pool.stats.size == 0


def test_broken_evicted_before_older_healthy():
    be = RecordingBackend(split=False, shrink=False, grow=False)
    pool = CommPool(be, capacity=2)
    pool.release(pool.get((0, 1)))
    pool.release(pool.get((0, 2)))
    pool.on_ranks_lost([2])
    pool.release(pool.get((0, 3)))
    assert be.destroyed == [((0, 2), True)]
    assert pool.cached() == [(0, 1), (0, 3)]


def test_parent_pinned_while_child_is_created():
    be = RecordingBackend(grow=False)
    pool = CommPool(be, capacity=1)
    pool.release(pool.get((0, 1, 2)))
    c = pool.get((0, 1))  # split from the only entry; capacity 1 evicts the parent after
    assert c.how == "split"
    assert be.destroyed == [((0, 1, 2), False)]
    assert pool.cached() == [(0, 1)]


def test_non_member_gets_no_handle():
    be = RecordingBackend(rank=5)
    pool = CommPool(be, capacity=4)
    c = pool.get((0, 1))
    assert c.handle is None and c.rank is None
    assert repr(c) == "Communicator((0, 1), not a member, init)"


class DirectedBackend(RecordingBackend):
    """The driver-directed mode: the owner is no member; objects are group ids."""

    directed = True

    def __init__(self):
        super().__init__(rank=-1, split=False, shrink=False, grow=False)
        self.next_id = 100

    def init(self, ranks, tag):
        self.calls.append(("init", tuple(ranks), None))
        self.next_id += 1
        return self.next_id

    def destroy(self, obj, broken):
        self.destroyed.append((obj, broken))


def test_directed_mode_hands_out_the_backend_objects():
    be = DirectedBackend()
    pool = CommPool(be, capacity=2)
    a = pool.get((0, 1))
    assert (a.handle, a.rank, a.how) == (101, None, "init")
    pool.release(a)
    b = pool.get((0, 1))  # a second request of the same ranks: reused, not rebuilt
    assert (b.handle, b.how) == (101, "hit")
    unit = pool.get((2, 3))  # held, like a live unit's own group
    pool.release(b)
    pool.release(pool.get((1, 2)))  # over capacity: the idle LRU (0, 1) goes, not (2, 3)
    assert be.destroyed == [(101, False)]
    assert pool.cached() == [(2, 3), (1, 2)] and pool.is_held((2, 3))
    pool.release(unit)  # e.g. the unit was destroyed: now it may be evicted
    assert not pool.is_held((2, 3))
    pool.release(pool.get((3, 0)))
    assert be.destroyed == [(101, False), (102, False)]
    s = pool.stats
    assert (s.hits, s.misses, s.evictions) == (1, 4, 2)


def test_bad_requests_raise_before_anything_moves():
    be = RecordingBackend(world_size=4)
    pool = CommPool(be, capacity=2)
    for bad, msg in [
        ((), "at least one rank"),
        ((0, 0), "appears twice"),
        ((0, -1), "negative"),
        ((0, 4), r"outside the backend's world of 4"),
    ]:
        with pytest.raises(PoolError, match=msg):
            pool.get(bad)
    with pytest.raises(PoolError, match="not held"):
        pool.release((0, 1))
    with pytest.raises(PoolError, match="capacity"):
        CommPool(be, capacity=0)
    assert be.calls == [] and pool.stats.misses == 0


def test_failed_creation_leaves_pool_unchanged():
    from nereus_comm.errors import TransportError

    be = RecordingBackend()
    pool = CommPool(be, capacity=2)
    pool.release(pool.get((0, 1, 2)))
    be.fail = True
    with pytest.raises(TransportError, match=r"split of communicator \(0, 1\)"):
        pool.get((0, 1))
    assert pool.cached() == [(0, 1, 2)] and not pool.is_held((0, 1, 2))
    be.fail = False
    assert pool.get((0, 1)).how == "split"
    assert pool.stats.failures == 1


def test_stats_repr():
    s = PoolStats(2, 4, 3, 2, 1, 1, 0, 0, 0, 0, 0.0125)
    assert repr(s) == (
        "PoolStats(size=2/4, hits=3, misses=2 [init=1 split=1 shrink=0 grow=0], "
        "evictions=0, failures=0, create=0.0125 s)"
    )
    assert isinstance(Communicator((0,), 0, None, "init"), Communicator)


# -- real gloo backend across processes ------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_worker(rank: int, world_size: int, port: int, out) -> None:
    try:
        torch.set_num_threads(1)
        import torch.distributed as dist

        from nereus_comm.pool import CommPool, GlooBackend

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        pool = CommPool(GlooBackend(timeout=30), capacity=2)
        seen = {}
        # Every rank makes the same calls in the same order (the pool's contract).
        for key in [(0, 1), (2, 1), (0, 1), (0, 1, 2), (2, 1)]:
            comm = pool.get(key)
            t = torch.tensor([float(rank + 1)])
            if comm.handle is not None:
                assert comm.rank == dist.get_rank(group=comm.handle) == key.index(rank)
                dist.all_reduce(t, group=comm.handle)
                # rank order is kept: broadcast from the group's rank 0 = key[0]
                b = torch.tensor([float(rank)])
                dist.broadcast(b, group_src=0, group=comm.handle)
                assert b.item() == key[0]
            seen.setdefault(key, []).append((comm.how, comm.rank, t.item()))
            pool.release(comm)
        out.put((rank, seen, pool.stats, pool.cached()))
        pool.destroy_all()
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, traceback.format_exc(), None, None))


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_gloo_backend_three_processes():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    env = os.environ.get("PYTHONPATH")
    assert env is None or env  # children inherit PYTHONPATH (the worktree)
    procs = [ctx.Process(target=_gloo_worker, args=(r, 3, port, out)) for r in range(3)]
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in procs:
            rank, seen, stats, cached = out.get(timeout=90)
            assert stats is not None, seen
            results[rank] = (seen, stats, cached)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank, (seen, stats, cached) in results.items():
        member = {(0, 1): rank in (0, 1), (2, 1): rank in (1, 2), (0, 1, 2): True}
        total = {(0, 1): 3.0, (2, 1): 5.0, (0, 1, 2): 6.0}
        for key, uses in seen.items():
            for _how, comm_rank, value in uses:
                assert (comm_rank is not None) == member[key]
                assert value == (total[key] if member[key] else rank + 1)
        assert [how for how, _, _ in seen[(0, 1)]] == ["init", "hit"]
        # capacity 2: (0,1,2) evicts (2,1); the second (2,1) is a fresh group.
        assert [how for how, _, _ in seen[(2, 1)]] == ["init", "init"]
        assert (stats.hits, stats.inits, stats.evictions) == (1, 4, 2)
        assert cached == [(0, 1, 2), (2, 1)]


# -- NcclBackend's calling conventions (the NCCL calls run only on a device) ------


class FakeNccl:
    """Records the calls NcclBackend makes, with nereus_comm.nccl's signatures."""

    has_shrink = True
    has_grow = True

    def __init__(self, log):
        self.log = log
        self.next = 100

    def _comm(self):
        self.next += 1
        return self.next

    def get_unique_id(self):
        return b"u" * 128

    def comm_get_unique_id(self, comm):
        self.log.append(("get_uid", comm))
        return b"g" * 128

    def comm_init_rank(self, nranks, uid, rank):
        self.log.append(("init", nranks, uid[:1], rank))
        return self._comm()

    def comm_split(self, comm, color, key):
        self.log.append(("split", comm, color, key))
        return 0 if color == -1 else self._comm()

    def comm_shrink(self, comm, exclude, abort_pending=False):
        self.log.append(("shrink", comm, tuple(exclude), abort_pending))
        return self._comm()

    def comm_grow(self, comm, nranks, uid, rank):
        self.log.append(("grow", comm, nranks, uid and uid[:1], rank))
        return self._comm()

    def comm_destroy(self, comm):
        self.log.append(("destroy", comm))

    def comm_abort(self, comm):
        self.log.append(("abort", comm))


def test_nccl_backend_conventions():
    import torch.distributed as dist

    from nereus_comm.pool import NcclBackend

    store = dist.HashStore()
    logs = {r: [] for r in range(4)}
    pools = {
        r: CommPool(NcclBackend(store, r, 4, lib=FakeNccl(logs[r]), timeout=5), capacity=8)
        for r in range(4)
    }

    def everyone(fn):
        return {r: fn(pools[r]) for r in range(4)}  # rank 0 first: it posts the ids

    c = everyone(lambda p: p.get((0, 1, 2)))
    assert [logs[r] for r in range(4)] == [
        [("init", 3, b"u", 0)],
        [("init", 3, b"u", 1)],
        [("init", 3, b"u", 2)],
        [],
    ]
    assert c[3].handle is None and c[2].rank == 2
    for r in range(4):
        logs[r].clear()
    c = everyone(lambda p: p.get((2, 0)))  # split: rank 1 of the parent takes no color
    assert [logs[r] for r in range(3)] == [
        [("split", 101, 0, 1)],
        [("split", 101, -1, 0)],
        [("split", 101, 0, 0)],
    ]
    assert c[1].handle is None and (c[2].rank, c[0].rank) == (0, 1)
    for r in range(4):
        logs[r].clear()
    everyone(lambda p: p.get((0, 1, 2, 3)))  # grow: root hands its grow id to rank 3
    assert [logs[r] for r in range(4)] == [
        [("get_uid", 101), ("grow", 101, 4, b"g", -1)],
        [("grow", 101, 4, None, -1)],
        [("grow", 101, 4, None, -1)],
        [("grow", 0, 4, b"g", 3)],
    ]
    for r in range(4):
        logs[r].clear()
    everyone(lambda p: p.release((0, 1, 2, 3)))
    # Rank 1 dies; the survivors go on.
    survivors = (0, 2, 3)
    for r in survivors:
        pools[r].on_ranks_lost({1})
        pools[r].get((0, 2, 3))  # shrink of the grown one, aborting its pending work
    assert [logs[r][0] for r in survivors] == [
        ("shrink", 103, (1,), True),
        ("shrink", 103, (1,), True),
        ("shrink", 101, (1,), True),  # rank 3's first communicator was the grown one
    ]
    # the shrunk source is aborted (a member died), not destroyed
    assert logs[0][1:] == [("abort", 103)]
    for r in survivors:
        logs[r].clear()
        pools[r].destroy_all()
    assert sorted(logs[0]) == [("abort", 101), ("destroy", 102), ("destroy", 104)]


def _nccl_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from nereus_comm.errors import NcclNotFoundError
    from nereus_comm.nccl import load_nccl

    try:
        return load_nccl()
    except NcclNotFoundError as e:
        pytest.skip(str(e))


def test_nccl_backend_one_device():
    """On a device: a one-rank pool inits, hits, and frees real NCCL communicators."""
    import torch.distributed as dist

    from nereus_comm.pool import NcclBackend

    lib = _nccl_or_skip()
    torch.cuda.set_device(0)
    pool = CommPool(NcclBackend(dist.HashStore(), 0, 1, lib=lib), capacity=1)
    a = pool.get((0,))
    assert a.how == "init" and lib.comm_count(a.handle) == 1 and lib.comm_user_rank(a.handle) == 0
    pool.release(a)
    assert pool.get((0,)).how == "hit"
    pool.destroy_all()
    assert pool.stats.size == 0 and pool.stats.create_seconds > 0.0


# -- the C++ core against a short Python reference, on random operation sequences --


class ReferencePool:
    """The pool's rules, written out plainly (see nereus_comm/pool.py's docstring)."""

    def __init__(self, capacity):
        self.capacity = capacity
        self.entries = {}  # key -> [pins, last_used, broken]
        self.dead = set()
        self.tick = 0
        self.destroyed = []

    def get(self, key):
        self.tick += 1
        if key in self.entries:
            e = self.entries[key]
            e[0] += 1
            e[1] = self.tick
            return "hit", None
        order = lambda k: (len(k), k)  # noqa: E731
        healthy = [k for k, e in self.entries.items() if not e[2]]
        shrink = [
            k
            for k, e in self.entries.items()
            if e[2] and tuple(r for r in k if r not in self.dead) == key
        ]
        split = [k for k in healthy if set(key) <= set(k)]
        grow = [k for k in healthy if len(k) < len(key) and key[: len(k)] == k]
        if shrink:
            how, parent = "shrink", min(shrink, key=order)
        elif split:
            how, parent = "split", min(split, key=order)
        elif grow:
            how, parent = "grow", max(grow, key=len)
        else:
            how, parent = "init", None
        if parent:
            self.entries[parent][1] = self.tick
        self.tick += 1
        self.entries[key] = [1, self.tick, False]
        if how == "shrink" and self.entries[parent][0] == 0:
            del self.entries[parent]
            self.destroyed.append((parent, True))
        self._evict()
        return how, parent

    def release(self, key):
        self.entries[key][0] -= 1
        self._evict()

    def lost(self, rank):
        self.dead.add(rank)
        for k, e in self.entries.items():
            e[2] = e[2] or rank in k

    def _evict(self):
        while len(self.entries) > self.capacity:
            free = [k for k, e in self.entries.items() if e[0] == 0]
            if not free:
                return
            victim = min(free, key=lambda k: (not self.entries[k][2], self.entries[k][1]))
            self.destroyed.append((victim, self.entries.pop(victim)[2]))

    def cached(self):
        return sorted(self.entries, key=lambda k: self.entries[k][1])


def test_core_matches_reference_on_random_sequences():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    op = st.one_of(
        st.tuples(st.just("get"), st.permutations(range(6)), st.integers(1, 4)),
        st.tuples(st.just("release"), st.integers(0, 50), st.just(0)),
        st.tuples(st.just("lost"), st.integers(0, 5), st.just(0)),
    )

    @settings(max_examples=200, deadline=None)
    @given(st.integers(1, 4), st.lists(op, max_size=40))
    def check(capacity, ops):
        be = RecordingBackend(rank=0, world_size=6)
        pool, ref = CommPool(be, capacity=capacity), ReferencePool(capacity)
        held = []
        for kind, a, b in ops:
            if kind == "get":
                key = tuple(r for r in a if r not in ref.dead)[:b]
                if not key:
                    continue
                be.calls.clear()
                comm = pool.get(key)
                how, parent = ref.get(key)
                assert comm.how == how
                if how != "hit":
                    assert be.calls == [(how, key, parent)]
                held.append(key)
            elif kind == "release" and held:
                key = held.pop(a % len(held))
                pool.release(key)
                ref.release(key)
            elif kind == "lost" and len(ref.dead) < 4:
                pool.on_ranks_lost([a])
                ref.lost(a)
            assert pool.cached() == ref.cached()
            assert be.destroyed == [d for d in ref.destroyed if 0 in d[0]]
            assert all(pool.is_held(k) for k in held)
            assert pool.stats.size <= max(capacity, len(set(held)))

    check()
