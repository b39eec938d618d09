"""Tensor- and data-parallel machinery for :mod:`.model` over torch.distributed groups.

The same code runs over gloo (CPU worker processes) and NCCL (devices): only the
process groups passed in differ. Tensor parallelism is Megatron's: the
conjugate ops ``f`` (:func:`copy_to_tp`: identity forward, all-reduce backward)
and ``g`` (:func:`reduce_from_tp`: all-reduce forward, identity backward) around
column- and row-parallel linears, a vocab-parallel embedding, and
:func:`vocab_parallel_logprobs`, which computes token log-probabilities from
vocab-sharded logits without ever gathering them (two all-reduces of [B, T]).

Every collective and point-to-point call made here is counted in
:data:`COMM_COUNTS`, so tests can check how many communications happened.
"""

from __future__ import annotations

import datetime
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd import Function

COMM_COUNTS: Counter[str] = Counter()
"""Calls made by this module's collectives, by kind (all_reduce, all_gather, send, ...)."""


def all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce over ``group`` (a no-op without a group); counted."""
    if group is not None:
        COMM_COUNTS["all_reduce"] += 1
        dist.all_reduce(t, op=op, group=group)
    return t


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> list[int]:
    """Layer indices of pipeline stage ``pp_rank``: even split, earlier stages take the remainder.

    Raises:
        ValueError: more stages than layers.
    """
    if pp_size > num_layers:
        raise ValueError(
            f"pipeline degree {pp_size} exceeds the model's {num_layers} layers; "
            "every stage needs at least one layer"
        )
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return list(range(start, start + base + (1 if pp_rank < extra else 0)))


@dataclass(frozen=True)
class ParallelGroups:
    """One rank's process groups and coordinates (a group of size 1 is None).

    ``pp_ranks`` are the global ranks of this rank's pipeline, in stage order, for
    point-to-point sends; ``dp_rank`` seeds ``generate.make_generator``'s per-replica
    stream (the trainer samples per global row instead: ``make_row_generators``).
    """

    tp_group: object | None = None
    pp_group: object | None = None
    dp_group: object | None = None
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    pp_ranks: tuple[int, ...] = (0,)

    @classmethod
    def single(cls) -> ParallelGroups:
        """No parallelism: the plain single-process model."""
        return cls()

    def __repr__(self) -> str:
        return (
            f"ParallelGroups(dp{self.dp_rank}/{self.dp_size} pp{self.pp_rank}/{self.pp_size} "
            f"tp{self.tp_rank}/{self.tp_size})"
        )


def init_parallel_groups(
    tp: int, pp: int, dp: int, ranks: Sequence[int] | None = None, timeout: float | None = None
) -> ParallelGroups | None:
    """Create the tp/pp/dp groups of a (dp, pp, tp) layout; collective over the whole world.

    Every process of the default group must call it with the same arguments (that is
    how ``torch.distributed.new_group`` works), including processes outside ``ranks``.
    Rank order follows ``nereus_comm.layout.Layout``: ``ranks[(d * pp + p) * tp + t]``.

    Arguments:
        tp, pp, dp: degrees.
        ranks: global ranks of the layout (default: 0 .. tp*pp*dp-1).
        timeout: seconds an op of these groups may wait for a peer (default: torch's
            ``new_group`` default, 30 minutes for gloo, whatever the default group's).

    Returns:
        The calling rank's groups, or None if it is not in ``ranks``.

    Raises:
        ValueError: the rank count does not equal tp*pp*dp.
    """
    ranks = list(range(tp * pp * dp)) if ranks is None else list(ranks)
    if len(ranks) != tp * pp * dp:
        raise ValueError(f"layout dp{dp} pp{pp} tp{tp} needs {tp * pp * dp} ranks, got {ranks}")
    me = dist.get_rank()

    def at(d: int, p: int, t: int) -> int:
        return ranks[(d * pp + p) * tp + t]

    wait = None if timeout is None else datetime.timedelta(seconds=timeout)
    found: dict[str, object] = {}
    coords = {at(d, p, t): (d, p, t) for d in range(dp) for p in range(pp) for t in range(tp)}

    def make(kind: str, members: list[int]) -> None:
        group = dist.new_group(members, timeout=wait) if len(members) > 1 else None
        if me in members:
            found[kind] = group
            found[kind + "_members"] = members

    # All processes create the groups in the same order (new_group is collective).
    for d in range(dp):
        for p in range(pp):
            make("tp", [at(d, p, t) for t in range(tp)])
    for d in range(dp):
        for t in range(tp):
            make("pp", [at(d, p, t) for p in range(pp)])
    for p in range(pp):
        for t in range(tp):
            make("dp", [at(d, p, t) for d in range(dp)])
    if me not in coords:
        return None
    d, p, t = coords[me]
    return ParallelGroups(
        tp_group=found["tp"],
        pp_group=found["pp"],
        dp_group=found["dp"],
        tp_rank=t,
        tp_size=tp,
        pp_rank=p,
        pp_size=pp,
        dp_rank=d,
        dp_size=dp,
        pp_ranks=tuple(found["pp_members"]),
    )


class _CopyToTP(Function):
    """Megatron f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.contiguous().clone(), ctx.group), None


