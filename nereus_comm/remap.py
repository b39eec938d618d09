"""Move bytes between ranges of this process by remapping their pages, not copying them.

Why
    Where a reshard consumes its sources (an EMU Split or Merge: the old unit is
    dropped once the new ones hold the state), the bytes a rank keeps (its old
    shard, now part of a bigger tensor; or half of its old tensor, now its shard)
    need not be copied: the kernel can move the pages that hold them to where the
    new tensor wants them (``mremap``), a few microseconds per range against ~0.1 ms
    per MiB for a copy on a memory-bound host. :func:`move_ranges` swaps the pages,
    so both ranges stay mapped and touched: the destination's old pages go where
    the source was (the source's block goes back to its arena with warm pages).

Limits
    Linux >= 5.7 (``MREMAP_DONTUNMAP``), host memory in private anonymous mappings
    (``torch.empty`` of large tensors). Only whole pages move; a range whose source
    and destination differ in their offset within a page, or is short, is copied,
    and so are the partial pages at either end of the others. Each moved range
    splits the mappings around it (a VMA per range); when the process has more than
    half of ``vm.max_map_count`` mappings, everything is copied instead. A swap the
    kernel refuses is copied instead.

Use with reshard
    A caller that gives up its source shards asks :func:`local_page_moves` which of
    the plan's local copies can be moves, passes their indices to
    :func:`~nereus_comm.reshard.reshard` as ``local_done``, and calls
    :func:`move_ranges` on them once the reshard has returned (its peers are done
    reading the sources then). Should it have to undo them, :func:`swap_pages` of the
    swaps made, in reverse order, gives every range its own pages back.
"""

from __future__ import annotations

import bisect
import itertools
import operator
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from nereus_comm import _C
from nereus_comm.errors import RemapError, TensorMismatchError
from nereus_comm.plan import ReshardPlan
from nereus_comm.reshard_program import DIRECT_MIN_BYTES, Slot, program

__all__ = [
    "MIN_MOVE_BYTES",
    "PAGE_BYTES",
    "PageMoves",
    "local_page_moves",
    "move_ranges",
    "swap_pages",
]

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
#: The last address a range may end at: addresses and sizes cross into C++ as int64.
_MAX_ADDR = 2**63 - 1
#: Ranges shorter than this are copied: three system calls and a mapping split cost
#: about what copying 64 KiB does.
MIN_MOVE_BYTES = 64 << 10


def _max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


def _mapping_bounds() -> list[int] | None:
    """Every start and end address of this process's mappings, sorted (None: unknown)."""
    try:
        with open("/proc/self/maps") as f:
            spans = [line.split(" ", 1)[0].split("-") for line in f]
    except OSError:
        return None
    return sorted({int(x, 16) for span in spans for x in span})


@dataclass
class PageMoves:
    """What :func:`move_ranges` did: its swaps and its byte counts.

    Swapping the rows of ``swaps`` again, last first (:func:`swap_pages` of
    ``swaps[::-1]``), gives every range its own pages back.
    """

    swaps: np.ndarray
    bytes_moved: int
    bytes_copied: int
    #: errno of a swap the kernel refused (it and the ones after it were copied), or 0.
    error: int = 0


def _cut(a: int, b: int, n: int, bounds: list[int]) -> list[tuple[int, int, int]]:
    """[a, a+n) <-> [b, b+n) cut wherever a mapping starts or ends inside either range."""
    cuts = {0, n}
    for base in (a, b):
        i = bisect.bisect_right(bounds, base)
        while i < len(bounds) and bounds[i] < base + n:
            cuts.add(bounds[i] - base)
            i += 1
    at = sorted(cuts)
    return [(a + lo, b + lo, hi - lo) for lo, hi in itertools.pairwise(at)]


