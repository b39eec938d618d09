"""What a worker command runs with: the command registry and the WorkerContext.

Commands are functions ``fn(ctx, *args, **kwargs)`` registered by name with
:func:`register`; a module that defines commands registers them when it is
imported (the driver asks every worker to import it, see
``Driver.import_module``). Workers move tensors among themselves over gloo
groups that the driver names by a group id (:meth:`WorkerContext.group`).

When the driver learns that workers died, a running command's gloo collectives
are aborted at once (nereus_rl.runtime.abort): they raise, and the command fails.
A command can also ask: :meth:`WorkerContext.aborted`, :meth:`WorkerContext.lost_ranks`,
and :meth:`WorkerContext.liveness` (a ``liveness`` callable for nereus_comm's
transports and ``reshard``).
"""

from __future__ import annotations

import datetime
import importlib
import os
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist

from nereus_rl.runtime import protocol as P
from nereus_rl.runtime.abort import AbortState

COMMANDS: dict[str, Callable[..., Any]] = {}


def register(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``fn(ctx, *args, **kwargs)`` as the worker command ``name``.

    Arguments:
        name: the name the driver calls it by (unique per process).

    Returns:
        A decorator that registers and returns the function unchanged.
    """

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        COMMANDS[name] = fn
        return fn

    return deco


def connect_store(host: str, port: int, timeout: float) -> dist.TCPStore:
    """Connect to the job's store as a client.

    Arguments:
        host, port: the store's address.
        timeout: seconds to keep trying before giving up; also the timeout of
            blocking store operations on this client.

    Returns:
        A connected TCPStore client.

    Raises:
        StoreUnreachableError: nothing answered at host:port within timeout.
    """
    try:
        return dist.TCPStore(
            host,
            port,
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout),
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as e:
        raise P.StoreUnreachableError(
            f"could not reach the job's store at {host}:{port} within {timeout:g} s ({e}); "
            "check that the driver is running and that HOST:PORT is its store address"
        ) from None


class WorkerContext:
    """What a command sees of its worker: rank, store, gloo groups and held state.

    Attributes:
        rank: this worker's global rank.
        store: the store client (commands may use it for small rendezvous data).
        state: free-form per-process state kept between commands (e.g. EMU shards).
        timings: (command name, seconds) of every command run so far.
        abort: the driver's abort notices as this worker has read them (the
            worker's watcher applies them; see nereus_rl.runtime.abort).
    """

    def __init__(
        self,
        rank: int,
        store: dist.Store,
        group_timeout: float,
        abort: AbortState | None = None,
        address: tuple[str, int] | None = None,
    ) -> None:
        self.rank = rank
        self.address = address
        self.store = store
        self.state: dict[str, Any] = {}
        self.timings: list[tuple[str, float]] = []
        self._groups: dict[int, tuple[tuple[int, ...], dist.ProcessGroup]] = {}
        self._group_timeout = group_timeout
        # Without a watcher (a context built outside serve) nothing is ever broken.
        self.abort = abort if abort is not None else AbortState(rank)

    # ------------------------------------------------------------ aborts

    def aborted(self) -> bool:
        """True if the driver reported a death while the running command ran.

        The command's gloo connections (those of groups with a lost member, and
        those of groups this worker cannot name the members of) were shut down
        then, so their ops raise; a command that catches such an error can tell an
        abort from another failure with this.
        """
        return self.abort.aborted()

    @property
    def abort_epoch(self) -> int:
        """How many abort notices the driver has written that this worker has read."""
        return self.abort.epoch

    def lost_ranks(self) -> frozenset[int]:
        """Worker ranks the driver reported lost so far. Cheap; never blocks."""
        return self.abort.lost_ranks()

    def liveness(self, ranks: Sequence[int] | None = None) -> Callable[[], frozenset[int]]:
        """A ``liveness`` callable for nereus_comm (``Transport.exchange``/``start``,
        ``reshard``): it answers the ranks the driver reported lost, so a transfer
        waiting on one ends with PeerLostError at once.

        Arguments:
            ranks: None when the transfer's ranks are worker ranks (this context's
                groups, the EMU layouts); else the worker rank of each rank of the
                transfer's group, in group-rank order (the trainer's default group,
                whose ranks are not the workers'), and the callable answers in them.
        """
        return self.abort.liveness(ranks)

    def track_group(self, key: object, members: Iterable[int]) -> AbstractContextManager[None]:
        """Context manager: the connections opened inside belong to a group over the
        worker ranks ``members`` (e.g. ``dist.init_process_group`` of the trainer's
        default group).

        An abort then breaks them only if it names one of ``members``; connections
        no group claims break on every abort that finds a command running. Build
        only that group inside the block (gloo connects while it builds).
        """
        return self.abort.track(key, members)

    def store_client(self, timeout: float) -> dist.Store:
        """A new client connection to the job's store (``timeout``: its blocking ops').

        For a rendezvous that should end when a member dies: opened inside
        :meth:`track_group`, it belongs to that group, and an abort naming a member
        shuts it down (the command's own store client is never shut down).

        Raises:
            RuntimeError: the context was built without the store's address.
        """
        if self.address is None:
            raise RuntimeError("this worker context has no store address (built outside serve)")
        return connect_store(*self.address, timeout)

    @property
    def group_timeout(self) -> float:
        """Seconds a collective or p2p op of this worker's groups may wait by default."""
        return self._group_timeout

    def group(
        self, group_id: int, ranks: tuple[int, ...], timeout: float | None = None
    ) -> tuple[dist.ProcessGroup, float]:
        """The gloo group ``group_id`` over the global ``ranks``, created on first use.

        Every member must call this with the same id and ranks (the driver
        does so by sending them the same command); creation is a rendezvous.

        Arguments:
            group_id: a job-unique id chosen by the driver.
            ranks: global ranks of the members, in group-rank order.
            timeout: seconds a collective or p2p op may wait (default: the worker's).

        Returns:
            (process group, seconds spent creating it; 0.0 when cached).

        Raises:
            RuntimeUserError: this worker is not in ``ranks``, or the id was
                used before for other ranks.
        """
        cached = self._groups.get(group_id)
        if cached is not None:
            if cached[0] != tuple(ranks):
                raise P.RuntimeUserError(
                    f"group id {group_id} already names ranks {cached[0]}, not {tuple(ranks)}; "
                    "use a fresh group id"
                )
            return cached[1], 0.0
        if self.rank not in ranks:
            raise P.RuntimeUserError(f"worker {self.rank} is not a member of group {ranks}")
        t0 = time.perf_counter()
        store = dist.PrefixStore(P.group_prefix(group_id), self.store)
        t = datetime.timedelta(seconds=timeout if timeout is not None else self._group_timeout)
        # Its connections are known, so an abort spares it while its members live.
        with self.abort.track(("group", group_id), ranks):
            pg = dist.ProcessGroupGloo(store, ranks.index(self.rank), len(ranks), t)
        self._groups[group_id] = (tuple(ranks), pg)
        return pg, time.perf_counter() - t0

    def release_groups(self, group_ids: list[int]) -> int:
        """Drop this worker's references to the named groups. Returns how many it held."""
        n = 0
        for gid in group_ids:
            if self._groups.pop(gid, None) is not None:
                self.abort.untrack(("group", gid))
                n += 1
        return n

    @property
    def group_ids(self) -> list[int]:
        """Ids of the groups this worker currently holds."""
        return sorted(self._groups)


@register("ping")
def _ping(ctx: WorkerContext) -> int:
    return ctx.rank


@register("import")
def _import(ctx: WorkerContext, module: str) -> list[str]:
    importlib.import_module(module)
    return sorted(COMMANDS)


@register("memory")
def _memory(ctx: WorkerContext) -> dict[str, int]:
    """Resident set size of this process and bytes of tensors held in ctx.state."""
    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    held = 0
    for value in ctx.state.values():
        held += _tensor_bytes(value)
    return {"rss_bytes": rss_pages * os.sysconf("SC_PAGE_SIZE"), "held_tensor_bytes": held}


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


@register("timings")
def _timings(ctx: WorkerContext) -> list[tuple[str, float]]:
    return list(ctx.timings)


@register("groups")
def _groups(ctx: WorkerContext) -> list[int]:
    return ctx.group_ids


@register("make_group")
def _make_group(ctx: WorkerContext, group_id: int, ranks: tuple[int, ...]) -> float:
    """Build (or find) the gloo group ``group_id``; returns the seconds spent building it."""
    return ctx.group(group_id, tuple(ranks))[1]


@register("release_groups")
def _release_groups(ctx: WorkerContext, group_ids: list[int]) -> int:
    return ctx.release_groups(group_ids)
