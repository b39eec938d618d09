"""Split and Merge move the bytes a rank keeps by page remapping: exact, and only once committed."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from support.emu import assert_bitwise

from nereus_comm import _C
from nereus_comm.layout import Layout
from nereus_comm.remap import MIN_MOVE_BYTES, PAGE_BYTES, move_ranges
from nereus_comm.reshard import shards_from_full
from nereus_rl.emu import worker as emu_worker
from nereus_rl.emu.arena import PAGE_ALIGN_MIN, Arena
from nereus_rl.emu.comm import move_state
from nereus_rl.emu.manager import EMUManager
from nereus_rl.emu.state import stage_state_specs, synthetic
from nereus_rl.runtime import Driver

# Multi-process: out of the fast lane (-m "not slow").
pytestmark = pytest.mark.slow

# Big enough that most kept halves span whole pages; vocab 1001 splits unevenly (501 /
# 500 rows), so its halves do not start on a page: partial pages, or no move at all.
SPECS = stage_state_specs(2, hidden=256, ffn=512, vocab=1001)


def _page_aligned(nbytes: int) -> torch.Tensor:
    raw = torch.empty(nbytes + PAGE_BYTES, dtype=torch.uint8)
    skip = -raw.data_ptr() % PAGE_BYTES
    return raw[skip : skip + nbytes]


def test_move_ranges_moves_whole_pages_and_copies_the_rest():
    n = 1 << 20
    src, dst = _page_aligned(4 * n), _page_aligned(4 * n)
    src.copy_(torch.randint(0, 256, (4 * n,), dtype=torch.uint8))
    dst.fill_(7)
    before = src.clone()
    pairs = [
        (0, 0, n),  # page-aligned both sides: moved
        (n + 100, n + 100, n - 300),  # same offset in a page: partial pages copied
        (2 * n + 8, 2 * n + 16, n // 2),  # offsets differ within a page: copied
        (3 * n, 3 * n, MIN_MOVE_BYTES - PAGE_BYTES),  # short: copied
    ]
    moves = move_ranges([(src.data_ptr() + s, dst.data_ptr() + d, k) for s, d, k in pairs])
    for s, d, k in pairs:
        assert torch.equal(dst[d : d + k], before[s : s + k])
    assert moves.bytes_moved == n + (n - 2 * PAGE_BYTES)  # pages strictly inside the second
    edges = (PAGE_BYTES - 100) + (PAGE_BYTES - 200)
    assert moves.bytes_copied == edges + n // 2 + MIN_MOVE_BYTES - PAGE_BYTES
    assert torch.equal(src[:n], torch.full((n,), 7, dtype=torch.uint8))  # dst's old pages
    done, err = _C.swap_pages(np.ascontiguousarray(moves.swaps[::-1]))  # swapped back
    assert (done, err) == (len(moves.swaps), 0) and torch.equal(src, before)


def test_the_arena_starts_large_tensors_on_a_page():
    arena = Arena(8 << 20)  # lazy: a segment from torch.empty, aligned by the arena
    _, t = arena.carve(
        {"small": ((5,), torch.float32), "big": ((PAGE_ALIGN_MIN + 8,), torch.uint8),
         "odd": ((3,), torch.float16), "big2": ((PAGE_ALIGN_MIN // 4,), torch.float32)}
    )  # fmt: skip
    assert t["big"].data_ptr() % PAGE_BYTES == 0 and t["big2"].data_ptr() % PAGE_BYTES == 0
    assert t["small"].data_ptr() % 64 == 0 and t["odd"].data_ptr() % 64 == 0


class _LocalOnly:
    """Enough of a transport for a reshard with no peers (every byte stays on rank 0)."""

    rank, ranks, device_type = 0, (0,), "cpu"

    def start(self, sends, recvs, timeout):
        assert not sends and not recvs
        return SimpleNamespace(wait=lambda: None)


def _aligned_like(shards):
    out = {}
    for name, t in shards.items():  # page-aligned, as a unit's arena block lays them out
        out[name] = _page_aligned(t.nbytes).view(t.dtype).view(t.shape)
        out[name].copy_(t)
    return out


def test_move_state_leaves_the_moves_to_its_caller_and_the_sources_intact():
    dst = Layout(1, 1, 1, (0,), num_layers=2)  # from and to rank 0: every copy is local
    full = {s.name: synthetic(s, tuple((0, n) for n in s.shape), 3) for s in SPECS}
    mine = shards_from_full(full, SPECS, dst, 0)
    tensors = _aligned_like(mine)
    out = _aligned_like({n: torch.zeros_like(t) for n, t in mine.items()})
    result, extra = move_state(SPECS, dst, dst, 0, tensors, _LocalOnly(), timeout=5, out=out,
                               consume_sources=True)  # fmt: skip
    moves = extra["moves"]
    assert moves and extra["bytes_remapped"] == sum(n for _, _, n in moves)
    for name, t in mine.items():
        assert torch.equal(tensors[name], t), name  # nothing moved out of a source yet
    move_ranges(moves)  # what emu.drop of the consumed source does after the commit
    for name, t in mine.items():
        assert torch.equal(result.tensors[name], t), name


def test_a_dropped_new_unit_gives_its_moved_pages_back():
    ctx = SimpleNamespace(state={}, rank=0, release_groups=lambda ids: None)
    a, b = _page_aligned(1 << 20), _page_aligned(1 << 20)
    a.fill_(1)
    b.fill_(2)
    units = ctx.state.setdefault("emu.units", {})
    for uid in (1, 2):
        units[uid] = {"stage": "s", "layout": None, "tensors": {}, "block": None}
    done = move_ranges([(a.data_ptr(), b.data_ptr(), 1 << 20)])  # what emu.reshard does
    assert done.bytes_moved == 1 << 20 and bool((b == 1).all())
    emu_worker._moves(ctx)[2] = (1, done.swaps)  # new unit 2 took source 1's pages
    emu_worker.drop(ctx, (2,))  # the primitive failed: its new unit goes
    assert bool((a == 1).all()) and bool((b == 2).all())  # the source is whole again
    assert not emu_worker._moves(ctx)
    done = move_ranges([(a.data_ptr(), b.data_ptr(), 1 << 20)])
    units[2] = {"stage": "s", "layout": None, "tensors": {}, "block": None}
    emu_worker._moves(ctx)[2] = (1, done.swaps)
    emu_worker.drop(ctx, (1,))  # committed: the source goes, the new unit keeps the pages
    assert not emu_worker._moves(ctx) and bool((b == 1).all())
    emu_worker.drop(ctx, (2,))  # a later destroy of the new unit moves nothing back
    assert bool((b == 1).all())


@pytest.fixture(scope="module")
def emus():
    d = Driver(call_timeout=60.0)
    try:
        d.spawn_local(2, num_threads=1, method="forkserver")
        m = EMUManager(d, transfer_timeout=30.0, arena_bytes=4 * sum(s.nbytes for s in SPECS))
        m.define_stage("actor", SPECS, seed=5)
        yield m
    finally:
        d.shutdown()


def test_split_and_merge_move_the_kept_bytes_and_stay_exact(emus):
    m = emus
    kinds = {s.split_dim for s in SPECS}
    assert kinds == {0, 1, None}  # column-, row-parallel and replicated (Adam, step, RNG)
    assert any(s.name == "rng" for s in SPECS) and any("exp_avg_sq" in s.name for s in SPECS)
    a = m.create("actor", [0, 1], tp=2)
    for _ in range(2):  # the second round moves pages that were moved before
        x, y = m.split(a)
        rec = m.records[-1]
        assert_bitwise(m, x)
        assert_bitwise(m, y)
        # Each rank kept half of every dim-0 tensor: most of it moved, not copied.
        dim0 = sum(s.nbytes for s in SPECS if s.split_dim == 0)
        assert 0.8 * dim0 < rec.extra["bytes_remapped"] <= dim0
        assert rec.bytes_moved == sum(s.nbytes for s in SPECS if s.split_dim is not None)
        a = m.merge(x, y)
        rec = m.records[-1]
        assert_bitwise(m, a)
        assert rec.extra["bytes_remapped"] > 0.4 * dim0
    m.forget(m.units())


def test_pipeline_split_and_merge_move_whole_stage_tensors(emus):
    m = emus
    a = m.create("actor", [0, 1], tp=1, pp=2)  # each rank holds one layer's tensors whole
    x, y = m.split(a)
    assert (x.tp, x.pp) == (1, 1)
    assert m.records[-1].extra["bytes_remapped"] > 0
    assert_bitwise(m, x)
    assert_bitwise(m, y)
    a = m.merge(x, y, tp=1, pp=2)
    assert m.records[-1].extra["bytes_remapped"] > 0
    assert_bitwise(m, a)
    m.forget(m.units())


def test_a_split_failing_after_the_page_moves_leaves_its_unit_whole(emus, monkeypatch):
    m = emus
    a = m.create("actor", [0, 1], tp=2)
    x, y = m.split(a)  # a first round, so the failing one moves pages moved before
    a = m.merge(x, y)

    def fail(comms):
        raise RuntimeError("injected after every rank's emu.reshard")

    monkeypatch.setattr(m, "_settle", fail)
    with pytest.raises(RuntimeError, match="injected"):
        m.split(a)  # every worker moved its kept pages, then the driver fails
    monkeypatch.undo()
    assert m.units("actor") == [a]
    assert_bitwise(m, a)  # the failed Split's new units gave the pages back
    x, y = m.split(a)
    assert m.records[-1].extra["bytes_remapped"] > 0
    assert_bitwise(m, x)
    assert_bitwise(m, y)
    m.forget(m.units())
