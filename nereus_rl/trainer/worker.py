"""Worker-side RL commands: hold each stage's model shard, run its work, move its state.

Imported on every worker by :class:`nereus_rl.trainer.trainer.Trainer` (through
``Driver.import_module``), which registers the commands: ``rl.init`` (join the
job's default process group), ``rl.setup`` (build the stages from full initial
states), ``rl.rebind`` (rebuild stages on new layouts from their EMU units),
``rl.move`` (reshard a stage between layouts), ``rl.generate``, ``rl.infer`` and
``rl.train`` (a stage's work), ``rl.save_hf`` (a stage as a Hugging Face folder),
``rl.held_bytes``, ``rl.shards`` and ``rl.close``, and
(:mod:`nereus_rl.trainer.worker_snapshot`) ``rl.snapshot`` and ``rl.snapshot_get``.

A worker is one device (:mod:`nereus_rl.trainer.worker_device`: where the stages live,
host copies, the move transport). It joins a default gloo (or, on GPU,
``cpu:gloo,cuda:nccl``) process group over all the job's workers so that the model's
tensor, pipeline and data parallel groups (``torch.distributed.new_group``) can be
built for any layout the plan asks for. Per model-stage it keeps a
:class:`~nereus_rl.models.model.Decoder` of its shard, and AdamW for a training stage
(:mod:`nereus_rl.trainer.worker_state`: stage models, optimizer, state read and load).

The stage's state on this rank is also the shard of an EMU unit
(:mod:`nereus_rl.emu.worker`): the driver adopts each unit with the state owner
``"trainer"`` registered here, so the unit's tensors *are* the model's
parameters and the optimizer's Adam moments (and step), read at the moment a
primitive copies them; no second copy is kept. A plan transition runs EMU
primitives on those units (new units receive plain tensors), then
``rl.rebind`` builds each changed stage's model for its new layout from its
new unit's tensors, through the same ``load_state`` as a reshard, and binds
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
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nereus_comm.reshard import reshard
from nereus_rl.algos.common import clipped_policy_loss, masked_sum
from nereus_rl.algos.grpo import grpo_loss
from nereus_rl.algos.ppo import value_loss
from nereus_rl.algos.remax import reinforce_loss
from nereus_rl.emu.worker import bind, register_state_owner, tensors_of
from nereus_rl.models.generate import generate, make_row_generators
from nereus_rl.models.hf import HFWeights, merge_tp_shards, save_hf_stage
from nereus_rl.models.model import (
    ModelConfig,
    allreduce_tied_gradients,
    full_attention_mask,
    shard_tensor,
)
from nereus_rl.models.parallel import allreduce_gradients, response_logprobs, response_values
from nereus_rl.models.pipeline import pipeline_forward, pipeline_forward_backward
from nereus_rl.runtime.context import WorkerContext, register
from nereus_rl.trainer import worker_device, worker_snapshot  # noqa: F401 (registers rl.snapshot*)
from nereus_rl.trainer.worker_state import (
    ADAM_KEYS,
    build_model,
    default_liveness,
    layout,
    load_state,
    reader,
    release_groups,
    replace_stage,
    reshard_plan,
    rl_state,
    state_bytes,
    state_of,
    tensor_specs,
    warm_optimizer,
)

# The EMU units the driver adopts with owner "trainer" read the stage models' state.
register_state_owner("trainer", reader)


@register("rl.init")
def init_world(
    ctx: WorkerContext,
    rank: int,
    world_size: int,
    prefix: str,
    timeout: float | None = None,
    device: str = "cpu",
    workers: list[int] | None = None,
) -> int:
    """Join the job's default process group as ``rank`` of ``world_size``.

    ``timeout``: seconds a collective may wait for a peer, on the default group and on
    every stage model's groups (default: the worker's ``group_timeout``). A death the
    driver notices ends a survivor's wait sooner (nereus_rl.runtime.abort breaks the
    running command's connections); the timeout bounds what it does not notice.
    ``device``: ``"cpu"`` (a gloo group; shards in host memory) or ``"cuda"`` (shards
    on :func:`worker_device`'s GPU; gloo for host tensors and NCCL for device ones).
    ``workers``: the worker of each rank of the group (its deaths, which the driver
    reports in worker ranks, end a move's waits on it at once; None: they do not).
    """
    torch.set_num_threads(1)
    if timeout is None:
        timeout = ctx.group_timeout
    # before leaving a group: a bad kind changes nothing
    dev = worker_device.worker_device(device, rank)
    if dev.type == "cuda":
        # The moves' NcclTransport loads NCCL from its wheel: a missing library is
        # reported here, at start, not at the first weight sync.
        from nereus_comm.nccl import load_nccl

        load_nccl()
    worker_device.drop_move_transport(rl_state(ctx))
    if dist.is_initialized():
        dist.destroy_process_group()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    # Host tensors (the driver's batches, staged shards) always have gloo; a stage
    # model's collectives take NCCL when its tensors are on the GPU.
    backend = "gloo" if dev.type == "cpu" else "cpu:gloo,cuda:nccl"

    def join(client) -> dist.Store:
        store = dist.PrefixStore(prefix, client)
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        return store

    if workers is None or ctx.address is None:
        store = join(ctx.store)
    else:
        # The group, and a store client of its own for its rendezvous, belong to these
        # workers: a member's death shuts both down on the survivors (the rendezvous
        # would otherwise wait the whole timeout for it), and a death elsewhere spares
        # them (nereus_rl.runtime.abort).
        with ctx.track_group(("rl.world", prefix), workers):
            store = join(ctx.store_client(timeout))
        if dev.type == "cuda":
            # NCCL waits on no socket: a member's death aborts every communicator of the
            # process (ncclCommAbort, in one NCCL group), so a survivor's collective
            # returns at once; the recovery's rl.init then forms the groups again.
            ctx.abort.on_abort(
                ("rl.world", prefix), lambda: dist.distributed_c10d._abort_process_group()
            )
    rl_state(ctx)["rank"] = rank
    rl_state(ctx)["timeout"] = timeout
    rl_state(ctx)["device"] = dev
    rl_state(ctx)["world"] = (store, world_size)
    rl_state(ctx)["world_workers"] = None if workers is None else list(workers)
    warm_optimizer()
    return rank


@register("rl.setup")
def setup(
    ctx: WorkerContext,
    stages: list[dict[str, Any]],
    config: ModelConfig,
    full_states: dict[str, dict[str, torch.Tensor] | HFWeights],
    hp: dict[str, Any],
) -> dict[str, int]:
    """Build every stage's shard on this worker from full initial states (at start; the
    startup calibration's probes call it once per probe plan, the run's plan last).

    A model's state is its full tensors by name, or an :class:`HFWeights` folder from
    which each rank reads only its slices.

    Collective over all workers (process groups are created in the same order everywhere).
    Returns bytes held per stage on this rank.
    """
    rl = rl_state(ctx)
    rl["config"], rl["hp"] = config, hp
    held = {}
    for desc in stages:
        model = build_model(desc, rl)
        if model is None:
            # not a member: drop what an earlier setup (a calibration probe) left here
            replace_stage(rl, desc["stage"], None)
            continue
        full = full_states[desc["model"]]
        dev = worker_device.device_of(rl)
        if isinstance(full, HFWeights):
            # A Hugging Face folder: this rank reads its own slices, nobody the whole file
            # (a fresh AdamW, as for any initial state).
            shards = {k: v.to(dev, copy=True) for k, v in full.shards(model).items()}
        else:
            # A training stage restored from a snapshot gets its Adam moments and step too
            # (nereus_rl.trainer.snapshot); the initial states have none (a fresh AdamW).
            adam = desc["trains"] and "adam_step" in full
            shards = {}
            g = model.groups
            for spec in model.local_specs():
                names = [spec.name] + ([f"{k}.{spec.name}" for k in ADAM_KEYS] if adam else [])
                for name in names:
                    shards[name] = shard_tensor(
                        full[name], spec.split_dim, g.tp_rank, g.tp_size
                    ).to(dev, copy=True)
            if adam:
                shards["adam_step"] = full["adam_step"].to(dev, copy=True)
        entry = {"model": model, "desc": desc, "trains": desc["trains"]}
        load_state(entry, shards, hp)
        replace_stage(rl, desc["stage"], entry)
        held[desc["stage"]] = state_bytes(entry)
    return held


@register("rl.rebind")
def rebind(ctx: WorkerContext, stages: list[tuple[dict[str, Any], list[int]]]) -> int:
    """Build stages' models for their new layouts from their EMU units, after a transition.

    Collective over all workers (the models' groups are made with ``new_group``).
    Per ``(desc, uids)``: ``uids[i]`` is the EMU unit of ``desc["units"][i]``; a
    member loads its unit's shards (received by a primitive, or a kept unit's live
    state) and binds the unit to the new model. Returns the bytes of state this rank
    now holds for those stages.
    """
    rl = rl_state(ctx)
    held = 0
    for desc, uids in stages:
        stage = desc["stage"]
        model = build_model(desc, rl)
        if model is None:
            replace_stage(rl, stage, None)
            continue
        uid = uids[model.groups.dp_rank]
        entry = {"model": model, "desc": desc, "trains": desc["trains"]}
        load_state(entry, tensors_of(ctx, uid), rl["hp"])
        replace_stage(rl, stage, entry)
        bind(ctx, uid, reader(ctx, stage))
        held += state_bytes(entry)
    return held


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
    rl = rl_state(ctx)
    config = rl["config"]
    critic = src_desc["model"] == "critic"
    specs = tensor_specs(config, critic, with_adam=not params_only)
    transport = worker_device.move_transport(rl)
    src_entry = rl["stages"].get(src_desc["stage"])
    src_state: dict[str, torch.Tensor] = {}
    if src_entry is not None and rl["rank"] in layout(src_desc, config.num_layers):
        src_state = state_of(src_entry)
        if transport.device_type == "cpu":
            src_state = worker_device.host(src_state)  # no copy on a CPU worker
        if params_only:
            src_state = {s.name: src_state[s.name] for s in specs if s.name in src_state}
    new_model = build_model(dst_desc, rl) if replace else None
    t0 = time.perf_counter()
    n = config.num_layers
    plan = reshard_plan(specs, layout(src_desc, n), layout(dst_desc, n))
    live = default_liveness(ctx)
    # Every rank built the plan from the driver's one description: no rank can
    # disagree, so the plan check's round trip is skipped (a weight sync every step).
    result = reshard(
        plan, rl["rank"], src_state, transport, timeout=timeout, liveness=live, verify_plan=False
    )
    if result.tensors:
        if replace:
            entry = {"model": new_model, "desc": dst_desc, "trains": dst_desc["trains"]}
        else:
            entry = rl["stages"][dst_desc["stage"]]
        load_state(entry, result.tensors, rl["hp"])
        replace_stage(rl, dst_desc["stage"], entry)
    elif replace:
        replace_stage(rl, dst_desc["stage"], None)
    if replace and new_model is not None and not result.tensors:
        release_groups({"model": new_model})  # built (collectively) but never used
    return {
        "seconds": time.perf_counter() - t0,
        "bytes_sent": float(result.bytes_sent),
        "bytes_received": float(result.bytes_received),
        "bytes_local": float(result.bytes_local),
        # of bytes_sent, those over the socket route's streams (peers on other hosts)
        "bytes_net": float(result.net_bytes_sent),
    }


def _mine(rl: dict[str, Any], stage: str, per_unit: list[Any]):
    entry = rl["stages"].get(stage)
    if entry is None:
        return None, None, None
    g = entry["model"].groups
    # the driver's tensors are in host memory: this unit's share goes onto the device
    return entry, g, worker_device.on_device(per_unit[g.dp_rank], worker_device.device_of(rl))


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
    eos_id: int | None,
    *,
    greedy: bool = False,
    pad_id: int = 0,
    prompt_masks: list[torch.Tensor] | None = None,
) -> dict[str, Any] | None:
    """Sample responses for this rank's unit's prompts, with their behaviour log-probs
    (and, for ReMax, greedy responses); the unit's reporting rank returns them.

    ``prompt_masks``: per unit, the left-padded prompts' mask (1 = real token), for
    prompts of different lengths; None when they share one length. ``pad_id`` fills
    what follows a response's EOS."""
    rl = rl_state(ctx)
    entry, g, mine = _mine(rl, stage, prompts)
    if entry is None:
        return None
    pmask = None
    if prompt_masks is not None:
        pmask = worker_device.on_device(prompt_masks[g.dp_rank], mine.device)
    t0 = time.perf_counter()
    model = entry["model"]
    gen = None
    if temperature > 0:
        # keyed by global sample index, not by dp rank: any split draws the same samples
        first = sum(int(p.shape[0]) for p in prompts[: g.dp_rank])
        gen = make_row_generators(seed, range(first, first + mine.shape[0]), mine.device)
    out = generate(
        model, mine, max_new_tokens, groups=g, temperature=temperature, generator=gen,
        eos_id=eos_id, pad_id=pad_id, prompt_mask=pmask,
    )  # fmt: skip
    outs = pipeline_forward(model, [out.sequences], g, attention_masks=[out.attention_mask])
    logp = response_logprobs(outs[0], out.sequences, out.prompt_len, g) if outs else None
    best = None
    if greedy:
        best = generate(
            model, mine, max_new_tokens, groups=g, eos_id=eos_id, pad_id=pad_id, prompt_mask=pmask
        ).responses
    secs = time.perf_counter() - t0
    if not _is_reporter(g):
        return None
    # Generation stops when every sequence ended; pad to the limit so units concatenate.
    pad = max_new_tokens - out.response_mask.shape[1]
    res = {
        "unit": g.dp_rank,
        "sequences": F.pad(out.sequences, (0, pad), value=pad_id),
        "mask": F.pad(out.response_mask, (0, pad)),
        "logp": F.pad(logp, (0, pad)),
        "greedy": None
        if best is None
        else F.pad(best, (0, max_new_tokens - best.shape[1]), value=pad_id),
        "seconds": secs,
    }
    return worker_device.on_device(res, worker_device.CPU)  # the driver reads host memory


def _micro(t: torch.Tensor, num_micro: int) -> list[torch.Tensor]:
    return list(t.chunk(max(1, min(num_micro, t.shape[0]))))


def _attention_masks(
    prompt_mask: torch.Tensor | None, idx: list[torch.Tensor], seq_len: int
) -> list[torch.Tensor] | None:
    """Per micro-batch (rows ``idx[m]``), the attention mask of left-padded prompts
    followed by their responses; None for prompts of one length."""
    if prompt_mask is None:
        return None
    full = full_attention_mask(prompt_mask, seq_len)
    return [full[i] for i in idx]


@register("rl.infer")
def rl_infer(
    ctx: WorkerContext,
    stage: str,
    seqs: list[torch.Tensor],
    prompt_len: int,
    num_micro: int,
    *,
    prompt_masks: list[torch.Tensor] | None = None,
) -> dict[str, Any] | None:
    """Response log-probs (policy) or values (critic) of the unit's sequences.

    ``prompt_masks``: per unit, the mask of the left-padded prompts (None: one length)."""
    rl = rl_state(ctx)
    entry, g, mine = _mine(rl, stage, seqs)
    if entry is None:
        return None
    t0 = time.perf_counter()
    model = entry["model"]
    mbs = _micro(mine, num_micro)
    pmask = None
    if prompt_masks is not None:
        pmask = worker_device.on_device(prompt_masks[g.dp_rank], mine.device)
    rows = list(torch.arange(mine.shape[0], device=mine.device).chunk(len(mbs)))
    masks = _attention_masks(pmask, rows, mine.shape[1])
    outs = pipeline_forward(model, mbs, g, attention_masks=masks)
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
    rl = rl_state(ctx)
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
    # left-padded prompts: every stage masks the padding (the losses read response
    # columns only, under the response mask)
    masks = _attention_masks(b.get("prompt_mask"), idx, seqs.shape[1])
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
    losses = pipeline_forward_backward(model, mbs, loss_fn, g, attention_masks=masks)
    allreduce_tied_gradients(model)
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


@register("rl.save_hf")
def save_hf(ctx: WorkerContext, stage: str, path: str) -> list[str]:
    """Write a stage's model (the policy, or a critic with its value head) as a Hugging
    Face folder, from the live shards of its first data-parallel unit.

    Collective over that unit's tensor-parallel groups: each pipeline stage's tp shards
    are gathered on its tp rank 0, which writes that stage's file (the first stage also
    config.json and the index; see :func:`nereus_rl.models.hf.save_hf_stage`). No rank
    holds more than one pipeline stage's tensors. ``path`` must be reachable from every
    writing worker (a local folder, or a shared file system for joined workers).
    Returns the files this rank wrote.
    """
    entry = rl_state(ctx)["stages"].get(stage)
    if entry is None:
        return []
    model = entry["model"]
    g = model.groups
    if g.dp_rank != 0:
        return []
    specs = model.local_specs()
    shards = model.shard_state_dict()
    gathered: list[dict[str, torch.Tensor]] = [{} for _ in range(g.tp_size)]
    for spec in specs:
        t = shards[spec.name].contiguous()
        if g.tp_size == 1:
            gathered[0][spec.name] = t.cpu()
            continue
        parts = [torch.empty_like(t) for _ in range(g.tp_size)]
        dist.all_gather(parts, t, group=g.tp_group)
        for r, part in enumerate(parts):
            gathered[r][spec.name] = part.cpu()
    if g.tp_rank != 0:
        return []
    full = merge_tp_shards(gathered, specs)
    files = save_hf_stage(
        path, full, model.config, stage=g.pp_rank, num_stages=g.pp_size,
        value_head=model.is_critic,
    )  # fmt: skip
    return [str(f) for f in files]


@register("rl.held_bytes")
def held_bytes(ctx: WorkerContext) -> int:
    """Bytes of model state (weights, Adam moments) this worker holds over all stages."""
    return sum(state_bytes(e) for e in rl_state(ctx)["stages"].values())


@register("rl.shards")
def shards(ctx: WorkerContext, stage: str) -> dict[str, torch.Tensor]:
    """This worker's shards of a stage's state (tests compare them across layouts)."""
    return {k: v.cpu().clone() for k, v in state_of(rl_state(ctx)["stages"].get(stage)).items()}


@register("rl.close")
def close(ctx: WorkerContext) -> None:
    """Drop the stages and leave the default group."""
    ctx.state.pop("rl", None)
    if dist.is_initialized():
        dist.destroy_process_group()
