"""Property-based fuzzing of pack, unpack and copy_regions against plain tensor slicing.

Valid tables must give exactly the bytes slicing gives. Adversarial regions (huge
offsets, sizes and strides, negative values, values near 2**63 and 2**64, bools and
floats) must raise PackError naming the region, or, where they happen to be valid,
copy exactly what slicing copies: never crash, never touch memory outside the
tensors. The bounds are decided here in Python ints, independently of pack.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus_comm import _C
from nereus_comm.pack import PackError, Region, copy_regions, pack, unpack

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8]

FUZZ = settings(max_examples=100)


def _slice(region: Region) -> torch.Tensor:
    """The region's rows as a (num_rows, row_elems) strided view: the reference."""
    t = region.tensor
    if region.num_rows == 0 or region.row_elems == 0:
        return t.new_empty((0, 0))
    # One row never steps its stride (which may then be anything, even negative).
    stride = region.row_stride if region.num_rows > 1 else region.row_elems
    return t.as_strided(
        (region.num_rows, region.row_elems), (stride, 1), t.storage_offset() + region.offset
    )


def _in_bounds(region: Region) -> bool:
    """Whether a region is valid, decided in Python ints (they cannot wrap)."""
    t, offset, rows, row, stride = region
    if any(isinstance(x, bool) or not isinstance(x, int) for x in (offset, rows, row, stride)):
        return False
    if offset < 0 or rows < 0 or row < 0 or (rows > 1 and stride < row):
        return False
    if rows == 0 or row == 0:
        return True
    available = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    return offset + (rows - 1) * stride + row <= available


@st.composite
def _valid_region(draw, tensor: torch.Tensor | None = None) -> Region:
    """A random in-bounds region of a random (or the given) 1-D tensor."""
    if tensor is None:
        dtype = draw(st.sampled_from(DTYPES))
        numel = draw(st.integers(0, 300))
        gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        tensor = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).view(dtype)
    numel = tensor.numel()
    row = draw(st.integers(0, max(numel, 0)))
    stride = draw(st.integers(row, max(row, numel)))
    rows_max = 0 if row == 0 else 1 + max(0, (numel - row)) // max(stride, 1)
    rows = draw(st.integers(0, max(rows_max, 0))) if row else draw(st.integers(0, 3))
    span = 0 if rows == 0 or row == 0 else (rows - 1) * stride + row
    offset = draw(st.integers(0, max(0, numel - span)))
    region = Region(tensor, offset, rows, row, stride)
    assert _in_bounds(region)
    return region


_HUGE = st.sampled_from(
    [2**31, 2**32 + 1, 2**62 + 1000, 2**63 - 1, 2**63, 2**64 - 1, 2**64 + 5, 2**70, -1, -(2**63)]
)
_FIELD = st.one_of(st.integers(-4, 70), _HUGE, st.sampled_from([True, False, 1.0, 2.5]))


@st.composite
def _adversarial_region(draw) -> Region:
    """A region of a small tensor whose fields are anything an attacker might pass."""
    dtype = draw(st.sampled_from(DTYPES))
    tensor = torch.zeros(draw(st.integers(0, 64)), dtype=dtype)
    return Region(tensor, draw(_FIELD), draw(_FIELD), draw(_FIELD), draw(_FIELD))


def _packed_reference(regions: list[Region]) -> torch.Tensor:
    parts = [_slice(r).contiguous().view(-1).view(torch.uint8) for r in regions]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


@FUZZ
@given(st.lists(_valid_region(), max_size=6), st.sampled_from([None, 1, 3]))
def test_pack_and_unpack_match_slicing(regions, num_threads):
    want = _packed_reference(regions)
    got = pack(regions, num_threads=num_threads)
    assert torch.equal(got, want)
    # unpack into fresh tensors: exactly the region's elements change, to the packed bytes.
    fresh = [Region(torch.zeros_like(r.tensor), *r[1:]) for r in regions]
    reference = [Region(torch.zeros_like(r.tensor), *r[1:]) for r in regions]
    unpack(got, fresh, num_threads=num_threads)
    pos = 0
    for ref, r in zip(reference, regions):
        n = r.num_rows * r.row_elems * r.tensor.element_size()
        _slice(ref).copy_(got[pos : pos + n].clone().view(r.tensor.dtype).view(_slice(r).shape))
        pos += n
    for a, b in zip(fresh, reference):
        assert torch.equal(a.tensor.view(torch.uint8), b.tensor.view(torch.uint8))


