"""Cost model, part 2: predicted cost of EMU primitives, refined from measured ones.

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

from dataclasses import dataclass

from nereus_rl.core.spec import ClusterSpec, ModelSpec
from nereus_rl.costmodel.work import CLASS_INDEX, CostModelError, state_bytes


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


class PrimitiveCostModel:
    """The primitive half of :class:`nereus_rl.costmodel.costmodel.CostModel` (a mixin).

    It uses the host's ``cluster``, ``_x`` (``1/e`` per class), ``observe_work`` and
    ``version``, and keeps its own running scales for communicator setup and the
    fixed per-primitive overhead.
    """

    cluster: ClusterSpec

    def _init_primitives(self, prior_strength: float, forgetting: float) -> None:
        self._setup = _RunningScale(prior_strength, forgetting)
        self._fixed = _RunningScale(prior_strength, forgetting)
        self._observed_primitives = 0

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
                w = self._work_vector(
                    {"p2p:" + tier: max_bytes_per_device / link.bandwidth_Bps}, xfer
                )
                self._add(w, xfer)
                self._solve()
        self._observed_primitives += 1
        self._refined()  # one version bump per primitive measurement
