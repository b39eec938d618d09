"""A small pool of local worker processes joined by a gloo process group.

Tests, examples and benchmarks start the pool once and run many functions
through it, instead of spawning processes per case (process start-up and
``import torch`` dominate on a small machine). Each worker is one rank of a
gloo group rendezvousing over a TCPStore that the parent hosts, listening on
127.0.0.1 only (jobs go to the workers over pipes, never through the store), and
starts with :data:`nereus_comm.environment.WORKER_ENV` (huge pages for fresh state).

Example::

    with LocalWorkers(4) as pool:
        results = pool.run(my_module_level_fn, arg)   # my_module_level_fn(ctx, arg) per rank
"""

from __future__ import annotations

import datetime
import gc
import os
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nereus_comm.environment import worker_environ
from nereus_comm.transport_net import NET_ADDRESS_ENV
from nereus_comm.world import listen_store

__all__ = ["LocalWorkers", "WorkerContext", "WorkerError"]


class WorkerError(RuntimeError):
    """A worker raised an exception that could not be sent back as itself."""


@dataclass
class WorkerContext:
    """What a function run in a worker gets as its first argument."""

    rank: int
    world_size: int
    store: dist.Store
    #: persists across calls in this worker (e.g. cached groups or tensors).
    scratch: dict[str, Any] = field(default_factory=dict)


def _worker_main(
    rank: int, world_size: int, port: int, inbox: mp.Queue, outbox: mp.Queue, timeout: float
) -> None:
    torch.set_num_threads(1)
    # Every worker is on this host: the socket route (reshard's route="net") listens on
    # loopback, as the store does, whatever the hostname resolves to.
    os.environ.setdefault(NET_ADDRESS_ENV, "127.0.0.1")
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=timeout)
    )
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("pg", store),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout),
    )
    ctx = WorkerContext(rank, world_size, store)
    # The ~170k objects inherited from the forkserver (torch and friends) never die;
    # freezing them keeps every full collection from walking them again, which
    # costs tens of ms each and copies their pages on write.
    gc.freeze()
    outbox.put((rank, "ready", None))
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args = job
        try:
            outbox.put((rank, "ok", fn(ctx, *args)))
        except BaseException as e:  # sent back to the parent, which decides
            tb = traceback.format_exc()
            try:
                outbox.put((rank, "err", (e, tb)))
            except Exception:
                outbox.put((rank, "err", (WorkerError(f"{type(e).__name__}: {e}"), tb)))
    dist.destroy_process_group()


class LocalWorkers:
    """``num_workers`` local processes, ranks 0..num_workers-1 of one gloo group.

    Arguments:
        num_workers: how many processes (ranks).
        timeout: seconds for start-up and the default per-call limit.

    Raises:
        TimeoutError: the workers did not start in time.
        WorkerError: a worker died while starting (e.g. run from stdin, which
            worker processes cannot re-import: put the code in a file).
    """

    def __init__(self, num_workers: int, *, timeout: float = 120.0) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self.timeout = timeout
        # forkserver: torch is imported once, in the server, and each worker is a
        # cheap fork of it (spawn would import torch once per worker); the parent's
        # threads (the store's server) are never forked.
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", "nereus_comm.transport"])
        # The parent hosts the store, so it outlives any worker that dies.
        self.store = listen_store("127.0.0.1", 0, timeout=timeout)
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(num_workers)]
        # The forkserver starts with this environment (on the first start only: a
        # forkserver already running keeps its own).
        with worker_environ(OMP_NUM_THREADS="1"):
            self._procs = [
                ctx.Process(
                    target=_worker_main,
                    args=(r, num_workers, self.store.port, self._inboxes[r], self._outbox, timeout),
                    daemon=True,
                )
                for r in range(num_workers)
            ]
            for p in self._procs:
                p.start()
        try:
            self._collect(timeout)
        except BaseException:
            self.close()
            raise

    def _collect(self, timeout: float) -> list[Any]:
        results: list[Any] = [None] * self.num_workers
        answered: set[int] = set()
        deadline = time.monotonic() + timeout
        while len(answered) < self.num_workers:
            try:
                rank, status, payload = self._outbox.get(timeout=0.25)
            except queue.Empty:
                # A worker that died never answers: say so now, not at the timeout.
                dead = [
                    f"rank {r} (exit code {p.exitcode})"
                    for r, p in enumerate(self._procs)
                    if r not in answered and not p.is_alive()
                ]
                if dead:
                    raise WorkerError(f"worker {', '.join(dead)} died") from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.num_workers)) - answered)
                    raise TimeoutError(
                        f"workers {missing} did not answer within {timeout:g} s"
                    ) from None
                continue
            results[rank] = payload if status != "err" else _Failure(*payload)
            answered.add(rank)
        return results

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        per_rank_args: Sequence[tuple[Any, ...]] | None = None,
        timeout: float | None = None,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """Run ``fn(ctx, *args)`` on every worker at once; return the results by rank.

        Arguments:
            fn: a module-level (picklable) function taking a :class:`WorkerContext` first.
            args: the same arguments for every rank.
            per_rank_args: instead of args, one argument tuple per rank.
            timeout: seconds to wait for all ranks (default: the pool's timeout).
            return_exceptions: put a rank's exception in its result slot instead of raising.

        Raises:
            TimeoutError: some rank did not answer in time (the pool is closed then).
            WorkerError: a worker process died (the pool is closed then).
            Exception: the first failing rank's exception (unless return_exceptions).
        """
        for r, inbox in enumerate(self._inboxes):
            inbox.put((fn, per_rank_args[r] if per_rank_args is not None else args))
        try:
            results = self._collect(self.timeout if timeout is None else timeout)
        except (TimeoutError, WorkerError):
            self.close()
            raise
        out = []
        for r, res in enumerate(results):
            if isinstance(res, _Failure):
                if not return_exceptions:
                    raise res.error from WorkerError(f"rank {r} failed:\n{res.traceback}")
                res = res.error
            out.append(res)
        return out

    def close(self) -> None:
        """Stop the workers (politely, then by force after a few seconds)."""
        for inbox in self._inboxes:
            try:
                inbox.put(None)
            except (ValueError, OSError):
                pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)

    def __enter__(self) -> LocalWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class _Failure:
    error: BaseException
    traceback: str
