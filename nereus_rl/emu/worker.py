"""Worker-side EMU commands: hold unit shards, build them, reshard them, drop them.

Imported on every worker by :class:`nereus_rl.emu.manager.EMUManager` (through
``Driver.import_module``). A worker keeps, per unit id it belongs to, the
unit's stage, layout and the rank's shard of every tensor of the stage's
state. Primitives run :func:`_reshard` on every rank that gives or takes
bytes; the new units' shards are stored under new unit ids, and the old
units are dropped only when the driver says so, after every rank succeeded.

A unit's tensors are either its own (a dict: built, or received by a
primitive) or *bound* (:class:`BoundState`): the live tensors of another
owner on this worker (the trainer's model and optimizer), read through a
function registered with :func:`register_state_owner` each time a primitive
copies from the unit, so the copy is of the state as it is at that moment.

A unit's own tensors live in one block of the worker's arena
(:mod:`nereus_rl.emu.arena`) when the manager configured one (``emu.arena``):
``emu.reserve`` carves the new units' blocks before any byte moves (so a unit
that does not fit fails there, on every rank, before a transfer starts), the
build or the reshard writes into them, and ``emu.drop`` (or binding the unit to
an owner's tensors) returns them, so the next unit reuses warm pages. A Split or
Merge (``consume``) moves the pages of what a rank keeps from the old unit's
block into the new unit's instead of copying them, at the end of its
``emu.reshard`` (every peer has read the sources by then): no round trip of its
own. Until the driver commits (drops the old unit) the moves are kept, and a
failed primitive's ``emu.drop`` of its new unit swaps the pages back, so the old
unit is whole again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from nereus_comm.layout import box_shape
from nereus_comm.remap import move_ranges, swap_pages
from nereus_comm.reshard import Workspace
from nereus_comm.transport import GlooTransport
from nereus_rl.emu import train as emu_train  # noqa: F401  (registers emu.train_step)
from nereus_rl.emu.arena import HUGE_PAGE, Arena, ArenaBlock, arena_config
from nereus_rl.emu.comm import Layout, TensorSpec, move_state
from nereus_rl.emu.state import synthetic
from nereus_rl.runtime.context import WorkerContext, register

StateReader = Callable[[], dict[str, torch.Tensor]]
_OWNERS: dict[str, Callable[[WorkerContext, str], StateReader]] = {}


def register_state_owner(name: str, fn: Callable[[WorkerContext, str], StateReader]) -> None:
    """Name a worker-side owner of live state that units can adopt (``emu.adopt``).

    Arguments:
        name: the owner's name (``EMUManager.adopt(..., owner=name)``).
        fn: ``fn(ctx, stage)`` -> a function returning this rank's current shards of
            the stage by spec name (tensors sharing storage with the owner's, no copy).
    """
    _OWNERS[name] = fn


class BoundState(Mapping):
    """A unit's tensors that are an owner's live tensors (read on each access)."""

    def __init__(self, read: StateReader) -> None:
        self.read = read

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.read()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.read())

    def __len__(self) -> int:
        return len(self.read())

    def __repr__(self) -> str:
        return f"BoundState({len(self)} tensors)"


def tensors_of(ctx: WorkerContext, uid: int) -> dict[str, torch.Tensor]:
    """This rank's shards of unit ``uid`` now (a bound unit's owner is read once)."""
    t = units_of(ctx)[uid]["tensors"]
    return t.read() if isinstance(t, BoundState) else t


def bind(ctx: WorkerContext, uid: int, read: StateReader) -> None:
    """Make unit ``uid``'s tensors an owner's live state (after the owner loaded them).

    The unit's arena block (the tensors it received) goes back to the arena: the owner
    copied what it needed.
    """
    unit = units_of(ctx)[uid]
    unit["tensors"] = BoundState(read)
    release(unit.pop("block", None))


# ---------------------------------------------------------------- arena


def arena_of(ctx: WorkerContext) -> Arena | None:
    """This worker's arena (None: not configured or off)."""
    return ctx.state.get("emu.arena")


