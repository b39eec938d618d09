"""Recovery of a run after a worker died: the trainer's :meth:`Trainer.recover
<nereus_rl.trainer.Trainer.recover>` (kept apart from the RL loop it interrupts)."""

from __future__ import annotations

import logging
import time

from nereus_rl.emu_types import EMUError, EMUStateLostError
from nereus_rl.globalplan import StagePlan

_LOG = logging.getLogger("nereus_rl.trainer")


def recover(trainer, step: int, error: Exception) -> None:
    """Continue after a worker died: a new default group over the survivors, a plan
    over the remaining devices, and every stage's state rebuilt from its units that
    lost no device, through the EMU runtime where it can
    (:meth:`TrainerUnits.recover <nereus_rl.trainer_units.TrainerUnits.recover>`:
    Destroy the broken units, keep the intact ones that fit the new plan, Extend
    from them onto the remaining devices), else by the per-stage reshard from one
    intact unit (logged with the reason). Nothing is reloaded from disk.

    Raises:
        the original error: no worker was lost (it was something else), or some stage
        had no intact unit left (its state is gone; the message says which).
    """
    lost = trainer.driver.check_liveness() or trainer.driver.wait_for_loss(10.0)
    dead = {d for d, w in trainer.device_worker.items() if w in lost}
    if not dead:
        raise error
    t0 = time.perf_counter()
    alive = sorted(d for d in trainer.device_worker if d not in dead)
    sources = {}
    for sp in trainer.plan.stages:
        intact = [u for u in sp.units if not dead.intersection(u)]
        if not intact:
            raise RuntimeError(
                f"worker(s) on devices {sorted(dead)} died and stage {sp.stage!r} "
                f"({sp!r}) has no unit left without them: its state is lost. Use a plan "
                "with dp >= 2 for every stage to survive a device loss"
            ) from error
        sources[sp.stage] = StagePlan(sp.stage, sp.model, sp.trains, 1, sp.tp, sp.pp,
                                      (intact[0],))  # fmt: skip
    trainer.workers = [trainer.device_worker[d] for d in alive]
    trainer.device_worker = {d: trainer.device_worker[d] for d in alive}
    trainer._init_world()
    trainer.world_rank = {d: i for i, d in enumerate(alive)}
    new, _ = trainer.adapter.best_plan(trainer._response_len(step), devices=alive)
    run, why = None, None
    if {"extend", "destroy"} <= trainer.units.live_kinds:
        try:
            run = trainer.units.recover(new)
        except (EMUError, EMUStateLostError) as e:  # refused before the models changed
            why = f"EMU recovery refused: {e}"
    else:
        why = f"transitions={trainer.cfg.transitions!r}: EMU primitives are not run live"
    if run is None:
        _LOG.warning("recovery by per-stage reshard: %s", why)
        for sp in new.stages:
            trainer._all(
                "rl.move",
                trainer._desc(sources[sp.stage]),
                trainer._desc(sp),
                params_only=not sp.trains,
                replace=True,
            )
        # the units of the lost layout are gone; the rebuilt state is adopted anew
        trainer.units.forget_all()
        trainer.units.adopt(new)
    old = trainer.plan
    trainer._set_plan(step, new)
    row = {
        "step": step,
        "signal": "devices",
        "trigger": f"lost devices {sorted(dead)} ({type(error).__name__})",
        "urgent": True,
        "current": repr(old),
        "candidate": repr(new),
        "taken": True,
        "path": "urgent",
        "reason": "recovery from the intact units after a worker died",
        "recovery": "emu" if run is not None else "reshard",
        "recovery_fallback": why,
        "executed_primitives": run.primitives if run is not None else [],
        "bytes_moved": run.bytes_moved if run is not None else None,
        "predicted_saving_s": None,
        "predicted_transition_s": None,
        "measured_transition_s": time.perf_counter() - t0,
    }
    trainer.adapter._log(row)
