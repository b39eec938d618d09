"""Aborting a worker's in-flight collectives when the driver learns of a death.

The failure this ends: survivor A waits in a gloo collective on survivor B,
which is alive but has left that collective (B got an error from the dead
worker C and its command returned). Nothing in gloo wakes A before the group's
timeout (60 s by default): ``ProcessGroupGloo.abort()`` and ``shutdown()`` do
not unblock an op in flight, on the calling rank or on its peers. What does is
a closed TCP connection: an op blocked on a pair whose socket is shut down
raises ("Connection closed by peer") at once, on both ends.

So when the driver marks workers lost it writes a sealed
:class:`~nereus_rl.runtime.protocol.AbortNotice` under ``abort/<epoch>``, and
every worker runs an :class:`AbortWatcher`: a daemon thread that waits for the
next epoch's key on a store connection of its own (the main thread's client is
held by its long wait for the next command, and a TCPStore client runs one
operation at a time), checks the notice's tag, and hands it to the worker's
:class:`AbortState`. If a command is running, that breaks the command's gloo
connections with ``shutdown(SHUT_RDWR)``: the collective raises in this process
and, its peers' ends being closed, in theirs. The command fails with an error
reply, and the driver's recovery forms new groups over the survivors.

Which connections break (:meth:`AbortState.apply`):

* only while a command runs: an idle worker has nothing in flight, and its
  groups of survivors stay usable (the driver's communicator pool hands them out
  again after a recovery);
* only notices newer than the running command: the driver tags every command
  with its abort epoch, so a command sent after a notice (the recovery's own
  ``rl.init``, which builds new groups) is never broken by it, however late the
  watcher reads it;
* every TCP connection of the process except those to the job's store (the
  command, heartbeat and watcher clients) and except the connections of groups
  whose members are all alive: :meth:`WorkerContext.group
  <nereus_rl.runtime.context.WorkerContext.group>` records the sockets each of
  its groups opened, and :meth:`AbortState.track` lets other code (the trainer's
  default group) declare theirs. Connections no group claims belong to groups
  whose members this process does not know, so they break.

NCCL communicators are not sockets: a tracked group may carry an abort hook
(:meth:`AbortState.on_abort`; the trainer's default group on GPUs registers
torch's ``_abort_process_group``, which calls ``ncclCommAbort``), run on the
watcher's thread when a notice names one of the group's members while a command
runs.

Not covered: a command blocked in a group of survivors only, on a survivor that
left it after another group failed (its group timeout still ends it; a
``liveness`` hook may end it sooner, see :meth:`AbortState.liveness`).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch.distributed as dist

from nereus_rl.runtime import protocol as P

#: Seconds between two reads of a rejected (forged) notice's key, waiting for the
#: driver's own notice to replace it.
REJECTED_POLL_S = 0.2
# The watcher's store wait is woken at once by the key's arrival; the timeout only
# bounds how often an idle watcher looks for the job's end.
_WAIT_S = 300.0


def socket_inodes() -> set[int]:
    """Inode numbers of every socket this process has open (from /proc/self/fd)."""
    out = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            out.add(int(target[8:-1]))
    return out


def _peer(address: tuple) -> tuple[str, int]:
    """(address, port) of a socket address, IPv4-mapped IPv6 written as IPv4.

    torch's TCPStore client connects over an IPv6 socket to an IPv4 address, so its
    peer reads ``::ffff:127.0.0.1``.
    """
    host = str(address[0])
    if host.lower().startswith("::ffff:") and "." in host:
        host = host[7:]
    return host, int(address[1])


def store_peers(host: str, port: int) -> frozenset[tuple[str, int]]:
    """The (address, port) pairs a connection to the store at host:port has as its peer."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        infos = []
    return frozenset(_peer(info[4]) for info in infos) | {_peer((host, port))}


def break_connections(
    skip_peers: Iterable[tuple[str, int]], keep: Iterable[int] = (), force: Iterable[int] = ()
) -> list[tuple[str, int]]:
    """Shut down (both ways) every connected TCP socket of this process, with exceptions.

    The socket itself is shut down, not closed: its owner (gloo) keeps a valid file
    descriptor, sees the connection end, and fails the ops waiting on it; the peer
    sees its end closed too.

    Arguments:
        skip_peers: (address, port) of peers whose connections stay (the store's).
        keep: inode numbers of sockets that stay.
        force: inode numbers of sockets shut down even to a skipped peer (a group's own
            store client, whose rendezvous waits on a dead member).

    Returns:
        The peers of the connections shut down.
    """
    skip = frozenset(skip_peers)
    keep = frozenset(keep)
    force = frozenset(force)
    broken: list[tuple[str, int]] = []
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return broken
    for name in names:
        fd = int(name)
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if not target.startswith("socket:[") or int(target[8:-1]) in keep:
            continue
        try:
            dup = os.dup(fd)  # a socket object of our own: closing it leaves gloo's fd
        except OSError:
            continue
        try:
            sock = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            continue
        with sock:
            try:
                if os.fstat(dup).st_ino != int(target[8:-1]):
                    continue  # the number was closed and reused since the listing
                if sock.family not in (socket.AF_INET, socket.AF_INET6):
                    continue
                if sock.type != socket.SOCK_STREAM:
                    continue
                peer = _peer(sock.getpeername())  # a listening socket has none (ENOTCONN)
                if peer in skip and int(target[8:-1]) not in force:
                    continue
                sock.shutdown(socket.SHUT_RDWR)
                broken.append(peer)
            except OSError:
                continue
    return broken


