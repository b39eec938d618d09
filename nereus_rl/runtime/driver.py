"""The driver: owns the job's store, starts or admits workers, and calls them.

The driver hosts a torch.distributed.TCPStore, listening on the host it is given
only (loopback by default). Workers join it, either spawned here
(:meth:`Driver.spawn_local`) or started elsewhere with
``python -m nereus_rl.runtime.worker --store HOST:PORT --secret-file PATH``, where
PATH is a copy of :attr:`Driver.secret_file`: every message is authenticated with
the job's secret (see nereus_rl.runtime.protocol), and one that is not is
rejected, logged, and changes nothing. The driver then calls
registered worker commands on any set of workers and gets their results, or a
:class:`RemoteError` carrying the remote traceback, or within a bounded time a
:class:`WorkerTimeoutError` / :class:`WorkerLostError` naming the workers that
did not answer. Membership is nereus_comm.world.World's (the driver creates the
World, workers join it). A worker counts as lost when any of three signs says so:

* its liveness connection ended without a goodbye (nereus_rl.runtime.liveness):
  every worker, spawned or joined, holds one TCP connection to the driver open,
  and the kernel closes it the moment the process dies, however it dies; this
  finds a dead process within milliseconds wherever it ran;
* for a local worker, its process has exited;
* its World heartbeat (a counter compared on the watcher's own clock) has been
  silent for ``heartbeat_timeout``: the bound for what closes no socket, a hung
  process or a machine that is unreachable.

When the driver notices that workers died (:meth:`Driver.check_liveness`, which
the liveness listener's thread runs at once on a closed connection, and
:meth:`Driver.wait` every 0.2 s while it waits and at once when the listener has
seen a death) it publishes a sealed abort notice, and every survivor's running
command has its gloo collectives broken at once (nereus_rl.runtime.abort) rather
than waiting out their group timeout.

Thread safety: threads may call :meth:`Driver.submit`, :meth:`Driver.wait`,
:meth:`Driver.call` and the membership queries at once (the transition
executor runs EMU primitives on disjoint workers from its threads). A submit
is atomic over its ranks, so every worker receives the commands of
concurrent callers in one global order: a command that spans several workers
(a collective among them) is never queued before another one on one worker
and after it on another, which rules out cyclic waits between commands. The
TCPStore client serializes its own operations; replies are polled without
blocking it.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from nereus_comm.environment import worker_env, worker_environ
from nereus_comm.world import World
from nereus_rl.runtime import protocol as P
from nereus_rl.runtime.liveness import LivenessListener

# Local workers that die before joining are replaced, this many in all per spawn_local.
SPAWN_RESTARTS = 3


@dataclass
class PendingCall:
    """A command sent to some workers whose replies have not all been read yet."""

    fn: str
    seqs: dict[int, int]  # rank -> seq of the command on that rank
    sent_at: float


#: Seconds between liveness checks of a loop that waits for replies.
LIVENESS_CHECK_S = 0.2


class LivenessCadence:
    """When a loop waiting for replies checks which workers died: every
    :data:`LIVENESS_CHECK_S`, and at once after the liveness listener saw a death (not
    at the next period)."""

    def __init__(self, listener: LivenessListener | None) -> None:
        self._listener = listener
        self._deaths = listener.deaths if listener is not None else 0
        self._next = time.monotonic() + LIVENESS_CHECK_S

    def due(self, now: float) -> bool:
        """Whether to check now (the next check is then a period away)."""
        if self._listener is not None and self._listener.deaths != self._deaths:
            self._deaths = self._listener.deaths
            self._next = now
        if now < self._next:
            return False
        self._next = now + LIVENESS_CHECK_S
        return True


def reply_values(fn: str, replies: dict[int, P.Reply]) -> dict[int, Any]:
    """rank -> the value each reply carries, in rank order.

    Raises:
        RemoteError: a command raised on a worker (the lowest such rank).
    """
    for rank in sorted(replies):
        r = replies[rank]
        if not r.ok:
            raise P.RemoteError(rank, fn, r.error_type, r.error, r.traceback)
    return {rank: replies[rank].value for rank in sorted(replies)}


class Driver:
    """Hosts the job's store and World, and sends commands to workers.

    Arguments:
        host: address the store listens on (only there) and workers connect to. An
            address other than loopback lets anyone who reaches the port disrupt the
            job, and whoever holds the job's secret run code on its workers. The
            liveness listener listens there too, on a port the OS picks (published
            in the store): workers on other machines need to reach both.
        port: store port (0 picks a free one; see :attr:`address`).
        heartbeat_timeout: seconds without a heartbeat after which a worker counts
            as lost (the World's; its heartbeat interval is min(0.5, timeout / 4)).
            A process that dies is seen at once through its liveness connection;
            this bounds what closes no connection (a hung process, a lost machine).
        call_timeout: default seconds a call waits for its replies.
        secret: the job's secret (default: a fresh random one, the usual choice).

    Raises:
        MembershipError: the store cannot listen at host:port.
        OSError: the liveness listener cannot listen on host.
        JobSecretError: the secret file's folder is not private to this user.

    Attributes:
        records: free-form records (dicts) of timed operations, appended by
            layers above (e.g. one per EMU primitive).
        secret_file: a file (mode 0600) holding the job's secret, for workers started
            by hand (``--secret-file``); removed at shutdown.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        heartbeat_timeout: float = 5.0,
        call_timeout: float = 120.0,
        secret: bytes | None = None,
    ) -> None:
        if secret is not None and len(secret) < P.SECRET_BYTES:
            raise P.JobSecretError(
                f"a job secret needs at least {P.SECRET_BYTES} bytes, got {len(secret)}; "
                "leave secret=None for a fresh random one"
            )
        self._secret = P.new_secret() if secret is None else bytes(secret)
        self.host = host
        self.world = World.create(
            host,
            port,
            min_members=1,
            heartbeat_interval=min(0.5, heartbeat_timeout / 4),
            heartbeat_timeout=heartbeat_timeout,
            secret=self._secret,
        )
        self.port = self.world.port
        # A client of our own: the World's store object is its business.
        self.store = dist.TCPStore(
            host, self.port, is_master=False, timeout=datetime.timedelta(seconds=30)
        )
        P.publish_secret_check(self.store, self._secret)
        self.heartbeat_timeout = heartbeat_timeout
        self.call_timeout = call_timeout
        self.records: list[dict[str, Any]] = []
        self.infos: dict[int, P.WorkerInfo] = {}
        # Rejected (forged) values per store key: one warning each, not one per poll.
        self._rejected: dict[str, bytes] = {}
        self._procs: dict[int, Any] = {}  # Popen or _ForkedWorker
        self._seq: dict[int, int] = {}
        self._seen_alive: set[int] = set()
        self._joined_at: dict[int, float] = {}
        self._lost: set[int] = set()
        # Abort notices written so far (see _publish_abort); each command carries it.
        self._abort_epoch = 0
        self._imports: list[str] = []
        self._closed = False
        # Guards the membership tables and the per-worker sequence numbers, and makes
        # each submit atomic: every worker then sees the commands of concurrent callers
        # in one global order, so commands that span workers (collectives) never wait
        # on each other in a cycle. Reentrant: a late joiner's imports are sent under it.
        self._lock = threading.RLock()
        # Started last: its thread calls back into the tables above.
        self._liveness: LivenessListener | None = None
        try:
            # The listener's thread reads the registration count on a client of its
            # own (a TCPStore client runs one operation at a time).
            liveness_store = dist.TCPStore(
                host, self.port, is_master=False, timeout=datetime.timedelta(seconds=30)
            )
            # On the store's own address, so it is exposed exactly where the store is.
            self._liveness = LivenessListener(
                host,
                self._secret,
                lambda: _registered_ranks(liveness_store),
                self._on_liveness_death,
            )
            self.store.set(
                P.LIVENESS_KEY, P.seal(self._secret, P.LIVENESS_KEY, self._liveness.port)
            )
            self.secret_file = P.write_secret_file(P.secret_file_for(host, self.port), self._secret)
        except BaseException:
            if self._liveness is not None:
                self._liveness.close()
            self.world.leave()
            raise

    @property
    def address(self) -> str:
        """``HOST:PORT`` of the store, the argument of ``--store`` for workers."""
        return f"{self.host}:{self.port}"

    # ---------------------------------------------------------------- membership

    def spawn_local(
        self,
        num_workers: int,
        *,
        num_threads: int = 1,
        group_timeout: float = 60.0,
        timeout: float = 120.0,
        method: str = "subprocess",
    ) -> list[int]:
        """Start ``num_workers`` worker processes on this machine and wait for them to join.

        Arguments:
            num_workers: how many to start.
            num_threads: torch threads per worker (its share of the cores).
            group_timeout: seconds a worker's gloo op may wait for a peer.
            timeout: seconds to wait for all of them to join.
            method: "subprocess" starts ``python -m nereus_rl.runtime.worker``
                (exactly what a hand-started worker runs); "forkserver" forks each
                worker from a multiprocessing forkserver that imported torch once
                (much faster to start; like any multiprocessing start method it
                re-imports the calling script, which needs an
                ``if __name__ == "__main__"`` guard).

        Returns:
            Their global ranks, in the order they were started.

        A worker that exits before joining is replaced by a new process (up to
        :data:`SPAWN_RESTARTS` in all): it held nothing yet.

        Raises:
            WorkerLostError: workers kept exiting before joining.
            WorkerTimeoutError: not all of them joined in time.
        """
        if method not in ("forkserver", "subprocess"):
            raise P.RuntimeUserError(f"method must be 'forkserver' or 'subprocess', got {method!r}")

        def start() -> Any:
            if method == "forkserver":
                return _ForkedWorker(self.host, self.port, num_threads, group_timeout, self._secret)
            cmd = [
                sys.executable,
                "-m",
                "nereus_rl.runtime.worker",
                "--store",
                self.address,
                "--num-threads",
                str(num_threads),
                "--group-timeout",
                str(group_timeout),
            ]
            env = worker_env()  # transparent huge pages for fresh state, unless set
            env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # idle store waits log timeouts
            # The secret travels in the environment, never on the command line (which
            # every user of the machine can read in /proc/PID/cmdline).
            env[P.SECRET_ENV] = self._secret.hex()
            return subprocess.Popen(cmd, env=env)

        procs: list[Any] = [start() for _ in range(num_workers)]
        by_pid = {p.pid: p for p in procs}
        deadline = time.monotonic() + timeout
        ranks: dict[int, int] = {}
        restarts = 0
        try:
            while len(ranks) < num_workers:
                for info in self._poll_joined():
                    if info.pid in by_pid:
                        ranks[info.pid] = info.rank
                        self._procs[info.rank] = by_pid[info.pid]
                for i, p in enumerate(procs):
                    if p.pid in ranks or p.poll() is None:
                        continue
                    # Died before joining: it holds nothing yet, so another process
                    # takes its place (a few times; then the machine is the problem).
                    if restarts >= SPAWN_RESTARTS:
                        raise P.WorkerLostError(
                            f"local worker pid {p.pid} exited with code {p.returncode} "
                            f"before joining, after {restarts} restarts of workers that "
                            "died while starting; check the workers' output above",
                            (),
                        )
                    restarts += 1
                    P.log.warning(
                        "local worker pid %d exited with code %s before joining; starting "
                        "another in its place",
                        p.pid,
                        p.returncode,
                    )
                    procs[i] = start()
                    by_pid[procs[i].pid] = procs[i]
                if len(ranks) < num_workers:
                    if time.monotonic() > deadline:
                        raise P.WorkerTimeoutError(
                            f"only {len(ranks)} of {num_workers} local workers joined "
                            f"within {timeout:g} s",
                            (),
                        )
                    time.sleep(0.05)
        except BaseException:
            # Those that did not join are not the driver's to stop at shutdown: stop
            # them here, so that a failed start leaves no process behind.
            for p in procs:
                if p.pid not in ranks and p.poll() is None:
                    p.kill()
                    p.wait()
            raise
        return [ranks[p.pid] for p in procs]

    def start_workers(self, num_workers: int, **kwargs: Any) -> list[int]:
        """The runtime interface's start (nereus_rl.runtime.base.Runtime): local
        processes, :meth:`spawn_local` with ``kwargs``."""
        return self.spawn_local(num_workers, **kwargs)

    def wait_for_workers(self, num_workers: int, timeout: float = 60.0) -> list[int]:
        """Wait until at least ``num_workers`` workers have joined (ever, lost ones included).

        Returns:
            The ranks of all workers joined so far.

        Raises:
            WorkerTimeoutError: fewer joined within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            self._poll_joined()
            if len(self.infos) >= num_workers:
                return sorted(self.infos)
            if time.monotonic() > deadline:
                raise P.WorkerTimeoutError(
                    f"{len(self.infos)} of {num_workers} workers joined within {timeout:g} s "
                    f"(store {self.address})",
                    (),
                )
            time.sleep(0.05)

    def _poll_joined(self) -> list[P.WorkerInfo]:
        with self._lock:
            return self._poll_joined_locked()

    def _poll_joined_locked(self) -> list[P.WorkerInfo]:
        num_ids = self.store.add(P.WORLD_NUM_IDS_KEY, 0)
        new = []
        for rank in range(P.rank_of_member(num_ids)):
            if rank in self.infos:
                continue
            key = P.info_key(rank)
            if not self.store.check([key]):
                continue  # it took a rank but has not written its info yet
            value = bytes(self.store.get(key))  # small, written with set
            if self._rejected.get(key) == value:
                continue
            try:
                info = P.unseal(self._secret, key, value)
            except P.UnauthenticatedMessageError as e:
                # Not a worker of this job (no secret): it stays out; a genuine info
                # written over this one later is still taken.
                self._rejected[key] = value
                P.log.warning("%s", e)
                continue
            if not isinstance(info, P.WorkerInfo) or info.rank != rank:
                P.log.warning("ignored %r under %r: not this rank's WorkerInfo", info, key)
                self._rejected[key] = value
                continue
            self.infos[rank] = info
            self._seq[rank] = 0
            self._joined_at[rank] = time.monotonic()
            new.append(info)
            for module in self._imports:
                # A late joiner learns the commands every other worker has.
                self.wait(self.submit([rank], "import", module))
        return new

    @property
    def workers(self) -> list[int]:
        """Ranks of the joined workers not known to be lost."""
        with self._lock:
            self._poll_joined_locked()
            return sorted(r for r in self.infos if r not in self._lost)

    def check_liveness(self) -> tuple[int, ...]:
        """Look at liveness connections, local processes and heartbeats now.

        Workers found lost for the first time are announced to the others (an
        abort notice: their running collectives are broken at once).

        Returns:
            All workers known to be lost so far (sorted).
        """
        with self._lock:
            return self._check_liveness_locked()

    def _check_liveness_locked(self) -> tuple[int, ...]:
        alive = self.world.alive()
        closed = self._liveness.dead() if self._liveness is not None else frozenset()
        now = time.monotonic()
        new: list[int] = []
        for rank in list(self.infos):
            if rank in self._lost:
                continue
            proc = self._procs.get(rank)
            if rank in closed or (proc is not None and proc.poll() is not None):
                new.append(rank)
            elif P.member_of_rank(rank) in alive:
                self._seen_alive.add(rank)
            elif rank in self._seen_alive or now - self._joined_at[rank] > self.heartbeat_timeout:
                # Its heartbeat stopped for heartbeat_timeout (or it left); a fresh
                # joiner gets that long for the World's watcher to first see it.
                new.append(rank)
        if new:
            self._lost.update(new)
            self._publish_abort(new)
        return tuple(sorted(self._lost))

    def _on_liveness_death(self, rank: int) -> None:
        """The listener saw ``rank``'s connection end: publish the abort notice now.

        Runs on the listener's thread, which must not wait on the driver's lock
        (a holder may be in a long call): when the lock is busy, its holder or the
        next waiter runs the liveness check instead (:meth:`wait` checks at once
        when :attr:`LivenessListener.deaths` moves).
        """
        if not self._lock.acquire(blocking=False):
            return
        try:
            if not self._closed and rank in self.infos:
                self._check_liveness_locked()
        finally:
            self._lock.release()

    def _publish_abort(self, new: list[int]) -> None:
        """Tell every worker that ``new`` died: survivors abort their running collectives.

        A survivor may be waiting in a gloo collective on another survivor that has
        left it (that one got an error from the dead worker and returned); gloo ends
        such a wait only at the group's timeout. Each worker's abort watcher reads
        the notice at once and breaks its running command's connections
        (nereus_rl.runtime.abort). One key per epoch, so a watcher waits for its
        next key (woken by its arrival) instead of polling one key for changes;
        sealed like every control message, so nobody without the secret can make
        workers abort (a forged notice is logged and ignored). Commands sent from
        now on carry the new epoch, so this notice never breaks them.
        """
        self._abort_epoch += 1
        key = P.abort_key(self._abort_epoch)
        notice = P.AbortNotice(self._abort_epoch, tuple(sorted(self._lost)), tuple(sorted(new)))
        try:
            self.store.set(key, P.seal(self._secret, key, notice))
        except RuntimeError as e:  # the store is going away: so are the workers
            P.log.warning("could not publish the abort notice for workers %s: %s", new, e)

    def wait_for_loss(self, timeout: float) -> tuple[int, ...]:
        """Block until some worker is noticed lost, or ``timeout`` seconds pass.

        Returns:
            The lost workers (empty if none within the timeout).
        """
        deadline = time.monotonic() + timeout
        while True:
            lost = self.check_liveness()
            if lost or time.monotonic() > deadline:
                return lost
            time.sleep(0.05)

    def pid(self, rank: int) -> int:
        """The process id of a worker this driver spawned (to place it in a cgroup, pin
        it to cores, or watch it).

        Raises:
            RuntimeUserError: the worker was not spawned by this driver.
        """
        proc = self._procs.get(rank)
        if proc is None:
            raise P.RuntimeUserError(f"worker {rank} was not spawned by this driver")
        return proc.pid

    def kill(self, rank: int) -> None:
        """SIGKILL a local worker (for failure tests and drills).

        Raises:
            RuntimeUserError: the worker was not spawned by this driver.
        """
        os.kill(self.pid(rank), signal.SIGKILL)
        self._procs[rank].wait()
        # Known dead now: the survivors' collectives are aborted at once (a pending
        # wait would also notice within its next liveness check).
        self.check_liveness()

    # ---------------------------------------------------------------- calls

    def import_module(self, module: str) -> None:
        """Make every worker, now and joining later, import ``module`` (it registers commands)."""
        if module not in self._imports:
            self._imports.append(module)
        self.call(self.workers, "import", module)

    def submit(self, ranks: Iterable[int], fn: str, *args: Any, **kwargs: Any) -> PendingCall:
        """Send ``fn(*args, **kwargs)`` to each worker in ``ranks``; do not wait.

        Raises:
            RuntimeUserError: a rank is not a joined worker.
            WorkerLostError: a rank is known to be lost.
        """
        ranks = list(ranks)
        cmd_args = tuple(args)
        with self._lock:  # atomic over the ranks (see __init__)
            self._check_ranks(ranks)
            seqs = {}
            for rank in ranks:
                seq = self._seq[rank]
                self._seq[rank] = seq + 1
                P.put(
                    self.store,
                    P.cmd_key(rank, seq),
                    P.Command(seq, fn, cmd_args, kwargs, self._abort_epoch),
                    self._secret,
                )
                seqs[rank] = seq
        return PendingCall(fn, seqs, time.monotonic())

    def wait(self, pending: PendingCall, timeout: float | None = None) -> dict[int, Any]:
        """Collect the replies of a submitted call.

        Returns:
            rank -> the value the command returned on that worker.

        Raises:
            RemoteError: the command raised on a worker (the lowest such rank).
            WorkerLostError: a worker that owes a reply died.
            WorkerTimeoutError: some workers did not answer within ``timeout``.
        """
        timeout = self.call_timeout if timeout is None else timeout
        deadline = pending.sent_at + timeout
        waiting = dict(pending.seqs)
        replies: dict[int, P.Reply] = {}
        sleep = 0.0002
        liveness = LivenessCadence(self._liveness)
        keys = {rank: P.reply_key(rank, seq) for rank, seq in waiting.items()}

        def take(rank: int) -> None:
            # A forged reply is left where it is and this rank still owes one; the
            # genuine reply replaces it when the worker writes it.
            key = keys[rank]
            try:
                replies[rank] = P.take(self.store, key, self._secret, known_bad=rejected.get(key))
            except P.UnauthenticatedMessageError as e:
                rejected[key] = e.head
                return
            del waiting[rank]

        rejected: dict[str, bytes] = {}
        while waiting:
            # One round trip asks for every reply still owed (a store check is true only
            # when all its keys exist); rank by rank only once they are all in, or when
            # the answer is no and liveness is due (who has answered matters then).
            if self.store.check([keys[r] for r in waiting]):
                for rank in list(waiting):
                    take(rank)
                if not waiting:
                    break
            now = time.monotonic()
            check = liveness.due(now)
            if check or now > deadline:
                # Replies first: a worker that answered and then died owes nothing.
                for rank in list(waiting):
                    if self.store.check([keys[rank]]):
                        take(rank)
                if not waiting:
                    break
            if check:
                lost = [r for r in waiting if r in self.check_liveness()]
                if lost:
                    raise P.WorkerLostError(
                        f"worker(s) {lost} died before answering {pending.fn!r}", tuple(lost)
                    )
            if now > deadline:
                raise P.WorkerTimeoutError(
                    f"worker(s) {sorted(waiting)} did not answer {pending.fn!r} within "
                    f"{timeout:g} s",
                    tuple(sorted(waiting)),
                )
            time.sleep(sleep)
            # Short commands (a small primitive, a stage command) answer within tens to
            # hundreds of ms (a 1 GB Split: ~0.15 s): poll finely at first, so a reply is
            # not left waiting for a long sleep (a 10 ms sleep costs 5 ms on average).
            sleep = min(sleep * 2, 0.002 if now - pending.sent_at < 0.5 else 0.01)
        return reply_values(pending.fn, replies)

    def call(
        self,
        ranks: Iterable[int],
        fn: str,
        *args: Any,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> dict[int, Any]:
        """Run the worker command ``fn`` on every worker in ``ranks`` and wait for all of them.

        Arguments:
            ranks: the workers (they run concurrently, so they may talk to each other).
            fn: a registered command name.
            timeout: seconds to wait (default: the driver's call_timeout).

        Returns:
            rank -> return value.

        Raises:
            RemoteError, WorkerLostError, WorkerTimeoutError: see :meth:`wait`
                (WorkerLostError also for a rank known to be lost).
            RuntimeUserError: a rank is not a joined worker.
        """
        return self.wait(self.submit(ranks, fn, *args, **kwargs), timeout)

    def _check_ranks(self, ranks: Sequence[int]) -> None:
        if not ranks:
            raise P.RuntimeUserError("a call needs at least one worker rank")
        unknown = [r for r in ranks if r not in self.infos]
        if unknown:
            self._poll_joined()
            unknown = [r for r in ranks if r not in self.infos]
        if unknown:
            raise P.RuntimeUserError(
                f"no joined worker with rank(s) {unknown}; joined: {sorted(self.infos)}"
            )
        lost = [r for r in ranks if r in self._lost]
        if lost:
            # Not a caller mistake: the worker died after the caller chose it (e.g. during
            # a transition), so callers that recover from a loss must see it as one.
            raise P.WorkerLostError(
                f"worker(s) {lost} are lost; they cannot run commands", tuple(lost)
            )

    # ---------------------------------------------------------------- shutdown

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every worker (politely, then by SIGKILL for local ones) and close the store."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # Workers told to exit close their connections: that is no death.
            if self._liveness is not None:
                self._liveness.expect_exit()
            live = [r for r in self.workers if r not in self._lost]
            for rank in live:
                try:
                    seq = self._seq[rank]
                    self._seq[rank] = seq + 1
                    P.put(self.store, P.cmd_key(rank, seq), P.Command(seq, "exit"), self._secret)
                except RuntimeError:
                    pass
        self.store.set(P.SHUTDOWN_KEY, b"1")
        deadline = time.monotonic() + timeout
        for proc in self._procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._liveness is not None:
            self._liveness.close()
        self.world.leave()
        try:
            # Only our own: a later job on the same port may have written its file there.
            if P.parse_secret(self.secret_file.read_text(), "") == self._secret:
                self.secret_file.unlink()
        except (OSError, P.JobSecretError):
            pass

    def __enter__(self) -> Driver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _registered_ranks(store: dist.TCPStore) -> int:
    """How many worker ranks were ever handed out (the World's registration count).

    Read with compare_set, which never blocks and never fails on a value that is
    not a count (``add`` would break the connection on one: anyone who reaches the
    store can write it).

    Raises:
        ValueError: the count was overwritten with something that is not one.
    """
    absent = b"\0absent"
    value = bytes(store.compare_set(P.WORLD_NUM_IDS_KEY, absent, absent))
    return 0 if value == absent else P.rank_of_member(int(value))


class _ForkedWorker:
    """A worker forked from the forkserver, with the slice of Popen's API the driver uses."""

    def __init__(
        self, host: str, port: int, num_threads: int, group_timeout: float, secret: bytes
    ) -> None:
        from nereus_rl.runtime.worker import WARM_MODULES

        ctx = multiprocessing.get_context("forkserver")
        # Imported once in the server; each fork then starts in milliseconds (with
        # the modules a worker warms before joining).
        ctx.set_forkserver_preload(["torch", *WARM_MODULES, "nereus_rl.runtime.worker"])
        self._proc = ctx.Process(
            target=_forked_main,
            # Through the forkserver's pipe, never a command line.
            args=(host, port, num_threads, group_timeout, secret),
            name="nereus-worker",
        )
        with worker_environ():  # the forkserver, if this starts it, gets THP too
            self._proc.start()
        self.pid = self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int | None:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired("nereus-worker", timeout or 0)
        return self._proc.exitcode

    def kill(self) -> None:
        self._proc.kill()


def _forked_main(
    host: str, port: int, num_threads: int, group_timeout: float, secret: bytes
) -> None:
    from nereus_rl.runtime.worker import serve

    serve(host, port, secret, num_threads=num_threads, group_timeout=group_timeout)
