"""Cost model: predicted step latency, per-device peak memory and primitive costs.

Step latency of a GlobalPlan (a synchronous RL step):

    step = sum over phases p of  max over colocation groups G of  sum_{s in G, phase p} t_s

Phases are generation, inference, training (see ``nereus_rl.workload``). Stages that
share devices (a colocation group) run one after another within a phase; groups on
disjoint devices run side by side. ``t_s = sum_c W_c(s) / e_c`` over operation classes
(``costmodel_work.CLASSES``), and the rollout stage's time includes the per-step weight
sync from the actor's training layout into its rollout layout. The sync is priced on
the intra-node tier when rollout and actor_train share a colocation group that lies
inside one node (or the cluster is one node), on the inter-node tier otherwise.

Memory: a device holds every stage placed on it (colocated stages' memory is summed;
see ``costmodel_work.stage_memory``). A plan is feasible when every device fits in
``device.memory_bytes - reserve``.

Efficiencies: one per class, conservative (low) for a class never measured, refined
from measured stage times by regularized least squares on ``1/e`` (the latency is
linear in it): rows are scaled by ``1/measured`` so each measurement counts by its
relative error, and a weak prior pulls towards the conservative start so a class that
never appears in a measurement keeps its start value.

Primitives (``primitive_cost``) are refined from measured primitives
(``observe_primitive``): the transfer part (seconds less communicator setup, fixed
overhead and link latency) refines the link tier's ``p2p`` class like any measured
work; communicator setup and the fixed per-primitive overhead are each a running
scale on the cluster's nominal figure, with the same weak prior (towards 1) and
forgetting factor. The fixed overhead is learned from primitives that move no bytes
(Destroy; a Merge or Split whose bytes all stay in place): with a transfer it cannot
be told apart from the link's efficiency, so per-byte-independent work of a transfer
(planning, commit) folds into that.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from nereus_rl.costmodel_work import (
    CLASS_INDEX,
    CLASSES,
    NUM_CLASSES,
    stage_memory,
    stage_work,
    state_bytes,
    sync_work,
)
from nereus_rl.globalplan import GlobalPlan, StagePlan
from nereus_rl.spec import ClusterSpec, ModelSpec
from nereus_rl.workload import StageWork, Workload

DEFAULT_EFFICIENCY = {
    "gemm": 0.3,
    "attention": 0.2,
    "mem": 0.4,
    "elementwise": 0.4,
    "launch": 0.5,
    "allreduce:intra": 0.4,
    "allreduce:inter": 0.3,
    "allgather:intra": 0.4,
    "allgather:inter": 0.3,
    "p2p:intra": 0.4,
    "p2p:inter": 0.3,
    # 1 / INTERFERENCE_PER_CORUNNER = 10 is the most it may cost; fitted from 2p plans
    # it is about 4-7 (efficiency 0.15-0.25): start above that, i.e. conservative.
    "interference": 0.1,
}


class CostModelError(ValueError):
    """Bad input to the cost model (a plan that misses a stage, an unknown class...)."""


@dataclass(frozen=True)
class StageEstimate:
    """Predicted seconds of one stage, with the share of each operation class."""

    stage: str
    seconds: float
    by_class: dict[str, float] = field(repr=False)

    def __repr__(self) -> str:
        return f"{self.stage}={self.seconds:.4g}s"


@dataclass(frozen=True)
class StepEstimate:
    """Predicted seconds of one step: total, per phase, per stage (rollout includes sync)."""

    total_s: float
    phase_s: tuple[float, ...]
    stages: dict[str, StageEstimate] = field(repr=False)
    sync_s: float

    def __repr__(self) -> str:
        return (
            f"StepEstimate({self.total_s:.4g}s; phases "
            + "/".join(f"{p:.3g}" for p in self.phase_s)
            + f"; sync {self.sync_s:.3g}s)"
        )


@dataclass(frozen=True)
class UnitLayout:
    """One EMU's layout and devices (``tp * pp`` of them, pp-major then tp)."""

    tp: int
    pp: int
    devices: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.devices) != self.tp * self.pp:
            raise CostModelError(
                f"UnitLayout: {len(self.devices)} devices for tp={self.tp} pp={self.pp}; "
                "give tp*pp device ids"
            )


