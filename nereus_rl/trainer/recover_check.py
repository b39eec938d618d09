"""Which live units still hold their stage's state when a death cut a transition short.

A unit adopted from the trainer (or bound to a stage model by a rebind) has no
bytes of its own: each of its ranks reads the stage model the worker holds *now*.
A transition changes those models in two places, and a death in either leaves
the survivors' models on two layouts:

* the rebind of the live primitives' stages (``rl.rebind``): each member rebuilds
  the stage model from its new unit and binds that unit to it. Every unit still
  live after the DAG is a target unit (the DAG destroyed the others), and a
  target unit's rank reads either its received tensors or a model loaded from
  them, so these units all stay sound; the check below confirms it per rank.
* the fallback's per-stage reshard (``rl.move``, replace): a member of the new
  layout swaps its stage model for the new layout's once its bytes arrived, and a
  source outside it drops the model. The stage's old units, still adopted, then
  read the new layout's shards (or nothing) on those ranks: they are unsound
  where the rank's place differs, and the units of the new layout are sound where
  every member finished the move.

:func:`check_units` asks every surviving worker (``rl.recovery_view``), per live
unit, whether its rank's piece is what the unit claims: a unit holding tensors of
its own is sound; a unit read through a stage model is sound when that model puts
the rank at the same (tp, pp) place of the same (tp, pp) degrees (the stage's dp
replicas hold the same bytes at each place). Unsound units are forgotten. On the
first recovery round (the stage models' group numbering is still the current
default group's), the units of the layouts the models are on now are adopted
where every member is alive and on that layout and no sound unit of the stage
sits on them, so a stage whose fallback move finished on the survivors recovers
from its new layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nereus_rl.runtime.context import WorkerContext, register

if TYPE_CHECKING:  # (workers import this module for its command: they need neither)
    from nereus_rl.trainer.group import WorkerGroup
    from nereus_rl.trainer.units import TrainerUnits

MODULE = "nereus_rl.trainer.recover_check"


def _same_place(entry: dict[str, Any], layout, rank: int) -> bool:
    """Does this rank's stage model hold the shard ``layout`` puts on ``rank``?"""
    g = entry["model"].groups
    _, p, t = layout.coords(rank)
    return (g.tp_size, g.pp_size, g.tp_rank, g.pp_rank) == (layout.tp, layout.pp, t, p)


@register("rl.recovery_view")
def recovery_view(ctx: WorkerContext, uids_by_rank: dict[int, list[int]]) -> dict[str, Any]:
    """This worker's verdict on its live units, and the layouts of its stage models.

    Arguments:
        uids_by_rank: worker rank -> the live units with a shard there (each worker
            reads its own entry).

    Returns:
        ``{"unsound": [uid, ...], "bound": [uid, ...], "descs": {stage: desc}}``: the
        units whose piece here is wrong or missing; the sound ones read through the
        stage model; the layout of each stage model held here.
    """
    from nereus_rl.emu.worker import BoundState, units_of

    held = units_of(ctx)
    stages = ctx.state.get("rl", {}).get("stages", {})
    unsound, bound = [], []
    for uid in uids_by_rank.get(ctx.rank, []):
        u = held.get(uid)
        if u is None:  # never committed here: cannot be read
            unsound.append(uid)
            continue
        if not isinstance(u["tensors"], BoundState):
            continue  # bytes of its own (received by a primitive): sound
        entry = stages.get(u["stage"])
        if (
            entry is None
            or entry.get("model") is None
            or not _same_place(entry, u["layout"], ctx.rank)
        ):
            unsound.append(uid)
        else:
            bound.append(uid)
    descs = {s: e["desc"] for s, e in stages.items()}
    return {"unsound": unsound, "bound": bound, "descs": descs}


def check_units(
    group: WorkerGroup, units: TrainerUnits, adopt_layouts: bool
) -> dict[str, list[str]]:
    """Forget the live EMU units that do not hold their stage's state on every
    surviving rank; with ``adopt_layouts``, adopt the units of the layouts the
    surviving stage models are on where no sound unit covers them (module docstring).

    Arguments:
        group: the run's workers (still the default group's that built the stage models
            when ``adopt_layouts``).
        units: the run's EMU units.
        adopt_layouts: map the models' layouts (default-group ranks) to workers.

    Returns:
        ``{"unsound": [repr of each forgotten unit], "adopted": [repr of each adopted],
        "readable": [the live units read through the stage models on every rank]}``
        (the per-stage reshard, which reads the models, can start from those).

    Raises:
        WorkerLostError (and the driver's other errors): a worker died meanwhile.
    """
    m = units.emus
    driver = group.driver
    lost = set(driver.check_liveness())
    by_rank: dict[int, list[int]] = {}
    for u in m.units():
        for r in u.ranks:
            if r not in lost:
                by_rank.setdefault(r, []).append(u.uid)
    workers = [w for w in group.workers if w not in lost]
    driver.import_module(MODULE)  # (joiners import it too)
    views = driver.call(workers, "rl.recovery_view", by_rank)
    bad = {uid for v in views.values() for uid in v["unsound"]}
    gone = [u for u in m.units() if u.uid in bad]
    if gone:
        m.forget(gone)
    adopted = []
    if adopt_layouts:
        adopted = _adopt_layouts(group, units, views, lost)
    bound = {(w, uid) for w, v in views.items() for uid in v["bound"]}
    readable = [u for u in m.units() if all((r, u.uid) in bound for r in u.ranks)]
    return {
        "unsound": [repr(u) for u in gone],
        "adopted": [repr(u) for u in adopted],
        "readable": readable + adopted,
    }


def _adopt_layouts(
    group: WorkerGroup, units: TrainerUnits, views: dict[int, dict[str, Any]], lost: set[int]
) -> list:
    m = units.emus
    out = []
    seen: set[tuple[str, tuple[int, ...]]] = set()
    for w, v in sorted(views.items()):
        for stage, desc in v["descs"].items():
            if stage not in m.stages:
                continue
            for unit in desc["units"]:
                ranks = tuple(group.workers[r] for r in unit)
                if (stage, ranks) in seen or w not in ranks:
                    continue
                seen.add((stage, ranks))
                if any(r in lost or views.get(r, {}).get("descs", {}).get(stage) != desc
                       for r in ranks):  # fmt: skip
                    continue  # a member died or is on another layout
                if any(set(ranks) & set(u.ranks) for u in m.units(stage)):
                    continue  # a sound unit of the stage is read there already
                out.append(units.adopt_unit(stage, ranks, tp=desc["tp"], pp=desc["pp"]))
    return out
