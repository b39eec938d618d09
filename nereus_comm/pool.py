"""Communicator pool: get-or-create the communicator of an ordered rank tuple.

A key is an ordered tuple of ranks (rank ``i`` of the communicator is
``ranks[i]``). The decision of how to obtain a communicator is made by the C++
core (``nereus_comm._C.PoolCore``), in this order:

1. hit: the key is cached; reuse it.
2. shrink: a cached communicator lost ranks (``on_ranks_lost``) and its
   survivors, in order, are the request (``ncclCommShrink``).
3. split: the smallest healthy cached communicator that holds every requested
   rank is split (``ncclCommSplit``); ties go to the smaller key.
4. grow: the largest healthy cached communicator that is a strict prefix of the
   request is grown by the remaining ranks (``ncclCommGrow``: existing ranks
   keep their numbers, new ones are appended).
5. init: a fresh communicator (unique id exchanged through a Store).

Steps 2-4 apply only when the backend can do them. The cache is bounded:
beyond ``capacity`` the least recently used communicator that nobody holds is
destroyed (broken ones first); held (pinned) ones are never evicted.

Contract: every process of the pool's world calls ``get``, ``release``,
``on_ranks_lost`` and ``destroy_all`` in the same order with the same arguments,
like ``torch.distributed.new_group``. That is what lets every process reach the
same decision without talking, and what split (collective over the parent) and
gloo's ``new_group`` (collective over the default group) need. A process that
is not in a requested tuple gets a Communicator whose ``handle`` is None.

Driver-directed mode (``backend.directed``): one process (a driver that sees
every request in order) owns the pool and alone calls ``get``/``release``; the
backend's ``init`` tells the ranks of the key to build the communicator (by an
id it picks) and returns that id, ``destroy`` tells them to drop it. The
Communicator's ``handle`` is then the backend's object (e.g. the group id) and
its ``rank`` is None, since the caller is no member. The decisions (hit, LRU
eviction, pins, counters) are the same as in lockstep mode.

Example (gloo, after ``torch.distributed.init_process_group("gloo", ...)``)::

    pool = CommPool(GlooBackend(), capacity=8)
    comm = pool.get((0, 1))          # every rank calls this
    if comm.handle is not None:
        torch.distributed.all_reduce(t, group=comm.handle)
    pool.release(comm)
    print(pool.stats)
"""

from __future__ import annotations

import abc
import dataclasses
import datetime
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch.distributed as dist

from nereus_comm import _C
from nereus_comm.errors import NereusCommError, PoolError, TransportError

__all__ = [
    "CommPool",
    "Communicator",
    "GlooBackend",
    "NcclBackend",
    "PoolBackend",
    "PoolError",
    "PoolStats",
]


@dataclasses.dataclass(frozen=True)
class Communicator:
    """One pooled communicator as seen by this process.

    Attributes:
        ranks: the ordered rank tuple (the pool key).
        rank: this process's rank in the communicator, or None if not a member.
        handle: the backend's object (a ProcessGroup for gloo, an ncclComm_t as
            int for NCCL), or None if this process is not a member.
        how: how it was obtained: "hit", "split", "shrink", "grow" or "init".
    """

    ranks: tuple[int, ...]
    rank: int | None
    handle: Any = dataclasses.field(compare=False)
    how: str

    def __repr__(self) -> str:
        me = "not a member" if self.rank is None else f"rank {self.rank}"
        return f"Communicator({self.ranks}, {me}, {self.how})"


@dataclasses.dataclass(frozen=True)
class PoolStats:
    """Counters of a pool. ``create_seconds`` is the time spent creating communicators:
    the backend's calls, and in driver-directed mode also the members' builds that the
    caller waited for and reported (:meth:`CommPool.record_build_seconds`)."""

    size: int
    capacity: int
    hits: int
    misses: int
    inits: int
    splits: int
    shrinks: int
    grows: int
    evictions: int
    failures: int
    create_seconds: float

    def __repr__(self) -> str:
        return (
            f"PoolStats(size={self.size}/{self.capacity}, hits={self.hits}, "
            f"misses={self.misses} [init={self.inits} split={self.splits} "
            f"shrink={self.shrinks} grow={self.grows}], evictions={self.evictions}, "
            f"failures={self.failures}, create={self.create_seconds:.4f} s)"
        )