@register("emu.arena")
def configure_arena(
    ctx: WorkerContext, budget: int | str | None, prefault: bool | None, num_local_workers: int
) -> dict[str, float]:
    """Set up this worker's arena (:func:`nereus_rl.emu.arena.arena_config`; budget 0:
    none); kept when already so configured.

    A different configuration replaces the arena; blocks of the old one stay valid
    and go back to it when freed. Returns the arena's stats (``reserve_s``: the
    seconds its reservation took).
    """
    budget, prefault = arena_config(budget, prefault, num_local_workers)
    old = arena_of(ctx)
    if budget <= 0:
        ctx.state["emu.arena"] = None
        return {"budget": 0}
    if old is None or (old.budget, old.prefault) != (budget, prefault):
        old = ctx.state["emu.arena"] = None  # let an unused old reservation go first
        ctx.state["emu.arena"] = Arena(budget, prefault=prefault)
    return arena_of(ctx).stats()


@register("emu.arena_stats")
def arena_stats(ctx: WorkerContext) -> dict[str, float] | None:
    """This worker's arena stats, or None without an arena."""
    arena = arena_of(ctx)
    return None if arena is None else arena.stats()


Block = tuple[Arena, ArenaBlock]


def _flat_offset(inner, outer) -> int:
    """Elements from the start of box ``outer`` (row-major) to the start of ``inner``."""
    at = 0
    for (lo, _), (olo, ohi) in zip(inner, outer):
        at = at * (ohi - olo) + (lo - olo)
    return at


def _contiguous_in(inner, outer) -> bool:
    """Whether box ``inner`` is one contiguous run of box ``outer`` (row-major)."""
    partial = False
    for (lo, hi), (olo, ohi) in zip(reversed(inner), reversed(outer)):
        if partial and hi - lo > 1:
            return False
        partial = partial or (lo, hi) != (olo, ohi)
    return True


def _huge_phases(
    ctx: WorkerContext, stage: str, specs, layout: Layout, num_layers: int
) -> dict[str, int]:
    """Where each new shard should start within a huge page (see emu_arena, "Huge pages").

    The bytes this rank keeps from its current unit of ``stage`` (a Split's or
    Merge's source: the only unit of the stage on this rank, with its own block)
    are moved by page swap into the new shard when they are one contiguous run on
    both sides; huge pages move whole only if the kept piece's source and
    destination addresses agree modulo 2 MiB. So such a shard's phase is its kept
    piece's source address less the piece's offset in the shard. Empty when the
    rank holds no such unit (an Extend onto fresh devices): shards then start on a
    huge page.
    """
    olds = [
        u for u in units_of(ctx).values()
        if u["stage"] == stage and u.get("block") is not None and isinstance(u["tensors"], dict)
    ]  # fmt: skip
    if len(olds) != 1:
        return {}
    old = olds[0]
    phases = {}
    for spec in specs:
        new_box = layout.box(spec, ctx.rank, num_layers)
        old_box = old["layout"].box(spec, ctx.rank, num_layers)
        src = old["tensors"].get(spec.name)
        if new_box is None or old_box is None or src is None:
            continue
        inter = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(new_box, old_box))
        if any(lo >= hi for lo, hi in inter):
            continue
        if not (_contiguous_in(inter, old_box) and _contiguous_in(inter, new_box)):
            continue  # a strided piece (row-parallel halves) is copied, not moved
        elt = src.element_size()
        addr = src.data_ptr() + _flat_offset(inter, old_box) * elt
        phases[spec.name] = (addr - _flat_offset(inter, new_box) * elt) % HUGE_PAGE
    return phases


def carve_shards(
    ctx: WorkerContext,
    specs: tuple[TensorSpec, ...],
    layout: Layout,
    num_layers: int,
    what: str,
    phases: dict[str, int] | None = None,
) -> tuple[Block | None, dict[str, torch.Tensor]]:
    """Empty tensors for this rank's shards of ``specs`` in ``layout``, from the arena.

    The same code gives every way of building a layout's state its destination (the
    EMU primitives, and a benchmark's checkpoint loaders), so they all write into the
    same kind of memory. Without an arena, plain ``torch.empty`` tensors. ``phases``:
    see :meth:`Arena.carve`.

    Returns:
        (the block to :func:`release` when the tensors die, or None; name -> tensor).

    Raises:
        ArenaExhaustedError: they do not fit (nothing allocated).
    """
    shapes = {}
    for spec in specs:
        box = layout.box(spec, ctx.rank, num_layers)
        if box is not None:
            shapes[spec.name] = (tuple(box_shape(box)), spec.dtype)
    arena = arena_of(ctx)
    if arena is None:
        return None, {n: torch.empty(shape, dtype=dt) for n, (shape, dt) in shapes.items()}
    block, tensors = arena.carve(shapes, f"{what} on worker {ctx.rank}", phases)
    return (arena, block), tensors