def _check_pairs(pairs: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    out = []
    for i, pair in enumerate(pairs):
        try:
            if any(isinstance(x, bool) for x in pair):
                raise TypeError  # a bool is not an address or a size
            src, dst, n = map(operator.index, pair)
        except (TypeError, ValueError):
            raise RemapError(
                f"pair {i} is {pair!r}; expected (source address, destination address, bytes) "
                "as three ints"
            ) from None
        if n < 0:
            raise RemapError(f"pair {i} moves {n} bytes; pass a size >= 0")
        if n and (src <= 0 or dst <= 0):
            raise RemapError(
                f"pair {i} has address {src if src <= 0 else dst:#x}; pass data_ptr() of live "
                "host tensors"
            )
        if n and max(src, dst) > _MAX_ADDR - n:
            raise RemapError(
                f"pair {i}: {n} bytes from {max(src, dst):#x} end past the address space; pass "
                "data_ptr() and sizes of live host tensors"
            )
        if n and abs(src - dst) < n:
            raise RemapError(
                f"pair {i}: the {n}-byte ranges at {src:#x} and {dst:#x} overlap; a range "
                "cannot move onto itself"
            )
        out.append((src, dst, n))
    return out


def move_ranges(pairs: Sequence[tuple[int, int, int]]) -> PageMoves:
    """Put the bytes of each (src, dst, nbytes) range at dst: whole pages moved, the rest copied.

    The sources' moved pages then hold what the destinations held: the source ranges
    must not be read again. Ranges must not overlap.

    Arguments:
        pairs: (source address, destination address, bytes), host memory of this
            process that the caller keeps alive.

    Returns:
        The swaps made and the bytes moved and copied.

    Raises:
        RemapError: a pair is not three ints, has a negative size, a null address, a
            range that ends past the address space, or a source that overlaps its
            destination; raised before any byte moves.
    """
    pairs = _check_pairs(pairs)
    # A _C built before swap_pages existed (a stale build) copies everything.
    bounds = _mapping_bounds() if hasattr(_C, "swap_pages") else None
    swaps: list[tuple[int, int, int]] = []
    copies: list[tuple[int, int, int]] = []
    if bounds is None or len(bounds) + 4 * len(pairs) > _max_map_count():
        bounds = None  # too many mappings (each bound is at most two) or unknown
    for src, dst, n in pairs:
        lo = -src % PAGE_BYTES
        mid = (n - lo) // PAGE_BYTES * PAGE_BYTES
        if bounds is None or (dst - src) % PAGE_BYTES or mid < MIN_MOVE_BYTES:
            copies.append((src, dst, n))
            continue
        swaps += _cut(src + lo, dst + lo, mid, bounds)
        copies += [(src, dst, lo), (src + lo + mid, dst + lo + mid, n - lo - mid)]
    table = np.array(swaps, dtype=np.int64).reshape(-1, 3)
    done, err = 0, 0
    if len(table):
        done, err = _C.swap_pages(table)
        copies += [tuple(int(x) for x in row) for row in table[done:]]  # refused: copied
    copies = [c for c in copies if c[2]]
    if copies:
        t = np.array([(s, d, 1, n, n, n) for s, d, n in copies], dtype=np.int64)
        _C.copy_regions(t, 1)
    return PageMoves(
        swaps=table[:done],
        bytes_moved=int(table[:done, 2].sum()),
        bytes_copied=sum(n for _, _, n in copies),
        error=err,
    )


def swap_pages(table: np.ndarray | Sequence[tuple[int, int, int]]) -> tuple[int, int]:
    """Swap the pages of each row's two ranges (a, b, nbytes), row by row (``mremap``).

    Swapping :attr:`PageMoves.swaps` again, last row first, undoes a
    :func:`move_ranges`: ``swap_pages(moves.swaps[::-1])``.

    Arguments:
        table: rows of (a, b, nbytes), e.g. an int64 array of shape (n, 3): two
            disjoint ranges of this process's host memory, each inside one private
            anonymous mapping (what ``torch.empty`` gives large tensors), both
            addresses and nbytes multiples of :data:`PAGE_BYTES`.

    Returns:
        (rows swapped, errno of the first row the kernel refused or 0). The rows
        before that one are swapped; it and the rows after it are as they were.

    Raises:
        RemapError: the table is not rows of three ints, or a row has a null address,
            a negative size, an address or size that is not a whole number of pages,
            a range that ends past the address space, or ranges that overlap; raised
            before any page moves.
        RuntimeError: the native core was built without swap_pages (rebuild it:
            ``python setup.py build_ext --inplace``).
    """
    arr = np.asarray(table)
    if arr.size == 0:
        return 0, 0
    if arr.dtype.kind not in "iu" or arr.ndim != 2 or arr.shape[1] != 3:
        raise RemapError(
            f"the swap table must be rows of (a, b, nbytes) ints, got {arr.dtype} of shape "
            f"{arr.shape}; pass an int64 array of shape (n, 3) such as PageMoves.swaps"
        )
    arr = np.ascontiguousarray(arr, dtype=np.int64)
    a, b, n = arr[:, 0], arr[:, 1], arr[:, 2]
    live = n > 0
    checks = (
        ((a <= 0) | (b <= 0), "has a null or negative address; pass addresses of live tensors"),
        (n < 0, "has nbytes < 0"),
        (
            live & (((a % PAGE_BYTES) != 0) | ((b % PAGE_BYTES) != 0) | ((n % PAGE_BYTES) != 0)),
            f"is not page-aligned: both addresses and nbytes must be multiples of {PAGE_BYTES}",
        ),
        (
            live & (np.maximum(a, b) > _MAX_ADDR - n),
            "ends past the address space; pass addresses of live tensors",
        ),
        (live & (np.abs(a - b) < n), "has ranges that overlap; swap disjoint ranges"),
    )
    for bad, why in checks:
        if bad.any():
            i = int(np.argmax(bad))
            raise RemapError(f"swap row {i} (a={a[i]:#x}, b={b[i]:#x}, nbytes={n[i]}) {why}")
    if not hasattr(_C, "swap_pages"):
        raise RuntimeError(
            "nereus_comm._C was built without swap_pages; rebuild it: "
            "python setup.py build_ext --inplace"
        )
    done, err = _C.swap_pages(arr)
    return int(done), int(err)


def _contiguous(slot: Slot) -> bool:
    _, _, rows, row, stride = slot
    return rows <= 1 or row == 0 or stride == row


def local_page_moves(
    plan: ReshardPlan,
    rank: int,
    tensors: Mapping[str, torch.Tensor],
    out: Mapping[str, torch.Tensor],
    *,
    direct_min_bytes: int = DIRECT_MIN_BYTES,
) -> tuple[list[tuple[int, int, int]], frozenset[int]]:
    """The plan's local copies on ``rank`` that can be page moves after the exchange.

    A local copy can be a move when it is one contiguous run on both sides (a dim-0
    shard inside its full tensor, a replicated tensor, half of a full tensor that
    becomes a dim-0 shard) of contiguous tensors, at least :data:`MIN_MOVE_BYTES`, in
    host memory, and the only local copy of its source tensor (a second one would find
    the bytes gone). A
    row-parallel (dim-1) piece is strided in the full tensor and stays a copy.

    Arguments:
        plan: the ReshardPlan.
        rank: this process's global rank.
        tensors: this rank's source shards by spec name, as given to reshard; the
            caller gives them up (their moved bytes are gone after the moves).
        out: this rank's destination shards by spec name, as given to reshard.
        direct_min_bytes: the value the reshard call passes (the plan's per-rank
            program is kept per value; the answer does not depend on it).

    Returns:
        ((source address, destination address, bytes) per move, for
        :func:`move_ranges` once reshard has returned; the indices of the plan's
        local copies they make, for reshard's ``local_done``).

    Raises:
        TensorMismatchError: a tensor of one of the plan's local copies on ``rank`` is
            missing from ``tensors`` or ``out``.
    """
    prog = program(plan, rank, direct_min_bytes)
    sides = ((prog.local_src, tensors, "source"), (prog.local_dst, out, "destination"))
    for slots, given, what in sides:
        missing = sorted({sl[0] for sl in slots if sl[0] not in given})
        if missing:
            raise TensorMismatchError(
                f"{what} tensors {missing} of rank {rank}'s local copies are missing; pass "
                f"the rank's {what} shards as for reshard"
            )
    reads: dict[str, int] = {}
    for sl in prog.local_src:
        reads[sl[0]] = reads.get(sl[0], 0) + 1
    pairs, done = [], set()
    for i, (s, d) in enumerate(zip(prog.local_src, prog.local_dst)):
        if not (_contiguous(s) and _contiguous(d)) or reads[s[0]] != 1:
            continue
        src_t, dst_t = tensors[s[0]], out[d[0]]
        nbytes = s[2] * s[3] * src_t.element_size()
        if src_t.device.type != "cpu" or dst_t.device.type != "cpu" or nbytes < MIN_MOVE_BYTES:
            continue
        # The slots' offsets count elements of a contiguous tensor: a strided one (a
        # column block, a transposed view) keeps its local copy, done by reshard.
        if not (src_t.is_contiguous() and dst_t.is_contiguous()):
            continue
        pairs.append(
            (
                src_t.data_ptr() + s[1] * src_t.element_size(),
                dst_t.data_ptr() + d[1] * dst_t.element_size(),
                nbytes,
            )
        )
        done.add(i)
    return pairs, frozenset(done)
