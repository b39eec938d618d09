"""Pack and unpack 2-D strided regions of many tensors, one call per table.

A Region is num_rows rows of row_elems contiguous elements inside a contiguous
tensor's storage, row r starting at element offset + r * row_stride (elements of the
tensor's dtype, counted from tensor.data_ptr()). Every piece of a reshard plan is
such a region (only one dim is ever split), so a whole message of pieces from many
tensors is one table:

    >>> w = torch.arange(12.0).view(3, 4)
    >>> buf = pack([Region(w, 1, 3, 2, 4)])          # w[:, 1:3], 3 rows of 2
    >>> buf.view(torch.float32)
    tensor([ 1.,  2.,  5.,  6.,  9., 10.])
    >>> unpack(buf, [Region(w, 2, 3, 2, 4)])         # writes them into w[:, 2:4]

CPU memory is copied by the C++ host path (nereus_comm._C.copy_regions: a persistent
thread pool splits the table's bytes evenly, GIL released); CUDA memory by one Triton
launch (nereus_comm.kernels.pack). A contiguous region needs no packing at all:
region_view() gives a 1-D view that a transport sends from or receives into directly.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from nereus_comm import _C
from nereus_comm.errors import NereusCommError

__all__ = [
    "PackError",
    "Region",
    "copy_regions",
    "is_contiguous_region",
    "pack",
    "pack_reference",
    "packed_nbytes",
    "region_view",
    "unpack",
    "unpack_reference",
]

_BACKENDS = ("host", "triton")


class PackError(NereusCommError, ValueError):
    """A region table cannot be copied (region outside storage, device or size mismatch)."""


class Region(NamedTuple):
    """num_rows rows of row_elems elements of `tensor`, row r at offset + r * row_stride.

    All counts are in elements of tensor.dtype, relative to tensor.data_ptr(); the
    tensor must be contiguous and its storage must hold every row.
    """

    tensor: torch.Tensor
    offset: int
    num_rows: int
    row_elems: int
    row_stride: int

    @property
    def nbytes(self) -> int:
        """Bytes the region holds."""
        return self.num_rows * self.row_elems * self.tensor.element_size()

    def __repr__(self) -> str:
        t = self.tensor
        dtype = str(t.dtype).removeprefix("torch.")
        return (
            f"Region({dtype}{list(t.shape)}@{t.device}, offset={self.offset}, "
            f"rows={self.num_rows}x{self.row_elems}, stride={self.row_stride})"
        )


class _Checked(NamedTuple):
    """A validated region in bytes: address, rows, row bytes, stride bytes."""

    addr: int
    num_rows: int
    row_bytes: int
    stride_bytes: int

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.row_bytes

    @property
    def contiguous(self) -> bool:
        return self.num_rows <= 1 or self.stride_bytes == self.row_bytes


def _check_region(region: Region, index: int, what: str) -> _Checked:
    """Validate one region against its tensor's storage and return it in bytes."""
    if not isinstance(region, tuple) or len(region) != 5:
        raise PackError(f"{what} {index} is {region!r}; expected a Region")
    t, *sizes = region
    if not isinstance(t, torch.Tensor):
        raise PackError(f"{what} {index}: tensor is a {type(t).__name__}, expected torch.Tensor")
    if not t.is_contiguous():
        raise PackError(
            f"{what} {index}: tensor of shape {tuple(t.shape)} is not contiguous; region "
            "offsets count elements from data_ptr(), so pass a contiguous tensor"
        )
    try:
        offset, num_rows, row_elems, row_stride = (operator.index(v) for v in sizes)
    except TypeError:
        raise PackError(f"{what} {index}: sizes {sizes!r} must be ints") from None
    for name, value in (("offset", offset), ("num_rows", num_rows), ("row_elems", row_elems)):
        if value < 0:
            raise PackError(f"{what} {index}: {name}={value}, expected >= 0")
    if num_rows > 1 and row_stride < row_elems:
        raise PackError(
            f"{what} {index}: row_stride={row_stride} < row_elems={row_elems}; rows overlap"
        )
    es = t.element_size()
    if num_rows == 0 or row_elems == 0:
        return _Checked(t.data_ptr(), 0, 0, 0)
    end = offset + (num_rows - 1) * row_stride + row_elems
    available = t.untyped_storage().nbytes() // es - t.storage_offset()
    if end > available:
        raise PackError(
            f"{what} {index}: {region!r} ends at element {end} but the tensor's storage holds "
            f"{available} elements from data_ptr(); the region lies outside the storage"
        )
    return _Checked(t.data_ptr() + offset * es, num_rows, row_elems * es, row_stride * es)