@FUZZ
@given(st.data())
def test_copy_regions_matches_slicing(data):
    src = data.draw(st.lists(_valid_region(), max_size=5))
    # One destination per source with the same bytes: a fresh uint8 tensor, packed rows.
    dst = []
    for r in src:
        nbytes = r.num_rows * r.row_elems * r.tensor.element_size()
        pad = data.draw(st.integers(0, 8))
        dst.append(Region(torch.zeros(nbytes + pad, dtype=torch.uint8), pad, 1, nbytes, nbytes))
    copy_regions(src, dst)
    for s, d in zip(src, dst):
        assert torch.equal(_slice(d).view(-1), _slice(s).contiguous().view(-1).view(torch.uint8))
        assert not d.tensor[: d.offset].any()


@FUZZ
@given(_adversarial_region(), st.sampled_from(["pack", "unpack", "copy"]))
def test_adversarial_region_raises_or_matches_slicing(region, op):
    before = region.tensor.clone()
    valid = _in_bounds(region)
    if not valid:
        with pytest.raises(PackError, match="region 0"):
            if op == "pack":
                pack([region])
            elif op == "unpack":
                unpack(torch.zeros(1 << 16, dtype=torch.uint8), [region])
            else:
                copy_regions([region], [region])
        assert torch.equal(region.tensor, before)  # raised before any byte moved
        return
    if op == "pack":
        assert torch.equal(pack([region]), _packed_reference([region]))
    elif op == "unpack":  # (a valid region copied onto itself is left out: it overlaps)
        nbytes = region.num_rows * region.row_elems * region.tensor.element_size()
        buf = torch.full((nbytes,), 7, dtype=torch.uint8)
        unpack(buf, [region])
        assert (_slice(region).contiguous().view(-1).view(torch.uint8) == 7).all()


@FUZZ
@given(st.lists(st.one_of(_valid_region(), _adversarial_region()), min_size=1, max_size=5))
def test_mixed_tables_raise_for_the_first_bad_region(regions):
    bad = [i for i, r in enumerate(regions) if not _in_bounds(r)]
    if not bad:
        assert torch.equal(pack(regions), _packed_reference(regions))
        return
    with pytest.raises(PackError, match=f"region {bad[0]}\\b"):
        pack(regions)


@FUZZ
@given(
    st.integers(-(2**63), 2**63 - 1),
    st.integers(-(2**63), 2**63 - 1),
    st.integers(-(2**63), 2**63 - 1),
)
def test_native_table_that_would_wrap_is_refused(rows, row_bytes, stride):
    """_C.copy_regions takes raw tables; one whose last byte wraps int64 must raise."""
    src = np.zeros(16, dtype=np.uint8)
    addr = src.ctypes.data
    end = None
    if rows > 0 and row_bytes > 0:
        end = addr + (rows - 1) * max(stride, 0) + row_bytes
    # Only tables the native check must refuse are run: valid-looking ones would copy.
    if rows < 0 or row_bytes < 0 or (rows > 1 and stride < 0) or (end is not None and end >= 2**63):
        table = np.array([[addr, addr, rows, row_bytes, stride, stride]], dtype=np.int64)
        with pytest.raises(ValueError):
            _C.copy_regions(table, 1)


@FUZZ
@given(st.lists(_valid_region(), min_size=1, max_size=4), st.data())
def test_cma_accepts_only_a_peer_table_that_matches_ours(regions, data):
    """A peer's published table whose regions hold other byte counts than ours is refused
    (the read would shape the copy from it and write past our regions)."""
    from nereus_comm.pack import region_table
    from nereus_comm.transport_cma import _remote_fits

    dst = region_table(regions)
    honest = np.stack([dst.addr + 4096, dst.num_rows, dst.row_bytes, dst.stride], axis=1)
    assert _remote_fits(honest, dst)
    crafted = honest.copy()
    i = data.draw(st.integers(0, len(regions) - 1))
    col = data.draw(st.sampled_from([1, 2]))
    crafted[i, col] = data.draw(st.sampled_from([-1, 2**31, 2**62, 2**63 - 1]))
    if int(crafted[i, 1]) * int(crafted[i, 2]) != int(dst.nbytes[i]):
        assert not _remote_fits(crafted, dst)
    assert not _remote_fits(honest[:-1], dst)  # one region missing
