"""Transports: batched point-to-point exchange of byte buffers between ranks.

A transport moves whole contiguous tensors (zero copy: the tensors' own
storage is sent from and received into). ``exchange`` posts every send and
every receive of one step as one batch and returns when all have finished, or
raises :class:`~nereus_comm.errors.PeerTimeoutError` naming the peers still
pending when the timeout ran out; it never hangs on a dead peer.

Several buffers to or from the same peer are matched in the order they are
listed, so sender and receiver must list them in the same order (a reshard
plan's messages do). Empty buffers are skipped on both sides.

- :class:`GlooTransport`: torch.distributed gloo (host memory), also over a
  standalone gloo group that torch.distributed does not know.
- :class:`~nereus_comm.transport_pg.ProcessGroupTransport`: any torch.distributed
  group (gloo: host memory; NCCL: device memory) through ``batch_isend_irecv``, so a
  framework's own group carries the bytes.
- :class:`~nereus_comm.transport_shm.ShmTransport`: shared-memory segments between
  ranks on one host (host memory; reshard()'s fallback for same-host peers).
- :class:`~nereus_comm.transport_cma.CmaRoute` (not a Transport: it reads the
  peers' shards in place): cross-memory attach between ranks on one host, which
  reshard() picks for same-host messages of long runs where the kernel allows it.
- :class:`NcclTransport`: grouped ``ncclSend``/``ncclRecv`` through the native
  core on torch's current CUDA stream (device memory).
"""

from __future__ import annotations

import datetime
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nereus_comm.errors import (
    PeerLostError,
    PeerTimeoutError,
    TensorMismatchError,
    TransportArgumentError,
    TransportError,
)
from nereus_comm.nccl import NCCL_IN_PROGRESS

__all__ = [
    "GLOO_CHUNK_BYTES",
    "LIVENESS_POLL_S",
    "GlooTransport",
    "Liveness",
    "NcclTransport",
    "PeerLostError",
    "PendingExchange",
    "Transport",
    "TransportArgumentError",
    "TransportStats",
    "wait_works",
]

Buffers = Sequence[tuple[int, torch.Tensor]]

#: GlooTransport splits larger buffers into chunks of this size (see its docstring).
GLOO_CHUNK_BYTES = 16 << 20

#: What an exchange asks about peers' deaths: a callable returning the global ranks
#: known dead now (e.g. from a World's heartbeats). It is called every
#: :data:`LIVENESS_POLL_S` while an exchange waits, so it must be cheap and never block.
Liveness = Callable[[], Iterable[int]]

#: Seconds between two liveness questions while an exchange waits.
LIVENESS_POLL_S = 0.05


def dead_among(liveness: Liveness | None, ranks: Iterable[int]) -> frozenset[int]:
    """The ranks of ``ranks`` that ``liveness`` reports dead (none without liveness)."""
    if liveness is None:
        return frozenset()
    return frozenset(int(r) for r in liveness()) & frozenset(ranks)


def await_lost(liveness: Liveness | None, ranks: Iterable[int], deadline: float) -> frozenset[int]:
    """The ranks of ``ranks`` liveness reports dead, asking until one is or ``deadline``.

    For a failure that says a peer is gone before liveness does (a closed
    connection): the error should name the dead rank, which liveness learns within
    its own bound. Without liveness: none, at once.
    """
    ranks = frozenset(ranks)
    while liveness is not None:
        lost = dead_among(liveness, ranks)
        if lost or time.monotonic() >= deadline:
            return lost
        time.sleep(LIVENESS_POLL_S)
    return frozenset()


