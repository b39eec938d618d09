"""Recovery of a run after a worker died: the trainer's :meth:`Trainer.recover
<nereus_rl.trainer.trainer.Trainer.recover>` (kept apart from the RL loop it interrupts).

A recovery runs in rounds. Each round takes the trainer's workers that are lost
*now* (losses recovered from earlier in the run are no longer the trainer's
workers, so they never count again), drops their devices from the device ->
worker map, joins the survivors in a new default group, plans over the
remaining devices and rebuilds every stage from the units that lost no shard.
If another worker dies while a round runs (re-forming the group, an Extend, the
rebind), the round stops where it is and the next one starts over the
survivors: every EMU unit still live holds its stage's whole state (a
primitive commits only after all its ranks succeeded, and the recovery's rebind
loads each unit's own bytes), so the next round extends from whatever is
intact, including units the cut-short round made.

A death may also cut a transition short (the boundary's, or an async weight sync):

* during its live primitives: the models are untouched until the rebind, and
  every live unit (the current plan's, or one a primitive made) holds the state;
* during its rebind: the DAG ended, so every live unit is a target unit, each rank
  of which reads its received tensors or a model loaded from them;
* during its fallback reshard (``rl.move`` of a whole stage): the survivors that
  finished swapped their stage model for the new layout's, so the stage's old
  units read the wrong shards there.

So each round first asks the survivors which live units hold, on every rank, the
shards they claim (:mod:`nereus_rl.trainer.recover_check`), forgets the others,
and on the first round adopts the units of the layouts the models are on now
(the finished part of a fallback reshard). The models may then be off the
current plan, so the per-stage reshard (``transitions="reshard"``, or the EMU
recovery refused) reads them through the units found read through them
(``_model_sources``), not as that plan's. In
async mode a weight sync cut short leaves rollout units with different weights
and the next rollout runs before any other sync, so a round ends with a weight
sync on the new plan (``recovery_rounds[i]["weight_sync"]``). The decision log's
recovery row says what was cut short (``interrupted``) and which units were
forgotten (``unsound_units``) or adopted (``adopted_units``).

Tests inject faults through ``on_phase`` (the trainer's ``on_recovery_phase``, None
by default), called as ``hook(phase, attempt)`` at each phase of a round:
``"start"`` (devices dropped, group not re-formed), ``"world"`` (new group
formed, nothing planned), and, on the EMU path, ``"destroyed"`` (broken units
destroyed) and ``"extended"`` (extends done, rebind not sent), from
:meth:`TrainerUnits.recover <nereus_rl.trainer.units.TrainerUnits.recover>`.
Deaths inside a transition are injected on the worker side (a worker armed to
die right after a command, ``tests/support/worker_faults.py``) or by the test's own
boundary / weight sync (tests/rl/trainer/test_trainer_recovery.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch

from nereus_rl.core.globalplan import GlobalPlan, StagePlan
from nereus_rl.emu.types import EMUError, EMUStateLostError
from nereus_rl.models.model import ModelConfig
from nereus_rl.policy.decision import Decision, Outcome, Recovery
from nereus_rl.runtime import RemoteError, WorkerLostError, WorkerTimeoutError
from nereus_rl.trainer.config import TrainConfig
from nereus_rl.trainer.group import WorkerGroup, sync_weights
from nereus_rl.trainer.recover_check import check_units
from nereus_rl.trainer.snapshot import DiskCheckpoint, Snapshots
from nereus_rl.trainer.units import TrainerUnits

_LOG = logging.getLogger("nereus_rl.trainer.trainer")

# Seconds to wait for a death to show after an error that may come from one (a gloo
# peer's closed connection can reach a survivor before the driver sees the death).
NOTICE_S = 10.0
_CUT = (WorkerLostError, WorkerTimeoutError, RemoteError, EMUError, EMUStateLostError)


class RecoveryStateLostError(RuntimeError):
    """A stage has no unit left that lost no shard: its state is gone from memory."""


@dataclass
class _Recovery:
    """What a recovery works on: the run's workers and units, its options, and the
    plan whose state the stage models hold (the current plan; after an async round's
    weight sync, the new one)."""

    group: WorkerGroup
    units: TrainerUnits | None
    plan: GlobalPlan
    cfg: TrainConfig
    mc: ModelConfig
    plan_for: Callable[[list[int]], GlobalPlan]
    on_phase: Callable[[str, int], None] | None

    def phase(self, phase: str, attempt: int) -> None:
        if self.on_phase is not None:
            self.on_phase(phase, attempt)


def _wait_lost(group: WorkerGroup, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        lost = group.lost()
        if lost or time.monotonic() > deadline:
            return lost
        time.sleep(0.05)


def recover(
    group: WorkerGroup,
    units: TrainerUnits | None,
    plan: GlobalPlan,
    step: int,
    error: Exception,
    *,
    cfg: TrainConfig,
    mc: ModelConfig,
    plan_for: Callable[[list[int]], GlobalPlan],
    on_phase: Callable[[str, int], None] | None = None,
) -> tuple[GlobalPlan, dict[str, Any]]:
    """Continue after a worker died: a new default group over the survivors, a plan
    over the remaining devices, and every stage's state rebuilt from its units that
    lost no shard, through the EMU runtime where it can
    (:meth:`TrainerUnits.recover <nereus_rl.trainer.units.TrainerUnits.recover>`:
    Destroy the broken units, keep the intact ones that fit the new plan, Extend
    from them onto the remaining devices and onto workers that joined the driver,
    which take the lost device ids), else by the per-stage reshard from one intact
    unit of the current plan (logged with the reason). A worker dying while this runs
    starts the recovery over the survivors, and a death that cut a transition or a
    weight sync short is recovered from the units that still hold the state (see the
    module docstring). Nothing is reloaded from disk.

    Arguments:
        group: the run's workers; its maps and default group are changed to the
            survivors' (and joined workers').
        units: the run's EMU units (None: the state is not held as units).
        plan: the current plan.
        step: the step the run goes on from.
        error: what the loss was noticed by.
        cfg: the run's options (``mode``, ``transitions``, ``devices``, hyper-parameters).
        mc: the model's config (a joined worker learns it).
        plan_for: the plan to go on with over the given plan devices.
        on_phase: called as ``on_phase(phase, attempt)`` at each phase of a round.

    Returns:
        The new plan (the caller makes it current) and the recovery's decision row.

    Raises:
        the original error: no worker was lost (it was something else).
        RecoveryStateLostError: some stage has no intact unit left (its state is gone;
            the message says which stage and what to do), raised before anything moves
            (off the current plan: no unit read through the stage's models is left).
        RuntimeError: a worker died while the per-stage reshard was moving state (the
            survivors' models may be on two layouts).
    """
    if not _wait_lost(group, NOTICE_S):
        raise error
    t0 = time.perf_counter()
    job = _Recovery(group, units, plan, cfg, mc, plan_for, on_phase)
    # The current plan's devices are these workers' (a round may give a lost device's
    # id to a joiner, which holds none of the plan's state).
    plan_workers = dict(group.device_worker)
    old = plan
    rounds: list[dict[str, Any]] = []
    lost_devices: list[int] = []
    # off_plan: the stage models may not be the current plan's layout (a transition's
    # rebind or fallback reshard, or a recovery's rebind, was cut short), so the
    # per-stage reshard must read them through the units found sound, not that plan's.
    ctx: dict[str, Any] = {"off_plan": False, "interrupted": None, "unsound": [], "adopted": []}
    ctx["readable"] = []
    while True:
        lost = set(group.lost())
        dead = sorted(d for d, w in group.device_worker.items() if w in lost)
        lost_devices += dead
        rounds.append({"lost_devices": dead, "joined": {}, "error": None})
        try:
            new, run, why = _round(job, error, dead, plan_workers, rounds[-1], len(rounds) - 1, ctx)
            ctx["off_plan"] = False  # every stage model is now ``new``'s
            if cfg.mode == "async":
                # Rollout units rebuilt from survivors that a cut-short weight sync
                # reached or not hold different weights; the next rollout is generated
                # before any other sync, so every rollout unit gets actor_train's now.
                job.plan = new  # (made current once, by the caller)
                plan_workers = dict(group.device_worker)
                sync_weights(group, new)
                rounds[-1]["weight_sync"] = True
            break
        except _CUT as e:
            # Another worker died during this round (else it is not ours to handle).
            if isinstance(e, EMUStateLostError) or not _wait_lost(group, NOTICE_S):
                raise
            rounds[-1]["error"] = f"{type(e).__name__}: {e}"
            _LOG.warning("a worker died during recovery (%s); starting over the survivors", e)
    outcome = Outcome(
        measured_s=time.perf_counter() - t0,
        interrupted=ctx["interrupted"],
        cause=str(error),
        bytes_moved=run.bytes_moved if run is not None else None,
        executed_primitives=tuple(run.primitives) if run is not None else (),
        recovery=Recovery(
            unsound_units=tuple(ctx["unsound"]),
            adopted_units=tuple(ctx["adopted"]),
            method="emu" if run is not None else "reshard",
            fallback=why,
            rounds=tuple(rounds),
        ),
    )
    reason = "recovery from the intact units after a worker died"
    return new, _row(step, error, lost_devices, old, new, reason, outcome)


def _row(step, error, lost_devices, current, new, reason: str, outcome: Outcome) -> dict[str, Any]:
    """A recovery's decisions.jsonl row: an urgent, taken move to ``new``."""
    decision = Decision(
        step=step,
        signal="devices",
        trigger=f"lost devices {sorted(lost_devices)} ({type(error).__name__})",
        urgent=True,
        current=current,
        candidate=new,
        taken=True,
        path="urgent",
        reason=reason,
        predicted_saving_s=None,
        predicted_transition_s=None,
    )
    return decision.to_row(outcome)


def _round(
    job: _Recovery,
    error: Exception,
    dead: list[int],
    plan_workers: dict[int, int],
    row: dict[str, Any],
    attempt: int,
    ctx: dict[str, Any],
):
    """One recovery round over the devices whose workers are alive now (and workers
    admitted in their place, noted in ``row["joined"]``).

    Returns:
        (the new plan, the EMU :class:`TransitionRun` or None, why the reshard was used).

    Raises:
        WorkerLostError, WorkerTimeoutError, RemoteError, EMUError: cut short (the
            caller tells a new death from another failure).
        RecoveryStateLostError: a stage has no intact unit left.
    """
    group, units, cfg = job.group, job.units, job.cfg
    if units is not None and units.moving is not None:
        raise RuntimeError(
            f"a worker died while the recovery's per-stage reshard was moving stage "
            f"{units.moving!r}: the survivors' copies may be on two layouts, so the state "
            "cannot be rebuilt from memory; restart the run from a checkpoint"
        ) from error
    emu_path = units is not None and {"extend", "destroy"} <= units.live_kinds
    if units is not None:
        _check(group, units, attempt, ctx)
    if ctx["off_plan"]:
        # The models are not the current plan's: the reshard reads them through the
        # units found read through them (``None``: the stage has none left).
        sources = _model_sources(group, job.plan, ctx["readable"])
    else:
        sources = _sources(job, plan_workers, emu_path, error)
    device_worker = {d: w for d, w in group.device_worker.items() if d not in dead}
    joined = row["joined"] = _admit(group, units, cfg.device_cap, device_worker)
    alive = sorted(device_worker)
    # plan device id -> rank in the new default group (the group is formed next)
    group.rebase(device_worker)
    job.phase("start", attempt)
    if group.lost():  # one more died: form the group over fewer
        raise WorkerLostError("a worker died before the default group was formed", ())
    group.init_world()
    if joined:
        # A joiner holds no stage yet: it learns the model and the hyper-parameters (no
        # stage is built, nothing is collective); its units come by Extend.
        group.driver.call(list(joined.values()), "rl.setup", [], job.mc, {}, cfg.hyper())
    job.phase("world", attempt)
    new = job.plan_for(alive)
    run, why = None, None
    if emu_path:
        try:
            units.on_recovery_phase = lambda p: job.phase(p, attempt)
            run = units.recover(new)
        except (EMUError, EMUStateLostError) as e:
            if group.lost():  # refused because one more died: a new round
                raise
            why = f"EMU recovery refused: {e}"  # refused before the models changed
    else:
        why = f"transitions={cfg.transitions!r}: EMU primitives are not run live"
    if run is None:
        _LOG.warning("recovery by per-stage reshard: %s", why)
        missing = sorted(s for s, sp in sources.items() if sp is None)
        if missing:
            raise RecoveryStateLostError(
                f"stage(s) {missing} keep no unit of the current plan that lost no device "
                + (
                    "nor one read through their models, which a death left mid-change "
                    f"({ctx['interrupted'] or 'a recovery rebind'}) "
                    if ctx["off_plan"]
                    else ""
                )
                + f"(lost now: {sorted(dead)}), and the EMU recovery refused ({why}): the "
                "state cannot be rebuilt by the per-stage reshard. Use a plan with dp >= 2 "
                "for every stage"
            ) from error
        _reshard(group, units, sources, new)
    return new, run, why


def _check(group: WorkerGroup, units: TrainerUnits, attempt: int, ctx: dict[str, Any]) -> None:
    """Keep only the live units that hold their stage's state on every surviving rank
    (:func:`nereus_rl.trainer.recover_check.check_units`), and note in ``ctx`` what the
    death cut short and which units were forgotten or adopted.

    A transition's rebind cut short leaves its target units sound (the DAG ended
    before it), so the rebind flag is lowered here for the EMU recovery to start from
    them; the models are then off the current plan (``ctx["off_plan"]``).
    """
    rebinding, units.rebinding = units.rebinding, None
    # The models' group numbering is the current default group's only before any
    # recovery round re-formed it.
    res = check_units(group, units, adopt_layouts=attempt == 0)
    ctx["unsound"] += res["unsound"]
    ctx["adopted"] += res["adopted"]
    ctx["readable"] = res["readable"]
    if attempt == 0:
        if rebinding == "transition":
            ctx["interrupted"] = "transition rebind"
        elif res["unsound"] or res["adopted"]:
            ctx["interrupted"] = "transition fallback reshard"
    if rebinding is not None or res["unsound"] or res["adopted"]:
        ctx["off_plan"] = True


def _admit(
    group: WorkerGroup,
    units: TrainerUnits | None,
    devices: int,
    device_worker: dict[int, int],
    exclude: Collection[int] = (),
) -> dict[int, int]:
    """Give free device ids (lost ones, then new ones, up to ``devices``: the run's
    ``max_devices``) to workers of the driver that the run does not use (joined with
    ``nereus-rl worker --store``, placed on new Ray capacity, or idle), less those in
    ``exclude`` (on a draining node), so that recovery or growth extends onto them.
    Updates ``device_worker``; returns device -> worker of the admitted ones."""
    used = set(device_worker.values()) | set(exclude)
    spare = [w for w in group.driver.workers if w not in used]
    free = [d for d in range(devices) if d not in device_worker]
    joined = dict(zip(free, spare))
    device_worker.update(joined)
    if joined and units is not None:
        # the cost model prices the joiners' primitives on their device ids
        units.emus.rank_devices.update({w: d for d, w in joined.items()})
    if joined:
        _LOG.warning("admitting joined worker(s) %s (device -> worker)", joined)
    return joined


def spare_workers(group: WorkerGroup, devices: int, exclude: Collection[int] = ()) -> list[int]:
    """The driver's live workers that the run could admit now: none while the run
    holds ``devices`` device ids (``max_devices``) already, else those it does not use
    (less ``exclude``). The driver's worker list is read only when there is room."""
    if len(group.device_worker) >= devices:
        return []
    used = set(group.device_worker.values()) | set(exclude)
    return [w for w in group.driver.workers if w not in used]


def grow(
    group: WorkerGroup,
    units: TrainerUnits,
    plan: GlobalPlan,
    step: int,
    *,
    cfg: TrainConfig,
    mc: ModelConfig,
    exclude: Collection[int] = (),
) -> dict[str, Any] | None:
    """Admit workers that arrived (no worker was lost): free device ids up to
    ``cfg.max_devices`` go to them, as a recovery admits a joiner.

    The same path as a recovery's round, less the loss: the joiners take device ids
    (:func:`_admit`), every worker joins a new default group with them, the joiners
    learn the model and the hyper-parameters (``rl.setup`` with no stage), and every
    stage's model is rebuilt on the new group from its own units (``rl.rebind``; no
    byte of state moves, the plan is unchanged). The new devices are then the devices
    signal's: the adaptation loop's planner may choose a plan that uses them, and the
    move onto them runs as live primitives (Extend, ...).

    Arguments:
        group, units: the run's workers and EMU units.
        plan: the current plan (its stages' units are rebound as they are).
        step: the step whose boundary this is.
        cfg, mc: the run's options and model.
        exclude: workers not to admit (on a draining node).

    Returns:
        The decisions.jsonl row of the growth (``signal: devices``, not a move), or None
        when no worker was admitted.

    Raises:
        WorkerLostError, WorkerTimeoutError, RemoteError: a worker died meanwhile (the
            caller's recovery goes on from it: every unit still holds its state, and a
            recovery rebind cut short is sound to start over).
    """
    t0 = time.perf_counter()
    device_worker = dict(group.device_worker)
    joined = _admit(group, units, cfg.device_cap, device_worker, exclude)
    if not joined:
        return None
    before = sorted(group.device_worker)
    group.rebase(device_worker)
    if group.lost():
        raise WorkerLostError("a worker died before the grown default group was formed", ())
    group.init_world()
    group.driver.call(list(joined.values()), "rl.setup", [], mc, {}, cfg.hyper())
    # The models' TP/PP/DP groups were made on the old default group: rebuilt on the
    # new one from each stage's own units (as a recovery rebinds the units it keeps).
    units.emus.flush()
    units._rebind([(group.desc(sp), units.by_stage[sp.stage]) for sp in plan.stages], "recovery")
    return {
        "step": step,
        "signal": "devices",
        "trigger": f"gained {len(joined)} device(s) {sorted(joined)}",
        "urgent": False,
        "current": repr(plan),
        "taken": False,
        "path": "grow",
        "reason": (
            f"worker(s) {sorted(joined.values())} admitted on devices {sorted(joined)} "
            f"({len(before)} -> {len(device_worker)} devices, max {cfg.device_cap}); the "
            "plan is unchanged until the planner moves onto them"
        ),
        "joined": {str(d): w for d, w in sorted(joined.items())},
        "measured_s": time.perf_counter() - t0,
    }


def _sources(
    job: _Recovery, plan_workers: dict[int, int], emu_path: bool, error: Exception
) -> dict[str, Any]:
    """Per stage of the plan the models hold, one intact unit as a single-unit StagePlan (None
    when the plan has none but a live EMU unit holds the state).

    Every loss counts, this round's and the cut-short rounds' (whose broken units may
    not have been destroyed yet).

    Raises:
        RecoveryStateLostError: a stage has no intact holder at all (nothing moved yet).
    """
    lost = set(job.group.driver.check_liveness())
    gone = sorted(d for d, w in plan_workers.items() if w in lost)
    live = {}
    if emu_path:
        live = {u.stage: u for u in job.units.emus.units() if not lost & set(u.ranks)}
    out = {}
    for sp in job.plan.stages:
        intact = [u for u in sp.units if not set(gone).intersection(u)]
        if not intact and sp.stage not in live:
            raise RecoveryStateLostError(
                f"worker(s) on devices {gone} died and stage {sp.stage!r} "
                f"({sp!r}) has no unit left without them: its state is lost. Use a plan "
                "with dp >= 2 for every stage to survive a device loss"
            ) from error
        out[sp.stage] = (
            StagePlan(sp.stage, sp.model, sp.trains, 1, sp.tp, sp.pp, (intact[0],))
            if intact
            else None
        )
    return out


def _model_sources(group: WorkerGroup, plan: GlobalPlan, readable) -> dict[str, StagePlan | None]:
    """Per stage of ``plan``, a live unit read through the stage models on every rank
    (after :func:`_check`), as a single-unit StagePlan of its devices."""
    dev_of = {w: d for d, w in group.device_worker.items()}
    out: dict[str, StagePlan | None] = {}
    for sp in plan.stages:
        us = [u for u in readable if u.stage == sp.stage and all(r in dev_of for r in u.ranks)]
        out[sp.stage] = None
        if us:
            devs = tuple(dev_of[r] for r in us[0].ranks)
            out[sp.stage] = StagePlan(sp.stage, sp.model, sp.trains, 1, us[0].tp, us[0].pp, (devs,))
    return out


def _reshard(
    group: WorkerGroup, units: TrainerUnits | None, sources: dict[str, StagePlan], new
) -> None:
    """The fallback: every stage moved from one intact unit of the current plan."""
    for sp in new.stages:
        # Until every stage moved, a death leaves some models on the new layout: flagged
        # so that a next round refuses instead of reading them as the old one's.
        if units is not None:
            units.moving = sp.stage
        group.call_all(
            "rl.move",
            group.desc(sources[sp.stage]),
            group.desc(sp),
            params_only=not sp.trains,
            replace=True,
        )
    if units is not None:
        # the units of the lost layout are gone; the rebuilt state is adopted anew
        units.forget_all()
        units.adopt(new)
        units.moving = None


def restore(
    group: WorkerGroup,
    units: TrainerUnits,
    snapshots: Snapshots | DiskCheckpoint,
    plan: GlobalPlan | None,
    step: int,
    error: Exception,
    *,
    cfg: TrainConfig,
    mc: ModelConfig,
    plan_for: Callable[[list[int]], GlobalPlan],
    initial: dict[str, dict[str, torch.Tensor]],
    why: str,
    noticed: bool = False,
) -> tuple[GlobalPlan, dict[str, Any], int]:
    """Continue after a worker died by rebuilding every stage from the committed
    in-memory snapshot (:mod:`nereus_rl.trainer.snapshot`): the training stages' state
    as of the snapshot's step, read from the survivors (each shard from its holder or
    its mirror), the reference from the initial weights, the rollout (and PPO's
    critic_inference) from the training stages' weights. Every stage of a plan over the
    survivors (and joined workers) is set up from them, as at start.

    Used where the units cannot rebuild the state: a stage lost every unit, a death
    came while a step's update was under way (some stages may have stepped, others not;
    the snapshot is the last step every stage finished), or during start-up (the
    snapshot is then the initial states). A worker dying while this runs starts it over
    the survivors.

    Arguments:
        group, units: the run's workers and EMU units (adopted anew on the new plan).
        snapshots: the committed snapshot (or, the last resort, the disk checkpoint).
        plan: the current plan (None: none was set up yet).
        step: the step the run would go on from.
        error: what the loss was noticed by.
        cfg, mc, plan_for: as for :func:`recover`.
        initial: the initial full states (the reference's weights; every model's before
            the first snapshot).
        why: why the units' recovery was not used (logged in the decision row).
        noticed: the loss was confirmed already (by a recovery from the units that
            stopped), so there is no death to wait for.

    Returns:
        The new plan, the recovery's decision row, and the step to go on from (the one
        after the snapshot's).

    Raises:
        the original error: no worker was lost.
        SnapshotLostError: a shard lost both its holder and its mirror.
    """
    if not noticed and not _wait_lost(group, NOTICE_S):
        raise error
    t0 = time.perf_counter()
    rounds: list[dict[str, Any]] = []
    lost_devices: list[int] = []
    while True:
        lost = set(group.lost())
        dead = sorted(d for d, w in group.device_worker.items() if w in lost)
        lost_devices += dead
        row: dict[str, Any] = {"lost_devices": dead, "joined": {}, "error": None}
        rounds.append(row)
        try:
            # read back first: which copy of a shard is read depends on who is alive
            full = snapshots.full_states(set(group.driver.check_liveness()), initial)
            device_worker = {d: w for d, w in group.device_worker.items() if d not in dead}
            row["joined"] = _admit(group, units, cfg.device_cap, device_worker)
            group.rebase(device_worker)
            if group.lost():
                raise WorkerLostError("a worker died before the default group was formed", ())
            group.init_world()
            new = plan_for(sorted(device_worker))
            group.call_all("rl.setup", [group.desc(sp) for sp in new.stages], mc, full, cfg.hyper())
            break
        except _CUT as e:
            if isinstance(e, EMUStateLostError) or not _wait_lost(group, NOTICE_S):
                raise
            row["error"] = f"{type(e).__name__}: {e}"
            _LOG.warning("a worker died during recovery (%s); starting over the survivors", e)
    units.forget_all()
    units.adopt(new)
    units.moving = units.rebinding = None
    resume = snapshots.version + 1
    outcome = Outcome(
        measured_s=time.perf_counter() - t0,
        interrupted=None,
        cause=str(error),
        recovery=Recovery(
            unsound_units=(),
            adopted_units=(),
            method="snapshot",
            fallback=why,
            rounds=tuple(rounds),
        ),
    )
    reason = f"recovery from the in-memory snapshot of step {snapshots.version}"
    return new, _row(step, error, lost_devices, plan, new, reason, outcome), resume