@dataclass(frozen=True)
class PrimitiveCost:
    """Predicted cost of one EMU primitive."""

    kind: str
    seconds: float
    bytes_moved: float
    max_bytes_per_device: float
    tier: str
    setup_s: float
    fixed_s: float

    def __repr__(self) -> str:
        return (
            f"{self.kind}({self.seconds:.3g}s, {self.bytes_moved / 2**30:.3g} GiB over {self.tier})"
        )


def stage_tiers(cluster: ClusterSpec, sp: StagePlan) -> tuple[str, str, str]:
    """Link tier of a stage's tp groups, pp chains and dp group, from its device ids."""

    def name(devs) -> str:
        return "intra" if cluster.tier(devs) is cluster.intra else "inter"

    tp_t = pp_t = "intra"
    for u in sp.units:
        for p in range(sp.pp):
            if name(u[p * sp.tp : (p + 1) * sp.tp]) == "inter":
                tp_t = "inter"
        for t in range(sp.tp):
            if name(u[t :: sp.tp]) == "inter":
                pp_t = "inter"
    return tp_t, pp_t, name(sp.devices)


def _box(tp: int, pp: int, idx: int) -> tuple[float, float, float, float]:
    p, t = divmod(idx, tp)
    return (p / pp, (p + 1) / pp, t / tp, (t + 1) / tp)


def _overlap(a, b) -> float:
    x = max(0.0, min(a[1], b[1]) - max(a[0], b[0]))
    y = max(0.0, min(a[3], b[3]) - max(a[2], b[2]))
    return x * y


class _RunningScale:
    """A scale ``k`` on a nominal figure, fitted like the classes' ``1/e``.

    Each measurement is one row scaled by ``1/nominal`` (its relative error counts);
    a weak prior pulls towards ``k = 1``; past rows decay by ``forgetting``.
    """

    def __init__(self, prior: float, forgetting: float) -> None:
        self._prior = prior
        self._forget = forgetting
        self._A = 0.0
        self._b = 0.0
        self.seen = 0
        self.value = 1.0

    def observe(self, nominal: float, measured: float) -> None:
        self._A = self._A * self._forget + 1.0
        self._b = self._b * self._forget + measured / nominal
        self.seen += 1
        self.value = max(0.0, (self._b + self._prior) / (self._A + self._prior))


