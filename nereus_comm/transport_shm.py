"""ShmTransport: shared-memory exchange between ranks on the same host.

Why
    Between two processes on one host gloo moves every byte through TCP loopback:
    the kernel copies it into a socket buffer and out again, slice by slice, with
    system calls, and reshard() adds a pack and an unpack copy for strided pieces on
    top. On a small host those copies fight over the same cores. As NCCL does with
    its SHM transport inside a node, the sender here writes a message straight into
    a shared-memory segment that the receiver maps: reshard() packs into the segment
    (the pack is the send) and unpacks out of it, so every byte is copied exactly
    twice, strided or not, and no system call runs per transfer.

Protocol
    Setup (over a control transport, e.g. the GlooTransport reshard was given; per
    peer pair, only when needed):

    1. host round, once per pair: both swap a 128-byte record holding a digest of
       their host identity (hostname, boot id, the /dev/shm file system and the
       network namespace, or the NEREUS_SHM_HOST environment variable when set; see
       :func:`host_identity`). Equal digests: same host.
    2. segment round, when a direction between same-host ranks needs more bytes than
       it ever asked for: the sender creates a /dev/shm file of that size
       (fallocate, so a full /dev/shm is an answer now, not a SIGBUS later), maps it
       and sends its name; the receiver maps it and unlinks the name at once, so no
       file is left behind however the processes end. Both sides know from the sizes
       alone whether a round is due, so a repeated exchange spends no round at all.

    A segment belongs to (control group, peer, direction) and serves every later
    exchange that fits, of any plan. Its header holds two counters, each in its own
    cache line: ``ready`` (written by the sender) and ``done`` (by the receiver).
    Exchange k: the sender waits until done == k - 1 (the receiver drained exchange
    k - 1), writes the message and sets ready = k; the receiver waits until
    ready == k, reads the message and sets done = k. A sender never waits on
    anything of exchange k, so no order of sends and receives among ranks can
    deadlock. Every wait polls its counter (yielding, then sleeping up to 1 ms)
    until the exchange's deadline and then raises PeerTimeoutError naming the peer:
    a dead peer never hangs the caller.

Limits
    Linux with /dev/shm, host memory only (CUDA tensors stay on NcclTransport). A
    segment holds a whole message, so each same-host direction keeps its largest
    message's bytes in /dev/shm until :meth:`ShmTransport.close` (or garbage
    collection, or exit). Publication relies on x86-64 store order (the copy threads
    are joined and a lock round trip is a full barrier before the counter store);
    other architectures are untested.

Dead peers
    Given ``liveness`` (see :data:`nereus_comm.transport.Liveness`), every wait asks
    it every LIVENESS_POLL_S and ends with PeerLostError naming the dead rank as soon
    as a rank of the group is dead (a live peer may be stuck on the dead one). A
    segment's file name carries its creator's pid namespace and pid
    (``nereus-shm-<pidns>-<pid>-r<rank>to<peer>-<random>``), and every setup record
    the sender's pid: the survivor that learns of a death removes the dead peer's
    files, and each segment round and close() removes any file of this pid namespace
    whose creator is gone, so a process killed between creating a segment and its
    peer mapping it leaves nothing behind for long.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping

import torch

from nereus_comm.errors import PeerTimeoutError, TransportArgumentError, TransportError
from nereus_comm.transport import (
    LIVENESS_POLL_S,
    Liveness,
    PeerLostError,
    Transport,
    dead_among,
    lost_error,
)

__all__ = ["HOST_ENV", "SHM_DIR", "ShmTransport", "host_identity"]

#: Where segments live (a tmpfs on Linux).
SHM_DIR = "/dev/shm"
#: Set to any string to override the host identity (processes with different
#: values never share memory; e.g. to keep a process on gloo, or in tests).
HOST_ENV = "NEREUS_SHM_HOST"
#: Segment file names start with this, then the creator's pid namespace and pid.
NAME_PREFIX = "nereus-shm-"

_HEADER = 128  # ready counter at byte 0, done counter at byte 64: separate cache lines
_READY, _DONE = 0, 8  # their indices in the header as int64
_RECORD = 192  # setup record: magic, host digest, size, pid namespace, pid, segment name
_MAGIC = b"NRSHM002"
_NO_HOST = bytes(32)
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


#: This process's pid namespace: pids in segment names are only compared within it.
_PIDNS = _pid_namespace()


#: Every ShmTransport of this process (for :func:`peers_lost`).
_LIVE: weakref.WeakSet = weakref.WeakSet()


def owner_prefix(pid: int, pidns: int = _PIDNS) -> str:
    """The file-name prefix of every segment created by process ``pid``."""
    return f"{NAME_PREFIX}{pidns}-{pid}-"


def _owner(name: str) -> tuple[int, int] | None:
    """(pid namespace, pid) of a segment file's creator, from its name."""
    parts = name[len(NAME_PREFIX) :].split("-")
    if not name.startswith(NAME_PREFIX) or len(parts) < 3:
        return None
    try:
        return int(parts[0]), int(parts[1])
    except ValueError:
        return None