def release(block: Block | None) -> None:
    """Give a block from :func:`carve_shards` back (None: nothing to do)."""
    if block is not None:
        block[0].free(block[1])


def _pending(ctx: WorkerContext) -> dict[int, tuple[Block | None, dict[str, torch.Tensor]]]:
    return ctx.state.setdefault("emu.pending", {})


@register("emu.reserve")
def reserve(ctx: WorkerContext, new: list[tuple[int, str, Layout]]) -> dict[str, float]:
    """Carve the blocks of new units (uid, stage, unit layout) on this rank, all or none.

    Runs before the build or transfer that fills them, so a unit that does not fit
    fails here on every rank, before any byte moves.

    Raises:
        ArenaExhaustedError: one of them does not fit (none is kept).
    """
    t0 = time.perf_counter()
    got = []
    try:
        for uid, stage, layout in new:
            specs, num_layers = _stages(ctx)[stage]
            what = f"unit {uid} of {stage!r}"
            phases = _huge_phases(ctx, stage, specs, layout, num_layers)
            got.append((uid, carve_shards(ctx, specs, layout, num_layers, what, phases)))
    except BaseException:
        for _, (block, _t) in got:
            release(block)
        raise
    pending = _pending(ctx)
    for uid, entry in got:
        release(pending.pop(uid, (None, {}))[0])
        pending[uid] = entry
    return {
        "alloc_s": time.perf_counter() - t0,
        "bytes": sum(t.nbytes for _, (_, ts) in got for t in ts.values()),
    }


def _take_pending(ctx: WorkerContext, uid: int):
    return _pending(ctx).pop(uid, (None, None))


def _stages(ctx: WorkerContext) -> dict[str, tuple[tuple[TensorSpec, ...], int]]:
    return ctx.state.setdefault("emu.stages", {})


def units_of(ctx: WorkerContext) -> dict[int, dict[str, Any]]:
    """The EMU shards this worker holds: unit id -> its stage, layout and tensors."""
    return ctx.state.setdefault("emu.units", {})


@register("emu.define_stage")
def define_stage(
    ctx: WorkerContext, stage: str, specs: tuple[TensorSpec, ...], num_layers: int
) -> None:
    """Remember a stage's specs so later commands can name the stage only."""
    _stages(ctx)[stage] = (tuple(specs), num_layers)


def _unit_group(ctx: WorkerContext, layout: Layout, group_id: int | None) -> float:
    # The unit's own group (its TP/PP traffic); part of what a new unit costs.
    if group_id is None or len(layout.ranks) == 1:
        return 0.0
    return ctx.group(group_id, tuple(layout.ranks))[1]


@register("emu.build")
def build(
    ctx: WorkerContext, uid: int, stage: str, layout: Layout, seed: int, group_id: int | None
) -> dict[str, float]:
    """Make this rank's shards of a new unit from the synthetic state."""
    specs, num_layers = _stages(ctx)[stage]
    block, tensors = _take_pending(ctx, uid)
    if tensors is None:
        block, tensors = carve_shards(ctx, specs, layout, num_layers, f"unit {uid} of {stage!r}")
    for spec in specs:
        box = layout.box(spec, ctx.rank, num_layers)
        if box is not None:
            tensors[spec.name].copy_(synthetic(spec, box, seed))
    setup = _unit_group(ctx, layout, group_id)
    units_of(ctx)[uid] = {"stage": stage, "layout": layout, "tensors": tensors, "block": block}
    return {
        "comm_setup_s": setup,
        "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
    }


@register("emu.adopt")
def adopt(ctx: WorkerContext, uid: int, stage: str, layout: Layout, owner: str) -> int:
    """Make unit ``uid`` of ``stage`` the owner's live state on this rank. Returns its bytes."""
    fn = _OWNERS.get(owner)
    if fn is None:
        raise KeyError(
            f"no state owner {owner!r} on worker {ctx.rank}; registered: {sorted(_OWNERS)}; "
            "import the module that registers it first"
        )
    state = BoundState(fn(ctx, stage))
    units_of(ctx)[uid] = {"stage": stage, "layout": layout, "tensors": state}
    return sum(t.numel() * t.element_size() for t in state.read().values())


