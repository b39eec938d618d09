"""Worker-side in-memory snapshots of the training stages: ``rl.snapshot`` and
``rl.snapshot_get`` (the driver's side is :mod:`nereus_rl.trainer.snapshot`).

After each step's optimizer step, every rank of one unit of a training stage copies
its shards (weights, Adam moments and step) into host memory (its *own* copy), and,
where the stage would otherwise die with one worker or node, sends them to a buddy
rank that keeps them as a *mirror*. Both are kept by (stage, tag), the tag being
the driver's count of snapshots taken (the driver knows which step each holds). A
recovery reads a whole snapshot back (``rl.snapshot_get``): from the holders that
survived, and from the buddies of the ones that did not.

Why host copies and not the live tensors: the next optimizer step changes the live
tensors in place, and a death in the middle of it must find the last committed
snapshot unchanged. Why two at a time: a death while snapshot ``k`` is being written
leaves some ranks with it and some without, and the driver then restores the
committed one, which every rank still has (each call names it, ``keep_from``; older
ones are dropped, and a new one never overwrites it).

Why the dropped ones' tensors are written again rather than freed: on CPU workers
that share the cores, a fresh allocation per snapshot costs page faults and zeroing
as large as the copy itself, on every step; a dropped copy's tensors of the same
names, shapes and dtypes take the next copy in place (``copy_``, and the mirror's
reshard ``out=``), and a workspace per stage keeps the reshard's staging buffers.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from nereus_comm.layout import box_shape
from nereus_comm.reshard import Workspace, reshard
from nereus_comm.transport import GlooTransport
from nereus_rl.runtime.context import WorkerContext, register
from nereus_rl.trainer.worker_state import (
    default_liveness,
    layout,
    reshard_plan,
    rl_state,
    state_of,
    tensor_specs,
)


def _store(rl: dict[str, Any]) -> dict[tuple[str, int], dict[str, dict[str, torch.Tensor]]]:
    return rl.setdefault("snapshots", {})


def _spare(rl: dict[str, Any]) -> dict[tuple[str, str], dict[str, torch.Tensor]]:
    """(stage, "own" | "mirror") -> the tensors of a dropped copy, to be written again."""
    return rl.setdefault("snapshot_spare", {})


def _reusable(
    spare: dict[str, torch.Tensor] | None, like: dict[str, tuple[torch.Size, torch.dtype]]
) -> dict[str, torch.Tensor] | None:
    """``spare`` when it has exactly the names, shapes and dtypes of ``like``, else None."""
    if spare is None or spare.keys() != like.keys():
        return None
    for k, (shape, dtype) in like.items():
        t = spare[k]
        if t.shape != shape or t.dtype != dtype or t.device.type != "cpu":
            return None
    return spare


@register("rl.snapshot")
def snapshot(
    ctx: WorkerContext,
    stage: str,
    tag: int,
    src_desc: dict[str, Any],
    mirror_desc: dict[str, Any] | None,
    keep_from: int,
    timeout: float = 120.0,
) -> dict[str, float]:
    """Keep snapshot ``tag`` of ``stage``'s state: a host copy on each rank of the
    unit ``src_desc`` (one unit, default-group ranks) and, when ``mirror_desc`` is given
    (the same tp x pp on other ranks), a mirror of shard ``i`` on its rank ``i``.

    Called on the ranks of both layouts only (the copy to the buddies is a nereus_comm
    reshard between them). Snapshots of ``stage`` older than ``keep_from`` are dropped
    first. Returns the seconds and bytes of this rank's part.
    """
    rl = rl_state(ctx)
    snaps = _store(rl)
    spare = _spare(rl)
    for key in [k for k in snaps if k[0] == stage and k[1] < keep_from]:
        for which, tensors in snaps.pop(key).items():
            spare[(stage, which)] = tensors
    config = rl["config"]
    n = config.num_layers
    src = layout(src_desc, n)
    t0 = time.perf_counter()
    rec: dict[str, dict[str, torch.Tensor]] = {}
    if rl["rank"] in src:
        live = state_of(rl["stages"].get(stage))
        if not live:
            raise RuntimeError(
                f"rank {rl['rank']} is in {stage!r}'s unit {src_desc['units']} but holds no "
                "state of it; the driver's plan and this worker disagree"
            )
        # a copy, on every device: the next optimizer step writes the live tensors
        into = _reusable(
            spare.pop((stage, "own"), None), {k: (v.shape, v.dtype) for k, v in live.items()}
        )
        if into is None:
            rec["own"] = {k: v.detach().to("cpu", copy=True) for k, v in live.items()}
        else:
            for k, v in live.items():
                into[k].copy_(v.detach())
            rec["own"] = into
    copied = time.perf_counter() - t0
    sent = received = 0
    if mirror_desc is not None:
        specs = tensor_specs(config, src_desc["model"] == "critic", with_adam=True)
        dst = layout(mirror_desc, n)
        plan = reshard_plan(specs, src, dst)
        out = None
        if rl["rank"] in dst:
            mine = {}
            for spec in specs:
                box = dst.box(spec, rl["rank"], n)
                if box is not None:
                    mine[spec.name] = (torch.Size(box_shape(box)), spec.dtype)
            out = _reusable(spare.pop((stage, "mirror"), None), mine)
        spaces = rl.setdefault("snapshot_workspaces", {})
        ws = spaces.get(stage)
        if ws is None:
            ws = spaces[stage] = Workspace("cpu")
        res = reshard(
            plan, rl["rank"], rec.get("own", {}), GlooTransport(), timeout=timeout,
            liveness=default_liveness(ctx), verify_plan=False,  # one plan, from the driver
            out=out, workspace=ws,
        )  # fmt: skip
        if res.tensors:
            rec["mirror"] = dict(res.tensors)
        sent, received = res.bytes_sent, res.bytes_received
    if rec:
        snaps[(stage, tag)] = rec
    return {
        "copy_s": copied,
        "seconds": time.perf_counter() - t0,
        "bytes_sent": float(sent),
        "bytes_received": float(received),
    }


@register("rl.snapshot_get")
def snapshot_get(ctx: WorkerContext, stage: str, tag: int, which: str) -> dict[str, torch.Tensor]:
    """This worker's ``which`` copy (``"own"`` or ``"mirror"``) of ``stage``'s snapshot
    ``tag``.

    Raises:
        KeyError: this worker keeps no such copy (the driver asked the wrong worker).
    """
    rec = _store(rl_state(ctx)).get((stage, tag), {})
    if which not in rec:
        raise KeyError(
            f"worker {ctx.rank} keeps no {which!r} copy of {stage!r} snapshot {tag} "
            f"(it keeps {sorted((k, sorted(v)) for k, v in _store(rl_state(ctx)).items())})"
        )
    return rec[which]
