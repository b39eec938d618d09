"""Worker commands used by tests/rl/runtime/test_runtime.py (imported on the workers)."""

from __future__ import annotations

import os
import time

import torch

from nereus_rl.runtime.context import WorkerContext, register


@register("test.fail")
def fail(ctx: WorkerContext, message: str) -> None:
    raise ValueError(f"{message} on {ctx.rank}")


@register("test.sleep")
def sleep(ctx: WorkerContext, seconds: float, only: tuple[int, ...] | None = None) -> int:
    """Sleep (on the ranks in ``only``, or on every rank), then return the rank."""
    if only is None or ctx.rank in only:
        time.sleep(seconds)
    return ctx.rank


@register("test.allreduce")
def allreduce(ctx: WorkerContext, group_id: int, ranks: tuple[int, ...]) -> tuple[float, float]:
    """Sum of (rank + 1) over the group, and the group's creation seconds."""
    pg, setup = ctx.group(group_id, ranks)
    t = torch.tensor([float(ctx.rank + 1)])
    pg.allreduce([t]).wait()
    return t.item(), setup


@register("test.threads")
def threads(ctx: WorkerContext) -> int:
    return torch.get_num_threads()


@register("test.pid")
def pid(ctx: WorkerContext) -> int:
    return os.getpid()


@register("test.big")
def big(ctx: WorkerContext, nbytes: int) -> torch.Tensor:
    """A tensor larger than the store's 8 MiB message limit."""
    return torch.arange(nbytes, dtype=torch.int64).to(torch.uint8)


@register("test.unpicklable")
def unpicklable(ctx: WorkerContext) -> object:
    return lambda: None


@register("test.huge_page_advised")
def huge_page_advised(ctx: WorkerContext) -> tuple[str | None, bool]:
    """THP_MEM_ALLOC_ENABLE as this worker sees it, and whether torch advised a fresh
    8 MiB tensor's pages to be huge (MADV_HUGEPAGE: "hg" in the mapping's VmFlags)."""
    import os

    t = torch.empty(8 << 20, dtype=torch.uint8)
    addr, advised = t.data_ptr(), False
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                advised = "hg" in line.split()[1:]
    return os.environ.get("THP_MEM_ALLOC_ENABLE"), advised
