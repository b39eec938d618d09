"""Transition types: units, placements, primitives, the DAG, errors and default costs.

Resources. A device serves at most one unit of each stage at a time (its
*stage slot*; ``stage_slots=False`` drops this rule), and the units on a device
must fit its memory. Colocated stages (different stages on one device) share the
device's memory, as in a GlobalPlan.
A primitive acquires the memory (and slots) of the units it creates when it
starts and releases the memory (and slots) of the units it consumes when it
ends: ``split`` and ``merge`` work in place, so for a moment they hold both.

Memory and primitive costs are injectable callables (``unit_memory(unit)`` ->
bytes per device, ``cost_fn(primitive)`` -> seconds) so that the cost model can
plug in; the defaults here are plain tables.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from itertools import chain, repeat
from operator import attrgetter
from typing import NamedTuple, Protocol

from nereus_rl.core.globalplan import GlobalPlan, fmt_devices

# ---------------------------------------------------------------------------
# Errors


class TransitionError(ValueError):
    """A transition cannot be compiled or checked; the message names units and devices."""


class InfeasibleTargetError(TransitionError):
    """The target plan needs devices that do not exist, or more memory than a device has."""


class StateLossError(TransitionError):
    """The transition would destroy the last holder of some state (weights or optimizer)."""


class UnsafeDAGError(TransitionError):
    """A DAG has a cycle, or no execution order keeps ownership and memory within bounds."""


class TransitionExecutionError(RuntimeError):
    """A primitive implementation failed, or execution did not end in the target placement."""


# ---------------------------------------------------------------------------
# Placement


class Unit(NamedTuple):
    """One Elastic Model Unit: a replica of one model-stage on ``tp * pp`` devices.

    Attributes:
        uid: unique id within a transition, e.g. ``"rollout#0"``.
        stage, model, trains: as in :class:`~nereus_rl.core.globalplan.StagePlan`.
        tp, pp: the unit's layout; ``devices`` are ordered pp-major, then tp.
        devices: the unit's devices.
    """

    uid: str
    stage: str
    model: str
    trains: bool
    tp: int
    pp: int
    devices: tuple[int, ...]

    @property
    def states(self) -> tuple[tuple[str, str], ...]:
        """State keys this unit holds: the model's weights, and its stage's optimizer state."""
        if self.trains:
            return (("weights", self.model), ("optimizer", self.stage))
        return (("weights", self.model),)

    @property
    def layout(self) -> tuple[int, int, tuple[int, ...]]:
        return (self.tp, self.pp, self.devices)

    def __repr__(self) -> str:
        return f"{self.uid}(tp{self.tp}pp{self.pp}@{fmt_devices(self.devices)})"


_DEVICES = attrgetter("devices")
_UID = attrgetter("uid")


@dataclass(frozen=True)
class Placement:
    """The live units of a job: what a GlobalPlan looks like once it runs."""

    units: tuple[Unit, ...]

    def __post_init__(self) -> None:
        uids = list(map(_UID, self.units))
        if len(set(uids)) == len(uids):
            return
        seen: set[str] = set()
        for uid in uids:
            if uid in seen:
                raise ValueError(f"Placement: uid {uid!r} names two units; give each a uid")
            seen.add(uid)

    @staticmethod
    def from_plan(plan: GlobalPlan) -> Placement:
        """Units of ``plan`` with uids ``"<stage>#<i>"``.

        Arguments:
            plan: the global plan.
        Returns:
            the placement with one unit per (stage, dp index).
        """
        units: list[Unit] = []
        make = partial(tuple.__new__, Unit)  # no Python-level call per unit
        for sp in plan.stages:
            uids = map(f"{sp.stage}#".__add__, map(str, range(len(sp.units))))
            same = (repeat(x) for x in (sp.stage, sp.model, sp.trains, sp.tp, sp.pp))
            units += map(make, zip(uids, *same, sp.units))
        return Placement(tuple(units))

    def stage_units(self, stage: str) -> tuple[Unit, ...]:
        return tuple(u for u in self.units if u.stage == stage)

    @property
    def devices(self) -> frozenset[int]:
        return frozenset(chain.from_iterable(map(_DEVICES, self.units)))

    def layout_key(self) -> dict[str, list[tuple[int, int, tuple[int, ...]]]]:
        """Per stage, the sorted layouts of its units: equal keys mean the same placement."""
        out: dict[str, list[tuple[int, int, tuple[int, ...]]]] = {}
        for u in self.units:
            out.setdefault(u.stage, []).append(u.layout)
        return {k: sorted(v) for k, v in out.items()}

    def matches(self, plan: GlobalPlan | Placement) -> bool:
        """True when every stage has exactly the units (layout and devices) of ``plan``."""
        other = Placement.from_plan(plan) if isinstance(plan, GlobalPlan) else plan
        return self.layout_key() == other.layout_key()

    def __repr__(self) -> str:
        return "Placement(" + " ".join(repr(u) for u in self.units) + ")"


# ---------------------------------------------------------------------------
# Memory and cost defaults (until the cost model plugs in)

UnitMemoryFn = Callable[[Unit], float]

#: Default weight bytes per model (an 8B model in bf16).
DEFAULT_MODEL_BYTES: dict[str, float] = {
    "actor": 16e9,
    "critic": 16e9,
    "reference": 16e9,
    "reward": 16e9,
}
#: Training units also hold gradients, fp32 master weights and Adam moments.
TRAIN_FACTOR = 8.0
#: Default device memory (bytes).
DEFAULT_CAPACITY = 141e9


def default_unit_memory(unit: Unit) -> float:
    """Bytes per device a unit holds: model bytes (x8 when training) over tp * pp.

    Arguments:
        unit: the unit.
    Returns:
        bytes on each of the unit's devices.
    """
    b = DEFAULT_MODEL_BYTES.get(unit.model, 16e9)
    if unit.trains:
        b *= TRAIN_FACTOR
    return b / (unit.tp * unit.pp)


CapacityLike = float | int | Mapping[int, float]


def capacity_of(capacity: CapacityLike, device: int) -> float:
    """Memory capacity of ``device`` from a number (all devices) or a mapping."""
    if isinstance(capacity, Mapping):
        return float(capacity[device])
    return float(capacity)


# ---------------------------------------------------------------------------
# DAG types

KINDS = ("extend", "destroy", "split", "merge")


class Primitive(NamedTuple):
    """One EMU primitive: a node of the transition DAG.

    Attributes:
        pid: index in ``TransitionDAG.primitives``.
        kind: ``"extend"`` (new unit, state copied from ``source``), ``"destroy"``
            (release a unit), ``"split"`` (one unit into two on the same devices),
            ``"merge"`` (two units into one on the same devices).
        stage: the model-stage.
        inputs: units consumed (destroyed, split or merged).
        outputs: units created.
        source: the live unit an ``extend`` copies state from.
        acquire: ``(device, bytes)`` taken at start (memory of the outputs).
        release: ``(device, bytes)`` given back at the end (memory of the inputs).
        lost: a ``destroy`` of a unit that lost devices (no state to keep).
    """

    pid: int
    kind: str
    stage: str
    inputs: tuple[Unit, ...]
    outputs: tuple[Unit, ...]
    source: Unit | None = None
    acquire: tuple[tuple[int, float], ...] = ()
    release: tuple[tuple[int, float], ...] = ()
    lost: bool = False

    @property
    def devices(self) -> tuple[int, ...]:
        s = {d for u in self.inputs + self.outputs for d in u.devices}
        return tuple(sorted(s))

    def slots_acquired(self) -> tuple[tuple[str, int], ...]:
        """(stage, device) slots this primitive takes: output devices its inputs do not hold."""
        if not self.outputs:
            return ()
        if not self.inputs:  # an extend: every device of the new unit
            return tuple((u.stage, d) for u in self.outputs for d in u.devices)
        held = {d for u in self.inputs for d in u.devices}
        return tuple((u.stage, d) for u in self.outputs for d in u.devices if d not in held)

    def slots_released(self) -> tuple[tuple[str, int], ...]:
        """(stage, device) slots freed at the end: input devices no output keeps."""
        if not self.inputs:
            return ()
        if not self.outputs:  # a destroy: every device of the unit
            return tuple((u.stage, d) for u in self.inputs for d in u.devices)
        kept = {d for u in self.outputs for d in u.devices}
        return tuple((u.stage, d) for u in self.inputs for d in u.devices if d not in kept)

    def __repr__(self) -> str:
        ins = ",".join(u.uid for u in self.inputs)
        outs = ",".join(repr(u) for u in self.outputs)
        tag = {"extend": "E", "destroy": "D", "split": "S", "merge": "M"}[self.kind]
        src = f" <- {self.source.uid}" if self.source is not None else ""
        if self.kind == "destroy":
            return f"{tag}{self.pid}[{ins}{' lost' if self.lost else ''}]"
        return f"{tag}{self.pid}[{ins + ' -> ' if ins else ''}{outs}{src}]"


class Edge(NamedTuple):
    """A DAG edge ``src -> dst`` (primitive ids); ``kind`` is ``"data"`` or ``"resource"``."""

    src: int
    dst: int
    kind: str
    reason: str

    def __repr__(self) -> str:
        return f"{self.src}->{self.dst} {self.kind}: {self.reason}"


class Funding(NamedTuple):
    """Certificate that an acquisition is covered: ``amount`` of ``resource`` from ``funder``.

    ``funder`` is ``-1`` for the memory (or slot) free before the transition, else the
    id of a primitive (an ancestor) that releases it. ``resource`` is a device id
    (memory) or a ``(stage, device)`` slot.
    """

    pid: int
    resource: int | tuple[str, int]
    funder: int
    amount: float


@dataclass(frozen=True)
class TransitionDAG:
    """A compiled plan change.

    Attributes:
        current: the placement before.
        target: the placement after (uids of kept units are unchanged).
        primitives: the nodes, ``primitives[i].pid == i``.
        edges: data and resource edges.
        order: a safe sequential order (the compiler's simulation).
        capacity: device memory used for the resource checks.
        devices: the devices that exist during the transition (lost ones excluded).
        unit_bytes: ``(uid, bytes per device)`` of every unit the DAG mentions (current,
            intermediate, target): the memory model the DAG was compiled with.
        funding: for compiled DAGs, a certificate that every acquisition is covered in
            every topological execution (see :mod:`nereus_rl.transition.safety`).
        anchors: for each non-lost destroy, ``(pid, state, holder uid)``: which unit keeps
            each state alive.
        stage_slots: whether a device serves at most one unit of each stage at a time
            (the default). When False only memory limits sharing, so a new unit may
            land on devices an old unit of its stage still holds while both fit.
        early_destroys: ``(destroy pid, blocked pid)``: destroys the compiler brought
            forward because an acquisition was blocked (``-1``: every one was).
    """

    current: Placement
    target: Placement
    primitives: tuple[Primitive, ...]
    edges: tuple[Edge, ...]
    order: tuple[int, ...]
    capacity: CapacityLike
    devices: frozenset[int]
    unit_bytes: tuple[tuple[str, float], ...]
    funding: tuple[Funding, ...] | None = None
    anchors: tuple[tuple[int, tuple[str, str], str], ...] = ()
    early_destroys: tuple[tuple[int, int], ...] = ()
    stage_slots: bool = True

    def slots_acquired(self, p: Primitive) -> tuple[tuple[str, int], ...]:
        """The stage slots ``p`` takes under this DAG's rules (none without stage slots)."""
        return p.slots_acquired() if self.stage_slots else ()

    def slots_released(self, p: Primitive) -> tuple[tuple[str, int], ...]:
        """The stage slots ``p`` frees under this DAG's rules (none without stage slots)."""
        return p.slots_released() if self.stage_slots else ()

    @property
    def notes(self) -> tuple[str, ...]:
        """Why each early destroy was chosen, in words."""
        out = []
        for q, p in self.early_destroys:
            who = f"{self.primitives[p]!r}" if p >= 0 else "every acquisition"
            out.append(f"{who} blocked: destroy {self.primitives[q]!r} first")
        return tuple(out)

    @property
    def num_resource_edges(self) -> int:
        return sum(1 for e in self.edges if e.kind == "resource")

    @property
    def num_data_edges(self) -> int:
        return sum(1 for e in self.edges if e.kind == "data")

    def preds(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.primitives]
        for e in self.edges:
            out[e.dst].append(e.src)
        return out

    def succs(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.primitives]
        for e in self.edges:
            out[e.src].append(e.dst)
        return out

    def counts(self) -> dict[str, int]:
        """Number of primitives of each kind."""
        out = dict.fromkeys(KINDS, 0)
        for p in self.primitives:
            out[p.kind] += 1
        return out

    def describe(self) -> str:
        """Multi-line printout: primitives in safe order, then edges."""
        lines = [repr(self)]
        lines += [f"  {self.primitives[i]!r}" for i in self.order]
        lines += [f"  edge {e!r}" for e in self.edges]
        return "\n".join(lines)

    def __repr__(self) -> str:
        c = self.counts()
        return (
            f"TransitionDAG({len(self.primitives)} primitives: E{c['extend']} D{c['destroy']} "
            f"S{c['split']} M{c['merge']}; {self.num_data_edges} data + "
            f"{self.num_resource_edges} resource edges)"
        )


# ---------------------------------------------------------------------------
# Transition cost


class PrimitiveCostFn(Protocol):
    """Predicted seconds of one primitive (the cost model's ``primitive_cost`` fits this)."""

    def __call__(self, primitive: Primitive) -> float: ...


#: Default copy bandwidth for an extend, and in-device reshard bandwidth for split/merge.
DEFAULT_EXTEND_BYTES_PER_S = 25e9
DEFAULT_RESHARD_BYTES_PER_S = 100e9


def default_primitive_cost(primitive: Primitive) -> float:
    """A plain table: fixed setup plus bytes moved over a nominal bandwidth.

    Arguments:
        primitive: the primitive.
    Returns:
        predicted seconds.
    """
    moved = sum(b for _, b in primitive.acquire)
    if primitive.kind == "extend":
        return 1.0 + moved / DEFAULT_EXTEND_BYTES_PER_S
    if primitive.kind in ("split", "merge"):
        return 0.5 + moved / DEFAULT_RESHARD_BYTES_PER_S
    return 0.1


__all__ = [
    "DEFAULT_CAPACITY",
    "Edge",
    "Funding",
    "InfeasibleTargetError",
    "Placement",
    "Primitive",
    "PrimitiveCostFn",
    "StateLossError",
    "TransitionDAG",
    "TransitionError",
    "TransitionExecutionError",
    "Unit",
    "UnsafeDAGError",
    "default_primitive_cost",
    "default_unit_memory",
]
