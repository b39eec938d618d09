"""The RL trainer: PPO, GRPO and ReMax on worker processes, adapting their layout as they run.

``train(...)`` is the project's main job. A driver (this process) runs the RL
loop's control; one worker process per device (``nereus_rl.runtime``) holds
the shards of every model-stage placed on it (:mod:`nereus_rl.trainer.worker`)
and runs that stage's work: rollout generation, reference / critic
inference, training. Where each stage runs and how it is split (dp, tp, pp)
is the current :class:`~nereus_rl.core.globalplan.GlobalPlan`.

One RL step (synchronous mode):

    rollout       sample responses (+ behaviour log-probs; ReMax: greedy baseline)
    reward        rule-based, on the driver
    reference     reference log-probs (PPO: critic values too)
    advantages    on the driver (GRPO group-normalised, PPO GAE, ReMax greedy baseline)
    training      one optimizer step per training stage, batch split over its units
    weight sync   actor_train -> rollout layout, nereus_comm reshard (every step)
    (next rollout sent: it runs while the boundary decides)
    adapt         (safe boundary) controller -> planner -> admission -> transition

Asynchronous mode generates the next step's responses while the current step
trains (one step stale, the behaviour log-probs come from the rollout
weights that sampled them); the weight sync is the safe boundary.

In both modes the rollout that follows a boundary's weight sync is sent before
the boundary decides, since its weights and prompts do not depend on the
decision (``Trainer._run_ahead``): the deciding overlaps it instead of adding to
the step. A move waits for it first (``Trainer.finish_ahead``) and carries the
rollout's synced state; a plan that cannot hold its responses moves first.

The model's state on the workers is held as EMU units
(:mod:`nereus_rl.trainer.units`), and a plan transition runs as EMU primitives
on them. The adaptation loop lives in :mod:`nereus_rl.trainer.adapt.adapter`; a step's
rollout and training work in :mod:`nereus_rl.trainer.step`; the workers as the driver
addresses them in :mod:`nereus_rl.trainer.group`; recovery from a worker's death in
:mod:`nereus_rl.trainer.recover`; the startup calibration in
:mod:`nereus_rl.trainer.calibrate`; the run folder in :mod:`nereus_rl.trainer.report`.
"""

from __future__ import annotations

import logging
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nereus_rl.core.globalplan import GlobalPlan
from nereus_rl.data.prompts import DatasetPrompts, TaskPrompts, dataset_prompts
from nereus_rl.data.rewards import RewardFnError
from nereus_rl.data.tasks import LengthCurriculum, LengthTrace, get_task, warm_start
from nereus_rl.emu.types import EMUStateLostError
from nereus_rl.models.hf import HFWeights
from nereus_rl.models.model import Decoder
from nereus_rl.runtime import Driver, RemoteError, Runtime, WorkerLostError, WorkerTimeoutError
from nereus_rl.trainer.adapt.adapter import Adapter
from nereus_rl.trainer.calibrate import calibrate
from nereus_rl.trainer.config import (
    ALGOS,
    MODES,
    NotEnoughDevicesError,
    TrainConfig,
    TrainConfigError,
    TrainResult,
    UnknownAlgorithmError,
    check_config,
    check_local_devices,
    is_hf_model,
    simple_plan,
    stage_desc,
    stage_names,
)
from nereus_rl.trainer.group import WorkerGroup, sync_weights
from nereus_rl.trainer.recover import RecoveryStateLostError, spare_workers
from nereus_rl.trainer.recover import grow as grow_run
from nereus_rl.trainer.recover import recover as recover_run
from nereus_rl.trainer.recover import restore as restore_run
from nereus_rl.trainer.report import RunLog
from nereus_rl.trainer.snapshot import (
    DiskCheckpoint,
    SnapshotLostError,
    Snapshots,
    read_checkpoint,
)
from nereus_rl.trainer.step import StepWork, head_start
from nereus_rl.trainer.units import TrainerUnits
from nereus_rl.transition import KINDS, TransitionExecutionError

__all__ = [
    "ALGOS",
    "MODES",
    "CapacityLostError",
    "NotEnoughDevicesError",
    "TrainConfig",
    "TrainConfigError",
    "TrainResult",
    "Trainer",
    "UnknownAlgorithmError",
    "check_config",
    "simple_plan",
    "stage_desc",
    "stage_names",
    "train",
]

_LOG = logging.getLogger("nereus_rl.trainer.trainer")


class CapacityLostError(RuntimeError):
    """The devices left after a loss cannot hold the run (no plan fits them). The run
    stops; its committed state is written to disk first, and the message says where and
    how to go on from it (``resume``) on enough devices."""


# Warm-started initial states by (critic, model, task, seed, warm steps): runs in one
# process (tests, benchmarks) that differ only in plan or algorithm share the warm start.
_WARM_CACHE: dict[tuple, dict[str, dict[str, torch.Tensor]]] = {}


def _own_driver(cfg: TrainConfig) -> Runtime:
    """The runtime a trainer starts its own workers with (``cfg.launcher``).

    Ray is imported only for ``launcher="ray"``: the local default needs none.
    """
    if cfg.launcher == "ray":
        from nereus_rl.runtime.ray_runtime import RayDriver

        return RayDriver(
            cfg.ray_address,
            device=cfg.device,
            heartbeat_timeout=cfg.heartbeat_timeout,
            call_timeout=600.0,
        )
    return Driver(heartbeat_timeout=cfg.heartbeat_timeout, call_timeout=600.0)


def _lengths(cfg: TrainConfig):
    if cfg.trace is not None:
        return LengthTrace.from_file(cfg.trace)
    return LengthCurriculum(cfg.length_start, cfg.length_end, cfg.steps)


