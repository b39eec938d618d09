"""Live units during the compiler's simulation: who holds each state, slot and device.

The simulation (:mod:`nereus_rl.transition.simulate`) asks three questions at
every step, and :class:`Holders` answers each from an index kept up to date as
units appear and disappear, so a step costs the same at 32 devices as at 4,096:

- which live unit an ``extend`` copies from (:meth:`Holders.pick_source`):
  per state and stage, the live holders in four preference classes, each an
  insertion-ordered dict, so round-robin within a class is O(1);
- which live unit keeps a state alive when another is destroyed
  (:meth:`Holders.anchors`): per state, the holders in four classes;
- which unit owns a stage slot on a device, and which units sit on a device
  (``slot``, ``dev_units``). Only devices some primitive touches are indexed:
  no acquisition or release looks at the others.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping

from nereus_rl.transition.types import Unit

Groups = tuple[OrderedDict, OrderedDict, OrderedDict, OrderedDict]


class Holders:
    """The live units of one simulation, indexed by state, stage slot and device.

    Source classes (which unit an extend copies from, best first): 0 an original unit
    that stays, 1 an original unit about to be split or merged, 2 a created unit that
    stays, 3 a created unit that moves on. Anchor classes (which unit keeps a state
    alive, best first): 0 a unit that stays, 1 a created target unit, 2 a unit whose
    state moves on through a split or merge, 3 a unit destroyed later.

    Arguments:
        consumer: uid -> the split or merge that consumes it.
        final: uids of the target units.
        model_stages: per model, its stages in priority order.
        touched: devices some primitive acquires or releases (only these are indexed).
        lost: lost devices.
    """

    def __init__(
        self,
        consumer: Mapping[str, int],
        final: Collection[str],
        model_stages: Mapping[str, list[str]],
        touched: Collection[int],
        lost: Collection[int],
    ) -> None:
        self.consumer, self.final, self.model_stages = consumer, final, model_stages
        self.touched, self.lostdev = frozenset(touched), lost
        self.live: dict[str, Unit] = {}
        self.cat: dict[str, tuple[int, int]] = {}
        self.slot: dict[tuple[str, int], str] = {}
        self.dev_units: dict[int, dict[str, None]] = {d: {} for d in touched if d not in lost}
        self._cache: dict[tuple[str, str, bool], tuple[tuple[Groups, Groups], ...]] = {}
        self.src_groups: dict[tuple[tuple[str, str], str], Groups] = {}
        self.anchor_groups: dict[tuple[str, str], Groups] = {}

    def _groups(self, u: Unit) -> tuple[tuple[Groups, Groups], ...]:
        """Per state of ``u``: its source groups (by stage) and its anchor groups."""
        pairs = []
        for s in u.states:
            sg = self.src_groups.get((s, u.stage))
            if sg is None:
                sg = self.src_groups[(s, u.stage)] = tuple(OrderedDict() for _ in range(4))
            ag = self.anchor_groups.get(s)
            if ag is None:
                ag = self.anchor_groups[s] = tuple(OrderedDict() for _ in range(4))
            pairs.append((sg, ag))
        out = self._cache[(u.model, u.stage, u.trains)] = tuple(pairs)
        return out

    def _index(self, u: Unit) -> None:
        uid, stage, slot, dev_units = u.uid, u.stage, self.slot, self.dev_units
        for d in u.devices:  # units on lost devices keep their other devices' slots only
            slot[(stage, d)] = uid
            du = dev_units.get(d)
            if du is not None:
                du[uid] = None

    def add_current(self, units: Iterable[Unit]) -> None:
        """Add the units live before the transition, in placement order."""
        live, cat, consumer, final = self.live, self.cat, self.consumer, self.final
        cache, untouched = self._cache, self.touched.isdisjoint
        for u in units:
            uid = u.uid
            live[uid] = u
            src_cat = 1 if uid in consumer else 0
            anchor_cat = 0 if uid in final else 2 if src_cat else 3
            cat[uid] = (src_cat, anchor_cat)
            groups = cache.get((u.model, u.stage, u.trains))
            if groups is None:
                groups = self._groups(u)
            for sg, ag in groups:
                sg[src_cat][uid] = None
                ag[anchor_cat][uid] = None
            if not untouched(u.devices):
                self._index(u)

    def add_created(self, u: Unit) -> None:
        """Add a unit a primitive just created."""
        uid = u.uid
        self.live[uid] = u
        consumed = uid in self.consumer
        src_cat = 3 if consumed else 2
        anchor_cat = 1 if uid in self.final else 2 if consumed else 3
        self.cat[uid] = (src_cat, anchor_cat)
        groups = self._cache.get((u.model, u.stage, u.trains))
        if groups is None:
            groups = self._groups(u)
        for sg, ag in groups:
            sg[src_cat][uid] = None
            ag[anchor_cat][uid] = None
        self._index(u)

    def drop(self, u: Unit) -> None:
        """Remove a unit a primitive consumed."""
        uid = u.uid
        del self.live[uid]
        src_cat, anchor_cat = self.cat.pop(uid)  # the groups it was added to
        for sg, ag in self._cache[(u.model, u.stage, u.trains)]:
            del sg[src_cat][uid]
            del ag[anchor_cat][uid]
        stage, slot, dev_units = u.stage, self.slot, self.dev_units
        for d in u.devices:
            if slot.get((stage, d)) == uid:
                del slot[(stage, d)]
            du = dev_units.get(d)
            if du is not None:
                du.pop(uid, None)

    def pick_source(self, t: Unit, commit: bool = False) -> str | None:
        """Copy source for ``t``: an original unit before a created one, one that stays
        before one about to be split or merged, the same stage before another stage of
        the same model (weights only), round-robin within each group.

        Arguments:
            t: the unit an extend creates.
            commit: move the chosen unit to the back of its group (the next extend
                prefers another source).
        Returns:
            the source's uid, or None when no live unit holds the state.
        """
        if t.trains:
            key, stages = ("optimizer", t.stage), (t.stage,)
        else:
            key = ("weights", t.model)
            stages = (t.stage, *(x for x in self.model_stages[t.model] if x != t.stage))
        src_groups = self.src_groups
        for cat in range(4):
            for st in stages:
                groups = src_groups.get((key, st))
                if groups and groups[cat]:
                    g = groups[cat]
                    uid = next(iter(g))
                    if commit:
                        g.move_to_end(uid)
                    return uid
        return None

    def anchors(self, u: Unit) -> list[tuple[tuple[str, str], str]] | None:
        """Per state of ``u``, the live unit that keeps it when ``u`` is destroyed.

        Returns:
            ``[(state, holder uid), ...]``, or None when ``u`` is the last holder of one.
        """
        uid = u.uid
        out = []
        for s in u.states:
            best = None
            for g in self.anchor_groups.get(s, ()):
                for other in g:
                    if other != uid:
                        best = other
                        break
                if best is not None:
                    break
            if best is None:
                return None
            out.append((s, best))
        return out