class AbortState:
    """A worker's view of the driver's abort notices, and what it breaks on one.

    Thread safety: the watcher thread calls :meth:`apply`, the command loop
    :meth:`begin` / :meth:`end`, commands the queries; one lock orders them, so a
    command never begins halfway through a break.

    Arguments:
        rank: this worker's rank (for messages).
        skip_peers: (address, port) of the store's connections, never broken
            (see :func:`store_peers`); empty: no connection is ever broken.
        spare: inode numbers of further sockets never broken, asked at each break (a
            Ray actor's connections to its raylet, GCS and callers: breaking them would
            kill the actor, see nereus_rl.runtime.ray_runtime); None: none.
    """

    def __init__(
        self,
        rank: int,
        skip_peers: Iterable[tuple[str, int]] = (),
        spare: Callable[[], Iterable[int]] | None = None,
    ) -> None:
        self.rank = rank
        self._skip = frozenset(skip_peers)
        self._spare = spare
        self._lock = threading.Lock()
        self._epoch = 0
        self._lost: frozenset[int] = frozenset()
        self._busy = False
        self._floor = 0  # the running command's abort epoch (see begin)
        self._cmd_aborted = False
        self._groups: dict[object, tuple[frozenset[int], frozenset[int]]] = {}
        self._hooks: dict[object, Callable[[], None]] = {}  # key -> abort of its group
        # Groups being built (members, the sockets open before): an abort during the
        # build claims what was opened since, the rendezvous's store client included.
        self._building: dict[object, tuple[frozenset[int], frozenset[int]]] = {}
        #: (epoch, peers shut down) of every notice that broke connections.
        self.breaks: list[tuple[int, list[tuple[str, int]]]] = []

    # ------------------------------------------------------------ queries

    @property
    def epoch(self) -> int:
        """The newest abort epoch this worker has read (0: none yet)."""
        return self._epoch

    def lost_ranks(self) -> frozenset[int]:
        """Worker ranks the driver's notices named lost so far (never blocks)."""
        return self._lost

    def aborted(self) -> bool:
        """True if a notice newer than the running command arrived while it ran."""
        return self._cmd_aborted

    def liveness(self, ranks: Sequence[int] | None = None) -> Callable[[], frozenset[int]]:
        """A nereus_comm ``liveness`` callable (``Transport.exchange``, ``reshard``).

        Arguments:
            ranks: None when the transport's ranks are worker ranks (the runtime's
                groups, the EMU layouts); else the worker rank of each rank of the
                transport's group, in its rank order (e.g. the trainer's default
                group), and the callable answers in those ranks.

        Returns:
            A cheap, never-blocking callable answering the ranks known dead now.
        """
        if ranks is None:
            return self.lost_ranks
        index = {int(w): i for i, w in enumerate(ranks)}
        return lambda: frozenset(index[w] for w in self._lost if w in index)

    # ------------------------------------------------------------ groups

    @contextlib.contextmanager
    def track(self, key: object, members: Iterable[int]) -> Iterator[None]:
        """Claim the sockets opened inside the block for a group over worker ranks ``members``.

        An abort then leaves them alone unless it names one of ``members``.
        Gloo connects a group's pairs while it is built, so build the group inside
        the block (and nothing else that opens connections).

        Arguments:
            key: names the group (a later :meth:`track` of the same key replaces it).
            members: worker ranks (the runtime's, not the group's) of its members.
        """
        before = frozenset(socket_inodes())
        members = frozenset(int(m) for m in members)
        with self._lock:
            self._building[key] = (members, before)
        try:
            yield
        finally:
            opened = frozenset(socket_inodes() - before)
            with self._lock:
                self._building.pop(key, None)
                self._groups[key] = (members, opened)

    def untrack(self, key: object) -> None:
        """Forget a group's sockets (it was released); unknown keys are ignored."""
        with self._lock:
            self._groups.pop(key, None)
            self._hooks.pop(key, None)

    def on_abort(self, key: object, hook: Callable[[], None]) -> None:
        """Run ``hook`` when a notice names a member of tracked group ``key`` while a
        command runs (after its sockets are shut down, outside the lock).

        For communicators a closed socket does not end, e.g. NCCL's: the hook aborts
        them, so a survivor's collective returns instead of waiting for its timeout.
        A hook that raises is logged; the other hooks still run.
        """
        with self._lock:
            self._hooks[key] = hook

    # ------------------------------------------------------------ commands

    def begin(self, abort_epoch: int) -> None:
        """A command sent at the driver's abort epoch ``abort_epoch`` starts."""
        with self._lock:
            self._busy = True
            self._floor = abort_epoch
            self._cmd_aborted = False

    def end(self) -> None:
        """The running command ended."""
        with self._lock:
            self._busy = False

    def apply(self, notice: P.AbortNotice) -> list[tuple[str, int]]:
        """Take a checked notice: record its ranks and break the running command's groups.

        Returns:
            The peers whose connections were shut down (empty when nothing ran, or
            the running command was sent after this notice).
        """
        with self._lock:
            self._lost = self._lost | frozenset(int(r) for r in notice.lost)
            if notice.epoch <= self._epoch:
                return []
            self._epoch = notice.epoch
            if not self._busy or notice.epoch <= self._floor:
                return []
            self._cmd_aborted = True
            hooks = [
                hook
                for key, hook in self._hooks.items()
                if key in self._groups and self._groups[key][0] & self._lost
            ]
            broken: list[tuple[str, int]] = []
            if self._skip:
                keep: set[int] = set() if self._spare is None else set(self._spare())
                force: set[int] = set()
                groups = list(self._groups.values())
                if self._building:
                    now = frozenset(socket_inodes())
                    groups += [(m, now - before) for m, before in self._building.values()]
                for members, inodes in groups:
                    if not members & self._lost:
                        keep |= inodes
                    else:  # its store client too: a rendezvous waits there on the dead
                        force |= inodes
                broken = break_connections(self._skip, keep, force)
                self.breaks.append((notice.epoch, broken))
        # Outside the lock: an NCCL abort may wait for the op it ends, which may be in
        # the command thread holding nothing of ours, but must not hold up begin/end.
        self._run_hooks(hooks, notice)
        if broken:
            P.log.warning(
                "worker %d: workers %s lost (abort epoch %d); shut down %d connection(s) of "
                "the running command",
                self.rank,
                sorted(notice.new),
                notice.epoch,
                len(broken),
            )
        return broken

    def _run_hooks(self, hooks: list[Callable[[], None]], notice: P.AbortNotice) -> None:
        for hook in hooks:
            try:
                hook()
            except Exception as e:  # a hook must not stop the watcher
                P.log.warning(
                    "worker %d: an abort hook failed at abort epoch %d: %s",
                    self.rank,
                    notice.epoch,
                    e,
                )


