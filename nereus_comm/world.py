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
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time

import torch.distributed as dist

from nereus_comm.errors import MembershipError

__all__ = ["World", "listen_store"]

_NS = "nereus/world/"


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


class _Watcher:
    """Heartbeat of one member plus its view of every other member's heartbeat."""

    def __init__(self, host: str, port: int, member_id: int, interval: float, timeout: float):
        self.interval = interval
        self.timeout = timeout
        self._member_id = member_id
        # A store client of its own: the main thread's may block in a collective.
        self._store = dist.TCPStore(
            host, port, is_master=False, timeout=datetime.timedelta(seconds=max(timeout, 5.0))
        )
        self._lock = threading.Lock()
        self._io = threading.Lock()  # one store client, two threads (beat and refresh)
        self._seen: dict[int, tuple[int, float]] = {}  # id -> (counter, when it last moved)
        self._left: set[int] = set()
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
            _add(self._store, f"member/{self._member_id}/hb", 1)
            num_ids = _add(self._store, "num_ids")
            now = time.monotonic()
            for m in range(num_ids):
                if m == self._member_id or m in known_left:
                    continue
                if _add(self._store, f"member/{m}/left"):
                    left.add(m)
                    continue
                updates[m] = _add(self._store, f"member/{m}/hb")
        with self._lock:
            self._left |= left
            for m, value in updates.items():
                old = self._seen.get(m)
                if old is None or old[0] != value:
                    self._seen[m] = (value, now)

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
    ) -> None:
        self._store = store
        self.host = host
        self.port = port
        self.member_id = member_id
        self._timeout = timeout
        self._generation = 0
        self._members: tuple[int, ...] = ()
        self._ever_listed: set[int] = set()
        self._closed = False
        store.set(_NS + f"member/{member_id}/info", f"{socket.gethostname()} {os.getpid()}")
        self._watcher = _Watcher(host, port, member_id, interval, hb_timeout)

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

        Returns:
            The World, in generation 1.

        Raises:
            ValueError: bad figures (min_members < 1, timeout <= interval, ...).
            MembershipError: the port cannot be bound, or members did not come in time.
        """
        if min_members < 1:
            raise ValueError(f"min_members must be >= 1; got {min_members}")
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
        store.set(_NS + "config", f"{heartbeat_interval} {heartbeat_timeout}")
        member_id = _add(store, "num_ids", 1) - 1
        assert member_id == 0, "a fresh store must give the creator id 0"
        world = cls(store, host, port, member_id, heartbeat_interval, heartbeat_timeout, timeout)
        try:
            world.wait_for_members(min_members, timeout=timeout)
            world.next_generation()
        except BaseException:
            world.leave()
            raise
        return world

    @classmethod
    def join(cls, host: str, port: int, *, timeout: float = 60.0, wait: bool = True) -> World:
        """Join a running job: register, start heartbeating, wait to be in a generation.

        Arguments:
            host: the address of the World's store (the creator's).
            port: its port.
            timeout: seconds to reach the store, and then to be taken into a generation.
            wait: if False, return once registered (call ``wait_until_admitted`` later).

        Returns:
            The World; with ``wait``, in the first generation that lists this process.

        Raises:
            MembershipError: the store at host:port could not be reached within
                ``timeout`` seconds, or no generation took this process in time.
        """
        try:
            store = dist.TCPStore(
                host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout)
            )
            config = store.get(_NS + "config").decode().split()
        except (RuntimeError, OSError, dist.DistStoreError) as e:
            raise MembershipError(
                f"could not reach the World's store at {host}:{port} within {timeout} s "
                f"(is the job running and the address right?): {e}"
            ) from e
        interval, hb_timeout = float(config[0]), float(config[1])
        hint = _add(store, "gen/latest")
        member_id = _add(store, "num_ids", 1) - 1
        world = cls(store, host, port, member_id, interval, hb_timeout, timeout)
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
            key = _NS + f"gen/{g}/members"
            if self._store.check([key]):
                members = _parse(self._store.get(key))
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
            timeout: seconds for the new group's rendezvous (default: the World's).

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
        key = _NS + f"gen/{g}/members"
        won = self._store.compare_set(key, "", ",".join(map(str, proposal)))
        members = _parse(won)
        if members == tuple(proposal):
            self._store.set(_NS + "gen/latest", str(g))
        if self.member_id not in members:
            self.leave()
            raise MembershipError(
                f"member {self.member_id} was left out of generation {g} (members {members}); "
                f"the others saw it as dead. Join again with World.join()"
            )
        self._enter(g, members, timeout)
        return g

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
            self._store.set(_NS + f"member/{self.member_id}/left", "1")
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
