"""Live membership: processes join a running job, dead ones are noticed, and the
members that stay form a new generation of process groups without restarting.

Protocol (all keys under ``nereus/world/`` in one torch.distributed.TCPStore,
hosted by the process that calls ``World.create``):

- ``config``: ``"<heartbeat_interval> <heartbeat_timeout>"``, written by the creator;
  every member uses the same figures.
- ``num_ids``: a counter; a process registers by ``add(num_ids, 1)`` and takes the
  previous value as its member id (0 is the creator). Ids are never reused.
- ``member/<id>/info``: ``"<hostname> <pid>"``, for messages.
- ``member/<id>/hb``: a counter each member's heartbeat thread increments every
  ``heartbeat_interval`` seconds. Watchers compare values, never clocks: a member
  whose counter has not moved for ``heartbeat_timeout`` seconds of the watcher's
  own monotonic clock is dead. So clocks need not agree across hosts, and a
  death is seen within ``heartbeat_timeout + heartbeat_interval`` seconds (plus
  store latency); a live member is never reported dead unless its heartbeat
  thread stalls for ``heartbeat_timeout``.
- ``member/<id>/left``: set by ``leave()``; a member that left is not alive.
- ``gen/<g>/members``: the member ids of generation ``g`` in rank order (ascending
  ids, so the members that stay keep their relative order). Agreed by
  ``compare_set(key, "", proposal)``: the first proposal written wins and every
  other proposer reads and adopts it. A proposal is the proposer's view of the
  alive members of generation ``g - 1`` plus the alive registered processes that
  are in no generation yet (joiners).
- ``gen/latest``: a hint, never ahead of the truth, of the newest agreed
  generation; joiners start there and walk forward.
- ``gen/<g>/pg/``: the PrefixStore in which generation ``g``'s gloo process group
  rendezvouses (``init_process_group(store=...)``).

Generations: the creator waits for ``min_members`` registered processes and
agrees generation 1. A joiner registers, starts its heartbeat and waits until a
generation lists it. Members call ``next_generation()`` together at a safe
boundary (e.g. after ``membership_changed()`` or ``wait_for_members(n)``): each
proposes, one proposal wins, every listed process destroys its old default
process group and initialises the new one in place, as the default group, so
all torch.distributed calls (and ``new_group``) work on it; rank = position in
``gen/<g>/members``. A member missing from the winning proposal gets
MembershipError and leaves. If a listed process never arrives (it died between
proposal and rendezvous), the rendezvous times out with MembershipError and the
members may call ``next_generation()`` again.

The creator hosts the store: it must stay until the job ends. The store listens
on the address asked for and nowhere else (:func:`listen_store`): torch's own
TCPStore server binds every interface whatever host it is given.

Authentication (``secret=``): anyone who reaches the store's port can write it.
Without a secret the records above are plain text (nothing in them runs code),
but anyone can forge a heartbeat, a "left" flag or a proposal. With a per-job
secret (the same bytes in every member) every record the World writes is
``tag + text``, where ``tag = HMAC-SHA256(secret, key + b"\0" + text)`` over its
full store key, so a record is bound to the key it was written under. Every read
checks the tag (``hmac.compare_digest``) before parsing; a record that fails is
ignored, so it changes nothing, and logged (a warning on the ``nereus_comm.world``
logger) once per key. What changes with a secret:

- heartbeats: a counter kept by ``add`` cannot carry a tag, so each member
  ``set``-s its own ``member/<id>/hb`` to a tagged, strictly increasing counter, and
  a watcher counts a member as beating only when it reads a tagged value greater
  than the last it accepted: a replayed older (or the same) value changes nothing;
- ``config``, ``member/<id>/info``, ``member/<id>/left``, ``gen/latest`` and
  ``gen/<g>/members`` are tagged. A forged proposal found where a proposer wants
  to write its own is replaced by ``compare_set(key, forged, ours)``, which cannot
  overwrite a genuine proposal written meanwhile; a joiner waiting for a generation
  treats a forged one as not agreed yet;
- a joiner checks the tag of ``config`` before it takes an id: with another
  secret (or none) ``World.join`` raises MembershipError and leaves no trace but
  the warning. A process that writes records by hand without the secret is
  never alive, never a pending joiner, never in a proposal;
- reads never use ``add`` (which drops the connection of whoever adds to a value
  that is not an integer) nor a blocking ``get``: a non-blocking
  ``compare_set`` peek reads a key or learns that it is absent.

Not covered: ``num_ids`` stays a bare counter (ids are handed out atomically by
``add``), so a forged increment only uses up ids that are never alive; the gloo
rendezvous under ``gen/<g>/pg/`` is torch's own; and whoever reaches the store
can still delete or overwrite records, which denies service (a flood of
overwritten heartbeats makes a member look dead, an overwritten ``config`` stops
joiners) but never makes a World accept a record it did not get from a holder
of the secret.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import os
import socket
import threading
import time

import torch.distributed as dist

from nereus_comm.errors import MembershipError

__all__ = ["World", "listen_store"]

_NS = "nereus/world/"
_TAG_BYTES = 32  # HMAC-SHA256
_MIN_SECRET_BYTES = 16
# What a peek returns for an absent key: compare_set returns the expected value,
# without creating the key, when the key does not exist.
_ABSENT = b"\0nereus-world-absent"

log = logging.getLogger(__name__)


def listen_store(host: str, port: int = 0, *, timeout: float = 60.0) -> dist.TCPStore:
    """Host a TCPStore that listens on ``host`` only (loopback stays loopback).

    torch's TCPStore server binds the wildcard address (every interface, IPv6 and
    IPv4) whatever ``host`` says; here the listening socket is bound to ``host``
    first and handed to the server (``master_listen_fd``, libuv backend).

    Arguments:
        host: the address (or a name resolving to it) to listen on; "0.0.0.0" or
            "::" still mean every interface, when asked for.
        port: the port; 0 picks a free one (read ``store.port``).
        timeout: the store's timeout for blocking operations.

    Returns:
        The server's own store (a client of itself), listening.

    Raises:
        OSError: ``host`` does not resolve, or host:port cannot be bound (in use,
            not an address of this machine).
    """
    family, kind, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's server does
        sock.bind(addr)
        sock.listen(socket.SOMAXCONN)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    # The server owns the descriptor from here and closes it when the store goes (on
    # a failed start too, or not: closing it here could close a reused number).
    return dist.TCPStore(
        host,
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout),
        master_listen_fd=sock.detach(),
        use_libuv=True,
    )


def _add(store: dist.Store, key: str, value: int = 0) -> int:
    # add(key, 0) reads a counter without blocking, even before it exists.
    return int(store.add(_NS + key, value))


def _peek(store: dist.Store, key: str) -> bytes | None:
    """The value under ``_NS + key``, or None if there is none; never blocks.

    A get after a check could block until the store's timeout if the key were
    deleted in between, and add(key, 0) breaks the connection on a value that is
    not an integer: both are in reach of anyone who can write the store.
    """
    value = bytes(store.compare_set(_NS + key, _ABSENT, _ABSENT))
    return None if value == _ABSENT else value


class _Records:
    """How a World's records are written and read: plain text, or tagged under a secret.

    Shared by a World and its watcher (two store clients, two threads), so the
    once-per-key warnings are shared too.
    """

    def __init__(self, secret: bytes | None) -> None:
        if secret is not None:
            secret = bytes(secret)
            if len(secret) < _MIN_SECRET_BYTES:
                raise ValueError(
                    f"a World secret needs at least {_MIN_SECRET_BYTES} bytes, got {len(secret)}"
                )
        self._secret = secret
        self._lock = threading.Lock()
        self._warned: set[str] = set()

    @property
    def tagged(self) -> bool:
        """Whether records carry a tag (the World has a secret)."""
        return self._secret is not None

    def _tag(self, key: str, data: bytes) -> bytes:
        assert self._secret is not None
        # Store keys never contain NUL, so no (key, data) pair can be shifted into another.
        return hmac.new(self._secret, key.encode() + b"\0" + data, hashlib.sha256).digest()

    def seal(self, key: str, text: str) -> bytes:
        """The value to store under ``_NS + key`` for ``text``."""
        data = text.encode()
        return data if self._secret is None else self._tag(_NS + key, data) + data

    def open(self, key: str, value: bytes) -> str | None:
        """The text of a record read under ``_NS + key``; None (and a warning) if its tag fails."""
        value = bytes(value)
        if self._secret is None:
            return value.decode(errors="replace")
        data = value[_TAG_BYTES:]
        if len(value) < _TAG_BYTES or not hmac.compare_digest(
            value[:_TAG_BYTES], self._tag(_NS + key, data)
        ):
            self.reject(key, "its tag does not match this World's secret")
            return None
        return data.decode(errors="replace")

    def reject(self, key: str, why: str) -> None:
        """Log an ignored record, once per key: a forger rewriting it must not flood the log."""
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        log.warning(
            "ignored the record under %r: %s; it was not written by a member of this World "
            "and changes nothing (later rejections under this key are not logged again)",
            _NS + key,
            why,
        )

    def read(self, store: dist.Store, key: str) -> str | None:
        """Peek at ``_NS + key`` and open it: None if it is absent or rejected."""
        value = _peek(store, key)
        return None if value is None else self.open(key, value)


class _Watcher:
    """Heartbeat of one member plus its view of every other member's heartbeat."""

    def __init__(
        self,
        host: str,
        port: int,
        member_id: int,
        interval: float,
        timeout: float,
        records: _Records,
    ):
        self.interval = interval
        self.timeout = timeout
        self._member_id = member_id
        self._records = records
        # A store client of its own: the main thread's may block in a collective.
        self._store = dist.TCPStore(
            host, port, is_master=False, timeout=datetime.timedelta(seconds=max(timeout, 5.0))
        )
        self._lock = threading.Lock()
        self._io = threading.Lock()  # one store client, two threads (beat and refresh)
        self._seen: dict[int, tuple[int, float]] = {}  # id -> (counter, when it last moved)
        self._left: set[int] = set()
        self._beats = 0  # this member's tagged heartbeat counter
        self._num_ids = 0  # the last registration count read (tagged mode)
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._beat()
        self._thread = threading.Thread(target=self._run, name="nereus-world-heartbeat")
        self._thread.daemon = True
        self._thread.start()

    def _beat(self) -> None:
        updates = {}
        left = set()
        with self._lock:
            known_left = set(self._left)
        with self._io:
            self._send_heartbeat()
            num_ids = self._read_num_ids()
            now = time.monotonic()
            for m in range(num_ids):
                if m == self._member_id or m in known_left:
                    continue
                if self._has_left(m):
                    left.add(m)
                    continue
                value = self._heartbeat_of(m)
                if value is not None:
                    updates[m] = value
        tagged = self._records.tagged
        with self._lock:
            self._left |= left
            for m, value in updates.items():
                old = self._seen.get(m)
                if old is None or (value > old[0] if tagged else value != old[0]):
                    self._seen[m] = (value, now)
                elif tagged and value < old[0]:
                    # Only a replay goes back: each member writes its counter from one
                    # thread over one connection, always upwards.
                    self._records.reject(
                        f"member/{m}/hb", f"heartbeat {value} is older than {old[0]} (a replay)"
                    )

    def _send_heartbeat(self) -> None:
        key = f"member/{self._member_id}/hb"
        if not self._records.tagged:
            _add(self._store, key, 1)
            return
        self._beats += 1
        self._store.set(_NS + key, self._records.seal(key, str(self._beats)))

    def _read_num_ids(self) -> int:
        if not self._records.tagged:
            return _add(self._store, "num_ids")
        # Read, not add(key, 0): a forged non-integer value must not cost us the connection.
        value = _peek(self._store, "num_ids")
        try:
            self._num_ids = max(self._num_ids, int(value or b"0"))
        except ValueError:
            self._records.reject("num_ids", f"{value[:40]!r} is not a count")
        return self._num_ids

    def _has_left(self, m: int) -> bool:
        key = f"member/{m}/left"
        if not self._records.tagged:
            return bool(_add(self._store, key))
        return self._records.read(self._store, key) == "1"

    def _heartbeat_of(self, m: int) -> int | None:
        key = f"member/{m}/hb"
        if not self._records.tagged:
            return _add(self._store, key)
        text = self._records.read(self._store, key)
        if text is None:
            return None  # no heartbeat yet, or a forged one
        try:
            return int(text)
        except ValueError:
            self._records.reject(key, f"{text[:40]!r} is not a counter")
            return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
            except BaseException as e:  # the store went away: report it, stop beating
                self.error = e
                return

    def alive(self) -> frozenset[int]:
        now = time.monotonic()
        with self._lock:
            seen = {m for m, (_, t) in self._seen.items() if now - t < self.timeout}
            return frozenset(seen - self._left | {self._member_id})

    def known(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._seen) | {self._member_id}

    def refresh(self) -> None:
        """Look at the store now rather than at the next beat."""
        self._beat()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval + 5.0)


