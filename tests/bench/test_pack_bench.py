"""pytest-benchmark cases for the host pack/unpack hot path (cheap with --benchmark-disable).

Run the timings with: pytest tests/bench/test_pack_bench.py --benchmark-enable
"""

from __future__ import annotations

import pytest
import torch

from nereus_comm.pack import Region, pack, pack_reference, unpack

REGION_BYTES = 64 * 1024
NUM_REGIONS = 128  # 8 MiB per call, every region strided (2 rows with a gap)


@pytest.fixture(scope="module")
def table() -> tuple[torch.Tensor, list[Region], torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (NUM_REGIONS, 2, REGION_BYTES), dtype=torch.uint8, generator=gen)
    half = REGION_BYTES // 2
    regions = [
        Region(src, i * 2 * REGION_BYTES, 2, half * 2 - 1, REGION_BYTES) for i in range(NUM_REGIONS)
    ]
    buf = torch.empty(sum(r.nbytes for r in regions), dtype=torch.uint8)
    return src, regions, buf


def reference(regions: list[Region]) -> torch.Tensor:
    # One thread: torch's intra-op threads pay a wake-up per small copy, which on a
    # loaded machine makes the 128-slice reference take seconds.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return pack_reference(regions)
    finally:
        torch.set_num_threads(threads)


def test_bench_host_pack(benchmark, table):
    _, regions, buf = table
    out = benchmark(pack, regions, buf)
    assert torch.equal(out, reference(regions))


def test_bench_host_unpack(benchmark, table):
    src, regions, buf = table
    pack(regions, buf)
    dst = torch.zeros_like(src)
    targets = [r._replace(tensor=dst) for r in regions]
    benchmark(unpack, buf, targets)
    assert torch.equal(reference(targets), buf)
