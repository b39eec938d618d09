"""Recovery of EMU capacity after workers died, from the intact units' memory only.

The functions read their manager through :class:`RecoveryHost` (what they use of
:class:`nereus_rl.emu.manager.EMUManager`), so this module never imports the manager that
calls it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from nereus_rl.emu.types import EMU, EMUStateLostError

if TYPE_CHECKING:
    from nereus_comm.pool import CommPool, Communicator
    from nereus_rl.runtime import Driver


class RecoveryHost(Protocol):
    """What recovery uses of its manager (``EMUManager`` is one): the driver, the pool,
    the units and the bookkeeping lock, Extend, and the commit and record steps that
    Destroy uses."""

    driver: Driver
    pool: CommPool
    _lock: AbstractContextManager[Any]

    def units(self, stage: str | None = None) -> list[EMU]: ...

    def free_ranks(self) -> list[int]: ...

    def extend(
        self, stage: str, ranks: Sequence[int], *, tp: int | None = None, pp: int | None = None
    ) -> EMU: ...

    def _commit(
        self, gone: list[EMU], new: list[EMU], new_comms: Sequence[Communicator | None]
    ) -> list[Any]: ...

    def _record(
        self,
        kind: str,
        stage: str,
        inputs: tuple[int, ...],
        outputs: tuple[int, ...],
        num_ranks: int,
        seconds: float,
        *,
        ranks: Sequence[int] = (),
        **measured: Any,
    ) -> None: ...


def recover_units(m: RecoveryHost, spare_ranks: Sequence[int] | None = None) -> list[EMU]:
    """Rebuild the capacity lost with dead workers from the intact units.

    Every unit that lost a shard is destroyed (its survivors drop their shards
    and groups); then, per broken unit, a unit of the same stage is extended
    from an intact one onto free live ranks (``spare_ranks`` first when given),
    with the broken unit's (tp, pp) if enough ranks are free, else the largest
    smaller degree that fits. Nothing is read from disk.

    Arguments:
        m: the manager.
        spare_ranks: ranks to use first.

    Returns:
        The new units (possibly fewer than the broken ones, if too few ranks are free).

    Raises:
        EMUStateLostError: a stage has no intact unit left.
    """
    broken = destroy_broken(m)
    new = []
    for u in broken:
        free = m.free_ranks()
        if spare_ranks is not None:
            free = [r for r in spare_ranks if r in free] + [r for r in free if r not in spare_ranks]
        for tp, pp in shrinking(u.tp, u.pp):
            if tp * pp <= len(free):
                new.append(m.extend(u.stage, free[: tp * pp], tp=tp, pp=pp))
                break
    return new


def destroy_broken(m: RecoveryHost) -> list[EMU]:
    """Destroy every unit that lost a shard with a dead worker (recovery's first step).

    The survivors of a broken unit drop its shards; pooled groups with a dead member
    are marked broken (never handed out again).

    Returns:
        The destroyed units.

    Raises:
        EMUStateLostError: a stage has no intact unit left (nothing is destroyed).
    """
    with m._lock:  # the checks and the destroys as one step
        lost = set(m.driver.check_liveness())
        broken = [u for u in m.units() if lost & set(u.ranks)]
        for stage in {u.stage for u in broken}:
            if not any(not (lost & set(u.ranks)) for u in m.units(stage)):
                raise EMUStateLostError(
                    f"every unit of stage {stage!r} lost a shard (lost workers {sorted(lost)}); "
                    "its state must come from a checkpoint"
                )
        for u in broken:
            t0 = time.perf_counter()
            m._commit([u], [], [])
            m._record(
                "destroy", u.stage, (u.uid,), (), len(u.ranks), time.perf_counter() - t0,
                extra={"reason": "lost worker"}, ranks=u.ranks, started=t0,
            )  # fmt: skip
        # Groups with a dead member are never handed out again; idle ones go first on
        # eviction.
        m.pool.on_ranks_lost(lost)
    return broken


def shrinking(tp: int, pp: int) -> list[tuple[int, int]]:
    """(tp, pp), then smaller layouts: halve tp first, then pp."""
    out = [(tp, pp)]
    while tp > 1 or pp > 1:
        if tp > 1:
            tp //= 2
        else:
            pp //= 2
        out.append((tp, pp))
    return out
