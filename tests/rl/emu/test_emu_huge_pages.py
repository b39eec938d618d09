"""Split and Merge keep transparent huge pages: the arena places tensors at matching
offsets within a 2 MiB page, and a page swap moves huge pages whole."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch
from support.emu import assert_bitwise

from nereus_comm import _C
from nereus_comm.remap import move_ranges
from nereus_rl.emu import worker as emu_worker
from nereus_rl.emu.arena import HUGE_PAGE, Arena, _layout
from nereus_rl.emu.comm import Layout
from nereus_rl.emu.manager import EMUManager
from nereus_rl.emu.state import stage_state_specs, synthetic
from nereus_rl.runtime import Driver
from nereus_rl.runtime.context import register

# Multi-process: out of the fast lane (-m "not slow").
pytestmark = pytest.mark.slow

THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_usable() -> bool:
    try:
        with open(THP) as f:
            mode = f.read()
    except OSError:
        return False
    return "[never]" not in mode


def _span(addr: int, nbytes: int) -> tuple[int, int]:
    """(addr, nbytes) widened to the whole mappings that overlap it now.

    The kernel merges an arena's mapping with an adjacent anonymous one of the same
    flags (an earlier test's arena, say), and a swap's mremap splits them again: a
    count over the mappings overlapping the window alone would lose the neighbour's
    huge pages after the swap. Counting over the span taken before keeps them in both.
    """
    lo_all, hi_all = addr, addr + nbytes
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                if lo < addr + nbytes and hi > addr:
                    lo_all, hi_all = min(lo_all, lo), max(hi_all, hi)
    return lo_all, hi_all - lo_all


def _huge_bytes(addr: int, nbytes: int) -> int:
    """AnonHugePages of this process's mappings that overlap [addr, addr + nbytes) (an
    arena segment's own mapping, split by the swaps; its slack is never touched)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < addr + nbytes and hi > addr
            elif inside and line.startswith("AnonHugePages:"):
                total += int(line.split()[1]) << 10
    return total


def test_layout_places_phased_tensors_at_their_phase_and_fills_the_padding():
    f32 = torch.float32
    shapes = {
        "small": ((5,), f32),
        "a": ((3 << 18,), f32),  # 3 MiB
        "b": ((5 << 17,), f32),  # 2.5 MiB
        "c": ((1 << 19,), f32),  # 2 MiB
        "mid": ((1 << 16,), f32),  # 256 KiB: page-aligned, no phase
        "free": ((3 << 18,), f32),  # 3 MiB without a phase: on a huge page
    }
    phases = {"a": 1 << 20, "b": 4096 + 7, "c": 0, "small": 12288}  # b's: a page down
    spans = _layout(shapes, phases)
    assert spans["a"][0] % HUGE_PAGE == 1 << 20
    assert spans["b"][0] % HUGE_PAGE == 4096
    assert spans["c"][0] % HUGE_PAGE == 0
    assert spans["mid"][0] % 4096 == 0 and spans["small"][0] % 64 == 0
    assert spans["free"][0] % HUGE_PAGE == 0
    ends = sorted((o, o + n) for o, n in spans.values())
    assert all(e <= s for (_, e), (s, _) in itertools.pairwise(ends))  # no overlap
    used = sum(n for _, n in spans.values())
    assert ends[-1][1] - used < 3 * HUGE_PAGE  # greedy order, gaps filled
    assert _layout(shapes, {}) == _layout(shapes, {"small": 5})  # small: no phase


def test_large_blocks_and_their_phased_tensors_sit_at_the_asked_address_mod_2mib():
    arena = Arena(64 << 20)
    small = arena.alloc(8192)  # a small block first: the big one must still align
    block, t = arena.carve(
        {"w": ((3 << 18,), torch.float32), "v": ((1 << 19,), torch.float32)},
        phases={"w": 12288},
    )
    assert block.flat.data_ptr() % HUGE_PAGE == 0
    assert t["w"].data_ptr() % HUGE_PAGE == 12288 and t["v"].data_ptr() % HUGE_PAGE == 0
    arena.free(block)
    arena.free(small)
    assert arena.used == 0


def test_padding_that_does_not_fit_falls_back_to_the_tight_layout():
    shapes = {f"t{i}": (((5 << 17) + 1024,), torch.float32) for i in range(4)}  # ~2.5 MiB
    phases = {}  # each starts a fresh huge page: ~1.5 MiB padding after each
    tight = max(o + n for o, n in _layout(shapes, {}, tight=True).values())
    padded = max(o + n for o, n in _layout(shapes, phases).values())
    assert padded > tight + HUGE_PAGE
    arena = Arena(tight + 4096, prefault=True)
    block, t = arena.carve(shapes, phases=phases)  # no ArenaExhaustedError
    assert block.nbytes <= tight + 4096 and len(t) == 4
    arena.free(block)
    roomy = Arena(padded + HUGE_PAGE, prefault=True)
    _, t = roomy.carve(shapes, phases=phases)
    assert all(x.data_ptr() % HUGE_PAGE == 0 for x in t.values())


def test_phases_match_the_kept_bytes_of_the_current_unit():
    """emu.reserve asks for the offsets that let a Split's kept halves move whole."""
    specs = stage_state_specs(1, hidden=512, ffn=1536, vocab=3000)
    arena = Arena(256 << 20)
    ctx = type("Ctx", (), {})()
    ctx.rank, ctx.state = 1, {"emu.arena": arena}
    old = Layout(1, 2, 1, (0, 1), num_layers=1)
    block, tensors = emu_worker.carve_shards(ctx, tuple(specs), old, 1, "old")
    ctx.state["emu.units"] = {7: {"stage": "s", "layout": old, "tensors": tensors,
                                  "block": block}}  # fmt: skip
    new = Layout(1, 1, 1, (1,), num_layers=1)
    phases = emu_worker._huge_phases(ctx, "s", specs, new, 1)
    _, out = emu_worker.carve_shards(ctx, tuple(specs), new, 1, "new", phases)
    checked = 0
    for spec in specs:
        if spec.split_dim != 0 or out[spec.name].nbytes < 2 * HUGE_PAGE:
            continue
        # rank 1 keeps the second half: its old shard lands half-way into the new tensor
        half = out[spec.name].nbytes // 2
        src, dst = tensors[spec.name].data_ptr(), out[spec.name].data_ptr() + half
        assert (src - dst) % HUGE_PAGE == 0, spec.name
        checked += 1
    assert checked >= 2
    ctx.state["emu.units"][8] = ctx.state["emu.units"][7]
    assert emu_worker._huge_phases(ctx, "s", specs, new, 1) == {}  # two units: no guess


@pytest.mark.skipif(not _thp_usable() or not hasattr(_C, "swap_pages"), reason="needs THP")
def test_a_swap_of_2mib_aligned_ranges_keeps_huge_pages_and_the_bytes():
    n = 8 << 20
    # Not a whole number of huge pages: the kernel does not align a scratch mapping of
    # this length by itself, and the last huge page of each range must split.
    k = (6 << 20) + 4096
    arena = Arena(3 * n, prefault=True)  # madvised to huge pages, touched
    a, b = arena.alloc(n).flat, arena.alloc(n).flat
    a.copy_(torch.arange(n, dtype=torch.int64).to(torch.uint8))
    b.fill_(9)
    want_a, want_b = a.clone(), b.clone()
    window = _span(arena._segments[0].buf.data_ptr(), 3 * n)
    before = _huge_bytes(*window)
    if before < 2 * n:
        pytest.skip(f"the kernel gave only {before >> 20} MiB of huge pages here")
    moves = move_ranges([(a.data_ptr(), b.data_ptr(), k)])
    assert moves.bytes_moved == k and moves.error == 0
    assert torch.equal(b[:k], want_a[:k]) and torch.equal(b[k:], want_b[k:])
    # Only the huge page at each range's end split (an unaligned scratch range in the
    # swap split all of b's: 10 MiB of 24 lost).
    assert _huge_bytes(*window) >= before - 2 * HUGE_PAGE
    done, err = _C.swap_pages(np.ascontiguousarray(moves.swaps))  # and back
    assert (done, err) == (len(moves.swaps), 0) and torch.equal(a[:k], want_a[:k])


def test_synthetic_state_survives_a_phased_carve():
    """Content written into phased tensors reads back exactly (the layout is only where)."""
    specs = stage_state_specs(1, hidden=512, ffn=1536, vocab=3000)
    arena = Arena(128 << 20)
    shapes = {s.name: (s.shape, s.dtype) for s in specs}
    phases = {s.name: (i * 12288) for i, s in enumerate(specs)}
    _, t = arena.carve(shapes, phases=phases)
    for s in specs:
        t[s.name].copy_(synthetic(s, tuple((0, k) for k in s.shape), 3))
    for s in specs:
        assert torch.equal(t[s.name], synthetic(s, tuple((0, k) for k in s.shape), 3)), s.name
    assert os.path.exists("/proc/self/smaps")


# Live: tensors of several huge pages, whose halves are whole huge pages (a page move
# then splits none; uneven halves are checked in test_emu_split_move), dim-0 and dim-1
# (row-parallel) tensors, Adam moments, step and RNG; 144 MiB per replica.
LIVE_SPECS = stage_state_specs(1, hidden=1024, ffn=2048, vocab=4096)


@register("test.huge_mib")
def _worker_huge_mib(ctx) -> float:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) / 1024
    return 0.0


