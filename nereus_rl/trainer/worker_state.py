"""A trainer worker's stage models and their state: build, read, load, release.

Per model-stage the worker keeps an entry ``{"model", "desc", "trains"}`` (and
``"opt"``, AdamW, for a training stage) in its ``rl`` state (:func:`rl_state`): a
:class:`~nereus_rl.models.model.Decoder` of this rank's shard, on the worker's device
(:mod:`nereus_rl.trainer.worker_device`). A stage's state is the model's parameters,
the optimizer's Adam moments and its step, by the names of :func:`tensor_specs` (the
TensorSpecs that nereus_comm reshards and the EMU units hold). :func:`state_of` reads
them (the live tensors, no copy) and :func:`load_state` loads them into a new model;
every setup, rebind and move goes through these two, so the state that reaches a new
model is the same bytes whichever way it travelled.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from nereus_comm.layout import Layout, TensorSpec
from nereus_comm.plan import plan_reshard
from nereus_rl.models.model import Decoder, ModelConfig, state_specs
from nereus_rl.models.parallel import init_parallel_groups
from nereus_rl.runtime.context import WorkerContext
from nereus_rl.trainer import worker_device

ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def rl_state(ctx: WorkerContext) -> dict[str, Any]:
    """This worker's trainer state: ``stages`` (stage -> entry), and what ``rl.init`` and
    ``rl.setup`` left (rank, device, group timeout, model config, hyper-parameters)."""
    return ctx.state.setdefault("rl", {"stages": {}})


def default_liveness(ctx: WorkerContext):
    """Which default-group ranks the driver reports dead, as nereus_comm's ``liveness``
    callable (a move or snapshot waiting on one raises at once, on every route); None
    where ``rl.init`` was not told the group's workers."""
    workers = rl_state(ctx).get("world_workers")
    return None if workers is None else ctx.liveness(workers)


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


def layout(desc: dict[str, Any], num_layers: int) -> Layout:
    """The nereus_comm Layout of a stage description (its units' default-group ranks)."""
    ranks = tuple(r for u in desc["units"] for r in u)
    return Layout(desc["dp"], desc["tp"], desc["pp"], ranks, num_layers=num_layers)


_PLANS: dict[tuple, Any] = {}


def reshard_plan(specs: list[TensorSpec], src: Layout, dst: Layout):
    """nereus_comm's reshard plan from ``src`` to ``dst``, cached: every rank computes
    the same plan on its own, and the weight sync repeats it each step."""
    key = (tuple(specs), src, dst)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) > 32:
            _PLANS.clear()
        plan = _PLANS[key] = plan_reshard(specs, src, dst)
    return plan


_OPTIMIZER_WARM = False


def warm_optimizer() -> None:
    """Construct and step one AdamW in this process, once.

    The first optimizer made in a process imports torch's compiler stack (seconds; the
    next one takes under a millisecond). Paid lazily, it would fall on the first
    transition that gives a worker a training stage it never held, a move the cost
    model prices far lower. Paid at ``rl.init`` it is a start-up cost on every worker
    at once, whatever the plan.
    """
    global _OPTIMIZER_WARM
    if _OPTIMIZER_WARM:
        return
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.AdamW([p], lr=0.0)
    p.sum().backward()
    opt.step()
    _OPTIMIZER_WARM = True


def release_groups(entry: dict[str, Any] | None) -> int:
    """Destroy the process groups of a stage model that is being dropped or replaced.

    Every setup, rebind or replacing move builds the stage's model with new groups
    (``new_group`` is collective over the world, so they cannot be looked up and
    reused by ranks alone). Each gloo group holds a device thread, two worker threads
    and a socket per peer, so a replaced model's groups are destroyed at once rather
    than kept until the next ``rl.init``. Destroying is local (no collective), so only
    the ranks that held the model call it. Returns the number of groups destroyed.
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


def replace_stage(rl: dict[str, Any], stage: str, entry: dict[str, Any] | None) -> None:
    """Set (or, with None, drop) a stage's entry, releasing the old model's groups."""
    old = rl["stages"].pop(stage, None)
    if entry is not None:
        rl["stages"][stage] = entry
    if old is not None and old is not entry:
        release_groups(old)


def build_model(desc: dict[str, Any], rl: dict[str, Any]) -> Decoder | None:
    """This rank's model of the stage ``desc`` (None: not a member), for the config and
    the group timeout ``rl.init`` and ``rl.setup`` left in ``rl``."""
    ranks = [r for u in desc["units"] for r in u]
    # The default group's timeout, not new_group's own default (30 minutes for gloo): a
    # survivor waiting in a stage's all-reduce on a peer that left it after another
    # worker died is released only by it (tests/rl/trainer/test_trainer_recovery_hang.py)
    groups = init_parallel_groups(desc["tp"], desc["pp"], desc["dp"], ranks, rl["timeout"])
    if groups is None:
        return None
    return Decoder(
        rl["config"],
        groups,
        value_head=desc["model"] == "critic",
        device=worker_device.device_of(rl),
    )


def state_of(entry: dict[str, Any] | None) -> dict[str, torch.Tensor]:
    """This rank's shards of a stage's state by spec name (params, Adam moments, step)."""
    if entry is None:
        return {}
    model = entry["model"]
    # A tied embedding held once (one pipeline stage) is listed under both of its names,
    # as the state's specs name it (nereus_rl.models.model).
    params = model.shard_state_dict()
    out = dict(params)
    opt = entry.get("opt")
    if opt is not None:
        step = 0.0
        for name, p in model.named_parameters(remove_duplicate=False):
            st = opt.state.get(p, {})
            for k in ADAM_KEYS:
                out[f"{k}.{name}"] = st[k] if k in st else torch.zeros_like(p)
            if "step" in st:
                step = float(st["step"])
        # beside the moments, so a device-to-device move has every shard on the device
        out["adam_step"] = torch.tensor([step], device=next(model.parameters()).device)
    return out


def state_bytes(entry: dict[str, Any] | None) -> int:
    """Bytes of a stage's state on this rank."""
    return sum(t.numel() * t.element_size() for t in state_of(entry).values())


def make_opt(model: Decoder, hp: dict[str, Any]) -> torch.optim.Optimizer:
    """The training stages' optimizer (AdamW) over ``model``'s parameters."""
    return torch.optim.AdamW(
        model.parameters(), lr=hp["lr"], betas=(0.9, 0.98), weight_decay=0.0, eps=1e-8
    )


def load_state(entry: dict[str, Any], state: dict[str, torch.Tensor], hp: dict[str, Any]) -> None:
    """Load ``state`` (by spec name) into the entry's model, and for a training stage
    into a new optimizer (its Adam moments and step)."""
    model = entry["model"]
    params = dict(model.named_parameters(remove_duplicate=False))
    model.load_shard_state_dict({n: state[n] for n in params})
    if entry.get("trains"):
        opt = make_opt(model, hp)
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


def reader(ctx: WorkerContext, stage: str):
    """What an EMU unit bound to ``stage`` reads: the stage's state in host memory.

    Looked up at each read: a rebind or a weight sync changes what the stage holds.
    EMU primitives move host memory over gloo, so a GPU worker's units read host copies.
    """
    return lambda: worker_device.host(state_of(rl_state(ctx)["stages"].get(stage)))
