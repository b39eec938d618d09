"""GPU check: Triton pack/unpack on a CUDA device, then the NCCL one-rank checks.

Run whenever a GPU is available (builds nothing beyond Triton's JIT; needs the
native core built, e.g. `pip install .`); on a machine without CUDA it says so and
exits 0. Well under 3 minutes on an H200.

    python scripts/gpu_check.py --json out.json

1. Correctness: pack/unpack/copy_regions on CUDA tensors (fp32, bf16, int64, uint8,
   odd sizes, empty regions, misaligned bytes, 16-byte aligned long rows) equal, byte
   for byte, torch slicing on the device and the C++ host path on CPU copies.
2. Speed: for regions of 4 KiB..64 MiB (spaced 2x apart in the source, 256 MiB per
   call), the copy kernel's bandwidth against torch copy_ of one contiguous buffer of
   the same bytes (the device's copy bandwidth; goal: >= 0.8x for large regions), and
   the end-to-end pack() (Python table build + upload + kernel).
3. If nereus_comm.testing.nccl_check is importable: run_one_rank_checks(), result printed.
4. The trainer on the GPU: a short GRPO run with ``device="cuda"`` on as many
   workers as there are GPUs (at most 2; NCCL puts one rank on each), and the same
   run on CPU workers beside it: every step's loss and reward finite, and the GPU
   run's seconds per step over the CPU run's (``--skip-trainer`` leaves it out).
   Where Ray is installed, the GPU run once more with ``launcher="ray"``: one actor
   per GPU on a new Ray on loopback, placed by ``{"GPU": 1}`` bundles, NCCL among the
   actors; its steps finite, and whether its rewards equal the local run's (same seed;
   reported, not required: GPU kernels may sum in another order). ``--skip-ray``
   leaves it out.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import statistics
import sys
import time
import traceback

import numpy as np
import torch

KIB, MIB = 1 << 10, 1 << 20
SIZES = [4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB]
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8]


def _random_tensor(
    gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype, device
) -> torch.Tensor:
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape).to(device)


def _random_regions(seed: int, dtypes: list[torch.dtype], num_tensors: int, device) -> list:
    from nereus_comm.pack import Region

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    regions = []
    for _ in range(num_tensors):
        rows, cols = rng.randint(1, 33), rng.randint(1, 3000)
        t = _random_tensor(gen, (rows, cols), rng.choice(dtypes), device)
        r0, c0 = rng.randint(0, rows - 1), rng.randint(0, cols - 1)
        r1, c1 = rng.randint(r0 + 1, rows), rng.randint(c0 + 1, cols)
        kind = rng.random()
        if kind < 0.1:
            r1 = r0
        elif kind < 0.3:
            c0, c1 = 0, cols
        regions.append(Region(t, r0 * cols + c0, r1 - r0, c1 - c0, cols))
    return regions


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def check_case(name: str, regions: list) -> dict:
    """pack/unpack on the device against torch slicing there and the host path on CPU."""
    from nereus_comm.pack import pack, pack_reference, unpack, unpack_reference

    buf = pack(regions)
    ok_pack = torch.equal(buf, pack_reference(regions))
    host = [r._replace(tensor=r.tensor.cpu()) for r in regions]
    ok_host = torch.equal(buf.cpu(), pack(host))
    dst = [r._replace(tensor=torch.zeros_like(r.tensor)) for r in regions]
    ref = [r._replace(tensor=torch.zeros_like(r.tensor)) for r in regions]
    unpack(buf, dst)
    unpack_reference(buf, ref)
    ok_unpack = all(torch.equal(_as_bytes(a.tensor), _as_bytes(b.tensor)) for a, b in zip(dst, ref))
    torch.cuda.synchronize()
    ok = ok_pack and ok_host and ok_unpack
    return {"case": name, "ok": ok, "pack_ok": ok_pack, "host_ok": ok_host, "unpack_ok": ok_unpack}


def correctness(device: torch.device) -> list[dict]:
    from nereus_comm.pack import Region, copy_regions

    cases = []
    for dtype in DTYPES:
        cases.append((f"random_{str(dtype)[6:]}", _random_regions(1, [dtype], 24, device)))
    cases.append(("random_mixed_dtypes_200", _random_regions(2, DTYPES, 200, device)))
    gen = torch.Generator().manual_seed(3)
    x = _random_tensor(gen, (64, 65536), torch.bfloat16, device)
    cases.append(
        ("bf16_aligned_long_rows", [Region(x, 8, 60, 65528, 65536), Region(x, 0, 64, 65536, 65536)])
    )
    y = _random_tensor(gen, (33, 100_003), torch.uint8, device)
    cases.append(("uint8_misaligned_long_rows", [Region(y, 1, 31, 99_999, 100_003)]))
    z = _random_tensor(gen, (1, 64 * MIB // 4), torch.float32, device)
    cases.append(("fp32_one_64mib_region", [Region(z, 0, 1, z.numel(), 0)]))
    out = []
    for name, regions in cases:
        try:
            out.append(check_case(name, regions))
        except Exception as e:
            out.append({"case": name, "ok": False, "error": f"{type(e).__name__}: {e}"})
    try:
        src = _random_regions(4, DTYPES, 50, device)
        a = [r._replace(tensor=torch.zeros_like(r.tensor)) for r in src]
        copy_regions(src, a)
        b = [r._replace(tensor=torch.zeros_like(r.tensor).cpu()) for r in src]
        copy_regions([r._replace(tensor=r.tensor.cpu()) for r in src], b)
        ok = all(torch.equal(_as_bytes(p.tensor).cpu(), _as_bytes(q.tensor)) for p, q in zip(a, b))
        out.append({"case": "copy_regions_vs_host", "ok": ok})
    except Exception as e:
        out.append(
            {"case": "copy_regions_vs_host", "ok": False, "error": f"{type(e).__name__}: {e}"}
        )
    return out


def _time_cuda(fn, reps: int, trials: int = 5) -> float:
    """Median seconds per call over `trials` batches of `reps` calls (CUDA events)."""
    fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(per_call)


def _time_wall(fn, reps: int) -> float:
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def speed_row(device: torch.device, size: int, total_bytes: int) -> dict:
    """Kernel, copy_ and end-to-end pack() bandwidth for regions of `size` bytes."""
    from nereus_comm.kernels.pack import plan_copy
    from nereus_comm.pack import Region, pack

    n = max(1, total_bytes // size)
    total = n * size
    src = torch.randint(0, 256, (2 * total,), dtype=torch.uint8, device=device)
    buf = torch.empty(total, dtype=torch.uint8, device=device)
    flat_src = torch.randint(0, 256, (total,), dtype=torch.uint8, device=device)
    flat_dst = torch.empty_like(flat_src)
    i = np.arange(n, dtype=np.int64)
    one, row = np.ones_like(i), np.full_like(i, size)
    table = np.stack(
        [src.data_ptr() + 2 * i * size, buf.data_ptr() + i * size, one, row, row, row], 1
    )
    back = table[:, [1, 0, 2, 3, 4, 5]].copy()
    pack_launch = plan_copy(table=torch.from_numpy(table), device=device)
    unpack_launch = plan_copy(table=torch.from_numpy(back), device=device)
    reps = max(3, min(200, (4 * 1024 * MIB) // total))
    copy_s = _time_cuda(lambda: flat_dst.copy_(flat_src), reps)
    pack_s = _time_cuda(pack_launch.run, reps)
    unpack_s = _time_cuda(unpack_launch.run, reps)
    regions = [Region(src, 2 * k * size, 1, size, size) for k in range(n)]
    call_s = _time_wall(lambda: pack(regions, buf), 5)
    ok = torch.equal(buf, src.view(n, 2, size)[:, 0].reshape(-1))
    return {
        "region_bytes": size,
        "num_regions": n,
        "total_bytes": total,
        "copy_gb_per_s": round(total / copy_s / 1e9, 1),
        "pack_kernel_gb_per_s": round(total / pack_s / 1e9, 1),
        "unpack_kernel_gb_per_s": round(total / unpack_s / 1e9, 1),
        "pack_call_gb_per_s": round(total / call_s / 1e9, 1),
        "pack_vs_copy_x": round(copy_s / pack_s, 3),
        "unpack_vs_copy_x": round(copy_s / unpack_s, 3),
        "pack_call_vs_copy_x": round(copy_s / call_s, 3),
        "programs": pack_launch.num_tiles,
        "align_bytes": pack_launch.align_bytes,
        "bytes_ok": ok,
    }


def speed(device: torch.device, total_bytes: int) -> list[dict]:
    rows = []
    for size in SIZES:
        row = speed_row(device, size, total_bytes)
        torch.cuda.empty_cache()
        rows.append(row)
        label = f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"
        print(
            f"{label:>7} x{row['num_regions']:<6} copy {row['copy_gb_per_s']:>7.1f}  "
            f"pack {row['pack_kernel_gb_per_s']:>7.1f} ({row['pack_vs_copy_x']:.2f}x)  "
            f"unpack {row['unpack_kernel_gb_per_s']:>7.1f} ({row['unpack_vs_copy_x']:.2f}x)  "
            f"pack() call {row['pack_call_gb_per_s']:>7.1f} GB/s"
            f"{'' if row['bytes_ok'] else '  WRONG BYTES'}",
            flush=True,
        )
    return rows


def nccl_checks() -> dict:
    try:
        from nereus_comm.testing import nccl_check
    except ImportError as e:
        return {"skipped": f"nereus_comm.testing.nccl_check not importable: {e}"}
    try:
        return {"result": nccl_check.run_one_rank_checks()}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}


def trainer_check(steps: int = 3, ray: bool = True) -> dict:
    """A short GRPO run on GPU workers and the same run on CPU workers, side by side;
    with ``ray`` (and Ray installed) the GPU run again on Ray actors."""
    try:
        import nereus_rl
    except ImportError as e:
        return {"skipped": f"nereus_rl not importable: {e}"}
    devices = min(2, torch.cuda.device_count())
    out: dict = {"devices": devices, "steps": steps}
    opts = {"warm_steps": 30, "batch": 4, "group_size": 2, "calibration_probes": 0}
    runs = {"cuda": {"device": "cuda"}, "cpu": {"device": "cpu"}}
    if not ray:
        out["ray"] = {"skipped": "--skip-ray"}
    else:
        if importlib.util.find_spec("ray") is None:
            out["ray"] = {"skipped": "ray is not installed"}
        else:
            runs["ray"] = {"device": "cuda", "launcher": "ray"}
    for kind, how in runs.items():
        t0 = time.perf_counter()
        try:
            res = nereus_rl.train(devices=devices, steps=steps, **how, **opts)
        except Exception as e:
            out[kind] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            continue
        ms = res.metrics
        out[kind] = {
            "error": res.error,
            "wall_s": round(time.perf_counter() - t0, 2),
            "steps_done": len(ms),
            "step_s": [round(m["step_s"], 4) for m in ms],
            "reward": [round(m["reward_mean"], 4) for m in ms],
            "loss": [m["loss"] for m in ms],
            "finite": all(math.isfinite(m["loss"]) and math.isfinite(m["reward_mean"]) for m in ms),
        }
    gpu, cpu = out.get("cuda", {}), out.get("cpu", {})

    def done(run: dict) -> bool:
        return run.get("error") is None and run.get("steps_done") == steps and run.get("finite")

    out["ok"] = bool(done(gpu) and ("ray" not in runs or done(out["ray"])))
    if "ray" in runs and done(out["ray"]) and done(gpu):
        out["ray_rewards_equal_local"] = out["ray"]["reward"] == gpu["reward"]
    if out["ok"] and cpu.get("step_s"):
        out["gpu_over_cpu_step_x"] = round(
            statistics.median(gpu["step_s"]) / statistics.median(cpu["step_s"]), 3
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write {'benchmark', 'rows', ...} here")
    parser.add_argument(
        "--quick", action="store_true", help="64 MiB per timed call instead of 256 MiB"
    )
    parser.add_argument("--skip-nccl", action="store_true", help="skip the NCCL one-rank checks")
    parser.add_argument("--skip-trainer", action="store_true", help="skip the GPU trainer run")
    parser.add_argument("--skip-ray", action="store_true", help="skip the trainer run on Ray")
    args = parser.parse_args()
    report: dict = {"benchmark": "gpu_check", "rows": []}

    def finish(code: int) -> int:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1, default=str)
        return code

    if not torch.cuda.is_available():
        report["skipped"] = "no CUDA device (torch.cuda.is_available() is False)"
        print("gpu_check: no CUDA device on this machine, nothing to check; run it where a GPU is.")
        return finish(0)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("gpu_check: unset TRITON_INTERPRET; this script times compiled kernels.")
        return finish(2)
    try:
        import nereus_comm.pack  # noqa: F401
    except ImportError as e:
        report["skipped"] = f"nereus_comm not importable: {e}"
        print(f"gpu_check: cannot import nereus_comm ({e}); build it first: pip install .")
        return finish(2)
    device = torch.device("cuda", torch.cuda.current_device())
    report["device"] = torch.cuda.get_device_name(device)
    report["torch"] = torch.__version__
    import triton

    report["triton"] = triton.__version__
    print(
        f"gpu_check on {report['device']} (torch {torch.__version__}, triton {triton.__version__})"
    )
    t0 = time.perf_counter()
    report["correctness"] = correctness(device)
    for c in report["correctness"]:
        print(f"  {'ok  ' if c['ok'] else 'FAIL'} {c['case']} {c.get('error', '')}")
    print(f"correctness: {time.perf_counter() - t0:.1f} s")
    report["rows"] = speed(device, (64 if args.quick else 256) * MIB)
    report["nccl"] = {"skipped": "--skip-nccl"} if args.skip_nccl else nccl_checks()
    print("nccl:", json.dumps(report["nccl"], default=str)[:4000])
    report["trainer"] = (
        {"skipped": "--skip-trainer"} if args.skip_trainer else trainer_check(ray=not args.skip_ray)
    )
    print("trainer:", json.dumps(report["trainer"], default=str)[:4000])
    report["seconds"] = round(time.perf_counter() - t0, 1)
    failed = [c["case"] for c in report["correctness"] if not c["ok"]]
    failed += [f"speed {r['region_bytes']}" for r in report["rows"] if not r["bytes_ok"]]
    if not args.skip_trainer and not report["trainer"].get("ok"):
        failed.append("trainer on cuda (local or Ray)")
    verdict = "FAILED: " + ", ".join(failed) if failed else "all bytes equal"
    print(f"done in {report['seconds']} s; {verdict}")
    return finish(1 if failed or "error" in report["nccl"] else 0)


if __name__ == "__main__":
    sys.exit(main())