def run_prompts(cfg: TrainConfig, mc) -> TaskPrompts | DatasetPrompts:
    """A run's prompts: the bundled task's, or (``cfg.data``) the dataset's with its
    tokenizer and reward function, loaded and checked (before any process starts).

    Raises:
        UnknownTaskError; DatasetError, TokenizerError, RewardFnError (naming the file and
        row, the folder or the function); OptionalDependencyError.
    """
    if cfg.data is None:
        return TaskPrompts(get_task(cfg.task))
    lengths = _lengths(cfg)
    return dataset_prompts(
        cfg.data,
        cfg.tokenizer or cfg.model,
        cfg.reward_fn,
        vocab=mc.vocab,
        max_seq_len=mc.max_seq_len,
        max_response_len=max(int(lengths.response_len(s)) for s in range(cfg.steps)),
        prompt_field=cfg.prompt_field,
        answer_field=cfg.answer_field,
    )


class Trainer(StepWork):
    """The driver side of one run: workers, plan, and the RL loop (see the module docstring).

    Arguments:
        cfg: the options (checked with :func:`check_config`).
        driver: a runtime (:class:`~nereus_rl.runtime.base.Runtime`: a local Driver or a
            RayDriver) with at least ``cfg.devices`` workers (tests reuse one); None
            starts workers (``cfg.launcher``) and shuts them down in :meth:`close`.
        log: a :class:`nereus_rl.trainer.report.RunLog` (or None): metrics and decisions go there
            as they happen.
        progress: called after every step with (step, metrics).

    Attributes:
        group: the run's workers (:class:`~nereus_rl.trainer.group.WorkerGroup`).
        units: the EMU units holding the state, once the workers hold it.
        on_recovery_phase: None, or called as ``hook(phase, attempt)`` at each phase of
            a recovery round (:mod:`nereus_rl.trainer.recover`; tests inject faults).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        driver: Runtime | None = None,
        log=None,
        progress: Callable[[int, dict[str, Any]], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.mc = check_config(cfg)
        if driver is None and cfg.launcher == "local":
            check_local_devices(cfg)  # its workers will be spawned here: can it host them?
        self.lengths = _lengths(cfg)
        # The dataset, its tokenizer and the reward function are checked now: bad input
        # stops the run before any process starts.
        self.prompts = run_prompts(cfg, self.mc)
        self.task = self.prompts if isinstance(self.prompts, DatasetPrompts) else self.prompts.task
        self.log = log
        self.progress = progress
        self.result = TrainResult(cfg)
        # the run's prompt generator, and each step's draw (kept for a step run again)
        self.rng = random.Random(cfg.seed)
        self.drawn: dict[int, tuple[int, list]] = {}
        # A resumed run: its checkpoint read and checked before any process starts, and
        # the prompts of the steps before it drawn again from the run's generator, so
        # that every later step draws what the run that wrote it would have drawn.
        self.start_step = 0
        self._resumed: dict[str, dict[str, torch.Tensor]] | None = None
        if cfg.resume is not None:
            trained = {model for _, model, trains in stage_names(cfg.algo) if trains}
            t0 = time.perf_counter()
            try:
                version, self._resumed = read_checkpoint(cfg.resume, trained, cfg.steps)
            except ValueError as e:
                raise TrainConfigError(f"resume: {e}") from None
            self.result.timings["resume_s"] = time.perf_counter() - t0
            self.start_step = version + 1
            for done in range(self.start_step):
                self._draw(done)
            self.drawn.clear()
        # no workers yet: the adapter plans over every configured device until they join
        self.group = WorkerGroup(driver, device=cfg.device)
        # Planned before any process starts, so that too few devices or too little
        # memory is reported at once.
        self.adapter = Adapter(
            cfg, self.mc, self.task, self.response_len, host=self, enabled=cfg.adapt
        )
        self.first_plan = self.adapter.initial_plan(self.response_len(0))
        self.plan: GlobalPlan | None = None
        self.units: TrainerUnits | None = None
        self.on_recovery_phase: Callable[[str, int], None] | None = None
        # the committed in-memory snapshot of the training stages (None: cfg.mirror off)
        self.snapshots: Snapshots | None = None
        self._initial: dict[str, dict[str, torch.Tensor]] = {}
        # A step's update is under way and not committed to the snapshot: the units may
        # hold it half applied, so a loss now restores the snapshot (recover).
        self._dirty = False
        # the measured step time, smoothed (None before the first step)
        self._step_ema: float | None = None
        self._disk_checkpoint: DiskCheckpoint | None = None
        # a worker loss at a step's end (its boundary, or the async weight sync): the
        # step is recorded, then recovered from (run)
        self._boundary_loss: Exception | None = None
        # rollouts sent ahead of their step (oldest first; see _step), and the step whose
        # weights the last weight sync gave the rollout (sync mode)
        self._ahead: list[dict[str, Any]] = []
        self._synced_for: int | None = None
        self.own_driver = driver is None
        self.driver = driver or _own_driver(cfg)
        self.group.driver = self.driver

    @property
    def workers(self) -> list[int]:
        """The run's workers, in plan-device order."""
        return self.group.workers

    @property
    def device_worker(self) -> dict[int, int]:
        """Plan device id -> worker (changes after a loss), less the devices whose worker
        the runtime says is going away (a Ray node draining: ``draining_workers``).

        The adaptation loop plans over these devices only, so a plan on a draining node
        is infeasible there and the next boundary moves off it at once (the urgent
        path) while its workers still run.
        """
        dw = self.group.device_worker
        draining = getattr(getattr(self, "driver", None), "draining_workers", None)
        gone = draining() if draining is not None and dw else ()
        return {d: w for d, w in dw.items() if w not in gone} if gone else dw

    @property
    def world_rank(self) -> dict[int, int]:
        """Plan device id -> rank in the workers' default group (changes after a loss)."""
        return self.group.world_rank

    # ------------------------------------------------------------------ setup

    def start(self, plan: GlobalPlan | None = None) -> None:
        """Spawn/attach workers, warm-start the policy, choose the first plan, build stages.

        A worker that dies after joining (during the group's forming, the calibration or
        the stages' setup) is recovered from: the stages are set up from the initial
        states on a plan over the survivors (with ``mirror``; else the error ends the run).
        """
        cfg = self.cfg
        if cfg.save_every and self.save_root() is None:
            raise TrainConfigError("save_every needs save_dir, or a run folder to write to")
        # The warm start runs on the driver alone, before any worker exists: a worker
        # that died while the driver was busy with it would be noticed only after.
        self._initial = self._initial_states()
        t0 = time.perf_counter()
        if self.own_driver:
            self.driver.start_workers(cfg.devices)
        workers = sorted(self.driver.workers)[: cfg.devices]
        if len(workers) < cfg.devices:
            raise NotEnoughDevicesError(
                f"{cfg.devices} devices asked but only {len(workers)} workers joined"
            )
        self.group.attach(workers)
        self._log_workers(self.start_step)
        # The stages' shards will be EMU units' tensors (no copy is made).
        live = KINDS if cfg.transitions == "emu" else ()

        def units() -> TrainerUnits:
            return TrainerUnits(self.group, self.mc, self.adapter.cm, live_kinds=live)

        if cfg.mirror:
            # Devices that arrive (max_devices) make nodes of the same size after these.
            per = cfg.devices // cfg.nodes
            nodes = -(-cfg.device_cap // per)
            self.snapshots = Snapshots(self.group, self.mc, per * nodes, nodes)
            # a resumed run's initial states are its checkpoint's step
            self.snapshots.version = self.start_step - 1
        self._dirty = True  # nothing is set up yet: a loss now restores the initial states
        try:
            self.driver.import_module("nereus_rl.trainer.worker")
            self.units = units()  # (its manager sets up the workers' EMU side)
            self.group.init_world()
            self.result.timings["spawn_s"] = time.perf_counter() - t0
            if plan is None and cfg.calibration_probes and (cfg.adapt or cfg.plan == "auto"):
                self._calibrate(self._initial)
            t0 = time.perf_counter()
            if cfg.adapt:
                # After calibration: the model (and budget) the run's decisions start from.
                self.adapter.prepare_buckets(self.response_len(0))
            self._set_plan(self.start_step, plan or self.first_plan)
            self._setup(self.plan, self._initial)
            self.units.adopt(self.plan)
            self.result.timings["setup_s"] = time.perf_counter() - t0
        except (WorkerLostError, WorkerTimeoutError, RemoteError) as e:
            if self.snapshots is None:
                raise
            # the survivors have the commands even if the death cut the import short
            self.driver.import_module("nereus_rl.trainer.worker")
            if self.units is None:
                self.units = units()
            self.recover(self.start_step, e)
        self._dirty = False

    def _setup(self, plan: GlobalPlan, full: dict[str, dict[str, torch.Tensor]]) -> None:
        """Build ``plan``'s stages on the workers from the full states ``full``."""
        descs = [self.group.desc(sp) for sp in plan.stages]
        self.group.call_all("rl.setup", descs, self.mc, full, self.cfg.hyper())

    def _calibrate(self, full: dict[str, dict[str, torch.Tensor]]) -> None:
        """Measure probe plans on these workers before the first decision
        (:mod:`nereus_rl.trainer.calibrate`); the first plan is then chosen again with
        what was measured. The probes draw prompts of their own and leave the trainer's
        plan as it was: the run's prompt stream and state do not depend on them."""
        cfg = self.cfg
        saved = self.rng, self.drawn, self.plan
        self.rng, self.drawn = random.Random(cfg.seed * 7919 + 1), {}

        def setup(plan: GlobalPlan) -> None:
            self.plan = plan
            self._setup(plan, full)

        def step(rlen: int) -> dict[str, Any]:
            sync = self.weight_sync()
            m = self._train_on(self._rollout_wait(self._rollout_submit(0, rlen=rlen)))
            m.update(sync)
            return m

        try:
            rec, observed = calibrate(
                self.adapter, setup, step,
                first_len=self.response_len(0), buckets=cfg.buckets, algo=cfg.algo,
                worker_inference=cfg.mode == "async", num_probes=cfg.calibration_probes,
            )  # fmt: skip
        finally:
            self.rng, self.drawn, self.plan = saved
        self.result.calibration = rec
        self.result.timings["calibration_s"] = rec["seconds"]
        self.adapter.calibrated(observed)
        self.first_plan = self.adapter.initial_plan(self.response_len(0))

    def _initial_states(self) -> dict[str, dict[str, torch.Tensor] | HFWeights]:
        """The initial states (``actor``, ``reference``, ``critic``): a Hugging Face
        folder's weights, which each worker reads its slices of (the critic's trunk too,
        with a fresh value head); else a preset's warm-started full states (on a prompt
        dataset, its seed's initial weights: the warm start is the bundled tasks')."""
        cfg = self.cfg
        t0 = time.perf_counter()
        if is_hf_model(cfg.model):
            src = HFWeights(str(Path(cfg.model).resolve()))
            out: dict[str, Any] = {"actor": src, "reference": src}
            if cfg.algo == "ppo":
                out["critic"] = HFWeights(src.path, seed=cfg.seed + 1)
            self.result.timings["warm_start_s"] = time.perf_counter() - t0
            return self._resume_over(out)
        key = (cfg.algo == "ppo", cfg.model, cfg.task, cfg.data, cfg.seed, cfg.warm_steps)
        if key not in _WARM_CACHE:
            if len(_WARM_CACHE) > 8:
                _WARM_CACHE.clear()
            _WARM_CACHE[key] = self._warm_start()
        self.result.timings["warm_start_s"] = time.perf_counter() - t0
        return self._resume_over(_WARM_CACHE[key])

    def _resume_over(self, initial: dict[str, Any]) -> dict[str, Any]:
        """``initial`` with a resumed run's trained states in place of their models'
        (the reference stays the initial weights), each checked against the model's.

        Raises:
            TrainConfigError: the checkpoint is of another model (a weight missing or of
                another shape).
        """
        if self._resumed is None:
            return initial
        for model, state in self._resumed.items():
            if not isinstance(initial.get(model), dict):
                continue  # a Hugging Face folder's lazy weights: checked as workers load
            for name, weight in initial[model].items():
                got = state.get(name)
                if got is None or got.shape != weight.shape or got.dtype != weight.dtype:
                    have = "missing" if got is None else f"{tuple(got.shape)} {got.dtype}"
                    raise TrainConfigError(
                        f"resume: {self.cfg.resume} is not a checkpoint of this model: "
                        f"{model} weight {name!r} is {have}, the model's is "
                        f"{tuple(weight.shape)} {weight.dtype}"
                    )
        return {**initial, **self._resumed}

    def _warm_start(self) -> dict[str, dict[str, torch.Tensor]]:
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        policy = Decoder(self.mc, seed=cfg.seed)
        if cfg.data is None:
            warm_start(policy, self.task, steps=cfg.warm_steps, seed=cfg.seed)
        actor = {k: v.detach().clone() for k, v in policy.shard_state_dict().items()}
        out = {"actor": actor, "reference": actor}
        if cfg.algo == "ppo":
            critic = Decoder(self.mc, value_head=True, seed=cfg.seed + 1)
            critic.load_shard_state_dict(
                {k: v for k, v in actor.items() if k != "lm_head.weight"}, strict=False
            )
            out["critic"] = {k: v.detach().clone() for k, v in critic.shard_state_dict().items()}
        return out

    def _set_plan(self, step: int, plan: GlobalPlan) -> None:
        self.plan = plan
        self.result.plans.append((step, plan))
        if self.log is not None:
            self.log.plan(step, plan)

    def _commit_snapshot(self) -> dict[str, Any]:
        """Commit the snapshot sent after the last update, if one is pending (then the
        state is that snapshot's: not dirty), and write the disk checkpoint when due.
        Returns what it measured, for the step's metrics."""
        snaps = self.snapshots
        if snaps is None or not snaps.pending:
            return {}
        t0 = time.perf_counter()
        out: dict[str, Any] = snaps.finish()
        out["snapshot_commit_s"] = time.perf_counter() - t0
        # what it took: the workers' part and the driver's wait for it
        snaps.observe(out.get("snapshot_worker_s", 0.0) + out["snapshot_commit_s"])
        self._dirty = False
        v = snaps.version
        # no step at or before a committed one runs again
        self.drawn = {s: d for s, d in self.drawn.items() if s > v}
        every = self.cfg.checkpoint_every
        # Due when the committed step crossed a multiple of checkpoint_every since the
        # last one written: snapshots taken every few steps (snapshot_budget) need not
        # land on a multiple.
        disk = self._disk_checkpoint
        written = disk is not None and disk.version is not None
        last = disk.version if written else self.start_step - 1
        if every and (v + 1) // every > (last + 1) // every:
            t_disk = time.perf_counter()
            try:
                out["checkpoint_bytes"] = self._disk().write(snaps, self._initial)
            except SnapshotLostError as e:  # the disk keeps the last one written
                _LOG.warning("no disk checkpoint of step %d: %s", v, e)
            out["checkpoint_s"] = time.perf_counter() - t_disk
        return out

    def _checkpoint_dir(self) -> Path | None:
        """Where disk checkpoints go: checkpoint_dir, else the run folder (None: neither)."""
        if self.cfg.checkpoint_dir is not None:
            return Path(self.cfg.checkpoint_dir)
        return None if self.log is None else Path(self.log.dir)

    def _disk(self) -> DiskCheckpoint:
        if self._disk_checkpoint is None:
            where = self._checkpoint_dir()
            if where is None:
                raise TrainConfigError(
                    "checkpoint_every needs checkpoint_dir, or a run folder to write to"
                )
            self._disk_checkpoint = DiskCheckpoint(where / "checkpoint.pt")
        return self._disk_checkpoint

    def _price_snapshot(self, step: int) -> float:
        """The cost model's price of the current plan's snapshot (seconds), and the
        snapshot interval that keeps it within ``cfg.snapshot_budget`` of a step.

        Before anything is measured, the step is the cost model's prediction; then the
        measured step and snapshot times take over (:meth:`Snapshots.price`): on a small
        model a snapshot's fixed costs (a command, a reshard's set-up) outweigh its bytes,
        which the model prices.
        """
        snaps = self.snapshots
        step_s = self._step_ema
        if step_s is None:
            cm = self.adapter.cm
            step_s = cm.step_total(self.plan, self.adapter.workload(self.response_len(step)))
        snaps.price(self.plan, self.adapter.cm.cluster, step_s, self.cfg.snapshot_budget)
        return snaps.predicted_s

    def _log_workers(self, step: int) -> None:
        if self.log is not None:
            infos = self.driver.infos
            self.log.workers(step, {d: infos[w].pid for d, w in self.group.device_worker.items()})

    def log_decision(self, row: dict[str, Any]) -> None:
        """Record a decision row in the result and the run folder."""
        self.result.decisions.append(row)
        if self.log is not None:
            self.log.decision(row)

    def _submit_stage(self, fn: str, stage: str, *args, **kwargs):
        """Send a stage command (``rl.generate``, ``rl.infer``, ``rl.train``) to the
        stage's own workers only; do not wait.

        Its collectives are over the stage's groups alone, so no other worker needs the
        command. Sent to every worker, a worker running another stage's command would
        answer only after that command: in async mode the rollout's workers would hold
        every reference and training reply back until the next step's rollout ended, and
        rollout would overlap nothing on disjoint devices. Every worker still sees the
        commands it gets in the driver's one order, so collectives stay in step.
        """
        ranks = self.group.ranks(sorted(self.plan.stage(stage).devices))
        return self.driver.submit(ranks, fn, stage, *args, **kwargs)

    def response_len(self, step: int) -> int:
        """The response length limit of ``step`` (the trace's or the curriculum's)."""
        return int(self.lengths.response_len(step))

    # ------------------------------------------------------------------ work

    def weight_sync(self) -> dict[str, float]:
        """actor_train -> rollout (PPO: critic_train -> critic_inference too) through
        nereus_comm reshard, collective over the workers; never a gather on one rank
        (:func:`~nereus_rl.trainer.group.sync_weights` on the current plan)."""
        return sync_weights(self.group, self.plan)

    def transition(self, new: GlobalPlan, dag, step: int):
        """Move every changed stage's state to its new layout by running the transition
        DAG's EMU primitives on the units holding it (:meth:`TrainerUnits.run`).

        Weights (and a training stage's Adam moments and step) travel by nereus_comm
        reshard inside the primitives; nothing is rebuilt from scratch.

        Arguments:
            new: the target plan.
            dag: its compiled transition DAG (None: per-stage reshards).
            step: the first step run on ``new``.

        Returns:
            The :class:`~nereus_rl.trainer.units.TransitionRun`.
        """
        self.finish_ahead()
        try:
            run = self.units.run(self.plan, new, dag)
        except TransitionExecutionError as e:
            # A worker lost mid-transition is handled as one lost mid-step: the models
            # of the current plan are untouched until the rebind, so :meth:`recover`
            # rebuilds from their intact units.
            if isinstance(e.__cause__, (WorkerLostError, WorkerTimeoutError, RemoteError)):
                raise e.__cause__ from e
            lost = tuple(w for w in self.driver.check_liveness() if w in self.workers)
            if lost:  # a primitive refused the lost worker's ranks before moving anything
                raise WorkerLostError(
                    f"worker(s) {list(lost)} died during a transition: {e}", lost
                ) from e
            raise
        self._set_plan(step, new)
        return run

    def finish_ahead(self) -> None:
        """Wait for the rollouts sent ahead (their responses are kept for their steps).

        One runs on the current plan's rollout workers, so a transition waits for it
        first (:meth:`transition`; the boundary's move calls this before its clock
        starts, so that the move is timed alone).
        """
        self._ahead = [j if "sequences" in j else self._rollout_wait(j) for j in self._ahead]

    def recover(self, step: int, error: Exception) -> int:
        """Continue after a worker died, and return the step to go on from.

        From the units where they hold the state (:func:`nereus_rl.trainer.recover.recover`:
        a new default group over the survivors, a plan over the remaining devices, every
        stage's state rebuilt from its units that lost no device); from the committed
        in-memory snapshot (:func:`nereus_rl.trainer.recover.restore`) where a stage lost
        every unit, or the death came while a step's update was under way or during
        start-up. The snapshot is then taken again on the new plan, so that the next
        death finds every copy on a survivor.

        Raises:
            the original error: no worker was lost, or (``mirror`` off) some stage lost
            its state. SnapshotLostError: a shard lost its holder and its mirror, and
            there is no disk checkpoint (``checkpoint_every``) to go back to.
        """
        snaps = self.snapshots
        noticed_at = time.time()
        if snaps is not None and snaps.pending:
            # The snapshot sent after the last update may be whole yet (the dead worker
            # held none of it): committed, the state is its own again.
            try:
                self._commit_snapshot()
            except (WorkerLostError, WorkerTimeoutError, RemoteError):
                snaps.abandon()

        def plan_for(devices: list[int]) -> GlobalPlan:
            try:
                return self.adapter.best_plan(self.response_len(step), devices=devices)[0]
            except NotEnoughDevicesError as e:
                raise self._capacity_lost(e) from None

        why, noticed = None, False
        if snaps is not None and self._dirty:
            why = "a worker died while a step's update or the start-up was under way"
        else:
            try:
                new, row = recover_run(
                    self.group, self.units, self.plan, step, error,
                    cfg=self.cfg, mc=self.mc, plan_for=plan_for,
                    on_phase=self.on_recovery_phase,
                )  # fmt: skip
                resume = step
            except (RecoveryStateLostError, EMUStateLostError) as e:
                if snaps is None:
                    raise
                why, noticed = f"{type(e).__name__}: {e}", True
        if why is not None:
            try:
                new, row, resume = restore_run(
                    self.group, self.units, snaps, self.plan, step, error,
                    cfg=self.cfg, mc=self.mc, plan_for=plan_for, initial=self._initial,
                    why=why, noticed=noticed,
                )  # fmt: skip
            except SnapshotLostError as lost:
                disk = self._disk_checkpoint
                if disk is None or not disk.exists():
                    raise
                # Both copies of a shard are gone: the last disk checkpoint is the state.
                new, row, resume = restore_run(
                    self.group, self.units, disk, self.plan, step, error,
                    cfg=self.cfg, mc=self.mc, plan_for=plan_for, initial=self._initial,
                    why=f"{why}; {lost}; from the disk checkpoint", noticed=True,
                )  # fmt: skip
                row["from_disk"] = str(disk.path)
                snaps.version, snaps.held = disk.version, {}
        # wall clock, so that a drill can time detection from its own kill
        row["recovery_started_at"] = noticed_at
        if resume < step:
            # Steps after the snapshot's are undone and run again (their rows in
            # metrics.jsonl stay, as what happened; the result keeps the re-run's).
            row["rolled_back_steps"] = list(range(resume, step))
            self.result.metrics = [m for m in self.result.metrics if m["step"] < resume]
        self._set_plan(resume, new)
        self._log_workers(resume)
        self.log_decision(row)
        self._dirty = False
        if snaps is not None and snaps.version >= 0:
            try:
                snaps.take(new, snaps.version)
            except (WorkerLostError, WorkerTimeoutError, RemoteError) as e:
                return self.recover(resume, e)
        return resume

    def _capacity_lost(self, error: NotEnoughDevicesError) -> CapacityLostError:
        """The error that stops a run whose survivors cannot hold it, once its committed
        snapshot is on disk (checkpoint_dir, else the run folder, else a new temporary
        folder), where a run with ``resume`` goes on from it. If the snapshot cannot be
        written (a shard lost both copies), an older disk checkpoint, else the resumed
        one, is where the run goes on from."""
        snaps = self.snapshots
        saved, why = None, "no snapshot was taken yet"
        if snaps is not None and snaps.held:
            disk = DiskCheckpoint(
                (self._checkpoint_dir() or Path(tempfile.mkdtemp(prefix="nereus-")))
                / "checkpoint.pt"
            )
            try:
                disk.write(snaps, self._initial)
                saved = disk
            except (SnapshotLostError, WorkerLostError, WorkerTimeoutError, RemoteError,
                    OSError) as e:  # fmt: skip
                why = f"its last snapshot could not be saved ({type(e).__name__}: {e})"
        older = self._disk_checkpoint
        if saved is None and older is not None and older.exists():
            saved = older
        if saved is not None:
            return CapacityLostError(
                f"{error} The run stops; its state after step {saved.version} is saved in "
                f"{saved.path}: on enough devices, run again with resume={str(saved.path)!r} "
                f"(nereus-rl train --resume {saved.path}) and the same options to go on from "
                f"step {saved.version + 1}."
            )
        if self.cfg.resume is not None:
            kept = f"{why}; its state is still that of {self.cfg.resume}"
        else:
            kept = f"{why}, and nothing is on disk: the run starts over"
        return CapacityLostError(f"{error} The run stops: {kept} on enough devices.")

    # ------------------------------------------------------------------ loop

    def run(self) -> TrainResult:
        """Run every step (metrics and decisions are logged as they happen)."""
        cfg = self.cfg
        self._ahead = []
        self._synced_for = None
        step = self.start_step
        while step < cfg.steps:
            try:
                self._step(step)
            except (WorkerLostError, WorkerTimeoutError, RemoteError) as e:
                # the step is run again on the new plan, its rollouts sent again there
                self._ahead, self._synced_for = [], None
                step = self.recover(step, e)
                continue
            step += 1
            if cfg.save_every and step % cfg.save_every == 0 and step < cfg.steps:
                self.save(f"step-{step:06d}")
            if step == cfg.steps:  # the last step's snapshot: nothing runs after it
                try:
                    self._commit_snapshot()
                except (WorkerLostError, WorkerTimeoutError, RemoteError):
                    self.snapshots.abandon()
            lost, self._boundary_loss = self._boundary_loss, None
            if lost is not None:  # the step finished; its boundary's transition did not
                # A finished rollout stays valid (its weights were the ones to use); one
                # still running may wait on the lost worker, so it is sent again.
                self._ahead = [j for j in self._ahead if "sequences" in j]
                self._synced_for = None
                resume = self.recover(step, lost)
                if resume != step:  # rolled back further: those rollouts are not its
                    self._ahead, step = [], resume
        if cfg.save_every or is_hf_model(cfg.model):
            self.save("final")
        return self.result

    def save_root(self) -> Path | None:
        """Where the Hugging Face folders go: ``save_dir``, else the run folder (None:
        neither, nothing is saved)."""
        if self.cfg.save_dir is not None:
            return Path(self.cfg.save_dir)
        return None if self.log is None else self.log.dir

    def save(self, label: str) -> Path | None:
        """Write the policy (actor_train's live shards) and PPO's critic as Hugging Face
        folders: ``ROOT/policy`` and ``ROOT/critic`` for ``label == "final"``, else
        ``ROOT/saved/LABEL/...`` (ROOT: :meth:`save_root`). The tokenizer of a prompt
        dataset is written beside the policy. Each pipeline stage's file is written by a
        worker of that stage; none gathers the model. Returns the folder (None: no root).
        """
        root = self.save_root()
        if root is None:  # (save_every without one is refused at start)
            return None
        base = root if label == "final" else root / "saved" / label
        t0 = time.perf_counter()
        pend = []
        stages = (("actor_train", "policy"), ("critic_train", "critic"))
        for stage, name in stages if self.cfg.algo == "ppo" else stages[:1]:
            pend.append(self._submit_stage("rl.save_hf", stage, str(base / name)))
        for p in pend:
            self.driver.wait(p)
        if isinstance(self.prompts, DatasetPrompts):
            self.prompts.tokenizer.save(base / "policy")
        row = {"saved": label, "path": str(base), "seconds": time.perf_counter() - t0}
        self.result.saves.append(row)
        _LOG.info("saved %s to %s", label, base)
        return base

    def _step(self, step: int) -> None:
        """One RL step and its safe boundary.

        The rollouts sent ahead of their step wait in ``self._ahead`` (oldest first):
        the next step's rollout runs while this step trains (async), and the rollout
        that follows the boundary's weight sync is sent before the boundary decides
        (:meth:`_run_ahead`), so the deciding overlaps it.
        """
        cfg = self.cfg
        t_step = time.perf_counter()
        sync: dict[str, float] = {}
        ahead = self._ahead
        if not ahead:  # the first step, the first after a recovery, or none sent ahead
            if step == 0 or (cfg.mode == "sync" and self._synced_for != step):
                sync = self.weight_sync()
            ahead.append(self._rollout_submit(step))
        job = ahead.pop(0)
        head = 0.0
        if cfg.mode == "sync":  # the step's own rollout is its first phase
            job, head = self._rollout_ready(job, t_step)
        elif "sequences" not in job:  # async: only the first step waits for its own
            job = self._rollout_wait(job)
        if cfg.mode == "async" and step + 1 < cfg.steps and not ahead:
            # The next step's rollout runs on the current rollout weights while this
            # step trains (on disjoint devices the two overlap).
            ahead.append(self._rollout_submit(step + 1))
        # The last step's snapshot is committed before this step's update is sent.
        committed = self._commit_snapshot()
        self._dirty = True
        m = self._train_on(job)
        m.update(committed)
        snaps = self.snapshots
        if snaps is not None:
            m["snapshot_s"] = 0.0
            m["snapshot_predicted_s"] = self._price_snapshot(step)
            if snaps.due(step):
                # Sent now, committed before the next update (or by a recovery): the
                # workers take it before anything sent after, and the driver waits on
                # it only then, when it is long done. Until then the step is not
                # committed: a loss rolls back to the last snapshot and runs it again.
                t_snap = time.perf_counter()
                snaps.begin(self.plan, step)
                m["snapshot_s"] = time.perf_counter() - t_snap
        else:
            self._dirty = False
        m["held_bytes_max"] = None  # unmeasured when a worker dies before it is read
        try:
            # measured bytes of model state (weights, Adam moments) on the fullest worker
            # (before the weight sync, which loads in place: the same bytes)
            m["held_bytes_max"] = max(self.group.call_all("rl.held_bytes").values())
            if ahead:  # async: the next step's rollout ends before the rollout weights change
                ahead[0], head = self._rollout_ready(ahead[0], t_step)
            if step + 1 < cfg.steps:
                # sync: the next step's weights; async: the step after next's (its
                # rollout is the one sent ahead next). A step records one sync, as the
                # cost model prices it (step 0 also ran the first one, before its rollout).
                sync = self.weight_sync()
                self._synced_for = step + 1
                self._run_ahead(step + 1 if cfg.mode == "sync" else step + 2)
        except (WorkerLostError, WorkerTimeoutError, RemoteError) as e:
            # The step trained already: as a loss at its boundary (below), recovered from
            # after the step is recorded (recovery syncs the weights in async mode).
            self._boundary_loss = e
        m.update(sync)
        m.update(
            step=step,
            response_len=job["rlen"],
            # the left-padded batch's prompt columns: what the cost model prices the step at
            prompt_len=job["sequences"].shape[1] - job["mask"].shape[1],
            level=job["level"],
            plan=repr(self.plan),
            num_devices=len(self.plan.devices),
        )
        m["step_s"] = time.perf_counter() - t_step
        # the part of the step's critical rollout that ran before the step began, during
        # the previous boundary: the step as the cost model prices it is step_s + this
        m["head_start_s"] = head
        m["transition_s"] = 0.0
        # The boundary's whole time, the transition included: what deciding (signals,
        # planner, lookahead, admission, DAG compiles) adds to a step beyond the
        # transition is decision_s; a fixed plan's boundary only observes.
        m["boundary_s"] = 0.0
        if step + 1 < cfg.steps and self._boundary_loss is None:
            t_boundary = time.perf_counter()
            try:
                grown = self.grow(step)
                if grown:
                    m["grow_s"] = grown
                m.update(self.adapter.boundary(step, m))
            except (WorkerLostError, WorkerTimeoutError, RemoteError) as e:
                # The step trained already: it is recorded and recovered from after, not
                # run again (its update would be applied twice).
                self._boundary_loss = e
            m["boundary_s"] = time.perf_counter() - t_boundary
        m["decision_s"] = max(0.0, m["boundary_s"] - m["transition_s"] - m.get("grow_s", 0.0))
        if step > 0:  # step 0 pays the first weight sync and warm-ups
            s = m["step_s"]
            self._step_ema = s if self._step_ema is None else 0.7 * self._step_ema + 0.3 * s
        self.result.metrics.append(m)
        if self.log is not None:
            self.log.metrics(m)
        if self.progress is not None:
            self.progress(step, m)

    def arrivals(self) -> list[int]:
        """Workers that arrived and that the run could admit now (up to ``max_devices``;
        none on a draining node). On Ray, actors are first placed on capacity that
        arrived in the cluster (:meth:`RayDriver.place_arrivals
        <nereus_rl.runtime.ray_runtime.RayDriver.place_arrivals>`), in the background."""
        cap = self.cfg.device_cap
        room = cap - len(self.group.device_worker)
        place = getattr(self.driver, "place_arrivals", None)
        if place is not None and room > 0 and cap > self.cfg.devices:
            place(room - len(spare_workers(self.group, cap)))
        draining = getattr(self.driver, "draining_workers", None)
        gone = draining() if draining is not None else ()
        return spare_workers(self.group, cap, gone)

    def grow(self, step: int) -> float:
        """Admit the workers that arrived at ``step``'s boundary, before it decides
        (:func:`nereus_rl.trainer.recover.grow`): the devices signal then sees them, and
        the planner may move onto them by Extend. Returns the seconds it took (0.0: none
        arrived, nothing was done).

        The rollout sent ahead runs on the current group, so it is waited for first; the
        committed snapshot is taken again on the new group (as after a recovery).
        """
        if not self.arrivals():
            return 0.0
        t0 = time.perf_counter()
        self.finish_ahead()
        snaps = self.snapshots
        if snaps is not None and snaps.pending:
            self._commit_snapshot()
        draining = getattr(self.driver, "draining_workers", None)
        row = grow_run(
            self.group, self.units, self.plan, step, cfg=self.cfg, mc=self.mc,
            exclude=draining() if draining is not None else (),
        )  # fmt: skip
        if row is None:
            return 0.0
        self._log_workers(step + 1)
        self.log_decision(row)
        if snaps is not None and snaps.version >= 0:
            snaps.take(self.plan, snaps.version)
        return time.perf_counter() - t0

    def _run_ahead(self, step: int) -> None:
        """Send ``step``'s rollout now, before the boundary decides, when the current
        plan can run it.

        Its weights are the ones it would get after the boundary: the weight sync ran,
        and a transition carries the rollout's state as it is (``transition`` waits for
        the rollout first, so the move is timed alone). Its data is the same too (the
        prompts are sampled in step order, the sampling seed is the step's). A plan
        the cost model says cannot hold the step's responses must move first (the
        urgent path), so then the rollout is sent after the boundary, on the new plan.
        """
        if step < self.cfg.steps and self.adapter.can_run(self.plan, self.response_len(step)):
            self._ahead.append(self._rollout_submit(step))

    def _rollout_ready(self, job, t_step: float):
        """``job`` with its responses (waiting for them if they are not in) and its
        head start: how much sooner the step's rollout ends than had it been sent when
        the step began (:func:`~nereus_rl.trainer.step.head_start`)."""
        t_wait = time.perf_counter()
        if "sequences" not in job:
            job = self._rollout_wait(job)
        return job, head_start(t_step, job["submitted_at"], t_wait, job["rollout_s"])

    def close(self) -> None:
        """Release the workers (shut them down when this trainer spawned them)."""
        try:
            if getattr(self, "units", None) is not None:
                self.units.close()
            if self.driver.workers:
                self.driver.call(self.workers, "rl.close", timeout=30.0)
        except Exception:
            pass
        if self.own_driver:
            self.driver.shutdown()


def train(
    algo: str = "grpo",
    model: str | Path = "tiny",
    task: str = "sort",
    devices: int = 4,
    steps: int = 60,
    adapt: bool = True,
    seed: int = 0,
    run_dir: str | Path | None = None,
    mode: str = "sync",
    memory_budget: int | None = None,
    *,
    data: str | Path | None = None,
    reward_fn: str | Callable[..., Any] | None = None,
    save_every: int = 0,
    driver: Runtime | None = None,
    progress: Callable[[int, dict[str, Any]], None] | None = None,
    **options: Any,
) -> TrainResult:
    """Train a policy with PPO, GRPO or ReMax on ``devices`` worker processes.

    Arguments:
        algo: ``"grpo"``, ``"ppo"`` or ``"remax"``.
        model: model preset (``"tiny"``, ``"small"``, ``"medium"``, ``"large"``), or the
            path of a Hugging Face folder (config.json and safetensors weights of a
            LlamaForCausalLM or Qwen2ForCausalLM, its tokenizer beside them): each
            worker reads its own slices of the weights, and the trained policy (PPO: and
            critic) is written back as Hugging Face folders at the end of the run.
        task: bundled task (``"sort"``, ``"reverse"``, ``"addition"``), when no ``data``.
        data: a prompt dataset, JSONL or Parquet, one prompt and ground truth per row
            (fields ``prompt_field``/``answer_field``, default ``prompt`` and ``answer``);
            ``nereus_rl.data.ARITH_WORD`` is a small one shipped with the package.
        reward_fn: scores a dataset's decoded responses: a built-in verifier's name
            (``"numeric"``, ``"exact"``, ``"format"``), ``"module:function"`` or
            ``"path/to/file.py:function"``, or a callable ``fn(prompt, response,
            answer) -> float``. It is called once on the first row before the run starts.
        save_every: also write the policy (and critic) every this many steps, under
            ``RUN/saved/step-N`` (0: at the end only; see ``save_dir``).
        devices: worker processes (one per device), spawned locally unless ``driver``
            already has them.
        steps: RL steps.
        adapt: run the adaptation loop (False: keep the first plan).
        seed: seeds the warm start, the prompts and the sampling.
        run_dir: folder for metrics.jsonl, decisions.jsonl, TensorBoard event files, plots
            and summary (None: none; ``wandb=True`` also logs to Weights & Biases).
        mode: ``"sync"`` or ``"async"`` (rollout one step ahead of training).
        memory_budget: bytes per worker the plan must fit. None: the automatic budget
            (:func:`~nereus_rl.policy.auto_budget.auto_budget`), which a fast start plan fits
            at the first
            response length and not at the run's longest, while another plan does, so
            that growing responses force a move (the situation Nereus is for).
        driver: a runtime (local Driver or RayDriver) whose workers to use (they are
            kept running). None: the trainer starts its own, as ``launcher`` says:
            ``"local"`` (worker processes here, the default) or ``"ray"`` (one Ray actor
            per device on the cluster at ``ray_address``: None for the Ray of this
            process or a new one on loopback, ``"auto"``, or ``HOST:PORT``).
        progress: called after every step with (step, metrics).
        options: further :class:`TrainConfig` fields (batch, group_size, lr, trace, plan,
            admission, transitions, length_start, length_end, device, tokenizer,
            prompt_field, answer_field, save_dir, wandb, wandb_project, ...). ``device="cuda"``
            puts each worker's stages on its own GPU (NCCL for the models' collectives);
            the default ``"cpu"`` keeps them in host memory.

    Returns:
        A :class:`TrainResult`; if a worker or the reward function failed mid-run,
        ``error`` says so and the metrics hold every step finished before.

    Raises:
        TrainConfigError (and the model/task/trace/checkpoint/dataset/tokenizer/reward
        errors, all ValueError, each naming the file and row or the function): bad
        options or input, raised before any process starts.
    """
    try:
        cfg = TrainConfig(
            algo=algo,
            model=str(model),
            task=task,
            devices=devices,
            steps=steps,
            adapt=adapt,
            seed=seed,
            mode=mode,
            memory_budget=memory_budget,
            data=None if data is None else str(data),
            reward_fn=reward_fn,
            save_every=save_every,
            **options,
        )
    except TypeError as e:
        raise TrainConfigError(f"{e}; see TrainConfig for the options") from None
    trainer = Trainer(cfg, driver=driver, progress=progress)  # checks every option
    log = RunLog(run_dir, cfg) if run_dir is not None else None
    trainer.log = log
    try:
        trainer.start()
        trainer.run()
    except (KeyboardInterrupt, RuntimeError, OSError, RewardFnError) as e:
        # A reward function that fails mid-run stops the run like a worker's failure:
        # the run folder keeps every step finished before, and the error.
        trainer.result.error = f"{type(e).__name__}: {e}"
        if log is not None:
            log.error(trainer.result.error)
    finally:
        trainer.close()
        if log is not None:
            trainer.result.run_dir = log.finish(trainer.result)
    return trainer.result
