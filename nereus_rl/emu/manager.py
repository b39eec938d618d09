"""Elastic Model Units and their four primitives, run on live workers.

An EMU is one replica of one model-stage laid out over tp x pp devices
(worker ranks). A stage's data-parallel degree is its number of units. The
primitives change a stage's units without touching any other unit and
without restarting a process:

- ``extend``: a new unit on free devices, any (tp, pp), its state copied from
  a live unit of the stage, or of another stage of the same model that holds
  every tensor of it (a rollout unit from a training unit: its weights);
  shard for shard, with no packing, when the layouts match;
- ``destroy``: drop a unit and release its communicator to the pool; refused
  for the last unit holding a stage's state (a unit of another stage of the
  same model holding all of it counts as a holder);
- ``split``: one unit of degree d (= tp * pp devices) into two of degree d/2
  on its own devices;
- ``merge``: two units of one stage and layout into one of twice the degree.

A unit's state is either built by the EMU layer (``create``: synthetic
content; the primitives' outputs: the bytes received) or *adopted*
(``adopt``): the unit's tensors are then the live tensors of another owner on
the worker, e.g. the trainer's model parameters and Adam moments
(:mod:`nereus_rl.trainer.units`), read at the moment a primitive copies them.

Each primitive checks its input before any byte moves (:class:`EMUError`),
moves bytes with the nereus_comm planner and reshard over a gloo group of the
ranks involved, and commits (drops the old units) only after every rank
succeeded (:mod:`nereus_rl.emu.primitives`). Every primitive appends a
:class:`PrimitiveRecord` to ``EMUManager.records`` and (as a dict) to
``Driver.records``; with a cost model, each Extend, Destroy, Split and Merge
record is also fed to ``CostModel.observe_primitive`` (here, and nowhere else)
so its primitive estimates follow measurements.

Every gloo group (a unit's own group, a transfer's group, a training stage's
DP groups) comes from one nereus_comm CommPool on the driver, in its
driver-directed mode (:class:`DriverGroupBackend`): the driver sees every
request in order, so it alone decides hit or create and which idle group to
evict, and tells only the workers involved to build or drop a group by id.
A live unit holds (pins) its own group; Destroy releases it. The groups'
backend is :class:`nereus_rl.emu.groups.DriverGroupBackend`; recovery after
lost workers is in :mod:`nereus_rl.emu.recover`, the synthetic training step
in :mod:`nereus_rl.emu.train`.

By default a device serves one unit at a time. ``shared_devices=True`` lets
units of several stages (colocated stages) and, during a transition, an old
and a new unit of one stage share devices; what may share is then the
caller's business (a transition DAG's memory accounting).

Concurrency: threads may run primitives at once (the transition executor
does). A primitive first takes the workers it involves (every rank of its
source and target units; per-rank locks, taken in rank order so two
primitives never wait on each other in a cycle): primitives on disjoint
workers run at the same time, and two that share a worker run one after the
other, in the order they got there. Only the bookkeeping (units, pool,
records) is under one lock, held for the checks and the commit but never
while bytes move; group builds and drops do not block it
(:mod:`nereus_rl.emu.groups`). Ordering primitives that depend on each other
(a source extended before it is destroyed) is the caller's business, as is
the DAG's.

Usage (driver side)::

    driver = Driver(); ranks = driver.spawn_local(4)
    emus = EMUManager(driver)
    emus.define_stage("actor", stage_state_specs(num_layers=4, hidden=64, ffn=128, vocab=96))
    a = emus.create("actor", ranks[:2], tp=2)
    b = emus.extend("actor", ranks[2:], tp=1, pp=2)   # dp 1 -> 2
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

import torch

from nereus_comm.pool import CommPool, Communicator, PoolStats
from nereus_rl.costmodel.costmodel import CostModel, CostModelError
from nereus_rl.emu.arena import ArenaExhaustedError, configure_workers
from nereus_rl.emu.comm import TensorSpec, box_slices
from nereus_rl.emu.groups import DriverGroupBackend, PooledGroups
from nereus_rl.emu.primitives import Primitives
from nereus_rl.emu.recover import destroy_broken, recover_units
from nereus_rl.emu.state import reference_state
from nereus_rl.emu.train import run_train_step
from nereus_rl.emu.types import EMU, EMUError, EMUStateLostError, PrimitiveRecord, StageState
from nereus_rl.runtime import Driver, WorkerLostError

__all__ = [
    "ArenaExhaustedError",
    "DriverGroupBackend",
    "EMUError",
    "EMUManager",
    "EMUStateLostError",
]

# Unit ids are unique in this driver process, so managers that take turns on one
# pool of workers (tests, one trainer after another) never reuse a worker's uid.
_UNIT_IDS = itertools.count()


class EMUManager(Primitives, PooledGroups):
    """The driver's view of every unit, and the primitives that change them.

    Arguments:
        driver: the runtime driver whose workers hold the shards.
        transfer_timeout: seconds a transfer may wait for a peer.
        max_cached_groups: capacity of the communicator pool: idle groups kept for
            reuse (least recently used dropped first; held ones never).
        costmodel: a ``nereus_rl.costmodel.costmodel.CostModel``; each primitive's record
            refines its primitive estimates. None: records only.
        rank_devices: the cost model's device id of each worker rank (default: the
            rank itself, e.g. with ``local_cpu_cluster`` over the workers).
        shared_devices: let units share devices (see the module docstring).
        unit_groups: give each multi-rank unit its own pooled group. False where the
            units' owner runs their TP/PP traffic over its own groups (the trainer).
        arena_bytes: each worker's memory budget for units' state (bytes or "2G"), its
            arena (:mod:`nereus_rl.emu.arena`); 0: no arena. Default:
            ``NEREUS_ARENA_BYTES``, else 0.9 of its share of its host's memory.
        arena_prefault: reserve and touch the whole budget when a worker's arena is
            set up (as a GPU worker reserves its memory); default
            ``NEREUS_ARENA_PREFAULT``, else False (blocks made on first use and kept).
        remap_pages: Split and Merge move the bytes a rank keeps from the old unit's
            arena block into the new one's by page remapping where whole pages allow
            it (:mod:`nereus_comm.remap`); False: they copy them (to compare).
    """

    def __init__(
        self,
        driver: Driver,
        *,
        transfer_timeout: float = 60.0,
        max_cached_groups: int = 16,
        costmodel: CostModel | None = None,
        rank_devices: Mapping[int, int] | None = None,
        shared_devices: bool = False,
        unit_groups: bool = True,
        arena_bytes: int | str | None = None,
        arena_prefault: bool | None = None,
        remap_pages: bool = True,
    ) -> None:
        self.driver = driver
        self.remap_pages = remap_pages
        self.costmodel = costmodel
        self.rank_devices = dict(rank_devices) if rank_devices is not None else None
        self.shared_devices = shared_devices
        self.unit_groups = unit_groups
        self.transfer_timeout = transfer_timeout
        self.max_cached_groups = max_cached_groups
        self.stages: dict[str, StageState] = {}
        self.records: list[PrimitiveRecord] = []
        self._units: dict[int, EMU] = {}
        self._unit_gid: dict[int, int | None] = {}
        self._unit_comm: dict[int, Communicator] = {}
        self.pool = CommPool(
            DriverGroupBackend(driver, timeout=transfer_timeout),
            capacity=max_cached_groups,
            name="emu",
        )
        self._informed: set[int] = set()  # workers that know every stage
        self._drops: list[Any] = []  # emu.drop calls sent, replies not yet collected
        self._lock = threading.RLock()  # the bookkeeping above (see the module docstring)
        self._rank_locks: dict[int, threading.Lock] = {}
        driver.import_module("nereus_rl.emu.worker")
        self._arena_config = (arena_bytes, arena_prefault)
        #: per worker, its arena's stats when it was set up (budget 0: no arena).
        self.arenas: dict[int, dict[str, float]] = configure_workers(
            driver, driver.workers, arena_bytes, arena_prefault
        )

    # ---------------------------------------------------------------- queries

    @property
    def comm_stats(self) -> PoolStats:
        """The communicator pool's counters (hits, misses, evictions, create seconds)."""
        return self.pool.stats

    def units(self, stage: str | None = None) -> list[EMU]:
        """Live units (of one stage, or all), by uid."""
        with self._lock:
            items = sorted(self._units.items())
        return [u for uid, u in items if stage is None or u.stage == stage]

    def dp_degree(self, stage: str) -> int:
        """The stage's data-parallel degree: its number of units."""
        return len(self.units(stage))

    def owner(self, rank: int) -> EMU | None:
        """The unit holding a shard on ``rank``, if any."""
        for u in self.units():
            if rank in u.ranks:
                return u
        return None

    def free_ranks(self) -> list[int]:
        """Live workers that hold no unit."""
        owned = {r for u in self.units() for r in u.ranks}
        lost = set(self.driver.check_liveness())
        return [r for r in self.driver.workers if r not in owned and r not in lost]

    def reference(self, stage: str) -> dict[str, torch.Tensor]:
        """The full state every unit of the stage must equal bitwise."""
        s = self.stages[stage]
        return reference_state(s.specs, s.seed)

    def full_state(self, unit: EMU) -> dict[str, torch.Tensor]:
        """Gather a unit's full state from its ranks.

        Raises:
            EMUError: the unit is not live.
            RuntimeError: two tp ranks hold different copies of a replicated tensor.
        """
        self._check_live(unit)
        stage = self.stages[unit.stage]
        shards = self.driver.call(unit.ranks, "emu.shards", unit.uid)
        layout = unit.layout
        out = {}
        for spec in stage.specs:
            full = torch.empty(spec.shape, dtype=spec.dtype)
            first: dict[tuple, torch.Tensor] = {}
            for rank in unit.ranks:
                box = layout.box(spec, rank, stage.num_layers)
                if box is None:
                    continue
                t = shards[rank][spec.name]
                if box in first:
                    if not torch.equal(first[box], t):
                        raise RuntimeError(
                            f"{unit!r}: ranks disagree on replicated tensor {spec.name}"
                        )
                    continue
                first[box] = t
                full[box_slices(box, tuple((0, 0) for _ in box))] = t
            out[spec.name] = full
        return out

    # ---------------------------------------------------------------- setup

    def define_stage(
        self,
        name: str,
        specs: Sequence[TensorSpec],
        *,
        num_layers: int | None = None,
        seed: int = 0,
        model: str | None = None,
    ) -> StageState:
        """Declare a stage's state (its specs) on the driver and every worker.

        Arguments:
            name: the stage.
            specs: TensorSpecs of one unit's state (see emu_state.stage_state_specs).
            num_layers: layers (default: max stage_key + 1).
            seed: seed of the synthetic initial content.
            model: the model whose weights the stage holds (default: the stage's own
                name). Stages of one model may copy state between them (extend).

        Raises:
            EMUError: the stage exists already, or has no tensors.
        """
        if name in self.stages:
            raise EMUError(f"stage {name!r} is already defined")
        if not specs:
            raise EMUError(f"stage {name!r} needs at least one TensorSpec")
        if num_layers is None:
            keys = [s.stage_key for s in specs if s.stage_key is not None]
            num_layers = max(keys) + 1 if keys else 1
        stage = StageState(name, tuple(specs), num_layers, seed, model or name)
        workers = self.driver.workers
        self.driver.call(workers, "emu.define_stage", name, stage.specs, num_layers)
        # Those that knew every earlier stage now know every stage.
        self._informed = (self._informed if self.stages else set(workers)) & set(workers)
        self.stages[name] = stage
        return stage

    def create(self, stage: str, ranks: Sequence[int], *, tp: int = 1, pp: int = 1) -> EMU:
        """The stage's first unit, its state built from the synthetic content.

        Raises:
            EMUError: unknown stage, bad (tp, pp) or ranks, ranks owned or not live.
        """
        st = self._stage(stage)
        with self._busy(ranks):
            with self._lock:
                unit = self._new_unit(st, ranks, tp, pp)
                t0 = time.perf_counter()
                self._ensure_stage_on(unit.ranks)
                comm = self._get_comm(unit.ranks) if self._needs_group(unit) else None
            gid = None if comm is None else comm.handle
            try:
                self._reserve([unit])
                self.driver.call(
                    unit.ranks, "emu.build", unit.uid, stage, unit.layout, st.seed, gid
                )
                setup = self._settle([comm])
            except Exception:
                if comm is not None:
                    self._release(comm)
                self._drop_new([unit])
                raise
            self._commit([], [unit], [comm])
            self._record(
                "create", stage, (), (unit.uid,), len(unit.ranks), time.perf_counter() - t0,
                comm_setup_s=setup, started=t0,
            )  # fmt: skip
        return unit

    def adopt(
        self, stage: str, ranks: Sequence[int], *, tp: int = 1, pp: int = 1, owner: str
    ) -> EMU:
        """A unit whose tensors are an owner's live state on its ranks (no byte moves).

        Each rank's shard is what the worker-side state owner ``owner`` (registered
        with :func:`nereus_rl.emu.worker.register_state_owner`) returns for
        ``stage``, read whenever a primitive copies from the unit; it must be that
        rank's shards of the stage's specs in the unit's layout.

        Raises:
            EMUError: unknown stage, bad (tp, pp) or ranks, ranks owned or not live.
        """
        st = self._stage(stage)
        with self._busy(ranks):
            with self._lock:
                unit = self._new_unit(st, ranks, tp, pp)
                t0 = time.perf_counter()
                self._ensure_stage_on(unit.ranks)
            self.driver.call(unit.ranks, "emu.adopt", unit.uid, stage, unit.layout, owner)
            self._commit([], [unit], [None])
            self._record(
                "adopt", stage, (), (unit.uid,), len(unit.ranks), time.perf_counter() - t0,
                started=t0,
            )  # fmt: skip
        return unit

    def forget(self, units: Sequence[EMU]) -> None:
        """Drop units whose state their owner has rebuilt elsewhere (no check, no byte moves).

        For an owner that moved the state by other means (the trainer's per-stage
        reshard fallback, its recovery); a lost rank's shards went with it.
        """
        with self._lock:
            units = [u for u in units if self._units.get(u.uid) == u]
            if units:
                self._commit(units, [], [])
        self.flush()

    def flush(self) -> None:
        """Collect the replies of the shard drops sent by earlier primitives.

        A drop on a worker that died meanwhile is moot (its shards went with it).
        """
        with self._lock:
            drops, self._drops = self._drops, []
        for pending in drops:
            try:
                self.driver.wait(pending, timeout=60.0)
            except WorkerLostError:
                pass
        reap = getattr(self.pool.backend, "reap", None)
        if reap is not None:
            reap()

    def close(self) -> None:
        """Forget every unit and drop every pooled group (the workers keep running)."""
        self.forget(self.units())
        with self._lock:
            self.pool.on_ranks_lost(self.driver.check_liveness())
            self.pool.destroy_all()
        self.flush()

    def recover(self, *, spare_ranks: Sequence[int] | None = None) -> list[EMU]:
        """Rebuild the capacity lost with dead workers from the intact units
        (:func:`nereus_rl.emu.recover.recover_units`).

        Raises:
            EMUStateLostError: a stage has no intact unit left.
        """
        return recover_units(self, spare_ranks)

    def destroy_broken(self) -> list[EMU]:
        """Destroy every unit that lost a shard with a dead worker; returns them
        (:func:`nereus_rl.emu.recover.destroy_broken`).

        Raises:
            EMUStateLostError: a stage has no intact unit left (nothing is destroyed).
        """
        return destroy_broken(self)

    def train_step(
        self, stage: str, step: int, *, global_batch: int = 8, lr: float = 1e-3
    ) -> float:
        """One synthetic data-parallel Adam step on every unit of a training stage
        (:func:`nereus_rl.emu.train.run_train_step`: bitwise independent of the DP
        degree, the layouts and the primitives run between steps).

        Raises:
            EMUError: no units, units of different (tp, pp), or not a training stage.
        """
        return run_train_step(self, stage, step, global_batch=global_batch, lr=lr)

    # ---------------------------------------------------------------- internals

    def _stage(self, stage: str) -> StageState:
        st = self.stages.get(stage)
        if st is None:
            raise EMUError(f"unknown stage {stage!r}; defined: {sorted(self.stages)}")
        return st

    def _check_live(self, unit: EMU) -> None:
        if self._units.get(unit.uid) != unit:
            raise EMUError(f"{unit!r} is not a live unit (destroyed, split or merged already)")

    def _new_unit(
        self,
        st: StageState,
        ranks: Sequence[int],
        tp: int,
        pp: int,
        replacing: Sequence[EMU] = (),
    ) -> EMU:
        ranks = tuple(int(r) for r in ranks)
        if tp < 1 or pp < 1:
            raise EMUError(f"tp and pp must be >= 1, got tp={tp} pp={pp}")
        if len(ranks) != tp * pp:
            raise EMUError(f"a tp={tp} x pp={pp} unit needs {tp * pp} ranks, got {len(ranks)}")
        if len(set(ranks)) != len(ranks):
            raise EMUError(f"ranks {list(ranks)} repeat a device")
        if pp > st.num_layers:
            raise EMUError(f"pp={pp} exceeds the {st.num_layers} layers of stage {st.name!r}")
        lost = set(self.driver.check_liveness())
        workers = set(self.driver.workers)
        bad = [r for r in ranks if r not in workers or r in lost]
        if bad:
            raise EMUError(f"ranks {bad} are not live workers (live: {sorted(workers - lost)})")
        freed = {r for u in replacing for r in u.ranks}
        for r in ranks if not self.shared_devices else ():
            owner = self.owner(r)
            if owner is not None and r not in freed:
                raise EMUError(
                    f"device {r} is already owned by {owner!r}; destroy that unit or pick a "
                    f"free device (free: {self.free_ranks()})"
                )
        return EMU(next(_UNIT_IDS), st.name, tp, pp, ranks, st.num_layers)

    def covers(self, holder: str, stage: str) -> bool:
        """True when units of stage ``holder`` hold all of stage ``stage``'s state."""
        h, s = self.stages[holder], self.stages[stage]
        return h.model == s.model and {t.name for t in s.specs} <= {t.name for t in h.specs}

    def _needs_group(self, unit: EMU) -> bool:
        return self.unit_groups and unit.degree > 1

    def _ensure_stage_on(self, ranks: Sequence[int]) -> None:
        # A worker that joined after define_stage has not heard of the stages yet,
        # nor set up its arena.
        late = [r for r in ranks if r not in self.arenas]
        if late:
            self.arenas.update(configure_workers(self.driver, late, *self._arena_config))
        for rank in ranks:
            if rank not in self._informed:
                for st in self.stages.values():
                    self.driver.call([rank], "emu.define_stage", st.name, st.specs, st.num_layers)
                self._informed.add(rank)

    def _commit(
        self, gone: list[EMU], new: list[EMU], new_comms: Sequence[Communicator | None]
    ) -> list[Any]:
        with self._lock:
            return self._commit_locked(gone, new, new_comms)

    def _commit_locked(
        self, gone: list[EMU], new: list[EMU], new_comms: Sequence[Communicator | None]
    ) -> list[Any]:
        """Drop ``gone``, add ``new``. Returns the drop calls sent (also kept for flush)."""
        sent = []
        for u in gone:
            self._unit_gid.pop(u.uid, None)
            del self._units[u.uid]
            # The unit's hold on its group ends; the pool drops it when it evicts it.
            comm = self._unit_comm.pop(u.uid, None)
            if comm is not None:
                self.pool.release(comm)
            lost = set(self.driver.check_liveness())
            live = [r for r in u.ranks if r not in lost]
            if live:
                # Not waited for here: a worker runs its commands in order, so every later
                # command sees the shards gone, and the reply carries nothing needed
                # (reaped by flush). This keeps a round trip off every destroy, split, merge.
                sent.append(self.driver.submit(live, "emu.drop", (u.uid,)))
                self._drops.append(sent[-1])
        for u, comm in zip(new, new_comms):
            self._units[u.uid] = u
            self._unit_gid[u.uid] = None if comm is None else comm.handle
            if comm is not None:
                self._unit_comm[u.uid] = comm
        return sent

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
    ) -> None:
        rec = PrimitiveRecord(kind, stage, inputs, outputs, num_ranks, seconds, **measured)
        with self._lock:
            self.records.append(rec)
            self.driver.records.append(asdict(rec))
            if self.costmodel is not None and kind in _PRIMITIVES:
                self._feed(rec, ranks)

    def _feed(self, rec: PrimitiveRecord, ranks: Sequence[int]) -> None:
        """One record -> ``CostModel.observe_primitive`` (the only place primitives are fed)."""
        cm = self.costmodel
        assert cm is not None
        devs = [self.rank_devices.get(r, r) for r in ranks] if self.rank_devices else list(ranks)
        tier = "intra" if not devs or cm.cluster.tier(devs) is cm.cluster.intra else "inter"
        try:
            cm.observe_primitive(
                rec.kind,
                bytes_moved=rec.bytes_moved,
                # a rank's received bytes may include its local copies: cap at the total
                max_bytes_per_device=min(rec.max_bytes_per_device, rec.bytes_moved),
                tier=tier,
                seconds=rec.seconds,
                setup_s=rec.comm_setup_s,
                new_units=len(rec.outputs),
                new_ranks=sum(len(self._units[u].ranks) for u in rec.outputs if u in self._units),
            )
        except CostModelError as e:  # a measurement the model cannot read moves no state
            rec.extra["costmodel_error"] = str(e)


_PRIMITIVES = ("extend", "destroy", "split", "merge")  # "create" builds, it copies nothing
