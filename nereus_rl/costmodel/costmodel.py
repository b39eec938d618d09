"""Cost model: predicted step latency, per-device peak memory and primitive costs.

Three modules: this one (efficiencies, step latency, memory), ``costmodel_work`` (the
ideal work and memory of one stage layout) and ``costmodel_primitives`` (EMU
primitives' costs, a mixin of :class:`CostModel`).

Step latency of a GlobalPlan (a synchronous RL step):

    step = sum over phases p of  max over colocation groups G of  sum_{s in G, phase p} t_s

Phases are generation, inference, training (see ``nereus_rl.core.workload``). Stages that
share devices (a colocation group) run one after another within a phase; groups on
disjoint devices run side by side. ``t_s = sum_c W_c(s) / e_c`` over operation classes
(``costmodel_work.CLASSES``), and the rollout stage's time includes the per-step weight
sync from the actor's training layout into its rollout layout. The sync is priced on
the intra-node tier when rollout and actor_train share a colocation group that lies
inside one node (or the cluster is one node), on the inter-node tier otherwise.

An asynchronous step (``Workload.rollout_ahead``: the next step's rollout beside this
step's inference and training) is composed by ``costmodel_async.overlapped_step``, which
simulates the order the workers run the stages in (:func:`compose_step` picks).

Memory: a device holds every stage placed on it (colocated stages' memory is summed;
see ``costmodel_work.stage_memory``). A plan is feasible when every device fits in
``device.memory_bytes - reserve``.

Efficiencies: one per class, conservative (low) for a class never measured, refined
from measured stage times by regularized least squares on ``1/e`` (the latency is
linear in it): rows are scaled by ``1/measured`` so each measurement counts by its
relative error, and a weak prior pulls towards the conservative start so a class that
never appears in a measurement keeps its start value.

Primitives (``primitive_cost``, ``observe_primitive``): see ``costmodel_primitives``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from nereus_rl.core.globalplan import GlobalPlan, StagePlan
from nereus_rl.core.spec import ClusterSpec
from nereus_rl.core.workload import StageWork, Workload
from nereus_rl.costmodel.overlap import overlapped_step
from nereus_rl.costmodel.primitives import PrimitiveCost, PrimitiveCostModel, UnitLayout
from nereus_rl.costmodel.work import (
    CLASS_INDEX,
    CLASSES,
    NUM_CLASSES,
    CostModelError,
    stage_memory,
    stage_work,
    sync_work,
)

__all__ = [
    "DEFAULT_EFFICIENCY",
    "CostModel",
    "CostModelError",
    "PrimitiveCost",
    "StageEstimate",
    "StepEstimate",
    "UnitLayout",
    "compose_step",
    "stage_tiers",
]

# (plan, workload) pairs whose work vectors a model keeps (a few KiB each); the cache is
# emptied when full (a long run prices new lengths; a boundary's pairs are a few hundred)
WORKS_CACHE_SIZE = 4096

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
    "contention": 0.1,  # as interference: the same start, fitted apart
}


class ClassShares(Mapping):
    """A stage's seconds per operation class (class name -> seconds), read from the
    work-times-efficiency array when asked: the decisions price hundreds of stages per
    boundary and read the shares of almost none (building a dict for each was the
    largest single cost of a PPO boundary). ``scale`` multiplies every share (a measured
    shape's ratio, :mod:`nereus_rl.costmodel.shape_correction`)."""

    __slots__ = ("_parts", "_scale")

    def __init__(self, parts: np.ndarray, scale: float | None = None) -> None:
        self._parts = parts
        self._scale = scale

    def __getitem__(self, cls: str) -> float:
        v = float(self._parts[CLASS_INDEX[cls]])
        return v if self._scale is None else v * self._scale

    def __iter__(self):
        return iter(CLASSES)

    def __len__(self) -> int:
        return len(CLASSES)

    def scaled(self, r: float) -> Mapping[str, float]:
        """The same shares times ``r`` (each exactly ``share * r``)."""
        if self._scale is None:
            return ClassShares(self._parts, r)
        return {c: self[c] * r for c in CLASSES}

    def __repr__(self) -> str:
        return f"ClassShares({dict(self)})"


@dataclass(frozen=True)
class StageEstimate:
    """Predicted seconds of one stage, with the share of each operation class."""

    stage: str
    seconds: float
    by_class: Mapping[str, float] = field(repr=False)

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


# (devices per node, one node, StagePlan) -> its tiers: pricing a new plan reads every
# stage's, O(devices) each, and the planner's placements share StagePlans across plans.
_TIERS: dict = {}
_TIERS_SIZE = 4096


def stage_tiers(cluster: ClusterSpec, sp: StagePlan) -> tuple[str, str, str]:
    """Link tier of a stage's tp groups, pp chains and dp group, from its device ids."""
    key = (cluster.devices_per_node, cluster.num_nodes == 1, sp)
    got = _TIERS.get(key)
    if got is not None:
        return got

    def name(devs) -> str:
        return "intra" if cluster.tier(devs) is cluster.intra else "inter"

    tp_t = pp_t = "intra"
    for u in sp.units:
        if tp_t == "intra":
            for p in range(sp.pp):
                if name(u[p * sp.tp : (p + 1) * sp.tp]) == "inter":
                    tp_t = "inter"
                    break
        if pp_t == "intra":
            for t in range(sp.tp):
                if name(u[t :: sp.tp]) == "inter":
                    pp_t = "inter"
                    break
        if tp_t == pp_t == "inter":
            break
    got = (tp_t, pp_t, name(sp.devices))
    if len(_TIERS) >= _TIERS_SIZE:
        _TIERS.clear()
    _TIERS[key] = got
    return got


def compose_phases(
    plan: GlobalPlan, workload: Workload, seconds: Mapping[str, float]
) -> tuple[float, ...]:
    """Each phase's seconds from its stages' (``seconds``: stage name -> seconds).

    Stages that share devices (a colocation group) run one after another within a
    phase; groups on disjoint devices overlap, so a phase lasts as long as its slowest
    group. Stages missing from ``seconds`` count 0.
    """
    phases = [0.0, 0.0, 0.0]
    for grp in plan.colocation_groups():
        per = [0.0, 0.0, 0.0]
        for s in grp:
            if s in seconds:
                per[workload.stage(s).phase] += seconds[s]
        phases = [max(a, b) for a, b in zip(phases, per)]
    return tuple(phases)


def compose_total(
    plan: GlobalPlan,
    workload: Workload,
    seconds: Mapping[str, float],
    sync_s: float,
    cluster: ClusterSpec,
    rest_s: float = 0.0,
) -> float:
    """:func:`compose_step`'s total alone (the same float operations): what ranking
    plans needs, without an async step's phases, which it does not read."""
    if not workload.rollout_ahead:
        return sum(compose_phases(plan, workload, seconds))
    return overlapped_step(plan, workload, seconds, sync_s, cluster, rest_s=rest_s)[0]


def compose_step(
    plan: GlobalPlan,
    workload: Workload,
    seconds: Mapping[str, float],
    sync_s: float,
    cluster: ClusterSpec,
    rest_s: float = 0.0,
) -> tuple[float, tuple[float, ...]]:
    """A step's seconds and its phases' (:func:`compose_phases`) from its stages'.

    Synchronous: the phases one after another. With ``workload.rollout_ahead`` the next
    step's rollout runs beside this step's work (``costmodel_async.overlapped_step``,
    with ``rest_s``, the driver's rest, on this step's chain; a synchronous step's rest
    is added by the caller);
    the phases are then each phase's own seconds, not parts of the total.
    """
    phases = compose_phases(plan, workload, seconds)
    if not workload.rollout_ahead:
        return sum(phases), phases
    return overlapped_step(plan, workload, seconds, sync_s, cluster, rest_s=rest_s)[0], phases


class CostModel(PrimitiveCostModel):
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
        self._init_primitives(prior_strength, forgetting)
        self.version = 0  # bumps on every refinement; planners key caches on it
        self._listeners: list = []  # weak references to callbacks (add_refine_listener)
        # (plan, workload) -> the stages' ideal work: it depends on the cluster only, never
        # on the efficiencies, and the decisions at one boundary price the same pairs many
        # times (the lookahead over a horizon of repeated lengths, the k-best re-ranked
        # twice): building it is most of a boundary's decision time on the tiny model
        self._works_cache: dict[tuple, dict[str, np.ndarray]] = {}
        self._stage_work_cache: dict[tuple, np.ndarray] = {}  # one stage's layout -> work
        # (plan, workload) -> peak bytes per device: the memory model has no fitted
        # parameter, and a lookahead checks each candidate at every horizon length
        # (a tenth of a PPO search's time)
        self._peak_cache: dict[tuple, dict[int, int]] = {}
        self._prior_terms: tuple | None = None  # (diag(lam), lam * x0), built on first solve

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
        w = self._work_vector(work, measured_s)
        self._add(w, measured_s)
        self._solve()
        self._refined()

    def _work_vector(self, work: Mapping[str, float] | np.ndarray, measured_s: float) -> np.ndarray:
        if not measured_s > 0:
            raise CostModelError(f"measured time {measured_s} must be > 0 seconds")
        if not isinstance(work, Mapping):
            return np.asarray(work, dtype=float)
        w = np.zeros(NUM_CLASSES)
        for c, v in work.items():
            if c not in CLASS_INDEX:
                raise CostModelError(f"unknown operation class {c!r}; classes are {CLASSES}")
            w[CLASS_INDEX[c]] = v
        return w

    def _add(self, w: np.ndarray, measured_s: float) -> None:
        """One measurement into the normal equations (the solution depends on them only)."""
        row = w / measured_s
        self._A *= self._forget
        self._b *= self._forget
        self._A += np.outer(row, row)
        self._b += row
        self._seen += w > 0

    def add_refine_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` after every refinement (each ``version`` bump).

        A bound method is held weakly (a planner that is dropped is not kept alive, and
        is no longer called); other callables strongly. The planner uses it to rebuild
        its latest search context at the new efficiencies as part of the refinement.
        """
        try:
            ref = weakref.WeakMethod(callback)
        except TypeError:
            ref = lambda: callback  # noqa: E731  (a plain function: kept)
        self._listeners.append(ref)

    def __getstate__(self) -> dict:
        # Listeners are who is watching, not the model: a copy or a pickle has none.
        state = self.__dict__.copy()
        state["_listeners"] = []
        return state

    def _refined(self) -> None:
        self.version += 1
        alive = []
        for ref in self._listeners:
            fn = ref()
            if fn is not None:
                alive.append(ref)
                fn()
        self._listeners = alive

    def _solve(self) -> None:
        # The prior's terms are fixed: built once (the same values as per solve).
        if self._prior_terms is None:
            lam = self._prior / self._x0**2
            self._prior_terms = (np.diag(lam), lam * self._x0)
        lam_diag, lam_x0 = self._prior_terms
        A = self._A + lam_diag
        rhs = self._b + lam_x0
        free = np.ones(NUM_CLASSES, dtype=bool)
        x = self._x0.copy()
        # Active-set loop for the bound 1/e >= 1 (no class beats its peak).
        for _ in range(NUM_CLASSES):
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
        for name, t in measured.items():  # every check before any state moves
            if name not in works or name.startswith("_"):
                raise CostModelError(f"measured stage {name!r} is not in the plan {plan!r}")
            self._work_vector(works[name], t)
        if not measured:
            return
        # One solve and one version bump for the whole step: the solution depends only on
        # the accumulated normal equations, so it is bit for bit the one a solve after
        # each stage would end with (a solve costs about 0.1 ms; a PPO step measures six).
        for name, t in measured.items():
            self._add(works[name], t)
        self._solve()
        self._refined()

    # ----- step latency ---------------------------------------------------------------
    def _stage_works(self, plan: GlobalPlan, workload: Workload) -> dict[str, np.ndarray]:
        """Each stage's ideal work vector (and ``_sync``), cached per (plan, workload);
        a new dict each call (callers pop from it; the arrays are never written)."""
        key = (plan, workload)
        out = self._works_cache.get(key)
        if out is None:
            out = self._build_stage_works(plan, workload)
            if len(self._works_cache) >= WORKS_CACHE_SIZE:
                self._works_cache.clear()
            self._works_cache[key] = out
        return dict(out)

    def _build_stage_works(self, plan: GlobalPlan, workload: Workload) -> dict[str, np.ndarray]:
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
            # A stage's work depends on its own layout only, and the planner's k-best
            # share a few layouts per stage: without this cache, pricing a new length for
            # the k-best builds each plan's stages afresh (0.3-0.4 ms a plan, a tenth of a
            # second at a PPO job's first decision at a new length)
            skey = (sw, sp.dp, sp.tp, sp.pp, tiers, workload.dtype)
            w = self._stage_work_cache.get(skey)
            if w is None:
                if len(self._stage_work_cache) >= WORKS_CACHE_SIZE:
                    self._stage_work_cache.clear()
                w = stage_work(sw, sp.dp, sp.tp, sp.pp, tiers, self.cluster, workload.dtype)
                self._stage_work_cache[skey] = w
            out[sw.stage] = w
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

    def stage_estimates(
        self, plan: GlobalPlan, workload: Workload
    ) -> tuple[dict[str, StageEstimate], float]:
        """Each planned stage's predicted seconds (the rollout's with the weight sync)
        and the sync's seconds, not composed into a step (:meth:`step_latency` composes
        them; the shape correction rescales stages before it composes once).

        Raises:
            CostModelError: the plan misses a stage the workload needs.
        """
        works = self._stage_works(plan, workload)
        sync = float(works.pop("_sync", np.zeros(NUM_CLASSES)) @ self._x)
        stages = {}
        for name, w in works.items():
            stages[name] = StageEstimate(name, float(w @ self._x), ClassShares(w * self._x))
        return stages, sync

    def stage_seconds(self, plan: GlobalPlan, workload: Workload) -> tuple[dict[str, float], float]:
        """:meth:`stage_estimates`' seconds without the per-class shares: each planned
        stage's seconds (the rollout's with the sync) and the sync's, the same floats.

        Raises:
            CostModelError: the plan misses a stage the workload needs.
        """
        works = self._stage_works(plan, workload)
        x = self._x
        sync = works.pop("_sync", None)
        return {name: float(w @ x) for name, w in works.items()}, (
            0.0 if sync is None else float(sync @ x)
        )

    def step_total(self, plan: GlobalPlan, workload: Workload, rest_s: float = 0.0) -> float:
        """``step_latency(plan, workload, rest_s).total_s``, bit for bit, without building
        the estimate: ranking the planner's k-best and scoring a lookahead read the total
        only, and building each stage's estimate was a third of their pricing."""
        secs, sync = self.stage_seconds(plan, workload)
        return compose_total(plan, workload, secs, sync, self.cluster, rest_s)

    def step_latency(
        self, plan: GlobalPlan, workload: Workload, rest_s: float = 0.0
    ) -> StepEstimate:
        """Predicted steady-state latency of one step of ``workload`` under ``plan``.

        ``rest_s``: the driver's seconds an asynchronous step spends on its chain of
        stages (see ``costmodel_async.overlapped_step``); ignored for a synchronous one.

        Returns:
            StepEstimate with the total, each phase and each stage (seconds).

        Raises:
            CostModelError: the plan misses a stage the workload needs.
        """
        stages, sync = self.stage_estimates(plan, workload)
        secs = {n: e.seconds for n, e in stages.items()}
        total, phases = compose_step(plan, workload, secs, sync, self.cluster, rest_s)
        return StepEstimate(total, phases, stages, sync)

    # ----- memory ---------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        """Usable bytes per device."""
        return self.cluster.device.memory_bytes - self.memory_reserve_bytes

    def stage_memory(self, sw: StageWork, dp: int, tp: int, pp: int, dtype: str) -> int:
        """Peak bytes per device of one stage under layout (dp, tp, pp)."""
        return stage_memory(sw, dp, tp, pp, dtype)

    def peak_memory(self, plan: GlobalPlan, workload: Workload) -> dict[int, int]:
        """Peak bytes on each device the plan uses (colocated stages summed); a new
        dict each call."""
        key = (plan, workload)
        out = self._peak_cache.get(key)
        if out is None:
            out = {}
            for sw in workload.planned_stages:
                sp = plan.stage(sw.stage)
                m = stage_memory(sw, sp.dp, sp.tp, sp.pp, workload.dtype)
                for d in sp.devices:
                    out[d] = out.get(d, 0) + m
            if len(self._peak_cache) >= WORKS_CACHE_SIZE:
                self._peak_cache.clear()
            self._peak_cache[key] = out
        return dict(out)

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
