"""NetRoute: reshard's bytes between hosts over TCP streams, rows straight from and into the shards.

Why
    Between hosts neither shared memory nor cross-memory attach exists, and a
    two-sided transport such as gloo moves one contiguous buffer per operation: a
    piece that is strided in a shard (a column block, split along dim 1) is packed
    into a staging buffer on the sending side and unpacked out of one on the
    receiving side, two copies on top of the kernel's own. Here each peer pair has
    one TCP stream of its own, and every row of every piece is handed to the kernel
    as an iovec (``sendmsg`` / ``recvmsg``, :class:`nereus_comm._C.NetExchange`):
    the kernel copies straight from the source shard into the socket and out of the
    socket into the destination shard, strided or not, as it does for a contiguous
    buffer (rows under 4 KiB go through a 64 KiB bounce buffer instead: the kernel's
    cost per iovec outweighs a copy in cache). Two threads per exchange, one for
    every peer's sends and one for every receive, run non-blocking calls and
    ``poll``: no order of sends and receives among ranks can deadlock, the two
    directions' kernel copies can run on two cores (as gloo's do, a caller's thread
    writing while its device thread reads), and the caller's thread is free for the
    local copies.

Setup (collective with each new peer, over the control transport reshard was given)
    For a pair (a, b) with a < b that has no stream yet, both swap a 64-byte record
    over the control transport: whether it takes part, the address and port a
    listens on (a only) and a 32-byte random nonce. b connects to a's address and
    sends a's nonce to it and its own rank; a accepts only a connection that presents
    the nonce it sent to that rank (anything else is closed, and a keeps listening
    until its deadline), then answers with b's nonce, which b checks before it uses
    the stream. A nonce travels only over the control transport, so a process that
    can reach the port but not the job's group cannot get in, and b knows that it
    reached a. The listening socket lives only during the setup round.

    The address is the one gloo binds on this host: the address of the interface
    named by ``GLOO_SOCKET_IFNAME`` (its first name; IPv4 if it has one, else a
    global IPv6 one), else the first address the hostname resolves to, as gloo does;
    ``NEREUS_NET_ADDRESS`` overrides both. IPv4 and IPv6 both work; a pair whose
    records name different families keeps the control transport (one side may have
    no route to the other's family), as does a rank without an address (the
    hostname does not resolve, or only an IPv6 link-local address, which needs a
    scope this record does not carry), which records that it does not take part.

Failures
    Streams belong to (control group, peer pair) and serve every later exchange. A
    failed exchange (a peer closed its end, a timeout, a death reported by
    ``liveness``) breaks the route for good: the pair's streams may hold part of a
    message, so later calls raise TransportArgumentError and the caller builds a new
    group, as after a gloo timeout.
"""

from __future__ import annotations

import fcntl
import hmac
import ipaddress
import os
import secrets
import socket
import struct
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch

from nereus_comm import _C
from nereus_comm.errors import PeerTimeoutError, TransportArgumentError, TransportError
from nereus_comm.pack import RegionTable
from nereus_comm.transport import (
    LIVENESS_POLL_S,
    Liveness,
    Transport,
    dead_among,
    lost_error,
)

__all__ = ["NET_ADDRESS_ENV", "NetRoute", "local_address"]

#: Overrides the address the route listens on (default: the one gloo binds).
NET_ADDRESS_ENV = "NEREUS_NET_ADDRESS"

# The setup record: magic [0:4], takes part [4], address family [5] (4 or 6), port
# [6:8], the address [8:24] (IPv4 in its first 4 bytes), the nonce [24:56].
_RECORD = 64
_MAGIC = b"NRNT"
_NONCE = 32
_HELLO = _NONCE + 8  # the connecting side's nonce answer and its rank
_SIOCGIFADDR = 0x8915
_FAMILIES = {4: socket.AF_INET, 6: socket.AF_INET6}