@register("emu.reshard")
def _reshard(
    ctx: WorkerContext,
    stage: str,
    src_uids: tuple[int, ...],
    src_layout: Layout,
    dst_uids: tuple[int, ...],
    dst_layout: Layout,
    group_id: int,
    group_ranks: tuple[int, ...],
    unit_group_ids: tuple[int | None, ...],
    timeout: float,
    consume: bool = False,
) -> dict[str, Any]:
    """Move a stage's state from src units (one layout, dp = number of units) to new ones.

    Arguments:
        stage: the stage.
        src_uids / src_layout: the source units, replica d of src_layout is src_uids[d].
        dst_uids / dst_layout: the new units, replica d of dst_layout is dst_uids[d].
        group_id / group_ranks: the gloo group over every participating rank.
        unit_group_ids: the id of each new unit's own group (None: no group).
        timeout: seconds the transfer may wait for a peer.
        consume: the source units are dropped after (Split, Merge): the bytes this rank
            keeps are moved from a source unit's arena block into the new unit's by
            page remapping where they can, here, once the exchange is over; should
            the primitive fail, ``emu.drop`` of the new unit swaps them back
            (:func:`_settle_moves`).

    Returns:
        Byte counts, seconds, communicator setup seconds and whether anything was packed.
    """
    cpu0, wall0 = time.process_time(), time.perf_counter()
    specs, _ = _stages(ctx)[stage]
    units = units_of(ctx)
    tensors: dict[str, torch.Tensor] = {}
    own = False  # the source shards are the unit's own arena block (not an owner's tensors)
    if ctx.rank in src_layout:
        d = src_layout.coords(ctx.rank)[0]
        # A source of another stage of the model (extend) may hold more (Adam moments).
        names = {s.name for s in specs}
        tensors = {k: v for k, v in tensors_of(ctx, src_uids[d]).items() if k in names}
        own = units[src_uids[d]].get("block") is not None
    block, out = None, None
    if ctx.rank in dst_layout:
        # The new unit's block, carved by emu.reserve (None without an arena).
        block, out = _take_pending(ctx, dst_uids[dst_layout.coords(ctx.rank)[0]])
    pg, setup = ctx.group(group_id, tuple(group_ranks))
    transport = GlooTransport(pg, group_ranks, ctx.rank)
    workspace = ctx.state.setdefault("emu.workspace", Workspace("cpu"))
    try:
        result, extra = move_state(
            specs, src_layout, dst_layout, ctx.rank, tensors, transport,
            timeout=timeout, workspace=workspace, out=out,
            consume_sources=consume and own and block is not None,
            # the layouts' ranks are worker ranks: the driver's word on deaths ends a
            # wait on a dead peer at once, on the same-host routes too
            liveness=ctx.liveness(),
        )  # fmt: skip
    except BaseException:
        release(block)
        raise
    moves = extra.pop("moves")
    remap_s = 0.0
    if ctx.rank in dst_layout:
        d = dst_layout.coords(ctx.rank)[0]
        unit_layout = Layout(1, dst_layout.tp, dst_layout.pp, _replica(dst_layout, d))
        try:
            setup += _unit_group(ctx, unit_layout, unit_group_ids[d])
        except BaseException:
            release(block)
            raise
        units[dst_uids[d]] = {
            "stage": stage, "layout": unit_layout, "tensors": result.tensors, "block": block,
        }  # fmt: skip
        if moves:
            # Last, so nothing here can fail after them: from now on only the driver's
            # commit (drop the source) or a failure (drop the new unit) settles them.
            t1 = time.perf_counter()
            done = move_ranges(moves)
            remap_s = time.perf_counter() - t1
            src_uid = src_uids[src_layout.coords(ctx.rank)[0]]
            _moves(ctx)[dst_uids[d]] = (src_uid, done.swaps)
            # what the last page moves took here (profiling)
            ctx.state["emu.last_moves"] = (remap_s, done.bytes_moved, len(done.swaps),
                                           done.bytes_copied)  # fmt: skip
    return {
        "bytes_sent": result.bytes_sent,
        "bytes_received": result.bytes_received,
        "bytes_local": result.bytes_local,
        "messages_sent": result.messages_sent,
        "buffers_sent": result.buffers_sent,
        # of bytes_sent, those peers read straight from this rank (cross-memory attach),
        # those sent through shared memory and those over the socket route's streams
        # (to other hosts); the rest went through gloo
        "bytes_cma": result.cma_bytes_sent,
        "bytes_shm": result.shm_bytes_sent,
        "bytes_net": result.net_bytes_sent,
        # per peer cross-memory attach could not serve, why not (empty: it served all)
        "cma_fallback": dict(result.fallback_reasons),
        "reshard_s": result.seconds,
        # where the transfer's time went on this rank (for profiling Extend)
        "pack_s": result.pack_seconds,
        "exchange_s": result.exchange_seconds,
        "unpack_s": result.unpack_seconds,
        # of exchange_s: the cross-memory-attach reads (and shm sends), the local copies
        "read_s": result.read_seconds,
        "local_s": result.local_seconds,
        "comm_setup_s": setup,
        "cpu_s": time.process_time() - cpu0,
        # the page moves of the bytes kept (consume), after the exchange
        "remap_s": remap_s,
        # the whole command on this rank (reshard_s plus planning, groups, page moves)
        "call_s": time.perf_counter() - wall0,
        **extra,
    }


