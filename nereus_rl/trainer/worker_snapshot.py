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
"""

from __future__ import annotations

import time
from typing import Any

import torch

from nereus_comm.reshard import reshard
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
    for key in [k for k in snaps if k[0] == stage and k[1] < keep_from]:
        del snaps[key]
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
        rec["own"] = {k: v.detach().to("cpu", copy=True) for k, v in live.items()}
    copied = time.perf_counter() - t0
    sent = received = 0
    if mirror_desc is not None:
        specs = tensor_specs(config, src_desc["model"] == "critic", with_adam=True)
        plan = reshard_plan(specs, src, layout(mirror_desc, n))
        res = reshard(
            plan, rl["rank"], rec.get("own", {}), GlooTransport(), timeout=timeout,
            liveness=default_liveness(ctx), verify_plan=False,  # one plan, from the driver
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
