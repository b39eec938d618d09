"""Triton copy over a table of 2-D strided regions (device memory).

One launch copies a whole table: pack (regions -> one flat buffer), unpack (the
inverse) and region-to-region copies are all the same kernel, only the table differs.
The kernel moves bytes, never values: a bf16 NaN or an int64 survives bit for bit.

Why bytes through a same-width integer view: the widest power-of-two alignment (up to
16 bytes) that divides every address, row length and stride of the table is chosen on
the host; the kernel moves 1/2/4-byte integers and is told (tl.multiple_of on the row
pointers) that each row starts on that boundary, so a fully 16-byte aligned table
compiles to 128-bit loads and stores (checked in the sm_90 PTX by tests/comm/test_pack.py),
the widest a thread can issue, which is what it takes to reach copy bandwidth.
Misaligned tables still work, with narrower accesses; note that one odd-sized region
in a pack shifts every later offset in the buffer and so narrows the whole table.
"""

from __future__ import annotations

import contextlib
import os
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

TABLE_COLUMNS = 6
"""Columns of a region table: src_addr, dst_addr, num_rows, row_bytes, src_stride_bytes,
dst_stride_bytes (all int64, addresses are raw data pointers)."""

_MAX_BLOCK = 4096  # units per program: 16 KiB per program for 4-byte units
_MIN_BLOCK = 512
_NUM_WARPS = 4
_MAX_FLAT_UNITS = 1 << 30  # short-row regions are split below this so int32 indices suffice
_UNIT_DTYPES = {1: tl.int8, 2: tl.int16, 4: tl.int32}


@triton.jit
def _copy_regions_kernel(
    table_ptr,
    tile_start_ptr,
    num_regions,
    UNIT: tl.constexpr,
    UNIT_BYTES: tl.constexpr,
    ALIGN_BYTES: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK: tl.constexpr,
    ROW_MIN: tl.constexpr,
):
    """Copy one tile (BLOCK units) of one region of a table.

    table_ptr: int64 [num_regions, 6] in units of UNIT: src_addr and dst_addr (bytes),
    num_rows, row_units, src_stride_units, dst_stride_units. tile_start_ptr: int64
    [num_regions + 1], the first tile of each region (a prefix sum). Regions with
    row_units >= ROW_MIN get one tile per BLOCK-chunk of each row (contiguous,
    vectorized); shorter rows are tiled over their flattened rows (an index division
    per element).

    Worked example, BLOCK=8, ROW_MIN=4, bytes as units: table [[s, d, 2, 3, 8, 3]] (two
    rows of 3 bytes, 8 apart, packed back to back; 3 < ROW_MIN) has one flat tile:
    elements 0..5 map to (row, col) = (0,0) (0,1) (0,2) (1,0) (1,1) (1,2), read s+0 s+1
    s+2 s+8 s+9 s+10 and written to d+0..d+5; elements 6 and 7 are masked off. A row of
    20 bytes would instead get 3 row tiles: columns 0..7, 8..15 and 16..19 (masked).
    """
    pid = tl.program_id(0).to(tl.int64)
    # Region of this tile: the last i with tile_start[i] <= pid (empty regions have no
    # tiles, so they are never chosen). Invariant: tile_start[lo] <= pid < tile_start[hi].
    # A runtime loop, not a static one, so tables of any length share one compiled kernel.
    lo = pid * 0
    hi = lo + num_regions
    while hi - lo > 1:
        mid = (lo + hi) // 2
        right = (tl.load(tile_start_ptr + mid) <= pid).to(tl.int64)
        lo = lo + (mid - lo) * right
        hi = hi + (mid - hi) * (1 - right)
    row_ptr = table_ptr + lo * 6
    src_addr = tl.load(row_ptr + 0)
    dst_addr = tl.load(row_ptr + 1)
    num_rows = tl.load(row_ptr + 2)
    row_units = tl.multiple_of(tl.load(row_ptr + 3), VEC)
    src_stride = tl.load(row_ptr + 4)
    dst_stride = tl.load(row_ptr + 5)
    local = pid - tl.load(tile_start_ptr + lo)
    if row_units >= ROW_MIN:
        tiles_per_row = tl.cdiv(row_units, BLOCK)
        row = local // tiles_per_row
        col = (local - row * tiles_per_row) * BLOCK + tl.arange(0, BLOCK)
        mask = col < row_units
        # The alignment hint goes on the pointer (after the int->pointer cast); a hint on
        # the integer address does not survive the cast and leaves 4-byte accesses.
        src_row = (src_addr + row * src_stride * UNIT_BYTES).to(tl.pointer_type(UNIT))
        dst_row = (dst_addr + row * dst_stride * UNIT_BYTES).to(tl.pointer_type(UNIT))
        src = tl.multiple_of(src_row, ALIGN_BYTES) + col
        dst = tl.multiple_of(dst_row, ALIGN_BYTES) + col
        tl.store(dst, tl.load(src, mask=mask), mask=mask)
    else:
        # Names differ from the other branch: the compiler unifies same-named values.
        # int32 indices: the host keeps num_rows * row_units of short-row regions < 2**30.
        idx = local.to(tl.int32) * BLOCK + tl.arange(0, BLOCK)
        in_region = idx < (num_rows * row_units).to(tl.int32)
        row_units32 = row_units.to(tl.int32)
        idx_row = idx // row_units32
        idx_col = idx - idx_row * row_units32
        src_ptrs = src_addr.to(tl.pointer_type(UNIT)) + idx_row.to(tl.int64) * src_stride + idx_col
        dst_ptrs = dst_addr.to(tl.pointer_type(UNIT)) + idx_row.to(tl.int64) * dst_stride + idx_col
        tl.store(dst_ptrs, tl.load(src_ptrs, mask=in_region), mask=in_region)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _alignment(table: np.ndarray) -> int:
    """Largest power of two <= 16 dividing every address, row length and stride in use."""
    multi_row = table[:, 2] > 1
    bits = int(np.bitwise_or.reduce(table[:, :2].ravel())) if len(table) else 0
    bits |= int(np.bitwise_or.reduce(table[:, 3])) if len(table) else 0
    if multi_row.any():
        bits |= int(np.bitwise_or.reduce(table[multi_row, 4:6].ravel()))
    bits |= 16
    return bits & -bits


