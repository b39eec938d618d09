"""The workers' memory arena: carving, reuse after free, exhaustion, and EMU primitives on it."""

from __future__ import annotations

import io
import itertools

import pytest
import torch
from support.emu import assert_bitwise

from nereus_rl.emu.arena import Arena, arena_config, parse_bytes
from nereus_rl.emu.manager import ArenaExhaustedError, EMUManager
from nereus_rl.emu.state import stage_state_specs
from nereus_rl.runtime import Driver

SHAPES = {
    "w": ((33, 7), torch.float32),
    "step": ((), torch.float32),
    "empty": ((0, 5), torch.bfloat16),
    "rng": ((5056,), torch.uint8),
    "h": ((9,), torch.float16),
}


def test_carve_gives_each_tensor_its_own_storage_inside_the_block():
    arena = Arena(1 << 20, prefault=True)
    block, t = arena.carve(SHAPES)
    base = block.flat.data_ptr()
    spans = []
    for name, (shape, dtype) in SHAPES.items():
        assert t[name].shape == torch.Size(shape) and t[name].dtype == dtype
        assert t[name].is_contiguous()
        if t[name].numel():
            assert t[name].storage_offset() == 0
            assert t[name].untyped_storage().nbytes() == t[name].nbytes
            assert t[name].data_ptr() % 64 == 0
            spans.append((t[name].data_ptr() - base, t[name].nbytes))
    spans.sort()
    assert all(a + n <= b for (a, n), (b, _) in itertools.pairwise(spans))  # no overlap
    assert spans[-1][0] + spans[-1][1] <= block.nbytes
    # Saving a unit's tensors writes their bytes, not the whole arena.
    buf = io.BytesIO()
    torch.save(t, buf)
    assert len(buf.getvalue()) < 2 * sum(x.nbytes for x in t.values()) + 4096
    # A generator state in the arena can be loaded (set_state of a view crashes torch).
    g = torch.Generator()
    g.manual_seed(5)
    t["rng"].copy_(g.get_state())
    torch.Generator().set_state(t["rng"])


def test_a_freed_block_is_reused_in_place():
    arena = Arena(1 << 20, prefault=True)
    assert arena.reserved == 1 << 20 and arena.reserve_seconds >= 0
    b1, t1 = arena.carve(SHAPES)
    t1["w"].fill_(3.0)
    ptr = t1["w"].data_ptr()
    arena.free(b1)
    assert arena.used == 0 and arena.live_blocks == 0
    b2, t2 = arena.carve(SHAPES)
    assert t2["w"].data_ptr() == ptr  # the same (warm) pages
    assert arena.stats()["reused"] == 2 and arena.reserved == 1 << 20
    arena.free(b2)


def test_lazy_arena_keeps_segments_and_lets_idle_ones_go_only_when_needed():
    arena = Arena(100_000)
    a = arena.alloc(40_000)
    arena.free(a)
    assert arena.reserved >= 40_000  # kept after free
    b = arena.alloc(30_000)  # fits in the kept segment
    assert b.segment == a.segment and arena.stats()["reused"] == 1
    arena.free(b)
    c = arena.alloc(90_000)  # does not fit beside it: the idle segment goes
    assert arena.reserved == c.nbytes and arena.live_blocks == 1


def test_free_merges_neighbours_and_refuses_a_second_free():
    arena = Arena(64 << 10, prefault=True)
    blocks = [arena.alloc(16 << 10) for _ in range(4)]
    with pytest.raises(ArenaExhaustedError):
        arena.alloc(1)
    arena.free(blocks[1])
    arena.free(blocks[2])
    big = arena.alloc(32 << 10)  # only fits if the two freed neighbours merged
    assert big.offset == blocks[1].offset
    with pytest.raises(ValueError, match="not a live block"):
        arena.free(blocks[1])


def test_exhaustion_names_the_budget_and_the_request_and_allocates_nothing():
    arena = Arena(1 << 20, prefault=True)
    keep = arena.alloc(600 << 10)
    before = arena.stats()
    with pytest.raises(ArenaExhaustedError) as e:
        arena.carve({"x": ((200_000,), torch.float32)}, "unit 7 of 'actor'")
    msg = str(e.value)
    assert "unit 7 of 'actor'" in msg and "802816 B" in msg and "1048576 B" in msg
    assert "NEREUS_ARENA_BYTES" in msg
    assert arena.stats() == before
    arena.free(keep)


