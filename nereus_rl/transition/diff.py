"""Plan diff: which current units stay, split, merge, re-lay-out, extend or go.

The diff maps the current units onto the target plan, moving as little state as
possible: a unit whose layout and devices already match stays; two units whose
devices make up one target unit are merged in place; one unit whose devices make
up two target units is split in place; a unit re-laid-out on the same devices is
split into halves and merged back; every other target unit is an ``extend`` (a
copy from a live unit of the same model) and every other current unit a
``destroy``. It also refuses a change that would lose state.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from functools import partial
from itertools import compress, count, filterfalse, islice, repeat
from operator import is_

from nereus_rl.core.globalplan import GlobalPlan, fmt_devices
from nereus_rl.transition.types import Placement, StateLossError, Unit


@dataclass(frozen=True)
class TransitionDiff:
    """Which current units stay, split, merge, relayout, extend or go.

    Attributes:
        kept: current units that stay as they are (also target units).
        splits: ``(unit, (half_a, half_b))``: one unit split in place into two target units.
        merges: ``((unit_a, unit_b), unit)``: two units merged in place into one target unit.
        relayouts: ``(unit, (half_a, half_b), target_unit)``: same devices, new layout,
            through a split into halves and a merge.
        extends: target units created by copying state from a live unit.
        destroys: current units no target unit keeps.
        lost: current units on lost devices (their state there is gone).
        target: the target placement (kept units keep their uid).
    """

    kept: tuple[Unit, ...]
    splits: tuple[tuple[Unit, tuple[Unit, Unit]], ...]
    merges: tuple[tuple[tuple[Unit, Unit], Unit], ...]
    relayouts: tuple[tuple[Unit, tuple[Unit, Unit], Unit], ...]
    extends: tuple[Unit, ...]
    destroys: tuple[Unit, ...]
    lost: tuple[Unit, ...]
    target: Placement

    def __repr__(self) -> str:
        return (
            f"TransitionDiff(kept {len(self.kept)}, split {len(self.splits)}, "
            f"merge {len(self.merges)}, relayout {len(self.relayouts)}, "
            f"extend {len(self.extends)}, destroy {len(self.destroys)}, lost {len(self.lost)})"
        )


def _half_layout(u: Unit) -> tuple[int, int]:
    return (u.tp // 2, u.pp) if u.tp % 2 == 0 else (u.tp, u.pp // 2)


def _halves(devices: tuple[int, ...], by_device: dict[int, Unit]) -> tuple[Unit, Unit] | None:
    """The two units of ``by_device`` whose devices are exactly ``devices``, half each.

    The first half holds ``devices[0]``; the other holds the smallest remaining device.
    Used both ways: two current units that merge into one target unit, and two target
    units that one current unit splits into.
    """
    whole = set(devices)
    a = by_device.get(devices[0])
    if a is None or 2 * len(a.devices) != len(whole) or not whole.issuperset(a.devices):
        return None
    rest = whole.difference(a.devices)
    b = by_device.get(min(rest))
    if b is None or set(b.devices) != rest:
        return None
    return a, b


def _pair_halves(
    units: list[Unit], by_device: dict[int, Unit]
) -> tuple[list[tuple[Unit, tuple[Unit, Unit]]], list[Unit]]:
    """Each of ``units`` whose devices are exactly two entries of ``by_device`` (see
    :func:`_halves`), paired with them; the paired entries leave ``by_device``, so no
    unit is used twice. Returns the pairs and the units left unpaired, in order."""
    pairs, left = [], []
    for u in units:
        halves = _halves(u.devices, by_device)
        if halves is None:
            left.append(u)
            continue
        pairs.append((u, halves))
        for d in u.devices:
            del by_device[d]
    return pairs, left


def diff_plans(
    current: Placement | GlobalPlan, target: GlobalPlan, *, lost_devices: Collection[int] = ()
) -> TransitionDiff:
    """Map the current units onto ``target``, keeping every unit that already fits.

    Arguments:
        current: the live units (or the plan they were made from).
        target: the plan to reach.
        lost_devices: devices that died; units on them are lost.
    Returns:
        the diff.
    Raises:
        StateLossError: some state (a model's weights, a training stage's optimizer
            state) would have no holder: the target plan drops it, or all its holders
            are on lost devices.
    """
    cur = current if isinstance(current, Placement) else Placement.from_plan(current)
    lost_set = frozenset(lost_devices)
    if lost_set:
        lost = tuple(u for u in cur.units if lost_set.intersection(u.devices))
        alive = [u for u in cur.units if not lost_set.intersection(u.devices)]
    else:
        lost, alive = (), list(cur.units)

    # Every state must survive: held by a live unit now, and by some target unit. States
    # depend only on (stage, model, trains): check each kind of unit once, not each unit.
    def kind_states(units) -> set[tuple[str, str]]:
        kinds = {(u.stage, u.model, u.trains) for u in units}
        return {s for k in kinds for s in Unit("", *k, 1, 1, ()).states}

    target_states = {
        s for sp in target.stages for s in Unit("", sp.stage, sp.model, sp.trains, 1, 1, ()).states
    }
    alive_states = kind_states(alive)
    for kind in dict.fromkeys((u.stage, u.model, u.trains) for u in cur.units):
        for s in Unit("", *kind, 1, 1, ()).states:
            if s not in target_states:
                holders = [v for v in cur.units if s in v.states]
                raise StateLossError(
                    f"target plan keeps no holder of {s[0]} of {s[1]!r}: destroying "
                    f"{holders} would lose it; keep a stage with that state in the target plan"
                )
    for sp in target.stages:
        for s in Unit("", sp.stage, sp.model, sp.trains, 1, 1, ()).states:
            if s not in alive_states:
                holders = [v for v in lost if s in v.states]
                where = (
                    f"was held only by {holders} on lost devices {fmt_devices(sorted(lost_set))}"
                    if holders
                    else "is held by no current unit"
                )
                raise StateLossError(
                    f"stage {sp.stage!r} needs {s[0]} of {s[1]!r}, which {where}; "
                    "restore it from a checkpoint before this transition"
                )

    cur_uids = {u.uid for u in cur.units}
    make = partial(tuple.__new__, Unit)  # Unit's own __new__ adds a Python call per unit
    kept: list[Unit] = []
    splits: list[tuple[Unit, tuple[Unit, Unit]]] = []
    merges: list[tuple[tuple[Unit, Unit], Unit]] = []
    relayouts: list[tuple[Unit, tuple[Unit, Unit], Unit]] = []
    extends: list[Unit] = []
    destroys: list[Unit] = []
    final: list[Unit] = []
    by_stage: dict[str, list[Unit]] = {}
    for u in alive:
        by_stage.setdefault(u.stage, []).append(u)

    for sp in target.stages:
        rem = by_stage.pop(sp.stage, [])
        by_layout = {(u.tp, u.pp, u.devices): u for u in rem}
        distinct = len(by_layout) == len(rem)
        # Target units whose layout and devices a current unit already has stay (lookups
        # and filters in C: this runs once per unit of the cluster).
        found = list(map(by_layout.pop, zip(repeat(sp.tp), repeat(sp.pp), sp.units), repeat(None)))
        here = list(filter(None, found))
        kept += here
        final += here
        todo = list(compress(sp.units, map(is_, found, repeat(None))))
        if distinct:  # no two units share a layout: the ones not kept, in order
            rem = list(by_layout.values())
        else:
            rem = [u for u in rem if (u.tp, u.pp, u.devices) in by_layout]
        # New units are "<stage>#<k>" for the smallest k no current unit uses.
        names = map(f"{sp.stage}#".__add__, map(str, count()))
        uids = islice(filterfalse(cur_uids.__contains__, names), len(todo))
        same = (repeat(x) for x in (sp.stage, sp.model, sp.trains, sp.tp, sp.pp))
        new: list[Unit] = list(map(make, zip(uids, *same, todo)))
        final.extend(new)

        # Relayout in place: same device set, other layout.
        if rem:
            by_set = {frozenset(u.devices): u for u in rem}
            left: list[Unit] = []
            for t in new:
                u = by_set.get(frozenset(t.devices))
                if u is not None and len(u.devices) % 2 == 0:
                    del by_set[frozenset(u.devices)]
                    tp, pp = _half_layout(u)
                    k = len(u.devices) // 2
                    ha = Unit(f"{u.uid}a", u.stage, u.model, u.trains, tp, pp, u.devices[:k])
                    hb = Unit(f"{u.uid}b", u.stage, u.model, u.trains, tp, pp, u.devices[k:])
                    relayouts.append((u, (ha, hb), t))
                else:
                    left.append(t)
            rem = list(by_set.values())
            new = left

        # Merge: two current units whose devices make up one target unit. A target unit
        # has tp * pp distinct devices, so only a current unit half that size can merge.
        size = sp.tp * sp.pp
        if new and any(2 * len(u.devices) == size for u in rem):
            dev_u = {d: u for u in rem for d in u.devices}
            paired, new = _pair_halves(new, dev_u)
            merges.extend((halves, t) for t, halves in paired)
            rem = [u for u in rem if u.devices[0] in dev_u]

        # Split: one current unit whose devices make up two target units (so it has at
        # least twice their size).
        if new and any(len(u.devices) >= 2 * size for u in rem):
            dev_t = {d: t for t in new for d in t.devices}
            paired, left_u = _pair_halves(rem, dev_t)
            splits.extend(paired)
            extends.extend(t for t in new if t.devices[0] in dev_t)
            destroys.extend(left_u)
        else:
            extends.extend(new)
            destroys.extend(rem)
    for rest_units in by_stage.values():  # stages the target drops
        destroys.extend(rest_units)

    return TransitionDiff(
        tuple(kept),
        tuple(splits),
        tuple(merges),
        tuple(relayouts),
        tuple(extends),
        tuple(destroys),
        lost,
        Placement(tuple(final)),
    )
