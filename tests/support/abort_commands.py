"""Worker commands used by tests/rl/runtime/test_abort.py (imported on the workers)."""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from nereus_rl.runtime.context import WorkerContext, register


def _wait_on_peer(
    ctx: WorkerContext, pg: dist.ProcessGroup, ranks: tuple[int, ...], waiter: int, peer: int
) -> float:
    """On ``waiter``: receive from ``peer`` (who never sends: it left); elsewhere return.

    Returns the seconds the waiter waited; its failure names whether an abort came.
    """
    if ctx.rank != waiter:
        return 0.0
    t = torch.zeros(4)
    t0 = time.monotonic()
    try:
        pg.recv([t], ranks.index(peer), 7).wait()
    except RuntimeError as e:
        raise RuntimeError(
            f"waited {time.monotonic() - t0:.2f} s; aborted={ctx.aborted()} "
            f"lost={sorted(ctx.lost_ranks())} epoch={ctx.abort_epoch}: {e}"
        ) from None
    return time.monotonic() - t0


@register("abort.wait_on_peer")
def wait_on_peer(
    ctx: WorkerContext, group_id: int, ranks: tuple[int, ...], waiter: int, peer: int
) -> float:
    """:func:`_wait_on_peer` on the runtime's gloo group ``group_id``."""
    pg, _ = ctx.group(group_id, tuple(ranks))
    return _wait_on_peer(ctx, pg, tuple(ranks), waiter, peer)


@register("abort.init_world")
def init_world(ctx: WorkerContext, rank: int, world_size: int, prefix: str) -> int:
    """(Re-)form the default process group the way the trainer's ``rl.init`` does.

    Its connections are no group's the runtime knows (untracked).
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(prefix, ctx.store),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=ctx.group_timeout),
    )
    return rank


@register("abort.world_wait_on_peer")
def world_wait_on_peer(ctx: WorkerContext, world: tuple[int, ...], waiter: int, peer: int) -> float:
    """:func:`_wait_on_peer` on the default group; ``world``: its members' worker ranks."""
    return _wait_on_peer(ctx, dist.group.WORLD, tuple(world), waiter, peer)


@register("abort.world_allreduce")
def world_allreduce(ctx: WorkerContext) -> float:
    """Sum of (worker rank + 1) over the default group."""
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    return t.item()


@register("abort.allreduce")
def allreduce(ctx: WorkerContext, group_id: int, ranks: tuple[int, ...]) -> float:
    """Sum of (worker rank + 1) over the runtime's gloo group ``group_id``."""
    pg, _ = ctx.group(group_id, tuple(ranks))
    t = torch.tensor([float(ctx.rank + 1)])
    pg.allreduce([t]).wait()
    return t.item()


@register("abort.state")
def state(ctx: WorkerContext) -> tuple[int, list[int], int]:
    """(abort epoch, lost ranks, notices that broke connections) as this worker sees them."""
    return ctx.abort_epoch, sorted(ctx.lost_ranks()), len(ctx.abort.breaks)


def check_break_connections() -> None:
    """Run in a process of its own (it shuts down TCP connections of its process):
    an abort breaks only a running command's connections, never the store's nor
    those of groups whose members all live, nor those a command sent after the
    notice made."""
    import socket

    from nereus_rl.runtime.abort import AbortState, socket_inodes, store_peers
    from nereus_rl.runtime.protocol import AbortNotice

    def server() -> socket.socket:
        return socket.create_server(("127.0.0.1", 0))

    def connect(
        listener: socket.socket, key: str, members: tuple[int, ...] | None
    ) -> tuple[socket.socket, socket.socket]:
        """A connection whose near end belongs to group ``key`` over ``members``
        (None: no group); its far end stands for another process (never broken)."""
        if members is None:
            c = socket.create_connection(listener.getsockname())
        else:
            with state.track(key, members):
                c = socket.create_connection(listener.getsockname())
        with state.track(("far", key), ()):
            a, _ = listener.accept()
        return c, a

    def is_closed(far: socket.socket) -> bool:
        far.settimeout(0.2)
        try:
            return far.recv(1) == b""
        except TimeoutError:
            return False

    store_l, peers_l = server(), server()
    state = AbortState(0, store_peers("127.0.0.1", store_l.getsockname()[1]))
    # Nothing else of this process may be broken: claim what it had before.
    state._groups["before"] = (frozenset(), frozenset(socket_inodes()))
    _store_c, store_far = connect(store_l, "store", None)
    live_c, live_far = connect(peers_l, "live", (0, 1))
    _dead_c, dead_far = connect(peers_l, "dead", (1, 2))
    _other_c, other_far = connect(peers_l, "other", None)

    # Idle: nothing is in flight, nothing breaks.
    assert state.apply(AbortNotice(1, (2,), (2,))) == []
    assert state.epoch == 1 and state.lost_ranks() == {2} and not state.aborted()
    # A command sent after notice 2 is not broken by it, however late it is read.
    state.begin(2)
    assert state.apply(AbortNotice(2, (2, 3), (3,))) == [] and not state.aborted()
    state.end()
    assert not any(is_closed(f) for f in (store_far, live_far, dead_far, other_far))
    # A command running when notice 3 comes: its connections break, but not the
    # store's nor the group of live members.
    state.begin(2)
    broken = state.apply(AbortNotice(3, (2, 3, 4), (4,)))
    state.end()
    assert state.aborted() and len(broken) == 2, broken
    assert is_closed(dead_far) and is_closed(other_far)
    assert not is_closed(store_far) and not is_closed(live_far)
    live_c.sendall(b"x")
    assert live_far.recv(1) == b"x"
    # A replayed (older) notice changes nothing.
    state.begin(0)
    assert state.apply(AbortNotice(1, (2,), (2,))) == [] and state.epoch == 3
    state.end()
    assert state.liveness()() == {2, 3, 4}
    assert state.liveness([5, 4, 0, 2])() == {1, 3}
    print("ok")
