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
"""

from __future__ import annotations

import bisect
import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from nereus_comm import _C

__all__ = ["MIN_MOVE_BYTES", "PAGE_BYTES", "PageMoves", "move_ranges"]

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
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

    Swapping a row of ``swaps`` again (``_C.swap_pages``) would give both ranges their
    own pages back.
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


def move_ranges(pairs: Sequence[tuple[int, int, int]]) -> PageMoves:
    """Put the bytes of each (src, dst, nbytes) range at dst: whole pages moved, the rest copied.

    The sources' moved pages then hold what the destinations held: the source ranges
    must not be read again. Ranges must not overlap.

    Arguments:
        pairs: (source address, destination address, bytes), host memory of this
            process that the caller keeps alive.

    Returns:
        The swaps made and the bytes moved and copied.
    """
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
