"""Host pack/unpack throughput against a plain memcpy of the same bytes.

For each region size S, a table of total/S regions of S bytes each, spaced 2*S apart in
a source tensor (so nothing is contiguous across regions, as for the pieces of a
reshard message), is packed into one buffer and unpacked back. The baseline is
torch's copy_ of one contiguous buffer of the same total bytes with the same number
of threads. Measurements of memcpy, pack and unpack are interleaved rep by rep so
that load on a shared machine hits all three alike; the figures are medians.

    python benchmarks/bench_pack.py --quick --json /tmp/bench_pack.json

Columns: pack_vs_memcpy_x = memcpy seconds / pack seconds (1.0 = as fast as memcpy),
from medians (a single fastest rep swings too much on a shared machine to compare);
table_copy is the native copy of a prebuilt table (pack minus the Python table build).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

from nereus_comm import _C
from nereus_comm.pack import Region, pack, pack_reference, unpack

KIB, MIB = 1 << 10, 1 << 20
SIZES = [4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB]


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_size(region_bytes: int, total_bytes: int, reps: int, num_threads: int) -> dict:
    num_regions = max(1, total_bytes // region_bytes)
    total = num_regions * region_bytes
    src = torch.randint(0, 256, (2 * total,), dtype=torch.uint8)
    regions = [
        Region(src, 2 * i * region_bytes, 1, region_bytes, region_bytes) for i in range(num_regions)
    ]
    buf = torch.empty(total, dtype=torch.uint8)
    flat_src = torch.randint(0, 256, (total,), dtype=torch.uint8)
    flat_dst = torch.empty(total, dtype=torch.uint8)
    table = np.array(
        [
            [
                src.data_ptr() + 2 * i * region_bytes,
                buf.data_ptr() + i * region_bytes,
                1,
                region_bytes,
                0,
                0,
            ]
            for i in range(num_regions)
        ],
        dtype=np.int64,
    )
    # Warm up (page faults, thread pool start) and check the bytes once.
    flat_dst.copy_(flat_src)
    pack(regions, buf, num_threads=num_threads)
    assert torch.equal(buf, pack_reference(regions)), "pack produced wrong bytes"
    unpack(buf, regions, num_threads=num_threads)
    times = {"memcpy": [], "pack": [], "unpack": [], "table_copy": []}
    for _ in range(reps):
        times["memcpy"].append(_time(lambda: flat_dst.copy_(flat_src)))
        times["pack"].append(_time(lambda: pack(regions, buf, num_threads=num_threads)))
        times["unpack"].append(_time(lambda: unpack(buf, regions, num_threads=num_threads)))
        times["table_copy"].append(_time(lambda: _C.copy_regions(table, num_threads)))
    med = {k: statistics.median(v) for k, v in times.items()}
    gbps = {k: total / v / 1e9 for k, v in med.items()}
    return {
        "region_bytes": region_bytes,
        "num_regions": num_regions,
        "total_bytes": total,
        "num_threads": num_threads,
        "memcpy_gb_per_s": round(gbps["memcpy"], 2),
        "pack_gb_per_s": round(gbps["pack"], 2),
        "unpack_gb_per_s": round(gbps["unpack"], 2),
        "table_copy_gb_per_s": round(gbps["table_copy"], 2),
        "pack_vs_memcpy_x": round(med["memcpy"] / med["pack"], 3),
        "unpack_vs_memcpy_x": round(med["memcpy"] / med["unpack"], 3),
        "table_copy_vs_memcpy_x": round(med["memcpy"] / med["table_copy"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="fewer reps and 32 MiB per call (< 2 min)"
    )
    parser.add_argument("--json", metavar="PATH", help="write {'benchmark', 'rows'} here")
    parser.add_argument(
        "--threads", type=int, default=None, help="threads (default: torch's intra-op count)"
    )
    args = parser.parse_args()
    num_threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(num_threads)
    reps = 15 if args.quick else 31
    rows = []
    header = (
        f"{'region':>8} {'regions':>7} {'memcpy':>8} {'pack':>8} {'unpack':>8} {'table':>8}"
        "  pack/memcpy unpack/memcpy"
    )
    print(f"threads={num_threads} reps={reps} (GB/s, medians)")
    print(header)
    for size in SIZES:
        total = max(size, 32 * MIB if args.quick else 64 * MIB)
        row = bench_size(size, total, reps, num_threads)
        rows.append(row)
        label = f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"
        print(
            f"{label:>8} {row['num_regions']:>7} {row['memcpy_gb_per_s']:>8.2f} "
            f"{row['pack_gb_per_s']:>8.2f} {row['unpack_gb_per_s']:>8.2f} "
            f"{row['table_copy_gb_per_s']:>8.2f}  "
            f"{row['pack_vs_memcpy_x']:>11.2f} {row['unpack_vs_memcpy_x']:>13.2f}",
            flush=True,
        )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"benchmark": "bench_pack", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
