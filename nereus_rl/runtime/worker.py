"""A worker process: one per device, carrying out the driver's commands.

Start one by hand on any machine that can reach the job's store::

    python -m nereus_rl.runtime.worker --store HOST:PORT --secret-file PATH [--num-threads 1]

(torchrun-style MASTER_ADDR / MASTER_PORT are used when --store is absent). PATH is
a copy of the file holding the job's secret that the driver wrote (``nereus-rl
train`` prints its path; keep the copy mode 0600); ``$NEREUS_JOB_SECRET`` (hex)
may carry the secret instead. Every message the worker reads is checked against
it before it is unpickled (nereus_rl.runtime.protocol); one that fails is logged
and ignored. A worker with no secret, or another job's, stops before joining.
Export ``THP_MEM_ALLOC_ENABLE=1`` first, as :meth:`Driver.spawn_local` does for the
workers it starts: torch then advises its large CPU allocations to transparent huge
pages, and a new unit's state faults in far fewer pages (torch reads the setting at
its first allocation, so it must be in the environment the worker starts with).
The worker joins the job's nereus_comm World (its rank is its member id - 1,
the driver being member 0; the World carries its heartbeat), opens its liveness
connection to the driver (nereus_rl.runtime.liveness: the driver learns of its
death the moment the process dies; before it writes its WorkerInfo, so there is
no moment at which the driver knows the worker but would not see its death),
then runs commands in the order the driver sends them (see nereus_rl.runtime.context
for how commands are registered and what they see). A daemon thread watches
for the driver's abort notices and breaks the running command's collectives
when workers die (nereus_rl.runtime.abort). A worker that cannot
reach the store gives up after --connect-timeout seconds with an error that
names the address.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pickle
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nereus_comm.errors import MembershipError
from nereus_comm.world import World
from nereus_rl.runtime import liveness
from nereus_rl.runtime import protocol as P
from nereus_rl.runtime.abort import AbortState, AbortWatcher, store_peers
from nereus_rl.runtime.context import COMMANDS, WorkerContext, connect_store


def run_command(ctx: WorkerContext, cmd: P.Command) -> P.Reply:
    """Run one driver command on this worker; its result or its error as a Reply.

    The one place commands run, whichever runtime delivered them (this module's store
    loop, or a Ray actor's method call: nereus_rl.runtime.ray_runtime). Never raises.
    """
    t0 = time.perf_counter()
    # Abort notices newer than the command break its connections from here on.
    ctx.abort.begin(cmd.abort_epoch)
    try:
        fn = COMMANDS.get(cmd.fn)
        if fn is None:
            raise P.RuntimeUserError(
                f"no command {cmd.fn!r} on worker {ctx.rank}; registered: {sorted(COMMANDS)}; "
                "import the module that registers it first (driver.import_module)"
            )
        value = fn(ctx, *cmd.args, **cmd.kwargs)
        dt = time.perf_counter() - t0
        ctx.timings.append((cmd.fn, dt))
        return P.Reply(cmd.seq, ctx.rank, True, value=value, seconds=dt)
    except BaseException as e:
        return P.Reply(
            cmd.seq,
            ctx.rank,
            False,
            error_type=type(e).__name__,
            error=str(e),
            traceback=traceback.format_exc(),
            seconds=time.perf_counter() - t0,
        )
    finally:
        ctx.abort.end()


@dataclass
class Membership:
    """A worker's membership of a job: what :func:`join_job` set up, for its command source.

    Attributes:
        ctx: the context every command runs with.
        store: the store client the context holds (the command loop's too).
        world: the World membership (heartbeat).
        live: the liveness connection to the driver (None if it could not be opened).
        watcher: the abort-notice watcher.
        info: what the worker registered under its rank.
    """

    ctx: WorkerContext
    store: dist.TCPStore
    world: World
    live: liveness.LivenessConnection | None
    watcher: AbortWatcher
    info: P.WorkerInfo

    def close(self, clean: bool = False) -> None:
        """Leave the job. ``clean``: told to (a goodbye on the liveness connection, so
        the driver does not take the end for a death). Idempotent."""
        if self.live is not None:
            if clean:
                self.live.close(bye=True)
            self.live.close()
        self.watcher.stop(timeout=0)
        self.world.leave()


#: Modules a worker imports before it joins: a process's first optimizer step imports
#: torch's compiler stack (about a second on one core, more on a busy one). Paid before
#: joining, it does not hold up the group a running job forms with an arriving worker.
WARM_MODULES = ("torch._dynamo",)


def warm_imports() -> None:
    """Import :data:`WARM_MODULES` (skipped where this torch lacks one)."""
    import importlib

    for name in WARM_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def join_job(
    host: str,
    port: int,
    secret: bytes,
    *,
    num_threads: int = 1,
    connect_timeout: float = 30.0,
    group_timeout: float = 60.0,
    spare: Callable[[], Iterable[int]] | None = None,
) -> Membership:
    """Join the job whose store is at host:port as a new worker (see the module docstring).

    Arguments:
        host, port, secret, num_threads, connect_timeout, group_timeout: see :func:`serve`.
        spare: inode numbers of sockets an abort must never shut down besides the
            store's and the liveness connection (a Ray actor's own connections), asked
            at each abort.

    Returns:
        The :class:`Membership`; the caller runs commands with :func:`run_command` on its
        ``ctx`` and closes it at the end.

    Raises:
        StoreUnreachableError, JobSecretError: see :func:`serve`.
    """
    warm_imports()
    # Checked before this process takes a member id: a worker with the wrong secret
    # would otherwise be a member whose every message the driver rejects.
    store = connect_store(host, port, connect_timeout)
    P.check_job_secret(store, secret, f"{host}:{port}")
    # The abort watcher's client: `store` is held by the long waits for commands
    # below, and a TCPStore client runs one operation at a time.
    watch_store = connect_store(host, port, connect_timeout)
    try:
        # Registration and heartbeats are the World's; the worker never enters a
        # generation (its data groups are standalone, see WorkerContext.group).
        world = World.join(host, port, timeout=connect_timeout, wait=False, secret=secret)
    except MembershipError as e:
        raise P.StoreUnreachableError(
            f"could not join the job at {host}:{port} within {connect_timeout:g} s; check "
            f"that the driver is running and that HOST:PORT is its store address ({e})"
        ) from None
    torch.set_num_threads(num_threads)
    rank = P.rank_of_member(world.member_id)
    live = _connect_liveness(store, host, secret, rank, connect_timeout)
    info = P.WorkerInfo(rank, socket.gethostname(), os.getpid(), num_threads)
    store.set(P.info_key(rank), P.seal(secret, P.info_key(rank), info))
    # An abort breaks the running command's connections but never the store's nor
    # the liveness connection: closing that one would tell the driver we died.
    keep = store_peers(host, port)
    if live is not None:
        keep |= store_peers(host, live.peer[1])
    abort = AbortState(rank, keep, spare=spare)
    ctx = WorkerContext(rank, store, group_timeout, abort, address=(host, port))
    watcher = AbortWatcher(watch_store, secret, abort).start()
    return Membership(ctx, store, world, live, watcher, info)


def serve(
    host: str,
    port: int,
    secret: bytes,
    *,
    num_threads: int = 1,
    connect_timeout: float = 30.0,
    group_timeout: float = 60.0,
) -> None:
    """Join the job whose store is at host:port and run commands until told to stop.

    Arguments:
        host, port: the store's address.
        secret: the job's secret (see :func:`nereus_rl.runtime.protocol.load_secret`).
        num_threads: torch intra-op threads for this worker (its share of the cores).
        connect_timeout: seconds to wait for the store before giving up.
        group_timeout: default seconds a gloo op may wait for a peer.

    Raises:
        StoreUnreachableError: the store did not answer within connect_timeout.
        JobSecretError: ``secret`` is not the job's (checked before joining).
    """
    membership = join_job(
        host,
        port,
        secret,
        num_threads=num_threads,
        connect_timeout=connect_timeout,
        group_timeout=group_timeout,
    )
    try:
        _command_loop(membership.ctx, membership.store, secret)
        # A clean end (told to exit, or the job is over): not a death.
        membership.close(clean=True)
    finally:
        membership.close()


def _connect_liveness(
    store: dist.TCPStore, host: str, secret: bytes, rank: int, timeout: float
) -> liveness.LivenessConnection | None:
    """Open this worker's liveness connection; None (and a warning) if that fails.

    Without it the worker still works; its death is then seen by its heartbeat only.
    """
    try:
        if not store.check([P.LIVENESS_KEY]):
            P.log.warning(
                "worker %d: the driver publishes no liveness port; its death will be "
                "seen by its heartbeat only",
                rank,
            )
            return None
        port = P.unseal(secret, P.LIVENESS_KEY, bytes(store.get(P.LIVENESS_KEY)))
        if not isinstance(port, int) or not 0 < port < 65536:
            raise P.UnauthenticatedMessageError(P.LIVENESS_KEY, b"")
        return liveness.connect(host, port, secret, rank, timeout)
    except (OSError, P.UnauthenticatedMessageError, RuntimeError) as e:
        P.log.warning(
            "worker %d: no liveness connection to the driver (%s); its death will be seen "
            "by its heartbeat only",
            rank,
            e,
        )
        return None


def _command_loop(ctx: WorkerContext, store: dist.TCPStore, secret: bytes) -> None:
    """Run the driver's commands in order until told to exit or the job ends."""
    rank = ctx.rank
    seq = 0
    # Long waits: a new command wakes the wait at once, and a dead driver
    # breaks the connection; a short timeout would only log timeouts.
    poll = datetime.timedelta(seconds=30.0)
    while True:
        key = P.cmd_key(rank, seq)
        try:
            store.wait([key], poll)
        except RuntimeError:
            # Timed out (or the store went away): stop if told to or if
            # the driver's store is gone, else keep waiting.
            try:
                if store.check([P.SHUTDOWN_KEY]):
                    return
            except RuntimeError:
                return
            continue
        try:
            cmd = P.take(store, key, secret)
        except P.UnauthenticatedMessageError as e:
            # Logged by take; run nothing and wait for the driver's own command.
            if not _wait_replaced(store, key, e.head):
                return
            continue
        if not isinstance(cmd, P.Command) or cmd.seq != seq:
            # Tagged with the secret, so the driver's; never expected.
            raise AssertionError(f"the driver sent {cmd!r} under {key!r}")
        if cmd.fn == "exit":
            P.put(store, P.reply_key(rank, seq), P.Reply(seq, rank, True, value=rank), secret)
            return
        reply = run_command(ctx, cmd)
        try:
            P.put(store, P.reply_key(rank, seq), reply, secret)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            why = f"the result of {cmd.fn!r} cannot be pickled: {e}"
            P.put(
                store,
                P.reply_key(rank, seq),
                P.Reply(seq, rank, False, None, type(e).__name__, why),
                secret,
            )
        seq += 1


def _wait_replaced(store: dist.TCPStore, key: str, head: bytes) -> bool:
    """Wait until ``key`` no longer holds the rejected ``head`` (or is gone).

    Returns:
        False if the job ended meanwhile (shutdown, or the store is gone).
    """
    while True:
        time.sleep(0.05)
        try:
            if store.check([P.SHUTDOWN_KEY]):
                return False
            if not store.check([key]) or bytes(store.get(key)) != head:
                return True
        except RuntimeError:
            return False


def _parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise P.RuntimeUserError(f"--store must be HOST:PORT, got {text!r}")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m nereus_rl.runtime.worker`` (and ``nereus-rl worker``)."""
    ap = argparse.ArgumentParser(prog="nereus-rl worker", description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", help="HOST:PORT of the store (default MASTER_ADDR:MASTER_PORT)")
    ap.add_argument(
        "--secret-file",
        help=f"file holding the job's secret, mode 0600 (the driver prints its path; "
        f"default ${P.SECRET_ENV})",
    )
    ap.add_argument("--num-threads", type=int, default=1, help="torch threads of this worker")
    ap.add_argument("--connect-timeout", type=float, default=30.0, help="seconds to reach store")
    ap.add_argument("--group-timeout", type=float, default=60.0, help="seconds a gloo op may wait")
    args = ap.parse_args(argv)
    if args.store:
        host, port = _parse_address(args.store)
    elif "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    else:
        ap.error("give --store HOST:PORT (or set MASTER_ADDR and MASTER_PORT)")
    try:
        secret = P.load_secret(args.secret_file)
        # Not passed on to processes this one starts.
        os.environ.pop(P.SECRET_ENV, None)
        serve(
            host,
            port,
            secret,
            num_threads=args.num_threads,
            connect_timeout=args.connect_timeout,
            group_timeout=args.group_timeout,
        )
    except (P.StoreUnreachableError, P.JobSecretError) as e:
        print(f"nereus-rl worker: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
