"""Pack/unpack over region tables: the C++ host path and the Triton kernel against torch slicing.

The Triton cases run in one subprocess with TRITON_INTERPRET=1 (the variable must be
set before triton is imported, and this pytest process may already have imported it
without), on CPU tensors; each case is still its own pytest test. Values are random
bytes (NaN patterns included) and are compared byte for byte.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Callable

import numpy as np
import pytest
import torch

from nereus_comm import _C
from nereus_comm.pack import (
    PackError,
    Region,
    copy_regions,
    is_contiguous_region,
    pack,
    pack_reference,
    packed_nbytes,
    region_view,
    unpack,
    unpack_reference,
)

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8]


def random_tensor(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor of random bytes (any bit pattern, NaNs included)."""
    numel = int(np.prod(shape)) if shape else 1
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
    )


def random_table(
    seed: int, dtypes: list[torch.dtype], num_tensors: int, max_rows: int = 9, max_cols: int = 40
) -> tuple[list[torch.Tensor], list[Region]]:
    """Random 2-D tensors and one random sub-block region of each (some empty)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    tensors, regions = [], []
    for _ in range(num_tensors):
        rows, cols = rng.randint(1, max_rows), rng.randint(1, max_cols)
        t = random_tensor(gen, (rows, cols), rng.choice(dtypes))
        r0, c0 = rng.randint(0, rows - 1), rng.randint(0, cols - 1)
        r1, c1 = rng.randint(r0 + 1, rows), rng.randint(c0 + 1, cols)
        kind = rng.random()
        if kind < 0.15:  # empty: no rows or no columns
            r1, c1 = (r0, c1) if kind < 0.075 else (r1, c0)
        elif kind < 0.35:  # full rows: one contiguous run
            c0, c1 = 0, cols
        tensors.append(t)
        regions.append(Region(t, r0 * cols + c0, r1 - r0, c1 - c0, cols))
    return tensors, regions


def retarget(regions: list[Region], fill: int = 0) -> list[Region]:
    """The same regions over fresh tensors filled with `fill`."""
    return [
        r._replace(tensor=torch.full_like(r.tensor.view(torch.uint8), fill).view(r.tensor.dtype))
        for r in regions
    ]


def check_roundtrip(regions: list[Region], **kwargs) -> None:
    """pack == torch slicing; unpack writes exactly what the reference writes, nothing else."""
    expected = pack_reference(regions)
    assert packed_nbytes(regions) == expected.numel()
    got = pack(regions, **kwargs)
    assert got.dtype == torch.uint8 and got.numel() == expected.numel()
    assert torch.equal(got, expected)
    dst, ref = retarget(regions, 0x5A), retarget(regions, 0x5A)
    unpack(got, dst, **kwargs)
    unpack_reference(expected, ref)
    for a, b in zip(dst, ref):
        assert same_bytes(a.tensor, b.tensor)


# ---------------------------------------------------------------- host path


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed", range(3))
def test_host_roundtrip_single_dtype(dtype, seed):
    _, regions = random_table(seed, [dtype], num_tensors=6)
    check_roundtrip(regions)


@pytest.mark.parametrize("seed", range(3))
def test_host_many_tensors_mixed_dtypes_in_one_table(seed):
    _, regions = random_table(100 + seed, DTYPES, num_tensors=200)
    assert any(r.num_rows * r.row_elems == 0 for r in regions), "want empty regions in the mix"
    check_roundtrip(regions)


@pytest.mark.parametrize("num_threads", [1, 2, 3, 4])
def test_host_thread_counts_split_rows_exactly(num_threads):
    # 3 regions of ~1 MiB with odd row lengths: the byte split between threads cuts rows
    # in the middle, so every boundary case of the split is exercised.
    gen = torch.Generator().manual_seed(num_threads)
    big = random_tensor(gen, (333, 3001), torch.uint8)
    bf = random_tensor(gen, (257, 2049), torch.bfloat16)
    f = random_tensor(gen, (1, 300_001), torch.float32)
    regions = [
        Region(big, 7, 330, 2993, 3001),
        Region(bf, 1, 256, 2047, 2049),
        Region(f, 3, 1, 299_990, 0),
    ]
    check_roundtrip(regions, num_threads=num_threads)


@pytest.mark.parametrize("num_threads", [1, 2, 3, 4])
def test_host_reports_threads_used(num_threads):
    src = torch.arange(4 << 20, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    table = np.array([[src.data_ptr(), dst.data_ptr(), 1, src.numel(), 0, 0]], dtype=np.int64)
    assert _C.copy_regions(table, num_threads) == num_threads
    assert torch.equal(src, dst)
    # Under 2 x 256 KiB the caller copies alone: no thread wake-up.
    small = table.copy()
    small[0, 3] = 300_000
    assert _C.copy_regions(small, num_threads) == 1


def test_host_concurrent_callers_are_correct():
    import threading

    gen = torch.Generator().manual_seed(7)
    tables = [random_tensor(gen, (64, 16384), torch.uint8) for _ in range(4)]
    outs = [None] * 4

    def work(i: int) -> None:
        outs[i] = pack([Region(tables[i], 3, 63, 16000, 16384)], num_threads=2)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for t, out in zip(tables, outs):
        assert torch.equal(out, pack_reference([Region(t, 3, 63, 16000, 16384)]))


@pytest.mark.slow
def test_host_pool_survives_fork():
    # The pool's threads do not exist in a forked child; the child must build its own
    # pool instead of waiting forever on the parent's.
    import signal
    import time

    src = torch.arange(4 << 20, dtype=torch.uint8)
    regions = [Region(src, 0, 1, src.numel(), 0)]
    assert torch.equal(pack(regions, num_threads=2), src)  # the parent's pool exists now
    pid = os.fork()
    if pid == 0:
        # numpy compares: torch's OpenMP threads are not fork-safe (its bug, not ours).
        ok = np.array_equal(pack(regions, num_threads=2).numpy(), src.numpy())
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung in pack()")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0


def test_pack_into_given_buffer_returns_exact_prefix():
    _, regions = random_table(5, [torch.float32], num_tensors=4)
    n = packed_nbytes(regions)
    out = torch.full((n + 9,), 0xEE, dtype=torch.uint8)
    got = pack(regions, out)
    assert got.numel() == n and got.data_ptr() == out.data_ptr()
    assert torch.equal(got, pack_reference(regions))
    assert torch.all(out[n:] == 0xEE)


def test_empty_table():
    assert pack([]).numel() == 0
    unpack(torch.empty(0, dtype=torch.uint8), [])
    copy_regions([], [])


@pytest.mark.parametrize("seed", range(3))
def test_copy_regions_matches_slicing(seed):
    _, src = random_table(200 + seed, DTYPES, num_tensors=30)
    dst = retarget(src, 0x11)
    copy_regions(src, dst)
    for s, d in zip(src, dst):
        expected = torch.full_like(s.tensor.view(torch.uint8), 0x11).view(s.tensor.dtype)
        unpack_reference(pack_reference([s]), [s._replace(tensor=expected)])
        assert same_bytes(d.tensor, expected)


def test_copy_regions_between_different_row_shapes():
    gen = torch.Generator().manual_seed(3)
    src = random_tensor(gen, (4, 6, 8), torch.float32)
    # src[:, 1:4, :]: 4 rows of 24 elements; dst shard (4, 3, 16) holds it as [:, :, 0:8]:
    # 12 rows of 8 (strided on both sides, different row lengths).
    dst = torch.zeros(4, 3, 16)
    copy_regions([Region(src, 8, 4, 24, 48)], [Region(dst, 0, 12, 8, 16)])
    assert torch.equal(dst[:, :, :8], src[:, 1:4, :])
    assert torch.all(dst[:, :, 8:] == 0)
    # Contiguous onto strided and back.
    flat = torch.zeros(96)
    copy_regions([Region(dst, 0, 12, 8, 16)], [Region(flat, 0, 1, 96, 96)])
    assert torch.equal(flat.view(4, 3, 8), src[:, 1:4, :])


def test_region_view_is_zero_copy():
    t = torch.arange(40, dtype=torch.int64).view(5, 8)
    r = Region(t, 8, 2, 8, 8)  # rows 1..2: contiguous
    assert is_contiguous_region(r)
    v = region_view(r)
    assert v.data_ptr() == t.data_ptr() + 8 * 8 and v.numel() == 16
    v.fill_(-1)
    assert torch.all(t[1:3] == -1) and torch.all(t[0] == torch.arange(8))
    assert is_contiguous_region(Region(t, 3, 1, 4, 0))
    assert not is_contiguous_region(Region(t, 0, 2, 4, 8))
    with pytest.raises(PackError, match="strided"):
        region_view(Region(t, 0, 2, 4, 8))


def test_numpy_int_sizes_and_plain_tuples_are_accepted():
    t = torch.arange(24, dtype=torch.int32).view(4, 6)
    regions = [(t, np.int64(1), np.int32(3), 2, np.int64(6)), Region(t, 0, 1, 6, 6)]
    assert pack(regions).view(torch.int32).tolist() == [1, 2, 7, 8, 13, 14, 0, 1, 2, 3, 4, 5]
    assert packed_nbytes(regions) == 48


def test_region_repr_is_short():
    r = Region(torch.zeros(3, 4, dtype=torch.bfloat16), 1, 3, 2, 4)
    assert repr(r) == "Region(bfloat16[3, 4]@cpu, offset=1, rows=3x2, stride=4)"


# ---------------------------------------------------------------- errors


def test_error_region_outside_storage():
    t = torch.zeros(4, 8)
    with pytest.raises(PackError, match="outside the storage"):
        pack([Region(t, 1, 4, 8, 8)])
    with pytest.raises(PackError, match="outside the storage"):
        unpack(torch.zeros(4 * 64, dtype=torch.uint8), [Region(t[2:], 0, 3, 8, 8)])
    # The storage, not the view, bounds a region: t[2:] still reaches t's last row.
    assert torch.equal(pack([Region(t[2:], 8, 1, 8, 8)]), pack_reference([Region(t, 24, 1, 8, 8)]))


def test_error_non_contiguous_tensor():
    t = torch.zeros(4, 8).t()
    with pytest.raises(PackError, match="not contiguous"):
        pack([Region(t, 0, 1, 4, 4)])


def test_error_bad_sizes():
    t = torch.zeros(16)
    with pytest.raises(PackError, match="rows overlap"):
        pack([Region(t, 0, 3, 4, 2)])
    with pytest.raises(PackError, match="num_rows=-1"):
        pack([Region(t, 0, -1, 4, 4)])
    with pytest.raises(PackError, match="must be ints"):
        pack([Region(t, 0.5, 1, 4, 4)])
    with pytest.raises(PackError, match="num_threads"):
        pack([Region(t, 0, 1, 4, 4)], num_threads=0)


def test_error_mismatched_devices():
    a = torch.zeros(8)
    b = torch.zeros(8, device="meta")
    with pytest.raises(PackError, match="one table holds one device"):
        pack([Region(a, 0, 1, 8, 8), Region(b, 0, 1, 8, 8)])
    with pytest.raises(PackError, match="regions are on cpu"):
        unpack(torch.zeros(32, dtype=torch.uint8, device="meta"), [Region(a, 0, 1, 8, 8)])


def test_error_buffer_too_small_or_wrong_type():
    t = torch.zeros(8)
    with pytest.raises(PackError, match="holds 31 bytes but the regions need 32"):
        unpack(torch.zeros(31, dtype=torch.uint8), [Region(t, 0, 1, 8, 8)])
    with pytest.raises(PackError, match="holds 16 bytes"):
        pack([Region(t, 0, 1, 8, 8)], out=torch.zeros(16, dtype=torch.uint8))
    with pytest.raises(PackError, match="uint8"):
        unpack(torch.zeros(8), [Region(t, 0, 1, 8, 8)])


def test_error_copy_regions_mismatch():
    a, b = torch.zeros(8), torch.zeros(8, dtype=torch.float64)
    with pytest.raises(PackError, match="2 source regions but 1"):
        copy_regions([Region(a, 0, 1, 4, 4)] * 2, [Region(b, 0, 1, 2, 2)])
    with pytest.raises(PackError, match="same bytes"):
        copy_regions([Region(a, 0, 1, 4, 4)], [Region(b, 0, 1, 4, 4)])
    # Same bytes, different dtypes: allowed (bytes move, not values).
    copy_regions([Region(torch.arange(4, dtype=torch.int32), 0, 1, 4, 4)], [Region(b, 0, 1, 2, 2)])
    assert b[:2].view(torch.int32).tolist() == [0, 1, 2, 3]


def test_error_native_table_checks():
    with pytest.raises(ValueError, match="int64"):
        _C.copy_regions(np.zeros((1, 6), dtype=np.int32))
    with pytest.raises(ValueError, match="shape"):
        _C.copy_regions(np.zeros((2, 5), dtype=np.int64))
    with pytest.raises(ValueError, match="null address"):
        _C.copy_regions(np.array([[0, 0, 1, 8, 8, 8]], dtype=np.int64))
    with pytest.raises(ValueError, match=">= 0"):
        _C.copy_regions(np.array([[8, 8, -1, 8, 8, 8]], dtype=np.int64))


# Raw tables whose last byte lies past 2**63 - 1 (or whose rows step backwards) were
# copied by _C.copy_regions from and to wild addresses; now refused. In a child: the
# old behaviour kills the process.
_WRAPPING_TABLES = """
import numpy as np
from nereus_comm import _C
buf = np.zeros(64, dtype=np.uint8)
a = buf.ctypes.data
rows = (
    [[a, a, 2**62, 8, 8, 8]],  # rows x stride wraps
    [[a, a, 2, 8, 2**63 - 8, 8]],  # stride past the address space
    [[2**63 - 4, a, 1, 8, 8, 8]],  # address + row wraps
    [[a, a, 2, 8, -8, 8]],  # a stride that steps backwards
    [[a, a, 2**40, 2**40, 2**40, 2**40]],  # rows x row bytes wraps
    [[a, a + 8, 1, 2**62, 2**62, 2**62]] * 3,  # the regions' sum wraps
)
for table in rows:
    try:
        _C.copy_regions(np.array(table, dtype=np.int64), 1)
    except ValueError as e:
        assert "overflow" in str(e) or "address space" in str(e) or "stride" in str(e), e
    else:
        raise SystemExit(f"{table} was copied")
