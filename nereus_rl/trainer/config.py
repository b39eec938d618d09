"""Options, results, errors and fixed plans of the trainer (see :mod:`.trainer`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nereus_rl.core.globalplan import GlobalPlan, StagePlan
from nereus_rl.data.tasks import LengthTrace, get_task
from nereus_rl.models.hf import HFCheckpointError, check_hf_weights, hf_config
from nereus_rl.models.model import PRESETS, ModelConfig, get_preset

ALGOS = ("grpo", "ppo", "remax")
MODES = ("sync", "async")
DEVICE_KINDS = ("cpu", "cuda")
START_LENGTHS = ("schedule", "cap", "first")
#: Where the trainer starts its workers (TrainConfig.launcher).
LAUNCHERS = ("local", "ray")


class TrainConfigError(ValueError):
    """An option of ``train`` is invalid (unknown name, impossible value)."""


class UnknownAlgorithmError(TrainConfigError):
    """``algo`` is not one of :data:`ALGOS`."""


class NotEnoughDevicesError(TrainConfigError):
    """Fewer devices than the smallest feasible plan needs."""


@dataclass(frozen=True)
class TrainConfig:
    """Options of one run (see :func:`train` for their meaning)."""

    algo: str = "grpo"
    model: str = "tiny"
    task: str = "sort"
    devices: int = 4
    steps: int = 60
    adapt: bool = True
    seed: int = 0
    mode: str = "sync"
    memory_budget: int | None = None
    batch: int = 8
    group_size: int = 4
    lr: float = 1e-4
    warmup_steps: int = 3
    kl_coef: float = 0.02
    temperature: float = 1.0
    num_micro: int = 2
    warm_steps: int = 300
    length_start: int = 6
    length_end: int = 14
    trace: str | None = None
    fixed_level: bool = True
    plan: str | GlobalPlan = "auto"
    admission: str = "payback"
    # "emu": a transition runs its DAG as live EMU primitives; "reshard": one nereus_comm
    # reshard per changed stage (a baseline to compare with).
    transitions: str = "emu"
    buckets: tuple[int, ...] = (8, 12, 16, 24, 32, 48, 64)
    # Probe plans run at startup to measure this machine's efficiencies before the first
    # plan decision (nereus_rl.trainer.calibrate); 0 turns the calibration off. It runs
    # only where the planner decides something (adapt, or plan="auto").
    calibration_probes: int = 3
    # What an adaptive run's start plan is chosen over (nereus_rl.policy.start_plan): "schedule",
    # the configured length limit of every step (the trace's or the curriculum's); "cap",
    # the first step's length and then the schedule's longest at every later step (what
    # a run that knows only its response cap can assume, as a startup configuration
    # does); "first", the first step's length only (bench_e2e's adaptive_cap and
    # adaptive_blind settings).
    start_lengths: str = "schedule"
    # Where the workers hold their stages: "cpu" (host memory, gloo) or "cuda" (one GPU
    # per worker, NCCL for the models' collectives; see nereus_rl.trainer.worker_device).
    device: str = "cpu"
    # Keep each step's training state in host memory (every rank of a unit) and, where a
    # stage would die with one worker or node, mirrored on another worker or node, so
    # that a worker's death never loses the run (nereus_rl.trainer.snapshot).
    mirror: bool = True
    # Failure domains the devices are split into, in device order (equal nodes): the
    # mirrors go to another node, so a whole node's death loses nothing either.
    nodes: int = 1
    # The most devices the run may grow to (None: ``devices``, no growth). Workers that
    # arrive while it runs (``nereus-rl worker`` joining, Ray actors placed on new
    # capacity) take free device ids up to this at the next boundary, and the planner
    # may then move onto them (nereus_rl.trainer.recover.grow).
    max_devices: int | None = None
    # CPU cores each worker may use, its own (a CPU quota per worker, as a device brings
    # its own compute; at most 1). None: the workers share this machine's cores, so a
    # worker that arrives brings no cores. The cost model prices each worker with it.
    worker_cores: float | None = None
    # Every this many steps, also write the committed snapshot to disk (0: never): the
    # last resort when a shard's holder and its mirror are lost together. Written to
    # checkpoint_dir, else the run folder's checkpoint.pt.
    checkpoint_every: int = 0
    checkpoint_dir: str | None = None
    # Start from a disk checkpoint (a checkpoint.pt that checkpoint_every, or a run whose
    # survivors could not hold it, wrote): its trained states and the step after its
    # own; ``steps`` still counts from step 0. The same options as the run that wrote it
    # continue it exactly as that run would have gone on.
    resume: str | None = None
    # The share of a step the snapshot may take on average: a dearer one (priced by the
    # cost model, then measured) is taken every few steps, and a death rolls back to it.
    # float("inf"): every step, whatever it costs.
    snapshot_budget: float = 0.05
    # Seconds without a heartbeat after which a worker counts as dead. A local worker's
    # death is seen at once from its process; this bounds the detection of a joined
    # one's. Too short, and a worker starved of CPU on a loaded machine looks dead.
    heartbeat_timeout: float = 30.0
    # Where the workers run when the trainer starts them: "local" (worker processes on
    # this machine, the default; needs no Ray) or "ray" (one Ray actor per device,
    # placed by a placement group, nereus_rl.runtime.ray_runtime) on the cluster at
    # ray_address (None: the Ray of this process, else a new one on loopback; "auto";
    # or HOST:PORT).
    launcher: str = "local"
    ray_address: str | None = None
    # A prompt dataset (JSONL or Parquet) in place of the bundled task, with the fields
    # holding each row's prompt and ground truth (nereus_rl.data.datasets).
    data: str | None = None
    prompt_field: str = "prompt"
    answer_field: str | None = "answer"
    # What scores a dataset's responses: a built-in verifier's name ("exact", "numeric",
    # "format"), "module:function" / "path/to/file.py:function", or a callable
    # fn(prompt, response, answer) -> float.
    reward_fn: str | Callable[..., Any] | None = None
    # The tokenizer's folder (None: the model's folder); a dataset needs one.
    tokenizer: str | None = None
    # Every this many steps, write the policy (and PPO's critic) as Hugging Face folders
    # (0: only at the end, and only for a Hugging Face model). Written under save_dir,
    # else the run folder.
    save_every: int = 0
    save_dir: str | None = None
    # Also log to Weights & Biases (needs the wandb package; it follows its own
    # environment, WANDB_MODE=offline included), in project wandb_project. TensorBoard
    # event files are written to the run folder regardless.
    wandb: bool = False
    wandb_project: str | None = None

    @property
    def device_cap(self) -> int:
        """The most devices the run may hold (``max_devices``, else ``devices``)."""
        return self.devices if self.max_devices is None else self.max_devices

    def hyper(self) -> dict[str, Any]:
        return {
            "algo": self.algo,
            "lr": self.lr,
            "kl_coef": self.kl_coef,
            "num_micro": self.num_micro,
        }


@dataclass
class TrainResult:
    """What a run produced.

    Attributes:
        config: the options.
        metrics: one dict per RL step (reward, loss, kl, times, plan, ...).
        plans: (step, GlobalPlan) each time the plan was set or changed.
        decisions: one dict per admission decision.
        run_dir: the run folder (None when not written).
        error: the message of the error that ended the run early, else None.
        timings: seconds of the start-up parts (spawn_s, warm_start_s, calibration_s,
            setup_s; resume_s: reading and checking ``resume``'s checkpoint).
        calibration: the startup calibration's record (probes, measured stage seconds,
            predictions before and after), or None when it did not run.
        saves: one dict per Hugging Face save (``saved``: "final" or "step-N", ``path``:
            the folder holding ``policy/`` and, for PPO, ``critic/``, ``seconds``).
    """

    config: TrainConfig
    metrics: list[dict[str, Any]] = field(default_factory=list)
    plans: list[tuple[int, GlobalPlan]] = field(default_factory=list)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    run_dir: Path | None = None
    error: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    calibration: dict[str, Any] | None = None
    saves: list[dict[str, Any]] = field(default_factory=list)

    @property
    def rewards(self) -> list[float]:
        return [m["reward_mean"] for m in self.metrics]

    @property
    def num_transitions(self) -> int:
        return sum(1 for d in self.decisions if d.get("taken"))

    @property
    def num_primitives(self) -> int:
        """EMU primitives the taken transitions ran live."""
        return sum(len(d.get("executed_primitives", ())) for d in self.decisions if d.get("taken"))

    @property
    def num_fallbacks(self) -> int:
        """Stages the taken transitions moved by a per-stage reshard instead of primitives."""
        return sum(d.get("fallbacks", 0) for d in self.decisions if d.get("taken"))


def is_hf_model(model: str) -> bool:
    """``model`` names a Hugging Face folder (a path), not a preset."""
    return model not in PRESETS and (
        os.sep in model or "/" in model or model.startswith(".") or Path(model).exists()
    )


def model_config(model: str) -> ModelConfig:
    """The config of a preset name or of a Hugging Face folder, whose weights are checked
    against it from the files' headers (no tensor is read).

    Raises:
        UnknownPresetError: neither a preset nor a path.
        HFCheckpointError: a folder without a readable config.json, an unsupported
            architecture or field, or weights that do not match the config.
    """
    if not is_hf_model(model):
        return get_preset(model)
    folder = Path(model)
    if not folder.is_dir():
        raise HFCheckpointError(
            f"model {model!r}: no such folder (a Hugging Face model folder holds config.json "
            f"and safetensors weights; presets are {sorted(PRESETS)})"
        )
    mc = hf_config(folder)
    check_hf_weights(folder, mc)
    return mc


def check_config(cfg: TrainConfig) -> ModelConfig:
    """Validate options before any process starts. Returns the model config.

    The dataset, tokenizer and reward function are loaded and checked by
    :func:`nereus_rl.data.prompts.dataset_prompts` (the trainer does it before any
    process starts).

    Raises:
        UnknownAlgorithmError, UnknownPresetError, UnknownTaskError, TraceFormatError,
        HFCheckpointError, TrainConfigError: with what is wrong and what to do.
    """
    if cfg.algo not in ALGOS:
        raise UnknownAlgorithmError(f"unknown algorithm {cfg.algo!r}; choose one of {ALGOS}")
    if cfg.mode not in MODES:
        raise TrainConfigError(f"unknown mode {cfg.mode!r}; choose one of {MODES}")
    if cfg.transitions not in ("emu", "reshard"):
        raise TrainConfigError(
            f"unknown transitions {cfg.transitions!r}; use 'emu' (the DAG's primitives) or "
            "'reshard' (one reshard per changed stage)"
        )
    if cfg.admission not in ("payback", "always"):
        raise TrainConfigError(
            f"unknown admission {cfg.admission!r}; use 'payback' or 'always' (replan on every "
            "trigger)"
        )
    if not (isinstance(cfg.calibration_probes, int) and cfg.calibration_probes >= 0):
        raise TrainConfigError(
            f"calibration_probes={cfg.calibration_probes!r} must be an int >= 0 "
            "(0 turns the startup calibration off)"
        )
    if cfg.start_lengths not in START_LENGTHS:
        raise TrainConfigError(
            f"unknown start_lengths {cfg.start_lengths!r}; use 'schedule' (every step's "
            "configured length), 'cap' (the first, then the longest) or 'first'"
        )
    if cfg.device not in DEVICE_KINDS:
        raise TrainConfigError(
            f"unknown device {cfg.device!r}; use 'cpu' (worker processes on host memory) or "
            "'cuda' (one GPU per worker)"
        )
    if cfg.launcher not in LAUNCHERS:
        raise TrainConfigError(
            f"unknown launcher {cfg.launcher!r}; use 'local' (worker processes on this "
            "machine) or 'ray' (Ray actors on a cluster)"
        )
    if cfg.ray_address is not None and cfg.launcher != "ray":
        raise TrainConfigError(
            f"ray_address={cfg.ray_address!r} needs launcher='ray' (the local launcher "
            "starts worker processes on this machine)"
        )
    mc = model_config(cfg.model)
    if cfg.data is None:
        get_task(cfg.task)
        if is_hf_model(cfg.model):
            raise TrainConfigError(
                f"model {cfg.model!r} is a Hugging Face folder: give it a prompt dataset "
                "(data='file.jsonl' and reward_fn=...); the bundled tasks use the character "
                "tokenizer of the presets"
            )
    elif cfg.tokenizer is None and not is_hf_model(cfg.model):
        raise TrainConfigError(
            f"data={cfg.data!r} needs a tokenizer: train a Hugging Face model folder (its "
            "tokenizer is used) or pass tokenizer=FOLDER"
        )
    if cfg.data is not None and cfg.reward_fn is None:
        raise TrainConfigError(
            "data needs reward_fn: a built-in verifier ('numeric', 'exact', 'format'), "
            "'module:function', or a callable fn(prompt, response, answer) -> float"
        )
    if cfg.wandb:
        from nereus_rl.trainer.tracking import import_wandb

        import_wandb()  # not installed: a clear error before any process starts
    if not (isinstance(cfg.save_every, int) and cfg.save_every >= 0):
        raise TrainConfigError(
            f"save_every={cfg.save_every!r} must be an int >= 0 (0: save at the end only)"
        )
    if isinstance(cfg.plan, GlobalPlan):
        want = [n for n, _, _ in stage_names(cfg.algo)]
        if sorted(cfg.plan.stage_names) != sorted(want):
            raise TrainConfigError(
                f"plan has stages {list(cfg.plan.stage_names)}; {cfg.algo} needs {want}"
            )
        if not cfg.plan.devices <= set(range(cfg.devices)):
            raise NotEnoughDevicesError(
                f"plan uses devices {sorted(cfg.plan.devices)} but only 0..{cfg.devices - 1} "
                "exist; raise devices or plan over fewer"
            )
    elif cfg.plan not in ("auto", "colocated", "disaggregated"):
        raise TrainConfigError(
            f"unknown plan {cfg.plan!r}; use auto, colocated, disaggregated or a GlobalPlan"
        )
    if cfg.trace is not None:
        LengthTrace.from_file(cfg.trace)
    if cfg.steps < 1:
        raise TrainConfigError(f"steps={cfg.steps} must be >= 1")
    if cfg.devices < 1:
        raise NotEnoughDevicesError(f"devices={cfg.devices}; a run needs at least 1 device")
    if cfg.algo == "grpo" and cfg.group_size < 2:
        raise TrainConfigError("GRPO needs group_size >= 2 (responses per prompt)")
    if not (isinstance(cfg.nodes, int) and 1 <= cfg.nodes <= cfg.devices):
        raise TrainConfigError(
            f"nodes={cfg.nodes!r} must be an int in 1..devices ({cfg.devices}): the devices "
            "are split into that many equal nodes"
        )
    if not (isinstance(cfg.checkpoint_every, int) and cfg.checkpoint_every >= 0):
        raise TrainConfigError(
            f"checkpoint_every={cfg.checkpoint_every!r} must be an int >= 0 (0: no disk checkpoint)"
        )
    if cfg.checkpoint_every and not cfg.mirror:
        raise TrainConfigError(
            "checkpoint_every writes the in-memory snapshot to disk, which mirror=False "
            "turns off; turn mirror on or set checkpoint_every=0"
        )
    if not (isinstance(cfg.snapshot_budget, (int, float)) and cfg.snapshot_budget > 0):
        raise TrainConfigError(
            f"snapshot_budget={cfg.snapshot_budget!r} must be a positive share of a step "
            "(0.05: 5%; float('inf'): a snapshot every step)"
        )
    if not (isinstance(cfg.heartbeat_timeout, (int, float)) and cfg.heartbeat_timeout > 0):
        raise TrainConfigError(
            f"heartbeat_timeout={cfg.heartbeat_timeout!r} must be positive seconds"
        )
    if cfg.devices % cfg.nodes:
        raise TrainConfigError(
            f"devices={cfg.devices} do not split into nodes={cfg.nodes} equal nodes; use a "
            "divisor of devices"
        )
    if cfg.memory_budget is not None and cfg.memory_budget <= 0:
        raise TrainConfigError(f"memory_budget={cfg.memory_budget} must be positive bytes")
    if cfg.worker_cores is not None and not (
        isinstance(cfg.worker_cores, (int, float)) and 0 < cfg.worker_cores <= 1
    ):
        raise TrainConfigError(
            f"worker_cores={cfg.worker_cores!r} must be a share of a core in (0, 1] (a worker "
            "runs one thread); None: the workers share this machine's cores"
        )
    if cfg.resume is not None and not Path(cfg.resume).is_file():
        raise TrainConfigError(
            f"resume={cfg.resume!r} is not a file: pass the checkpoint.pt a run wrote "
            "(checkpoint_every, or the one a run writes when its survivors cannot hold it)"
        )
    if cfg.max_devices is not None and not (
        isinstance(cfg.max_devices, int) and cfg.max_devices >= cfg.devices
    ):
        raise TrainConfigError(
            f"max_devices={cfg.max_devices!r} must be an int >= devices ({cfg.devices}): the "
            "most devices the run may grow to (None: devices, no growth)"
        )
    return mc


def check_local_devices(cfg: TrainConfig) -> None:
    """Check that this machine can host ``cfg.devices`` workers on ``cfg.device``
    (before spawning them here).

    Raises:
        TrainConfigError: ``device="cuda"`` without a GPU, or with fewer GPUs than
            workers (NCCL cannot put two ranks of one communicator on one GPU).
    """
    if cfg.device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise TrainConfigError(
            "device='cuda' but this machine has no GPU torch can use "
            "(torch.cuda.is_available() is False); use device='cpu'"
        )
    have = torch.cuda.device_count()
    if cfg.devices > have:
        raise NotEnoughDevicesError(
            f"devices={cfg.devices} workers on device='cuda' need one GPU each, and this "
            f"machine has {have} (NCCL cannot put two ranks on one GPU); use devices<={have} "
            "or device='cpu'"
        )


def stage_desc(sp: StagePlan) -> dict[str, Any]:
    """A StagePlan as the plain dict the worker commands take."""
    return {
        "stage": sp.stage,
        "model": sp.model,
        "trains": sp.trains,
        "dp": sp.dp,
        "tp": sp.tp,
        "pp": sp.pp,
        "units": [list(u) for u in sp.units],
    }


def stage_names(algo: str) -> list[tuple[str, str, bool]]:
    """(stage, model, trains) of the planned stages of an algorithm, in workload order."""
    out = [("rollout", "actor", False), ("reference", "reference", False)]
    if algo == "ppo":
        out.append(("critic_inference", "critic", False))
    out.append(("actor_train", "actor", True))
    if algo == "ppo":
        out.append(("critic_train", "critic", True))
    return out


# Inference copies refreshed from their training stage every step (weights only).
SYNC_PAIRS = (("actor_train", "rollout"), ("critic_train", "critic_inference"))


def simple_plan(algo: str, devices: int, kind: str, tp: int = 1, pp: int = 1) -> GlobalPlan:
    """A fixed plan: ``colocated`` (every stage on every device, as verl) or
    ``disaggregated`` (rollout on the first half, the rest on the second, as OpenRLHF).

    Raises:
        TrainConfigError: unknown kind; NotEnoughDevicesError: too few devices for it.
    """
    names = stage_names(algo)
    if kind == "colocated":
        groups = {n: list(range(devices)) for n, _, _ in names}
    elif kind == "disaggregated":
        if devices < 2:
            raise NotEnoughDevicesError("a disaggregated plan needs at least 2 devices")
        half = devices // 2
        groups = {
            n: list(range(half)) if n == "rollout" else list(range(half, devices))
            for n, _, _ in names
        }
    else:
        raise TrainConfigError(f"unknown plan {kind!r}; use auto, colocated or disaggregated")
    stages = []
    for n, model, trains in names:
        devs = groups[n]
        width = tp * pp if len(devs) % (tp * pp) == 0 else 1
        t, p = (tp, pp) if width > 1 else (1, 1)
        dp = len(devs) // (t * p)
        units = tuple(tuple(devs[u * t * p : (u + 1) * t * p]) for u in range(dp))
        stages.append(StagePlan(n, model, trains, dp, t, p, units))
    return GlobalPlan(tuple(stages))
