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

Aborts: when the driver learns that workers died it writes an AbortNotice under
``abort/<epoch>`` (epochs 1, 2, ...); every worker's abort watcher waits for the
next epoch's key on a store connection of its own and breaks the gloo connections
of the command it is running (nereus_rl.runtime.abort), so survivors stop waiting
on each other at once instead of at their group timeout.

Liveness: besides its World heartbeat, every worker holds one TCP connection to
the driver's liveness listener open (port under :data:`LIVENESS_KEY`, sealed), so
the driver sees a worker process die the moment the kernel closes it
(nereus_rl.runtime.liveness).

Authentication: anyone who reaches the store's port can read and write it, and a
pickle runs code when loaded. So every message (Command, Reply, WorkerInfo,
AbortNotice) carries an HMAC-SHA256 tag, under the job's secret, over its store
key and its bytes, and the reader checks the tag before it unpickles anything: a message
from someone without the secret is rejected (logged with its key) and changes
nothing, and a genuine message copied under another key fails its check. The
driver generates the secret (:func:`new_secret`), hands it to the workers it
spawns through their environment (:data:`SECRET_ENV`), and writes it to a file
only its user can read (:func:`secret_file_for`) for the operator to give to
workers started by hand (``--secret-file PATH``). :data:`AUTH_KEY` lets a worker
check, before it joins, that it holds this job's secret.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import os
import pickle
import re
import secrets
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nereus_comm.errors import MembershipError

PREFIX = "nereus/rt/"
SHUTDOWN_KEY = PREFIX + "shutdown"
# A nonce and its tag under the job's secret: a worker checks its secret here before joining.
AUTH_KEY = PREFIX + "auth"
#: The port of the driver's liveness listener (an int, sealed; nereus_rl.runtime.liveness).
LIVENESS_KEY = PREFIX + "liveness"
#: Environment variable holding the job's secret (hex) for a worker.
SECRET_ENV = "NEREUS_JOB_SECRET"
SECRET_BYTES = 32
TAG_BYTES = 32  # HMAC-SHA256

log = logging.getLogger("nereus_rl.runtime")
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


def abort_key(epoch: int) -> str:
    """Store key of the driver's ``epoch``-th :class:`AbortNotice` (epochs count from 1)."""
    return f"{PREFIX}abort/{epoch}"


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
    # The driver's abort epoch when it sent this command: aborts up to it happened
    # before the command began, so they never break the connections it makes.
    abort_epoch: int = 0

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


@dataclass(frozen=True)
class AbortNotice:
    """The driver's word that workers died: survivors abort their in-flight collectives.

    Written (sealed) under :func:`abort_key` of its epoch, one notice per liveness
    check that found new losses (see nereus_rl.runtime.abort for what a worker does).

    Arguments:
        epoch: 1 for the job's first notice, then one more per notice.
        lost: every worker rank lost so far (ranks are never reused).
        new: the ranks this notice is the first to name.
    """

    epoch: int
    lost: tuple[int, ...]
    new: tuple[int, ...]


def encode(obj: Any) -> bytes:
    """Serialize a Command, Reply, WorkerInfo or AbortNotice (unauthenticated: see
    :func:`seal`)."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


# The store's server refuses a value over 8 MiB (and drops the client that
# sent it), so larger messages travel as parts under key#0, key#1, ...
PART_BYTES = 4 << 20
_WHOLE, _PARTS = b"w", b"p"
# A forged head cannot make a reader wait on parts that never come: it must name
# parts that all exist, and no more than a message of 64 GiB would have.
_MAX_PARTS = (64 << 30) // PART_BYTES


class UnauthenticatedMessageError(ValueError):
    """A message under ``key`` had no valid tag under the job's secret; it was not loaded.

    ``head`` is the value read under ``key`` (left in the store as it was).
    """

    def __init__(self, key: str, head: bytes) -> None:
        super().__init__(
            f"rejected the message under {key!r}: its authentication tag is missing or wrong "
            "(it was not written with this job's secret); it was not loaded"
        )
        self.key = key
        self.head = head


class JobSecretError(ValueError):
    """A worker has no usable job secret, or not this job's."""


