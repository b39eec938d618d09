"""One-device NCCL checks: run whenever a CUDA device is at hand.

Loads NCCL through :mod:`nereus_comm.nccl`, creates a one-rank communicator,
sends a buffer to itself and checks every byte, splits the communicator and
uses the child, shrinks it when the library has ncclCommShrink, and times each
step. Without a device or without NCCL it returns a skip report instead.

    python -m nereus_comm.testing.nccl_check      # prints the report as JSON
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["run_one_rank_checks"]


def _timed(report: dict[str, Any], name: str, fn: Callable[[], Any]) -> Any:
    start = time.perf_counter()
    out = fn()
    report[f"{name}_s"] = time.perf_counter() - start
    return out


def _self_send_recv(lib, comm: int, src: torch.Tensor, dst: torch.Tensor) -> None:
    stream = torch.cuda.current_stream().cuda_stream
    lib.group_send_recv(
        comm, [(0, src.data_ptr(), src.nbytes)], [(0, dst.data_ptr(), dst.nbytes)], stream
    )
    torch.cuda.synchronize()


def run_one_rank_checks(device: int = 0, nbytes: int = 256 << 20, repeats: int = 5) -> dict:
    """Exercise the NCCL calls Nereus makes, on one device, and time them.

    Arguments:
        device: the CUDA device index.
        nbytes: size of the self send/recv buffer.
        repeats: timed repetitions of the self send/recv.

    Returns:
        A report: ``status`` is "ok", "failed" (``error`` says where) or "skipped"
        (``reason`` says why); the NCCL path and version; ``self_send_recv_equal``;
        ``self_send_recv_gbps``; ``<step>_s`` seconds per step; shrink/grow outcomes.
    """
    from nereus_comm.errors import NcclNotFoundError
    from nereus_comm.nccl import load_nccl

    if not torch.cuda.is_available():
        return {
            "status": "skipped",
            "reason": "no CUDA device (torch.cuda.is_available() is False)",
        }
    try:
        lib = load_nccl()
    except NcclNotFoundError as e:
        return {"status": "skipped", "reason": str(e)}
    report: dict[str, Any] = {
        "status": "ok",
        "device": torch.cuda.get_device_name(device),
        "nccl_path": lib.path,
        "nccl_version": lib.version_string,
        "has_shrink": lib.has_shrink,
        "has_grow": lib.has_grow,
    }
    torch.cuda.set_device(device)
    step = "init"
    comm = child = 0
    try:
        uid = _timed(report, "unique_id", lib.get_unique_id)
        comm = _timed(report, "comm_init", lambda: lib.comm_init_rank(1, uid, 0))
        assert lib.comm_count(comm) == 1 and lib.comm_user_rank(comm) == 0

        step = "self_send_recv"
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
        dst = torch.zeros_like(src)
        _timed(report, "first_send_recv", lambda: _self_send_recv(lib, comm, src, dst))
        report["self_send_recv_equal"] = bool(torch.equal(src, dst))
        start = time.perf_counter()
        for _ in range(repeats):
            _self_send_recv(lib, comm, src, dst)
        per = (time.perf_counter() - start) / repeats
        report["self_send_recv_s"] = per
        report["self_send_recv_gbps"] = nbytes / per / 1e9
        report["async_error"] = lib.comm_get_async_error(comm)

        step = "split"
        child = _timed(report, "comm_split", lambda: lib.comm_split(comm, 0, 0))
        small_src, small_dst = src[: 1 << 20], torch.zeros_like(src[: 1 << 20])
        _self_send_recv(lib, child, small_src, small_dst)
        report["split_send_recv_equal"] = bool(torch.equal(small_src, small_dst))
        _timed(report, "split_destroy", lambda: lib.comm_destroy(child))
        child = 0

        step = "shrink"
        if lib.has_shrink:
            # One rank cannot drop a peer; shrinking by nothing still exercises the call.
            try:
                shrunk = _timed(report, "comm_shrink", lambda: lib.comm_shrink(comm, []))
                report["shrink"] = f"ok ({lib.comm_count(shrunk)} rank)"
                lib.comm_destroy(shrunk)
            except Exception as e:  # reported, not fatal: the call's contract for [] varies
                report["shrink"] = f"error: {e}"
        else:
            report["shrink"] = "absent (NCCL < 2.27)"
        report["grow"] = (
            "present; needs a second rank to exercise" if lib.has_grow else "absent (NCCL < 2.28)"
        )

        step = "destroy"
        _timed(report, "comm_destroy", lambda: lib.comm_destroy(comm))
        comm = 0
        if not (report["self_send_recv_equal"] and report["split_send_recv_equal"]):
            report["status"] = "failed"
            report["error"] = "bytes differ after self send/recv"
    except Exception as e:
        report["status"] = "failed"
        report["error"] = f"{step}: {type(e).__name__}: {e}"
        for c in (child, comm):
            if c:
                try:
                    lib.comm_abort(c)
                except Exception:
                    pass
    return report


if __name__ == "__main__":
    print(json.dumps(run_one_rank_checks(), indent=2))
