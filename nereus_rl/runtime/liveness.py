"""Process-death detection in milliseconds: one held-open TCP connection per worker.

The World's heartbeat finds a dead worker only after ``heartbeat_timeout``
seconds of silence (30 s in the trainer's default), and the driver can poll the
process itself only for the workers it spawned. A worker started by hand on
another shell or machine would stall the job for that long. But a process that
dies, however it dies (SIGKILL, an abort, the OOM killer), has its sockets
closed by the kernel, and the other end of a TCP connection reads EOF (or
ECONNRESET) at once. So the driver runs a :class:`LivenessListener` and every
worker, spawned or joined (one code path for both), holds one connection to it
open for its whole life (:func:`connect`). When the connection ends without the
worker's goodbye, the listener marks that rank dead, and the driver's liveness
check publishes the abort notice as it does for a heartbeat loss.

The heartbeat stays the bound for what closes no socket: a hung process, a
machine that lost power or its network (no FIN, no RST reaches the driver).

Wire protocol (no pickle, fixed sizes, so there is nothing to parse but bytes):

1. the driver sends :data:`MAGIC` and a fresh random nonce (:data:`NONCE_BYTES`);
2. the worker answers its rank (8 bytes, big-endian) and
   ``HMAC-SHA256(secret, AUTH_LABEL || NUL || nonce || rank)``;
3. the driver checks the tag and that the rank is a registered World member
   without a connection yet, then answers :data:`ACK`;
4. the connection stays open; a worker that ends cleanly (told to exit, or the
   job is over) sends :data:`BYE` and closes.

A connection that fails any step (no secret, a wrong tag, a replayed answer, a
rank nobody registered or that already has a connection, more bytes than an
answer, silence past :data:`HANDSHAKE_TIMEOUT_S`) is closed and logged and
changes nothing: only an authenticated connection's end can mark a rank dead.
The nonce makes each answer good for one connection only, and the label keeps
the tag apart from the store messages' tags (nereus_rl.runtime.protocol).

The listener binds the same host address as the job's store (loopback by
default), on a port the OS picks, and the driver publishes the port sealed under
:data:`~nereus_rl.runtime.protocol.LIVENESS_KEY`; a worker connects to its store
host at that port. A worker that cannot (a firewall that passes only the store's
port) logs a warning and runs on, its death then seen by its heartbeat only.

A worker's connection must not outlive the worker: it is opened close-on-exec,
so processes the worker execs do not hold it, but a child *forked* by a worker
(fork-based multiprocessing) inherits it and would hide the worker's death
until the child exits.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from nereus_rl.runtime import protocol as P

#: Greeting the driver sends before its nonce (it names the protocol and its version).
MAGIC = b"NRLV1"
NONCE_BYTES = 32
RANK_BYTES = 8
#: The worker's answer: rank, then its tag.
HELLO_BYTES = RANK_BYTES + P.TAG_BYTES
ACK = b"OK"
BYE = b"B"
#: Binds the answer's tag to this use of the secret.
AUTH_LABEL = P.PREFIX + "liveness/auth"
#: Seconds a connection may take to authenticate before it is closed.
HANDSHAKE_TIMEOUT_S = 10.0
#: Unauthenticated connections held at once; more are closed as they arrive, so a
#: stranger cannot use up the listener's file descriptors.
MAX_PENDING = 64


def answer(secret: bytes, nonce: bytes, rank: int) -> bytes:
    """The worker's authenticated answer to the driver's ``nonce`` (HELLO_BYTES long)."""
    rank_bytes = int(rank).to_bytes(RANK_BYTES, "big")
    mac = hmac.new(secret, AUTH_LABEL.encode() + b"\0" + nonce + rank_bytes, hashlib.sha256)
    return rank_bytes + mac.digest()


@dataclass
class _Conn:
    sock: socket.socket
    peer: str
    nonce: bytes
    deadline: float
    buf: bytes = b""
    rank: int | None = None  # set once authenticated
    bye: bool = False
    noise_logged: bool = False


class LivenessListener:
    """The driver's end: accepts workers' connections and notices when one ends.

    Arguments:
        host: the address to listen on (the job's store's; only there).
        secret: the job's secret.
        num_ranks: how many worker ranks are registered now (a rank at or above it
            is refused); called on the listener's thread, for authenticated answers
            only, so it may do store traffic on a client of its own.
        on_death: called on the listener's thread with a rank whose connection
            ended without a goodbye (after it was recorded in :meth:`dead`); it must
            not block for long.

    Raises:
        OSError: ``host`` does not resolve or cannot be bound.

    Thread safety: the queries may be called from any thread; one daemon thread
    does all socket work. :meth:`close` stops it and closes every socket.
    """

    def __init__(
        self,
        host: str,
        secret: bytes,
        num_ranks: Callable[[], int],
        on_death: Callable[[int], None] | None = None,
    ) -> None:
        self._secret = secret
        self._num_ranks = num_ranks
        self._on_death = on_death
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        self._server = socket.socket(family, kind, proto)
        try:
            self._server.bind(addr)
            self._server.listen(socket.SOMAXCONN)
            self._server.setblocking(False)
        except OSError:
            self._server.close()
            raise
        self.address: tuple[str, int] = self._server.getsockname()[:2]
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, _Conn] = {}
        self._by_rank: dict[int, _Conn] = {}
        self._dead: set[int] = set()
        self._left: set[int] = set()
        self._deaths = 0
        self._rejected = 0
        self._expect_exit = False
        self._closed = False
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._server, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name="nereus-liveness", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        """The port the OS chose."""
        return self.address[1]

    # ------------------------------------------------------------ queries

    def dead(self) -> frozenset[int]:
        """Ranks whose connection ended without a goodbye (never blocks)."""
        with self._lock:
            return frozenset(self._dead)

    def left(self) -> frozenset[int]:
        """Ranks that said goodbye before closing (they ended cleanly)."""
        with self._lock:
            return frozenset(self._left)

    def connected(self) -> frozenset[int]:
        """Ranks holding an authenticated connection now."""
        with self._lock:
            return frozenset(self._by_rank) - self._dead - self._left

    @property
    def deaths(self) -> int:
        """How many deaths were seen so far: a waiter compares it to spot a new one cheaply."""
        return self._deaths

    @property
    def rejected(self) -> int:
        """How many connections were refused (unauthenticated, malformed, surplus)."""
        return self._rejected

    def expect_exit(self) -> None:
        """From now on a connection's end is an exit, not a death (the job is ending)."""
        with self._lock:
            self._expect_exit = True

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread, which closes every socket as it ends. Idempotent."""
        with self._lock:
            self._closed = True
            self._expect_exit = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass  # the thread ended already and closed it
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                P.log.warning("the liveness listener's thread did not stop within %g s", timeout)

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        try:
            while not self._closed:
                timeout = self._next_deadline()
                # New connections last: ends read first free their pending slots.
                events = self._sel.select(timeout)
                events.sort(key=lambda ev: ev[0].fileobj is self._server)
                for key, _ in events:
                    if self._closed:
                        break
                    if key.fileobj is self._server:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        try:
                            self._wake_r.recv(64)
                        except OSError:
                            pass
                    else:
                        conn = self._conns.get(key.fileobj)  # type: ignore[arg-type]
                        if conn is not None:
                            self._readable(conn)
                self._expire(time.monotonic())
        except Exception:  # never expected; detection then falls back to heartbeats
            P.log.exception("the liveness listener stopped; deaths are seen by heartbeat only")
        finally:
            # The thread alone touches the sockets, so it alone closes them.
            self._close_all()

    def _next_deadline(self) -> float | None:
        pending = [c.deadline for c in self._conns.values() if c.rank is None]
        if not pending:
            return None
        return max(0.0, min(pending) - time.monotonic())

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._server.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors, or the peer reset already
                P.log.warning("liveness listener: accept failed: %s", e)
                return
            peer = f"{addr[0]}:{addr[1]}"
            if sum(c.rank is None for c in self._conns.values()) >= MAX_PENDING:
                self._rejected += 1
                P.log.warning(
                    "liveness listener: refused %s: %d connections are already authenticating",
                    peer,
                    MAX_PENDING,
                )
                sock.close()
                continue
            sock.setblocking(False)
            nonce = secrets.token_bytes(NONCE_BYTES)
            conn = _Conn(sock, peer, nonce, time.monotonic() + HANDSHAKE_TIMEOUT_S)
            try:
                # A few bytes on a fresh connection: the kernel buffer takes them whole.
                sock.send(MAGIC + nonce)
            except OSError:
                sock.close()
                continue
            self._conns[sock] = conn
            self._sel.register(sock, selectors.EVENT_READ)

    def _readable(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            # ECONNRESET and the like: the peer is gone as surely as with EOF.
            if e.errno not in (errno.ECONNRESET, errno.ETIMEDOUT, errno.EPIPE):
                P.log.warning("liveness listener: reading from %s failed: %s", conn.peer, e)
            data = b""
        if not data:
            self._ended(conn)
            return
        if conn.rank is not None:
            if BYE in data:
                conn.bye = True
            elif not conn.noise_logged:
                conn.noise_logged = True
                P.log.warning(
                    "liveness listener: worker %d sent unexpected bytes; ignored", conn.rank
                )
            return
        conn.buf += data
        if len(conn.buf) > HELLO_BYTES:
            self._reject(conn, f"sent {len(conn.buf)} bytes, more than an answer")
        elif len(conn.buf) == HELLO_BYTES:
            self._authenticate(conn)

    def _authenticate(self, conn: _Conn) -> None:
        rank = int.from_bytes(conn.buf[:RANK_BYTES], "big")
        if not hmac.compare_digest(conn.buf, answer(self._secret, conn.nonce, rank)):
            self._reject(conn, "its answer has no valid tag under the job's secret")
            return
        try:
            registered = int(self._num_ranks())
        except Exception as e:  # a forged counter in the store, or the store is gone
            self._reject(conn, f"could not read the number of registered workers ({e})")
            return
        if rank >= registered:
            self._reject(conn, f"rank {rank} is not a registered worker ({registered} are)")
            return
        with self._lock:
            if rank in self._by_rank:
                duplicate = True
            else:
                duplicate = False
                conn.rank = rank
                self._by_rank[rank] = conn
        if duplicate:
            self._reject(conn, f"worker {rank} already has a connection")
            return
        conn.buf = b""
        try:
            conn.sock.send(ACK)
        except OSError:
            pass  # it died at once: the read that follows sees the end
        P.log.debug("liveness listener: worker %d connected from %s", rank, conn.peer)

    def _ended(self, conn: _Conn) -> None:
        self._drop(conn)
        if conn.rank is None:
            P.log.debug("liveness listener: %s closed before authenticating", conn.peer)
            return
        with self._lock:
            death = not (conn.bye or self._expect_exit)
            (self._dead if death else self._left).add(conn.rank)
            if death:
                self._deaths += 1
        if death:
            P.log.warning(
                "worker %d's liveness connection closed without a goodbye: it died", conn.rank
            )
            if self._on_death is not None:
                try:
                    self._on_death(conn.rank)
                except Exception:
                    P.log.exception("liveness listener: the death callback of %d failed", conn.rank)

    def _reject(self, conn: _Conn, why: str) -> None:
        self._rejected += 1
        P.log.warning("liveness listener: refused the connection from %s: %s", conn.peer, why)
        self._drop(conn)

    def _expire(self, now: float) -> None:
        for conn in list(self._conns.values()):
            if conn.rank is None and now > conn.deadline:
                self._reject(conn, f"no answer within {HANDSHAKE_TIMEOUT_S:g} s")

    def _drop(self, conn: _Conn) -> None:
        if self._conns.pop(conn.sock, None) is None:
            return
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _close_all(self) -> None:
        for conn in list(self._conns.values()):
            self._drop(conn)
        for sock in (self._server, self._wake_r, self._wake_w):
            try:
                self._sel.unregister(sock)
            except (KeyError, ValueError):
                pass
            sock.close()
        self._sel.close()


class LivenessConnection:
    """A worker's end: an authenticated connection held open until the worker ends.

    Use :func:`connect` to make one.
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    @property
    def peer(self) -> tuple[str, int]:
        """(address, port) of the driver's listener, as this socket sees it."""
        return self._sock.getpeername()[:2]

    def close(self, *, bye: bool = False) -> None:
        """Close the connection; ``bye``: tell the driver this is a clean end first."""
        if self._sock.fileno() < 0:
            return
        if bye:
            try:
                self._sock.sendall(BYE)
            except OSError:
                pass  # the driver is gone or closed its end: nobody to tell
        self._sock.close()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the driver closed the liveness connection")
        buf += chunk
    return buf


def connect(
    host: str, port: int, secret: bytes, rank: int, timeout: float = 10.0
) -> LivenessConnection:
    """Open and authenticate a worker's liveness connection to the driver at host:port.

    Arguments:
        host: the driver's address (the store's host, as the worker reaches it).
        port: the listener's port (published by the driver under ``LIVENESS_KEY``).
        secret: the job's secret.
        rank: this worker's rank.
        timeout: seconds for the whole handshake.

    Raises:
        OSError: the listener cannot be reached, or did not accept the answer in time
            (ConnectionError when it closed the connection: it refused the answer).
    """
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        greeting = _recv_exactly(sock, len(MAGIC) + NONCE_BYTES)
        if greeting[: len(MAGIC)] != MAGIC:
            raise ConnectionError(f"{host}:{port} is not a nereus liveness listener")
        sock.sendall(answer(secret, greeting[len(MAGIC) :], rank))
        if _recv_exactly(sock, len(ACK)) != ACK:
            raise ConnectionError(f"the liveness listener at {host}:{port} sent no ACK")
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    return LivenessConnection(sock)