def _process_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return state in ("Z", "X")  # a killed child its parent has not reaped yet


def remove_segments(prefix: str) -> list[str]:
    """Unlink every file in SHM_DIR whose name starts with ``prefix``; their names."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if name.startswith(prefix):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except OSError:
                pass
    return removed


def sweep_orphans() -> list[str]:
    """Unlink the segment files of this pid namespace whose creator is gone; their names.

    A file lives in SHM_DIR only between its creation and its peer mapping it, so a
    file whose creator died is an orphan no one will map. Without /proc (no pid
    namespace known) nothing is removed: no process could be told dead.
    """
    removed: list[str] = []
    if not _PIDNS:
        return removed
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        owner = _owner(name)
        if owner is not None and owner[0] == _PIDNS and _process_gone(owner[1]):
            removed += remove_segments(name)
    return removed


def _net_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/net")
    except OSError:
        return ""


def host_identity() -> str | None:
    """This process's host as shared memory sees it, or None without /dev/shm.

    Hostname, boot id, the /dev/shm file system and the network namespace, or the
    NEREUS_SHM_HOST environment variable when set. Processes in different network
    namespaces count as different hosts even where they share a kernel, hostname
    and /dev/shm (``ip netns exec`` changes none of those): they reach each other
    over a network address, as processes on two machines do, so their bytes go
    through the transport (no shared memory, no cross-memory attach). That is how
    two namespaces joined by a veth pair stand in for two hosts in the tests.
    """
    override = os.environ.get(HOST_ENV)
    if override:
        return override
    if not os.path.isdir(SHM_DIR):
        return None
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    st = os.stat(SHM_DIR)  # containers with their own /dev/shm differ here
    return f"{socket.gethostname()}|{boot}|{st.st_dev}:{st.st_ino}|{_net_namespace()}"


class _Segment:
    """One mapped /dev/shm file: a header of two counters and the message bytes."""

    def __init__(self, name: str, nbytes: int, *, create: bool) -> None:
        self.name, self.nbytes = name, nbytes
        self.path = os.path.join(SHM_DIR, name)
        self.pid = os.getpid()
        size = _HEADER + nbytes
        fd = os.open(self.path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError:
                    os.unlink(self.path)
                    raise
            elif os.fstat(fd).st_size < size:
                raise TransportError(
                    f"shared-memory segment {name} holds {os.fstat(fd).st_size} bytes, "
                    f"expected {size}: the peer computed another plan"
                )
            self._mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
        finally:
            os.close(fd)
        self.linked = create
        self._view = memoryview(self._mm)
        self.counters = self._view[:_HEADER].cast("q")
        self.data = torch.frombuffer(self._mm, dtype=torch.uint8, offset=_HEADER, count=nbytes)
        self.seq = 0  # exchanges completed through this segment

    def unlink(self) -> None:
        if self.linked and self.pid == os.getpid():  # not in a forked child
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        self.linked = False

    def close(self) -> None:
        self.unlink()
        self.data = None
        self.counters.release()
        self._view.release()
        try:
            self._mm.close()
        except BufferError:  # a view of the data is still alive: the GC unmaps it later
            pass


def _close_all(*segment_maps: dict[int, _Segment]) -> None:
    for segments in segment_maps:
        for seg in segments.values():
            seg.close()
        segments.clear()


def _release(*segment_maps: dict[int, _Segment]) -> None:
    """A ShmTransport's end (close, garbage collection, exit): its segments, and orphans."""
    _close_all(*segment_maps)
    sweep_orphans()


def _record(host: bytes, nbytes: int = 0, name: str = "") -> torch.Tensor:
    raw = (
        _MAGIC
        + host
        + nbytes.to_bytes(8, "little")
        + _PIDNS.to_bytes(8, "little")
        + os.getpid().to_bytes(8, "little")
        + name.encode()
    )
    assert len(raw) <= _RECORD, "a segment name too long for the setup record"
    return torch.frombuffer(bytearray(raw.ljust(_RECORD, b"\0")), dtype=torch.uint8)