def _check_all(regions: Sequence[Region], what: str) -> tuple[list[_Checked], torch.device | None]:
    """Validate a table; every region must be on one device (returned; None if empty)."""
    device = None
    checked = []
    for i, r in enumerate(regions):
        c = _check_region(r, i, what)
        dev = r[0].device
        if device is None:
            device = dev
        elif dev != device:
            raise PackError(
                f"{what} {i} is on {dev} but {what} 0 is on {device}; one table holds one "
                "device's memory, so split the table by device"
            )
        checked.append(c)
    return checked, device


def _check_buffer(buf: torch.Tensor, nbytes: int, device: torch.device | None, what: str) -> None:
    if not isinstance(buf, torch.Tensor):
        raise PackError(f"{what} is a {type(buf).__name__}, expected a uint8 torch.Tensor")
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise PackError(
            f"{what} must be a contiguous 1-D uint8 tensor, got {buf.dtype} of shape "
            f"{tuple(buf.shape)}; use torch.empty(n, dtype=torch.uint8) or .view(torch.uint8)"
        )
    if device is not None and buf.device != device:
        raise PackError(f"{what} is on {buf.device} but the regions are on {device}")
    if buf.numel() < nbytes:
        raise PackError(
            f"{what} holds {buf.numel()} bytes but the regions need {nbytes}; "
            "size it with packed_nbytes(regions)"
        )


def _entry(src: _Checked, dst: _Checked) -> list[tuple[int, int, int, int, int, int]]:
    """Table rows copying src onto dst (same bytes, any row shapes)."""
    if src.nbytes == 0:
        return []
    if src.num_rows == dst.num_rows and src.row_bytes == dst.row_bytes:
        return [
            (src.addr, dst.addr, src.num_rows, src.row_bytes, src.stride_bytes, dst.stride_bytes)
        ]
    if src.contiguous:
        return [(src.addr, dst.addr, dst.num_rows, dst.row_bytes, dst.row_bytes, dst.stride_bytes)]
    if dst.contiguous:
        return [(src.addr, dst.addr, src.num_rows, src.row_bytes, src.stride_bytes, src.row_bytes)]
    # Both strided with different row lengths (never produced by a reshard plan, whose
    # two sides split the same dim): one row per run that stays inside a row of each.
    rows = []
    pos = 0
    while pos < src.nbytes:
        s_row, s_col = divmod(pos, src.row_bytes)
        d_row, d_col = divmod(pos, dst.row_bytes)
        n = min(src.row_bytes - s_col, dst.row_bytes - d_col)
        s_addr = src.addr + s_row * src.stride_bytes + s_col
        rows.append((s_addr, dst.addr + d_row * dst.stride_bytes + d_col, 1, n, n, n))
        pos += n
    return rows


def _run(
    table: list[tuple[int, ...]],
    device: torch.device | None,
    num_threads: int | None,
    backend: str | None,
) -> None:
    """Copy a table on the backend that owns `device`'s memory."""
    if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
        raise PackError(f"num_threads={num_threads!r}, expected None or an int >= 1")
    if backend is not None and backend not in _BACKENDS:
        raise PackError(f"backend={backend!r}, expected None or one of {_BACKENDS}")
    if not table or device is None:
        return
    if backend is None:
        backend = "host" if device.type == "cpu" else "triton"
    array = np.array(table, dtype=np.int64).reshape(-1, 6)
    if backend == "host":
        if device.type != "cpu":
            raise PackError(f"the host path copies CPU memory only, got {device}")
        _C.copy_regions(array, num_threads or 0)
        return
    if device.type not in ("cuda", "cpu"):
        raise PackError(f"no pack path for {device}; regions must be on CPU or CUDA")
    from nereus_comm.kernels import pack as kernels  # imports triton: only when needed

    kernels.copy_regions(table=torch.from_numpy(array), device=device)


def packed_nbytes(regions: Sequence[Region]) -> int:
    """Bytes pack() produces for `regions`.

    Arguments:
        regions: the table.

    Returns:
        The sum of the regions' bytes.
    """
    return sum(r.num_rows * r.row_elems * r.tensor.element_size() for r in regions)