def _interface_address(name: str) -> str | None:
    """The address of interface ``name``: its IPv4 one, else its first global IPv6 one
    (as gloo takes an interface's IPv4 address before its IPv6 ones). None: no such
    interface, or neither."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            return socket.inet_ntoa(raw[20:24])
        except OSError:
            pass
    try:
        with open("/proc/net/if_inet6") as f:
            return _ipv6_of(name, f.read())
    except OSError:
        return None


def _ipv6_of(name: str, if_inet6: str) -> str | None:
    """The first IPv6 address of interface ``name`` that is not link-local, from the
    text of /proc/net/if_inet6 (a line per address: "address ifindex prefixlen scope
    flags name", the address as 32 hex digits)."""
    for line in if_inet6.splitlines():
        fields = line.split()
        if len(fields) != 6 or fields[5] != name or len(fields[0]) != 32:
            continue
        try:
            address = ipaddress.IPv6Address(bytes.fromhex(fields[0]))
        except ValueError:
            continue
        if not address.is_link_local:
            return str(address)
    return None


def _usable(address: str | None) -> str | None:
    """``address`` in canonical form if the route can listen on and record it: an IPv4
    or IPv6 address, not IPv6 link-local (its scope would not reach the peer)."""
    if address is None:
        return None
    try:
        parsed = ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        return None
    if parsed.version == 6 and parsed.is_link_local:
        return None
    return str(parsed)


def local_address() -> str | None:
    """The address peers reach this process at, as gloo chooses it.

    ``NEREUS_NET_ADDRESS`` if set; else the address of the first interface named by
    ``GLOO_SOCKET_IFNAME`` (IPv4, else global IPv6); else the first address the
    hostname resolves to. None when there is none (the route then leaves this rank's
    pairs to the control transport).
    """
    given = os.environ.get(NET_ADDRESS_ENV)
    if given:
        return given
    names = os.environ.get("GLOO_SOCKET_IFNAME")
    if names:
        return _interface_address(names.split(",")[0].strip())
    try:
        found = socket.getaddrinfo(socket.gethostname(), None, proto=socket.IPPROTO_TCP)
    except OSError:
        return None
    usable = (_usable(a[4][0]) for a in found if a[0] in (socket.AF_INET, socket.AF_INET6))
    return next((u for u in usable if u is not None), None)


def _record(address: str | None, port: int, nonce: bytes) -> torch.Tensor:
    out = bytearray(_RECORD)
    out[0:4] = _MAGIC
    if address is not None:
        parsed = ipaddress.ip_address(address)
        out[4] = 1
        out[5] = parsed.version
        out[6:8] = port.to_bytes(2, "big")
        out[8 : 8 + len(parsed.packed)] = parsed.packed
    out[24 : 24 + _NONCE] = nonce
    return torch.frombuffer(out, dtype=torch.uint8).clone()


def _parse(t: torch.Tensor, peer: int) -> tuple[bool, str, int, bytes, int]:
    """A peer's record: (takes part, address, port, nonce, address family 4 or 6)."""
    raw = bytes(t.numpy().tobytes())
    if raw[0:4] != _MAGIC or (raw[4] == 1 and raw[5] not in _FAMILIES):
        raise TransportError(
            f"peer {peer} answered the socket route's setup with something else; every "
            "rank must run the same nereus_comm and pass the same route"
        )
    version = raw[5] if raw[4] == 1 else 0
    size = 16 if version == 6 else 4
    address = str(ipaddress.ip_address(raw[8 : 8 + size])) if version else ""
    return raw[4] == 1, address, int.from_bytes(raw[6:8], "big"), raw[24 : 24 + _NONCE], version


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("the peer closed the connection during the handshake")
        out += chunk
    return bytes(out)


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


class NetPending:
    """An exchange in flight on a :class:`NetRoute`; :meth:`wait` completes it."""

    def __init__(self, route: NetRoute, exchange, jobs, deadline, timeout, liveness) -> None:
        self._route = route
        self._exchange = exchange
        self._jobs = jobs  # (kind, peer) per job, in the order added
        self._deadline = deadline
        self._timeout = timeout
        self._liveness = liveness

    def wait(self) -> None:
        """Wait until every job is done.

        Raises:
            PeerLostError: ``liveness`` reported a rank of the group dead.
            PeerTimeoutError: not done by the deadline (names the peers still pending).
            TransportError: a peer closed its stream or a call failed (names it).
        """
        ex, route = self._exchange, self._route
        if ex is None:
            return
        try:
            next_check = time.monotonic() + LIVENESS_POLL_S
            while not ex.wait(int(LIVENESS_POLL_S * 1000)):
                now = time.monotonic()
                if self._liveness is not None and now >= next_check:
                    next_check = now + LIVENESS_POLL_S
                    lost = dead_among(self._liveness, route.ranks)
                    if lost:
                        ex.cancel()
                        route._break(f"ranks {sorted(lost)} died")
                        peers = {p for _, p in self._jobs}
                        raise lost_error(route.rank, lost, peers, "known from liveness")
                if now > self._deadline:
                    ex.cancel()
                    pending = self._pending(ex.results())
                    route._break(f"peers {sorted({p for _, p in pending})} timed out")
                    detail = "; ".join(f"{k} {p}" for k, p in pending)
                    raise PeerTimeoutError(
                        f"rank {route.rank}: socket transfers did not complete within "
                        f"{self._timeout:g} s (pending: {detail}). The peer may have died; "
                        "form a new group without it."
                    )
            failed = [
                (kind, peer, err, eof)
                for (kind, peer), (_, _, err, eof) in zip(self._jobs, ex.results(), strict=True)
                if err or eof
            ]
            if failed:
                route._break(f"transfers with peers {sorted({f[1] for f in failed})} failed")
                lost = dead_among(self._liveness, route.ranks)
                if lost:
                    raise lost_error(route.rank, lost, {f[1] for f in failed}, "a stream failed")
                kind, peer, err, eof = failed[0]
                why = "the peer closed its end" if eof else os.strerror(err)
                raise TransportError(
                    f"rank {route.rank}: socket {kind} {peer} failed: {why}; the route is "
                    "broken, form a new group"
                )
            for (kind, _), (done, _, _, _) in zip(self._jobs, ex.results(), strict=True):
                if kind == "send to":
                    route.bytes_sent += done
                else:
                    route.bytes_received += done
        finally:
            ex.cancel()  # joins the exchange's thread: it touches no shard after this
            self._exchange = None

    def abort(self, reason: str) -> None:
        """End the transfers now and break the route (its streams may hold part of a
        message); for a caller that fails before :meth:`wait`."""
        if self._exchange is not None:
            self._exchange.cancel()
            self._exchange = None
        self._route._break(reason)

    def _pending(self, results) -> list[tuple[str, int]]:
        return [kp for kp, (done, total, _, _) in zip(self._jobs, results, strict=True)
                if done < total]  # fmt: skip


class NetRoute:
    """Streams to peers over TCP, for reshard's host memory between hosts.

    reshard() keeps one per process group (like its shared-memory and cross-memory
    attach routes): ``route="auto"`` sends the bytes of peers on other hosts through
    it, ``route="net"`` every peer's. See the module docstring for the protocol.

    Arguments:
        control: a transport over the group (sets up streams with new peers).
        address: the IPv4 or IPv6 address to listen on (default: :func:`local_address`;
            one the route cannot use, such as a host name or an IPv6 link-local
            address, leaves this rank out: its pairs keep the control transport).
    """

    def __init__(self, control: Transport, address: str | None = None) -> None:
        self.rank = control.rank
        self.ranks = tuple(control.ranks)
        self.address = _usable(address if address is not None else local_address())
        self._control = weakref.ref(control)
        self._streams: dict[int, socket.socket] = {}
        #: peers that answered that they do not take part (their pairs keep the transport)
        self._without: set[int] = set()
        self._broken: str | None = None
        self.setup_rounds = 0
        #: bytes of setup records this rank sent over the control transport (as many
        #: came back): not data, and not in bytes_sent.
        self.setup_bytes = 0
        #: connections to the listener that did not present a nonce this rank sent
        #: (closed at once).
        self.rejected = 0
        #: data bytes moved over the streams by completed exchanges (not the handshakes).
        self.bytes_sent = 0
        self.bytes_received = 0

    def __repr__(self) -> str:
        return f"NetRoute(rank={self.rank}, address={self.address}, peers={sorted(self._streams)})"

    def _break(self, reason: str) -> None:
        if self._broken is None:  # the first failure is the one to name
            self._broken = reason
        self.close()

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise TransportArgumentError(
                f"this socket route broke earlier ({self._broken}); its streams may hold part "
                "of a message: create a new process group (the World's next generation)"
            )

    def close(self) -> None:
        """Close every stream (the route cannot be used again after a failure)."""
        for s in self._streams.values():
            s.close()
        self._streams.clear()

    def prepare(
        self,
        peers: Iterable[int],
        *,
        timeout: float,
        control: Transport | None = None,
        liveness: Liveness | None = None,
    ) -> frozenset[int]:
        """Open streams to the peers named that have none (collective with those peers).

        Every peer named without a stream must call prepare in the same round naming
        this rank; peers with a stream already cost nothing.

        Arguments:
            peers: global ranks this rank is about to exchange with.
            timeout: seconds for the setup round.
            control: the transport for the records (default: the constructor's).
            liveness: ends the round early when a rank dies.

        Returns:
            The peers of ``peers`` that have a stream now; the others keep the control
            transport (one side has no address).

        Raises:
            TransportArgumentError: the route broke earlier.
            PeerTimeoutError: a peer did not connect, or did not answer, in time.
            PeerLostError: ``liveness`` reported a rank of the group dead.
            TransportError: a peer's record or handshake is not this protocol's.
        """
        self._check_usable()
        control = control or self._control()
        if control is None:
            raise TransportArgumentError(
                "the control transport this NetRoute was built with is gone; pass control="
            )
        peers = sorted(set(peers))
        new = [p for p in peers if p not in self._streams and p not in self._without]
        if new:
            try:
                self._connect(new, control, timeout, liveness)
            except BaseException:
                self._break(f"setting up streams with peers {new} failed")
                raise
        return frozenset(p for p in peers if p in self._streams)

    def _connect(self, new: list[int], control: Transport, timeout: float, liveness) -> None:
        deadline = time.monotonic() + timeout
        listener = None
        higher = [p for p in new if p > self.rank]
        address = self.address
        port = 0
        mine = ipaddress.ip_address(address).version if address is not None else 0
        if address is not None and higher:
            listener = socket.socket(_FAMILIES[mine], socket.SOCK_STREAM)
            try:
                listener.bind((address, 0))
                listener.listen(len(higher) + 8)
                port = listener.getsockname()[1]
            except OSError:
                listener.close()
                listener, address = None, None
        try:
            nonces = {p: secrets.token_bytes(_NONCE) for p in new}
            got = {p: torch.empty(_RECORD, dtype=torch.uint8) for p in new}
            control.exchange(
                [(p, _record(address, port, nonces[p])) for p in new],
                list(got.items()),
                timeout=timeout,
                liveness=liveness,
            )
            self.setup_rounds += 1
            self.setup_bytes += _RECORD * len(new)
            theirs = {p: _parse(got[p], p) for p in new}
            # Both take part, with addresses of one family: a host with an IPv6 address
            # may have no route to an IPv4 one, and the other way round.
            mine_in = address is not None
            joined = [p for p in new if mine_in and theirs[p][0] and theirs[p][4] == mine]
            self._without.update(p for p in new if p not in joined)
            # Lower ranks first: a peer that both accepts and connects does its accepts
            # on the kernel's backlog, so the order cannot deadlock.
            for p in sorted(q for q in joined if q < self.rank):
                self._streams[p] = self._dial(p, theirs[p], nonces[p], deadline, liveness)
            expect = {p for p in joined if p > self.rank}
            if expect:
                self._accept(listener, expect, nonces, theirs, deadline, timeout, liveness)
        finally:
            if listener is not None:
                listener.close()

    def _dial(self, peer: int, record, mine: bytes, deadline: float, liveness) -> socket.socket:
        _, host, port, theirs, _ = record
        left = max(deadline - time.monotonic(), 0.001)
        try:
            sock = socket.create_connection((host, port), timeout=left)
        except OSError as e:
            why = f"could not connect to {host}:{port}: {e}"
            raise self._setup_failed(peer, why, liveness) from e
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock.sendall(theirs + self.rank.to_bytes(8, "little"))
            answer = _recv_exactly(sock, _NONCE)
        except OSError as e:
            sock.close()
            why = f"handshake with {host}:{port} failed: {e}"
            raise self._setup_failed(peer, why, liveness) from e
        if not hmac.compare_digest(answer, mine):
            sock.close()
            raise TransportError(
                f"rank {self.rank}: the process at {host}:{port} did not answer with the nonce "
                f"sent to rank {peer} over the control transport; not using it"
            )
        _tune(sock)
        sock.setblocking(False)
        return sock

    def _accept(self, listener, expect, nonces, theirs, deadline, timeout, liveness) -> None:
        assert listener is not None  # joined pairs above this rank need one
        while expect:
            now = time.monotonic()
            if now > deadline:
                raise self._setup_failed(
                    min(expect), f"peers {sorted(expect)} did not connect within {timeout:g} s",
                    liveness,
                )  # fmt: skip
            lost = dead_among(liveness, self.ranks)
            if lost:
                raise lost_error(self.rank, lost, expect, "while setting up streams")
            listener.settimeout(min(LIVENESS_POLL_S, max(deadline - now, 0.001)))
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            try:
                # Peers send their hello at once: a silent stranger holds the round 2 s.
                sock.settimeout(max(min(deadline - time.monotonic(), 2.0), 0.001))
                hello = _recv_exactly(sock, _HELLO)
            except (OSError, ConnectionError):
                sock.close()  # not one of ours, or gone: keep listening
                self.rejected += 1
                continue
            peer = int.from_bytes(hello[_NONCE:], "little")
            if peer not in expect or not hmac.compare_digest(hello[:_NONCE], nonces[peer]):
                sock.close()  # a stranger, or a replay: it never learns a thing
                self.rejected += 1
                continue
            try:
                sock.sendall(theirs[peer][3])
            except OSError:
                sock.close()
                continue
            _tune(sock)
            sock.setblocking(False)
            self._streams[peer] = sock
            expect.discard(peer)

    def _setup_failed(self, peer: int, why: str, liveness) -> Exception:
        lost = dead_among(liveness, self.ranks)
        if lost:
            return lost_error(self.rank, lost, [peer], "while setting up streams")
        return PeerTimeoutError(f"rank {self.rank}: socket route to peer {peer}: {why}")

    def start(
        self,
        sends: Mapping[int, RegionTable],
        recvs: Mapping[int, RegionTable],
        *,
        owners: Sequence[object],
        deadline: float,
        timeout: float,
        liveness: Liveness | None = None,
    ) -> NetPending:
        """Start moving each peer's regions over its stream (returns at once).

        Arguments:
            sends / recvs: per peer, the validated table (:func:`~nereus_comm.pack.region_table`
                or :func:`~nereus_comm.pack.columns_table`) of the regions whose bytes go
                out / come in, in wire order: both ends list the same bytes in the same
                order. The regions must not change (sends) or be read (recvs) until
                wait() returns.
            owners: objects that keep the tables' memory alive (their tensors); held
                until the exchange has ended.
            deadline: ``time.monotonic()`` by which all must be done.
            timeout: the exchange's timeout (for messages).
            liveness: asked while waiting.

        Raises:
            TransportArgumentError: the route broke earlier, a peer has no stream (call
                :meth:`prepare` first), or a table holds device memory; before any byte
                moves.
        """
        self._check_usable()
        missing = sorted((set(sends) | set(recvs)) - set(self._streams))
        if missing:
            raise TransportArgumentError(
                f"rank {self.rank} has no socket stream with peers {missing}; call prepare() "
                "with them first"
            )
        for t in (*sends.values(), *recvs.values()):
            if t.device is not None and t.device.type != "cpu":
                raise TransportArgumentError(
                    f"the socket route moves host memory, got regions on {t.device}"
                )
        ex = _C.NetExchange()
        jobs = []
        owners = list(owners)
        for send, per_peer in ((False, recvs), (True, sends)):
            for peer, t in per_peer.items():
                cols = np.stack([t.addr, t.num_rows, t.row_bytes, t.stride], axis=1)
                cols = np.ascontiguousarray(cols, dtype=np.int64).reshape(-1, 4)
                ex.add(self._streams[peer].fileno(), send, cols, owners)
                jobs.append(("send to" if send else "recv from", peer))
        ex.start()  # sends and receives on a thread each
        return NetPending(self, ex, jobs, deadline, timeout, liveness)