def _parse(rec: torch.Tensor, peer: int) -> tuple[bytes, int, str, tuple[int, int]]:
    """(host digest, bytes, segment name, (pid namespace, pid)) of a peer's record."""
    raw = bytes(rec.numpy())
    if raw[:8] != _MAGIC:
        raise TransportError(f"peer {peer} sent no shared-memory setup record: different code?")
    owner = (int.from_bytes(raw[48:56], "little"), int.from_bytes(raw[56:64], "little"))
    return raw[8:40], int.from_bytes(raw[40:48], "little"), raw[64:].rstrip(b"\0").decode(), owner


def peers_lost(ranks: Iterable[int]) -> None:
    """Ranks died, learnt outside the shared-memory waits (a plan check, another route):
    every ShmTransport of this process whose group holds one of them is broken (as its
    group is), unmaps its segments, unlinks the files it created (a peer that died before
    mapping one never will) and removes the files the dead left behind."""
    dead = set(ranks)
    for shm in list(_LIVE):
        lost = dead & set(shm.ranks)
        if lost:
            shm._break(f"ranks {sorted(lost)} died")
            shm._lost(lost)


class ShmTransport(Transport):
    """Exchange through /dev/shm segments with peers on this host (see the module doc).

    One per control group and process: :func:`nereus_comm.reshard.reshard` keeps one
    per gloo group. Setup rounds run over ``control``, collectively with the peers
    of each exchange. Besides the Transport interface (which copies buffers in and
    out of the segments, so sends complete in ``start``), :meth:`prepare`,
    :meth:`send` and :meth:`receive` let a caller pack into and unpack out of the
    segments itself.

    Arguments:
        control: a host-memory transport over the same ranks, for the setup records
            (held weakly: keep it, or pass one to each :meth:`prepare`).

    Raises:
        TransportArgumentError: ``control`` does not move host memory.
    """

    device_type = "cpu"

    def __init__(self, control: Transport) -> None:
        super().__init__()
        if control.device_type != "cpu":
            raise TransportArgumentError(
                f"the control transport must move host memory, {control!r} moves "
                f"{control.device_type}; use a GlooTransport"
            )
        # Weakly: reshard keys its ShmTransport by the control's process group, and a
        # strong reference would keep that group (and these segments) alive forever.
        self._control = weakref.ref(control)
        self.rank, self.ranks = control.rank, control.ranks
        ident = host_identity()
        self.host = hashlib.sha256(ident.encode()).digest() if ident else _NO_HOST
        self._hosts: dict[int, bytes] = {}  # peer -> its host digest
        self._owners: dict[int, tuple[int, int]] = {}  # peer -> (its pid namespace, pid)
        self._out: dict[int, _Segment] = {}  # peer -> the segment this rank writes
        self._in: dict[int, _Segment] = {}  # peer -> the segment this rank reads
        # Largest size each direction ever asked for (both sides keep the same numbers,
        # so both know when a segment round is due).
        self._asked_out: dict[int, int] = {}
        self._asked_in: dict[int, int] = {}
        self.setup_rounds = 0
        self.setup_bytes = 0  # sent through the control transport for setup
        self._barrier = threading.Lock()
        self._finalizer = weakref.finalize(self, _release, self._out, self._in)
        _LIVE.add(self)

    def __repr__(self) -> str:
        return (
            f"ShmTransport(rank={self.rank}, writes to {sorted(self._out)}, "
            f"reads from {sorted(self._in)})"
        )

    def same_host(self, peer: int) -> bool | None:
        """Whether peer shares this host's memory (None: not asked yet)."""
        h = self._hosts.get(peer)
        return None if h is None else (h == self.host and h != _NO_HOST)

    # -- setup -------------------------------------------------------------------

    def _swap(
        self,
        records: dict[int, torch.Tensor],
        control: Transport,
        timeout: float,
        liveness: Liveness | None,
    ):
        peers = sorted(records)
        got = {p: torch.empty(_RECORD, dtype=torch.uint8) for p in peers}
        try:
            control.exchange(
                [(p, records[p]) for p in peers],
                list(got.items()),
                timeout=timeout,
                liveness=liveness,
            )
        except BaseException as e:
            # The peers may have seen a different round: this state is no longer shared.
            self._break(f"a setup round with peers {peers} failed")
            if isinstance(e, PeerLostError):
                self._lost(e.ranks)
            else:  # a peer that died in its segment round may have left its new file
                sweep_orphans()
            raise
        self.setup_rounds += 1
        self.setup_bytes += _RECORD * len(peers)
        out = {p: _parse(got[p], p) for p in peers}
        self._owners.update({p: rec[3] for p, rec in out.items()})
        return out

    def _lost(self, ranks) -> None:
        """Ranks died: unmap every segment and remove the files the dead left behind."""
        _close_all(self._out, self._in)
        for r in ranks:
            owner = self._owners.get(r)
            if owner is not None:
                remove_segments(owner_prefix(owner[1], owner[0]))
        sweep_orphans()

    def prepare(
        self,
        send_bytes: Mapping[int, int],
        recv_bytes: Mapping[int, int],
        *,
        timeout: float,
        require: bool = False,
        control: Transport | None = None,
        liveness: Liveness | None = None,
    ) -> tuple[frozenset[int], frozenset[int]]:
        """Make segments for the coming exchanges (collective with the peers named).

        Every peer named must call prepare in the same exchange, with the mirror
        sizes (its ``send_bytes[me]`` is my ``recv_bytes[peer]``).

        Arguments:
            send_bytes / recv_bytes: bytes per message to / from each peer.
            timeout: seconds for the setup rounds.
            require: raise unless every direction can go through shared memory.
            control: the transport for setup records (default: the constructor's).
            liveness: ends a setup round early when a rank dies (see the module doc).

        Returns:
            (peers to send to, peers to receive from) through shared memory; the
            others must use another transport.

        Raises:
            TransportArgumentError: broken earlier; or ``require`` and a peer is on
                another host or /dev/shm has no room (after the setup rounds, before
                any data moves).
            PeerTimeoutError: a peer did not take part in a setup round in time.
            PeerLostError: ``liveness`` reported a rank of the group dead.
        """
        self._check_usable()
        control = control or self._control()
        if control is None:
            raise TransportArgumentError(
                "the control transport this ShmTransport was built with is gone; pass "
                "control= (a transport over the same group)"
            )
        send = {p: n for p, n in send_bytes.items() if n}
        recv = {p: n for p, n in recv_bytes.items() if n}
        peers = sorted(set(send) | set(recv))
        unknown = [p for p in peers if p not in self._hosts]
        if unknown:
            got = self._swap({p: _record(self.host) for p in unknown}, control, timeout, liveness)
            self._hosts.update({p: rec[0] for p, rec in got.items()})
        due = [
            p
            for p in peers
            if self.same_host(p)
            and (
                send.get(p, 0) > self._asked_out.get(p, 0)
                or recv.get(p, 0) > self._asked_in.get(p, 0)
            )
        ]
        if due:
            self._grow(due, send, control, timeout, liveness)
        send_shm = _fits(self._out, send)
        recv_shm = _fits(self._in, recv)
        if require:
            missing = sorted((set(send) - send_shm) | (set(recv) - recv_shm))
            if missing:
                why = ", ".join(
                    f"{p} ({'no room in ' + SHM_DIR if self.same_host(p) else 'another host'})"
                    for p in missing
                )
                raise TransportArgumentError(
                    f"rank {self.rank} cannot reach peers {why} through shared memory; "
                    "use route='auto' to let those go through the transport"
                )
        return send_shm, recv_shm

    def _grow(self, due: list[int], send: dict[int, int], control, timeout, liveness) -> None:
        sweep_orphans()  # files of processes that died in an earlier segment round
        created: dict[int, _Segment] = {}
        records = {}
        for p in due:
            n = send.get(p, 0)
            if n <= self._asked_out.get(p, 0):
                records[p] = _record(self.host)
                continue
            self._asked_out[p] = n
            name = f"{owner_prefix(os.getpid())}r{self.rank}to{p}-{uuid.uuid4().hex[:12]}"
            try:
                created[p] = _Segment(name, n, create=True)
                records[p] = _record(self.host, n, name)
            except OSError:  # /dev/shm full or missing: this direction stays on control
                records[p] = _record(self.host, n, "")
        try:
            got = self._swap(records, control, timeout, liveness)
        except BaseException:
            _close_all(created)
            raise
        for p, seg in created.items():
            old = self._out.pop(p, None)
            if old is not None:
                old.close()
            self._out[p] = seg
        for p, (_, n, name, _) in got.items():
            if not n:
                continue
            self._asked_in[p] = max(self._asked_in.get(p, 0), n)
            if not name:
                continue  # the peer found no room: keep the old segment, if any
            try:
                seg = _Segment(name, n, create=False)
            except OSError as e:
                self._break(f"could not map peer {p}'s segment")
                raise TransportError(
                    f"rank {self.rank}: peer {p} reports the same host but its segment "
                    f"{SHM_DIR}/{name} cannot be opened here ({e}); set {HOST_ENV} "
                    "differently in processes that do not share /dev/shm"
                ) from e
            seg.linked = True
            seg.unlink()  # both ends are mapped: the name is no longer needed
            old = self._in.pop(p, None)
            if old is not None:
                old.close()
            self._in[p] = seg

    # -- data --------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise TransportArgumentError(
                f"this shared-memory transport broke earlier ({self._broken}); create a new "
                "one (over the next generation of the World's process group)"
            )

    def _timeout(self, peers, what: str, timeout: float, liveness=None) -> PeerTimeoutError:
        self._break(f"peers {sorted(peers)} timed out")
        lost = dead_among(liveness, peers)
        if lost:  # the dead are the ones to name, not the live ones they held up
            self._lost(lost)
            return lost_error(self.rank, lost, peers, f"timed out after {timeout:g} s")
        sweep_orphans()
        return PeerTimeoutError(
            f"rank {self.rank}: peers {', '.join(map(str, sorted(peers)))} did not {what} "
            f"within {timeout:g} s (shared memory). The peer may have died; form a new "
            "group without it. (A live peer named here may itself be waiting on a dead "
            "one: pass liveness= to learn which.)"
        )

    def _check_alive(self, liveness: Liveness | None, peers, started: float) -> None:
        """Raise PeerLostError (after removing the dead's files) if a rank is known dead."""
        lost = dead_among(liveness, self.ranks)
        if lost:
            self._break(f"ranks {sorted(lost)} died")
            self._lost(lost)
            how = f"known from liveness after {time.monotonic() - started:.2f} s"
            raise lost_error(self.rank, lost, peers, how)

    def _publish(self, seg: _Segment, index: int, value: int) -> None:
        # A lock round trip is a locked instruction: a full barrier on x86-64, so the
        # message bytes are visible before the counter.
        with self._barrier:
            pass
        seg.counters[index] = value

    def send(
        self,
        peer: int,
        nbytes: int,
        fill: Callable[[torch.Tensor], object],
        *,
        deadline: float,
        timeout: float,
        liveness: Liveness | None = None,
    ) -> None:
        """Write one message to ``peer``: ``fill(view)`` writes ``nbytes`` into the segment.

        Waits (until ``deadline``, a time.monotonic() value) for the peer to have
        drained the previous message; ``timeout`` is only quoted in the error.
        ``liveness`` ends the wait early when a rank dies (see the module doc).

        Raises:
            TransportArgumentError: no segment of ``nbytes`` to ``peer`` (call prepare).
            PeerTimeoutError: the previous message was not drained by the deadline.
            PeerLostError: ``liveness`` reported a rank of the group dead.
        """
        self._send(peer, nbytes, fill, deadline, timeout, liveness)
        self.stats.messages_sent += 1
        self.stats.bytes_sent += nbytes

    def _send(self, peer, nbytes, fill, deadline, timeout, liveness=None) -> None:
        seg = self._segment(self._out, peer, nbytes, "to")
        ready = lambda: seg.counters[_DONE] >= seg.seq  # noqa: E731
        self._poll(ready, [peer], deadline, timeout, "drain", liveness)
        fill(seg.data[:nbytes])
        seg.seq += 1
        self._publish(seg, _READY, seg.seq)

    def receive(
        self,
        sizes: Mapping[int, int],
        drain: Callable[[int, torch.Tensor], object],
        *,
        deadline: float,
        timeout: float,
        liveness: Liveness | None = None,
    ) -> None:
        """Read one message from each peer of ``sizes``, in the order they arrive.

        ``drain(peer, view)`` must read the ``sizes[peer]`` bytes of ``view``; the
        segment is handed back to the sender when it returns. ``liveness`` ends the
        wait early when a rank dies (see the module doc).

        Raises:
            TransportArgumentError: no segment of that size from a peer (call prepare).
            PeerTimeoutError: messages still missing at the deadline (names the peers).
            PeerLostError: ``liveness`` reported a rank of the group dead.
        """
        self._receive(sizes, drain, deadline, timeout, liveness)
        self.stats.messages_received += sum(1 for n in sizes.values() if n)
        self.stats.bytes_received += sum(sizes.values())

    def _receive(self, sizes, drain, deadline, timeout, liveness=None) -> None:
        waiting = {p: self._segment(self._in, p, n, "from") for p, n in sizes.items() if n}
        delay = 0.0
        started = time.monotonic()
        check_at = started + LIVENESS_POLL_S
        while waiting:
            ready = [p for p, seg in waiting.items() if seg.counters[_READY] > seg.seq]
            for p in ready:
                seg = waiting.pop(p)
                drain(p, seg.data[: sizes[p]])
                seg.seq += 1
                self._publish(seg, _DONE, seg.seq)
            if ready or not waiting:
                delay = 0.0
                continue
            now = time.monotonic()
            if now >= deadline:
                raise self._timeout(waiting, "send their message", timeout, liveness)
            if liveness is not None and now >= check_at:
                check_at = now + LIVENESS_POLL_S
                self._check_alive(liveness, waiting, started)
            delay = _sleep(delay)

    def _segment(self, segments, peer: int, nbytes: int, direction: str) -> _Segment:
        self._check_usable()
        seg = segments.get(peer)
        if seg is None or seg.nbytes < nbytes:
            have = "none" if seg is None else f"{seg.nbytes} bytes"
            raise TransportArgumentError(
                f"rank {self.rank}: no shared-memory segment of {nbytes} bytes {direction} "
                f"peer {peer} (have {have}); call prepare() with the message sizes first"
            )
        return seg

    def _poll(self, ready: Callable[[], bool], peers, deadline, timeout, what, liveness) -> None:
        delay = 0.0
        started = time.monotonic()
        check_at = started + LIVENESS_POLL_S
        while not ready():
            now = time.monotonic()
            if now >= deadline:
                raise self._timeout(peers, what, timeout, liveness)
            if liveness is not None and now >= check_at:
                check_at = now + LIVENESS_POLL_S
                self._check_alive(liveness, peers, started)
            delay = _sleep(delay)

    # -- the Transport interface ---------------------------------------------------

    def _post(self, sends, recvs, timeout, liveness):
        deadline = time.monotonic() + timeout
        by_peer: dict[int, list[torch.Tensor]] = {}
        for p, t in sends:
            by_peer.setdefault(p, []).append(t)
        into: dict[int, list[torch.Tensor]] = {}
        for p, t in recvs:
            into.setdefault(p, []).append(t)
        send_sizes = {p: sum(t.nbytes for t in ts) for p, ts in by_peer.items()}
        recv_sizes = {p: sum(t.nbytes for t in ts) for p, ts in into.items()}
        self.prepare(send_sizes, recv_sizes, timeout=timeout, require=True, liveness=liveness)
        # PendingExchange.wait counts the buffers, so the uncounted _send/_receive.
        for p, ts in by_peer.items():
            self._send(p, send_sizes[p], _copier(ts, into=True), deadline, timeout, liveness)
        return into, recv_sizes, deadline, timeout, liveness

    def _wait(self, state) -> None:
        into, sizes, deadline, timeout, liveness = state
        drain = lambda p, v: _copier(into[p], into=False)(v)  # noqa: E731
        self._receive(sizes, drain, deadline, timeout, liveness)

    def close(self) -> None:
        """Unmap every segment and remove any file still named in /dev/shm, this
        process's and those of dead processes (see the module doc)."""
        self._finalizer()
        self._break("closed")


def _fits(segments: dict[int, _Segment], sizes: dict[int, int]) -> frozenset[int]:
    return frozenset(p for p, n in sizes.items() if p in segments and segments[p].nbytes >= n)


def _copier(tensors: list[torch.Tensor], *, into: bool) -> Callable[[torch.Tensor], None]:
    """Copy tensors into consecutive bytes of a view (into=True) or back out of it."""

    def run(view: torch.Tensor) -> None:
        at = 0
        for t in tensors:
            flat = t.reshape(-1).view(torch.uint8)
            if into:
                view[at : at + flat.numel()].copy_(flat)
            else:
                flat.copy_(view[at : at + flat.numel()])
            at += flat.numel()

    return run


def _sleep(delay: float) -> float:
    """Sleep for delay (0: just yield) and return the next, longer delay (max 1 ms)."""
    time.sleep(delay)
    return min(max(delay * 2, 2e-5), 1e-3)