def lost_error(rank: int, lost: Iterable[int], waited_on: Iterable[int], how: str) -> PeerLostError:
    """The PeerLostError of ``rank`` for dead ``lost`` while it waited on ``waited_on``."""
    lost = sorted(lost)
    waited = sorted(set(waited_on))
    also = sorted(set(waited) - set(lost))
    tail = (
        f"; it also waited on live peers {_peer_list(also)}, which may be waiting on the dead"
        if also
        else ""
    )
    return PeerLostError(
        f"rank {rank}: rank{'s' if len(lost) > 1 else ''} {_peer_list(lost)} died during the "
        f"exchange ({how}){tail}. Form a new group without "
        f"{'them' if len(lost) > 1 else 'it'}.",
        lost,
    )


@dataclass
class TransportStats:
    """Counters over the life of a transport (non-empty buffers only)."""

    exchanges: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0


def _peer_list(peers: Sequence[int]) -> str:
    return ", ".join(str(p) for p in sorted(set(peers)))


class Transport(ABC):
    """Batched send/recv of contiguous tensors between global ranks.

    Subclasses implement :meth:`_post` and :meth:`_wait`; :meth:`start` validates the
    arguments before anything is posted and keeps :attr:`stats`.
    """

    #: this process's global rank.
    rank: int
    #: global ranks this transport can reach (including itself).
    ranks: tuple[int, ...]
    #: the device type whose memory it moves ("cpu" or "cuda").
    device_type: str

    def __init__(self) -> None:
        self.stats = TransportStats()
        self._broken: str | None = None

    def exchange(
        self,
        sends: Buffers,
        recvs: Buffers,
        *,
        timeout: float,
        liveness: Liveness | None = None,
    ) -> None:
        """Send and receive all buffers as one batch and wait until all are done.

        The same as ``start(sends, recvs, timeout=timeout, liveness=liveness).wait()``.

        Arguments:
            sends: ``(peer, tensor)`` per outgoing buffer (global ranks).
            recvs: ``(peer, tensor)`` per incoming buffer, written in place.
            timeout: seconds to wait for the whole batch.
            liveness: asked every :data:`LIVENESS_POLL_S` while waiting (see
                :data:`Liveness`): once a rank of this transport's group is reported
                dead, the wait ends with PeerLostError. Any rank of the group, not only
                this batch's peers: a live peer may be waiting on the dead one, so the
                group as a whole is broken. None: wait until done or ``timeout``.

        Raises:
            TransportArgumentError: a peer is not reachable, is this rank, or the
                transport broke earlier (a peer timed out); raised before posting.
            TensorMismatchError: a tensor is not contiguous or on the wrong device.
            PeerLostError: ``liveness`` reported a rank of the group dead; names it.
            PeerTimeoutError: some transfers had not finished after ``timeout``
                seconds; the message names those peers (those also known dead, when
                liveness knows some, as PeerLostError). The transport is then broken
                (the connection to a silent peer is closed): build a new one.
        """
        self.start(sends, recvs, timeout=timeout, liveness=liveness).wait()

    def start(
        self,
        sends: Buffers,
        recvs: Buffers,
        *,
        timeout: float,
        liveness: Liveness | None = None,
    ) -> PendingExchange:
        """Post the batch and return at once; ``.wait()`` on the result completes it.

        Lets a caller overlap its own work (e.g. local copies) with the transfers.
        The buffers must stay untouched until ``wait`` returns. Arguments and errors
        as :meth:`exchange` (PeerTimeoutError comes from ``wait``); the timeout counts
        from this call.
        """
        if self._broken is not None:
            raise TransportArgumentError(
                f"this transport broke earlier ({self._broken}); create a new one "
                "(e.g. over the next generation of the World's process group)"
            )
        if timeout <= 0:
            raise TransportArgumentError(f"timeout must be > 0 seconds, got {timeout}")
        sends = self._checked(sends, "send")
        recvs = self._checked(recvs, "recv")
        started = time.perf_counter()
        state = self._post(sends, recvs, timeout, liveness)
        return PendingExchange(self, state, sends, recvs, started)

    def _checked(self, buffers: Buffers, kind: str) -> list[tuple[int, torch.Tensor]]:
        out = []
        reachable = set(self.ranks)
        for i, (peer, t) in enumerate(buffers):
            if peer not in reachable:
                raise TransportArgumentError(
                    f"{kind} #{i}: peer {peer} is not among this transport's ranks "
                    f"{list(self.ranks)}; use a transport over a group that holds it"
                )
            if peer == self.rank:
                raise TransportArgumentError(
                    f"{kind} #{i}: peer {peer} is this rank; copy locally instead"
                )
            if not isinstance(t, torch.Tensor):
                raise TensorMismatchError(f"{kind} #{i} to/from {peer}: expected a tensor")
            if not t.is_contiguous():
                raise TensorMismatchError(
                    f"{kind} #{i} to/from {peer}: tensor of shape {tuple(t.shape)} is not "
                    "contiguous; pack it into a buffer first"
                )
            if t.device.type != self.device_type:
                raise TensorMismatchError(
                    f"{kind} #{i} to/from {peer}: tensor is on {t.device}, this transport "
                    f"moves {self.device_type} memory"
                )
            if t.nbytes:
                out.append((peer, t))
        return out

    def _break(self, reason: str) -> None:
        self._broken = reason

    @abstractmethod
    def _post(
        self,
        sends: list[tuple[int, torch.Tensor]],
        recvs: list[tuple[int, torch.Tensor]],
        timeout: float,
        liveness: Liveness | None,
    ) -> object:
        """Post the validated, non-empty batch; return what ``_wait`` needs (liveness too)."""

    @abstractmethod
    def _wait(self, state: object) -> None:
        """Complete a posted batch or raise PeerTimeoutError (see :meth:`exchange`)."""

    def close(self) -> None:  # noqa: B027  (optional hook: most transports own nothing)
        """Release what the transport owns (communicators); the transport is unusable after."""

    def connection_key(self) -> object:
        """An object that lives as long as this transport's connections.

        Transports over the same connections share it (default: the transport
        itself), so state bound to the connections (e.g. shared-memory segments)
        can be cached by it, weakly, across transport objects.
        """
        return self


