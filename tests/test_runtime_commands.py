"""Worker commands used by tests/test_runtime.py (imported on the workers; holds no tests)."""

from __future__ import annotations

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


@register("test.big")
def big(ctx: WorkerContext, nbytes: int) -> torch.Tensor:
    """A tensor larger than the store's 8 MiB message limit."""
    return torch.arange(nbytes, dtype=torch.int64).to(torch.uint8)


@register("test.unpicklable")
def unpicklable(ctx: WorkerContext) -> object:
    return lambda: None
