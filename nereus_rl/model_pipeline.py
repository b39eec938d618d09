"""Pipeline-parallel execution of a :class:`nereus_rl.model.Decoder` (GPipe schedule).

Every rank of a pipeline is given the same micro-batches of token ids (they are
small; the first stage embeds them, the others use their shape, and the last
stage's loss function may use them as targets). Activations go forward and
their gradients backward with point-to-point send/recv in the pp group; all
forwards run first, then all backwards in reverse order (GPipe), which keeps
the send/recv order identical on both sides of every link, so blocking gloo
calls cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from nereus_rl.model_parallel import COMM_COUNTS, ParallelGroups


def send(t: torch.Tensor, stage: int, groups: ParallelGroups) -> None:
    """Send ``t`` to pipeline stage ``stage`` of this rank's pipeline (counted)."""
    COMM_COUNTS["send"] += 1
    dist.send(t.contiguous(), dst=groups.pp_ranks[stage], group=groups.pp_group)


def recv(shape, dtype: torch.dtype, device, stage: int, groups: ParallelGroups) -> torch.Tensor:
    """Receive a tensor of ``shape`` from pipeline stage ``stage`` (counted)."""
    COMM_COUNTS["recv"] += 1
    t = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(t, src=groups.pp_ranks[stage], group=groups.pp_group)
    return t


def broadcast_from_last(
    t: torch.Tensor | None, shape, dtype: torch.dtype, groups: ParallelGroups, device="cpu"
) -> torch.Tensor:
    """The last stage's ``t`` on every stage of the pipeline (``t`` is ignored elsewhere)."""
    if groups.pp_group is None:
        assert t is not None
        return t
    if groups.pp_rank != groups.pp_size - 1:
        t = torch.empty(shape, dtype=dtype, device=device)
    else:
        t = t.contiguous()
    COMM_COUNTS["broadcast"] += 1
    dist.broadcast(t, src=groups.pp_ranks[-1], group=groups.pp_group)
    return t


def _hidden_shape(model, tokens: torch.Tensor) -> tuple[int, int, int]:
    return (tokens.shape[0], tokens.shape[1], model.config.hidden)


def pipeline_forward(
    model, micro_batches: Sequence[torch.Tensor], groups: ParallelGroups
) -> list[torch.Tensor] | None:
    """Forward only (no graph kept): the last stage's outputs per micro-batch.

    Arguments:
        model: this rank's Decoder stage.
        micro_batches: token ids [b, T] per micro-batch, the same on every stage.
        groups: this rank's groups.

    Returns:
        On the last stage, the head outputs (logits shards or values) per micro-batch;
        None on other stages.
    """
    outs = []
    with torch.no_grad():
        for tokens in micro_batches:
            x = tokens
            if not model.is_first:
                x = recv(
                    _hidden_shape(model, tokens),
                    model.dtype,
                    tokens.device,
                    groups.pp_rank - 1,
                    groups,
                )
            y = model(x)
            if model.is_last:
                outs.append(y)
            else:
                send(y, groups.pp_rank + 1, groups)
    return outs if model.is_last else None


def pipeline_forward_backward(
    model,
    micro_batches: Sequence[torch.Tensor],
    loss_fn: Callable[[torch.Tensor, int], torch.Tensor],
    groups: ParallelGroups,
) -> torch.Tensor:
    """One GPipe pass: forward every micro-batch, then backward in reverse order.

    Gradients accumulate into the stage's parameters (``.grad``); the total gradient
    is that of ``sum_m loss_fn(out_m, m)``, so scale inside ``loss_fn`` as needed.

    Arguments:
        model: this rank's Decoder stage.
        micro_batches: token ids [b, T] per micro-batch, the same on every stage.
        loss_fn: (last-stage head output, micro-batch index) -> scalar loss; called on the
            last stage only.
        groups: this rank's groups.

    Returns:
        The micro-batch losses [M] (detached, fp32) on every stage of the pipeline.
    """
    inputs: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    losses: list[torch.Tensor] = []
    for m, tokens in enumerate(micro_batches):
        x = tokens
        if not model.is_first:
            x = recv(
                _hidden_shape(model, tokens), model.dtype, tokens.device, groups.pp_rank - 1, groups
            )
            x.requires_grad_(True)
        y = model(x)
        inputs.append(x)
        if model.is_last:
            loss = loss_fn(y, m)
            losses.append(loss)
            outputs.append(loss)
        else:
            send(y.detach(), groups.pp_rank + 1, groups)
            outputs.append(y)
    for m in reversed(range(len(micro_batches))):
        if model.is_last:
            outputs[m].backward()
        else:
            grad = recv(
                outputs[m].shape, outputs[m].dtype, outputs[m].device, groups.pp_rank + 1, groups
            )
            torch.autograd.backward(outputs[m], grad)
        if not model.is_first:
            send(inputs[m].grad, groups.pp_rank - 1, groups)
        outputs[m] = inputs[m] = None  # free the micro-batch's graph and activations
    result = torch.stack([x.detach().float() for x in losses]) if model.is_last else None
    return broadcast_from_last(
        result, (len(micro_batches),), torch.float32, groups, micro_batches[0].device
    )
