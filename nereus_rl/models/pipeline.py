"""Pipeline-parallel execution of a :class:`nereus_rl.models.model.Decoder` (1F1B or GPipe).

Every rank of a pipeline is given the same micro-batches of token ids (they are
small; the first stage embeds them, the others use their shape, and the last
stage's loss function may use them as targets). Activations go forward and
their gradients backward with point-to-point send/recv in the pp group, posted
as batches (``batch_isend_irecv``) so a send and a receive in opposite
directions can meet. Schedules: GPipe (all forwards, then all backwards) and
1F1B (Megatron's: warm-up forwards, then one forward and one backward per step,
which bounds the activations a stage holds by the number of stages after it).

Batches of left-padded sequences (prompts of different lengths) pass one attention
mask per micro-batch (``attention_masks``, [b, T], 1 = real token), given to every stage
like the token ids: each stage masks padding keys and derives the rows' positions from
it, so nothing extra travels between stages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from nereus_rl.models.parallel import COMM_COUNTS, ParallelGroups

LAST_PASS: dict[str, int] = {}
"""Facts about this process's last :func:`pipeline_forward_backward` call:
``max_live_micro_batches`` (most micro-batches whose activations were held at once)."""


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


def _check_masks(
    micro_batches: Sequence[torch.Tensor], attention_masks: Sequence[torch.Tensor | None] | None
) -> list[torch.Tensor | None]:
    """One attention mask (or None) per micro-batch, each the shape of its token ids."""
    if attention_masks is None:
        return [None] * len(micro_batches)
    masks = list(attention_masks)
    if len(masks) != len(micro_batches):
        raise ValueError(
            f"{len(masks)} attention masks for {len(micro_batches)} micro-batches; "
            "give one per micro-batch (or None)"
        )
    for i, (mask, tokens) in enumerate(zip(masks, micro_batches)):
        if mask is not None and tuple(mask.shape) != tuple(tokens.shape):
            raise ValueError(
                f"micro-batch {i}: attention mask {tuple(mask.shape)} for token ids "
                f"{tuple(tokens.shape)}; they must match"
            )
    return masks


def pipeline_forward(
    model,
    micro_batches: Sequence[torch.Tensor],
    groups: ParallelGroups,
    *,
    attention_masks: Sequence[torch.Tensor | None] | None = None,
) -> list[torch.Tensor] | None:
    """Forward only (no graph kept): the last stage's outputs per micro-batch.

    Arguments:
        model: this rank's Decoder stage.
        micro_batches: token ids [b, T] per micro-batch, the same on every stage.
        groups: this rank's groups.
        attention_masks: per micro-batch, None or [b, T] (1 = real token) for left-padded
            rows (e.g. ``GenerationOutput.attention_mask`` split like the tokens); the
            same on every stage. None: no padding anywhere.

    Returns:
        On the last stage, the head outputs (logits shards or values) per micro-batch;
        None on other stages.

    Raises:
        ValueError: the masks do not match the micro-batches.
    """
    masks = _check_masks(micro_batches, attention_masks)
    outs = []
    with torch.no_grad():
        for tokens, mask in zip(micro_batches, masks):
            x = tokens
            if not model.is_first:
                x = recv(
                    _hidden_shape(model, tokens),
                    model.dtype,
                    tokens.device,
                    groups.pp_rank - 1,
                    groups,
                )
            y = model(x, attention_mask=mask)
            if model.is_last:
                outs.append(y)
            else:
                send(y, groups.pp_rank + 1, groups)
    return outs if model.is_last else None


def _exchange(
    sends: Sequence[tuple[torch.Tensor, int]],
    recvs: Sequence[tuple[tuple[int, ...], int]],
    dtype: torch.dtype,
    device,
    groups: ParallelGroups,
) -> list[torch.Tensor]:
    """Post sends [(tensor, stage)] and receives [(shape, stage)] as one batch, then wait.

    Batching a send with a receive in the other direction is what keeps 1F1B's steady
    state from deadlocking: two neighbours that both send first would wait forever.
    """
    out = [torch.empty(shape, dtype=dtype, device=device) for shape, _ in recvs]
    ops = [
        dist.P2POp(dist.isend, t.contiguous(), groups.pp_ranks[stage], groups.pp_group)
        for t, stage in sends
    ]
    ops += [
        dist.P2POp(dist.irecv, buf, groups.pp_ranks[stage], groups.pp_group)
        for buf, (_, stage) in zip(out, recvs)
    ]
    if ops:
        COMM_COUNTS["send"] += len(sends)
        COMM_COUNTS["recv"] += len(recvs)
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return out


class _StageRunner:
    """Forward and backward steps of one stage, with the activations kept in between."""

    def __init__(self, model, micro_batches, loss_fn, groups: ParallelGroups, masks) -> None:
        self.model, self.mbs, self.loss_fn, self.groups = model, micro_batches, loss_fn, groups
        self.masks = masks
        self.inputs: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.losses: list[torch.Tensor] = []
        self.live = 0  # micro-batches whose activations are held (for the memory check)
        self.max_live = 0
        p = groups.pp_rank
        self.prev = p - 1 if p > 0 else None
        self.next = p + 1 if p < groups.pp_size - 1 else None

    def shape(self, m: int) -> tuple[int, int, int]:
        return _hidden_shape(self.model, self.mbs[m])

    def forward(self, m: int, x: torch.Tensor | None) -> torch.Tensor | None:
        """Run micro-batch m (x: received activation, None on the first stage); returns
        the activation to send on, or None on the last stage."""
        if x is None:
            x = self.mbs[m]
        else:
            x.requires_grad_(True)
        y = self.model(x, attention_mask=self.masks[m])
        self.inputs[m] = x
        self.live += 1
        self.max_live = max(self.max_live, self.live)
        if self.next is None:
            y = self.loss_fn(y, m)
            self.losses.append(y)
            self.outputs[m] = y
            return None
        self.outputs[m] = y
        return y.detach()

    def backward(self, m: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        """Backward of micro-batch m; returns the input gradient to send back (or None)."""
        out = self.outputs.pop(m)
        x = self.inputs.pop(m)
        if grad is None:
            out.backward()
        else:
            torch.autograd.backward(out, grad)
        self.live -= 1
        return None if self.prev is None else x.grad


def pipeline_forward_backward(
    model,
    micro_batches: Sequence[torch.Tensor],
    loss_fn: Callable[[torch.Tensor, int], torch.Tensor],
    groups: ParallelGroups,
    *,
    schedule: str = "1f1b",
    attention_masks: Sequence[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """One training pass over micro-batches through the pipeline.

    Gradients accumulate into the stage's parameters (``.grad``); the total gradient
    is that of ``sum_m loss_fn(out_m, m)``, so scale inside ``loss_fn`` as needed.
    Both schedules give the same gradients; ``1f1b`` holds at most ``pp - pp_rank``
    micro-batches' activations at once, ``gpipe`` holds all of them.

    Arguments:
        model: this rank's Decoder stage.
        micro_batches: token ids [b, T] per micro-batch, the same on every stage.
        loss_fn: (last-stage head output, micro-batch index) -> scalar loss; called on the
            last stage only.
        groups: this rank's groups.
        schedule: ``"1f1b"`` (one forward, one backward in the steady state, as Megatron)
            or ``"gpipe"`` (all forwards, then all backwards in reverse).
        attention_masks: per micro-batch, None or [b, T] (1 = real token) for left-padded
            rows; the same on every stage (see :func:`pipeline_forward`). Padding gets
            no gradient from the real tokens' outputs; a loss_fn that reads only real
            positions (response masks) makes it contribute nothing at all.

    Returns:
        The micro-batch losses [M] (detached, fp32) on every stage of the pipeline.

    Raises:
        ValueError: unknown schedule, no micro-batches, or masks that do not match them.
    """
    if schedule not in ("1f1b", "gpipe"):
        raise ValueError(f"unknown pipeline schedule {schedule!r}; use '1f1b' or 'gpipe'")
    if not micro_batches:
        raise ValueError("pipeline_forward_backward needs at least one micro-batch")
    masks = _check_masks(micro_batches, attention_masks)
    run = _StageRunner(model, micro_batches, loss_fn, groups, masks)
    dtype, device = model.dtype, micro_batches[0].device
    num = len(micro_batches)

    def xchg(sends, recvs):
        return _exchange(
            [(t, st) for t, st in sends if st is not None],
            [(sh, st) for sh, st in recvs if st is not None],
            dtype,
            device,
            groups,
        )

    def recv_forward(m):
        return xchg([], [(run.shape(m), run.prev)])[0] if run.prev is not None else None

    def recv_backward(m):
        return xchg([], [(run.shape(m), run.next)])[0] if run.next is not None else None

    if schedule == "gpipe":
        for m in range(num):
            xchg([(run.forward(m, recv_forward(m)), run.next)], [])
        for m in reversed(range(num)):
            xchg([(run.backward(m, recv_backward(m)), run.prev)], [])
    else:
        warmup = min(groups.pp_size - groups.pp_rank - 1, num)
        for m in range(warmup):
            xchg([(run.forward(m, recv_forward(m)), run.next)], [])
        x = recv_forward(warmup) if warmup < num else None
        for i in range(num - warmup):
            m = warmup + i
            y = run.forward(m, x)
            # send this activation on and take the oldest micro-batch's gradient, together
            got = xchg([(y, run.next)], [(run.shape(i), run.next)])
            gin = run.backward(i, got[0] if got else None)
            if m + 1 < num:
                got = xchg([(gin, run.prev)], [(run.shape(m + 1), run.prev)])
                x = got[0] if got else None
            else:
                xchg([(gin, run.prev)], [])
        for i in range(num - warmup, num):
            xchg([(run.backward(i, recv_backward(i)), run.prev)], [])
    assert not run.outputs and run.live == 0
    LAST_PASS["max_live_micro_batches"] = run.max_live
    result = torch.stack([x.detach().float() for x in run.losses]) if model.is_last else None
    return broadcast_from_last(result, (num,), torch.float32, groups, device)
