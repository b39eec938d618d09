"""Pricing and carrying out one move of the adaptation loop.

:func:`primitive_seconds` and :func:`compile_priced` price a transition as the trainer
runs it (a DAG of EMU primitives on devices the stages share); :func:`price_move` prices
the move to a chosen candidate. :func:`execute_move` runs a move admission took, measures
it, feeds what it measured to the cost model and the transition calibration, and reports
an :class:`~nereus_rl.policy.decision.Outcome` to its caller, which logs it with its
Decision. A move cut short by a worker death has an outcome too (``interrupted``,
``cause``); the caller logs it before the error goes on to the trainer's recovery,
which logs its own row beside it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from nereus_rl.core.globalplan import GlobalPlan
from nereus_rl.costmodel.calibration import TransitionCalibration
from nereus_rl.costmodel.costmodel import CostModel, UnitLayout
from nereus_rl.policy.decision import Outcome
from nereus_rl.runtime import RemoteError, WorkerLostError, WorkerTimeoutError
from nereus_rl.trainer.fallback import observe_fallback, stagewise_cost
from nereus_rl.transition import TransitionError, predicted_completion_time
from nereus_rl.transition.compile import compile_transition


class MoveHost(Protocol):
    """The trainer's process side as the adaptation loop uses it.

    Attributes:
        plan: the running plan (None before the run starts).
        device_worker: plan device id -> worker (empty before the workers exist).
    """

    plan: GlobalPlan | None
    device_worker: Mapping[int, int]

    def finish_ahead(self) -> None:
        """Wait for the rollouts sent ahead of their step (they end on the running plan)."""

    def transition(self, new: GlobalPlan, dag, step: int):
        """Move the state to ``new`` (``dag``: its transition DAG, or None) before
        ``step``; returns the :class:`~nereus_rl.trainer.units.TransitionRun`."""

    def log_decision(self, row: dict[str, Any]) -> None:
        """Record one decisions.jsonl row."""


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


def compile_priced(
    cm: CostModel, mspec, devices: Iterable[int], current: GlobalPlan, target: GlobalPlan
):
    """The transition DAG current -> target on plan ``devices`` as the trainer runs it
    (stages share devices, no memory cap), and its predicted completion seconds."""

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


def price_move(cm: CostModel, mspec, devices: Iterable[int], plan: GlobalPlan, cand: GlobalPlan):
    """The move ``plan -> cand`` as the trainer would run it, priced by the cost model.

    Returns:
        (its DAG or None, the model's seconds, why no DAG was compiled or None). Compiled
        with the trainer's execution model (shared devices, no memory cap) a DAG is
        expected; should none compile, a running job must not stop over pricing: the
        change is priced as one Extend per new unit.
    """
    try:
        dag, raw_cost = compile_priced(cm, mspec, devices, plan, cand)
        return dag, raw_cost, None
    except TransitionError as e:
        return None, stagewise_cost(cm, mspec, plan, cand), f"DAG not compiled: {e}"


def execute_move(
    host,
    cm: CostModel,
    mspec,
    calibration: TransitionCalibration,
    plan: GlobalPlan,
    cand: GlobalPlan,
    dag,
    step: int,
    raw_cost: float,
) -> tuple[Outcome, Exception | None]:
    """Run the transition ``plan -> cand`` admission took at ``step``'s boundary.

    Arguments:
        host: the trainer's process side (``finish_ahead``, ``transition``; see
            :class:`~nereus_rl.trainer.adapt.adapter.MoveHost`).
        cm, mspec: the cost model (fed the fallback reshards' measurement) and the model.
        calibration: fed the move's measured seconds against ``raw_cost``, its price.
        dag: the move's DAG (None: per-stage reshards).

    Returns:
        The move's :class:`~nereus_rl.policy.decision.Outcome`, and the runtime error
        that cut it short (a worker died: the caller logs the outcome, then raises it
        for the trainer's recovery; the move's time is then not fed to the calibration,
        as it did not complete) or None.
    """
    t0 = time.perf_counter()
    try:
        # the rollout sent ahead of the next step ends on the current plan: not the move's
        host.finish_ahead()
        t0 = time.perf_counter()
        run = host.transition(cand, dag, step + 1)
    except (WorkerLostError, WorkerTimeoutError, RemoteError) as e:
        first = str(e).splitlines()[0] if str(e) else ""  # (a RemoteError's: its traceback)
        outcome = Outcome(
            measured_s=time.perf_counter() - t0,
            interrupted=True,
            cause=f"{type(e).__name__}: {first}",
            lost_workers=tuple(getattr(e, "ranks", ()) or ()),
        )
        return outcome, e
    seconds = time.perf_counter() - t0
    # per primitive of the DAG, as floor_s prices a move (fallback stages included)
    calibration.observe(float(raw_cost), seconds, len(dag.primitives) if dag else 0)
    learned: dict = {}
    if run.fallback_stages:
        observe_fallback(
            cm, mspec, plan, cand, learned, set(run.fallback_stages), run.fallback_s,
            run.fallback_bytes,
        )  # fmt: skip
    learned["costmodel_primitives_observed"] = cm.primitives_seen()
    devs = plan.devices | cand.devices
    tier = "intra" if cm.cluster.tier(devs) is cm.cluster.intra else "inter"
    learned.setdefault("costmodel_p2p_efficiency", float(cm.efficiency("p2p:" + tier)))
    outcome = Outcome(
        measured_s=seconds,
        interrupted=False,
        bytes_moved=run.bytes_moved,
        executed_primitives=tuple(run.primitives),
        primitive_s=run.primitive_s,
        rebind_s=run.rebind_s,
        fallback_stages=dict(run.fallback_stages),
        execution=None if run.execution is None else repr(run.execution),
        learned=learned,
    )
    return outcome, None
