"""In-memory snapshots of the training state, so that no single worker death (and no
whole node's, with two or more nodes) loses a run.

A stage's state lives in its units; a stage with one unit (dp 1), or whose units all
share one node, dies with that worker or node. The reference is the frozen initial
policy and the rollout (and PPO's critic_inference) hold actor_train's (critic_train's)
weights, so only the training stages' state is the run's own: weights, Adam moments
and step. After each step's optimizer step, :meth:`Snapshots.take` keeps it twice:

* every rank of unit 0 of each training stage copies its shards into its own host
  memory (``own``), so that a rollback to the last finished step reads an unchanged
  copy even where a death interrupted the next update half way; so do the other units'
  ranks where the stage is not exposed (a stage with dp >= 2 on separate workers then
  survives any one death in the copies of its other units);
* where the stage is *exposed* (some worker, or some node when ``nodes >= 2``, meets
  every unit), each rank's shards also go to a *buddy* on another node (another
  worker with one node), which keeps them as a ``mirror``, as Gemini keeps its
  in-memory checkpoints on peers. Buddies are distinct, so the mirror is a unit layout
  of its own and the copy is one nereus_comm reshard.

A version is committed when every rank of every training stage has it; the driver
then knows, for each shard, which workers hold it. :meth:`Snapshots.full_states` reads
the committed version back for a recovery, each shard from its holder if alive, else
from its buddy, and gives every model's full state: actor and critic from the
snapshot, the reference from the initial weights. The recovery
(:func:`nereus_rl.trainer.recover.restore`) builds every stage of a new plan on the
survivors from them. Before the first version, the initial states are the version.

Cost: the copy is a host memcpy on the unit's ranks; the mirror moves one unit's
state (12 bytes per parameter in float32: weights and two Adam moments) between
distinct workers. :func:`snapshot_seconds` prices both with the cost model's
cluster (memory bandwidth, link tiers); the trainer takes a snapshot every step
when the price is within 5% of the predicted step, else every
:func:`snapshot_interval` steps (a death then rolls back up to that many steps,
which run again with their own prompts). ``metrics.jsonl`` records what each took
(``snapshot_s``) beside the prediction (``snapshot_predicted_s``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from nereus_comm.layout import Layout
from nereus_rl.core.globalplan import GlobalPlan, StagePlan
from nereus_rl.models.model import ModelConfig
from nereus_rl.trainer.group import WorkerGroup
from nereus_rl.trainer.worker_state import tensor_specs


class SnapshotLostError(RuntimeError):
    """A shard of the committed snapshot has neither its holder nor its buddy alive."""


@dataclass(frozen=True)
class Held:
    """Where one committed version of a training stage lives.

    Attributes:
        stage, model: the stage and its model (``"actor"`` or ``"critic"``).
        tp, pp: the unit's layout the shards were taken from.
        holders: the worker of each layout position of the first unit (``own`` copies).
        buddies: the worker keeping each of those positions' ``mirror`` (None: the stage
            is not exposed).
        others: the workers of the stage's other units, which keep ``own`` copies too (a
            unit whose workers all survive gives the whole state).
    """

    stage: str
    model: str
    tp: int
    pp: int
    holders: tuple[int, ...]
    buddies: tuple[int, ...] | None
    others: tuple[tuple[int, ...], ...] = ()


def exposed(sp: StagePlan, node_of: dict[int, int]) -> bool:
    """Whether one worker, or one node, meets every unit of ``sp`` (its state would die
    with it). ``node_of``: plan device -> node."""
    if sp.dp == 1:
        return True
    nodes = [{node_of[d] for d in u} for u in sp.units]
    return len(set(node_of.values())) > 1 and bool(set.intersection(*nodes))


def buddies(unit: tuple[int, ...], devices: list[int], node_of: dict[int, int]) -> list[int] | None:
    """A distinct buddy device for each device of ``unit``: never itself, on another node
    where there is one, else outside the unit where there is room (None: one device).

    Among equals the next device after it (in device order) is taken, which spreads the
    mirrors of a unit over the others.
    """
    n = len(devices)
    pos = {d: i for i, d in enumerate(devices)}
    used: set[int] = set()
    out = []
    for d in unit:
        options = [c for c in devices if c != d and c not in used]
        if not options:
            return None
        options.sort(key=lambda c: (node_of[c] == node_of[d], c in unit, (pos[c] - pos[d]) % n))
        used.add(options[0])
        out.append(options[0])
    return out


def node_map(devices: list[int], num_devices: int, nodes: int) -> dict[int, int]:
    """Plan device -> node when ``num_devices`` devices are split in ``nodes`` equal
    nodes in device order (device ids keep their node after a loss)."""
    per = max(1, num_devices // max(1, nodes))
    return {d: min(d // per, nodes - 1) for d in devices}


def snapshot_seconds(plan: GlobalPlan, mc: ModelConfig, cluster, node_of: dict[int, int]) -> float:
    """Predicted seconds one snapshot of ``plan``'s training stages adds to a step, on
    ``cluster`` (a :class:`~nereus_rl.core.spec.ClusterSpec`).

    Per training stage, a rank's share of the unit's state (weights, two Adam moments)
    is read and written once by the host copy (twice its bytes over the device's
    memory bandwidth) and, where the stage is exposed, sent to its buddy over the link
    tier between them. The stages run one after the other on the driver's wait, so
    their seconds add up.
    """
    total = 0.0
    for sp in plan.stages:
        if not sp.trains:
            continue
        specs = tensor_specs(mc, sp.model == "critic", with_adam=True)
        per_rank = sum(s.nbytes for s in specs) / (sp.tp * sp.pp)
        total += 2 * per_rank / cluster.device.mem_bw_Bps
        bud = buddies(sp.units[0], sorted(node_of), node_of) if exposed(sp, node_of) else None
        if bud is not None:
            tier = cluster.tier(tuple(sp.units[0]) + tuple(bud))
            total += tier.latency_s + per_rank / tier.bandwidth_Bps
    return total


def snapshot_interval(predicted_s: float, step_s: float, budget: float) -> int:
    """Steps between snapshots so that their predicted cost stays within ``budget`` (a
    fraction) of the predicted step: 1 (every step) when it fits."""
    if step_s <= 0 or predicted_s <= budget * step_s:
        return 1
    return max(1, math.ceil(predicted_s / (budget * step_s)))


class Snapshots:
    """The committed snapshot of a run's training stages (see the module docstring).

    Arguments:
        group: the run's workers.
        mc: the model's config.
        num_devices: the run's configured devices (the node split is over them).
        nodes: failure domains the devices are split into (1: each worker alone).

    Attributes:
        version: the step whose update the committed snapshot holds (-1: the initial
            states, before any step; a resumed run's initial states are its
            checkpoint's, and its version that checkpoint's step).
        held: stage -> :class:`Held` of the committed version.
    """

    def __init__(self, group: WorkerGroup, mc: ModelConfig, num_devices: int, nodes: int = 1):
        self.group = group
        self.mc = mc
        self.num_devices = num_devices
        self.nodes = nodes
        self.version = -1
        self.held: dict[str, Held] = {}
        # Each take writes under a new tag (the workers key their copies by it), so a
        # take cut short, or one of the same version on a new plan after a recovery,
        # never overwrites the committed copies.
        self.tag = -1
        self._next_tag = 0
        # steps between snapshots (price()), the prediction, and what they took (smoothed)
        self.interval = 1
        self.predicted_s: float | None = None
        self.observed_s: float | None = None
        self._priced: tuple | None = None
        self._pending: tuple | None = None  # sent, not committed (begin)
        # workers that may keep older versions of a stage (pruned by the next take)
        self._keepers: dict[str, set[int]] = {}

    def node_of(self, devices: list[int]) -> dict[int, int]:
        """Plan device -> node for ``devices``."""
        return node_map(devices, self.num_devices, self.nodes)

    def price(self, plan: GlobalPlan, cluster, step_s: float, budget: float) -> int:
        """Set :attr:`interval` for ``plan``: a snapshot's seconds (the cost model's price,
        or what snapshots measured when that is more) against a ``budget`` fraction of a
        step of ``step_s`` seconds. Returns the interval."""
        devices = tuple(sorted(self.group.device_worker))
        if self._priced != (plan, devices):  # priced once per plan (called every step)
            node_of = self.node_of(list(devices))
            self.predicted_s = snapshot_seconds(plan, self.mc, cluster, node_of)
            self._priced = (plan, devices)
        cost = max(self.predicted_s, self.observed_s or 0.0)
        self.interval = snapshot_interval(cost, step_s, budget)
        return self.interval

    def observe(self, seconds: float) -> None:
        """Feed what a committed snapshot took (smoothed over the last few)."""
        old = self.observed_s
        self.observed_s = seconds if old is None else 0.7 * old + 0.3 * seconds

    def due(self, step: int) -> bool:
        """Whether ``step``'s update is to be committed (every :attr:`interval` steps)."""
        return step - self.version >= self.interval

    def layouts(self, plan: GlobalPlan) -> dict[str, tuple[StagePlan, list[int] | None]]:
        """Per training stage of ``plan``: the unit snapshot (as a one-unit StagePlan) and
        its buddy devices (None: the stage is not exposed, or there is no other device)."""
        devices = sorted(self.group.device_worker)
        node_of = self.node_of(devices)
        out = {}
        for sp in plan.stages:
            if not sp.trains:
                continue
            unit = sp.units[0]
            one = StagePlan(sp.stage, sp.model, True, 1, sp.tp, sp.pp, (unit,))
            out[sp.stage] = (one, buddies(unit, devices, node_of) if exposed(sp, node_of) else None)
        return out

    def take(self, plan: GlobalPlan, version: int) -> dict[str, float]:
        """Keep version ``version`` of every training stage of ``plan`` (own copies, and
        mirrors where exposed) and commit it once all ranks have it.

        Raises:
            WorkerLostError, WorkerTimeoutError, RemoteError: a worker failed before the
                version was committed (the previous one stays committed).
        """
        self.begin(plan, version)
        return self.finish()

    @property
    def pending(self) -> bool:
        """Whether a snapshot was sent (:meth:`begin`) and not yet committed."""
        return self._pending is not None

    def abandon(self) -> None:
        """Forget a snapshot sent and not committed (a worker died meanwhile)."""
        self._pending = None

    def begin(self, plan: GlobalPlan, version: int) -> None:
        """Send the snapshot of version ``version`` (see :meth:`take`), not waiting: the
        workers take it in their command order, before anything the driver sends them
        after, and :meth:`finish` commits it. The driver thus pays no round trip of its
        own for it; the state must not change (no training) before :meth:`finish`."""
        self._pending = None
        g = self.group
        pend = []
        held = {}
        tag, self._next_tag = self._next_tag, self._next_tag + 1
        alive = set(g.workers)
        for stage, (one, bud) in self.layouts(plan).items():
            src = g.desc(one)
            dst = None
            workers = g.ranks(one.units[0])
            if bud is not None:
                mirror = StagePlan(stage, one.model, True, 1, one.tp, one.pp, (tuple(bud),))
                dst = g.desc(mirror)
                workers += g.ranks(bud)
            keepers = self._keepers.setdefault(stage, set())
            # older versions on workers off this layout are pruned by the same call
            call = sorted((set(workers) | keepers) & alive)
            pend.append(g.driver.submit(call, "rl.snapshot", stage, tag, src, dst, self.tag))
            others = []
            # With a mirror, unit 0's shards each have two copies on two nodes: any one
            # death (worker or node) leaves one, so the other units' copies would only
            # add a host copy per step. Without one, they are what covers unit 0.
            for u in plan.stage(stage).units[1:] if bud is None else ():
                other = StagePlan(stage, one.model, True, 1, one.tp, one.pp, (u,))
                ws = g.ranks(u)
                pend.append(
                    g.driver.submit(ws, "rl.snapshot", stage, tag, g.desc(other), None, self.tag)
                )
                others.append(tuple(ws))
            self._keepers[stage] = set(workers).union(*others)
            held[stage] = Held(
                stage, one.model, one.tp, one.pp, tuple(g.ranks(one.units[0])),
                None if bud is None else tuple(g.ranks(bud)), tuple(others),
            )  # fmt: skip
        self._pending = (pend, held, version, tag)

    def finish(self) -> dict[str, float]:
        """Wait for the snapshot :meth:`begin` sent and commit it (empty: none pending).

        Raises:
            WorkerLostError, WorkerTimeoutError, RemoteError: a worker failed before the
                version was committed (the previous one stays committed).
        """
        if self._pending is None:
            return {}
        pend, held, version, tag = self._pending
        self._pending = None
        g = self.group
        copy_s = total_s = sent = 0.0
        for p in pend:
            for rep in g.driver.wait(p).values():
                copy_s = max(copy_s, rep["copy_s"])
                total_s = max(total_s, rep["seconds"])
                sent += rep["bytes_sent"]
        self.held, self.version, self.tag = held, version, tag
        return {"snapshot_copy_s": copy_s, "snapshot_worker_s": total_s, "mirror_bytes": sent}

    def full_states(
        self, lost: set[int], initial: dict[str, dict[str, torch.Tensor]]
    ) -> dict[str, dict[str, torch.Tensor]]:
        """Every model's full state at the committed version, read back from the workers
        not in ``lost``: each shard from its holder, else its buddy.

        The reference is always the initial weights; before the first version every
        model is its initial state.

        Raises:
            SnapshotLostError: a shard has neither copy left (say which and what to do).
        """
        out = dict(initial)
        if not self.held:  # nothing taken yet: the initial states are the version
            return out
        for h in self.held.values():
            whole = [u for u in (h.holders, *h.others) if not set(u) & lost]
            if whole:  # a unit whose every rank kept its own copy
                shards = [
                    self.group.driver.call([w], "rl.snapshot_get", h.stage, self.tag, "own")[w]
                    for w in whole[0]
                ]
                out[h.model] = assemble(self.mc, h, shards)
                continue
            sources = []
            for i, w in enumerate(h.holders):
                if w not in lost:
                    sources.append((w, "own"))
                elif h.buddies is not None and h.buddies[i] not in lost:
                    sources.append((h.buddies[i], "mirror"))
                else:
                    raise SnapshotLostError(
                        f"shard {i} of {h.stage!r} (version {self.version}) was on worker {w}"
                        + (
                            f" and its mirror on worker {h.buddies[i]}"
                            if h.buddies is not None
                            else " with no mirror"
                        )
                        + f"; both are lost ({sorted(lost)}), so the state is gone from "
                        "memory. Restart the run from a checkpoint; with nodes >= 2 the "
                        "mirrors are kept on another node"
                    )
            shards = [
                self.group.driver.call([w], "rl.snapshot_get", h.stage, self.tag, which)[w]
                for w, which in sources
            ]
            out[h.model] = assemble(self.mc, h, shards)
        return out