class PendingExchange:
    """A posted batch of a transport; :meth:`wait` completes it (once)."""

    def __init__(self, transport: Transport, state: object, sends, recvs, started: float) -> None:
        self._transport = transport
        self._state = state
        self._sends, self._recvs = sends, recvs
        self._started = started
        self._done = False

    def wait(self) -> None:
        """Wait until every transfer finished.

        Raises:
            PeerTimeoutError: transfers still pending at the timeout; names the peers.
        """
        if self._done:
            return
        self._transport._wait(self._state)
        self._done = True
        s = self._transport.stats
        s.exchanges += 1
        s.messages_sent += len(self._sends)
        s.messages_received += len(self._recvs)
        s.bytes_sent += sum(t.nbytes for _, t in self._sends)
        s.bytes_received += sum(t.nbytes for _, t in self._recvs)
        s.seconds += time.perf_counter() - self._started


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    # A flat uint8 view of the same storage: transports move bytes, whatever the dtype.
    return t.reshape(-1).view(torch.uint8)


def _chunks(t: torch.Tensor, chunk_bytes: int) -> list[torch.Tensor]:
    flat = _as_bytes(t)
    return [flat[i : i + chunk_bytes] for i in range(0, flat.numel(), chunk_bytes)]


def _wait_each(pending, deadline: float, stop=None) -> dict[tuple[str, int], str]:
    failed: dict[tuple[str, int], str] = {}
    for what, peer, work in pending:
        if stop is not None and stop.is_set():
            break
        # Work.is_completed() also reports True for timed-out work, so the
        # outcome of each wait is the only truth about what is still pending.
        left = max(deadline - time.monotonic(), 0.001)
        try:
            work.wait(datetime.timedelta(seconds=left))
        except RuntimeError as e:
            failed.setdefault((what, peer), str(e).splitlines()[-1])
    return failed