class PoolBackend(abc.ABC):
    """What a pool needs from a communication library.

    Every method is called on every process of the pool's world (see the
    module docstring) and returns this process's new communicator object, or
    None where this process is not a member of the result.

    Attributes:
        rank: this process's rank in the rank space the pool's keys use.
        world_size: number of ranks in that space.
        can_split, can_shrink, can_grow: which derivations the library offers.
        directed: the driver-directed mode (see the module docstring): only the
            pool's owner calls the pool, and the backend's objects are handed
            out as they are.
    """

    rank: int
    world_size: int
    directed: bool = False
    can_split: bool = False
    can_shrink: bool = False
    can_grow: bool = False

    @abc.abstractmethod
    def init(self, ranks: tuple[int, ...], tag: str) -> Any:
        """Create a fresh communicator over ``ranks``; ``tag`` is unique per creation."""

    def split(self, parent: Any, parent_ranks: tuple[int, ...], ranks: tuple[int, ...], tag: str):
        """Derive ``ranks`` from ``parent`` (collective over ``parent_ranks``)."""
        raise NotImplementedError

    def shrink(self, parent: Any, parent_ranks: tuple[int, ...], dead: frozenset[int], tag: str):
        """Derive ``parent`` minus ``dead`` (called by the survivors of ``parent_ranks``)."""
        raise NotImplementedError

    def grow(self, parent: Any, parent_ranks: tuple[int, ...], ranks: tuple[int, ...], tag: str):
        """Derive ``ranks`` (``parent_ranks`` followed by new ranks) from ``parent``."""
        raise NotImplementedError

    @abc.abstractmethod
    def destroy(self, obj: Any, broken: bool) -> None:
        """Free a communicator; ``broken``: a member died, abort instead of a clean destroy."""