def test_config_from_options_and_environment(monkeypatch):
    assert parse_bytes("1536M") == 1536 << 20 and parse_bytes("2G") == 2 << 30
    assert parse_bytes("4096") == 4096
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("lots")
    monkeypatch.setenv("NEREUS_ARENA_BYTES", "64M")
    monkeypatch.setenv("NEREUS_ARENA_PREFAULT", "1")
    assert arena_config(None, None, 4) == (64 << 20, True)
    assert arena_config("0", False, 4) == (0, False)  # an option beats the environment
    monkeypatch.delenv("NEREUS_ARENA_BYTES")
    monkeypatch.delenv("NEREUS_ARENA_PREFAULT")
    budget, prefault = arena_config(None, None, 4)
    assert budget > 0 and not prefault


# ---------------------------------------------------------------- on live workers

SPECS = stage_state_specs(2, hidden=32, ffn=64, vocab=50)
STATE_BYTES = sum(s.nbytes for s in SPECS)


@pytest.fixture(scope="module")
def emus():
    d = Driver(call_timeout=60.0)
    try:
        d.spawn_local(4, num_threads=1, method="forkserver")
        # A tp=2 half of the state fits, a whole replica (tp=1) does not.
        m = EMUManager(d, transfer_timeout=30.0, arena_bytes=int(0.8 * STATE_BYTES),
                       arena_prefault=True)  # fmt: skip
        m.define_stage("actor", SPECS, seed=3)
        m.define_stage("tiny", stage_state_specs(2, hidden=8, ffn=16, vocab=12), seed=4)
        yield m
    finally:
        d.shutdown()


def _stats(m: EMUManager, rank: int) -> dict:
    m.flush()  # drops are sent without waiting
    return m.driver.call([rank], "emu.arena_stats")[rank]


@pytest.mark.slow
def test_primitives_on_arena_memory_are_exact_and_destroy_gives_blocks_back(emus):
    m = emus
    assert all(a["prefault"] and a["reserved"] == a["budget"] for a in m.arenas.values())
    a = m.create("actor", [0, 1], tp=2)
    assert_bitwise(m, a)
    used0 = _stats(m, 0)["used"]
    assert 0.4 * STATE_BYTES < used0 <= 0.6 * STATE_BYTES
    for _ in range(2):
        b = m.extend("actor", [2, 3], tp=2)
        assert_bitwise(m, b)
        s = _stats(m, 2)
        assert s["used"] == used0 and s["live_blocks"] == 1
        m.destroy(b)
        s = _stats(m, 2)
        assert s["used"] == 0 and s["live_blocks"] == 0 and s["reserved"] == s["budget"]
    assert s["allocs"] == s["reused"] == 2  # every block from the prefaulted pages
    m.forget(m.units())


@pytest.mark.slow
def test_split_and_merge_on_arena_memory_are_exact(emus):
    m = emus
    t = m.create("tiny", [0, 1], tp=2)
    base = {r: _stats(m, r)["used"] for r in (0, 1)}
    x, y = m.split(t)  # the halves' blocks beside the source's until it is dropped
    assert_bitwise(m, x)
    assert_bitwise(m, y)
    z = m.merge(x, y)
    assert_bitwise(m, z)
    e = m.extend("tiny", [2, 3], tp=1, pp=2)
    assert_bitwise(m, e)
    m.destroy(z)
    assert_bitwise(m, e)
    assert {r: _stats(m, r)["used"] for r in (0, 1)} == {0: 0, 1: 0}
    assert base[0] > 0 and _stats(m, 0)["peak_used"] >= base[0] * 3  # old + new halves
    m.forget(m.units())


@pytest.mark.slow
def test_extend_that_does_not_fit_fails_before_any_byte_moves(emus):
    m = emus
    a = m.create("actor", [0, 1], tp=2)
    before = {r: _stats(m, r) for r in (2, 3)}
    with pytest.raises(ArenaExhaustedError) as e:
        m.extend("actor", [2], tp=1)  # a whole replica on one worker: over its budget
    msg = str(e.value)
    assert f"budget is {int(0.8 * STATE_BYTES)} B" in msg and "worker 2" in msg
    assert m.units("actor") == [a] and m.free_ranks() == [2, 3]
    assert {r: _stats(m, r) for r in (2, 3)} == before  # nothing kept, nothing moved
    assert m.driver.call([2], "emu.units")[2] == {}
    assert_bitwise(m, a)
    # Nothing leaked: a unit that fits still goes there.
    b = m.extend("actor", [2, 3], tp=2)
    assert_bitwise(m, b)
    m.destroy(b)
    m.forget(m.units())


@pytest.mark.slow
def test_create_that_does_not_fit_fails_on_every_rank_alike(emus):
    m = emus
    with pytest.raises(ArenaExhaustedError, match="worker 1"):
        m.create("actor", [1], tp=1)
    assert m.units() == [] and _stats(m, 1)["used"] == 0