@pytest.fixture(scope="module")
def emus():
    d = Driver(call_timeout=120.0)
    try:
        d.spawn_local(2, num_threads=1, method="forkserver")
        d.import_module("tests.rl.emu.test_emu_huge_pages")
        state = sum(s.nbytes for s in LIVE_SPECS)
        m = EMUManager(d, transfer_timeout=60.0, arena_bytes=int(2.2 * state),
                       arena_prefault=True)  # fmt: skip
        m.define_stage("actor", LIVE_SPECS, seed=11)
        yield m
    finally:
        d.shutdown()


def test_split_and_merge_rounds_stay_exact_and_keep_huge_pages(emus):
    m = emus
    assert {s.split_dim for s in LIVE_SPECS} == {0, 1, None}
    assert any(s.name == "rng" for s in LIVE_SPECS)
    assert any("exp_avg_sq" in s.name for s in LIVE_SPECS)
    a = m.create("actor", [0, 1], tp=2)
    huge0 = m.driver.call([0, 1], "test.huge_mib")
    dim0 = sum(s.nbytes for s in LIVE_SPECS if s.split_dim == 0)
    for _ in range(3):  # later rounds move pages that were moved before
        x, y = m.split(a)
        assert m.records[-1].extra["bytes_remapped"] > 0.8 * dim0
        assert_bitwise(m, x)
        assert_bitwise(m, y)
        a = m.merge(x, y, tp=2)
        assert m.records[-1].extra["bytes_remapped"] > 0.4 * dim0
        assert_bitwise(m, a)
    huge = m.driver.call([0, 1], "test.huge_mib")
    if _thp_usable() and min(huge0.values()) >= 32:
        # Moves between addresses that differ modulo 2 MiB split huge pages: before the
        # arena placed tensors at matching offsets, a round lost most of them.
        for r in (0, 1):
            assert huge[r] >= 0.8 * huge0[r], (huge0, huge)
    m.forget(m.units())
