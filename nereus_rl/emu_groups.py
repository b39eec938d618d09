"""The EMU layer's communicators: runtime gloo groups handed out by a driver-directed CommPool.

Every gloo group the EMU layer uses (a unit's own group, a transfer's group, a
training stage's DP groups) comes from one nereus_comm CommPool on the driver,
in its driver-directed mode: the driver sees every request in order, so it
alone decides hit or create and which idle group to evict, and tells only the
workers involved to build or drop a group by id.
"""

from __future__ import annotations

import itertools

from nereus_comm.pool import PoolBackend
from nereus_rl.runtime import Driver, WorkerLostError

# Group ids are unique in this driver process, so two pools on one Driver never collide.
_GROUP_IDS = itertools.count(1)


class DriverGroupBackend(PoolBackend):
    """A CommPool backend (driver-directed mode) whose communicators are runtime gloo groups.

    ``init`` picks a fresh group id and has the members build the group
    (``make_group``, a rendezvous among them); its object is the group id.
    ``destroy`` has the live members drop it (``release_groups``).

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

    @property
    def world_size(self) -> int:
        """One more than the highest rank of a joined worker (workers join over time)."""
        return max(self._driver.infos, default=-1) + 1

    def init(self, ranks: tuple[int, ...], tag: str) -> int:
        gid = next(_GROUP_IDS)
        self._driver.call(ranks, "make_group", gid, ranks, timeout=self._timeout + 30)
        self._ranks[gid] = ranks
        return gid

    def destroy(self, obj: int, broken: bool) -> None:
        ranks = self._ranks.pop(obj, ())
        lost = set(self._driver.check_liveness())
        live = [r for r in ranks if r not in lost]
        if live:
            try:
                self._driver.call(live, "release_groups", [obj], timeout=30)
            except WorkerLostError:
                pass  # a member died meanwhile: its group went with it