class _ReduceFromTP(Function):
    """Megatron g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """Enter a column-parallel region (f): forward identity, backward all-reduce over tp."""
    return x if groups.tp_group is None else _CopyToTP.apply(x, groups.tp_group)


def reduce_from_tp(x: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """Leave a row-parallel region (g): forward all-reduce over tp, backward identity."""
    return x if groups.tp_group is None else _ReduceFromTP.apply(x, groups.tp_group)


class _VocabParallelLogProb(Function):
    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start):
        x = logits.float()
        local_vocab = x.shape[-1]
        # The max only shifts for stability; its gradient is zero, so it is not saved.
        m = all_reduce(x.max(-1).values, group, dist.ReduceOp.MAX)
        shifted = x - m.unsqueeze(-1)
        exp = shifted.exp()
        local_t = targets - vocab_start
        mine = (local_t >= 0) & (local_t < local_vocab)
        local_t = local_t.clamp(0, local_vocab - 1)
        target_logit = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) * mine
        # One all-reduce for both sums: [sum exp, target logit].
        both = all_reduce(torch.stack([exp.sum(-1), target_logit]), group)
        sum_exp, target_logit = both[0], both[1]
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local_t, mine)
        ctx.out_dtype = logits.dtype
        return (target_logit - sum_exp.log()).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        softmax, local_t, mine = ctx.saved_tensors
        g = grad.float()
        # d logp(target) / d logit_j = 1[j == target] - softmax_j; no communication.
        out = softmax * -g.unsqueeze(-1)
        out.scatter_add_(-1, local_t.unsqueeze(-1), (g * mine).unsqueeze(-1))
        return out.to(ctx.out_dtype), None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, groups: ParallelGroups
) -> torch.Tensor:
    """log softmax(logits)[target] from this tp rank's vocab shard, never gathering logits.

    Arguments:
        logits: this rank's shard [..., vocab/tp] (vocab rows ``tp_rank * vocab/tp ...``).
        targets: token ids [...] over the full vocabulary.
        groups: this rank's groups (the tp group is used; 2 all-reduces of targets' size).

    Returns:
        Log-probabilities [...] (same on every tp rank), differentiable w.r.t. ``logits``.
    """
    start = groups.tp_rank * logits.shape[-1]
    return _VocabParallelLogProb.apply(logits, targets, groups.tp_group, start)


def response_logprobs(
    logits: torch.Tensor, sequences: torch.Tensor, prompt_len: int, groups: ParallelGroups
) -> torch.Tensor:
    """Log-probs [B, N] of the response tokens ``sequences[:, prompt_len:]``.

    Arguments:
        logits: the last stage's logits shard for ``sequences`` [B, P + N, vocab/tp]
            (position ``i`` predicts token ``i + 1``).
        sequences: prompt and response ids [B, P + N].
        prompt_len: P, the padded prompt width when prompts are left-padded (every
            response starts at column P, so padding shifts nothing here; the logits must
            come from a forward given the batch's attention mask).
        groups: this rank's groups.
    """
    predicting = logits[:, prompt_len - 1 : -1]
    return vocab_parallel_logprobs(predicting, sequences[:, prompt_len:], groups)


def response_values(values: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Critic values [B, N] of the states before each response token (positions P-1 .. -2).

    With left-padded prompts P is the padded width and position P-1 every row's last real
    prompt token, as in :func:`response_logprobs`.
    """
    return values[:, prompt_len - 1 : -1]


@torch.no_grad()
def vocab_parallel_entropy(logits: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """Entropy of softmax(logits) [...] from vocab shards (no gradient; for metrics)."""
    x = logits.float()
    m = all_reduce(x.max(-1).values, groups.tp_group, dist.ReduceOp.MAX)
    shifted = x - m.unsqueeze(-1)
    exp = shifted.exp()
    both = all_reduce(torch.stack([exp.sum(-1), (exp * shifted).sum(-1)]), groups.tp_group)
    return both[0].log() - both[1] / both[0]


def vocab_parallel_argmax(scores: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """Argmax over the full vocabulary of vocab-sharded scores [B, vocab/tp] -> ids [B].

    Ties go to the lowest id, as ``torch.argmax`` does on the full row.
    """
    local_max, local_idx = scores.max(-1)
    local_idx = local_idx + groups.tp_rank * scores.shape[-1]
    if groups.tp_group is None:
        return local_idx
    vals = [torch.empty_like(local_max) for _ in range(groups.tp_size)]
    idxs = [torch.empty_like(local_idx) for _ in range(groups.tp_size)]
    COMM_COUNTS["all_gather"] += 2
    dist.all_gather(vals, local_max.contiguous(), group=groups.tp_group)
    dist.all_gather(idxs, local_idx.contiguous(), group=groups.tp_group)
    best = torch.stack(vals).argmax(0)  # first (lowest-vocab) rank wins ties
    return torch.stack(idxs).gather(0, best.unsqueeze(0)).squeeze(0)


def allreduce_gradients(model: torch.nn.Module, groups: ParallelGroups) -> None:
    """Average gradients over the data-parallel group with one bucketed all-reduce.

    Parameters without a gradient count as zero gradients (and get one), so every
    replica reduces the same buffer layout.
    """
    if groups.dp_group is None:
        return
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    all_reduce(flat, groups.dp_group)
    flat /= groups.dp_size
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n
