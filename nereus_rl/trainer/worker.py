"""Worker-side RL commands: hold each stage's model shard, run its work, move its state.

Imported on every worker by :class:`nereus_rl.trainer.trainer.Trainer` (through
``Driver.import_module``). A worker is one device. It joins a default gloo (or
NCCL) process group over all the job's workers so that the model's tensor,
pipeline and data parallel groups (``torch.distributed.new_group``) can be
built for any layout the plan asks for. Per model-stage the worker keeps a
:class:`~nereus_rl.models.model.Decoder` of its shard (and AdamW for training stages) on
its device: host memory with ``device="cpu"`` (a gloo default group), or its GPU
with ``device="cuda"`` (``cpu:gloo,cuda:nccl``: the models' tensor, pipeline and
data parallel collectives go over NCCL). The CPU run is the ``device="cpu"`` case
of the same code: every command moves what the driver sends onto the worker's
device (:func:`_on_device`) and what it returns back to host memory.

State moves come in two kinds. ``rl.move`` (the per-step weight sync, and the
fallback reshard of a whole stage) goes over the worker's *move transport*
(:func:`_move_transport`): :class:`~nereus_comm.transport.GlooTransport` on the
default group on CPU, and on GPU an
:class:`~nereus_comm.transport.NcclTransport` (NCCL loaded from its wheel) over
all the job's workers, built collectively at the first move after each
``rl.init``, so the shards go device to device with no host copy. EMU primitives
move their units' host memory over the runtime's gloo groups (the units live in
the host arenas of :mod:`nereus_rl.emu.worker`): on a GPU worker a unit reads a
host copy of the shards (:func:`_host`), and ``_load_state`` copies what a new
unit received onto the device. The bytes are the same either way.

The stage's state on this rank is also the shard of an EMU unit
(:mod:`nereus_rl.emu.worker`): the driver adopts each unit with the state owner
``"trainer"`` registered here, so the unit's tensors *are* the model's
parameters and the optimizer's Adam moments (and step), read at the moment a
primitive copies them; no second copy is kept. A plan transition runs EMU
primitives on those units (new units receive plain tensors), then
``rl.rebind`` builds each changed stage's model for its new layout from its
new unit's tensors, through the same ``_load_state`` as a reshard, and binds
the unit to the new model. The state that reaches the new model is thus the
same bytes either way, which keeps an adaptive run bitwise on the path of a
static one.

State moves only through nereus_comm's reshard: the per-step weight sync
(actor_train -> rollout, ``rl.move``), a transition's EMU primitives, or (the
fallback for a stage whose primitives cannot run live) ``rl.move`` of the whole
stage; never through a full gather on one rank. Sampling draws come from one
generator per sample, seeded by (seed, step, the sample's index in the step's whole
batch) at each call, so no RNG state lives in a unit and the samples do not depend
on the rollout layout (dp split or tp/pp degrees; see nereus_rl.models.generate).
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nereus_comm.layout import Layout, TensorSpec
from nereus_comm.plan import plan_reshard
from nereus_comm.reshard import reshard
from nereus_comm.transport import GlooTransport, NcclTransport, Transport
from nereus_rl.algos.common import clipped_policy_loss, masked_sum
from nereus_rl.algos.grpo import grpo_loss
from nereus_rl.algos.ppo import value_loss
from nereus_rl.algos.remax import reinforce_loss
from nereus_rl.emu.worker import bind, register_state_owner, tensors_of
from nereus_rl.models.generate import generate, make_row_generators
from nereus_rl.models.model import Decoder, ModelConfig, shard_tensor, state_specs
from nereus_rl.models.parallel import (
    allreduce_gradients,
    init_parallel_groups,
    response_logprobs,
    response_values,
)
from nereus_rl.models.pipeline import pipeline_forward, pipeline_forward_backward
from nereus_rl.runtime.context import WorkerContext, register
from nereus_rl.trainer.config import DEVICE_KINDS

ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def _rl(ctx: WorkerContext) -> dict[str, Any]:
    return ctx.state.setdefault("rl", {"stages": {}})


def worker_device(kind: str, rank: int) -> torch.device:
    """The device a worker of rank ``rank`` holds its stages on, for ``kind``.

    ``"cuda"``: the GPU ``LOCAL_RANK`` names (torchrun-style, for workers started by
    hand on a cluster node), else ``rank`` modulo the GPUs this process sees (workers
    spawned on one machine, one per GPU).

    Raises:
        ValueError: an unknown kind, or ``"cuda"`` where this process sees no GPU.
    """
    if kind == "cpu":
        return torch.device("cpu")
    if kind != "cuda":
        raise ValueError(f"unknown device kind {kind!r}; use one of {DEVICE_KINDS}")
    if not torch.cuda.is_available():
        raise ValueError(
            f"device='cuda' but worker {rank} sees no GPU (torch.cuda.is_available() is "
            "False); run it where one is, or use device='cpu'"
        )
    local = os.environ.get("LOCAL_RANK")
    return torch.device("cuda", (int(local) if local else rank) % torch.cuda.device_count())


@register("rl.init")
def init_world(
    ctx: WorkerContext,
    rank: int,
    world_size: int,
    prefix: str,
    timeout: float | None = None,
    device: str = "cpu",
) -> int:
    """Join the job's default process group as ``rank`` of ``world_size``.

    ``timeout``: seconds a collective may wait for a peer, on the default group and on
    every stage model's groups (default: the worker's ``group_timeout``). It is what
    ends a survivor's wait on a peer that is alive but has left the collective.
    ``device``: ``"cpu"`` (a gloo group; shards in host memory) or ``"cuda"`` (shards
    on :func:`worker_device`'s GPU; gloo for host tensors and NCCL for device ones).
    """
    torch.set_num_threads(1)
    if timeout is None:
        timeout = ctx.group_timeout
    dev = worker_device(device, rank)  # before leaving a group: a bad kind changes nothing
    if dev.type == "cuda":
        # The moves' NcclTransport loads NCCL from its wheel: a missing library is
        # reported here, at start, not at the first weight sync.
        from nereus_comm.nccl import load_nccl

        load_nccl()
    _drop_move_transport(_rl(ctx))
    if dist.is_initialized():
        dist.destroy_process_group()
    store = dist.PrefixStore(prefix, ctx.store)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    # Host tensors (the driver's batches, staged shards) always have gloo; a stage
    # model's collectives take NCCL when its tensors are on the GPU.
    backend = "gloo" if dev.type == "cpu" else "cpu:gloo,cuda:nccl"
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout),
    )
    _rl(ctx)["rank"] = rank
    _rl(ctx)["timeout"] = timeout
    _rl(ctx)["device"] = dev
    _rl(ctx)["world"] = (store, world_size)
    _warm_optimizer()
    return rank


_CPU = torch.device("cpu")


def _device(rl: dict[str, Any]) -> torch.device:
    return rl.get("device", _CPU)


def _on_device(x: Any, device: torch.device) -> Any:
    """``x`` (a tensor, or a dict or list of them and of plain values) on ``device``;
    the same objects when they are there already (every CPU run)."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return {k: _on_device(v, device) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_on_device(v, device) for v in x)
    return x


def _host(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Shards in host memory, for gloo: the tensors themselves when they are there (a
    CPU run moves and reads the live shards, no copy), else host copies."""
    return {k: v.cpu() for k, v in state.items()}


def _move_transport(rl: dict[str, Any]) -> Transport:
    """The transport ``rl.move`` reshards over, for the worker's device.

    CPU: gloo on the default group (a new object per move costs nothing; the group is
    the connection). GPU: one :class:`NcclTransport` over every worker of the world,
    created at the first move after ``rl.init`` (every move is collective over all
    workers, so all of them create it together) and kept until the next ``rl.init``.
    A transport that broke (a peer timed out) is not rebuilt here: the peers would not
    rebuild theirs at the same moment; the run's recovery calls ``rl.init`` instead.
    """
    dev = _device(rl)
    if dev.type == "cpu":
        return GlooTransport()
    t = rl.get("nccl_move")
    if t is None:
        store, world_size = rl["world"]
        # The store carries this init's fresh prefix, so the key is unique per world.
        t = rl["nccl_move"] = NcclTransport(
            store, rl["rank"], range(world_size), dev, key="nereus_rl/move",
            init_timeout=rl["timeout"],
        )  # fmt: skip
    return t


def _drop_move_transport(rl: dict[str, Any]) -> None:
    """Abort the GPU move transport of the last world (``rl.init`` builds a new one).

    Abort, not destroy: when a worker died, a destroy could wait on it.
    """
    t = rl.pop("nccl_move", None)
    if t is not None:
        t.abort()


_OPTIMIZER_WARM = False


def _warm_optimizer() -> None:
    """Construct and step one AdamW in this process, once.

    The first optimizer made in a process imports torch's compiler stack (about 4 s
    here, measured in a fresh interpreter; 0.6 ms for the next one). Paid lazily, it
    fell on the first transition that gave a worker a training stage it never held
    (bench_e2e's warm-up runs: 2.4-3.9 s for a move the model prices at ~0.05 s), and
    on nothing a fixed plan's steps count. Paid here it is a start-up cost on every
    worker at once, whatever the plan.
    """
    global _OPTIMIZER_WARM
    if _OPTIMIZER_WARM:
        return
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.AdamW([p], lr=0.0)
    p.sum().backward()
    opt.step()
    _OPTIMIZER_WARM = True


def _layout(desc: dict[str, Any], num_layers: int) -> Layout:
    ranks = tuple(r for u in desc["units"] for r in u)
    return Layout(desc["dp"], desc["tp"], desc["pp"], ranks, num_layers=num_layers)


def tensor_specs(config: ModelConfig, critic: bool, with_adam: bool) -> list[TensorSpec]:
    """nereus_comm TensorSpecs of a model's state (and of its Adam moments)."""
    out = [TensorSpec(*s) for s in state_specs(config, value_head=critic)]
    if with_adam:
        out += [
            TensorSpec(f"{k}.{s.name}", s.shape, s.dtype, s.split_dim, s.stage_key)
            for k in ADAM_KEYS
            for s in list(out)
        ]
        out.append(TensorSpec("adam_step", (1,), torch.float32, None, None))
    return out


def _release_groups(entry: dict[str, Any] | None) -> int:
    """Destroy the process groups of a stage model that is being dropped or replaced.

    Every setup, rebind or replacing move builds the stage's model with new groups
    (``new_group`` is collective over the world, so they cannot be looked up and
    reused by ranks alone); the old model's groups were kept until the next
    ``rl.init``. Each gloo group holds a device thread, two worker threads and a
    socket per peer: a bench_e2e adaptive run (3 calibration probes, two transitions)
    ended with 46 threads and 86 descriptors on worker 0 against 7 and 15 after the
    run. Destroying is local (no collective), so only the ranks that held the model
    call it. Returns the number of groups destroyed.
    """
    if entry is None:
        return 0
    groups = getattr(entry.get("model"), "groups", None)
    n = 0
    for name in ("tp_group", "pp_group", "dp_group"):
        g = getattr(groups, name, None)
        if g is None:
            continue
        try:
            dist.destroy_process_group(g)
            n += 1
        except Exception:  # a group whose peer died: it goes with the next rl.init
            pass
    return n


def _replace_stage(rl: dict[str, Any], stage: str, entry: dict[str, Any] | None) -> None:
    """Set (or, with None, drop) a stage's entry, releasing the old model's groups."""
    old = rl["stages"].pop(stage, None)
    if entry is not None:
        rl["stages"][stage] = entry
    if old is not None and old is not entry:
        _release_groups(old)


def _build_model(desc: dict[str, Any], rl: dict[str, Any]):
    """This rank's model of the stage ``desc`` (None: not a member), for the config and
    the group timeout ``rl.init`` and ``rl.setup`` left in ``rl``."""
    ranks = [r for u in desc["units"] for r in u]
    # The default group's timeout, not new_group's own default (30 minutes for gloo): a
    # survivor waiting in a stage's all-reduce on a peer that left it after another
    # worker died is released only by it (tests/rl/trainer/test_trainer_recovery_hang.py)
    groups = init_parallel_groups(desc["tp"], desc["pp"], desc["dp"], ranks, rl["timeout"])
    if groups is None:
        return None
    return Decoder(rl["config"], groups, value_head=desc["model"] == "critic", device=_device(rl))


def _state_of(entry: dict[str, Any] | None) -> dict[str, torch.Tensor]:
    """This rank's shards of a stage's state by spec name (params, Adam moments, step)."""
    if entry is None:
        return {}
    model = entry["model"]
    out = {n: p.detach() for n, p in model.named_parameters()}
    opt = entry.get("opt")
    if opt is not None:
        step = 0.0
        for name, p in model.named_parameters():
            st = opt.state.get(p, {})
            for k in ADAM_KEYS:
                out[f"{k}.{name}"] = st[k] if k in st else torch.zeros_like(p)
            if "step" in st:
                step = float(st["step"])
        # beside the moments, so a device-to-device move has every shard on the device
        out["adam_step"] = torch.tensor([step], device=next(model.parameters()).device)
    return out


def _make_opt(model: Decoder, hp: dict[str, Any]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        model.parameters(), lr=hp["lr"], betas=(0.9, 0.98), weight_decay=0.0, eps=1e-8
    )


def _load_state(entry: dict[str, Any], state: dict[str, torch.Tensor], hp: dict[str, Any]) -> None:
    model = entry["model"]
    params = dict(model.named_parameters())
    model.load_shard_state_dict({n: state[n] for n in params})
    if entry.get("trains"):
        opt = _make_opt(model, hp)
        step = float(state["adam_step"][0]) if "adam_step" in state else 0.0
        if step > 0:
            for name, p in params.items():
                opt.state[p] = {
                    "step": torch.tensor(step),
                    # a copy on the parameter's device: a unit's shards are in host memory, and
                    # an arena block is not the optimizer's to keep
                    **{k: state[f"{k}.{name}"].to(p.device, copy=True) for k in ADAM_KEYS},
                }
        entry["opt"] = opt


@register("rl.setup")
def setup(
    ctx: WorkerContext,
    stages: list[dict[str, Any]],
    config: ModelConfig,
    full_states: dict[str, dict[str, torch.Tensor]],
    hp: dict[str, Any],
) -> dict[str, int]:
    """Build every stage's shard on this worker from full initial states (at start; the
    startup calibration's probes call it once per probe plan, the run's plan last).

    Collective over all workers (process groups are created in the same order everywhere).
    Returns bytes held per stage on this rank.
    """
    rl = _rl(ctx)
    rl["config"], rl["hp"] = config, hp
    held = {}
    for desc in stages:
        model = _build_model(desc, rl)
        if model is None:
            # not a member: drop what an earlier setup (a calibration probe) left here
            _replace_stage(rl, desc["stage"], None)
            continue
        full = full_states[desc["model"]]
        shards = {}
        for spec in model.local_specs():
            shards[spec.name] = shard_tensor(
                full[spec.name], spec.split_dim, model.groups.tp_rank, model.groups.tp_size
            ).to(_device(rl), copy=True)
        entry = {"model": model, "desc": desc, "trains": desc["trains"]}
        _load_state(entry, shards, hp)
        _replace_stage(rl, desc["stage"], entry)
        held[desc["stage"]] = sum(t.numel() * t.element_size() for t in _state_of(entry).values())
    return held


def _reader(ctx: WorkerContext, stage: str):
    # Looked up at each read: a rebind or a weight sync changes what the stage holds.
    # EMU primitives move host memory over gloo: a GPU worker's units read host copies.
    return lambda: _host(_state_of(_rl(ctx)["stages"].get(stage)))


register_state_owner("trainer", _reader)


@register("rl.rebind")
def rebind(ctx: WorkerContext, stages: list[tuple[dict[str, Any], list[int]]]) -> int:
    """Build stages' models for their new layouts from their EMU units, after a transition.

    Collective over all workers (the models' groups are made with ``new_group``).
    Per ``(desc, uids)``: ``uids[i]`` is the EMU unit of ``desc["units"][i]``; a
    member loads its unit's shards (received by a primitive, or a kept unit's live
    state) and binds the unit to the new model. Returns the bytes of state this rank
    now holds for those stages.
    """
    rl = _rl(ctx)
    held = 0
    for desc, uids in stages:
        stage = desc["stage"]
        model = _build_model(desc, rl)
        if model is None:
            _replace_stage(rl, stage, None)
            continue
        uid = uids[model.groups.dp_rank]
        entry = {"model": model, "desc": desc, "trains": desc["trains"]}
        _load_state(entry, tensors_of(ctx, uid), rl["hp"])
        _replace_stage(rl, stage, entry)
        bind(ctx, uid, _reader(ctx, stage))
        held += sum(t.numel() * t.element_size() for t in _state_of(entry).values())
    return held


_PLANS: dict[tuple, Any] = {}


def _plan(specs: list[TensorSpec], src: Layout, dst: Layout):
    # Every rank computes the same plan on its own; the weight sync repeats it each step.
    key = (tuple(specs), src, dst)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) > 32:
            _PLANS.clear()
        plan = _PLANS[key] = plan_reshard(specs, src, dst)
    return plan


@register("rl.move")
def move(
    ctx: WorkerContext,
    src_desc: dict[str, Any],
    dst_desc: dict[str, Any],
    *,
    params_only: bool,
    replace: bool,
    timeout: float = 120.0,
) -> dict[str, float]:
    """Reshard a stage's state from layout src to layout dst (collective over all workers).

    ``params_only``: move the weights only (the per-step weight sync actor_train ->
    rollout); otherwise weights, Adam moments and step (a training stage's transition).
    ``replace``: the destination stage is ``dst_desc["stage"]``, built anew with the
    new groups (the old entry dropped only after the bytes arrived).
    """
    rl = _rl(ctx)
    config = rl["config"]
    critic = src_desc["model"] == "critic"
    specs = tensor_specs(config, critic, with_adam=not params_only)
    transport = _move_transport(rl)
    src_entry = rl["stages"].get(src_desc["stage"])
    src_state: dict[str, torch.Tensor] = {}
    if src_entry is not None and rl["rank"] in _layout(src_desc, config.num_layers):
        src_state = _state_of(src_entry)
        if transport.device_type == "cpu":
            src_state = _host(src_state)  # no copy on a CPU worker
        if params_only:
            src_state = {s.name: src_state[s.name] for s in specs if s.name in src_state}
    new_model = _build_model(dst_desc, rl) if replace else None
    t0 = time.perf_counter()
    plan = _plan(specs, _layout(src_desc, config.num_layers), _layout(dst_desc, config.num_layers))
    result = reshard(plan, rl["rank"], src_state, transport, timeout=timeout)
    if result.tensors:
        if replace:
            entry = {"model": new_model, "desc": dst_desc, "trains": dst_desc["trains"]}
        else:
            entry = rl["stages"][dst_desc["stage"]]
        _load_state(entry, result.tensors, rl["hp"])
        _replace_stage(rl, dst_desc["stage"], entry)
    elif replace:
        _replace_stage(rl, dst_desc["stage"], None)
    if replace and new_model is not None and not result.tensors:
        _release_groups({"model": new_model})  # built (collectively) but never used
    return {
        "seconds": time.perf_counter() - t0,
        "bytes_sent": float(result.bytes_sent),
        "bytes_received": float(result.bytes_received),
        "bytes_local": float(result.bytes_local),
    }


def _mine(rl: dict[str, Any], stage: str, per_unit: list[Any]):
    entry = rl["stages"].get(stage)
    if entry is None:
        return None, None, None
    g = entry["model"].groups
    # the driver's tensors are in host memory: this unit's share goes onto the device
    return entry, g, _on_device(per_unit[g.dp_rank], _device(rl))


def _is_reporter(g) -> bool:
    return g.tp_rank == 0 and g.pp_rank == g.pp_size - 1


@register("rl.generate")
def rl_generate(
    ctx: WorkerContext,
    stage: str,
    prompts: list[torch.Tensor],
    max_new_tokens: int,
    temperature: float,
    seed: int,
    eos_id: int,
    *,
    greedy: bool = False,
) -> dict[str, Any] | None:
    """Sample responses for this rank's unit's prompts, with their behaviour log-probs
    (and, for ReMax, greedy responses); the unit's reporting rank returns them."""
    rl = _rl(ctx)
    entry, g, mine = _mine(rl, stage, prompts)
    if entry is None:
        return None
    t0 = time.perf_counter()
    model = entry["model"]
    gen = None
    if temperature > 0:
        # keyed by global sample index, not by dp rank: any split draws the same samples
        first = sum(int(p.shape[0]) for p in prompts[: g.dp_rank])
        gen = make_row_generators(seed, range(first, first + mine.shape[0]), mine.device)
    out = generate(
        model, mine, max_new_tokens, groups=g, temperature=temperature, generator=gen,
        eos_id=eos_id,
    )  # fmt: skip
    outs = pipeline_forward(model, [out.sequences], g)
    logp = response_logprobs(outs[0], out.sequences, out.prompt_len, g) if outs else None
    best = None
    if greedy:
        best = generate(model, mine, max_new_tokens, groups=g, eos_id=eos_id).responses
    secs = time.perf_counter() - t0
    if not _is_reporter(g):
        return None
    # Generation stops when every sequence ended; pad to the limit so units concatenate.
    pad = max_new_tokens - out.response_mask.shape[1]
    res = {
        "unit": g.dp_rank,
        "sequences": F.pad(out.sequences, (0, pad)),
        "mask": F.pad(out.response_mask, (0, pad)),
        "logp": F.pad(logp, (0, pad)),
        "greedy": None if best is None else F.pad(best, (0, max_new_tokens - best.shape[1])),
        "seconds": secs,
    }
    return _on_device(res, _CPU)  # the driver reads host memory


def _micro(t: torch.Tensor, num_micro: int) -> list[torch.Tensor]:
    return list(t.chunk(max(1, min(num_micro, t.shape[0]))))


@register("rl.infer")
def rl_infer(
    ctx: WorkerContext, stage: str, seqs: list[torch.Tensor], prompt_len: int, num_micro: int
) -> dict[str, Any] | None:
    """Response log-probs (policy) or values (critic) of the unit's sequences."""
    rl = _rl(ctx)
    entry, g, mine = _mine(rl, stage, seqs)
    if entry is None:
        return None
    t0 = time.perf_counter()
    model = entry["model"]
    mbs = _micro(mine, num_micro)
    outs = pipeline_forward(model, mbs, g)
    res = None
    if outs is not None:
        parts = []
        for y, mb in zip(outs, mbs):
            if model.is_critic:
                parts.append(response_values(y, prompt_len))
            else:
                parts.append(response_logprobs(y, mb, prompt_len, g))
        res = torch.cat(parts)
    if not _is_reporter(g):
        return None
    return {"unit": g.dp_rank, "out": res.cpu(), "seconds": time.perf_counter() - t0}


@register("rl.train")
def rl_train(
    ctx: WorkerContext, stage: str, batches: list[dict[str, torch.Tensor]], hp: dict[str, Any]
) -> dict[str, Any] | None:
    """One optimizer step of a training stage on its unit's share of the batch.

    Each unit's loss is a sum over its tokens divided by the global token count, times
    the dp degree (the gradient all-reduce averages), so the update does not depend
    on how the batch is split over units.
    """
    rl = _rl(ctx)
    entry, g, b = _mine(rl, stage, batches)
    if entry is None:
        return None
    t0 = time.perf_counter()
    model, opt = entry["model"], entry["opt"]
    critic = model.is_critic
    seqs, mask = b["sequences"], b["mask"]
    prompt_len = int(b["prompt_len"])
    num_tokens = float(b["num_tokens"]) / g.dp_size
    idx = list(
        torch.arange(seqs.shape[0], device=seqs.device).chunk(
            max(1, min(hp["num_micro"], seqs.shape[0]))
        )
    )
    mbs = [seqs[i] for i in idx]
    stats: dict[str, float] = {}

    def loss_fn(y: torch.Tensor, m: int) -> torch.Tensor:
        i = idx[m]
        mk = mask[i]
        if critic:
            v = response_values(y, prompt_len)
            loss, st = value_loss(v, b["old_values"][i], b["returns"][i], mk, num_tokens=num_tokens)
        else:
            logp = response_logprobs(y, mbs[m], prompt_len, g)
            algo = hp["algo"]
            if algo == "grpo":
                loss, st = grpo_loss(
                    logp,
                    b["old_logp"][i],
                    b["ref_logp"][i],
                    b["advantages"][i],
                    mk,
                    kl_coef=hp["kl_coef"],
                    num_tokens=num_tokens,
                )
            elif algo == "ppo":
                loss, st = clipped_policy_loss(
                    logp, b["old_logp"][i], b["advantages"][i], mk, num_tokens=num_tokens
                )
            else:
                loss = reinforce_loss(logp, b["advantages"][i], mk, num_tokens=num_tokens)
                st = {}
            st = {**st, "logp_sum": masked_sum(logp.detach(), mk)}
        for k, v in st.items():
            stats[k] = stats.get(k, 0.0) + float(v)
        return loss

    for group in opt.param_groups:
        group["lr"] = hp["lr"]
    opt.zero_grad(set_to_none=False)
    losses = pipeline_forward_backward(model, mbs, loss_fn, g)
    allreduce_gradients(model, g)
    opt.step()
    if not _is_reporter(g):
        return None
    return {
        "unit": g.dp_rank,
        "loss": float(losses.sum()),
        "stats": stats,
        "seconds": time.perf_counter() - t0,
    }


@register("rl.held_bytes")
def held_bytes(ctx: WorkerContext) -> int:
    """Bytes of model state (weights, Adam moments) this worker holds over all stages."""
    rl = _rl(ctx)
    return sum(
        t.numel() * t.element_size() for e in rl["stages"].values() for t in _state_of(e).values()
    )


@register("rl.shards")
def shards(ctx: WorkerContext, stage: str) -> dict[str, torch.Tensor]:
    """This worker's shards of a stage's state (tests compare them across layouts)."""
    return {k: v.cpu().clone() for k, v in _state_of(_rl(ctx)["stages"].get(stage)).items()}


@register("rl.close")
def close(ctx: WorkerContext) -> None:
    """Drop the stages and leave the default group."""
    ctx.state.pop("rl", None)
    if dist.is_initialized():
        dist.destroy_process_group()
