"""Pricing, admitting and carrying out one move of the adaptation loop (split from
trainer_adapt).

:func:`primitive_seconds` and :func:`compile_priced` price a transition as the trainer
runs it (a DAG of EMU primitives on devices the stages share). :func:`admit_move`
prices the chosen candidate's move and asks admission, with a forecast no longer than
the steps the run has left and the running plan's measured step noise. :func:`execute_move`
runs a move admission took, measures it and completes its decision row: what ran,
what fell back, what the cost model learned. A move cut short by a worker death gets
its row too (``interrupted``, ``cause``), logged before the error goes on to the
trainer's recovery, which logs its own row beside it.
"""

from __future__ import annotations

import time

from nereus_rl.core.globalplan import GlobalPlan
from nereus_rl.costmodel.costmodel import CostModel, UnitLayout
from nereus_rl.runtime import RemoteError, WorkerLostError, WorkerTimeoutError
from nereus_rl.trainer.fallback import observe_fallback, stagewise_cost
from nereus_rl.transition import TransitionError
from nereus_rl.transition.compile import compile_transition


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


def admit_move(adapter, plan: GlobalPlan, cand: GlobalPlan, wl, trig, la, steps_left: int, row):
    """Price the move ``plan -> cand`` (its DAG, calibrated) and ask admission whether
    to take it; fills ``row`` with the decision and what it rested on.

    Arguments:
        adapter: the :class:`~nereus_rl.trainer.adapt.adapter.Adapter`.
        wl: the next step's workload; trig: the trigger; la: the lookahead's choice
            (None: lookahead not used); steps_left: steps the run runs after this one.

    Returns:
        (dag or None, the model's transition seconds, whether to take the move).
    """
    try:
        dag, raw_cost = adapter.compile(plan, cand)
        dag_note = None
    except TransitionError as e:
        # Compiled with the trainer's execution model (shared devices, no memory cap)
        # this is not expected; should it happen, a running job must not stop over
        # pricing: price the change as one extend per new unit and log why.
        dag, dag_note = None, f"DAG not compiled: {e}"
        raw_cost = stagewise_cost(adapter.cm, adapter.mspec, plan, cand)
    # Priced as transitions have measured on this job so far (TransitionCalibration):
    # the model's price plus the learned excess, and no less than this job's measured
    # seconds per primitive for as many primitives (floor_s)
    n_prims = len(dag.primitives) if dag is not None else 0
    floor = adapter.calibration.floor_s(n_prims)
    cost = max(adapter.calibration.price(raw_cost), floor)
    # The trigger's forecast (steps to its next crossing) is capped by the steps the
    # run has left: a signal flat for "200 steps" in a 10-step run let small savings
    # repay a move they never could (the cap is logged beside the forecast).
    fc = adapter.controller.forecast(trig.signal)
    # None until the running plan has the steps its noise needs: no opportunistic move
    # rests on one or two steps of a fresh plan (admission declines it)
    noise = adapter.noise.noise_s(plan) if adapter.noise.known(plan) else None
    devices = sorted(adapter.trainer.device_worker)
    dec = adapter.admission.decide(
        plan,
        cand,
        wl,
        forecast_steps=min(fc.steps, float(steps_left)),
        transition_cost=cost,
        available_devices=devices,
        trigger=trig.reason,
        candidate_over_in=None if la is None else la.over_at,
        current_over_in=None if la is None else la.current_over_at,
        forced_move_s=0.0 if la is None else la.forced_move_s,
        noise_s=noise,
    )
    always = adapter.cfg.admission == "always"
    taken = dec.taken or always
    row.update(
        taken=taken,
        path=dec.path,
        reason=dec.reason if dec.taken or not always else "replan on every trigger",
        predicted_saving_s=dec.saving_per_step_s,
        forecast_steps=dec.forecast_steps,
        signal_forecast_steps=fc.steps,
        steps_left=steps_left,
        step_noise_s=noise,
        predicted_transition_s=cost,
        predicted_transition_model_s=raw_cost,
        transition_excess_s=adapter.calibration.excess_s,
        transition_floor_s=floor,
        model_tolerance=adapter.tolerance.value,
        tie_margin=adapter.tie_margin(),
        predicted_forced_move_s=dec.forced_move_s,
        primitives=[f"{p.kind}:{p.stage}" for p in dag.primitives] if dag else [],
    )
    if dag_note:
        row["dag_note"] = dag_note
    return dag, raw_cost, taken


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
        # the rollout sent ahead of the next step ends on the current plan: not the move's
        tr.finish_ahead()
        t0 = time.perf_counter()
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
    # per primitive of the DAG, as floor_s prices a move (fallback stages included)
    adapter.calibration.observe(float(raw_cost), seconds, len(dag.primitives) if dag else 0)
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