print("ok")
"""


def test_error_native_table_that_wraps_int64():
    proc = subprocess.run(
        [sys.executable, "-c", _WRAPPING_TABLES], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


# The reproducer: a region whose end wraps int64 passed the bounds check and
# unpack wrote 2**62 rows past a 16-element tensor (the process aborted). Run in a
# child so that the test process survives the old behaviour.
_WRAPPING_UNPACK = """
import torch
from nereus_comm.pack import PackError, Region, copy_regions, pack, unpack
t = torch.arange(16.0)
for call in (
    lambda: unpack(torch.zeros(4000, dtype=torch.uint8), [Region(t, 0, 2**62 + 1000, 1, 6)]),
    lambda: pack([Region(t, 0, 2**62 + 1000, 1, 6)]),
    lambda: pack([Region(t, 2**64 - 4, 1, 8, 8)]),
    lambda: pack([Region(t, 0, 2, 4, 2**63 - 2)]),
    lambda: copy_regions([Region(t, 0, 1, 4, 4)], [Region(t, 2**63 + 8, 1, 4, 4)]),
):
    try:
        call()
    except PackError as e:
        assert "outside the storage" in str(e), e
    else:
        raise SystemExit("a wrapping region was copied")
print("ok")
"""


def test_wrapping_region_raises_pack_error_in_a_child_process():
    proc = subprocess.run(
        [sys.executable, "-c", _WRAPPING_UNPACK], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_error_bool_and_float_sizes():
    t = torch.zeros(16)
    for sizes in ((True, 1, 4, 4), (0, 1, 4.0, 4), (0, True, 4, 4)):
        with pytest.raises(PackError, match="must be ints"):
            pack([Region(t, *sizes)])
        # A table the vectorized check sees whole: the bool among ints is still found.
        with pytest.raises(PackError, match="region 1: sizes"):
            pack([Region(t, 0, 1, 4, 4), Region(t, *sizes)])
    with pytest.raises(PackError, match="num_threads"):
        pack([Region(t, 0, 1, 4, 4)], num_threads=True)


def test_large_fields_take_the_exact_check():
    """Fields >= 2**31 leave the int64 fast path; in-bounds ones still copy right."""
    t = torch.arange(16.0)
    r = Region(t, 2, 1, 4, 2**62)  # one row: its stride is never stepped
    assert torch.equal(pack([r]), pack_reference([Region(t, 2, 1, 4, 4)]))
    empty = Region(t, 0, 2**40, 0, 2**40)  # no elements, however many rows
    assert pack([empty, r]).numel() == 16
    with pytest.raises(PackError, match="region 0"):
        pack([Region(t, 0, 2, 4, np.uint64(2**63 + 4))])


# ---------------------------------------------------------------- Triton (interpreter)

TRITON_CASES: dict[str, Callable[[], None]] = {}


def triton_case(fn: Callable[[], None]) -> Callable[[], None]:
    TRITON_CASES[fn.__name__] = fn
    return fn


def check_triton(regions: list[Region]) -> None:
    """Triton pack/unpack equal torch slicing and the host path."""
    check_roundtrip(regions, backend="triton")
    assert torch.equal(pack(regions, backend="triton"), pack(regions, backend="host"))


for _dtype in DTYPES:

    def _case(dtype=_dtype) -> None:
        _, regions = random_table(7, [dtype], num_tensors=12)
        t = random_tensor(torch.Generator().manual_seed(3), (8, 13), dtype)
        check_triton([*regions, Region(t, 2, 8, 9, 13)])

    _case.__name__ = f"triton_flat_rows_{str(_dtype).removeprefix('torch.')}"
    triton_case(_case)


@triton_case
def triton_many_tensors_mixed_dtypes_odd_offsets() -> None:
    _, regions = random_table(11, DTYPES, num_tensors=40)
    assert any(r.num_rows * r.row_elems == 0 for r in regions)
    check_triton(regions)


@triton_case
def triton_long_rows_bf16() -> None:
    # Rows of >= 4096 units take the row-chunk (vectorized) path; 9000 bf16 = 4500 units.
    gen = torch.Generator().manual_seed(1)
    t = random_tensor(gen, (3, 9000), torch.bfloat16)
    u = random_tensor(gen, (1, 20_000), torch.float32)
    # 700 units >= BLOCK // 8: one masked row tile each.
    check_triton(
        [
            Region(t, 0, 3, 9000, 9000),
            Region(u, 4, 1, 19_990, 0),
            Region(t, 3, 2, 8996, 9000),
            Region(u, 0, 5, 700, 1000),
        ]
    )


@triton_case
def triton_aligned_16_bytes_vector_path() -> None:
    from nereus_comm.kernels import pack as kernels

    gen = torch.Generator().manual_seed(4)
    x = random_tensor(gen, (4, 4096), torch.float32)
    regions = [Region(x, 4, 3, 2048, 4096), Region(x, 0, 4, 4096, 4096), Region(x, 8, 2, 4, 8)]
    buf = torch.empty(packed_nbytes(regions), dtype=torch.uint8)
    table = torch.tensor([[x.data_ptr() + 16, buf.data_ptr(), 3, 8192, 16384, 8192]])
    launch = kernels.plan_copy(table=table, device=torch.device("cpu"))
    assert (launch.align_bytes, launch.unit_bytes, launch.block) == (16, 4, 2048), launch[1:]
    check_triton(regions)


@triton_case
def triton_table_that_wraps_int64_is_refused() -> None:
    """The launcher takes raw tables too: a region whose end wraps int64 is refused."""
    from nereus_comm.kernels import pack as kernels

    a = torch.zeros(64, dtype=torch.uint8).data_ptr()
    for row in (
        [a, a, 2**62, 8, 8, 8],
        [a, a, 2, 8, 2**63 - 8, 8],
        [2**63 - 4, a, 1, 8, 8, 8],
        [a, a, 2, 8, -8, 8],
        [a, a, 2**40, 2**40, 2**40, 2**40],
    ):
        with pytest.raises(ValueError, match=r"past|stride"):
            kernels.plan_copy(table=torch.tensor([row]), device=torch.device("cpu"))


@triton_case
def triton_long_rows_misaligned_bytes() -> None:
    gen = torch.Generator().manual_seed(2)
    t = random_tensor(gen, (3, 5003), torch.uint8)
    check_triton([Region(t, 1, 3, 5001, 5003), Region(t, 0, 1, 7, 0)])


@triton_case
def triton_copy_regions_matches_host() -> None:
    _, src = random_table(12, DTYPES, num_tensors=20)
    a, b = retarget(src, 0x33), retarget(src, 0x33)
    copy_regions(src, a, backend="triton")
    copy_regions(src, b, backend="host")
    assert all(same_bytes(x.tensor, y.tensor) for x, y in zip(a, b))


@triton_case
def triton_launcher_rejects_bad_input() -> None:
    from nereus_comm.kernels import pack as kernels

    for table, match in (
        (torch.zeros(1, 6, dtype=torch.int32), "int64"),
        (torch.zeros(1, 5, dtype=torch.int64), "shape"),
        (torch.tensor([[8, 8, -1, 8, 8, 8]]), "negative"),
        (torch.tensor([[0, 8, 1, 8, 8, 8]]), "null address"),
    ):
        with pytest.raises(ValueError, match=match):
            kernels.copy_regions(table=table, device=torch.device("cpu"))
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        with pytest.raises(ValueError, match="need a CUDA device"):
            kernels.copy_regions(
                table=torch.zeros(0, 6, dtype=torch.int64), device=torch.device("cpu")
            )
    finally:
        os.environ["TRITON_INTERPRET"] = "1"
    assert (
        kernels.copy_regions(table=torch.zeros(0, 6, dtype=torch.int64), device=torch.device("cpu"))
        == 0
    )


def _run_triton_cases() -> dict[str, str]:
    results = {}
    for name, fn in TRITON_CASES.items():
        try:
            fn()
            results[name] = "ok"
        except Exception as e:  # report every case, not just the first failure
            results[name] = f"{type(e).__name__}: {e}"
    return results


@pytest.fixture(scope="module")
def triton_results() -> dict[str, str]:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, __file__, "--triton-cases"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, f"Triton case runner failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TRITON_CASES))
def test_triton_interpreter(triton_results, name):
    assert triton_results.get(name) == "ok", triton_results.get(name, "case did not run")


def _compile_for_sm90() -> dict[str, dict[str, int]]:
    """Compile the copy kernel for sm_90 (no GPU needed: Triton ships ptxas); count accesses.

    The interpreter does not type-check like the compiler does, so this catches kernels
    that run interpreted but would not compile, and checks the 16-byte vector path.
    """
    import collections
    import re

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nereus_comm.kernels.pack import _copy_regions_kernel

    names = list(_copy_regions_kernel.arg_names)
    signature = {n: "constexpr" if n.isupper() else "*i64" for n in names}
    signature["num_regions"] = "i32"
    out = {}
    for label, unit, unit_bytes, align, block in (
        ("int32_align16", tl.int32, 4, 16, 4096),
        ("int8_align1", tl.int8, 1, 1, 512),
    ):
        values = {"UNIT": unit, "UNIT_BYTES": unit_bytes, "ALIGN_BYTES": align}
        values |= {"VEC": align // unit_bytes, "BLOCK": block, "ROW_MIN": block // 8}
        constexprs = {(names.index(k),): v for k, v in values.items()}
        attrs = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}
        source = ASTSource(_copy_regions_kernel, signature, constexprs=constexprs, attrs=attrs)
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        ops = re.findall(r"(?:ld|st)\.global[.\w]*", ptx.asm["ptx"])
        out[label] = dict(collections.Counter(ops))
    return out


@pytest.mark.slow
def test_triton_kernel_compiles_for_sm90_with_16_byte_accesses():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run(
        [sys.executable, __file__, "--compile-sm90"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, f"sm_90 compile failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    # Aligned rows: 128-bit loads and stores; misaligned bytes: byte accesses, still compiles.
    assert counts["int32_align16"].get("ld.global.v4.b32", 0) > 0, counts
    assert counts["int32_align16"].get("st.global.v4.b32", 0) > 0, counts
    assert counts["int8_align1"].get("st.global.b8", 0) > 0, counts


if __name__ == "__main__" and sys.argv[1:] == ["--compile-sm90"]:
    print(json.dumps(_compile_for_sm90()))

if __name__ == "__main__" and sys.argv[1:] == ["--triton-cases"]:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    torch.set_num_threads(1)
    print(json.dumps(_run_triton_cases()))