class CommPool:
    """Bounded get-or-create cache of communicators keyed by ordered rank tuples.

    Arguments:
        backend: the library that creates communicators (GlooBackend, NcclBackend).
        capacity: most communicators kept; held ones may exceed it until released.
        name: namespace of the tags handed to the backend (store keys), so two
            pools on the same store do not collide.
    """

    def __init__(self, backend: PoolBackend, capacity: int = 16, *, name: str = "pool") -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise PoolError(f"capacity must be an int >= 1; got {capacity!r}")
        self._backend = backend
        self._core = _C.PoolCore(capacity, backend.can_split, backend.can_shrink, backend.can_grow)
        self._name = name
        self._objects: dict[int, Any] = {}
        self._next_handle = 0
        self._num_creations = 0
        self._lost: set[int] = set()
        self._build_seconds = 0.0  # directed mode: reported by record_build_seconds

    @property
    def backend(self) -> PoolBackend:
        """The backend this pool creates communicators with."""
        return self._backend

    def get(self, ranks: Sequence[int]) -> Communicator:
        """Return the communicator over ``ranks`` (in that order), creating it if needed.

        Collective: every process of the pool's world calls it with the same ranks.
        The result is held (pinned) until ``release``.

        Arguments:
            ranks: distinct ranks in ``[0, backend.world_size)``, none reported lost.

        Returns:
            The Communicator; its handle is None on a process that is not a member.

        Raises:
            PoolError: empty, repeated, negative, out-of-range or lost ranks.
            TransportError: the backend failed to create it (the pool is unchanged).
        """
        key = self._check(ranks)
        try:
            decision = self._core.acquire(list(key))
        except ValueError as e:
            raise PoolError(str(e)) from None
        action = decision.action_name
        if action == "hit":
            return self._communicator(key, decision.handle, action)

        tag = f"{self._name}/{self._num_creations}"
        self._num_creations += 1
        parent = tuple(decision.parent)
        parent_obj = self._objects.get(decision.parent_handle)
        start = time.perf_counter()
        try:
            if action == "split":
                obj = self._backend.split(parent_obj, parent, key, tag)
            elif action == "shrink":
                obj = self._backend.shrink(parent_obj, parent, frozenset(self._lost), tag)
            elif action == "grow":
                obj = self._backend.grow(parent_obj, parent, key, tag)
            else:
                obj = self._backend.init(key, tag)
        except Exception as e:
            self._core.abort(list(key))
            if isinstance(e, NereusCommError):
                raise
            raise TransportError(
                f"{action} of communicator {key} (parent {parent or 'none'}) failed: {e}"
            ) from e
        seconds = time.perf_counter() - start
        handle = self._store(obj)
        self._dispose(self._core.commit(list(key), handle, seconds))
        return self._communicator(key, handle, action)

    def record_build_seconds(self, seconds: float) -> None:
        """Count members' build seconds in ``stats.create_seconds``.

        In driver-directed mode the backend's ``init`` only tells the members to build
        and returns; the build runs on them and its time is known when the caller
        reads their replies. Without this the pool's counter held the sending alone
        (microseconds) while the EMU layer's groups took milliseconds to build.

        Raises:
            PoolError: ``seconds`` is negative or not finite.
        """
        if not seconds >= 0 or seconds == float("inf"):
            raise PoolError(f"build seconds must be finite and >= 0; got {seconds!r}")
        self._build_seconds += float(seconds)

    def release(self, comm: Communicator | Sequence[int]) -> None:
        """Drop one hold on a communicator from ``get``; it may now be evicted.

        Arguments:
            comm: the Communicator (or its rank tuple).

        Raises:
            PoolError: it is not held.
        """
        key = comm.ranks if isinstance(comm, Communicator) else tuple(int(r) for r in comm)
        try:
            disposals = self._core.release(list(key))
        except ValueError as e:
            raise PoolError(str(e)) from None
        self._dispose(disposals)

    def on_ranks_lost(self, dead: Iterable[int]) -> list[tuple[int, ...]]:
        """Mark ranks as dead: cached communicators holding them become broken.

        A broken communicator is never handed out again; with a backend that can
        shrink, a later ``get`` of its survivors shrinks it, otherwise it is
        aborted when evicted or on ``destroy_all``.

        Arguments:
            dead: the lost ranks.

        Returns:
            The keys of the communicators that became broken.
        """
        dead = sorted({int(r) for r in dead})
        if any(r < 0 for r in dead):
            raise PoolError(f"lost ranks must be >= 0; got {dead}")
        self._lost.update(dead)
        return [tuple(k) for k in self._core.mark_lost(dead)]

    def destroy_all(self) -> None:
        """Destroy every cached communicator (held ones too) and forget lost ranks."""
        self._dispose(self._core.clear())
        self._lost.clear()

    @property
    def stats(self) -> PoolStats:
        """A snapshot of the pool's counters."""
        c = self._core.counters()
        return PoolStats(
            size=self._core.size,
            capacity=self._core.capacity,
            hits=c.hits,
            misses=c.misses,
            inits=c.inits,
            splits=c.splits,
            shrinks=c.shrinks,
            grows=c.grows,
            evictions=c.evictions,
            failures=c.failures,
            create_seconds=c.create_seconds + self._build_seconds,
        )

    def cached(self) -> list[tuple[int, ...]]:
        """Cached keys, least recently used first."""
        return [tuple(k) for k in self._core.lru_order()]

    def is_held(self, ranks: Sequence[int]) -> bool:
        """Whether a caller holds the communicator over ``ranks``."""
        return self._core.pins([int(r) for r in ranks]) > 0

    def is_broken(self, ranks: Sequence[int]) -> bool:
        """Whether the cached communicator over ``ranks`` lost a member."""
        return self._core.is_broken([int(r) for r in ranks])

    def __repr__(self) -> str:
        return f"CommPool({type(self._backend).__name__}, {self.stats!r})"

    # -- internals ---------------------------------------------------------------

    def _check(self, ranks: Sequence[int]) -> tuple[int, ...]:
        try:
            key = tuple(int(r) for r in ranks)
        except (TypeError, ValueError):
            raise PoolError(f"ranks must be a sequence of ints; got {ranks!r}") from None
        size = self._backend.world_size
        bad = [r for r in key if r >= size]
        if bad:
            raise PoolError(f"ranks {bad} of {key} are outside the backend's world of {size} ranks")
        return key

    def _store(self, obj: Any) -> int:
        if obj is None:
            return -1
        handle = self._next_handle
        self._next_handle += 1
        self._objects[handle] = obj
        return handle

    def _communicator(self, key: tuple[int, ...], handle: int, how: str) -> Communicator:
        obj = self._objects.get(handle) if handle >= 0 else None
        if self._backend.directed:
            return Communicator(ranks=key, rank=None, handle=obj, how=how)
        member = obj is not None and self._backend.rank in key
        rank = key.index(self._backend.rank) if member else None
        return Communicator(ranks=key, rank=rank, handle=obj, how=how)

    def _dispose(self, disposals: Iterable[Any]) -> None:
        for d in disposals:
            obj = self._objects.pop(d.handle, None)
            if obj is not None:
                self._backend.destroy(obj, d.broken)


