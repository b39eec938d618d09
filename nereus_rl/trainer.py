"""The RL trainer: PPO, GRPO and ReMax on worker processes, adapting their layout as they run.

``train(...)`` is the project's main job. A driver (this process) runs the RL
loop's control; one worker process per device (``nereus_rl.runtime``) holds
the shards of every model-stage placed on it (:mod:`nereus_rl.trainer_worker`)
and runs that stage's work: rollout generation, reference / critic
inference, training. Where each stage runs and how it is split (dp, tp, pp)
is the current :class:`~nereus_rl.globalplan.GlobalPlan`.

One RL step (synchronous mode):

    weight sync   actor_train -> rollout layout, nereus_comm reshard (every step)
    rollout       sample responses (+ behaviour log-probs; ReMax: greedy baseline)
    reward        rule-based, on the driver
    reference     reference log-probs (PPO: critic values too)
    advantages    on the driver (GRPO group-normalised, PPO GAE, ReMax greedy baseline)
    training      one optimizer step per training stage, batch split over its units
    adapt         (safe boundary) controller -> planner -> admission -> transition

Asynchronous mode generates the next step's responses while the current step
trains (one step stale, the behaviour log-probs come from the rollout
weights that sampled them); the weight sync is the safe boundary.

The model's state on the workers is held as EMU units
(:mod:`nereus_rl.trainer_units`), and a plan transition runs as EMU primitives
on them. The adaptation loop lives in :mod:`nereus_rl.trainer_adapt`; the run
folder in :mod:`nereus_rl.report`.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nereus_rl.algos.grpo import group_advantages
from nereus_rl.algos.ppo import gae, kl_penalized_rewards
from nereus_rl.algos.remax import remax_advantages
from nereus_rl.globalplan import GlobalPlan, StagePlan
from nereus_rl.model import Decoder
from nereus_rl.runtime import Driver, RemoteError, WorkerLostError, WorkerTimeoutError
from nereus_rl.tasks import (
    TOKENIZER,
    LengthCurriculum,
    LengthTrace,
    encode_prompts,
    get_task,
    score_responses,
    warm_start,
)
from nereus_rl.trainer_config import (
    ALGOS,
    MODES,
    SYNC_PAIRS,
    NotEnoughDevicesError,
    TrainConfig,
    TrainConfigError,
    TrainResult,
    UnknownAlgorithmError,
    check_config,
    simple_plan,
    stage_desc,
    stage_names,
)

__all__ = [
    "ALGOS",
    "MODES",
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

# Warm-started initial states by (critic, model, task, seed, warm steps): runs in one
# process (tests, benchmarks) that differ only in plan or algorithm share the warm start.
_WARM_CACHE: dict[tuple, dict[str, dict[str, torch.Tensor]]] = {}


def _lengths(cfg: TrainConfig):
    if cfg.trace is not None:
        return LengthTrace.from_file(cfg.trace)
    return LengthCurriculum(cfg.length_start, cfg.length_end, cfg.steps)


def _split(t: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """Split rows evenly over units (sizes differ by at most one; rows stay in order)."""
    n = t.shape[0]
    sizes = [n // parts + (1 if i < n % parts else 0) for i in range(parts)]
    return list(t.split(sizes))


def _gather(replies: dict[int, Any], key: str) -> torch.Tensor:
    outs = sorted((r for r in replies.values() if r is not None), key=lambda r: r["unit"])
    return torch.cat([r[key] for r in outs])


def _stage_seconds(replies: dict[int, Any]) -> float:
    return max((r["seconds"] for r in replies.values() if r is not None), default=0.0)


class Trainer:
    """The driver side of one run: workers, plan, and the RL loop (see the module docstring).

    Arguments:
        cfg: the options (checked with :func:`check_config`).
        driver: a runtime Driver with at least ``cfg.devices`` workers (tests reuse one);
            None spawns local workers and shuts them down in :meth:`close`.
        log: a :class:`nereus_rl.report.RunLog` (or None): metrics and decisions go there
            as they happen.
        progress: called after every step with (step, metrics).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        driver: Driver | None = None,
        log=None,
        progress: Callable[[int, dict[str, Any]], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.mc = check_config(cfg)
        self.task = get_task(cfg.task)
        self.lengths = _lengths(cfg)
        self.log = log
        self.progress = progress
        self.result = TrainResult(cfg)
        self.rng = random.Random(cfg.seed)
        from nereus_rl.trainer_adapt import Adapter

        # Planned before any process starts, so that too few devices or too little
        # memory is reported at once.
        self.adapter = Adapter(self, enabled=cfg.adapt)
        self.first_plan = self.adapter.initial_plan(self._response_len(0))
        self.plan: GlobalPlan | None = None
        self.units = None  # TrainerUnits, once the workers hold the state
        # a worker loss at a step's end (its boundary, or the async weight sync): the
        # step is recorded, then recovered from (run)
        self._boundary_loss: Exception | None = None
        self.own_driver = driver is None
        self.driver = driver or Driver(heartbeat_timeout=30.0, call_timeout=600.0)

    # ------------------------------------------------------------------ setup

    def start(self, plan: GlobalPlan | None = None) -> None:
        """Spawn/attach workers, warm-start the policy, choose the first plan, build stages."""
        cfg = self.cfg
        t0 = time.perf_counter()
        if self.own_driver:
            self.driver.spawn_local(cfg.devices)
        workers = sorted(self.driver.workers)[: cfg.devices]
        if len(workers) < cfg.devices:
            raise NotEnoughDevicesError(
                f"{cfg.devices} devices asked but only {len(workers)} workers joined"
            )
        self.workers = workers
        # plan device id -> rank in the workers' default group (changes after a loss)
        self.world_rank = {d: d for d in range(len(workers))}
        self.device_worker = dict(enumerate(workers))
        self.driver.import_module("nereus_rl.trainer_worker")
        self._init_world()
        self.result.timings["spawn_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        full = self._initial_states()
        self.result.timings["warm_start_s"] = time.perf_counter() - t0
        if plan is None and cfg.calibration_probes and (cfg.adapt or cfg.plan == "auto"):
            self._calibrate(full)
        t0 = time.perf_counter()
        if cfg.adapt:
            # After calibration: the model (and budget) the run's decisions start from.
            self.adapter.prepare_buckets(self._response_len(0))
        self._set_plan(0, plan or self.first_plan)
        descs = [self._desc(sp) for sp in self.plan.stages]
        self._all("rl.setup", descs, self.mc, full, cfg.hyper())
        from nereus_rl.trainer_units import TrainerUnits
        from nereus_rl.transition import KINDS

        # From here on each stage's shards are EMU units' tensors (no copy is made).
        live = KINDS if cfg.transitions == "emu" else ()
        self.units = TrainerUnits(self, self.adapter.cm, live_kinds=live)
        self.units.adopt(self.plan)
        self.result.timings["setup_s"] = time.perf_counter() - t0

    def _calibrate(self, full: dict[str, dict[str, torch.Tensor]]) -> None:
        # Measured on these workers before the first decision (nereus_rl.trainer_calibrate);
        # the planner's first plan is then chosen again with what was measured.
        from nereus_rl.trainer_calibrate import calibrate

        rec, observed = calibrate(self, full, self.cfg.calibration_probes)
        self.result.calibration = rec
        self.result.timings["calibration_s"] = rec["seconds"]
        self.adapter.calibrated(observed)
        self.first_plan = self.adapter.initial_plan(self._response_len(0))

    def _desc(self, sp: StagePlan) -> dict[str, Any]:
        d = stage_desc(sp)
        d["units"] = [[self.world_rank[x] for x in u] for u in d["units"]]
        return d

    def _init_world(self) -> None:
        n = len(self.workers)
        # a fresh prefix per run: workers reused by another run must not meet old keys
        prefix = f"rl.world.{uuid.uuid4().hex[:12]}/"
        pend = [
            self.driver.submit([w], "rl.init", i, n, prefix) for i, w in enumerate(self.workers)
        ]
        for p in pend:
            self.driver.wait(p)

    def _initial_states(self) -> dict[str, dict[str, torch.Tensor]]:
        cfg = self.cfg
        key = (cfg.algo == "ppo", cfg.model, cfg.task, cfg.seed, cfg.warm_steps)
        if key not in _WARM_CACHE:
            if len(_WARM_CACHE) > 8:
                _WARM_CACHE.clear()
            _WARM_CACHE[key] = self._warm_start()
        return _WARM_CACHE[key]

    def _warm_start(self) -> dict[str, dict[str, torch.Tensor]]:
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        policy = Decoder(self.mc, seed=cfg.seed)
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

    def _all(self, fn: str, *args, **kwargs) -> dict[int, Any]:
        # Every worker runs every stage command (non-members return at once), so that
        # collectives over the default group and new_group calls stay in step.
        return self.driver.call(self.workers, fn, *args, **kwargs)

    def _submit(self, fn: str, *args, **kwargs):
        return self.driver.submit(self.workers, fn, *args, **kwargs)

    def _response_len(self, step: int) -> int:
        return int(self.lengths.response_len(step))

    # ------------------------------------------------------------------ work

    def weight_sync(self) -> dict[str, float]:
        """actor_train -> rollout (PPO: critic_train -> critic_inference too) through
        nereus_comm reshard, collective over the workers; never a gather on one rank."""
        t0 = time.perf_counter()
        sent = 0.0
        names = self.plan.stage_names
        for src, dst in SYNC_PAIRS:
            if src in names and dst in names:
                rep = self._all(
                    "rl.move",
                    self._desc(self.plan.stage(src)),
                    self._desc(self.plan.stage(dst)),
                    params_only=True,
                    replace=False,
                )
                sent += sum(r["bytes_sent"] for r in rep.values())
        return {"sync_s": time.perf_counter() - t0, "sync_bytes_sent": sent}

    def _rollout_submit(self, step: int, rlen: int | None = None):
        """Sample a step's prompts and send them to the rollout units (not waiting);
        ``rlen`` overrides the step's response limit (the startup calibration's probes)."""
        cfg = self.cfg
        rlen = self._response_len(step) if rlen is None else rlen
        # The response limit follows the length schedule; the task level stays at the
        # first step's (fixed_level) so that reward can rise while responses grow.
        level = self.task.level_for_response_len(self._response_len(0) if cfg.fixed_level else rlen)
        problems = self.task.sample(cfg.batch, level, self.rng)
        if cfg.algo == "grpo":
            problems = [p for p in problems for _ in range(cfg.group_size)]
        prompts = encode_prompts(problems)
        rp = self.plan.stage("rollout")
        parts = _split(prompts, rp.dp)
        pend = self._submit(
            "rl.generate",
            "rollout",
            parts,
            rlen,
            cfg.temperature,
            cfg.seed * 100_003 + step,
            TOKENIZER.EOS,
            greedy=cfg.algo == "remax",
        )
        return {"step": step, "problems": problems, "rlen": rlen, "level": level, "pend": pend}

    def _rollout_wait(self, job) -> dict[str, Any]:
        rep = self.driver.wait(job["pend"])
        job["sequences"] = _gather(rep, "sequences")
        job["mask"] = _gather(rep, "mask")
        job["old_logp"] = _gather(rep, "logp")
        job["rollout_s"] = _stage_seconds(rep)
        if self.cfg.algo == "remax":
            job["greedy"] = _gather(rep, "greedy")
        return job

    def _train_on(self, job) -> dict[str, Any]:
        """Reward, reference (and critic) inference, advantages and the training stages."""
        cfg = self.cfg
        seqs, mask, old_logp = job["sequences"], job["mask"], job["old_logp"]
        plen = seqs.shape[1] - mask.shape[1]
        problems = job["problems"]
        t0 = time.perf_counter()
        scores = score_responses(self.task, problems, seqs[:, plen:])
        reward_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        ref_p = self.plan.stage("reference")
        rep = self._all("rl.infer", "reference", _split(seqs, ref_p.dp), plen, cfg.num_micro)
        ref_logp = _gather(rep, "out")
        values = None
        if cfg.algo == "ppo":
            cp = self.plan.stage("critic_inference")
            rep_v = self._all(
                "rl.infer", "critic_inference", _split(seqs, cp.dp), plen, cfg.num_micro
            )
            values = _gather(rep_v, "out")
        infer_s = time.perf_counter() - t0
        num_tokens = float(mask.sum())
        batch: dict[str, torch.Tensor] = {
            "sequences": seqs,
            "mask": mask,
            "old_logp": old_logp,
            "ref_logp": ref_logp,
        }
        if cfg.algo == "grpo":
            batch["advantages"] = group_advantages(scores, cfg.group_size)
        elif cfg.algo == "ppo":
            rewards = kl_penalized_rewards(scores, old_logp, ref_logp, mask, kl_coef=cfg.kl_coef)
            adv, ret = gae(rewards, values, mask, whiten=True)
            batch.update(advantages=adv, returns=ret, old_values=values)
        else:
            gscores = score_responses(self.task, problems, job["greedy"])
            rewards = kl_penalized_rewards(scores, old_logp, ref_logp, mask, kl_coef=cfg.kl_coef)
            batch["advantages"] = remax_advantages(rewards, gscores, mask)
        t0 = time.perf_counter()
        hp = {**cfg.hyper(), "lr": self._lr(job["step"])}
        pend = []
        for stage in ("actor_train", "critic_train") if cfg.algo == "ppo" else ("actor_train",):
            sp = self.plan.stage(stage)
            parts = []
            for rows in _split(torch.arange(seqs.shape[0]), sp.dp):
                b = {k: v[rows] for k, v in batch.items()}
                b["prompt_len"] = torch.tensor(plen)
                b["num_tokens"] = torch.tensor(num_tokens)
                parts.append(b)
            pend.append((stage, self._submit("rl.train", stage, parts, hp)))
        stats: dict[str, float] = {}
        train_s = 0.0
        for stage, p in pend:
            rep = self.driver.wait(p)
            train_s = max(train_s, _stage_seconds(rep))
            outs = [r for r in rep.values() if r is not None]
            prefix = "critic_" if stage == "critic_train" else ""
            # each unit's loss was scaled by dp (the gradient all-reduce averages)
            dp = self.plan.stage(stage).dp
            stats[prefix + "loss"] = sum(r["loss"] for r in outs) / dp
            for r in outs:
                for k, v in r["stats"].items():
                    stats[prefix + k] = stats.get(prefix + k, 0.0) + v / dp
        kl = float(((old_logp - ref_logp) * mask).sum() / max(num_tokens, 1.0))
        return {
            "reward_mean": float(scores.mean()),
            "reward_exact": float((scores >= 1.0).float().mean()),
            "kl": kl,
            "loss": stats.get("loss", 0.0),
            "critic_loss": stats.get("critic_loss"),
            "response_tokens_mean": float(mask.sum(-1).mean()),
            "stage_s": {
                "rollout": job["rollout_s"],
                "reward": reward_s,
                "inference": infer_s,
                "train": train_s,
            },
        }

    def _lr(self, step: int) -> float:
        # Linear warm-up after the warm start: the first RL updates are the noisiest.
        return self.cfg.lr * min(1.0, (step + 1) / max(1, self.cfg.warmup_steps))

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
            The :class:`~nereus_rl.trainer_units.TransitionRun`.
        """
        from nereus_rl.transition import TransitionExecutionError

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

    def recover(self, step: int, error: Exception) -> None:
        """Continue after a worker died (:func:`nereus_rl.trainer_recover.recover`: a new
        default group over the survivors, a plan over the remaining devices, every
        stage's state rebuilt from its units that lost no device).

        Raises:
            the original error: no worker was lost, or some stage lost its state.
        """
        from nereus_rl.trainer_recover import recover

        recover(self, step, error)

    # ------------------------------------------------------------------ loop

    def run(self) -> TrainResult:
        """Run every step (metrics and decisions are logged as they happen)."""
        cfg = self.cfg
        ahead = None
        step = 0
        while step < cfg.steps:
            try:
                ahead = self._step(step, ahead)
            except (WorkerLostError, WorkerTimeoutError, RemoteError) as e:
                self.recover(step, e)
                ahead = None  # the step is run again on the new plan
                continue
            step += 1
            lost, self._boundary_loss = self._boundary_loss, None
            if lost is not None:  # the step finished; its boundary's transition did not
                self.recover(step, lost)  # (an async rollout made before it stays valid)
        return self.result

    def _step(self, step: int, ahead):
        """One RL step (and its safe boundary); returns the next step's rollout (async)."""
        cfg = self.cfg
        t_step = time.perf_counter()
        sync: dict[str, float] = {}
        if cfg.mode == "sync" or step == 0:
            sync = self.weight_sync()
        job = ahead if ahead is not None else self._rollout_wait(self._rollout_submit(step))
        nxt = None
        if cfg.mode == "async" and step + 1 < cfg.steps:
            # The next step's rollout runs on the current rollout weights while this
            # step trains (on disjoint devices the two overlap).
            nxt = self._rollout_submit(step + 1)
        m = self._train_on(job)
        # measured bytes of model state (weights, Adam moments) on the fullest worker
        # (before the async weight sync, which loads in place: the same bytes)
        m["held_bytes_max"] = max(self._all("rl.held_bytes").values())
        try:
            if nxt is not None:
                nxt = self._rollout_wait(nxt)
                sync = self.weight_sync()
        except (WorkerLostError, WorkerTimeoutError, RemoteError) as e:
            # The step trained already: as a loss at its boundary (below), recovered from
            # after the step is recorded (recovery syncs the weights); a finished rollout
            # stays valid.
            self._boundary_loss = e
            if nxt is not None and "sequences" not in nxt:
                nxt = None
        ahead = nxt
        m.update(sync)
        m.update(
            step=step,
            response_len=job["rlen"],
            level=job["level"],
            plan=repr(self.plan),
            num_devices=len(self.plan.devices),
        )
        m["step_s"] = time.perf_counter() - t_step
        m["transition_s"] = 0.0
        if step + 1 < cfg.steps and self._boundary_loss is None:
            try:
                m.update(self.adapter.boundary(step, m))
            except (WorkerLostError, WorkerTimeoutError, RemoteError) as e:
                # The step trained already: it is recorded and recovered from after, not
                # run again (its update would be applied twice).
                self._boundary_loss = e
        self.result.metrics.append(m)
        if self.log is not None:
            self.log.metrics(m)
        if self.progress is not None:
            self.progress(step, m)
        return ahead

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
    model: str = "tiny",
    task: str = "sort",
    devices: int = 4,
    steps: int = 60,
    adapt: bool = True,
    seed: int = 0,
    run_dir: str | Path | None = None,
    mode: str = "sync",
    memory_budget: int | None = None,
    *,
    driver: Driver | None = None,
    progress: Callable[[int, dict[str, Any]], None] | None = None,
    **options: Any,
) -> TrainResult:
    """Train a policy with PPO, GRPO or ReMax on ``devices`` worker processes.

    Arguments:
        algo: ``"grpo"``, ``"ppo"`` or ``"remax"``.
        model: model preset (``"tiny"``, ``"small"``, ``"medium"``).
        task: bundled task (``"sort"``, ``"reverse"``, ``"addition"``).
        devices: worker processes (one per device), spawned locally unless ``driver``
            already has them.
        steps: RL steps.
        adapt: run the adaptation loop (False: keep the first plan).
        seed: seeds the warm start, the prompts and the sampling.
        run_dir: folder for metrics.jsonl, decisions.jsonl, plots and summary (None: none).
        mode: ``"sync"`` or ``"async"`` (rollout one step ahead of training).
        memory_budget: bytes per worker the plan must fit (None: the machine's share).
        driver: a runtime Driver whose workers to use (they are kept running).
        progress: called after every step with (step, metrics).
        options: further :class:`TrainConfig` fields (batch, group_size, lr, trace, plan,
            admission, transitions, length_start, length_end, ...).

    Returns:
        A :class:`TrainResult`; if a worker failed mid-run, ``error`` says so and the
        metrics hold every step finished before.

    Raises:
        TrainConfigError (and the model/task/trace errors, all ValueError): bad options,
        raised before any process starts.
    """
    from nereus_rl.report import RunLog

    try:
        cfg = TrainConfig(
            algo=algo,
            model=model,
            task=task,
            devices=devices,
            steps=steps,
            adapt=adapt,
            seed=seed,
            mode=mode,
            memory_budget=memory_budget,
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
    except (KeyboardInterrupt, RuntimeError, OSError) as e:
        trainer.result.error = f"{type(e).__name__}: {e}"
        if log is not None:
            log.error(trainer.result.error)
    finally:
        trainer.close()
        if log is not None:
            trainer.result.run_dir = log.finish(trainer.result)
    return trainer.result