def _wait_watching(
    transport: Transport, pending, deadline: float, liveness: Liveness, started: float
) -> dict[tuple[str, int], str]:
    """_wait_each on a helper thread while this one asks liveness.

    A gloo Work has no abort and no non-blocking completion test from Python
    (is_completed() turns true only once a wait returned), and a wait that times
    out closes every pair of the group. So one thread makes the usual blocking
    waits, this one polls liveness; on a death it makes a 1 ms wait time out, which
    closes the group's pairs and ends the helper's wait at once. (Should a wait
    outlive that, the daemon helper ends by the deadline; its Work objects keep
    their buffers alive until then.)
    """
    result: dict[tuple[str, int], str] = {}
    done, stop = threading.Event(), threading.Event()

    def run() -> None:
        try:
            result.update(_wait_each(pending, deadline, stop))
        finally:
            done.set()

    threading.Thread(target=run, name="nereus-gloo-wait", daemon=True).start()
    while not done.wait(LIVENESS_POLL_S):
        lost = dead_among(liveness, transport.ranks)
        if not lost:
            continue
        stop.set()
        for _, _, work in reversed(pending):
            if done.is_set():
                break
            try:
                work.wait(datetime.timedelta(milliseconds=1))
            except RuntimeError:
                break
        done.wait(0.2)  # the helper's wait usually ends at once; never wait long
        transport._break(f"ranks {_peer_list(lost)} died")
        waited = {p for _, p, _ in pending}
        how = f"known from liveness after {time.perf_counter() - started:.2f} s"
        raise lost_error(transport.rank, lost, waited, how)
    return result


def wait_works(
    transport: Transport,
    pending: Sequence[tuple[str, int, dist.Work]],
    deadline: float,
    timeout: float,
    liveness: Liveness | None,
    *,
    backend: str = "gloo",
) -> None:
    """Complete posted torch.distributed Works whose ``wait`` blocks (gloo's), for ``transport``.

    The waiting half of :class:`GlooTransport`, shared with
    :class:`~nereus_comm.transport_pg.ProcessGroupTransport` over gloo.

    Arguments:
        transport: the transport that posted them (its rank and ranks; marked broken
            on a failure).
        pending: ``(what, peer, work)`` per posted op, ``what`` being "recv from" or
            "send to" (for the error message), ``peer`` a global rank.
        deadline: ``time.monotonic()`` by which all must be done.
        timeout: the exchange's timeout (for the message).
        liveness: asked while waiting (see :meth:`Transport.exchange`).
        backend: the backend's name, for the message.

    Raises:
        PeerLostError: liveness reported a rank of ``transport.ranks`` dead.
        PeerTimeoutError: works still pending at ``deadline``; names their peers.
    """
    if liveness is None:
        failed = _wait_each(pending, deadline)
    else:
        failed = _wait_watching(transport, pending, deadline, liveness, time.perf_counter())
    if failed:
        peers = [p for _, p in failed]
        transport._break(f"peers {_peer_list(peers)} timed out")
        # A closed connection fails at once, maybe before liveness knows; and the
        # dead are the ones to name, not the live ones they held up.
        lost = await_lost(liveness, transport.ranks, deadline)
        if lost:
            raise lost_error(transport.rank, lost, peers, "its transfers failed")
        detail = "; ".join(f"{w} {p}" for w, p in failed)
        first = next(iter(failed.values()))
        raise PeerTimeoutError(
            f"rank {transport.rank}: peers {_peer_list(peers)} did not complete within "
            f"{timeout:g} s (pending: {detail}; {backend}: {first}). The peer may have "
            "died; form a new group without it."
        )