class AbortWatcher:
    """A daemon thread that reads the driver's abort notices and applies them.

    Arguments:
        store: a store client of its own (its waits block the client).
        secret: the job's secret; a notice without its tag is logged and ignored.
        state: where notices are applied.
    """

    def __init__(self, store: dist.Store, secret: bytes, state: AbortState) -> None:
        self._store = store
        self._secret = secret
        self.state = state
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nereus-abort-watch", daemon=True)

    def start(self) -> AbortWatcher:
        """Start watching; returns self."""
        self._thread.start()
        return self

    def stop(self, timeout: float = 1.0) -> None:
        """Ask the thread to stop (it notices within its next wake-up)."""
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        epoch = 1  # old notices are read too: they carry the ranks lost before joining
        wait = datetime.timedelta(seconds=_WAIT_S)
        rejected: bytes | None = None
        while not self._stop.is_set():
            key = P.abort_key(epoch)
            try:
                if rejected is None:
                    self._store.wait([key], wait)
                else:
                    time.sleep(REJECTED_POLL_S)
                if self._stop.is_set():
                    return
                value = bytes(self._store.get(key))
            except RuntimeError:
                # The wait timed out, or the store is gone (the job ended).
                try:
                    if self._store.check([P.SHUTDOWN_KEY]):
                        return
                except RuntimeError:
                    return
                continue
            if value == rejected:
                continue  # the same forgery: wait for the driver's notice to replace it
            try:
                notice = P.unseal(self._secret, key, value)
                if not isinstance(notice, P.AbortNotice) or notice.epoch != epoch:
                    raise P.UnauthenticatedMessageError(key, value)
            except P.UnauthenticatedMessageError as e:
                P.log.warning("worker %d: ignored an abort notice: %s", self.state.rank, e)
                rejected = value
                continue
            except Exception as e:  # a tagged notice that does not load: never expected
                P.log.warning("worker %d: unreadable abort notice %r: %s", self.state.rank, key, e)
                rejected = value
                continue
            rejected = None
            self.state.apply(notice)
            epoch += 1