def new_secret() -> bytes:
    """A fresh per-job secret (32 random bytes)."""
    return secrets.token_bytes(SECRET_BYTES)


def tag(secret: bytes, key: str, data: bytes) -> bytes:
    """HMAC-SHA256 of ``data`` bound to the store ``key`` it travels under."""
    # Keys never contain NUL, so key and data cannot be shifted into each other.
    return hmac.new(secret, key.encode() + b"\0" + data, hashlib.sha256).digest()


def seal(secret: bytes, key: str, obj: Any) -> bytes:
    """The value to store under ``key`` for a small ``obj``: a tag, then its pickle."""
    data = encode(obj)
    return _WHOLE + tag(secret, key, data) + data


def unseal(secret: bytes, key: str, value: bytes) -> Any:
    """Check the tag of a :func:`seal`-ed value, then unpickle it.

    Raises:
        UnauthenticatedMessageError: the tag is missing or wrong (nothing was unpickled).
    """
    value = bytes(value)
    data = value[1 + TAG_BYTES :]
    if value[:1] != _WHOLE or not hmac.compare_digest(
        value[1 : 1 + TAG_BYTES], tag(secret, key, data)
    ):
        raise UnauthenticatedMessageError(key, value)
    return pickle.loads(data)


def put(store, key: str, obj: Any, secret: bytes) -> None:
    """Write ``obj`` under ``key``, tagged with the job's secret; the key appears last.

    Arguments:
        store: the job's store.
        key: where the reader waits.
        obj: any picklable object, of any size.
        secret: the job's secret.
    """
    data = encode(obj)
    mac = tag(secret, key, data)
    if len(data) <= PART_BYTES:
        store.set(key, _WHOLE + mac + data)
        return
    num_parts = 0
    for start in range(0, len(data), PART_BYTES):
        store.set(f"{key}#{num_parts}", data[start : start + PART_BYTES])
        num_parts += 1
    store.set(key, _PARTS + mac + str(num_parts).encode())


def take(store, key: str, secret: bytes, *, known_bad: bytes | None = None) -> Any:
    """Read (and delete) what :func:`put` wrote under ``key``, which must exist.

    The tag is checked before anything is unpickled. A rejected message is logged
    (a warning naming the key) and left in the store: deleting it could delete a
    genuine message written over it meanwhile.

    Arguments:
        known_bad: a head rejected before; if the key still holds it, it is rejected
            again without a second warning.

    Raises:
        UnauthenticatedMessageError: the message's tag is missing or wrong.
    """
    head = bytes(store.get(key))
    if known_bad is not None and head == known_bad:
        raise UnauthenticatedMessageError(key, head)
    mac = head[1 : 1 + TAG_BYTES]
    if head[:1] == _WHOLE and len(head) > TAG_BYTES:
        data = head[1 + TAG_BYTES :]
        part_keys: list[str] = []
    elif head[:1] == _PARTS and head[1 + TAG_BYTES :].isdigit():
        num_parts = int(head[1 + TAG_BYTES :])
        part_keys = [f"{key}#{i}" for i in range(num_parts)]
        if 0 < num_parts <= _MAX_PARTS and store.check(part_keys):
            data = b"".join(bytes(store.get(k)) for k in part_keys)
        else:
            data = None
    else:
        data = None
    if data is None or not hmac.compare_digest(mac, tag(secret, key, data)):
        err = UnauthenticatedMessageError(key, head)
        log.warning("%s", err)
        raise err
    store.delete_key(key)
    for k in part_keys:
        store.delete_key(k)
    return pickle.loads(data)


# ---------------------------------------------------------------- the job's secret


