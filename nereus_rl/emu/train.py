"""A synthetic data-parallel training step on a stage's units, to check training semantics.

Every unit of a training stage runs the same step: the gradient of each
parameter is the sum, over the unit's share of the global batch, of a
deterministic per-sample gradient; the units sum their gradients with an
all-reduce over DP groups (the ranks at the same position of every unit),
then apply Adam to their shards and advance the unit's RNG.

Per-sample gradients are multiples of 2**-16 in [-0.5, 0.5), so their sums
are exact in fp32 whatever the order, and Adam is elementwise: the state after
N steps is bitwise the same for any DP degree, any (tp, pp), and any sequence
of primitives between steps. That is what lets a test compare a run with
transitions against an uninterrupted one bitwise. The real model's step
(nereus_rl.trainer.trainer) adopts its real state into units instead
(EMUManager.adopt); this step remains the semantics check of the EMU layer itself.

The driver side reads its manager through :class:`TrainingHost`, so this module never
imports the manager that calls it.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import torch

from nereus_rl.emu.state import RNG_SPEC, Box, _hashed, _name_seed
from nereus_rl.emu.types import EMU, EMUError, StageState
from nereus_rl.runtime.context import WorkerContext, register

if TYPE_CHECKING:
    from nereus_comm.pool import Communicator
    from nereus_rl.runtime import Driver


class TrainingHost(Protocol):
    """What :func:`run_train_step` uses of its manager (``EMUManager`` is one): the
    driver, the stages and units, the bookkeeping lock, and the pooled DP groups."""

    driver: Driver
    _lock: AbstractContextManager[Any]

    def units(self, stage: str | None = None) -> list[EMU]: ...

    def _stage(self, stage: str) -> StageState: ...

    def _ensure_stage_on(self, ranks: Sequence[int]) -> None: ...

    def _get_comm(self, ranks: Sequence[int]) -> Communicator: ...

    def _settle(self, comms: Sequence[Communicator | None]) -> float: ...

    def _release(self, comm: Communicator) -> None: ...


BETAS = (0.9, 0.999)
EPS = 1e-8


def _is_param(name: str) -> bool:
    return not name.startswith("optim.") and name != RNG_SPEC.name


def sample_grad(spec, box: Box, sample: int, step: int) -> torch.Tensor:
    """The gradient of ``spec``'s box for one sample of one step (fp32)."""
    return _hashed(spec, box, _name_seed(spec.name, 1_000_003 * (step + 1) + sample)).to(
        torch.float32
    )


@register("emu.train_step")
def train_step(
    ctx: WorkerContext,
    stage: str,
    uids: tuple[int, ...],
    unit_ranks: tuple[tuple[int, ...], ...],
    dp_group_ids: tuple[int, ...],
    step: int,
    global_batch: int,
    lr: float,
) -> float:
    """One Adam step of this rank's shards of the stage's unit it belongs to.

    Arguments:
        stage: the stage.
        uids / unit_ranks: every unit of the stage, and its ranks (same (tp, pp) for all).
        dp_group_ids: the group id of each position's DP group (ranks[i] of every unit).
        step: the step number (0-based; the per-sample gradients depend on it).
        global_batch: samples per step over all units; unit d takes samples d, d + D, ...
        lr: the learning rate.

    Returns:
        The sum of this rank's gradient elements (for logging).
    """
    d = next(i for i, ranks in enumerate(unit_ranks) if ctx.rank in ranks)
    pos = unit_ranks[d].index(ctx.rank)
    unit = ctx.state["emu.units"][uids[d]]
    specs, num_layers = ctx.state["emu.stages"][stage]
    tensors, layout = unit["tensors"], unit["layout"]
    params = [s for s in specs if _is_param(s.name) and s.name in tensors]
    grads = []
    for spec in params:
        box = layout.box(spec, ctx.rank, num_layers)
        g = torch.zeros(tensors[spec.name].shape, dtype=torch.float32)
        for sample in range(d, global_batch, len(uids)):
            g += sample_grad(spec, box, sample, step)
        grads.append(g)
    if len(uids) > 1 and grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dp_ranks = tuple(ranks[pos] for ranks in unit_ranks)
        pg, _ = ctx.group(dp_group_ids[pos], dp_ranks)
        pg.allreduce([flat]).wait()
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view(g.shape))
            offset += g.numel()
    t = tensors["optim.step"]
    t += 1
    b1, b2 = BETAS
    c1, c2 = 1 - b1 ** t.item(), 1 - b2 ** t.item()
    for spec, g in zip(params, grads):
        p = tensors[spec.name]
        m = tensors[f"optim.exp_avg.{spec.name}"]
        v = tensors[f"optim.exp_avg_sq.{spec.name}"]
        # No fused multiply-adds (add_ with alpha, addcmul_): a vectorized body and
        # its scalar tail may round them differently, and where a shard's tail
        # falls depends on the layout. Plain ops round once each, everywhere.
        m.mul_(b1).add_(g * (1 - b1))
        v.mul_(b2).add_(g * g * (1 - b2))
        update = (m / c1) / ((v / c2).sqrt() + EPS)
        p.sub_((update * lr).to(p.dtype))
    gen = torch.Generator()
    gen.set_state(tensors["rng"])
    torch.rand(1, generator=gen)  # the step's draw (dropout and sampling would use these)
    tensors["rng"].copy_(gen.get_state())
    return float(sum(g.sum() for g in grads))


def run_train_step(
    m: TrainingHost, stage: str, step: int, *, global_batch: int = 8, lr: float = 1e-3
) -> float:
    """Driver side of :func:`train_step`: one synthetic DP Adam step on every unit of ``stage``.

    Arguments:
        m: the manager holding the stage's units.
        stage: a training stage (its state has Adam moments, a step and RNG).
        step: the step number.
        global_batch: samples per step over all units.
        lr: the learning rate.

    Returns:
        The sum of every rank's gradient elements (a cheap log value).

    Raises:
        EMUError: the stage has no units, its units differ in (tp, pp), or it is not
            a training stage.
    """
    st = m._stage(stage)
    units = m.units(stage)
    if not units:
        raise EMUError(f"stage {stage!r} has no units to train")
    if len({(u.tp, u.pp) for u in units}) > 1:
        raise EMUError(
            f"the units of {stage!r} differ in layout ({units}); a DP step needs one "
            "(tp, pp) per stage: split, merge or re-extend first"
        )
    if not any(s.name == "optim.step" for s in st.specs):
        raise EMUError(f"stage {stage!r} has no optimizer state; it is not a training stage")
    ranks = [r for u in units for r in u.ranks]
    with m._lock:
        m._ensure_stage_on(ranks)
    # Position i's DP group (rank i of every unit) comes from the pool; it stays
    # cached after the step, so the next step with the same units is a hit.
    comms = []
    try:
        if len(units) > 1:
            for i in range(units[0].degree):
                comms.append(m._get_comm(tuple(u.ranks[i] for u in units)))
        dp_gids = tuple(c.handle for c in comms) or (0,) * units[0].degree
        res = m.driver.call(
            ranks, "emu.train_step", stage, tuple(u.uid for u in units),
            tuple(u.ranks for u in units), dp_gids, step, global_batch, lr,
        )  # fmt: skip
        m._settle(comms)  # read the builds' replies (they ran before the step)
    finally:
        for c in comms:
            m._release(c)
    return sum(res.values())