class GlooBackend(PoolBackend):
    """Caches gloo process groups of the current default group (``new_group``).

    ``new_group`` is collective over the default group, which the pool's
    contract (every process calls ``get`` in the same order) provides. Groups
    keep the requested order (``sort_ranks=False``). Gloo has no split, shrink
    or grow, so every miss is a fresh group. The groups belong to the default
    group they were made in: with World, call ``destroy_all`` before moving to
    the next generation (a rank loss needs a new generation anyway, since the
    default group itself lost a member).

    Arguments:
        timeout: seconds a collective on these groups may wait for a peer.
    """

    def __init__(self, *, timeout: float = 60.0) -> None:
        if not dist.is_initialized():
            raise PoolError(
                "GlooBackend needs torch.distributed initialised; call "
                "init_process_group('gloo', ...) or use a World first"
            )
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._timeout = datetime.timedelta(seconds=timeout)
        self._default = dist.group.WORLD

    def _check_generation(self) -> None:
        if dist.group.WORLD is not self._default:
            raise PoolError(
                "the default process group changed since this GlooBackend was made (a new "
                "World generation?); destroy_all() the pool and make a new one"
            )

    def init(self, ranks: tuple[int, ...], tag: str) -> Any:
        self._check_generation()
        group = dist.new_group(list(ranks), timeout=self._timeout, backend="gloo", sort_ranks=False)
        return group if self.rank in ranks else None

    def destroy(self, obj: Any, broken: bool) -> None:
        # Groups of an earlier default group were already freed with it.
        if dist.is_initialized() and dist.group.WORLD is self._default:
            dist.destroy_process_group(obj)


class NcclBackend(PoolBackend):
    """NCCL communicators through the run-time loaded library (``nereus_comm.nccl``).

    Unique ids travel through ``store`` under ``nereus/<tag>/uid``. Split is
    always available; shrink and grow when the loaded NCCL has
    ``ncclCommShrink`` / ``ncclCommGrow`` (2.27 / 2.28 and later).

    Arguments:
        store: a torch.distributed Store every process of the pool's world reaches.
        rank: this process's rank in the pool's rank space (its device is already set).
        world_size: size of that rank space.
        lib: a loaded NcclLibrary (default: ``nereus_comm.nccl.load_nccl()``).
        timeout: seconds to wait for a unique id from the store.
    """

    # NCCL_SPLIT_NOCOLOR: a parent member that is not in the child.
    SPLIT_NOCOLOR = -1

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        *,
        lib: Any = None,
        timeout: float = 60.0,
    ) -> None:
        if not 0 <= rank < world_size:
            raise PoolError(f"rank {rank} is outside a world of {world_size} ranks")
        if lib is None:
            from nereus_comm.nccl import load_nccl  # the transport part's loader

            lib = load_nccl()
        self._lib = lib
        self._store = store
        self._timeout = datetime.timedelta(seconds=timeout)
        self.rank = rank
        self.world_size = world_size
        self.can_split = True
        self.can_shrink = bool(lib.has_shrink)
        self.can_grow = bool(lib.has_grow)

    def _exchange_uid(self, tag: str, root: bool, make) -> bytes:
        key = f"nereus/{tag}/uid"
        if root:
            uid = make()
            self._store.set(key, uid)
            return uid
        self._store.set_timeout(self._timeout)
        return self._store.get(key)

    def init(self, ranks: tuple[int, ...], tag: str) -> Any:
        if self.rank not in ranks:
            return None
        uid = self._exchange_uid(tag, ranks[0] == self.rank, self._lib.get_unique_id)
        return self._lib.comm_init_rank(len(ranks), uid, ranks.index(self.rank))

    def split(self, parent: Any, parent_ranks: tuple[int, ...], ranks: tuple[int, ...], tag: str):
        if self.rank not in parent_ranks:
            return None
        member = self.rank in ranks
        color = 0 if member else self.SPLIT_NOCOLOR
        key = ranks.index(self.rank) if member else 0
        comm = self._lib.comm_split(parent, color, key)
        return comm if member else None

    def shrink(self, parent: Any, parent_ranks: tuple[int, ...], dead: frozenset[int], tag: str):
        if self.rank not in parent_ranks or self.rank in dead:
            return None
        exclude = [i for i, r in enumerate(parent_ranks) if r in dead]
        # A member died: its pending work on the parent can never finish.
        return self._lib.comm_shrink(parent, exclude, abort_pending=True)

    def grow(self, parent: Any, parent_ranks: tuple[int, ...], ranks: tuple[int, ...], tag: str):
        if self.rank not in ranks:
            return None
        # Existing ranks pass their comm and rank -1 (the first also passes the
        # grow id it made); new ranks pass no comm and their new rank.
        existing = self.rank in parent_ranks
        root = existing and parent_ranks[0] == self.rank
        if existing and not root:
            uid = None
        else:
            uid = self._exchange_uid(tag, root, lambda: self._lib.comm_get_unique_id(parent))
        if existing:
            return self._lib.comm_grow(parent, len(ranks), uid, -1)
        return self._lib.comm_grow(0, len(ranks), uid, ranks.index(self.rank))

    def destroy(self, obj: Any, broken: bool) -> None:
        if broken:
            self._lib.comm_abort(obj)
        else:
            self._lib.comm_destroy(obj)
