"""CmaRoute: one-copy exchange between ranks on the same host by cross-memory attach.

Why
    Through a shared-memory segment (:mod:`nereus_comm.transport_shm`) every byte is
    copied twice, and the segment itself costs: creating and faulting in a /dev/shm
    file as large as the biggest message, per group and direction. Linux's
    cross-memory attach (``process_vm_readv``) lets a receiver read a peer's memory
    straight into its own tensors: the kernel copies each byte once, from the
    sender's shard into the receiver's, with no segment and no packing on either
    side (strided pieces are read row by row, up to 1,024 rows per system call).

Protocol (over a control transport, e.g. the GlooTransport reshard was given)
    1. Probe, once per peer pair and group: both ranks swap a 64-byte record (pid, the
       address of an 8-byte random nonce, a digest of the host identity); each reads
       the peer's nonce with ``process_vm_readv`` and reports back what happened. A
       direction is usable only when the read returned the peer's nonce: another
       host, another pid namespace, Yama ptrace scope, seccomp (ENOSYS) or missing
       credentials (EPERM) all fail the probe, and the reason is kept
       (:attr:`CmaRoute.reasons`). Setting ``NEREUS_CMA=0`` in either process turns
       the route off for its pairs.
    2. Per exchange, the sender sends each CMA peer the table of its source regions
       (address, rows, row bytes, stride per piece, in the plan's wire order; the
       receiver knows how many from the plan), and waits.
    3. The receiver pairs them with its own destination regions and reads them with
       :func:`nereus_comm._C.cma_read` (GIL released, split over a couple of threads).
    4. The receiver sends each sender a completion record (bytes read, errno); only
       then may the sender return and change or free its tensors. A failed read is
       reported to both sides (TransportError), and that direction is off from then
       on (its later exchanges take the fallback route).

Dead peers
    Given ``liveness`` (see :data:`nereus_comm.transport.Liveness`), every wait of the
    route (a probe round, a receiver waiting for its senders' tables, a sender waiting
    for its readers' completion records) is a control exchange that asks it every
    LIVENESS_POLL_S and ends with PeerLostError naming the dead rank once a rank of
    the group is dead; without it a wait ends at its timeout, or sooner where the
    control transport sees the peer's connection close (PeerTimeoutError). A read
    whose sender's process is gone (``process_vm_readv`` answers ESRCH; the probe has
    shown the pid was that peer's) raises PeerLostError naming the sender at once.
    The route keeps no file or segment, so a dead peer leaves nothing of it behind.

Limits
    Linux, host memory, peers on one host that the kernel lets read each other (same
    uid and no Yama ptrace restriction, or CAP_SYS_PTRACE). The sender's tensors must
    stay alive and untouched until :meth:`CmaRoute.finish` returns on its side.
"""

from __future__ import annotations

import errno
import hashlib
import os
import weakref
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from nereus_comm import _C
from nereus_comm.errors import TransportArgumentError, TransportError
from nereus_comm.pack import Region, RegionTable, copy_table, region_table
from nereus_comm.transport import Liveness, Transport, lost_error
from nereus_comm.transport_shm import host_identity

__all__ = ["CMA_ENV", "CMA_THREADS", "CmaRoute", "cma_disabled"]

#: "0" / "off" / "false" / "no": this process never reads or is read by cross-memory attach.
CMA_ENV = "NEREUS_CMA"
#: Threads a receiver splits one peer's bytes over (the kernel copy of a page runs
#: on the reading thread; two keep two cores busy where the workers have them).
CMA_THREADS = 2

_MAGIC = 0x4E52434D41303031  # "NRCMA001"
_RECORD = 8  # int64 words: magic, pid, nonce address, nonce, host digest (4 words)
_DONE = 3  # int64 words: magic, bytes read, errno (or one of the codes below)
# Probe codes besides errno values (negative, so never an errno).
_OTHER_HOST, _DISABLED, _WRONG_NONCE, _NOT_LINUX = -1, -2, -3, -4
_HEAD = 2  # table message header words: magic, total bytes


def cma_disabled() -> bool:
    """Whether NEREUS_CMA turns cross-memory attach off in this process."""
    return os.environ.get(CMA_ENV, "").strip().lower() in ("0", "off", "false", "no")