class CostModel:
    """Predicts step latency, peak memory and primitive costs on one cluster.

    Arguments:
        cluster: the devices and links.
        efficiencies: start efficiency per class (defaults: ``DEFAULT_EFFICIENCY``,
            deliberately low).
        prior_strength: weight of the pull towards the start values in refinement
            (in units of one measurement's relative squared error).
        forgetting: factor applied to past measurements at each new one (1.0 keeps all;
            below 1 tracks drifting efficiencies).
        memory_reserve_bytes: bytes per device kept free (runtime, fragmentation).
    """

    def __init__(
        self,
        cluster: ClusterSpec,
        *,
        efficiencies: Mapping[str, float] | None = None,
        prior_strength: float = 0.01,
        forgetting: float = 1.0,
        memory_reserve_bytes: int = 0,
    ) -> None:
        start = dict(DEFAULT_EFFICIENCY)
        for c, e in (efficiencies or {}).items():
            if c not in CLASS_INDEX:
                raise CostModelError(f"unknown operation class {c!r}; classes are {CLASSES}")
            if not 0 < e <= 1:
                raise CostModelError(f"efficiency of {c!r} is {e}; it must be in (0, 1]")
            start[c] = e
        self.cluster = cluster
        self._x0 = np.array([1.0 / start[c] for c in CLASSES])
        self._x = self._x0.copy()
        self._A = np.zeros((NUM_CLASSES, NUM_CLASSES))
        self._b = np.zeros(NUM_CLASSES)
        self._seen = np.zeros(NUM_CLASSES, dtype=int)
        self._prior = prior_strength
        self._forget = forgetting
        self.memory_reserve_bytes = memory_reserve_bytes
        self._setup = _RunningScale(prior_strength, forgetting)
        self._fixed = _RunningScale(prior_strength, forgetting)
        self._observed_primitives = 0
        self.version = 0  # bumps on every refinement; planners key caches on it

    # ----- efficiencies -------------------------------------------------------------
    @property
    def inverse_efficiencies(self) -> np.ndarray:
        """``1/e`` per class, indexed as ``CLASSES`` (a copy)."""
        return self._x.copy()

    def efficiency(self, cls: str) -> float:
        """Current efficiency of operation class ``cls``."""
        return 1.0 / self._x[CLASS_INDEX[cls]]

    def efficiencies(self) -> dict[str, float]:
        return {c: 1.0 / self._x[i] for i, c in enumerate(CLASSES)}

    def seen(self, cls: str) -> int:
        """How many measurements involved class ``cls``."""
        return int(self._seen[CLASS_INDEX[cls]])

    def observe_work(self, work: Mapping[str, float] | np.ndarray, measured_s: float) -> None:
        """Refine efficiencies from one measurement of known ideal work.

        Arguments:
            work: ideal seconds per class (at efficiency 1) of what was measured.
            measured_s: the measured seconds.

        Raises:
            CostModelError: non-positive measured time or an unknown class.
        """
        if not measured_s > 0:
            raise CostModelError(f"measured time {measured_s} must be > 0 seconds")
        if isinstance(work, Mapping):
            w = np.zeros(NUM_CLASSES)
            for c, v in work.items():
                if c not in CLASS_INDEX:
                    raise CostModelError(f"unknown operation class {c!r}; classes are {CLASSES}")
                w[CLASS_INDEX[c]] = v
        else:
            w = np.asarray(work, dtype=float)
        row = w / measured_s
        self._A *= self._forget
        self._b *= self._forget
        self._A += np.outer(row, row)
        self._b += row
        self._seen += w > 0
        self._solve()
        self.version += 1

    def _solve(self) -> None:
        lam = self._prior / self._x0**2
        free = np.ones(NUM_CLASSES, dtype=bool)
        x = self._x0.copy()
        # Active-set loop for the bound 1/e >= 1 (no class beats its peak).
        for _ in range(NUM_CLASSES):
            A = self._A + np.diag(lam)
            rhs = self._b + lam * self._x0
            fixed = ~free
            rhs_f = rhs[free] - A[np.ix_(free, fixed)] @ x[fixed]
            x[free] = np.linalg.solve(A[np.ix_(free, free)], rhs_f)
            low = free & (x < 1.0)
            if not low.any():
                break
            x[low] = 1.0
            free &= ~low
        self._x = x

    def observe(self, plan: GlobalPlan, workload: Workload, measured: Mapping[str, float]) -> None:
        """Refine efficiencies from measured seconds of some stages of one step.

        Arguments:
            plan: the plan the step ran under.
            workload: the step's workload.
            measured: seconds per stage name (rollout's time includes its weight sync).

        Raises:
            CostModelError: a stage not in the plan, or a non-positive time.
        """
        works = self._stage_works(plan, workload)
        for name, t in measured.items():
            if name not in works:
                raise CostModelError(f"measured stage {name!r} is not in the plan {plan!r}")
            self.observe_work(works[name], t)

    # ----- step latency ---------------------------------------------------------------
    def _stage_works(self, plan: GlobalPlan, workload: Workload) -> dict[str, np.ndarray]:
        out = {}
        group_of = {}
        for gi, grp in enumerate(plan.colocation_groups()):
            for s in grp:
                group_of[s] = gi
        for sw in workload.planned_stages:
            try:
                sp = plan.stage(sw.stage)
            except KeyError as e:
                raise CostModelError(
                    f"plan {plan!r} has no stage {sw.stage!r} that workload needs"
                ) from e
            tiers = stage_tiers(self.cluster, sp)
            out[sw.stage] = stage_work(sw, sp.dp, sp.tp, sp.pp, tiers, self.cluster, workload.dtype)
        if "rollout" in out and "actor_train" in group_of:
            r = plan.stage("rollout")
            same = group_of["rollout"] == group_of["actor_train"]
            grp_devs = set()
            for sp in plan.stages:
                if group_of[sp.stage] == group_of["rollout"]:
                    grp_devs |= sp.devices
            intra = self.cluster.num_nodes == 1 or (
                same and self.cluster.tier(grp_devs) is self.cluster.intra
            )
            actor = workload.stage("actor_train").model_spec
            out["rollout"] = out["rollout"] + sync_work(
                actor, r.tp, r.pp, "intra" if intra else "inter", self.cluster, workload.dtype
            )
            out["_sync"] = sync_work(
                actor, r.tp, r.pp, "intra" if intra else "inter", self.cluster, workload.dtype
            )
        return out

    def step_latency(self, plan: GlobalPlan, workload: Workload) -> StepEstimate:
        """Predicted steady-state latency of one step of ``workload`` under ``plan``.

        Returns:
            StepEstimate with the total, each phase and each stage (seconds).

        Raises:
            CostModelError: the plan misses a stage the workload needs.
        """
        works = self._stage_works(plan, workload)
        sync = float(works.pop("_sync", np.zeros(NUM_CLASSES)) @ self._x)
        stages = {}
        for name, w in works.items():
            parts = w * self._x
            stages[name] = StageEstimate(
                name, float(w @ self._x), {c: float(parts[i]) for i, c in enumerate(CLASSES)}
            )
        phases = [0.0, 0.0, 0.0]
        for grp in plan.colocation_groups():
            per = [0.0, 0.0, 0.0]
            for s in grp:
                if s in stages:
                    per[workload.stage(s).phase] += stages[s].seconds
            phases = [max(a, b) for a, b in zip(phases, per)]
        return StepEstimate(sum(phases), tuple(phases), stages, sync)

    # ----- memory ---------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        """Usable bytes per device."""
        return self.cluster.device.memory_bytes - self.memory_reserve_bytes

    def stage_memory(self, sw: StageWork, dp: int, tp: int, pp: int, dtype: str) -> int:
        """Peak bytes per device of one stage under layout (dp, tp, pp)."""
        return stage_memory(sw, dp, tp, pp, dtype)

    def peak_memory(self, plan: GlobalPlan, workload: Workload) -> dict[int, int]:
        """Peak bytes on each device the plan uses (colocated stages summed)."""
        out: dict[int, int] = {}
        for sw in workload.planned_stages:
            sp = plan.stage(sw.stage)
            m = stage_memory(sw, sp.dp, sp.tp, sp.pp, workload.dtype)
            for d in sp.devices:
                out[d] = out.get(d, 0) + m
        return out

    def memory_violations(self, plan: GlobalPlan, workload: Workload) -> dict[int, int]:
        """Devices whose peak exceeds capacity, with their peak bytes (empty: feasible)."""
        cap = self.capacity_bytes
        return {d: m for d, m in self.peak_memory(plan, workload).items() if m > cap}

    def feasible(
        self, plan: GlobalPlan, workload: Workload, available: Iterable[int] | None = None
    ) -> bool:
        """Memory fits everywhere and (if given) every device is among ``available``."""
        if available is not None and not plan.devices <= set(available):
            return False
        return not self.memory_violations(plan, workload)

    # ----- primitives -----------------------------------------------------------------
    def primitive_cost(
        self,
        kind: str,
        model: ModelSpec,
        *,
        trains: bool,
        src: tuple[UnitLayout, ...],
        dst: tuple[UnitLayout, ...] = (),
        dtype: str = "bf16",
    ) -> PrimitiveCost:
        """Predicted cost of one EMU primitive.

        Bytes: each destination device needs its shard of the unit's state (weights,
        plus master weights and Adam moments when ``trains``); what already lies on that
        device in a source unit is copied locally, the rest crosses the slowest tier
        among the devices involved. Time = max(bytes received by one device, bytes sent
        by one source device) / bandwidth / efficiency(p2p) + latency + communicator
        setup for the new units + the fixed primitive overhead.

        Arguments:
            kind: ``"extend"`` (src 1 live unit, dst 1 new unit), ``"destroy"`` (src 1),
                ``"split"`` (src 1, dst 2 of half the degree), ``"merge"`` (src 2, dst 1).
            model: the unit's architecture.
            trains: the unit holds optimizer state.
            src, dst: the units before and after.

        Returns:
            PrimitiveCost.

        Raises:
            CostModelError: unknown kind or wrong number of units for it.
        """
        want = {"extend": (1, 1), "destroy": (1, 0), "split": (1, 2), "merge": (2, 1)}
        if kind not in want:
            raise CostModelError(f"unknown primitive {kind!r}; use one of {sorted(want)}")
        if (len(src), len(dst)) != want[kind]:
            raise CostModelError(
                f"{kind} takes {want[kind][0]} source and {want[kind][1]} destination units, "
                f"got {len(src)} and {len(dst)}"
            )
        c = self.cluster
        fixed = self.fixed_overhead_s
        if kind == "destroy":
            return PrimitiveCost(kind, fixed, 0.0, 0.0, "none", 0.0, fixed)
        full = state_bytes(model, trains, 1, 1, dtype)  # the whole unit's state
        held: dict[int, tuple] = {}
        for u in src:
            for i, d in enumerate(u.devices):
                held[d] = _box(u.tp, u.pp, i)
        recv: dict[int, float] = {}
        for u in dst:
            for i, d in enumerate(u.devices):
                box = _box(u.tp, u.pp, i)
                need = (box[1] - box[0]) * (box[3] - box[2])
                local = _overlap(box, held[d]) if d in held else 0.0
                recv[d] = recv.get(d, 0.0) + full * (need - local)
        total = sum(recv.values())
        src_devs = [d for u in src for d in u.devices]
        max_recv = max(recv.values(), default=0.0)
        max_send = total / len(src_devs)
        involved = set(src_devs) | set(recv)
        tier = c.tier(involved)
        tname = "intra" if tier is c.intra else "inter"
        xfer = 0.0
        if total > 0:
            xfer = (
                max(max_recv, max_send) / tier.bandwidth_Bps * self._x[CLASS_INDEX["p2p:" + tname]]
                + tier.latency_s
            )
        new_devs = {d for u in dst for d in u.devices}
        setup = self._nominal_setup(len(dst), len(new_devs)) * self._setup.value
        return PrimitiveCost(kind, xfer + setup + fixed, total, max_recv, tname, setup, fixed)

    # ----- primitive refinement -----------------------------------------------------
    @property
    def fixed_overhead_s(self) -> float:
        """Current estimate of the fixed seconds of one primitive (bookkeeping)."""
        return self.cluster.primitive_overhead_s * self._fixed.value

    @property
    def setup_scale(self) -> float:
        """Measured / nominal communicator setup so far (1.0 before any measurement)."""
        return self._setup.value

    def primitives_seen(self) -> int:
        """How many measured primitives were fed to :meth:`observe_primitive`."""
        return self._observed_primitives

    def _nominal_setup(self, new_units: int, new_ranks: int) -> float:
        c = self.cluster
        return new_units * c.comm_setup_s + new_ranks * c.comm_setup_per_rank_s

    def observe_primitive(
        self,
        kind: str,
        *,
        bytes_moved: float,
        max_bytes_per_device: float,
        tier: str,
        seconds: float,
        setup_s: float | None = None,
        new_units: int = 1,
        new_ranks: int = 1,
        primitives: int = 1,
    ) -> None:
        """Refine the primitive estimates from one measured primitive.

        What is refined: the communicator-setup scale (when ``setup_s`` was measured
        and the primitive creates units), the fixed overhead (from a primitive that
        moves no bytes: its time less setup), and the ``p2p:<tier>`` efficiency from
        the transfer part ``seconds - setup - fixed - latency`` (skipped when that is
        not positive). A tier never observed keeps its conservative start.

        Arguments:
            kind: ``"extend"``, ``"destroy"``, ``"split"``, ``"merge"``, or
                ``"reshard"`` (a stage-level composition of them, priced alike).
            bytes_moved: bytes sent between devices, in all.
            max_bytes_per_device: the most bytes one device sent or received (the
                transfer's critical path, as ``primitive_cost`` prices it).
            tier: ``"intra"`` or ``"inter"``: the link tier the bytes crossed.
            seconds: the measured wall time of the whole primitive.
            setup_s: measured communicator-creation seconds within ``seconds``
                (``None``: not measured; the current estimate is subtracted instead).
            new_units, new_ranks: communicators and ranks the primitive set up (the
                nominal setup they scale: ``new_units * comm_setup_s + new_ranks *
                comm_setup_per_rank_s``).
            primitives: how many primitives the measurement covers (a stage-level
                reshard standing for several Extends): the fixed overhead is counted
                that many times.

        Raises:
            CostModelError: unknown kind or tier, negative bytes, non-positive seconds,
                ``max_bytes_per_device`` above ``bytes_moved``, ``primitives < 1``, or a
                negative count of new units or ranks.
        """
        kinds = ("extend", "destroy", "split", "merge", "reshard")
        if kind not in kinds:
            raise CostModelError(f"unknown primitive {kind!r}; use one of {kinds}")
        if tier not in ("intra", "inter"):
            raise CostModelError(f"unknown link tier {tier!r}; use 'intra' or 'inter'")
        if not seconds > 0:
            raise CostModelError(f"measured primitive time {seconds} must be > 0 seconds")
        if bytes_moved < 0 or max_bytes_per_device < 0 or max_bytes_per_device > bytes_moved:
            raise CostModelError(
                f"bytes_moved={bytes_moved} and max_bytes_per_device={max_bytes_per_device} "
                "must be >= 0 with the per-device figure at most the total"
            )
        if primitives < 1:
            raise CostModelError(f"primitives={primitives}: a measurement covers at least 1")
        if new_units < 0 or new_ranks < 0:
            raise CostModelError(f"new_units={new_units} and new_ranks={new_ranks} must be >= 0")
        if setup_s is not None and setup_s < 0:
            raise CostModelError(f"measured setup time {setup_s} must be >= 0 seconds")
        nominal = self._nominal_setup(new_units, new_ranks)
        if setup_s is not None and nominal > 0:
            self._setup.observe(nominal, setup_s)
        setup = setup_s if setup_s is not None else nominal * self._setup.value
        if bytes_moved == 0:
            nominal_fixed = self.cluster.primitive_overhead_s * primitives
            self._fixed.observe(nominal_fixed, max(0.0, seconds - setup))
        elif max_bytes_per_device > 0:
            link = self.cluster.intra if tier == "intra" else self.cluster.inter
            xfer = seconds - setup - primitives * self.fixed_overhead_s - link.latency_s
            if xfer > 0:
                self.observe_work({"p2p:" + tier: max_bytes_per_device / link.bandwidth_Bps}, xfer)
        self._observed_primitives += 1
        self.version += 1
