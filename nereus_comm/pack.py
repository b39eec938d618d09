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

import itertools
import operator
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from nereus_comm import _C
from nereus_comm.errors import PackError

__all__ = [
    "PackError",
    "Region",
    "RegionTable",
    "columns_table",
    "copy_regions",
    "copy_table",
    "copy_tables",
    "is_contiguous_region",
    "pack",
    "pack_reference",
    "packed_nbytes",
    "region_table",
    "region_view",
    "unpack",
    "unpack_reference",
    "unsupported_reason",
]

_BACKENDS = ("host", "triton")
#: Region fields below this (in absolute value) are checked with vectorized int64
#: arithmetic, which cannot overflow for them; larger ones in Python ints.
_SMALL = 2**31


class Region(NamedTuple):
    """num_rows rows of row_elems elements of `tensor`, row r at offset + r * row_stride.

    All counts are in elements of tensor.dtype, relative to tensor.data_ptr(); the
    tensor must be a plain dense tensor (no subclass such as DTensor, not sparse,
    quantized, nested or meta), contiguous, and its storage must hold every row.
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


class _TensorInfo(NamedTuple):
    """What a table needs of a tensor, looked up once per tensor per call."""

    data_ptr: int
    element_size: int
    available: int  # elements the storage holds from data_ptr()
    device: torch.device


#: The tensor types whose storage holds exactly their data (a Parameter is a plain tensor).
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def unsupported_reason(t: object) -> str | None:
    """Why the bytes of ``t`` cannot be copied by address, and what to pass instead.

    Region copies, transports and cross-memory-attach reads move the bytes at
    ``t.data_ptr()``. That is the tensor's data only for a plain, dense, strided
    tensor in memory that can be addressed; everything else would move garbage, or
    hand a null address to the native core (a DTensor's ``data_ptr()`` is 0).

    Arguments:
        t: anything handed in as a tensor.

    Returns:
        None when ``t`` is a plain dense tensor with addressable data; otherwise a
        phrase that completes "tensor ..." and says what to do, e.g. "is a DTensor
        ...; pass dtensor.to_local() ...".
    """
    if not isinstance(t, torch.Tensor):
        return f"is a {type(t).__name__}, not a torch.Tensor"
    kind = type(t)
    if kind is not torch.Tensor and kind is not torch.nn.Parameter:
        name = kind.__name__
        if hasattr(t, "to_local"):  # DTensor (and look-alikes): a wrapper over a local shard
            return (
                f"is a {name}, a wrapper whose own storage is not its data; pass "
                "dtensor.to_local() (this rank's shard, a plain tensor) and describe the "
                "full tensor in the TensorSpec"
            )
        return (
            f"is a tensor subclass ({kind.__module__}.{name}), whose storage need not be its "
            "data; pass the plain torch.Tensor that holds its values (e.g. materialize it, "
            "or t.as_subclass(torch.Tensor) where its storage is its data)"
        )
    if t.is_nested:
        return "is a nested tensor; pass its components (t.unbind()) or t.to_padded_tensor(0)"
    if t.layout is not torch.strided:
        return f"has layout {t.layout} (not dense); pass t.to_dense()"
    if t.is_quantized:
        return (
            f"is quantized ({t.dtype}): its bytes are the integers without the scale and zero "
            "point; pass t.dequantize(), or t.int_repr() under an integer spec and move "
            "q_scale()/q_zero_point() yourself"
        )
    if t.is_meta:
        return (
            "is on the meta device and has no data; materialize it first "
            "(e.g. torch.empty_like(t, device='cpu') and load its values)"
        )
    if t.is_conj() or t.is_neg():
        fix = "t.resolve_conj()" if t.is_conj() else "t.resolve_neg()"
        return f"carries a lazy conjugation or negation its bytes do not hold; pass {fix}"
    try:
        addr = t.data_ptr()
    except RuntimeError as e:  # e.g. a functorch-wrapped tensor inside vmap/grad
        return f"has no addressable data ({str(e).splitlines()[0]}); pass a plain tensor"
    if addr == 0 and t.numel() > 0:
        return "has no data (data_ptr() is 0); pass a plain tensor that holds the values"
    return None


def _tensor_info(t: object, index: int, what: str) -> _TensorInfo:
    if type(t) not in _PLAIN or t.layout is not torch.strided or t.is_quantized:
        why = unsupported_reason(t)
        if why is not None:
            raise PackError(f"{what} {index}: tensor {why}")
    elif t.is_nested or t.is_meta or t.is_conj() or t.is_neg():
        raise PackError(f"{what} {index}: tensor {unsupported_reason(t)}")
    if not t.is_contiguous():
        raise PackError(
            f"{what} {index}: tensor of shape {tuple(t.shape)} is not contiguous; region "
            "offsets count elements from data_ptr(), so pass a contiguous tensor"
        )
    es = t.element_size()
    available = t.untyped_storage().nbytes() // es - t.storage_offset()
    addr = t.data_ptr()
    if addr == 0 and available > 0:
        raise PackError(f"{what} {index}: tensor {unsupported_reason(t) or 'has a null address'}")
    return _TensorInfo(addr, es, available, t.device)


def _check_region(
    region: Region, index: int, what: str, info: _TensorInfo | None = None
) -> tuple[int, int, int, int]:
    """Validate one region; return (addr, num_rows, row_bytes, stride_bytes)."""
    if not isinstance(region, tuple) or len(region) != 5:
        raise PackError(f"{what} {index} is {region!r}; expected a Region")
    t, *sizes = region
    if info is None:
        info = _tensor_info(t, index, what)
    # Python ints throughout: they cannot wrap, so a crafted size fails the bounds check
    # below instead of passing it modulo 2**64.
    try:
        if any(isinstance(x, bool) or type(x).__name__ == "bool_" for x in sizes):
            raise TypeError
        offset, num_rows, row_elems, row_stride = map(operator.index, sizes)
    except TypeError:
        raise PackError(
            f"{what} {index}: sizes {sizes!r} must be ints (offset, num_rows, row_elems, "
            "row_stride), not bools or floats"
        ) from None
    if offset < 0 or num_rows < 0 or row_elems < 0:
        raise PackError(
            f"{what} {index}: offset={offset}, num_rows={num_rows}, row_elems={row_elems}; "
            "each must be >= 0"
        )
    if num_rows > 1 and row_stride < row_elems:
        raise PackError(
            f"{what} {index}: row_stride={row_stride} < row_elems={row_elems}; rows overlap"
        )
    if num_rows == 0 or row_elems == 0:
        return (info.data_ptr, 0, 0, 0)
    end = offset + (num_rows - 1) * row_stride + row_elems
    if end > info.available:
        raise PackError(
            f"{what} {index}: {region!r} ends at element {end} but the tensor's storage holds "
            f"{info.available} elements from data_ptr(); the region lies outside the storage"
        )
    es = info.element_size
    # One row: the stride is never stepped, so any value gives the same copy; row_bytes
    # keeps it inside int64 (the table's dtype) whatever was passed.
    stride = row_stride if num_rows > 1 else row_elems
    return (info.data_ptr + offset * es, num_rows, row_elems * es, stride * es)


class RegionTable(NamedTuple):
    """A validated region table in bytes: one entry per region in each int64 array.

    Made by :func:`region_table` from Regions; a transport that learns where a peer's
    regions are (addresses in another process) builds one from those arrays, and
    :func:`copy_table` pairs two tables into the copy table the native copies take.
    Empty regions have 0 rows, 0 row bytes and 0 stride.
    """

    addr: np.ndarray
    num_rows: np.ndarray
    row_bytes: np.ndarray
    stride: np.ndarray
    device: torch.device | None  # None for an empty table

    @property
    def nbytes(self) -> np.ndarray:
        """Bytes of each region."""
        return self.num_rows * self.row_bytes

    @property
    def contiguous(self) -> np.ndarray:
        """Whether each region's bytes follow each other (at most one row, or no gaps)."""
        return (self.num_rows <= 1) | (self.stride == self.row_bytes)

    @staticmethod
    def flat(addr: int, nbytes: np.ndarray, device: torch.device | None) -> RegionTable:
        """Back-to-back regions of ``nbytes`` each from ``addr`` (a packed buffer).

        Arguments:
            addr: the buffer's address.
            nbytes: int64 bytes of each region, in order.
            device: the buffer's device (None for an empty table).

        Returns:
            One contiguous region per entry of ``nbytes``.
        """
        starts = addr + np.concatenate([[0], np.cumsum(nbytes)[:-1]]).astype(np.int64)
        return RegionTable(starts[: len(nbytes)], np.ones_like(nbytes), nbytes, nbytes, device)


def region_table(regions: Sequence[Region], what: str = "region") -> RegionTable:
    """Validate regions and convert them to bytes and addresses, one entry per region.

    The common case is vectorized: one Python pass pulls the fields out, numpy checks
    them (a table may hold 10,000 regions, a few microseconds each would show). Any
    failure re-checks the first offending region one by one for a precise message.

    Arguments:
        regions: the regions, every one on the same device.
        what: what to call a region in error messages ("source region", ...).

    Returns:
        The table (its device None when ``regions`` is empty). It holds raw
        addresses: the regions' tensors must stay alive while it is used.

    Raises:
        PackError: a region is not a Region, its tensor is not contiguous or its
            bytes are not its data (a tensor subclass such as DTensor, sparse,
            quantized, nested, meta or lazily conjugated: see :func:`unsupported_reason`),
            it lies outside its tensor's storage or has negative sizes or overlapping
            rows, or two regions are on different devices.
    """
    n = len(regions)
    if not all(type(r) is Region or (isinstance(r, tuple) and len(r) == 5) for r in regions):
        for i, r in enumerate(regions):
            _check_region(r, i, what)
    # Many regions share a tensor (a message holds pieces of few tensors): look each
    # tensor up once. The regions keep the tensors alive, so id() is a safe key.
    index_of: dict[int, int] = {}
    infos: list[_TensorInfo] = []
    which = []
    device = None
    for i, r in enumerate(regions):
        key = id(r[0])
        j = index_of.get(key)
        if j is None:
            # The device first: a table that mixes devices is told so, whatever else is wrong.
            other = getattr(r[0], "device", None)
            if device is not None and isinstance(other, torch.device) and other != device:
                raise PackError(
                    f"{what} {i} is on {other} but {what} 0 is on {device}; one table "
                    "holds one device's memory, so split the table by device"
                )
            info = _tensor_info(r[0], i, what)
            if device is None:
                device = info.device
            j = index_of[key] = len(infos)
            infos.append(info)
        which.append(j)
    fields = [r[1:] for r in regions]
    try:
        # No dtype given: a float or an oversized int shows up as a non-integer dtype.
        sizes = np.array(fields).reshape(n, 4)
    except (TypeError, ValueError, OverflowError):
        sizes = None
    # numpy turns a bool among ints into 0 or 1: only tables of plain ints (and numpy
    # integers) take the vectorized path; anything else gets the exact per-region check.
    plain = sizes is not None and (n == 0 or sizes.dtype.kind in "iu")
    plain = plain and bool not in set(map(type, itertools.chain.from_iterable(fields)))
    if plain and n and sizes.dtype.kind == "u" and int(sizes.max()) >= _SMALL:
        plain = False
    if not plain:
        checked = [_check_region(r, i, what, infos[which[i]]) for i, r in enumerate(regions)]
        cols = np.array(checked, dtype=np.int64).reshape(n, 4)
        return RegionTable(cols[:, 0], cols[:, 1], cols[:, 2], cols[:, 3], device)
    return _vectorized(regions, infos, np.array(which, dtype=np.int64), sizes, device, what)


def columns_table(
    tensors: Sequence[torch.Tensor], which: np.ndarray, sizes: np.ndarray, what: str = "region"
) -> RegionTable:
    """:func:`region_table` for regions given as columns instead of Region tuples.

    Region i is ``Region(tensors[which[i]], *sizes[i])``. A caller that keeps its
    regions as arrays (reshard's wire buffers: hundreds of pieces of few tensors)
    skips building a tuple per region; every check is the same.

    Arguments:
        tensors: the distinct tensors, all on one device.
        which: int64 index into ``tensors`` per region.
        sizes: int64 array (num_regions, 4): offset, num_rows, row_elems, row_stride.
        what: what to call a region in error messages.

    Returns:
        The validated table (see :func:`region_table`).

    Raises:
        PackError: as :func:`region_table`.
    """
    infos = [_tensor_info(t, i, what) for i, t in enumerate(tensors)]
    devices = {x.device for x in infos}
    if len(devices) > 1:
        raise PackError(f"{what}s span devices {sorted(map(str, devices))}; split the table")
    which = np.asarray(which, dtype=np.int64)
    sizes = np.asarray(sizes, dtype=np.int64).reshape(len(which), 4)
    if len(which) and (which.min() < 0 or which.max() >= len(tensors)):
        raise PackError(f"{what} tensor indices must lie in [0, {len(tensors)})")

    def regions(i: int) -> Region:
        return Region(tensors[int(which[i])], *map(int, sizes[i]))

    device = next(iter(devices)) if infos and len(which) else None
    return _vectorized(_Lazy(regions, len(which)), infos, which, sizes, device, what)


class _Lazy(Sequence):
    """Regions made on demand (only the error path of a columns table looks at them)."""

    def __init__(self, make, n: int) -> None:
        self._make, self._n = make, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        return self._make(i)


def _vectorized(regions, infos, which, sizes, device, what) -> RegionTable:
    """The vectorized checks of a table of plain int sizes (see region_table)."""
    sizes = sizes.astype(np.int64, copy=False)
    # int64 arithmetic is exact only for small sizes: with every field in (-2**31, 2**31)
    # the region's end stays below 2**63. Regions with a larger field (a tensor of more
    # than 2**31 elements, or a crafted size) are checked exactly, in Python ints.
    big = ((sizes >= _SMALL) | (sizes <= -_SMALL)).any(axis=1)
    base = np.array([x.data_ptr for x in infos], dtype=np.int64)[which]
    es = np.array([x.element_size for x in infos], dtype=np.int64)[which]
    available = np.array([x.available for x in infos], dtype=np.int64)[which]
    offset, num_rows, row_elems, row_stride = np.where(big[:, None], 0, sizes).T
    empty = (num_rows == 0) | (row_elems == 0)
    end = offset + (num_rows - 1) * row_stride + row_elems
    bad = (offset < 0) | (num_rows < 0) | (row_elems < 0)
    bad |= (num_rows > 1) & (row_stride < row_elems)
    bad |= ~empty & (end > available)
    if bad.any():
        i = int(np.argmax(bad))
        # A large region before it is checked exactly first, so the error names the
        # first bad region of the table whichever check finds it.
        for j in np.flatnonzero(big[:i]).tolist():
            _check_region(regions[j], j, what, infos[which[j]])
        _check_region(regions[i], i, what)
        raise AssertionError(f"{what} {i} failed the vectorized check but not the exact one")
    num_rows = np.where(empty, 0, num_rows)
    cols = np.stack(
        [
            np.where(empty, base, base + offset * es),
            num_rows,
            np.where(empty, 0, row_elems * es),
            np.where(empty, 0, row_stride * es),
        ],
        axis=1,
    )
    for i in np.flatnonzero(big).tolist():
        cols[i] = _check_region(regions[i], i, what, infos[which[i]])
    return RegionTable(cols[:, 0], cols[:, 1], cols[:, 2], cols[:, 3], device)


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


def copy_table(src: RegionTable, dst: RegionTable) -> np.ndarray:
    """The copy table that moves src region i onto dst region i, for every i.

    Arguments:
        src, dst: equally long tables whose regions i hold the same bytes (the
            caller checks: :func:`copy_regions` does).

    Returns:
        An int64 array of shape (k, 6): src_addr, dst_addr, num_rows, row_bytes,
        src_stride_bytes, dst_stride_bytes, the table ``nereus_comm._C.copy_regions``
        and the Triton kernel take. Empty pairs are left out; a pair whose two sides
        are strided with different row lengths becomes one row per run.
    """
    keep = src.nbytes > 0
    same = (src.num_rows == dst.num_rows) & (src.row_bytes == dst.row_bytes)
    # A contiguous side can take the other side's row shape.
    like_dst = ~same & src.contiguous
    like_src = ~same & ~like_dst & dst.contiguous
    general = keep & ~same & ~like_dst & ~like_src
    table = np.stack(
        [
            src.addr,
            dst.addr,
            np.where(like_dst, dst.num_rows, src.num_rows),
            np.where(like_dst, dst.row_bytes, src.row_bytes),
            np.where(like_dst, dst.row_bytes, src.stride),
            np.where(like_src, src.row_bytes, dst.stride),
        ],
        axis=1,
    )[keep & ~general]
    if not general.any():
        return table
    # Both strided with different row lengths (a reshard plan never makes these: its two
    # sides split the same dim): one row per run that stays inside a row of each.
    runs = []
    for i in np.flatnonzero(general).tolist():
        s_rb, d_rb = int(src.row_bytes[i]), int(dst.row_bytes[i])
        s_st, d_st = int(src.stride[i]), int(dst.stride[i])
        pos, nbytes = 0, int(src.nbytes[i])
        while pos < nbytes:
            s_row, s_col = divmod(pos, s_rb)
            d_row, d_col = divmod(pos, d_rb)
            n = min(s_rb - s_col, d_rb - d_col)
            s_addr = int(src.addr[i]) + s_row * s_st + s_col
            runs.append((s_addr, int(dst.addr[i]) + d_row * d_st + d_col, 1, n, n, n))
            pos += n
    return np.concatenate([table, np.array(runs, dtype=np.int64)])


def _run(
    table: np.ndarray, device: torch.device | None, num_threads: int | None, backend: str | None
) -> None:
    """Copy a table on the backend that owns `device`'s memory."""
    if num_threads is not None and (
        not isinstance(num_threads, int) or isinstance(num_threads, bool) or num_threads < 1
    ):
        raise PackError(f"num_threads={num_threads!r}, expected None or an int >= 1")
    if backend is not None and backend not in _BACKENDS:
        raise PackError(f"backend={backend!r}, expected None or one of {_BACKENDS}")
    if len(table) == 0 or device is None:
        return
    if backend is None:
        backend = "host" if device.type == "cpu" else "triton"
    table = np.ascontiguousarray(table, dtype=np.int64)
    if backend == "host":
        if device.type != "cpu":
            raise PackError(f"the host path copies CPU memory only, got {device}")
        _C.copy_regions(table, num_threads or 0)
        return
    if device.type not in ("cuda", "cpu"):
        raise PackError(f"no pack path for {device}; regions must be on CPU or CUDA")
    from nereus_comm.kernels import pack as kernels  # imports triton: only when needed

    kernels.copy_regions(table=torch.from_numpy(table), device=device)


def packed_nbytes(regions: Sequence[Region]) -> int:
    """Bytes pack() produces for `regions`.

    Arguments:
        regions: the table.

    Returns:
        The sum of the regions' bytes.
    """
    return sum(int(r[2]) * int(r[3]) * r[0].element_size() for r in regions)


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
        PackError: a region outside its tensor's storage, a non-contiguous tensor or
            one whose bytes are not its data (see :func:`unsupported_reason`), regions
            on different devices, a bad or too small `out`.
    """
    src = region_table(regions, "region")
    nbytes = int(src.nbytes.sum())
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=src.device or "cpu")
    else:
        _check_buffer(out, nbytes, src.device, "out")
    table = copy_table(src, RegionTable.flat(out.data_ptr(), src.nbytes, src.device))
    _run(table, src.device, num_threads, backend)
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
    dst = region_table(regions, "region")
    nbytes = int(dst.nbytes.sum())
    _check_buffer(buf, nbytes, dst.device, "buf")
    table = copy_table(RegionTable.flat(buf.data_ptr(), dst.nbytes, dst.device), dst)
    _run(table, dst.device, num_threads, backend)


def copy_regions(
    src_regions: Sequence[Region],
    dst_regions: Sequence[Region],
    *,
    num_threads: int | None = None,
    backend: str | None = None,
) -> None:
    """Copy src_regions[i] onto dst_regions[i] for every i, in one call.

    Pairs may differ in dtype and row shape; each pair must hold the same bytes.
    Destinations must not overlap each other or any source (they are copied in
    parallel, in no particular order).

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
    src = region_table(src_regions, "source region")
    dst = region_table(dst_regions, "destination region")
    copy_tables(src, dst, num_threads=num_threads, backend=backend)


def copy_tables(
    src: RegionTable,
    dst: RegionTable,
    *,
    num_threads: int | None = None,
    backend: str | None = None,
) -> None:
    """:func:`copy_regions` for validated tables (:func:`region_table`, :func:`columns_table`).

    Raises:
        PackError: the tables differ in length or device, a pair differs in bytes, or
            as for pack().
    """
    if len(src.addr) != len(dst.addr):
        raise PackError(
            f"{len(src.addr)} source regions but {len(dst.addr)} destination regions; "
            "pass one destination per source"
        )
    if src.device is not None and src.device != dst.device:
        raise PackError(f"source regions are on {src.device} but destinations on {dst.device}")
    differ = src.nbytes != dst.nbytes
    if differ.any():
        i = int(np.argmax(differ))
        raise PackError(
            f"pair {i}: source holds {src.nbytes[i]} bytes, destination {dst.nbytes[i]}; "
            "a pair must hold the same bytes"
        )
    _run(copy_table(src, dst), src.device, num_threads, backend)


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