def _why(code: int) -> str:
    if code == _OTHER_HOST:
        return "another host"
    if code == _DISABLED:
        return f"disabled by {CMA_ENV}"
    if code == _WRONG_NONCE:
        return "the peer's pid is another process here (another pid namespace)"
    if code == _NOT_LINUX:
        return "process_vm_readv is not available (not Linux)"
    name = errno.errorcode.get(code, str(code))
    return f"process_vm_readv failed: {name} ({os.strerror(code)})"


def _digest() -> np.ndarray:
    ident = host_identity()
    raw = hashlib.sha256(ident.encode()).digest() if ident else bytes(32)
    return np.frombuffer(raw, dtype=np.int64).copy()


def _as_bytes(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(words, dtype=np.int64)).view(torch.uint8)


class CmaRoute:
    """Cross-memory-attach exchanges with the same-host peers of one control group.

    One per control group and process (:func:`nereus_comm.reshard.reshard` keeps one
    per gloo group). :meth:`prepare` probes new peers and says which directions can
    use the route; :meth:`publish`, :meth:`read` and :meth:`finish` run one exchange.

    Arguments:
        control: a host-memory transport over the same ranks, for the probe, table
            and completion records (held weakly, as ShmTransport does).

    Raises:
        TransportArgumentError: ``control`` does not move host memory.
    """

    def __init__(self, control: Transport) -> None:
        if control.device_type != "cpu":
            raise TransportArgumentError(
                f"the control transport must move host memory, {control!r} moves "
                f"{control.device_type}; use a GlooTransport"
            )
        self._control = weakref.ref(control)
        self.rank = control.rank
        # The nonce a peer's probe reads out of this process; kept alive with self.
        self._nonce = np.frombuffer(os.urandom(8), dtype=np.int64).copy()
        self._host = _digest()
        self._pid: dict[int, int] = {}
        #: per peer: None when this rank can read from it, else why not.
        self.read_reasons: dict[int, str | None] = {}
        #: per peer: None when it can read from this rank, else why not.
        self.write_reasons: dict[int, str | None] = {}
        self.probe_rounds = 0
        #: data bytes read by peers from this rank / read by this rank (probes excluded).
        self.bytes_sent = 0
        self.bytes_received = 0
        self._published: dict[int, int] = {}
        #: bytes of this route's own records (probes, tables, completions) sent and
        #: received through the control transport.
        self.control_bytes = [0, 0]
        self.threads = max(1, min(CMA_THREADS, _C.copy_default_num_threads()))

    def __repr__(self) -> str:
        ok_in = sorted(p for p, r in self.read_reasons.items() if r is None)
        ok_out = sorted(p for p, r in self.write_reasons.items() if r is None)
        return f"CmaRoute(rank={self.rank}, reads from {ok_in}, read by {ok_out})"

    @property
    def reasons(self) -> dict[int, str]:
        """Why each probed direction that cannot use the route cannot, by peer."""
        out = {}
        for p, r in self.read_reasons.items():
            if r is not None:
                out[p] = f"reading from {p}: {r}"
        for p, r in self.write_reasons.items():
            if r is not None:
                out[p] = (out[p] + "; " if p in out else "") + f"read by {p}: {r}"
        return out

    def _control_or(self, control: Transport | None) -> Transport:
        control = control or self._control()
        if control is None:
            raise TransportArgumentError(
                "the control transport this CmaRoute was built with is gone; pass "
                "control= (a transport over the same group)"
            )
        return control

    def _swap(
        self, control: Transport, sends, recvs, timeout: float, liveness: Liveness | None
    ) -> None:
        # Passed only when given: a Transport of another framework's may predate liveness.
        extra = {} if liveness is None else {"liveness": liveness}
        control.exchange(sends, recvs, timeout=timeout, **extra)
        self.control_bytes[0] += sum(t.nbytes for _, t in sends)
        self.control_bytes[1] += sum(t.nbytes for _, t in recvs)

    # -- probe -----------------------------------------------------------------------

    def _probe_one(self, record: np.ndarray) -> int:
        """0 when this process can read the peer's nonce, else the reason's code."""
        if int(record[0]) != _MAGIC:
            raise TransportError(f"rank {self.rank}: malformed CMA probe record from a peer")
        pid, addr, nonce = (int(x) for x in record[1:4])
        if cma_disabled() or pid == 0:
            return _DISABLED
        if not np.array_equal(record[4:8], self._host) or not self._host.any():
            return _OTHER_HOST
        got = np.zeros(1, dtype=np.int64)
        table = np.array([[addr, got.ctypes.data, 1, 8, 8, 8]], dtype=np.int64)
        try:
            nbytes, err = _C.cma_read(pid, table, 1)
        except (AttributeError, OSError):
            return _NOT_LINUX
        if err:
            return err
        return 0 if nbytes == 8 and int(got[0]) == nonce else _WRONG_NONCE

    def prepare(
        self,
        send_peers: Sequence[int],
        recv_peers: Sequence[int],
        *,
        timeout: float,
        control: Transport | None = None,
        liveness: Liveness | None = None,
    ) -> tuple[frozenset[int], frozenset[int]]:
        """Probe peers not probed yet (collective with them); say which may use the route.

        Every peer named must call prepare in the same exchange with this rank named
        (the peers of a reshard plan are symmetric).

        Arguments:
            send_peers / recv_peers: peers this rank sends to / receives from.
            timeout: seconds for each probe round.
            control: the transport for the records (default: the constructor's).
            liveness: ends a probe round early when a rank dies (see the module doc).

        Returns:
            (peers to send to, peers to receive from) by cross-memory attach.

        Raises:
            PeerTimeoutError: a peer did not take part in a probe round in time.
            PeerLostError: ``liveness`` reported a rank of the group dead.
        """
        control = self._control_or(control)
        peers = sorted(set(send_peers) | set(recv_peers))
        new = [p for p in peers if p not in self.read_reasons]
        if new:
            mine = np.zeros(_RECORD, dtype=np.int64)
            mine[:4] = (_MAGIC, 0 if cma_disabled() else os.getpid(), self._nonce.ctypes.data,
                        int(self._nonce[0]))  # fmt: skip
            mine[4:] = self._host
            got = {p: torch.empty(_RECORD * 8, dtype=torch.uint8) for p in new}
            mine_to = [(p, _as_bytes(mine)) for p in new]
            self._swap(control, mine_to, list(got.items()), timeout, liveness)
            codes = {}
            for p in new:
                record = got[p].view(torch.int64).numpy()
                self._pid[p] = int(record[1])
                codes[p] = self._probe_one(record)
            back = {p: torch.empty(_DONE * 8, dtype=torch.uint8) for p in new}
            sends = [(p, _as_bytes(np.array([_MAGIC, 0, codes[p]]))) for p in new]
            self._swap(control, sends, list(back.items()), timeout, liveness)
            self.probe_rounds += 2
            for p in new:
                self.read_reasons[p] = None if codes[p] == 0 else _why(codes[p])
                code = int(back[p].view(torch.int64)[2])
                self.write_reasons[p] = None if code == 0 else _why(code)
        send = frozenset(p for p in send_peers if self.write_reasons.get(p, "") is None)
        recv = frozenset(p for p in recv_peers if self.read_reasons.get(p, "") is None)
        return send, recv

    # -- one exchange ------------------------------------------------------------------

    def publish(
        self,
        sends: Mapping[int, Sequence[Region]],
        recvs: Mapping[int, int],
        *,
        timeout: float,
        control: Transport | None = None,
        liveness: Liveness | None = None,
    ) -> dict[int, np.ndarray]:
        """Swap region tables: send each peer in ``sends`` where its bytes are here.

        Arguments:
            sends: per peer this rank sends to, its source regions in wire order.
            recvs: per peer this rank receives from, how many regions it sends.
            timeout: seconds for the swap.
            control: the transport for the tables (default: the constructor's).
            liveness: ends the wait for a sender's table early when a rank dies.

        Returns:
            Per receive peer, its source table (int64 (n, 4): address, rows, row
            bytes, stride bytes) after a header of (magic, total bytes).

        Raises:
            PeerTimeoutError: a peer did not send or take its table in time.
            PeerLostError: ``liveness`` reported a rank of the group dead.
        """
        control = self._control_or(control)
        out = []
        for p, regions in sends.items():
            t = region_table(regions, "source region")
            table = np.stack([t.addr, t.num_rows, t.row_bytes, t.stride], axis=1)
            head = np.array([_MAGIC, int(t.nbytes.sum())], dtype=np.int64)
            out.append((p, _as_bytes(np.concatenate([head, table.reshape(-1)]))))
            self._published[p] = int(head[1])
        got = {p: torch.empty((_HEAD + 4 * n) * 8, dtype=torch.uint8) for p, n in recvs.items()}
        self._swap(control, out, list(got.items()), timeout, liveness)
        return {p: t.view(torch.int64).numpy() for p, t in got.items()}

    def read(self, peer: int, table: np.ndarray, regions: Sequence[Region], nbytes: int) -> int:
        """Read ``peer``'s published bytes into ``regions`` (this rank's, in wire order).

        Returns:
            0, or the errno (or code) that stopped the read, for :meth:`finish`.

        Raises:
            PeerLostError: the peer's process is gone (ESRCH): it died after the probe.
        """
        if len(table) < _HEAD or int(table[0]) != _MAGIC or int(table[1]) != nbytes:
            # A different plan on the peer: nothing is read, both sides raise.
            return errno.EBADMSG
        src = table[_HEAD:].reshape(-1, 4)
        dst = region_table(regions, "destination region")
        if not _remote_fits(src, dst):
            # The peer's regions must hold exactly what ours take, region by region:
            # copy_table shapes the copy from either side, so a larger remote region
            # would write past ours.
            return errno.EBADMSG
        remote = RegionTable(src[:, 0], src[:, 1], src[:, 2], src[:, 3], dst.device)
        try:
            pairs = np.ascontiguousarray(copy_table(remote, dst), dtype=np.int64)
            got, err = _C.cma_read(self._pid[peer], pairs, self.threads)
        except ValueError:  # a malformed table from the peer: report it, never hang it
            return errno.EBADMSG
        self.bytes_received += got
        if err == errno.ESRCH:
            # The probe read this pid's nonce, so the pid was the peer's: no process
            # by it now means the peer died (an exited process's mm is gone, a zombie's
            # too). Said now, as liveness would say it later.
            raise lost_error(
                self.rank, [peer], [peer], "reading its memory: process_vm_readv found no "
                f"process {self._pid[peer]} (ESRCH)"
            )  # fmt: skip
        if not err and got != nbytes:
            err = errno.EIO
        return err

    def finish(
        self,
        results: Mapping[int, int],
        senders: Sequence[int],
        *,
        timeout: float,
        control: Transport | None = None,
        liveness: Liveness | None = None,
    ) -> None:
        """Tell each peer read from how its read went; wait for the peers reading us.

        Arguments:
            results: per peer read from, :meth:`read`'s return.
            senders: wait, per peer that reads from this rank, for its record.
            timeout: seconds for the wait.
            control: the transport for the records (default: the constructor's).
            liveness: ends the wait for a reader's record early when a rank dies.

        Raises:
            PeerTimeoutError: a peer did not send or take its record in time.
            PeerLostError: ``liveness`` reported a rank of the group dead.
            TransportError: a read failed on either side (that direction is then off:
                the next exchange takes the fallback route).
        """
        control = self._control_or(control)
        sends = [(p, _as_bytes(np.array([_MAGIC, 0, code]))) for p, code in results.items()]
        got = {p: torch.empty(_DONE * 8, dtype=torch.uint8) for p in senders}
        self._swap(control, sends, list(got.items()), timeout, liveness)
        failed = []
        for p, code in results.items():
            if code:
                self.read_reasons[p] = _why(code)
                failed.append(f"reading from {p}: {_why(code)}")
        for p, t in got.items():
            code = int(t.view(torch.int64)[2])
            self.bytes_sent += 0 if code else self._published.pop(p, 0)
            if code:
                self.write_reasons[p] = _why(code)
                failed.append(f"read by {p}: {_why(code)}")
        if failed:
            raise TransportError(
                f"rank {self.rank}: cross-memory attach failed ({'; '.join(failed)}); the "
                "destination shards are incomplete, the sources untouched. Retry: those "
                "peers now take the shared-memory or transport route"
            )


def _remote_fits(src: np.ndarray, dst: RegionTable) -> bool:
    """Whether a peer's table (address, rows, row bytes, stride) matches ``dst`` byte for byte.

    One region per destination region, sizes >= 0, the same bytes each (checked
    without int64 overflow), positive addresses and, for several rows, a stride of at
    least a row: anything else is a malformed table the read must not trust.
    """
    if src.ndim != 2 or src.shape != (len(dst.addr), 4):
        return False
    addr, rows, row_bytes, stride = src.T
    want = dst.nbytes
    if (rows < 0).any() or (row_bytes < 0).any():
        return False
    # rows * row_bytes == want, tested as rows <= want // row_bytes first so it cannot wrap.
    fits = (row_bytes == 0) | (rows <= want // np.maximum(row_bytes, 1))
    if not fits.all() or not (rows * row_bytes == want).all():
        return False
    live = want > 0
    return bool((addr[live] > 0).all() and ((rows <= 1) | (stride >= row_bytes))[live].all())
