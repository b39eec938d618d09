"""The trainer's model state as EMU units, and plan transitions run as EMU primitives.

Every unit of every stage of the trainer's plan is an EMU unit of an
:class:`~nereus_rl.emu.EMUManager` on the driver, *adopted* from the state the
trainer built (``EMUManager.adopt``, owner ``"trainer"``): on each worker the
unit's tensors are the stage model's parameters and its optimizer's Adam
moments and step (:mod:`nereus_rl.trainer_worker`). The stage's TensorSpecs
are ``trainer_worker.tensor_specs``, the same the per-stage reshard moves.

A taken transition runs its compiled DAG (``transition_compile``, with
``stage_slots=False``) through the concurrent executor
(:func:`nereus_rl.transition_exec.execute_dag`) with live implementations: each
DAG node becomes ``EMUManager.extend / destroy / split / merge`` on the units
the DAG names (DAG uids ``"<stage>#<i>"`` are the current plan's units; the
DAG's plan devices are mapped to worker ranks). Then each changed stage's model
is rebuilt on its new layout from its new units' tensors (``rl.rebind``) and the
units are bound to it. Bytes move only inside the primitives (nereus_comm
reshard over pooled gloo groups), and ``rl.rebind`` loads them exactly as the
per-stage reshard did, so the run's numbers do not change.

The manager is shared by threads of the executor but is not thread-safe, and a
runtime worker runs one command at a time (two primitives sharing a worker
could each wait on the other's peer), so the live primitives run one at a time
under a lock, in the order the executor's dependency tracking releases them.

Fallback: a stage with a primitive that has no live counterpart here (a kind
outside ``live_kinds``, a destroy of a lost unit, a copy from a unit that does
not hold the stage's state, devices that do not add up) has none of its
primitives run live; after the DAG its state moves by the old per-stage reshard
(``rl.move``) and new units are adopted. A stage whose extend copies from such
a stage's new unit falls back too. The decision log counts these.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nereus_rl.emu import EMUManager
from nereus_rl.emu_types import EMU
from nereus_rl.globalplan import GlobalPlan, StagePlan
from nereus_rl.trainer_worker import tensor_specs
from nereus_rl.transition import KINDS, Primitive, TransitionDAG
from nereus_rl.transition_exec import execute_dag

if TYPE_CHECKING:
    from nereus_rl.costmodel import CostModel
    from nereus_rl.trainer import Trainer

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
        trainer: the started :class:`~nereus_rl.trainer.Trainer` (driver, workers, plan).
        costmodel: fed each live primitive's measurement (``EMUManager`` does it).
        live_kinds: primitive kinds run live; others make their stage fall back.
    """

    def __init__(
        self,
        trainer: Trainer,
        costmodel: CostModel | None = None,
        *,
        live_kinds: Collection[str] = KINDS,
    ) -> None:
        self.tr = trainer
        self.live_kinds = frozenset(live_kinds)
        self.emus = EMUManager(
            trainer.driver,
            costmodel=costmodel,
            rank_devices={w: d for d, w in trainer.device_worker.items()},
            # colocated stages share devices, and so do a stage's old and new units
            shared_devices=True,
            # the model's TP/PP/DP traffic runs over the trainer's own groups
            unit_groups=False,
            transfer_timeout=120.0,
        )
        self.by_stage: dict[str, list[EMU]] = {}
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- adopting

    def adopt(self, plan: GlobalPlan, stages: Collection[str] | None = None) -> None:
        """Adopt the trainer's state of ``plan``'s stages (all, or those named) as units."""
        mc = self.tr.mc
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

    def forget_all(self) -> None:
        """Forget every unit (the trainer rebuilt its state another way, e.g. recovery)."""
        self.emus.forget(self.emus.units())
        self.by_stage.clear()

    def close(self) -> None:
        """Forget every unit and drop the pooled groups."""
        self.emus.close()
        self.by_stage.clear()

    def _ranks(self, devices) -> list[int]:
        return [self.tr.device_worker[d] for d in devices]

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
            rebind.append((self.tr._desc(sp), [u.uid for u in units]))
            self.by_stage[sp.stage] = units
        if rebind:  # one call for every stage: a round trip, not one per stage
            self.tr._all("rl.rebind", rebind)
        out.rebind_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for sp in changed:
            if sp.stage not in out.fallback_stages:
                continue
            rep = self.tr._all(
                "rl.move", self.tr._desc(old.stage(sp.stage)), self.tr._desc(sp),
                params_only=not sp.trains, replace=True,
            )  # fmt: skip
            out.fallback_bytes += int(sum(r["bytes_sent"] for r in rep.values()))
            self.adopt(new, stages=[sp.stage])
        out.fallback_s = time.perf_counter() - t0
        out.bytes_moved += out.fallback_bytes
        return out

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
            if src.stage != p.stage and not self.emus._covers(src.stage, p.stage):
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
            with self._lock:  # one primitive at a time (see the module docstring)
                self._run(p, live)
                out.primitives.append(f"{p.kind}:{p.stage}")

        return dict.fromkeys(KINDS, run)

    def _run(self, p: Primitive, live: dict[str, EMU]) -> None:
        m = self.emus
        if p.kind == "extend":
            u = p.outputs[0]
            live[u.uid] = m.extend(
                u.stage, self._ranks(u.devices), tp=u.tp, pp=u.pp, source=live[p.source.uid]
            )
        elif p.kind == "destroy":
            m.destroy(live.pop(p.inputs[0].uid))
        elif p.kind == "split":
            a, b = p.outputs
            ea, eb = m.split(
                live.pop(p.inputs[0].uid), tp=a.tp, pp=a.pp,
                halves=(self._ranks(a.devices), self._ranks(b.devices)),
            )  # fmt: skip
            live[a.uid], live[b.uid] = ea, eb
        else:
            (u,) = p.outputs
            a, b = (live.pop(x.uid) for x in p.inputs)
            live[u.uid] = m.merge(a, b, tp=u.tp, pp=u.pp, ranks=self._ranks(u.devices))