class GlooTransport(Transport):
    """Exchange over a torch.distributed gloo process group (host memory).

    Two kinds of group:

    - the default group or a subgroup of it (``dist.new_group``): give only
      ``group`` (or nothing); ranks come from torch.distributed.
    - a standalone group that is no part of a default group, e.g.
      ``dist.ProcessGroupGloo(store, group_rank, size)`` as the EMU runtime
      builds by id: give ``group``, ``ranks`` and ``rank``. torch.distributed
      need not be initialized then.

    :class:`~nereus_comm.transport_pg.ProcessGroupTransport` is the general form
    for any group torch.distributed knows (NCCL too); over gloo both post the same
    ops and wait the same way (:func:`wait_works`). This one stays for standalone
    groups, which ``batch_isend_irecv`` cannot address.

    Arguments:
        group: the gloo group (default: the default process group). Peers are
            global ranks, as everywhere in nereus_comm.
        ranks: standalone group only: the global rank of each group rank (group
            rank i is ``ranks[i]``).
        rank: standalone group only: this process's global rank.
        chunk_bytes: buffers larger than this travel as consecutive chunks of this
            size (both sides split the same way, since their sizes match). Each gloo
            op costs ~25-40 us of CPU: 128 MiB between two ranks cost 97-108 ms CPU as
            one message, 102-108 ms as 16 and 119-145 ms as 256 (bench_reshard.md),
            so chunks are large; bounded, they still let early chunks land while a
            huge buffer is in flight.

    Raises:
        TransportArgumentError: ``chunk_bytes`` < 1; only one of ``ranks`` and
            ``rank`` given, or them without a group; ``ranks`` with duplicates or
            without ``rank``, or not matching the group's size and this process's
            group rank; torch.distributed not initialized (default-group kind).
    """

    device_type = "cpu"

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        ranks: Sequence[int] | None = None,
        rank: int | None = None,
        *,
        chunk_bytes: int = GLOO_CHUNK_BYTES,
    ) -> None:
        super().__init__()
        if chunk_bytes < 1:
            raise TransportArgumentError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self.group = group
        # global rank -> group rank; None: torch.distributed maps ranks (default group).
        self._index: dict[int, int] | None = None
        if ranks is not None or rank is not None:
            self._init_standalone(group, ranks, rank)
            return
        if not dist.is_initialized():
            raise TransportArgumentError(
                "torch.distributed is not initialized; call init_process_group('gloo', ...) "
                "(or join a nereus_comm World) first, or pass ranks= and rank= for a "
                "standalone group"
            )
        self.rank = dist.get_rank()
        self.ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
        if self.rank not in self.ranks:
            raise TransportArgumentError(f"rank {self.rank} is not in the group {self.ranks}")

    def _init_standalone(self, group, ranks, rank) -> None:
        if group is None or ranks is None or rank is None:
            raise TransportArgumentError(
                "a standalone group needs all of group, ranks and rank (got "
                f"group={'set' if group is not None else None}, ranks={ranks}, rank={rank}); "
                "give only group (or nothing) for the default group or a subgroup of it"
            )
        self.ranks = tuple(int(r) for r in ranks)
        self.rank = int(rank)
        if len(set(self.ranks)) != len(self.ranks):
            raise TransportArgumentError(f"ranks {list(self.ranks)} has duplicates")
        if self.rank not in self.ranks:
            raise TransportArgumentError(f"rank {self.rank} is not in ranks {list(self.ranks)}")
        if group.size() != len(self.ranks):
            raise TransportArgumentError(
                f"the group has {group.size()} ranks but ranks lists {len(self.ranks)}: "
                "give the global rank of every group rank, in group-rank order"
            )
        self._index = {r: i for i, r in enumerate(self.ranks)}
        if group.rank() != self._index[self.rank]:
            raise TransportArgumentError(
                f"this process is group rank {group.rank()}, but ranks puts global rank "
                f"{self.rank} at group rank {self._index[self.rank]}; list ranks in "
                "group-rank order"
            )

    def __repr__(self) -> str:
        return f"GlooTransport(rank={self.rank}, ranks={list(self.ranks)})"

    def connection_key(self) -> object:
        """The process group: transports built per call over one group share it."""
        return self.group if self.group is not None else dist.group.WORLD

    def _post_one(self, kind: str, peer: int, chunk: torch.Tensor) -> dist.Work:
        if self._index is None:
            op = dist.irecv if kind == "recv from" else dist.isend
            return op(chunk, peer, self.group)
        # A standalone group is addressed by group rank (tag 0, as dist.isend uses).
        op = self.group.recv if kind == "recv from" else self.group.send
        return op([chunk], self._index[peer], 0)

    def _post(self, sends, recvs, timeout, liveness):
        deadline = time.monotonic() + timeout
        pending: list[tuple[str, int, dist.Work]] = []
        try:
            # Receives first, so that data arriving early lands in place.
            for kind, buffers in (("recv from", recvs), ("send to", sends)):
                for peer, t in buffers:
                    for chunk in _chunks(t, self.chunk_bytes):
                        pending.append((kind, peer, self._post_one(kind, peer, chunk)))
        except RuntimeError as e:  # a pair closed earlier: the peer is gone
            self._break(f"posting failed: {e}")
            lost = await_lost(liveness, self.ranks, deadline)
            if lost:
                waited = {p for p, _ in (*sends, *recvs)}
                raise lost_error(self.rank, lost, waited, "a connection closed") from e
            raise PeerTimeoutError(
                f"could not post transfers (a peer's connection is closed): {e}"
            ) from e
        return pending, deadline, timeout, liveness

    def _wait(self, state) -> None:
        wait_works(self, *state)