class World:
    """Membership of a running job over a TCPStore, with generations of gloo groups.

    Make one with ``World.create`` (the first process, hosts the store) or
    ``World.join`` (any later process). See the module docstring for the protocol.
    A World owns torch.distributed's default process group: each generation
    replaces it, so make at most one World per process.

    Example::

        world = World.create("127.0.0.1", 29500, min_members=2)  # or World.join(host, port)
        dist.all_reduce(t, group=world.process_group())
        if world.membership_changed():                          # at a safe boundary, on all
            world.next_generation()
    """

    def __init__(
        self,
        store: dist.TCPStore,
        host: str,
        port: int,
        member_id: int,
        interval: float,
        hb_timeout: float,
        timeout: float,
        records: _Records,
    ) -> None:
        self._store = store
        self._records = records
        self.host = host
        self.port = port
        self.member_id = member_id
        self._timeout = timeout
        self._generation = 0
        self._members: tuple[int, ...] = ()
        self._ever_listed: set[int] = set()
        self._closed = False
        self._infos: dict[int, tuple[str, int]] = {}
        key = f"member/{member_id}/info"
        store.set(_NS + key, records.seal(key, f"{socket.gethostname()} {os.getpid()}"))
        self._watcher = _Watcher(host, port, member_id, interval, hb_timeout, records)

    # -- making one -----------------------------------------------------------------

    @classmethod
    def create(
        cls,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        min_members: int = 1,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 10.0,
        timeout: float = 60.0,
        secret: bytes | None = None,
    ) -> World:
        """Host the store, become member 0, and form generation 1.

        Arguments:
            host: address to listen on, and only there (an interface's address for
                members on other machines: anyone who reaches it can write the store).
            port: port to listen on; 0 picks a free one (see ``world.port``).
            min_members: processes (this one included) generation 1 waits for.
            heartbeat_interval: seconds between heartbeats (for every member).
            heartbeat_timeout: seconds without a heartbeat after which a member is dead.
            timeout: seconds to wait for members and for a group's rendezvous.
            secret: the job's secret (at least 16 bytes, the same in every member): every
                record is tagged with it and every record read is checked (see the module
                docstring). None writes plain records, as for a private network.

        Returns:
            The World, in generation 1.

        Raises:
            ValueError: bad figures (min_members < 1, timeout <= interval, a short
                secret, ...).
            MembershipError: the port cannot be bound, or members did not come in time.
        """
        if min_members < 1:
            raise ValueError(f"min_members must be >= 1; got {min_members}")
        records = _Records(secret)
        if not 0 < heartbeat_interval < heartbeat_timeout:
            raise ValueError(
                f"need 0 < heartbeat_interval < heartbeat_timeout; got {heartbeat_interval} "
                f"and {heartbeat_timeout} (a timeout of several intervals avoids false deaths)"
            )
        try:
            store = listen_store(host, port, timeout=timeout)
        except (RuntimeError, OSError) as e:
            raise MembershipError(f"cannot host the World's store at {host}:{port}: {e}") from e
        port = store.port
        store.set(
            _NS + "config", records.seal("config", f"{heartbeat_interval} {heartbeat_timeout}")
        )
        member_id = _add(store, "num_ids", 1) - 1
        assert member_id == 0, "a fresh store must give the creator id 0"
        world = cls(
            store, host, port, member_id, heartbeat_interval, heartbeat_timeout, timeout, records
        )
        try:
            world.wait_for_members(min_members, timeout=timeout)
            world.next_generation()
        except BaseException:
            world.leave()
            raise
        return world

    @classmethod
    def join(
        cls,
        host: str,
        port: int,
        *,
        timeout: float = 60.0,
        wait: bool = True,
        secret: bytes | None = None,
    ) -> World:
        """Join a running job: register, start heartbeating, wait to be in a generation.

        Arguments:
            host: the address of the World's store (the creator's).
            port: its port.
            timeout: seconds to reach the store, and then to be taken into a generation.
            wait: if False, return once registered (call ``wait_until_admitted`` later).
            secret: the job's secret, as given to ``World.create``; None for a World
                without one.

        Returns:
            The World; with ``wait``, in the first generation that lists this process.

        Raises:
            ValueError: a secret shorter than 16 bytes.
            MembershipError: the store at host:port could not be reached within
                ``timeout`` seconds, its config is not tagged with ``secret`` (another
                job's secret, none where the World has one, or one where it has none;
                checked before this process takes an id), or no generation took this
                process in time.
        """
        records = _Records(secret)
        try:
            store = dist.TCPStore(
                host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout)
            )
            value = store.get(_NS + "config")
        except (RuntimeError, OSError, dist.DistStoreError) as e:
            raise MembershipError(
                f"could not reach the World's store at {host}:{port} within {timeout} s "
                f"(is the job running and the address right?): {e}"
            ) from e
        config = records.open("config", value)
        try:
            if config is None:
                raise ValueError("its tag does not match")
            interval, hb_timeout = map(float, config.split())
        except ValueError:
            raise MembershipError(
                f"the config of the World at {host}:{port} fails its check "
                f"{'under this secret' if records.tagged else 'without a secret'}: join with "
                f"the secret the World was created with (none if it has none)"
            ) from None
        if records.tagged:
            # A forged hint is ignored: walking forward from generation 1 is slow, not wrong.
            latest = records.read(store, "gen/latest")
            hint = int(latest) if latest is not None and latest.isdigit() else 0
        else:
            hint = _add(store, "gen/latest")
        member_id = _add(store, "num_ids", 1) - 1
        world = cls(store, host, port, member_id, interval, hb_timeout, timeout, records)
        world._generation = hint
        if wait:
            try:
                world.wait_until_admitted(timeout=timeout)
            except BaseException:
                world.leave()
                raise
        return world

    def wait_until_admitted(self, timeout: float | None = None) -> int:
        """Block until a generation lists this process, then enter it.

        Returns:
            The generation entered.

        Raises:
            MembershipError: none did within ``timeout`` seconds.
        """
        timeout = self._timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        g = self._generation + 1
        while True:
            members = self._read_generation(g)
            if members is not None:
                if self.member_id in members:
                    self._enter(g, members)
                    return g
                g += 1
                continue
            if time.monotonic() > deadline:
                raise MembershipError(
                    f"member {self.member_id} was not taken into a generation of the World at "
                    f"{self.host}:{self.port} within {timeout} s (did the members call "
                    f"next_generation()?)"
                )
            time.sleep(self._watcher.interval / 2)

    # -- what a member sees -------------------------------------------------------

    @property
    def generation(self) -> int:
        """The current generation (0 before the first)."""
        return self._generation

    @property
    def members(self) -> tuple[int, ...]:
        """Member ids of the current generation, in rank order."""
        return self._members

    @property
    def rank(self) -> int:
        """This process's rank in the current generation."""
        return self.rank_of(self.member_id)

    @property
    def size(self) -> int:
        """Number of members in the current generation."""
        return len(self._members)

    def rank_of(self, member: int) -> int:
        """The rank of ``member`` in the current generation.

        Raises:
            MembershipError: it is not a member of the current generation.
        """
        try:
            return self._members.index(member)
        except ValueError:
            raise MembershipError(
                f"member {member} is not in generation {self._generation} (members {self._members})"
            ) from None

    def process_group(self) -> dist.ProcessGroup:
        """The current generation's gloo process group (also the default group).

        Raises:
            MembershipError: no generation has been entered, or this World has left.
        """
        if self._generation == 0 or self._closed or not dist.is_initialized():
            raise MembershipError(
                f"member {self.member_id} has no process group: it is in no generation yet, "
                f"or it left"
            )
        return dist.group.WORLD

    def alive(self) -> frozenset[int]:
        """Ids of every registered process (members and joiners) whose heartbeat is alive."""
        self._check_watcher()
        return self._watcher.alive()

    def dead_members(self) -> frozenset[int]:
        """Members of the current generation that died or left."""
        return frozenset(self._members) - self.alive()

    def pending_joiners(self) -> frozenset[int]:
        """Alive processes that no generation has listed yet."""
        return self.alive() - frozenset(self._members) - self._ever_listed

    def membership_changed(self) -> bool:
        """Whether a member died or left, or a joiner waits: time for next_generation()."""
        return bool(self.dead_members() or self.pending_joiners())

    def wait_for_members(self, n: int, timeout: float | None = None) -> frozenset[int]:
        """Block until ``n`` processes (this one, members and joiners) are alive.

        Returns:
            The alive ids.

        Raises:
            MembershipError: fewer than ``n`` within ``timeout`` seconds.
        """
        timeout = self._timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            self._watcher.refresh()
            alive = self.alive()
            if len(alive) >= n:
                return alive
            if time.monotonic() > deadline:
                raise MembershipError(
                    f"only {len(alive)} of {n} processes joined the World at "
                    f"{self.host}:{self.port} within {timeout} s (alive: {sorted(alive)})"
                )
            time.sleep(self._watcher.interval / 2)

    # -- changing generation ----------------------------------------------------------

    def next_generation(self, *, timeout: float | None = None) -> int:
        """Agree on the next generation and enter it (every staying member calls this).

        The proposal is the alive members plus the alive joiners; the first
        proposal stored wins. The old process group is destroyed and the new one
        initialised in this process: nothing restarts.

        Arguments:
            timeout: seconds to agree on it and for the new group's rendezvous (default:
                the World's).

        Returns:
            The new generation number.

        Raises:
            MembershipError: this process is not in the winning proposal (it then
                leaves), or a listed process did not arrive in time.
        """
        self._check_watcher()
        self._watcher.refresh()
        g = self._generation + 1
        # Members and joiners the proposer can see; a member we already lost stays out.
        alive = self.alive()
        proposal = sorted((alive & frozenset(self._members)) | self.pending_joiners())
        members = self._agree(g, tuple(proposal), self._timeout if timeout is None else timeout)
        if members == tuple(proposal):
            self._store.set(_NS + "gen/latest", self._records.seal("gen/latest", str(g)))
        if self.member_id not in members:
            self.leave()
            raise MembershipError(
                f"member {self.member_id} was left out of generation {g} (members {members}); "
                f"the others saw it as dead. Join again with World.join()"
            )
        self._enter(g, members, timeout)
        return g

    def _read_generation(self, g: int) -> tuple[int, ...] | None:
        """The agreed members of generation ``g``; None while none is (a forged one is not)."""
        key = f"gen/{g}/members"
        if not self._records.tagged:
            full = _NS + key
            return _parse(self._store.get(full)) if self._store.check([full]) else None
        text = self._records.read(self._store, key)
        return None if text is None else _parse(text)

    def _agree(self, g: int, proposal: tuple[int, ...], timeout: float) -> tuple[int, ...]:
        """Write ``proposal`` as generation ``g`` unless one is there already; the winner."""
        key = f"gen/{g}/members"
        ours = self._records.seal(key, ",".join(map(str, proposal)))
        expected = b""  # the key is absent
        deadline = time.monotonic() + timeout
        tries = 0
        while True:
            current = bytes(self._store.compare_set(_NS + key, expected, ours))
            text = self._records.open(key, current)
            if text is not None:
                return _parse(text)
            # A forged record sits where proposals go. Replace exactly that value: a
            # genuine proposal written over it meanwhile then wins instead of ours.
            if time.monotonic() > deadline:
                raise MembershipError(
                    f"generation {g} could not be agreed within {timeout} s: the store keeps "
                    f"holding records under {_NS + key!r} that no member wrote"
                )
            tries += 1
            if tries > 2:
                time.sleep(min(0.05, self._watcher.interval / 4))
            # compare_set answers `expected` itself when the key is absent (the forgery
            # was deleted): then propose as on an empty key.
            expected = b"" if current == expected else current

    def member_info(self, member: int) -> tuple[str, int] | None:
        """Host name and process id of a registered process, from its info record.

        Returns:
            (host, pid); None if ``member`` wrote none, or (with a secret) its record
            failed the check.
        """
        if member in self._infos:
            return self._infos[member]
        key = f"member/{member}/info"
        text = self._records.read(self._store, key)
        host, _, pid = (text or "").rpartition(" ")
        if not host or not pid.isdigit():
            return None
        # A process writes its info once, before its first heartbeat: keep the first
        # accepted one, so a later overwrite changes nothing.
        self._infos[member] = (host, int(pid))
        return self._infos[member]

    def _enter(self, g: int, members: tuple[int, ...], timeout: float | None = None) -> None:
        timeout = self._timeout if timeout is None else timeout
        if dist.is_initialized():
            dist.destroy_process_group()
        store = dist.PrefixStore(_NS + f"gen/{g}/pg/", self._store)
        try:
            dist.init_process_group(
                "gloo",
                store=store,
                rank=members.index(self.member_id),
                world_size=len(members),
                timeout=datetime.timedelta(seconds=timeout),
            )
        except (RuntimeError, dist.DistError) as e:
            # Keep the old members: a retry proposes the alive ones again, as g + 1.
            self._generation = g
            raise MembershipError(
                f"generation {g} (members {members}) did not form within {timeout} s: a listed "
                f"process may have died; call next_generation() again: {e}"
            ) from e
        self._generation, self._members = g, members
        self._ever_listed |= set(members)

    def leave(self) -> None:
        """Leave the job: stop heartbeating, mark this member left, drop the process group."""
        if self._closed:
            return
        self._closed = True
        self._watcher.stop()
        try:
            key = f"member/{self.member_id}/left"
            self._store.set(_NS + key, self._records.seal(key, "1"))
        except (RuntimeError, dist.DistError):
            pass  # the store is gone already: nobody is left to tell
        if dist.is_initialized():
            dist.destroy_process_group()

    def _check_watcher(self) -> None:
        if self._watcher.error is not None:
            raise MembershipError(
                f"lost the World's store at {self.host}:{self.port}: {self._watcher.error}"
            )

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc: object) -> None:
        self.leave()

    def __repr__(self) -> str:
        return (
            f"World({self.host}:{self.port}, member {self.member_id}, generation "
            f"{self._generation}, members {self._members})"
        )


def _parse(value: bytes | str) -> tuple[int, ...]:
    text = value.decode() if isinstance(value, bytes) else value
    return tuple(int(m) for m in text.split(",") if m)