def _split_long_flat(table: np.ndarray, row_min: int, unit: int) -> np.ndarray:
    """Split short-row regions with >= 2**30 units by rows (the flat path indexes in int32)."""
    row_units = table[:, 3] // unit
    too_big = (row_units < row_min) & (table[:, 2] * row_units >= _MAX_FLAT_UNITS)
    if not too_big.any():
        return table
    pieces = [table[~too_big]]
    for src, dst, rows, row_bytes, src_stride, dst_stride in table[too_big].tolist():
        step = _MAX_FLAT_UNITS // (row_bytes // unit)
        for r in range(0, rows, step):
            n = min(step, rows - r)
            pieces.append(
                np.array(
                    [
                        [
                            src + r * src_stride,
                            dst + r * dst_stride,
                            n,
                            row_bytes,
                            src_stride,
                            dst_stride,
                        ]
                    ],
                    dtype=np.int64,
                )
            )
    return np.concatenate(pieces)


class CopyLaunch(NamedTuple):
    """A region table prepared for the device: run() queues the copy (again and again)."""

    meta: torch.Tensor  # int64 on the device: the table in units, then the tile prefix
    num_regions: int
    num_tiles: int
    unit_bytes: int
    align_bytes: int
    block: int
    device: torch.device

    def run(self) -> None:
        """Queue the copy on the current stream of the device (nothing if no tiles)."""
        if self.num_tiles == 0:
            return
        cols = self.num_regions * TABLE_COLUMNS
        ctx = (
            torch.cuda.device(self.device)
            if self.device.type == "cuda"
            else contextlib.nullcontext()
        )
        with ctx:
            _copy_regions_kernel[(self.num_tiles,)](
                self.meta[:cols],
                self.meta[cols:],
                self.num_regions,
                UNIT=_UNIT_DTYPES[self.unit_bytes],
                UNIT_BYTES=self.unit_bytes,
                ALIGN_BYTES=self.align_bytes,
                VEC=self.align_bytes // self.unit_bytes,
                BLOCK=self.block,
                ROW_MIN=self.block // 8,
                num_warps=_NUM_WARPS,
            )


_INT64_MAX = 2**63 - 1