def assemble(
    mc: ModelConfig, h: Held, shards: list[dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """The full tensors of a stage's state from the shards of each position of its
    unit layout (tp x pp), each written where the layout puts it."""
    specs = tensor_specs(mc, h.model == "critic", with_adam=True)
    lay = Layout(1, h.tp, h.pp, tuple(range(len(shards))), num_layers=mc.num_layers)
    out = {}
    for spec in specs:
        full = torch.empty(spec.shape, dtype=spec.dtype)
        filled = torch.zeros(spec.shape, dtype=torch.bool)
        for pos, shard in enumerate(shards):
            box = lay.box(spec, pos)
            if box is None:
                continue
            index = tuple(slice(a, b) for a, b in box)
            full[index] = shard[spec.name].reshape(full[index].shape)
            filled[index] = True
        if not bool(filled.all()):
            raise SnapshotLostError(f"the snapshot's shards do not cover {spec.name!r}")
        out[spec.name] = full
    return out


class DiskCheckpoint:
    """The last resort: the committed snapshot written to disk every few steps
    (``TrainConfig.checkpoint_every``), for a loss that takes a shard's holder and its
    mirror at once (two workers, or a node with ``nodes=1``).

    Written from the holders' own copies through the driver (each training stage's
    full state, one file, replaced atomically), so it costs a gather and a write per
    checkpoint; read back by a recovery as :meth:`Snapshots.full_states` is.

    Arguments:
        path: the file (its folder is created).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.version: int | None = None

    def write(self, snapshots: Snapshots, initial: dict[str, dict[str, torch.Tensor]]) -> int:
        """Write the committed snapshot; returns the bytes written.

        Raises:
            SnapshotLostError: the snapshot lost a shard already (nothing is written).
        """
        full = snapshots.full_states(set(snapshots.group.driver.check_liveness()), initial)
        trained = {m: full[m] for m in {h.model for h in snapshots.held.values()}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        torch.save({"version": snapshots.version, "states": trained}, tmp)
        os.replace(tmp, self.path)  # a reader never sees half a file
        self.version = snapshots.version
        return self.path.stat().st_size

    def exists(self) -> bool:
        return self.version is not None and self.path.exists()

    def full_states(
        self, lost: set[int], initial: dict[str, dict[str, torch.Tensor]]
    ) -> dict[str, dict[str, torch.Tensor]]:
        """Every model's full state at the checkpoint's step (the reference: initial)."""
        saved = torch.load(self.path, map_location="cpu", weights_only=True)
        return {**initial, **saved["states"]}


def read_checkpoint(
    path: str | Path, models: set[str], steps: int
) -> tuple[int, dict[str, dict[str, torch.Tensor]]]:
    """A disk checkpoint's step and trained states, checked for a run that resumes from it.

    Arguments:
        path: the checkpoint.pt (:class:`DiskCheckpoint`).
        models: the models the run trains (``"actor"``, and PPO's ``"critic"``).
        steps: the run's steps (the checkpoint's step must leave some to run).

    Returns:
        (the step whose update it holds, model -> its full training state).

    Raises:
        ValueError: not a checkpoint of a run like this one (say what differs).
    """
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle, zip and torch errors alike: not a checkpoint
        raise ValueError(
            f"{path} is not a checkpoint torch can read ({type(e).__name__}: {e})"
        ) from None
    version = saved.get("version") if isinstance(saved, dict) else None
    states = saved.get("states") if isinstance(saved, dict) else None
    if not isinstance(version, int) or version < 0 or not isinstance(states, dict):
        raise ValueError(
            f"{path} holds no step and trained states ({{'version': int >= 0, 'states': "
            "{...}}): pass a checkpoint.pt a run wrote"
        )
    if set(states) != models:
        raise ValueError(
            f"{path} holds the states of {sorted(states)}, and this run trains "
            f"{sorted(models)}: resume with the algorithm that wrote it"
        )
    for model, state in states.items():
        if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
        ):
            raise ValueError(f"{path}: the state of {model!r} is not a dict of named tensors")
    if version + 1 >= steps:
        raise ValueError(
            f"{path} holds step {version}, and steps={steps} runs steps 0..{steps - 1}: "
            f"nothing is left to run; pass steps > {version + 1}"
        )
    return version, states
