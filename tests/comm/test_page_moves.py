"""nereus_comm.remap's public calls: page swaps and moves, their argument checks, and
which of a plan's local copies can be page moves."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from nereus_comm import (
    MIN_MOVE_BYTES,
    PAGE_BYTES,
    Layout,
    RemapError,
    TensorMismatchError,
    TensorSpec,
    local_page_moves,
    move_ranges,
    plan_reshard,
    shards_from_full,
    swap_pages,
)


def _page_aligned(nbytes: int) -> torch.Tensor:
    raw = torch.empty(nbytes + PAGE_BYTES, dtype=torch.uint8)
    skip = -raw.data_ptr() % PAGE_BYTES
    return raw[skip : skip + nbytes]


def test_swap_pages_swaps_and_swaps_back():
    n = 64 * PAGE_BYTES
    a, b = _page_aligned(n), _page_aligned(n)
    a.fill_(1)
    b.fill_(2)
    assert swap_pages([(a.data_ptr(), b.data_ptr(), n)]) == (1, 0)
    assert bool((a == 2).all()) and bool((b == 1).all())
    assert swap_pages(np.array([[a.data_ptr(), b.data_ptr(), n]], dtype=np.int64)) == (1, 0)
    assert bool((a == 1).all()) and bool((b == 2).all())
    assert swap_pages(np.empty((0, 3), dtype=np.int64)) == (0, 0)


def test_move_ranges_then_swap_pages_undoes_it():
    n = MIN_MOVE_BYTES + 8 * PAGE_BYTES
    src, dst = _page_aligned(n), _page_aligned(n)
    src.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
    dst.fill_(7)
    before = src.clone()
    moves = move_ranges([(src.data_ptr(), dst.data_ptr(), n)])
    assert torch.equal(dst, before) and moves.bytes_moved + moves.bytes_copied == n
    if moves.bytes_moved:  # the kernel may refuse (old kernels): then it was a copy
        assert swap_pages(moves.swaps[::-1]) == (len(moves.swaps), 0)
        assert torch.equal(src, before)


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ((0, PAGE_BYTES, PAGE_BYTES), "null"),
        ((PAGE_BYTES, 4 * PAGE_BYTES, -PAGE_BYTES), "nbytes < 0"),
        ((PAGE_BYTES + 8, 4 * PAGE_BYTES, PAGE_BYTES), "page-aligned"),
        ((PAGE_BYTES, 4 * PAGE_BYTES, PAGE_BYTES + 1), "page-aligned"),
        ((PAGE_BYTES, 2 * PAGE_BYTES, 2 * PAGE_BYTES), "overlap"),
        ((2**63 - PAGE_BYTES, PAGE_BYTES, 2 * PAGE_BYTES), "past the address space"),
    ],
)
def test_swap_pages_rejects_a_bad_row_before_any_page_moves(row, match):
    # Addresses no mapping holds: a check that let one through would make the kernel
    # fail (an errno), not raise.
    with pytest.raises(RemapError, match=match):
        swap_pages([(1 << 40, 2 << 40, PAGE_BYTES), row])


@pytest.mark.parametrize("table", [[(1, 2)], np.zeros((2, 3), dtype=np.float64), [[[1, 2, 3]]]])
def test_swap_pages_rejects_a_malformed_table(table):
    with pytest.raises(RemapError, match=r"rows of \(a, b, nbytes\)"):
        swap_pages(table)


@pytest.mark.parametrize(
    ("pair", "match"),
    [((1, 2), "three ints"), ((1.5, 2, 3), "three ints"), ((8, 4096, -1), ">= 0"),
     ((0, 4096, 8), "address"), ((4096, 4100, 8), "overlap")],
)  # fmt: skip
def test_move_ranges_rejects_a_bad_pair_before_any_byte_moves(pair, match):
    a = torch.zeros(16, dtype=torch.uint8)
    b = torch.ones(16, dtype=torch.uint8)
    with pytest.raises(RemapError, match=match):
        move_ranges([(a.data_ptr(), b.data_ptr(), 16), pair])
    assert bool((b == 1).all())  # the good pair before it did not move either


def test_local_page_moves_picks_contiguous_local_copies_of_host_memory():
    rows = 4 * MIN_MOVE_BYTES // 4 // 64  # dim-0 halves of MIN_MOVE_BYTES * 2 each
    specs = [
        TensorSpec("w", (rows, 64), torch.float32, split_dim=0),  # halves: contiguous
        TensorSpec("v", (rows, 64), torch.float32, split_dim=1),  # halves: strided
        TensorSpec("b", (8,), torch.float32, split_dim=None),  # too short to move
    ]
    src, dst = Layout(1, 1, 1, (0,)), Layout(1, 2, 1, (0, 1))
    plan = plan_reshard(specs, src, dst, num_layers=1)
    full = {s.name: torch.randn(s.shape) for s in specs}
    tensors = shards_from_full(full, specs, src, 0, 1)
    out = {k: torch.empty_like(v) for k, v in shards_from_full(full, specs, dst, 0, 1).items()}
    pairs, done = local_page_moves(plan, 0, tensors, out)
    local = plan.local_copies(0)
    assert [local[i].tensor for i in sorted(done)] == [0]  # "w" only
    (s, d, n), = pairs  # fmt: skip
    assert (s, d, n) == (tensors["w"].data_ptr(), out["w"].data_ptr(), out["w"].nbytes)
    with pytest.raises(TensorMismatchError, match=r"destination tensors \['v'\]"):
        local_page_moves(plan, 0, tensors, {k: t for k, t in out.items() if k != "v"})
    # A strided source (same values, a transposed buffer): its element offsets are not
    # the contiguous ones the slots count, so the copy stays a copy.
    strided = dict(tensors, w=tensors["w"].t().contiguous().t())
    assert torch.equal(strided["w"], tensors["w"]) and not strided["w"].is_contiguous()
    assert local_page_moves(plan, 0, strided, out) == ([], frozenset())


def test_native_swap_pages_checks_its_own_rows():
    """_C.swap_pages is reachable directly: a row whose end wraps int64 is refused."""
    from nereus_comm import _C

    for row in (
        (2**63 - PAGE_BYTES, PAGE_BYTES, 2 * PAGE_BYTES),
        (PAGE_BYTES, 2 * PAGE_BYTES, 2 * PAGE_BYTES),
    ):
        with pytest.raises(ValueError, match=r"address space|overlap"):
            _C.swap_pages(np.array([row], dtype=np.int64))


# Pairs that passed the checks and were copied from or to wild addresses (the process
# died): a bool taken for address 1, a range that ends past 2**63 - 1. Run in a child
# so that the test process survives the old behaviour.
_WILD_PAIRS = """
import torch
from nereus_comm.errors import RemapError
from nereus_comm.remap import move_ranges
b = torch.ones(16, dtype=torch.uint8)
for pair, match in (((True, b.data_ptr(), 8), "three ints"),
                    ((2**63 - 8, b.data_ptr(), 16), "past the address space")):
    try:
        move_ranges([pair])
    except RemapError as e:
        assert match in str(e), e
    else:
        raise SystemExit(f"{pair} was moved")
assert bool((b == 1).all())
print("ok")
"""


def test_move_ranges_rejects_wild_pairs_in_a_child_process():
    proc = subprocess.run(
        [sys.executable, "-c", _WILD_PAIRS], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