class NcclTransport(Transport):
    """Grouped ncclSend/ncclRecv over one NCCL communicator (device memory).

    Every rank of ``ranks`` constructs the transport together: the first rank
    generates the unique id and publishes it in ``store``; all then create the
    communicator. Transfers are enqueued on torch's current CUDA stream; the
    exchange waits (polling an event) until they finish or the timeout runs
    out, then aborts the communicator and raises PeerTimeoutError.

    Arguments:
        store: a torch.distributed Store all ranks share.
        rank: this process's global rank.
        ranks: the global ranks of the communicator, in communicator order.
        device: this process's CUDA device (index or torch.device).
        key: store key prefix; must be unique per communicator created through
            ``store`` (default: derived from ``ranks``, so pass one when the same
            ranks build a second communicator over the same store).
        lib: the NCCL library (default: :func:`nereus_comm.nccl.load_nccl`).
        comm: an existing communicator to wrap instead of creating one (e.g. from
            the communicator pool); the transport then does not destroy it.
        init_timeout: seconds to wait for the unique id in the store.

    Raises:
        NcclNotFoundError: NCCL could not be loaded.
        TransportArgumentError: rank not in ranks, or CUDA unavailable.
        NcclError: communicator creation failed.
    """

    device_type = "cuda"

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        ranks: Sequence[int],
        device: int | torch.device,
        *,
        key: str | None = None,
        lib=None,
        comm: int | None = None,
        init_timeout: float = 300.0,
    ) -> None:
        super().__init__()
        from nereus_comm.nccl import load_nccl  # here: no NCCL is needed for gloo

        if not torch.cuda.is_available():
            raise TransportArgumentError("NcclTransport needs a CUDA device; use GlooTransport")
        self.ranks = tuple(int(r) for r in ranks)
        if rank not in self.ranks:
            raise TransportArgumentError(f"rank {rank} is not in ranks {list(self.ranks)}")
        self.rank = rank
        self.device = torch.device("cuda", device) if isinstance(device, int) else device
        self._index = {r: i for i, r in enumerate(self.ranks)}
        self.lib = lib or load_nccl()
        self._owns_comm = comm is None
        if comm is None:
            torch.cuda.set_device(self.device)
            if key is None:
                key = "nereus/nccl_transport/" + "-".join(map(str, self.ranks))
            uid_key = f"{key}/unique_id"
            if self._index[rank] == 0:
                store.set(uid_key, self.lib.get_unique_id())
            store.wait([uid_key], datetime.timedelta(seconds=init_timeout))
            uid = bytes(store.get(uid_key))
            comm = self.lib.comm_init_rank(len(self.ranks), uid, self._index[rank])
        self.comm = comm

    def __repr__(self) -> str:
        return f"NcclTransport(rank={self.rank}, ranks={list(self.ranks)}, device={self.device})"

    def _post(self, sends, recvs, timeout, liveness):
        for peer, t in (*sends, *recvs):
            if t.device != self.device:
                raise TensorMismatchError(
                    f"tensor for peer {peer} is on {t.device}, this transport uses {self.device}"
                )
        stream = torch.cuda.current_stream(self.device)
        ops_s = [(self._index[p], t.data_ptr(), t.nbytes) for p, t in sends]
        ops_r = [(self._index[p], t.data_ptr(), t.nbytes) for p, t in recvs]
        peers = [p for p, _ in (*sends, *recvs)]
        deadline = time.monotonic() + timeout
        # ncclGroupEnd may block while it connects to peers; a watchdog aborts the
        # communicator if that outlasts the timeout, which makes the call return.
        fired = threading.Event()

        def _abort() -> None:
            fired.set()
            self.lib.comm_abort(self.comm)

        watchdog = threading.Timer(timeout, _abort)
        watchdog.start()
        try:
            self.lib.group_send_recv(self.comm, ops_s, ops_r, stream.cuda_stream)
        except TransportError as e:
            watchdog.cancel()
            if fired.is_set():
                self._break("aborted by the watchdog")
                self.comm = 0
                raise PeerTimeoutError(
                    f"rank {self.rank}: NCCL group with peers {_peer_list(peers)} did not "
                    f"start within {timeout:g} s: {e}"
                ) from e
            raise
        watchdog.cancel()
        if fired.is_set():
            self._break("aborted by the watchdog")
            self.comm = 0
            raise PeerTimeoutError(
                f"rank {self.rank}: peers {_peer_list(peers)} did not connect within {timeout:g} s"
            )
        done = torch.cuda.Event()
        done.record(stream)
        return done, deadline, peers, timeout, liveness

    def _wait(self, state) -> None:
        done, deadline, peers, timeout, liveness = state
        next_check = time.monotonic() + LIVENESS_POLL_S
        while not done.query():
            if liveness is not None and time.monotonic() > next_check:
                next_check = time.monotonic() + LIVENESS_POLL_S
                lost = dead_among(liveness, self.ranks)
                if lost:
                    self.abort()
                    raise lost_error(self.rank, lost, peers, "known from liveness")
            code = self.lib.comm_get_async_error(self.comm)
            if code not in (0, NCCL_IN_PROGRESS):
                self.abort()
                raise TransportError(
                    f"rank {self.rank}: NCCL reported {self.lib.error_string(code)} during an "
                    f"exchange with peers {_peer_list(peers)}"
                )
            if time.monotonic() > deadline:
                self.abort()
                raise PeerTimeoutError(
                    f"rank {self.rank}: transfers with peers {_peer_list(peers)} did not finish "
                    f"within {timeout:g} s; the communicator was aborted"
                )
            time.sleep(0.0002)

    def abort(self) -> None:
        """Abort the communicator (if this transport created it) without waiting on peers.

        For a group that lost a member: ``close`` (ncclCommDestroy) may wait on work
        a dead peer never finishes, ncclCommAbort does not. The transport is unusable
        after.
        """
        self._break("communicator aborted")
        if self._owns_comm and self.comm:
            self.lib.comm_abort(self.comm)
            self.comm = 0

    def close(self) -> None:
        """Destroy the communicator (if this transport created it)."""
        if self._owns_comm and self.comm and self._broken is None:
            self.lib.comm_destroy(self.comm)
        self.comm = 0
        self._break("closed")
