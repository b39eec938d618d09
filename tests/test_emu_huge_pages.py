"""Split and Merge keep transparent huge pages: the arena places tensors at matching
offsets within a 2 MiB page, and a page swap moves huge pages whole."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch

from nereus_comm import _C
from nereus_comm.remap import move_ranges
from nereus_rl import emu_worker
from nereus_rl.emu_arena import HUGE_PAGE, Arena, _layout
from nereus_rl.emu_comm import Layout
from nereus_rl.emu_state import stage_state_specs, synthetic

THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_usable() -> bool:
    try:
        with open(THP) as f:
            mode = f.read()
    except OSError:
        return False
    return "[never]" not in mode


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


def test_layout_places_huge_tensors_at_their_phase_and_pads_little():
    f32 = torch.float32
    shapes = {
        "small": ((5,), f32),
        "a": ((3 << 18,), f32),  # 3 MiB
        "b": ((5 << 17,), f32),  # 2.5 MiB
        "c": ((1 << 19,), f32),  # 2 MiB
        "mid": ((1 << 16,), f32),  # 256 KiB: page-aligned, no phase
    }
    phases = {"a": 1 << 20, "b": 4096 + 7, "c": 0}  # b's rounds down to a page
    spans = _layout(shapes, phases)
    assert spans["a"][0] % HUGE_PAGE == 1 << 20
    assert spans["b"][0] % HUGE_PAGE == 4096
    assert spans["c"][0] % HUGE_PAGE == 0
    assert spans["mid"][0] % 4096 == 0 and spans["small"][0] % 64 == 0
    ends = sorted((o, o + n) for o, n in spans.values())
    assert all(e <= s for (_, e), (s, _) in itertools.pairwise(ends))  # no overlap
    # c (phase 0) first, then a at 1 MiB past the next huge page... greedy order wastes
    # less than a huge page per huge tensor.
    used = sum(n for _, n in spans.values())
    assert ends[-1][1] - used < 3 * HUGE_PAGE


def test_large_blocks_and_their_phased_tensors_sit_at_the_asked_address_mod_2mib():
    arena = Arena(64 << 20)
    small = arena.alloc(8192)  # a small block first: the big one must still align
    block, t = arena.carve(
        {"w": ((3 << 18,), torch.float32), "v": ((1 << 19,), torch.float32)},
        phases={"w": 12288},
    )
    assert block.flat.data_ptr() % HUGE_PAGE == 0
    assert t["w"].data_ptr() % HUGE_PAGE == 12288 and t["v"].data_ptr() % HUGE_PAGE == 0
    t["w"].fill_(1.5)
    arena.free(block)
    arena.free(small)
    assert arena.used == 0
    _, again = arena.carve({"w": ((3 << 18,), torch.float32)})
    assert again["w"].data_ptr() % HUGE_PAGE == 0


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
    window = (arena._segments[0].buf.data_ptr(), 3 * n)
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
