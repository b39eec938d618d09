"""Pricing and carrying out one move of the adaptation loop (split from trainer_adapt).

:func:`primitive_seconds` and :func:`compile_priced` price a transition as the trainer
runs it (a DAG of EMU primitives on devices the stages share). :func:`execute_move`
runs a move admission took, measures it and completes its decision row: what ran,
what fell back, what the cost model learned. A move cut short by a worker death gets
its row too (``interrupted``, ``cause``), logged before the error goes on to the
trainer's recovery, which logs its own row beside it.
"""

from __future__ import annotations

import time

from nereus_rl.costmodel import CostModel, UnitLayout
from nereus_rl.globalplan import GlobalPlan
from nereus_rl.runtime import RemoteError, WorkerLostError, WorkerTimeoutError
from nereus_rl.trainer_fallback import observe_fallback
from nereus_rl.transition_compile import compile_transition


def primitive_seconds(cm: CostModel, mspec, prim) -> float:
    """The cost model's predicted seconds for one transition primitive (fp32 state).

    A primitive the model cannot price costs the cluster's fixed primitive overhead:
    pricing must never stop a running job.
    """
    try:

        def ul(u):
            return UnitLayout(u.tp, u.pp, tuple(u.devices))

        return cm.primitive_cost(
            prim.kind,
            mspec,
            trains=any(u.trains for u in prim.inputs + prim.outputs),
            src=tuple(ul(u) for u in prim.inputs if prim.kind != "extend")
            + ((ul(prim.source),) if prim.kind == "extend" and prim.source else ()),
            dst=tuple(ul(u) for u in prim.outputs),
            dtype="fp32",
        ).seconds
    except Exception:
        return cm.cluster.primitive_overhead_s


def compile_priced(cm: CostModel, mspec, devices, current: GlobalPlan, target: GlobalPlan):
    """The transition DAG current -> target as the trainer runs it, and its predicted
    completion seconds (stages share devices, no memory cap: see ``Adapter.compile``)."""
    from nereus_rl.transition import predicted_completion_time

    def cost(prim):
        return primitive_seconds(cm, mspec, prim)

    dag = compile_transition(
        current,
        target,
        devices=sorted(devices),
        capacity=float("inf"),
        cost_fn=cost,
        # The trainer's stages share devices, and a stage's old and new units may too
        # (EMUManager(shared_devices=True)): model that, not one unit per device.
        stage_slots=False,
    )
    return dag, predicted_completion_time(dag, cost)


def execute_move(
    adapter, plan: GlobalPlan, cand: GlobalPlan, dag, step: int, raw_cost: float, row: dict
) -> float:
    """Run the transition ``plan -> cand`` admission took at ``step``'s boundary and fill
    ``row`` (the decision's log row) with what it did; returns its measured seconds.

    A worker death during it (the runtime's errors) is logged first, as the decision's
    row with ``interrupted=True`` and ``cause``, then raised for the trainer's recovery
    (which logs a recovery row of its own); the transition's time is then not fed to
    the calibration (it did not complete).
    """
    tr = adapter.trainer
    t0 = time.perf_counter()
    try:
        run = tr.transition(cand, dag, step + 1)
    except (WorkerLostError, WorkerTimeoutError, RemoteError) as e:
        row.update(
            measured_transition_s=time.perf_counter() - t0,
            interrupted=True,
            # (a RemoteError's message carries the worker's traceback: its first line)
            cause=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
            lost_workers=list(getattr(e, "ranks", ()) or ()),
        )
        adapter._log(row)
        raise
    seconds = time.perf_counter() - t0
    row["measured_transition_s"] = seconds
    row["interrupted"] = False
    adapter.calibration.observe(float(raw_cost), seconds)
    row.update(
        bytes_moved=run.bytes_moved,
        executed_primitives=run.primitives,
        primitive_s=run.primitive_s,
        rebind_s=run.rebind_s,
        fallbacks=len(run.fallback_stages),
        fallback_stages=run.fallback_stages,
    )
    if run.execution is not None:
        row["execution"] = repr(run.execution)
    if run.fallback_stages:
        observe_fallback(
            adapter.cm,
            adapter.mspec,
            plan,
            cand,
            row,
            set(run.fallback_stages),
            run.fallback_s,
            run.fallback_bytes,
        )
    row["costmodel_primitives_observed"] = adapter.cm.primitives_seen()
    devs = plan.devices | cand.devices
    tier = "intra" if adapter.cluster.tier(devs) is adapter.cluster.intra else "inter"
    row.setdefault("costmodel_p2p_efficiency", float(adapter.cm.efficiency("p2p:" + tier)))
    adapter.controller.plan_changed()
    return seconds
