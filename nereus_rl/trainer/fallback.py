"""Stages whose transition primitives cannot run live fall back to one nereus_comm
reshard of the whole stage: their price and their measurements (used by
:mod:`nereus_rl.trainer.adapt.adapter`)."""

from __future__ import annotations

from typing import Any

from nereus_rl.core.globalplan import GlobalPlan
from nereus_rl.costmodel.costmodel import CostModel, CostModelError, UnitLayout


def stagewise_cost(cm: CostModel, mspec, old: GlobalPlan, new: GlobalPlan) -> float:
    """Predicted seconds of moving every changed stage by one Extend per new unit (the
    per-stage reshard a stage falls back to; also the price when no DAG compiles)."""
    return sum(pc.seconds for _, _, _, pc in _unit_extends(cm, mspec, old, new, None))


def _unit_extends(cm: CostModel, mspec, old: GlobalPlan, new: GlobalPlan, stages):
    """(new stage, its old stage, new unit, priced Extend) for every unit of every stage
    that changed (of ``stages`` only, unless None): the Extend from the old stage's first
    unit that the fallback's reshard is priced as."""
    for sp in new.stages:
        src = old.stage(sp.stage)
        if sp == src or (stages is not None and sp.stage not in stages):
            continue
        for u in sp.units:
            pc = cm.primitive_cost(
                "extend",
                mspec,
                trains=sp.trains,
                src=(UnitLayout(src.tp, src.pp, tuple(src.units[0])),),
                dst=(UnitLayout(sp.tp, sp.pp, tuple(u)),),
                dtype="fp32",
            )
            yield sp, src, u, pc


def observe_fallback(
    cm: CostModel,
    mspec,
    old: GlobalPlan,
    new: GlobalPlan,
    row: dict[str, Any],
    stages: set[str],
    seconds: float,
    moved: int,
) -> None:
    """Feed the per-stage reshards of fallback ``stages`` to the primitive estimates.

    (Live primitives are fed by the EMUManager, one record each; this covers only
    the stages that fell back, so no measurement is counted twice.)
    The reshard reports the bytes sent in all, not per device; the critical path
    (bytes of the busiest device, summed over the stages moved one after another)
    is taken as the measured total times the predicted share of it, from the same
    Extend per new unit that ``stagewise_cost`` prices. The communicator setup
    is not measured there, so the model's estimate of it is subtracted. ``row`` (the
    decision's log row) gets the refined p2p efficiency, or the error if the model
    could not read the measurement.
    """
    total = crit = 0.0
    units = ranks = 0
    devs: set[int] = set()
    for _, src, u, pc in _unit_extends(cm, mspec, old, new, stages):
        total += pc.bytes_moved
        crit += pc.max_bytes_per_device
        units += 1
        ranks += len(u)
        devs |= set(u) | set(src.units[0])
    if units == 0 or not seconds > 0:
        return
    crit = min(float(moved), moved * crit / total) if total > 0 else 0.0
    tier = "intra" if cm.cluster.tier(devs) is cm.cluster.intra else "inter"
    try:
        cm.observe_primitive(
            "reshard", bytes_moved=moved, max_bytes_per_device=crit, tier=tier,
            seconds=seconds, setup_s=None, new_units=units, new_ranks=ranks,
            primitives=units,
        )  # fmt: skip
    except CostModelError as e:  # a measurement the model cannot read: keep training
        row["costmodel_feedback_error"] = str(e)
        return
    row["costmodel_p2p_efficiency"] = float(cm.efficiency("p2p:" + tier))