def _replica(layout: Layout, d: int) -> tuple[int, ...]:
    n = layout.tp * layout.pp
    return tuple(layout.ranks[d * n : (d + 1) * n])


def _moves(ctx: WorkerContext) -> dict[int, tuple[int, np.ndarray]]:
    """Page moves not settled yet: new unit's uid -> (its source's uid, the swaps made)."""
    return ctx.state.setdefault("emu.moves", {})


def _settle_moves(ctx: WorkerContext, uids: tuple[int, ...]) -> None:
    """Before units are dropped: a dropped new unit (its primitive failed) swaps the pages
    it took back to its source, which is whole again; a dropped source (the primitive
    committed) leaves its new unit the pages.

    Raises:
        RuntimeError: the kernel refused a swap back (the source's moved bytes are lost;
            destroy the unit).
    """
    moves = _moves(ctx)
    for dst in [u for u in uids if u in moves]:
        src, swaps = moves.pop(dst)
        if src in units_of(ctx) and len(swaps):
            back = swaps[::-1]
            done, err = swap_pages(back)
            if err:
                raise RuntimeError(
                    f"worker {ctx.rank}: swapping unit {src}'s pages back from failed unit "
                    f"{dst} stopped at range {done} of {len(back)} (errno {err}); unit {src} "
                    "lost those bytes: destroy it and extend its stage again"
                )
    for dst in [u for u, (src, _) in moves.items() if src in uids]:
        del moves[dst]


@register("emu.drop")
def drop(ctx: WorkerContext, uids: tuple[int, ...], group_ids: tuple[int, ...] = ()) -> int:
    """Forget the named units' shards and groups. Returns the bytes let go.

    A failed primitive's new unit first gives back the pages it took (_settle_moves).
    """
    _settle_moves(ctx, uids)
    freed = 0
    for uid in uids:
        release(_take_pending(ctx, uid)[0])  # a primitive that failed before its transfer
        unit = units_of(ctx).pop(uid, None)
        if unit is not None and not isinstance(unit["tensors"], BoundState):
            freed += sum(t.numel() * t.element_size() for t in unit["tensors"].values())
            # Back to the arena: nothing else holds these tensors (emu.shards copies).
            release(unit.get("block"))
    ctx.release_groups(list(group_ids))
    return freed


@register("emu.shards")
def shards(ctx: WorkerContext, uid: int) -> dict[str, torch.Tensor]:
    """This rank's shards of a unit, by tensor name."""
    return dict(tensors_of(ctx, uid))


@register("emu.units")
def units(ctx: WorkerContext) -> dict[int, tuple[str, Layout]]:
    """The units this rank holds a shard of: uid -> (stage, layout)."""
    return {uid: (u["stage"], u["layout"]) for uid, u in units_of(ctx).items()}
