"""The four EMU primitives (Extend, Destroy, Split, Merge) and how they move a unit's bytes.

:class:`Primitives` is the part of :class:`nereus_rl.emu.manager.EMUManager` that
changes units: each primitive checks its input before any byte moves
(:class:`~nereus_rl.emu.types.EMUError`), moves bytes with the nereus_comm
planner and reshard over a pooled gloo group of the ranks involved
(``emu.reshard`` on the workers), and commits (drops the old units) only after
every rank succeeded; then it records its measurement. The manager supplies the
bookkeeping it relies on (``_stage``, ``_check_live``, ``_new_unit``,
``_commit``, ``_record``, ``_get_comm``, the pool and the driver), and the
locks that let threads run primitives at once: each primitive holds the
workers it involves (``_busy``) from its checks to its commit, and the
bookkeeping lock (``_lock``) only around its checks and its commit.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence

from nereus_comm.pool import Communicator
from nereus_rl.emu.arena import reserve_units
from nereus_rl.emu.comm import Layout
from nereus_rl.emu.types import EMU, EMUError, StageState

_SUMMED = ("bytes_sent", "bytes_local", "bytes_direct", "bytes_packed", "messages_sent",
           "buffers_sent")  # fmt: skip


class Primitives:
    """Extend, Destroy, Split and Merge on the manager's units (mixed into EMUManager)."""

    def extend(
        self,
        stage: str,
        ranks: Sequence[int],
        *,
        tp: int | None = None,
        pp: int | None = None,
        source: EMU | None = None,
    ) -> EMU:
        """Add a unit of ``stage`` on free ``ranks``, its state copied from a live unit.

        Arguments:
            stage: the stage to grow by one replica.
            ranks: tp * pp free live worker ranks (Layout order).
            tp, pp: the new unit's degrees (default: the source's).
            source: the unit to copy from (default: the stage's oldest unit); a unit
                of another stage of the same model holding every tensor of ``stage``
                (its extra tensors, e.g. Adam moments, are not copied).

        Returns:
            The new unit.

        Raises:
            EMUError: a rank is owned, lost or repeated; bad degrees; the source
                is not a live unit holding the stage's state. Raised before any byte
                moves.
        """
        st = self._stage(stage)
        if source is None:
            live = self.units(stage)
            if not live:
                raise EMUError(f"stage {stage!r} has no live unit to copy its state from")
            source = live[0]
        with self._busy([*ranks, *source.ranks]):
            with self._lock:
                self._check_live(source)
                if source.stage != stage and not self.covers(source.stage, stage):
                    raise EMUError(
                        f"source {source!r} does not hold stage {stage!r}'s state: it needs a "
                        f"unit of {stage!r}, or of another stage of model {st.model!r} with all "
                        "its tensors"
                    )
                unit = self._new_unit(st, ranks, tp or source.tp, pp or source.pp)
            return self._transfer("extend", st, [source], [unit], keep_sources=True)

    def destroy(self, unit: EMU) -> None:
        """Drop a unit: its shards, its hold on its communicator, its claim on its devices.

        Raises:
            EMUError: the unit is not live, or is the last unit of its stage.
        """
        with self._busy(unit.ranks), self._lock:  # check and commit as one step
            self._check_live(unit)
            holders = [
                u for u in self.units()
                if u.uid != unit.uid
                and (u.stage == unit.stage or self.covers(u.stage, unit.stage))
            ]  # fmt: skip
            if not holders:
                raise EMUError(
                    f"{unit!r} is the last unit holding stage {unit.stage!r}'s state; "
                    "extend the stage first or keep this unit"
                )
            t0 = time.perf_counter()
            self._commit([unit], [], [])
            self._record(
                "destroy", unit.stage, (unit.uid,), (), len(unit.ranks),
                time.perf_counter() - t0, ranks=unit.ranks, started=t0,
            )  # fmt: skip

    def split(
        self,
        unit: EMU,
        *,
        tp: int | None = None,
        pp: int | None = None,
        halves: tuple[Sequence[int], Sequence[int]] | None = None,
    ) -> tuple[EMU, EMU]:
        """Split a unit of degree d into two units of degree d/2 on its own devices.

        Arguments:
            unit: the unit to split.
            tp, pp: degrees of each half (default: tp halved, or pp if tp is odd).
            halves: each half's ranks in Layout order (default: the first and the
                second half of unit.ranks); together exactly unit.ranks.

        Returns:
            The two new units.

        Raises:
            EMUError: the degree is odd or 1, tp * pp != degree / 2, or the halves
                are not a partition of the unit's ranks.
        """
        with self._busy(unit.ranks):
            return self._split(unit, tp, pp, halves)

    def _split(
        self,
        unit: EMU,
        tp: int | None,
        pp: int | None,
        halves: tuple[Sequence[int], Sequence[int]] | None,
    ) -> tuple[EMU, EMU]:
        self._check_live(unit)
        st = self._stage(unit.stage)
        if unit.degree == 1:
            raise EMUError(
                f"cannot split {unit!r}: it has degree 1 (a single device); extend the "
                "stage instead to add a replica"
            )
        if unit.degree % 2:
            raise EMUError(
                f"cannot split {unit!r}: its degree {unit.degree} is not even "
                "(split needs tp * pp of at least 2 and divisible by 2)"
            )
        if tp is None and pp is None:
            tp, pp = (unit.tp // 2, unit.pp) if unit.tp % 2 == 0 else (unit.tp, unit.pp // 2)
        tp, pp = tp or 1, pp or 1
        if tp * pp * 2 != unit.degree:
            raise EMUError(
                f"each half of {unit!r} must have tp * pp = {unit.degree // 2}, got tp={tp} pp={pp}"
            )
        half = unit.degree // 2
        if halves is None:
            halves = (unit.ranks[:half], unit.ranks[half:])
        if sorted([*halves[0], *halves[1]]) != sorted(unit.ranks):
            raise EMUError(
                f"the halves {[list(h) for h in halves]} of {unit!r} must together be exactly "
                f"its ranks {list(unit.ranks)}"
            )
        with self._lock:
            a = self._new_unit(st, halves[0], tp, pp, replacing=[unit])
            b = self._new_unit(st, halves[1], tp, pp, replacing=[unit])
        self._transfer("split", st, [unit], [a, b], keep_sources=False)
        return self._units[a.uid], self._units[b.uid]

    def merge(
        self,
        a: EMU,
        b: EMU,
        *,
        tp: int | None = None,
        pp: int | None = None,
        ranks: Sequence[int] | None = None,
    ) -> EMU:
        """Merge two units of one stage and one layout into one of twice the degree.

        Arguments:
            a, b: the units.
            tp, pp: the new unit's degrees (default: tp doubled).
            ranks: the new unit's ranks in Layout order (default: a.ranks + b.ranks);
                exactly the ranks of a and b.

        Returns:
            The new unit.

        Raises:
            EMUError: same unit twice, different stages or layouts,
                tp * pp != 2 * degree, or ranks other than those of a and b.
        """
        with self._busy([*a.ranks, *b.ranks]):
            return self._merge(a, b, tp, pp, ranks)

    def _merge(
        self, a: EMU, b: EMU, tp: int | None, pp: int | None, ranks: Sequence[int] | None
    ) -> EMU:
        self._check_live(a)
        self._check_live(b)
        if a.uid == b.uid:
            raise EMUError(f"cannot merge {a!r} with itself")
        if a.stage != b.stage:
            raise EMUError(f"cannot merge units of different stages: {a!r} and {b!r}")
        if (a.tp, a.pp) != (b.tp, b.pp):
            raise EMUError(
                f"cannot merge units of different layouts: {a!r} and {b!r}; "
                "split or extend one of them to the other's (tp, pp) first"
            )
        st = self._stage(a.stage)
        if tp is None and pp is None:
            tp, pp = a.tp * 2, a.pp
        tp, pp = tp or 1, pp or 1
        if tp * pp != 2 * a.degree:
            raise EMUError(f"the merged unit needs tp * pp = {2 * a.degree}, got tp={tp} pp={pp}")
        if ranks is None:
            ranks = a.ranks + b.ranks
        if sorted(ranks) != sorted(a.ranks + b.ranks):
            raise EMUError(
                f"the merged unit's ranks {list(ranks)} must be exactly those of {a!r} and {b!r}"
            )
        with self._lock:
            unit = self._new_unit(st, ranks, tp, pp, replacing=[a, b])
        return self._transfer("merge", st, [a, b], [unit], keep_sources=False)

    def _reserve(self, units: Sequence[EMU]) -> float:
        """Carve the new units' arena blocks on their ranks before any byte moves.

        Returns the slowest rank's seconds (0 where no rank has an arena).

        Raises:
            ArenaExhaustedError: a rank's arena cannot hold its shards.
        """
        new: dict[int, list] = {}
        for u in units:
            for r in u.ranks:
                if self.arenas.get(r, {}).get("budget"):
                    new.setdefault(r, []).append((u.uid, u.stage, u.layout))
        return reserve_units(self.driver, new) if new else 0.0

    def _drop_new(self, units: Sequence[EMU]) -> None:
        """Forget what a failed primitive left of its new units (blocks, shards)."""
        lost = set(self.driver.check_liveness())
        live = sorted({r for u in units for r in u.ranks if r not in lost})
        if live:
            try:
                self.driver.call(live, "emu.drop", tuple(u.uid for u in units), timeout=30)
            except Exception:
                pass  # the original error is the one worth reporting

    @contextlib.contextmanager
    def _busy(self, ranks: Sequence[int]) -> Iterator[None]:
        """Hold the named workers for one primitive (see the module docstring).

        The locks are taken in rank order, so two primitives never wait on each other
        in a cycle. Malformed ranks take no lock (the primitive's checks refuse them).
        """
        try:
            keys = sorted({int(r) for r in ranks})
        except (TypeError, ValueError):
            keys = []
        with self._lock:
            locks = [self._rank_locks.setdefault(r, threading.Lock()) for r in keys]
        with contextlib.ExitStack() as stack:
            for lock in locks:
                stack.enter_context(lock)
            yield

    def _transfer(
        self, kind: str, st: StageState, sources: list[EMU], targets: list[EMU], keep_sources: bool
    ) -> EMU:
        t0 = time.perf_counter()
        src = Layout(
            len(sources), sources[0].tp, sources[0].pp,
            tuple(r for u in sources for r in u.ranks), num_layers=st.num_layers,
        )  # fmt: skip
        dst = Layout(
            len(targets), targets[0].tp, targets[0].pp,
            tuple(r for u in targets for r in u.ranks), num_layers=st.num_layers,
        )  # fmt: skip
        ranks = tuple(sorted(set(src.ranks) | set(dst.ranks)))
        with self._lock:
            self._ensure_stage_on(ranks)
        held: list[Communicator] = []
        try:
            held.append(self._get_comm(ranks))
            gid = held[0].handle
            unit_comms: list[Communicator | None] = []
            for u in targets:
                unit_comms.append(self._get_comm(u.ranks) if self._needs_group(u) else None)
                if unit_comms[-1] is not None:
                    held.append(unit_comms[-1])
            unit_gids = tuple(None if c is None else c.handle for c in unit_comms)
            # The new units' memory, before any byte moves (fails here when it does not fit).
            alloc_s = self._reserve(targets)
            res = self.driver.call(
                ranks, "emu.reshard", st.name,
                tuple(u.uid for u in sources), src, tuple(u.uid for u in targets), dst,
                gid, ranks, unit_gids, self.transfer_timeout,
                not keep_sources and self.remap_pages,
                timeout=self.transfer_timeout + 30,
            )  # fmt: skip
            # the builds ran before the transfer on every member: their replies are in
            setup = self._settle(held)
        except Exception:
            # Sources are untouched; forget whatever partial targets exist. The groups
            # stay in the pool, idle (a dead member's are marked broken by recover).
            for c in held:
                self._release(c)
            self._drop_new(targets)
            raise
        self._release(held[0])  # the transfer's group; the new units keep theirs
        # The sources' drops settle the page moves the workers made (emu.reshard moved
        # the kept bytes' pages; a failed primitive's _drop_new swaps them back).
        self._commit([] if keep_sources else sources, targets, unit_comms)
        total = {k: sum(r[k] for r in res.values()) for k in _SUMMED}
        self._record(
            kind, st.name, tuple(u.uid for u in sources), tuple(u.uid for u in targets),
            len(ranks), time.perf_counter() - t0,
            bytes_moved=total["bytes_sent"], bytes_local=total["bytes_local"],
            bytes_direct=total["bytes_direct"], bytes_packed=total["bytes_packed"],
            comm_setup_s=setup, started=t0,
            max_bytes_per_device=max(max(r["bytes_sent"], r["bytes_received"])
                                     for r in res.values()),
            ranks=ranks,
            extra={"messages": total["messages_sent"], "buffers": total["buffers_sent"],
                   "bytes_cma": sum(r.get("bytes_cma", 0) for r in res.values()),
                   "bytes_shm": sum(r.get("bytes_shm", 0) for r in res.values()),
                   "bytes_net": sum(r.get("bytes_net", 0) for r in res.values()),
                   # rank -> {peer: why cross-memory attach could not serve it}
                   "cma_fallback": {k: r["cma_fallback"] for k, r in res.items()
                                    if r.get("cma_fallback")},
                   "reshard_s": max(r["reshard_s"] for r in res.values()),
                   "plan_s": max(r["plan_s"] for r in res.values()),
                   "alloc_s": alloc_s,
                   # the slowest rank's pack / exchange / unpack (profiling Extend)
                   **{k: max(r.get(k, 0.0) for r in res.values())
                      for k in ("pack_s", "exchange_s", "unpack_s", "read_s", "local_s",
                                "call_s")},
                   # the page moves of the kept bytes (slowest rank; in call_s)
                   "remap_s": max(r.get("remap_s", 0.0) for r in res.values()),
                   "bytes_remapped": sum(r.get("bytes_remapped", 0) for r in res.values()),
                   # CPU seconds of every rank's process (all its threads) in the transfer
                   "cpu_s": sum(r.get("cpu_s", 0.0) for r in res.values())},
        )  # fmt: skip
        return targets[0]