def _check_extents(rows: np.ndarray) -> None:
    """Refuse rows whose last byte, on either side, lies past int64 (it would wrap).

    Every bound is tested by division, so nothing here overflows: rows * row_bytes,
    (rows - 1) * stride + row_bytes, address + that, and the table's total must all fit.
    One-row regions get stride = row_bytes (the stride is never stepped). Modifies
    ``rows`` (non-empty rows only) in place.
    """
    one = rows[:, 2] == 1
    rows[one, 4] = rows[one, 3]
    rows[one, 5] = rows[one, 3]
    if (rows[:, :2] < 0).any():
        raise ValueError("table has a negative address; pass data_ptr() of live tensors")
    if (rows[:, 4:6] < 0).any():
        raise ValueError("table has a negative stride in a multi-row region; strides are >= 0")
    n, row = rows[:, 2], rows[:, 3]
    if (n > _INT64_MAX // row).any():
        raise ValueError("table has num_rows * row_bytes past 2**63 - 1; split the region")
    for side in (0, 1):
        addr, stride = rows[:, side], rows[:, 4 + side]
        steps_fit = (stride == 0) | (n - 1 <= (_INT64_MAX - row) // np.maximum(stride, 1))
        span = np.where(steps_fit, (n - 1) * np.where(steps_fit, stride, 0) + row, 0)
        if not steps_fit.all() or (addr > _INT64_MAX - span).any():
            raise ValueError(
                "table has a region that ends past the address space (its address plus "
                "(num_rows - 1) * stride + row_bytes exceeds 2**63 - 1)"
            )
    if float((n * row).astype(np.float64).sum()) > 2.0**62:
        raise ValueError("table moves more than 2**62 bytes in all; split it")


def plan_copy(*, table: torch.Tensor, device: torch.device) -> CopyLaunch:
    """Check a region table, choose access width and tiling, and upload it to `device`.

    Arguments:
        table: CPU int64 tensor of shape (num_regions, 6): src_addr, dst_addr, num_rows,
            row_bytes, src_stride_bytes, dst_stride_bytes (addresses from data_ptr() of
            tensors on `device` that the caller keeps alive until the copy is done).
            Destinations must not overlap each other.
        device: a CUDA device (a CPU device too when TRITON_INTERPRET=1).

    Returns:
        A CopyLaunch whose run() queues the copy.

    Raises:
        ValueError: a malformed table (dtype, shape, device, negative sizes or
            strides, null addresses, a region whose end overflows int64) or a device
            Triton cannot run on.
    """
    if not isinstance(table, torch.Tensor) or table.dtype != torch.int64:
        raise ValueError(
            f"table must be an int64 torch.Tensor, got {getattr(table, 'dtype', type(table))}"
        )
    if table.dim() != 2 or table.shape[1] != TABLE_COLUMNS:
        raise ValueError(
            f"table must have shape (num_regions, {TABLE_COLUMNS}), got {tuple(table.shape)}"
        )
    if table.device.type != "cpu":
        raise ValueError(
            f"table must be a CPU tensor (it is uploaded once per call), got {table.device}"
        )
    device = torch.device(device)
    if device.type != "cuda" and not (device.type == "cpu" and _interpreting()):
        raise ValueError(
            f"Triton copies need a CUDA device, got {device}; use the host path for CPU "
            "memory (or set TRITON_INTERPRET=1 before importing triton to test on CPU)"
        )
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    rows = table.contiguous().numpy()
    if (rows[:, 2:4] < 0).any():
        raise ValueError("table has a negative num_rows or row_bytes; sizes must be >= 0")
    rows = rows[(rows[:, 2] > 0) & (rows[:, 3] > 0)]
    if (rows[:, :2] == 0).any():
        raise ValueError("table has a null address; pass data_ptr() of live tensors")
    if len(rows) == 0:
        return CopyLaunch(torch.zeros(1, dtype=torch.int64), 0, 0, 1, 1, _MIN_BLOCK, device)
    rows = rows.copy()
    _check_extents(rows)
    # Rows that follow each other on both sides are one long row: vectorized row tiles.
    packed = (rows[:, 2] > 1) & (rows[:, 4] == rows[:, 3]) & (rows[:, 5] == rows[:, 3])
    rows[packed, 3] *= rows[packed, 2]
    rows[packed, 2] = 1
    align = _alignment(rows)
    unit = min(align, 4)
    # Programs as wide as the longest row (up to _MAX_BLOCK): few programs for long rows,
    # few idle lanes when every row is short.
    longest = int(rows[:, 3].max()) // unit
    block = min(_MAX_BLOCK, max(_MIN_BLOCK, 1 << max(0, longest - 1).bit_length()))
    row_min = block // 8
    rows = _split_long_flat(rows, row_min, unit)
    units = rows.copy()
    units[:, 3:6] //= unit
    row_units = units[:, 3]
    tiles = np.where(
        row_units >= row_min,
        units[:, 2] * -(-row_units // block),
        -(-(units[:, 2] * row_units) // block),
    )
    tile_start = np.concatenate([[0], np.cumsum(tiles)]).astype(np.int64)
    num_tiles = int(tile_start[-1])
    if num_tiles >= 2**31:
        raise ValueError(f"table needs {num_tiles} programs, over the grid limit; split it")
    meta = torch.from_numpy(np.concatenate([units.ravel(), tile_start]))
    if device.type == "cuda":
        # Pinned + non_blocking: a pageable upload would wait for the whole stream. The
        # caching host allocator keeps the pinned block until the copy has run.
        meta = meta.pin_memory().to(device, non_blocking=True)
    return CopyLaunch(meta, len(units), num_tiles, unit, align, block, device)


def copy_regions(*, table: torch.Tensor, device: torch.device) -> int:
    """Copy every region of a table whose memory lives on `device`, in one launch.

    Arguments:
        table, device: as for plan_copy().

    Returns:
        The number of programs launched (0 when the table moves no byte). The copy is
        queued on the current stream of `device`.

    Raises:
        ValueError: as for plan_copy().
    """
    launch = plan_copy(table=table, device=device)
    launch.run()
    return launch.num_tiles
