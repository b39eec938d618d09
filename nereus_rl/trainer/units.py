"""The trainer's model state as EMU units, and plan transitions run as EMU primitives.

Every unit of every stage of the trainer's plan is an EMU unit of an
:class:`~nereus_rl.emu.manager.EMUManager` on the driver, *adopted* from the state the
trainer built (``EMUManager.adopt``, owner ``"trainer"``): on each worker the
unit's tensors are the stage model's parameters and its optimizer's Adam
moments and step (:mod:`nereus_rl.trainer.worker`). The stage's TensorSpecs
are :func:`nereus_rl.trainer.worker_state.tensor_specs`, the same the per-stage
reshard moves.

A taken transition runs its compiled DAG (``transition_compile``, with
``stage_slots=False``) through the concurrent executor
(:func:`nereus_rl.transition.execute.execute_dag`) with live implementations: each
DAG node becomes ``EMUManager.extend / destroy / split / merge`` on the units
the DAG names (DAG uids ``"<stage>#<i>"`` are the current plan's units; the
DAG's plan devices are mapped to worker ranks). Then each changed stage's model
is rebuilt on its new layout from its new units' tensors (``rl.rebind``) and the
units are bound to it. Bytes move only inside the primitives (nereus_comm
reshard over pooled gloo groups), and ``rl.rebind`` loads them exactly as the
per-stage reshard did, so the run's numbers do not change.

The executor starts every ready primitive at once, and they really run at once
where their workers are disjoint: the manager holds each primitive's workers
(source and target ranks) while it runs and keeps only its bookkeeping under a
lock, the driver's submits are atomic over their ranks, and the primitives'
groups are built among their members only (:mod:`nereus_rl.emu.manager`,
:mod:`nereus_rl.emu.groups`, :mod:`nereus_rl.runtime.driver`). Two primitives
that share a worker run one after the other: in the DAG's order when an edge
orders them, else in the order they got there. The mapping of DAG nodes to
manager calls is :func:`nereus_rl.emu.dag.run_primitive`.

Recovery after a worker died (:meth:`TrainerUnits.recover`, called by
``Trainer.recover``): the broken units are destroyed, intact units that fit the
new plan are kept, the others are extended from intact units, and every stage's
model is rebound; nothing is read from disk.

Fallback: a stage with a primitive that has no live counterpart here (a kind
outside ``live_kinds``, a destroy of a lost unit, a copy from a unit that does
not hold the stage's state, devices that do not add up) has none of its
primitives run live; after the DAG its state moves by the per-stage reshard
(``rl.move``) and new units are adopted. A stage whose extend copies from such
a stage's new unit falls back too. The decision log counts these.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nereus_rl.core.globalplan import GlobalPlan, StagePlan
from nereus_rl.emu.dag import run_primitive
from nereus_rl.emu.manager import EMUManager
from nereus_rl.emu.types import EMU, EMUError
from nereus_rl.runtime import WorkerLostError
from nereus_rl.trainer.group import WorkerGroup
from nereus_rl.trainer.worker_state import tensor_specs
from nereus_rl.transition import KINDS, Primitive, TransitionDAG
from nereus_rl.transition.execute import execute_dag

if TYPE_CHECKING:
    from nereus_rl.costmodel.costmodel import CostModel
    from nereus_rl.models.model import ModelConfig

OWNER = "trainer"


@dataclass
class TransitionRun:
    """What one executed transition did.

    Attributes:
        primitives: ``"kind:stage"`` of each primitive run live, in the order run.
        fallback_stages: stages moved by the per-stage reshard instead, and why.
        bytes_moved: bytes sent between workers (primitives and fallback reshards).
        fallback_bytes: of those, the fallback reshards'.
        primitive_s: seconds of the live primitives (the EMU records' sum).
        rebind_s: seconds rebuilding the changed stages' models from their units.
        fallback_s: seconds of the fallback reshards.
        execution: the executor's report (None when nothing ran live).
    """

    primitives: list[str] = field(default_factory=list)
    fallback_stages: dict[str, str] = field(default_factory=dict)
    bytes_moved: int = 0
    fallback_bytes: int = 0
    primitive_s: float = 0.0
    rebind_s: float = 0.0
    fallback_s: float = 0.0
    execution: Any = None


class TrainerUnits:
    """The EMU units holding a trainer's state (see the module docstring).

    Arguments:
        group: the run's workers (their default group formed, the stages set up); its
            device -> worker map is read at each use (a recovery changes it).
        mc: the model's config (the stages' TensorSpecs).
        costmodel: fed each live primitive's measurement (``EMUManager`` does it).
        live_kinds: primitive kinds run live; others make their stage fall back.
    """

    def __init__(
        self,
        group: WorkerGroup,
        mc: ModelConfig,
        costmodel: CostModel | None = None,
        *,
        live_kinds: Collection[str] = KINDS,
    ) -> None:
        self.group = group
        self.mc = mc
        self.live_kinds = frozenset(live_kinds)
        self.emus = EMUManager(
            group.driver,
            costmodel=costmodel,
            rank_devices={w: d for d, w in group.device_worker.items()},
            # colocated stages share devices, and so do a stage's old and new units
            shared_devices=True,
            # the model's TP/PP/DP traffic runs over the trainer's own groups
            unit_groups=False,
            transfer_timeout=120.0,
        )
        self.by_stage: dict[str, list[EMU]] = {}
        self._live_lock = threading.Lock()  # the transition's uid -> unit map
        # What a rebind that was sent and has not finished everywhere was for
        # ("transition" or "recovery"; None: no rebind is cut short).
        self.rebinding: str | None = None
        # The stage a recovery's per-stage reshard is moving (None: none is under way).
        self.moving: str | None = None
        # Called with "destroyed" and "extended" as those steps of :meth:`recover` end
        # (fault injection in tests; set by nereus_rl.trainer.recover).
        self.on_recovery_phase: Callable[[str], None] | None = None

    # ---------------------------------------------------------------- adopting

    def adopt(self, plan: GlobalPlan, stages: Collection[str] | None = None) -> None:
        """Adopt the trainer's state of ``plan``'s stages (all, or those named) as units."""
        mc = self.mc
        for sp in plan.stages:
            if stages is not None and sp.stage not in stages:
                continue
            if sp.stage not in self.emus.stages:
                specs = tensor_specs(mc, sp.model == "critic", with_adam=sp.trains)
                self.emus.define_stage(sp.stage, specs, num_layers=mc.num_layers, model=sp.model)
            self.emus.forget(self.by_stage.pop(sp.stage, []))
            self.by_stage[sp.stage] = [
                self.emus.adopt(sp.stage, self._ranks(u), tp=sp.tp, pp=sp.pp, owner=OWNER)
                for u in sp.units
            ]

    def adopt_unit(self, stage: str, ranks, *, tp: int, pp: int) -> EMU:
        """Adopt the stage models on workers ``ranks`` as one unit of ``stage`` (laid out
        tp x pp), outside :attr:`by_stage` (recovery adopts the layouts the models are on)."""
        return self.emus.adopt(stage, ranks, tp=tp, pp=pp, owner=OWNER)

    def forget_all(self) -> None:
        """Forget every unit (the trainer rebuilt its state another way, e.g. recovery)."""
        self.emus.forget(self.emus.units())
        self.by_stage.clear()

    def close(self) -> None:
        """Forget every unit and drop the pooled groups."""
        self.emus.close()
        self.by_stage.clear()

    def _ranks(self, devices) -> list[int]:
        return self.group.ranks(devices)

    # ---------------------------------------------------------------- transitions

    def run(self, old: GlobalPlan, new: GlobalPlan, dag: TransitionDAG | None) -> TransitionRun:
        """Move the trainer's state from ``old`` to ``new`` by running ``dag`` live.

        Arguments:
            old: the current plan (its units are ``self.by_stage``).
            new: the target plan.
            dag: the compiled transition (None: every changed stage falls back).

        Returns:
            What ran (see :class:`TransitionRun`).

        Raises:
            TransitionExecutionError: a live primitive failed (the message names it).
        """
        out = TransitionRun()
        changed = [sp for sp in new.stages if sp != old.stage(sp.stage)]
        first_rec = len(self.emus.records)
        live: dict[str, EMU] = {}
        if dag is None:
            out.fallback_stages = {sp.stage: "no DAG" for sp in changed}
        else:
            for sp in old.stages:
                for i, u in enumerate(self.by_stage[sp.stage]):
                    live[f"{sp.stage}#{i}"] = u
            out.fallback_stages = self._fallbacks(dag, live)
            if any(p.stage not in out.fallback_stages for p in dag.primitives):
                out.execution = execute_dag(dag, self._impls(live, out))
        for rec in self.emus.records[first_rec:]:
            out.bytes_moved += rec.bytes_moved
            out.primitive_s += rec.seconds
        t0 = time.perf_counter()
        self.emus.flush()
        rebind = []
        for sp in changed:
            if sp.stage in out.fallback_stages:
                continue
            units = [self._target_unit(dag, live, sp, i) for i in range(sp.dp)]
            rebind.append((self.group.desc(sp), units))
        if rebind:  # one call for every stage: a round trip, not one per stage
            self._rebind(rebind, "transition")
        for desc, units in rebind:  # only now: until the rebind the models are the old plan's
            self.by_stage[desc["stage"]] = units
        out.rebind_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for sp in changed:
            if sp.stage not in out.fallback_stages:
                continue
            rep = self.group.call_all(
                "rl.move", self.group.desc(old.stage(sp.stage)), self.group.desc(sp),
                params_only=not sp.trains, replace=True,
            )  # fmt: skip
            out.fallback_bytes += int(sum(r["bytes_sent"] for r in rep.values()))
            self.adopt(new, stages=[sp.stage])
        out.fallback_s = time.perf_counter() - t0
        out.bytes_moved += out.fallback_bytes
        return out

    # ---------------------------------------------------------------- recovery

    def recover(self, new: GlobalPlan) -> TransitionRun:
        """Rebuild the trainer's state on ``new`` from the live units that lost no worker.

        EMU recovery: every unit that lost a shard is destroyed
        (``EMUManager.destroy_broken``); each unit of ``new`` is an intact unit that
        already sits on its devices with its layout (kept, no byte moves) or is
        extended from an intact unit of its stage (round robin over them), the extends
        running at once where their workers are disjoint; then the intact units not
        kept are destroyed and every stage's model is rebuilt from its units
        (``rl.rebind``: the job's default group changed). Nothing is read from disk.

        Every live unit holds its stage's whole state (a primitive commits only after
        all its ranks succeeded): the current plan's units read the models, which stay
        untouched until a rebind, and units made by a transition that a loss cut short
        hold received copies. So any intact live unit is a sound source, except after a
        transition's rebind that did not finish (some models may already be the new
        layout's, read through the old units). A recovery's rebind cut short is sound to
        start over: every unit not in its plan was destroyed before it, and each
        member loads its own unit's bytes, so every live unit reads its own state
        whether its worker got that far or not.

        Arguments:
            new: the plan over the surviving devices (its device ids are the trainer's).

        Returns:
            What ran (primitives, bytes, seconds; ``execution`` is None).

        Raises:
            EMUError: a stage has no intact unit, or a primitive refused its input (a
                rank lost meanwhile, too); the models are untouched, so the per-stage
                reshard (the caller's fallback) can still run. EMUStateLostError: every
                unit of a stage lost a shard. WorkerLostError (and the driver's other
                errors): a worker died meanwhile; the live units stay sound to start over.
            RuntimeError: a transition's rebind was cut short (neither the units nor the
                models can be trusted as one layout).
        """
        out = TransitionRun()
        m = self.emus
        if self.rebinding == "transition":
            raise RuntimeError(
                "a worker died during a transition's rebind: some models may already be "
                "on the new layout and are read through the old units, so the state cannot "
                "be rebuilt from memory; restart the run from a checkpoint"
            )
        phase = self.on_recovery_phase or (lambda _: None)
        first_rec = len(m.records)
        broken = m.destroy_broken()
        out.primitives += [f"destroy:{u.stage}" for u in broken]
        phase("destroyed")
        keep: dict[str, list[EMU | None]] = {}
        todo: list[tuple[int, EMU, StagePlan]] = []
        for sp in new.stages:
            intact = m.units(sp.stage)
            if not intact:
                raise EMUError(f"stage {sp.stage!r} has no intact unit to extend from")
            free = list(intact)
            slots: list[EMU | None] = []
            for devs in sp.units:
                ranks = tuple(self._ranks(devs))
                fits = [u for u in free if u.ranks == ranks and (u.tp, u.pp) == (sp.tp, sp.pp)]
                slots.append(fits[0] if fits else None)
                if fits:
                    free.remove(fits[0])
            todo += [(i, intact[len(todo) % len(intact)], sp)
                     for i, u in enumerate(slots) if u is None]  # fmt: skip
            keep[sp.stage] = slots

        def extend(job: tuple[int, EMU, StagePlan]) -> EMU:
            i, src, sp = job
            return m.extend(sp.stage, self._ranks(sp.units[i]), tp=sp.tp, pp=sp.pp, source=src)

        if todo:  # at once: the manager runs those on disjoint workers in parallel
            with ThreadPoolExecutor(max_workers=len(todo)) as ex:
                made = list(ex.map(extend, todo))
            for (i, _, sp), u in zip(todo, made):
                keep[sp.stage][i] = u
                out.primitives.append(f"extend:{sp.stage}")
        phase("extended")
        kept = {u.uid for us in keep.values() for u in us if u is not None}
        for u in m.units():
            if u.uid not in kept:
                m.destroy(u)
                out.primitives.append(f"destroy:{u.stage}")
        for rec in m.records[first_rec:]:
            out.bytes_moved += rec.bytes_moved
            out.primitive_s += rec.seconds
        t0 = time.perf_counter()
        m.flush()
        self.by_stage = {s: [u for u in us if u is not None] for s, us in keep.items()}
        self._rebind(
            [(self.group.desc(sp), self.by_stage[sp.stage]) for sp in new.stages], "recovery"
        )
        out.rebind_s = time.perf_counter() - t0
        return out

    def _rebind(self, stages: list[tuple[dict[str, Any], list[EMU]]], why: str) -> None:
        """``rl.rebind`` on every worker (one round trip for every stage)."""
        # A worker lost now fails before anything is sent (the models stay as they are):
        # sent to a dead member, the survivors would wait in its group rendezvous for the
        # whole group timeout. Once sent, the flag stays up unless every worker finished.
        dead = self.group.lost()
        if dead:
            raise WorkerLostError(f"worker(s) {dead} died before the rebind was sent", tuple(dead))
        pending = self.group.submit_all("rl.rebind", [(d, [u.uid for u in us]) for d, us in stages])
        self.rebinding = why
        self.group.driver.wait(pending)
        self.rebinding = None

    def _target_unit(self, dag, live: dict[str, EMU], sp: StagePlan, i: int) -> EMU:
        ranks = tuple(self._ranks(sp.units[i]))
        for u in dag.target.stage_units(sp.stage):
            emu = live.get(u.uid)
            if emu is not None and emu.ranks == ranks and (emu.tp, emu.pp) == (sp.tp, sp.pp):
                return emu
        raise RuntimeError(
            f"after the transition no live unit of {sp.stage!r} sits on ranks {list(ranks)} "
            f"(tp{sp.tp} pp{sp.pp}); the DAG's target {dag.target!r} does not match {sp!r}"
        )

    def _fallbacks(self, dag: TransitionDAG, live: dict[str, EMU]) -> dict[str, str]:
        """Stages whose primitives cannot all run live, with the first reason."""
        out: dict[str, str] = {}
        for u in dag.current.units:
            emu = live.get(u.uid)
            if emu is None or emu.ranks != tuple(self._ranks(u.devices)):
                out.setdefault(u.stage, f"DAG unit {u!r} is not a live unit of the plan")
        for p in dag.primitives:
            why = self._unmappable(p)
            if why is not None:
                out.setdefault(p.stage, why)
        made_by = {u.uid: p.stage for p in dag.primitives for u in p.outputs}
        grew = True
        while grew:  # an extend from a fallback stage's new unit cannot run live either
            grew = False
            for p in dag.primitives:
                src = p.source.uid if p.kind == "extend" and p.source is not None else None
                if src in made_by and made_by[src] in out and p.stage not in out:
                    out[p.stage] = f"copies from {src}, a new unit of fallback stage {made_by[src]}"
                    grew = True
        return out

    def _unmappable(self, p: Primitive) -> str | None:
        """Why ``p`` has no live counterpart (None: it has one)."""
        if p.kind not in self.live_kinds:
            return f"{p.kind} is not run live here"
        if p.lost:
            return "destroy of a lost unit"
        ins = {d for u in p.inputs for d in u.devices}
        outs = [u.devices for u in p.outputs]
        if p.kind == "extend":
            src = p.source
            if src is None or len(p.outputs) != 1:
                return "extend without one source and one output"
            if src.stage != p.stage and not self.emus.covers(src.stage, p.stage):
                return f"source {src.uid} does not hold stage {p.stage}'s state"
        elif p.kind == "split":
            if len(p.inputs) != 1 or len(outs) != 2 or sorted(outs[0] + outs[1]) != sorted(ins):
                return "split whose halves are not its unit's devices"
        elif p.kind == "merge":
            if len(p.inputs) != 2 or len(outs) != 1 or sorted(outs[0]) != sorted(ins):
                return "merge whose unit is not its inputs' devices"
            if p.inputs[0].layout[:2] != p.inputs[1].layout[:2]:
                return "merge of units of different layouts"
        elif len(p.inputs) != 1:
            return "destroy of other than one unit"
        return None

    def _impls(self, live: dict[str, EMU], out: TransitionRun):
        fallback = out.fallback_stages

        def run(p: Primitive) -> None:
            if p.stage in fallback:
                return  # its stage moves by the per-stage reshard after the DAG
            # concurrently with the other ready primitives (see the module docstring)
            self._run(p, live)
            out.primitives.append(f"{p.kind}:{p.stage}")  # list.append: atomic

        return dict.fromkeys(KINDS, run)

    def _run(self, p: Primitive, live: dict[str, EMU]) -> None:
        run_primitive(self.emus, p, live, self._ranks, self._live_lock)