def pack(
    regions: Sequence[Region],
    out: torch.Tensor | None = None,
    *,
    num_threads: int | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Concatenate the regions' bytes, in order, into a flat uint8 tensor.

    Arguments:
        regions: the table; every region on the same device.
        out: optional contiguous 1-D uint8 buffer of at least packed_nbytes(regions)
            bytes on that device (reused across calls to avoid allocation).
        num_threads: host threads to use (None: one per CPU of this process).
        backend: None picks by device ("host" for CPU, "triton" for CUDA); "triton"
            on CPU tensors is for tests under TRITON_INTERPRET=1.

    Returns:
        A uint8 tensor of exactly packed_nbytes(regions) bytes (a prefix of `out`
        when given), on the regions' device (CPU when the table is empty).

    Raises:
        PackError: a region outside its tensor's storage, a non-contiguous tensor,
            regions on different devices, a bad or too small `out`.
    """
    checked, device = _check_all(regions, "region")
    nbytes = sum(c.nbytes for c in checked)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=device or "cpu")
    else:
        _check_buffer(out, nbytes, device, "out")
    table = []
    addr = out.data_ptr()
    for c in checked:
        table += _entry(c, _Checked(addr, 1, c.nbytes, c.nbytes))
        addr += c.nbytes
    _run(table, device, num_threads, backend)
    return out[:nbytes]


def unpack(
    buf: torch.Tensor,
    regions: Sequence[Region],
    *,
    num_threads: int | None = None,
    backend: str | None = None,
) -> None:
    """Scatter a packed buffer back into the regions (the inverse of pack).

    Arguments:
        buf: contiguous 1-D uint8 tensor on the regions' device holding at least
            packed_nbytes(regions) bytes; its prefix is read in region order.
        regions: the table; destinations must not overlap each other.
        num_threads, backend: as for pack().

    Raises:
        PackError: as for pack(), with `buf` in place of `out`.
    """
    checked, device = _check_all(regions, "region")
    nbytes = sum(c.nbytes for c in checked)
    _check_buffer(buf, nbytes, device, "buf")
    table = []
    addr = buf.data_ptr()
    for c in checked:
        table += _entry(_Checked(addr, 1, c.nbytes, c.nbytes), c)
        addr += c.nbytes
    _run(table, device, num_threads, backend)


def copy_regions(
    src_regions: Sequence[Region],
    dst_regions: Sequence[Region],
    *,
    num_threads: int | None = None,
    backend: str | None = None,
) -> None:
    """Copy src_regions[i] onto dst_regions[i] for every i, in one call.

    Pairs may differ in dtype and row shape; each pair must hold the same bytes.

    Arguments:
        src_regions, dst_regions: equally long tables, all on one device.
        num_threads, backend: as for pack().

    Raises:
        PackError: the tables differ in length, a pair differs in bytes, or as for pack().
    """
    if len(src_regions) != len(dst_regions):
        raise PackError(
            f"{len(src_regions)} source regions but {len(dst_regions)} destination regions; "
            "pass one destination per source"
        )
    src, src_device = _check_all(src_regions, "source region")
    dst, dst_device = _check_all(dst_regions, "destination region")
    if src_device is not None and src_device != dst_device:
        raise PackError(f"source regions are on {src_device} but destinations on {dst_device}")
    table = []
    for i, (s, d) in enumerate(zip(src, dst)):
        if s.nbytes != d.nbytes:
            raise PackError(
                f"pair {i}: source holds {s.nbytes} bytes, destination {d.nbytes}; "
                "a pair must hold the same bytes"
            )
        table += _entry(s, d)
    _run(table, src_device, num_threads, backend)


def is_contiguous_region(region: Region) -> bool:
    """Whether the region's bytes follow each other (so it can be sent without packing).

    Arguments:
        region: any region.

    Returns:
        True for at most one row, empty rows, or rows that follow each other.
    """
    return region.num_rows <= 1 or region.row_elems == 0 or region.row_stride == region.row_elems


def region_view(region: Region) -> torch.Tensor:
    """A 1-D view (the tensor's dtype) of a contiguous region: zero-copy send/recv.

    Arguments:
        region: a region for which is_contiguous_region() holds.

    Returns:
        A view sharing the tensor's storage; writing it writes the region.

    Raises:
        PackError: the region is strided or lies outside the tensor's storage.
    """
    _check_region(region, 0, "region")
    if not is_contiguous_region(region):
        raise PackError(f"{region!r} is strided; pack() it instead of viewing it")
    t = region.tensor
    numel = region.num_rows * region.row_elems
    return t.as_strided((numel,), (1,), t.storage_offset() + region.offset)


def _reference_view(region: Region) -> torch.Tensor:
    t = region.tensor
    shape = (region.num_rows, region.row_elems)
    return t.as_strided(shape, (region.row_stride, 1), t.storage_offset() + region.offset)


def pack_reference(regions: Sequence[Region]) -> torch.Tensor:
    """pack() by torch slicing, one region at a time: the reference tests compare to."""
    parts = [_reference_view(r).contiguous().view(-1).view(torch.uint8) for r in regions]
    if not parts:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat([p.to(parts[0].device) for p in parts])


def unpack_reference(buf: torch.Tensor, regions: Sequence[Region]) -> None:
    """unpack() by torch slicing, one region at a time: the reference tests compare to."""
    pos = 0
    for r in regions:
        n = r.num_rows * r.row_elems * r.tensor.element_size()
        # clone: a uint8 slice at an odd offset cannot be viewed as a wider dtype.
        values = buf[pos : pos + n].clone().view(r.tensor.dtype).view(r.num_rows, r.row_elems)
        _reference_view(r).copy_(values)
        pos += n
