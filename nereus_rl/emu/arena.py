"""A worker's device-memory arena: its budget reserved once, units' state carved from it.

Why
    On a CPU worker most of a cold Extend is page faulting, not copying: the
    receiver's first touch of fresh memory costs several times the copy into touched
    memory (far more when the host has not backed the pages yet), and without an arena
    a "warm" Extend faults again because the previous unit's memory went back to the OS
    on Destroy. A GPU worker does not pay this: its memory is reserved when the
    process starts (a CUDA caching allocator, vLLM's ``gpu_memory_utilization``).
    So a worker reserves its budget as one buffer, touched once (``prefault``), a
    unit's state is one block of it (contiguous tensors side by side, as Megatron's
    parameter and gradient buffers; each tensor a storage of its own over its bytes,
    see :meth:`Arena.carve`), and Destroy returns the
    block to the arena, so the next unit writes into warm pages.

Layout
    One or more *segments* (uint8 tensors). With ``prefault=True`` the whole budget
    is one segment, allocated and touched at creation. Otherwise segments are made
    on demand (first touch then) and kept after their blocks are freed, up to the
    budget; entirely free segments are let go only when a request would not fit
    otherwise. Inside a segment, blocks are first-fit ranges aligned to
    :data:`ALIGN` bytes; free neighbours merge. Segments, and tensors of at least
    :data:`PAGE_ALIGN_MIN` bytes, start on a page: a Split or Merge then moves the
    pages of the bytes a rank keeps from the old unit's block into the new one's
    (:mod:`nereus_comm.remap`) instead of copying them, and the old block goes back
    holding the new block's former pages (still touched).

Huge pages
    Segments are advised to transparent huge pages (``MADV_HUGEPAGE``) and start on
    :data:`HUGE_PAGE` bytes, and so do blocks of at least that size. The kernel moves
    a huge page whole only between addresses that agree modulo 2 MiB (it splits it
    into 4 KiB pages otherwise, which makes later cross-memory reads of those bytes
    and later page moves slower), and splits the huge pages at either end of
    a moved range that does not start or end on one. So a tensor of at least
    :data:`HUGE_PAGE` bytes is placed at the offset within a huge page that the
    caller asks for (``phases``, see :meth:`Arena.carve`: where the bytes a Split
    or Merge will move into it sit in the old unit), else at the start of one. The
    padding this takes is kept small (greedy order, smaller tensors in the gaps),
    and dropped when it does not fit.

Configuration (per worker process; :func:`arena_config`)
    ``NEREUS_ARENA_BYTES``: the budget (bytes; suffixes K, M, G allowed; ``0``
    turns the arena off: plain allocations, as before). ``NEREUS_ARENA_PREFAULT``:
    ``1`` reserves and touches the whole budget at creation. ``EMUManager`` options
    ``arena_bytes`` / ``arena_prefault`` override both.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nereus_rl.emu.types import EMUError

__all__ = [
    "ALIGN",
    "ARENA_BYTES_ENV",
    "ARENA_PREFAULT_ENV",
    "HUGE_PAGE",
    "PAGE_ALIGN_MIN",
    "Arena",
    "ArenaBlock",
    "ArenaExhaustedError",
    "arena_config",
    "parse_bytes",
]

ARENA_BYTES_ENV = "NEREUS_ARENA_BYTES"
ARENA_PREFAULT_ENV = "NEREUS_ARENA_PREFAULT"
#: Every tensor of a block starts on this boundary (a cache line; and 4 KiB blocks
#: keep two units off one page).
ALIGN = 64
_BLOCK_ALIGN = 4096
#: Tensors of at least this many bytes start on a page (segments start on one too),
#: so that a Split or Merge can move the pages of what a rank keeps from the old
#: unit's block into the new one's instead of copying them (nereus_comm.remap).
PAGE_ALIGN_MIN = 64 << 10
#: A transparent huge page (x86-64, arm64 with 4 KiB pages): segments and blocks of at
#: least this size start on one, and tensors of at least this size are placed at the
#: offset within one that carve's ``phases`` ask for.
HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # <sys/mman.h>, Linux
#: Fraction of its share of host memory a worker takes by default (vLLM's default
#: gpu_memory_utilization is 0.9).
DEFAULT_FRACTION = 0.9


class ArenaExhaustedError(EMUError):
    """A unit's state does not fit in a worker's arena; nothing was allocated or moved."""


def parse_bytes(text: str | int) -> int:
    """``"1536M"`` / ``"2G"`` / ``"4096"`` -> bytes.

    Raises:
        ValueError: not a non-negative size.
    """
    if isinstance(text, int):
        n = text
    else:
        s = text.strip().upper().removesuffix("B").removesuffix("I")
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
        try:
            n = int(float(s[:-1] if mult > 1 else s) * mult)
        except ValueError:
            raise ValueError(
                f"{ARENA_BYTES_ENV}={text!r} is not a size; use bytes or e.g. 1536M, 2G"
            ) from None
    if n < 0:
        raise ValueError(f"an arena budget must be >= 0 bytes, got {n}")
    return n


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 << 30


def arena_config(
    budget: int | str | None, prefault: bool | None, num_local_workers: int
) -> tuple[int, bool]:
    """The (budget bytes, prefault) a worker's arena gets.

    Arguments:
        budget: bytes (or "2G"); None: ``NEREUS_ARENA_BYTES``, else
            DEFAULT_FRACTION of host memory over ``num_local_workers``.
        prefault: None: ``NEREUS_ARENA_PREFAULT`` ("1" on), else False (segments
            on demand: tests and small jobs need MBs, and touching GiBs per worker
            costs seconds and the memory of a shared machine).
        num_local_workers: workers sharing this host's memory.

    Returns:
        (budget, prefault); budget 0 means no arena.
    """
    if budget is None:
        env = os.environ.get(ARENA_BYTES_ENV, "").strip()
        budget = (
            parse_bytes(env)
            if env
            else int(DEFAULT_FRACTION * _host_memory() / max(1, num_local_workers))
        )
    if prefault is None:
        prefault = os.environ.get(ARENA_PREFAULT_ENV, "").strip().lower() in ("1", "on", "yes")
    return parse_bytes(budget), bool(prefault)


def _round(n: int, align: int) -> int:
    return (n + align - 1) // align * align


@dataclass(eq=False)
class ArenaBlock:
    """One allocation: ``nbytes`` at ``offset`` of segment ``segment`` (free it once)."""

    segment: int
    offset: int
    nbytes: int
    flat: torch.Tensor
    freed: bool = False

    def __repr__(self) -> str:
        state = "freed" if self.freed else "live"
        return f"ArenaBlock(seg {self.segment} @ {self.offset}, {self.nbytes} B, {state})"


def _advise_huge(addr: int, nbytes: int) -> None:
    """Ask for transparent huge pages over [addr, addr + nbytes) (best effort: THP may
    be off, or the libc call missing; the memory then stays in 4 KiB pages)."""
    start = addr + (-addr % HUGE_PAGE)
    end = (addr + nbytes) // HUGE_PAGE * HUGE_PAGE
    if end <= start or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass


class _Segment:
    def __init__(self, nbytes: int, touch: bool) -> None:
        # A huge page more than asked, so the segment can start on one (see "Huge
        # pages"); the slack is never touched.
        raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
        skip = -raw.data_ptr() % HUGE_PAGE
        self.buf = raw[skip : skip + nbytes]
        _advise_huge(self.buf.data_ptr(), nbytes)  # before the first touch faults pages in
        if touch:
            self.buf.fill_(0)  # the first touch: every page faulted in now, once
        self.np = self.buf.numpy()  # shares the memory; tensors are carved through it
        self.nbytes = nbytes
        self.free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, size), by offset

    def take(self, n: int, align: int = _BLOCK_ALIGN) -> int | None:
        for i, (off, size) in enumerate(self.free):
            at = _round(off, align)
            if at + n <= off + size:
                # what is left before and after the block stays free
                rest = [(o, k) for o, k in ((off, at - off), (at + n, off + size - at - n)) if k]
                self.free[i : i + 1] = rest
                return at
        return None

    def give(self, off: int, n: int) -> None:
        free = self.free
        i = 0
        while i < len(free) and free[i][0] < off:
            i += 1
        free.insert(i, (off, n))
        # merge with the right, then the left neighbour
        if i + 1 < len(free) and free[i][0] + free[i][1] == free[i + 1][0]:
            free[i] = (free[i][0], free[i][1] + free[i + 1][1])
            del free[i + 1]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == free[i][0]:
            free[i - 1] = (free[i - 1][0], free[i - 1][1] + free[i][1])
            del free[i]

    @property
    def used(self) -> int:
        return self.nbytes - sum(size for _, size in self.free)

    @property
    def largest_free(self) -> int:
        return max((size for _, size in self.free), default=0)


class Arena:
    """A worker's memory budget, carved into blocks that are returned for reuse.

    Arguments:
        budget: bytes this worker may hold in arena blocks (its "device memory").
        prefault: reserve the whole budget now, as one touched buffer; otherwise
            segments are made (and touched by their first user) on demand.

    Raises:
        ValueError: budget < 1.
    """

    def __init__(self, budget: int, *, prefault: bool = False) -> None:
        if budget < 1:
            raise ValueError(f"an arena needs a budget of at least 1 byte, got {budget}")
        self.budget = budget
        self.prefault = prefault
        self._segments: dict[int, _Segment] = {}
        self._next = 0
        self.live_blocks = 0
        self.peak_used = 0
        self.allocs = 0
        #: allocations served from pages an earlier block had touched (or the
        #: prefaulted segment) vs from a segment made for them.
        self.reused = 0
        t0 = time.perf_counter()
        if prefault:
            self._add(budget, touch=True)
        self.reserve_seconds = time.perf_counter() - t0

    def __repr__(self) -> str:
        return (
            f"Arena(budget {self.budget} B, reserved {self.reserved} B, used {self.used} B, "
            f"{self.live_blocks} blocks, prefault={self.prefault})"
        )

    @property
    def reserved(self) -> int:
        """Bytes held in segments (touched or about to be)."""
        return sum(s.nbytes for s in self._segments.values())

    @property
    def used(self) -> int:
        """Bytes in live blocks (alignment included)."""
        return sum(s.used for s in self._segments.values())

    def stats(self) -> dict[str, float]:
        """Budget, reserved, used and peak bytes, block and reuse counts, reserve seconds."""
        return {
            "budget": self.budget,
            "reserved": self.reserved,
            "used": self.used,
            "peak_used": self.peak_used,
            "live_blocks": self.live_blocks,
            "segments": len(self._segments),
            "allocs": self.allocs,
            "reused": self.reused,
            "reserve_s": self.reserve_seconds,
            "prefault": self.prefault,
        }

    def _add(self, nbytes: int, touch: bool) -> int:
        sid = self._next
        self._next += 1
        self._segments[sid] = _Segment(nbytes, touch)
        return sid

    def alloc(self, nbytes: int, what: str = "a block") -> ArenaBlock:
        """A block of at least ``nbytes`` (rounded up to 4 KiB).

        Raises:
            ArenaExhaustedError: the budget cannot hold it (names the budget, what is
                used, the largest free range and the request); nothing is allocated.
        """
        n = _round(max(nbytes, 1), _BLOCK_ALIGN)
        align = HUGE_PAGE if n >= HUGE_PAGE else _BLOCK_ALIGN
        for sid, seg in self._segments.items():
            off = seg.take(n, align)
            if off is not None:
                self.reused += 1
                return self._block(sid, off, n)
        if not self.prefault:
            idle = [s for s, seg in self._segments.items() if seg.used == 0]
            if (
                self.reserved + n
                > self.budget
                >= self.reserved + n - sum(self._segments[s].nbytes for s in idle)
            ):
                # Whole free segments are let go only now, when their bytes are needed
                # in one piece (and only if that is enough).
                for sid in idle:
                    del self._segments[sid]
            if self.reserved + n <= self.budget:
                sid = self._add(n, touch=False)
                return self._block(sid, self._segments[sid].take(n, align), n)
        largest = max((s.largest_free for s in self._segments.values()), default=0)
        raise ArenaExhaustedError(
            f"{what} needs {n} B ({n / 2**20:.1f} MiB) but the worker's arena budget is "
            f"{self.budget} B ({self.budget / 2**20:.1f} MiB), {self.used} B in use, largest "
            f"free range {largest} B; destroy a unit on this device, pick other devices, or "
            "raise the budget (EMUManager(arena_bytes=...) or NEREUS_ARENA_BYTES)"
        )

    def _block(self, sid: int, off: int, n: int) -> ArenaBlock:
        self.allocs += 1
        self.live_blocks += 1
        self.peak_used = max(self.peak_used, self.used)
        return ArenaBlock(sid, off, n, self._segments[sid].buf[off : off + n])

    def free(self, block: ArenaBlock) -> None:
        """Return a block; its tensors must not be used any more.

        Raises:
            ValueError: freed twice, or not from this arena.
        """
        seg = self._segments.get(block.segment)
        if block.freed or seg is None or block.flat.data_ptr() != seg.buf.data_ptr() + block.offset:
            raise ValueError(f"{block!r} is not a live block of {self!r}")
        block.freed = True
        seg.give(block.offset, block.nbytes)
        self.live_blocks -= 1

    def carve(
        self,
        shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        what: str = "a unit",
        phases: Mapping[str, int] | None = None,
    ) -> tuple[ArenaBlock, dict[str, torch.Tensor]]:
        """One block holding a contiguous tensor per name, side by side.

        Arguments:
            shapes: name -> (shape, dtype).
            what: how the error names the request.
            phases: name -> the offset within a huge page (modulo :data:`HUGE_PAGE`,
                rounded down to a page) at which a tensor of at least HUGE_PAGE bytes
                should start: the page moves of a Split or Merge keep huge pages
                whole only where source and destination agree (see the module's
                "Huge pages"). Default 0 (a later move of the tensor's pages then
                splits fewest). When the padding this takes does not fit, the
                tensors are packed tightly instead.

        Returns:
            (the block, name -> tensor in the order of ``shapes``); each tensor has a
            storage of its own over its bytes of the block, and holds whatever the
            block last held.

        Raises:
            ArenaExhaustedError: see :meth:`alloc`.
        """
        spans = _layout(shapes, phases or {})
        at = max((off + n for off, n in spans.values()), default=0)
        try:
            block = self.alloc(at, what)
        except ArenaExhaustedError:
            # The padding that keeps huge pages does not fit: the tight layout, whose
            # page moves split some huge pages, rather than no unit at all.
            spans = _layout(shapes, {}, tight=True)
            block = self.alloc(max((off + n for off, n in spans.values()), default=0), what)
        mem = self._segments[block.segment].np
        out = {}
        for name, (shape, dtype) in shapes.items():
            off, nbytes = spans[name]
            if not nbytes:
                out[name] = torch.empty(shape, dtype=dtype)
                continue
            # Its own storage over its own bytes (not a view of the segment): torch.save
            # and pickling write only those bytes, DCP does not clone it, and APIs that
            # assume a storage offset of 0 (Generator.set_state) work.
            start = block.offset + off
            raw = torch.frombuffer(mem[start : start + nbytes], dtype=torch.uint8)
            out[name] = raw.view(dtype).view(shape)
        return block, out


def _align_of(nbytes: int) -> int:
    return _BLOCK_ALIGN if nbytes >= PAGE_ALIGN_MIN else ALIGN


def _layout(
    shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    phases: Mapping[str, int],
    tight: bool = False,
) -> dict[str, tuple[int, int]]:
    """name -> (offset in the block, bytes).

    Tensors of at least HUGE_PAGE bytes go first, each at its phase (0 if none), in
    the order that pads least (greedily, the one whose phase is nearest ahead of
    where the block has got to); the padding before each is filled with the smaller
    tensors that fit (largest first). The rest follow, page-aligned from
    PAGE_ALIGN_MIN bytes, else ALIGN-aligned. With ``tight``, no phases: every
    tensor just aligned.
    """
    sizes = {n: math.prod(shape) * dt.itemsize for n, (shape, dt) in shapes.items()}
    phased = [] if tight else [n for n in sizes if sizes[n] >= HUGE_PAGE]
    want = {n: phases.get(n, 0) % HUGE_PAGE // _BLOCK_ALIGN * _BLOCK_ALIGN for n in phased}
    rest = sorted((n for n in sizes if n not in want), key=lambda n: -sizes[n])
    spans, at = {}, 0
    while phased:
        name = min(phased, key=lambda n: (want[n] - at) % HUGE_PAGE)
        phased.remove(name)
        target = at + (want[name] - at) % HUGE_PAGE
        for other in list(rest):  # into the padding
            start = _round(at, _align_of(sizes[other]))
            if start + sizes[other] <= target:
                spans[other] = (start, sizes[other])
                at = start + sizes[other]
                rest.remove(other)
        spans[name] = (target, sizes[name])
        at = target + sizes[name]
    for name in sizes:
        if name not in spans:
            at = _round(at, _align_of(sizes[name]))
            spans[name] = (at, sizes[name])
            at += sizes[name]
    return spans


# ---------------------------------------------------------------- driver side


def configure_workers(
    driver, ranks: Sequence[int], budget: int | str | None, prefault: bool | None
) -> dict[int, dict[str, float]]:
    """Set up the arena of each worker in ``ranks`` (``emu.arena``); their stats by rank.

    Each worker resolves the defaults itself (its environment, its host's memory over
    the workers the driver knows on that host).
    """
    hosts = {r: getattr(driver.infos.get(r), "host", None) for r in driver.workers}
    per_host = {h: sum(1 for x in hosts.values() if x == h) for h in hosts.values()}
    pending = {
        r: driver.submit([r], "emu.arena", budget, prefault, per_host[hosts.get(r)]) for r in ranks
    }
    return {r: driver.wait(p)[r] for r, p in pending.items()}


def reserve_units(driver, new: Mapping[int, list[tuple[int, str, Any]]]) -> float:
    """Carve new units' blocks (``emu.reserve``) on each rank before any byte moves.

    Arguments:
        new: rank -> [(uid, stage, unit layout)] of the units it will hold.

    Returns:
        The slowest rank's allocation seconds.

    Raises:
        ArenaExhaustedError: a rank's arena cannot hold its shards (what the worker
            said; the ranks that succeeded keep their blocks until ``emu.drop``).
    """
    from nereus_rl.runtime import RemoteError

    calls = {r: driver.submit([r], "emu.reserve", items) for r, items in new.items()}
    worst, errors = 0.0, []
    for r, pending in calls.items():  # every rank answers before anything is raised
        try:
            worst = max(worst, driver.wait(pending)[r]["alloc_s"])
        except RemoteError as e:
            errors.append(e)
    exhausted = [e for e in errors if e.error_type == ArenaExhaustedError.__name__]
    if exhausted:
        raise ArenaExhaustedError(exhausted[0].error) from exhausted[0]
    if errors:
        raise errors[0]
    return worst