def publish_secret_check(store, secret: bytes) -> None:
    """Write :data:`AUTH_KEY`: a nonce and its tag, so workers can check their secret."""
    nonce = secrets.token_bytes(16)
    store.set(AUTH_KEY, nonce + tag(secret, AUTH_KEY, nonce))


def check_job_secret(store, secret: bytes, address: str, timeout: float = 10.0) -> None:
    """Check that ``secret`` is the secret of the job whose store this is.

    Arguments:
        timeout: seconds to wait for the driver's check value (it writes it right
            after its store starts).

    Raises:
        JobSecretError: it is not (or the store holds no check value in time).
    """
    try:
        store.wait([AUTH_KEY], datetime.timedelta(seconds=timeout))
        value = bytes(store.get(AUTH_KEY))
    except RuntimeError:  # no check value: not a nereus job's store
        value = b""
    nonce, mac = value[:16], value[16:]
    if len(nonce) < 16 or not hmac.compare_digest(mac, tag(secret, AUTH_KEY, nonce)):
        raise JobSecretError(
            f"the secret given is not the secret of the job at {address}; pass the file its "
            "driver wrote (nereus-rl train prints its path) with --secret-file PATH"
        )


def parse_secret(text: str | bytes, where: str) -> bytes:
    """The secret from its hex form (as written by :func:`write_secret_file`).

    Raises:
        JobSecretError: ``text`` is not 64 hex digits (``where`` names its source).
    """
    if isinstance(text, bytes):
        text = text.decode("ascii", "replace")
    text = text.strip()
    if not re.fullmatch(rf"[0-9a-fA-F]{{{2 * SECRET_BYTES}}}", text):
        raise JobSecretError(
            f"{where} does not hold a job secret ({2 * SECRET_BYTES} hex digits); use the file "
            "the job's driver wrote (nereus-rl train prints its path)"
        )
    return bytes.fromhex(text)


def load_secret(secret_file: str | os.PathLike | None = None) -> bytes:
    """A worker's job secret: from ``secret_file``, else from ``$NEREUS_JOB_SECRET``.

    Raises:
        JobSecretError: neither is given, the file cannot be read, others may read it,
            or it does not hold a secret.
    """
    if secret_file is not None:
        path = Path(secret_file)
        try:
            st = path.stat()
            text = path.read_bytes()
        except OSError as e:
            raise JobSecretError(f"cannot read the secret file {str(path)!r}: {e}") from None
        if st.st_mode & 0o077:
            raise JobSecretError(
                f"the secret file {str(path)!r} can be read by other users (mode "
                f"{stat.S_IMODE(st.st_mode):o}); run `chmod 600 {path}` first"
            )
        return parse_secret(text, f"the secret file {str(path)!r}")
    if os.environ.get(SECRET_ENV):
        return parse_secret(os.environ[SECRET_ENV], f"${SECRET_ENV}")
    raise JobSecretError(
        "a worker needs its job's secret: pass --secret-file PATH (the file the driver "
        f"wrote; nereus-rl train prints its path) or set {SECRET_ENV}"
    )


def secret_file_for(host: str, port: int) -> Path:
    """Where the driver of the store at host:port writes its secret for the operator.

    A per-user folder (mode 0700) under the temporary directory.
    """
    safe_host = re.sub(r"[^A-Za-z0-9.-]", "_", host)
    return Path(tempfile.gettempdir()) / f"nereus-{os.getuid()}" / f"job-{safe_host}-{port}.secret"


def write_secret_file(path: Path, secret: bytes) -> Path:
    """Write ``secret`` (hex) to ``path``, readable by this user only.

    Raises:
        JobSecretError: the folder is not this user's alone (another user made it, or
            it is a link), so the secret would not be private there.
    """
    folder = path.parent
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise JobSecretError(
            f"{str(folder)!r} is not a folder only this user can use; remove it (or set "
            "TMPDIR to a private folder) and start again"
        )
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(secret.hex() + "\n")
    return path


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
