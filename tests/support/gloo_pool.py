"""Local gloo processes that run a test module's case functions by name.

The model tests compare sharded runs (tp, pp, dp over four ranks) with a single
process: each case is a module-level function that every rank runs with the same
arguments, after ``torch.distributed`` is initialised over the pool.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import shutil
import tempfile
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def _worker(rank: int, world: int, module: str, init_file: str, tasks, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    cases = importlib.import_module(module)
    while True:
        item = tasks.get()
        if item is None:
            break
        name, args = item
        try:
            results.put((rank, True, getattr(cases, name)(*args)))
        except Exception:
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class GlooPool:
    """``world`` spawned gloo processes running the case functions of ``module`` (the
    test module's import name, e.g. ``__name__``)."""

    def __init__(self, module: str, world: int = 4) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self.dir = tempfile.mkdtemp()
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        init_file = os.path.join(self.dir, "init")
        self.procs = [
            ctx.Process(
                target=_worker, args=(r, world, module, init_file, self.tasks[r], self.results)
            )
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def run(self, name: str, *args: Any, timeout: float = 120.0) -> list[Any]:
        """Every rank's return value of ``name(*args)``, in rank order.

        Raises:
            AssertionError: a rank raised (its traceback in the message).
        """
        for q in self.tasks:
            q.put((name, args))
        out = {}
        for _ in range(self.world):
            rank, ok, val = self.results.get(timeout=timeout)
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{val}")
            out[rank] = val
        return [out[r] for r in range(self.world)]

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
