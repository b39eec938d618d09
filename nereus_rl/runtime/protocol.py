"""Wire protocol between the driver and its workers.

Membership (joining, heartbeats, who is alive) is nereus_comm.world.World's:
the driver creates the World (member 0), each worker joins it (worker rank =
member id - 1) without entering a process-group generation.

Commands and replies travel through the job's key-value store (a
torch.distributed.TCPStore): the driver writes one pickled Command under
``cmd/<rank>/<seq>``, the worker blocks on that key, runs the command and
writes a pickled Reply under ``reply/<rank>/<seq>``. Bulk data never goes
through the store: workers move tensors among themselves over gloo groups.

A per-worker sequence number orders the commands of one worker, so a worker
runs its commands one at a time in the order the driver issued them.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

from nereus_comm.errors import MembershipError

PREFIX = "nereus/rt/"
SHUTDOWN_KEY = PREFIX + "shutdown"
# nereus_comm.world's registration counter (documented in its protocol): every
# process that ever joined took one id; the driver is member 0.
WORLD_NUM_IDS_KEY = "nereus/world/num_ids"


def rank_of_member(member_id: int) -> int:
    """Worker rank of a World member id (the driver is member 0, workers follow)."""
    return member_id - 1


def member_of_rank(rank: int) -> int:
    """World member id of a worker rank."""
    return rank + 1


def cmd_key(rank: int, seq: int) -> str:
    """Store key of the seq-th command sent to worker ``rank``."""
    return f"{PREFIX}cmd/{rank}/{seq}"


def reply_key(rank: int, seq: int) -> str:
    """Store key of the worker's reply to its seq-th command."""
    return f"{PREFIX}reply/{rank}/{seq}"


def info_key(rank: int) -> str:
    """Store key holding a joined worker's WorkerInfo."""
    return f"{PREFIX}worker/{rank}"


def group_prefix(group_id: int) -> str:
    """Store prefix under which the members of one gloo group rendezvous."""
    return f"{PREFIX}pg/{group_id}/"


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker tells the driver when it joins.

    Arguments:
        rank: global worker rank (the order of joining).
        host: host name of the worker's machine.
        pid: process id on that host.
        num_threads: intra-op threads the worker's torch uses.
    """

    rank: int
    host: str
    pid: int
    num_threads: int


@dataclass(frozen=True)
class Command:
    """One remote call: run the registered function ``fn`` with these arguments."""

    seq: int
    fn: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"Command(#{self.seq} {self.fn})"


@dataclass(frozen=True)
class Reply:
    """A worker's answer to one Command: a value, or the remote error and traceback."""

    seq: int
    rank: int
    ok: bool
    value: Any = None
    error_type: str = ""
    error: str = ""
    traceback: str = ""
    seconds: float = 0.0


def encode(obj: Any) -> bytes:
    """Serialize a Command, Reply or WorkerInfo for the store."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Any:
    """Inverse of encode."""
    return pickle.loads(data)


# The store's server refuses a value over 8 MiB (and drops the client that
# sent it), so larger messages travel as parts under key#0, key#1, ...
PART_BYTES = 4 << 20
_WHOLE, _PARTS = b"w", b"p"


def put(store, key: str, obj: Any) -> None:
    """Write ``obj`` under ``key``; the key appears last, after any parts.

    Arguments:
        store: the job's store.
        key: where the reader waits.
        obj: any picklable object, of any size.
    """
    data = encode(obj)
    if len(data) <= PART_BYTES:
        store.set(key, _WHOLE + data)
        return
    num_parts = 0
    for start in range(0, len(data), PART_BYTES):
        store.set(f"{key}#{num_parts}", data[start : start + PART_BYTES])
        num_parts += 1
    store.set(key, _PARTS + str(num_parts).encode())


def take(store, key: str) -> Any:
    """Read (and delete) what :func:`put` wrote under ``key``, which must exist."""
    head = store.get(key)
    store.delete_key(key)
    if head[:1] == _WHOLE:
        return decode(head[1:])
    parts = []
    for i in range(int(head[1:])):
        parts.append(store.get(f"{key}#{i}"))
        store.delete_key(f"{key}#{i}")
    return decode(b"".join(parts))


class RuntimeUserError(ValueError):
    """A runtime call was malformed (unknown worker, unknown command name)."""


class StoreUnreachableError(MembershipError):
    """The job's store could not be reached in time. The message names the address."""


class WorkerTimeoutError(TimeoutError):
    """Workers did not answer a command in time. ``ranks`` lists them."""

    def __init__(self, message: str, ranks: tuple[int, ...]) -> None:
        super().__init__(message)
        self.ranks = ranks


class WorkerLostError(RuntimeError):
    """A worker process died (or stopped its heartbeat). ``ranks`` lists the lost ones."""

    def __init__(self, message: str, ranks: tuple[int, ...]) -> None:
        super().__init__(message)
        self.ranks = ranks


class RemoteError(RuntimeError):
    """A command raised on a worker. Carries the worker's rank and remote traceback."""

    def __init__(self, rank: int, fn: str, error_type: str, error: str, traceback: str) -> None:
        super().__init__(
            f"worker {rank} failed in {fn!r}: {error_type}: {error}\n"
            f"--- remote traceback (worker {rank}) ---\n{traceback}"
        )
        self.rank = rank
        self.fn = fn
        self.error_type = error_type
        self.error = error
        self.remote_traceback = traceback
