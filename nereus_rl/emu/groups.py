"""The EMU layer's communicators: runtime gloo groups handed out by a driver-directed CommPool.

Every gloo group the EMU layer uses (a unit's own group, a transfer's group, a
training stage's DP groups) comes from one nereus_comm CommPool on the driver,
in its driver-directed mode: the driver sees every request in order, so it
alone decides hit or create and which idle group to evict, and tells only the
workers involved to build or drop a group by id.

A group is a standalone ``ProcessGroupGloo`` over a store prefix of its own
(``WorkerContext.group``): building it is a rendezvous among its members only,
never a collective over every worker of the job, so primitives on disjoint
workers build their groups at the same time without waiting on each other.

Neither building nor dropping blocks the driver: ``init`` and ``destroy`` only
send the command (a worker runs its commands in order, so the command that
uses a group runs after the one that builds it), and the caller collects the
build's seconds when it needs them (:meth:`DriverGroupBackend.setup_seconds`).
The pool's decisions are thus quick enough to be made under the EMU manager's
bookkeeping lock, and an eviction never waits for workers busy with another
primitive.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence

from nereus_comm.errors import TransportError
from nereus_comm.pool import Communicator, PoolBackend
from nereus_rl.runtime import Driver, PendingCall, RemoteError, WorkerLostError

# Group ids are unique in this driver process, so two pools on one Driver never collide.
_GROUP_IDS = itertools.count(1)


class DriverGroupBackend(PoolBackend):
    """A CommPool backend (driver-directed mode) whose communicators are runtime gloo groups.

    ``init`` picks a fresh group id and sends the members ``make_group`` (a
    rendezvous among them) without waiting; its object is the group id.
    ``destroy`` sends the live members ``release_groups`` without waiting.

    Arguments:
        driver: the runtime driver.
        timeout: seconds the members may take to build a group.
    """

    directed = True
    rank = -1  # the driver is no member of any group

    def __init__(self, driver: Driver, *, timeout: float = 60.0) -> None:
        self._driver = driver
        self._timeout = timeout
        self._ranks: dict[int, tuple[int, ...]] = {}
        self._building: dict[int, PendingCall] = {}  # gid -> make_group not yet collected
        self._dropping: list[PendingCall] = []  # release_groups not yet collected
        self._lock = threading.Lock()

    @property
    def world_size(self) -> int:
        """One more than the highest rank of a joined worker (workers join over time)."""
        return max(self._driver.infos, default=-1) + 1

    def init(self, ranks: tuple[int, ...], tag: str) -> int:
        gid = next(_GROUP_IDS)
        pending = self._driver.submit(ranks, "make_group", gid, ranks)
        with self._lock:
            self._ranks[gid] = ranks
            self._building[gid] = pending
        return gid

    def setup_seconds(self, gid: int) -> float:
        """Wait for group ``gid``'s build, if not collected yet: its slowest member's seconds.

        Returns:
            The seconds (0.0 when the build was collected before, or the group was
            not built by this backend).

        Raises:
            RemoteError, WorkerLostError, WorkerTimeoutError: the build failed.
        """
        with self._lock:
            pending = self._building.pop(gid, None)
        if pending is None:
            return 0.0
        return max(self._driver.wait(pending, timeout=self._timeout + 30).values())

    def destroy(self, obj: int, broken: bool) -> None:
        with self._lock:
            ranks = self._ranks.pop(obj, ())
            building = self._building.pop(obj, None)
            if building is not None:
                self._dropping.append(building)  # its reply still has to be read
        lost = set(self._driver.check_liveness())
        live = [r for r in ranks if r not in lost]
        if live:
            try:
                pending = self._driver.submit(live, "release_groups", [obj])
            except WorkerLostError:
                return  # a member died meanwhile: its group went with it
            with self._lock:
                self._dropping.append(pending)

    def reap(self) -> None:
        """Read the replies of the drops (and uncollected builds) sent so far.

        A worker that died meanwhile took its groups with it; a build that failed
        left a group that is never used again (it was dropped).
        """
        with self._lock:
            pending, self._dropping = self._dropping, []
        for p in pending:
            try:
                self._driver.wait(p, timeout=self._timeout + 30)
            except (WorkerLostError, RemoteError):
                pass


class PooledGroups:
    """How :class:`nereus_rl.emu.manager.EMUManager` takes groups from its pool (mixed into it):
    under its bookkeeping lock, with the builds' seconds read afterwards."""

    def _get_comm(self, ranks: Sequence[int]) -> Communicator:
        """A held communicator over ``ranks`` from the pool (the workers build it on a miss,
        after whatever they were sent before; :meth:`_settle` waits for the build)."""
        try:
            with self._lock:
                return self.pool.get(ranks)
        except TransportError as e:
            # The pool wraps the backend's failure; a lost worker is what the caller handles.
            if isinstance(e.__cause__, WorkerLostError):
                raise e.__cause__ from None
            raise

    def _release(self, comm: Communicator) -> None:
        with self._lock:
            self.pool.release(comm)

    def _settle(self, comms: Sequence[Communicator | None]) -> float:
        """Seconds the workers spent building the communicators among ``comms`` that were
        built for this call (0 for pool hits): their builds' replies, read now."""
        seconds = getattr(self.pool.backend, "setup_seconds", None)
        if seconds is None:
            return 0.0
        built = float(sum(seconds(c.handle) for c in comms if c is not None and c.how != "hit"))
        if built:
            with self._lock:  # the pool's counters count the builds too
                self.pool.record_build_seconds(built)
        return built
