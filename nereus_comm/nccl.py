"""Finding and loading NCCL at run time.

The native core declares the small slice of NCCL's C ABI it calls and opens
``libnccl.so.2`` with ``dlopen`` when first asked, so nothing about NCCL or CUDA
is needed to build or import nereus_comm. Where the library is looked for, in
order:

1. the environment variable ``NEREUS_NCCL_PATH`` (the library file, or a folder
   holding ``libnccl.so.2``);
2. the ``nvidia-nccl-cu12`` and ``nvidia-nccl-cu13`` wheels
   (``nvidia/nccl/lib`` under each site-packages folder);
3. torch's own ``lib`` folder;
4. the system: ``ctypes.util.find_library("nccl")`` (ldconfig), the folders of
   ``LD_LIBRARY_PATH`` and the usual system library folders.

Communicators, CUDA streams and device pointers cross as plain integers.

Example::

    lib = load_nccl()
    uid = lib.get_unique_id()          # share with the other ranks, e.g. via a Store
    comm = lib.comm_init_rank(nranks, uid, rank)
    lib.group_send_recv(comm, [(peer, t.data_ptr(), t.nbytes)], [], stream)
"""

from __future__ import annotations

import ctypes.util
import functools
import importlib.util
import os
import site
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from nereus_comm import _C
from nereus_comm.errors import NcclNotFoundError, TransportError

__all__ = [
    "NCCL_UNIQUE_ID_BYTES",
    "NcclError",
    "NcclLibrary",
    "candidate_paths",
    "find_nccl",
    "load_nccl",
]

LIBRARY_NAME = "libnccl.so.2"
NCCL_UNIQUE_ID_BYTES = 128
NCCL_IN_PROGRESS = 7  # ncclInProgress, as returned by comm_get_async_error
ENV_VAR = "NEREUS_NCCL_PATH"
# Both wheels install nvidia/nccl/lib; CUDA 13 wheels may also use nvidia/cu13/lib.
_WHEEL_SUBDIRS = (
    ("nvidia-nccl-cu12/cu13 wheel", ("nvidia", "nccl", "lib")),
    ("nvidia-nccl-cu13 wheel", ("nvidia", "cu13", "lib")),
)
_SYSTEM_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/local/cuda/lib64",
    "/usr/lib64",
    "/usr/local/lib",
    "/usr/lib",
)

_NONE_REGISTERED = "<no libnccl registered>"

P2pOp = tuple[int, int, int]
"""One transfer: (peer rank in the communicator, device pointer, bytes)."""


class NcclError(TransportError):
    """An NCCL call failed; the message carries NCCL's own error text."""


def _site_dirs() -> list[str]:
    dirs: list[str] = []
    try:
        dirs.extend(site.getsitepackages())
    except AttributeError:  # virtualenvs built by old tools lack it
        pass
    user = site.getusersitepackages() if hasattr(site, "getusersitepackages") else None
    if isinstance(user, str):
        dirs.append(user)
    dirs.extend(p for p in sys.path if p.endswith(("site-packages", "dist-packages")))
    return list(dict.fromkeys(dirs))


def _torch_lib_dir() -> str | None:
    # find_spec does not import torch: loading NCCL must not drag torch in first.
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(next(iter(spec.submodule_search_locations)), "lib")


def candidate_paths(
    env: dict[str, str] | None = None,
    site_dirs: Sequence[str] | None = None,
    torch_lib_dir: str | bool | None = True,
    system: bool = True,
) -> list[tuple[str, str]]:
    """List the places NCCL is looked for, in search order.

    Arguments:
        env: environment to read ``NEREUS_NCCL_PATH`` and ``LD_LIBRARY_PATH`` from
            (default ``os.environ``).
        site_dirs: site-packages folders to look for the nvidia-nccl wheels in
            (default: this interpreter's).
        torch_lib_dir: torch's lib folder; True = find it, None/False = skip.
        system: whether to add ldconfig's answer and the system folders.

    Returns:
        ``(where, path)`` pairs: ``where`` says which rule produced the path.
        Paths need not exist; a bare soname (from ldconfig) is resolved by dlopen.
    """
    env = os.environ if env is None else env
    out: list[tuple[str, str]] = []
    override = env.get(ENV_VAR)
    if override:
        path = Path(override)
        out.append((f"${ENV_VAR}", str(path / LIBRARY_NAME if path.is_dir() else path)))
    for base in _site_dirs() if site_dirs is None else site_dirs:
        for where, parts in _WHEEL_SUBDIRS:
            out.append((where, os.path.join(base, *parts, LIBRARY_NAME)))
    if torch_lib_dir is True:
        torch_lib_dir = _torch_lib_dir()
    if torch_lib_dir:
        out.append(("torch's lib folder", os.path.join(torch_lib_dir, LIBRARY_NAME)))
    if system:
        found = ctypes.util.find_library("nccl")
        out.append(("ldconfig (ctypes.util.find_library)", found or _NONE_REGISTERED))
        for d in env.get("LD_LIBRARY_PATH", "").split(os.pathsep):
            if d:
                out.append(("LD_LIBRARY_PATH", os.path.join(d, LIBRARY_NAME)))
        for d in _SYSTEM_DIRS:
            out.append(("system folder", os.path.join(d, LIBRARY_NAME)))
    return out


def _exists(path: str) -> bool:
    # A bare soname ("libnccl.so.2") came from ldconfig: dlopen knows where it is.
    if path == _NONE_REGISTERED:
        return False
    return os.sep not in path or os.path.isfile(path)


def find_nccl(**kwargs: object) -> str:
    """Return the path of the first NCCL library found (see the module docstring).

    Arguments:
        kwargs: passed to :func:`candidate_paths` (for tests).

    Returns:
        A path to ``libnccl.so.2`` (or a soname that dlopen resolves).

    Raises:
        NcclNotFoundError: none of the places holds the library; the message lists them.
    """
    places = candidate_paths(**kwargs)  # type: ignore[arg-type]
    for _, path in places:
        if _exists(path):
            return path
    raise NcclNotFoundError(_not_found_message([(w, p, "not found") for w, p in places]))


def _not_found_message(tried: Iterable[tuple[str, str, str]]) -> str:
    lines = [f"  {where}: {path} ({why})" for where, path, why in tried]
    return (
        f"could not load NCCL ({LIBRARY_NAME}). Tried, in order:\n"
        + "\n".join(lines)
        + f"\nInstall it (pip install nvidia-nccl-cu12) or set {ENV_VAR} to the library's path."
    )


class NcclLibrary:
    """One loaded NCCL library.

    Thin, checked wrappers over the NCCL entry points; every failure raises
    :class:`NcclError` with NCCL's own text. Calls that wait on other ranks
    (init, split, shrink, grow, send/recv group) release the GIL.
    """

    def __init__(self, core: _C.NcclLibrary) -> None:
        self._lib = core
        self.path: str = core.path
        self.version: int = core.version
        self.has_shrink: bool = core.has_shrink
        self.has_grow: bool = core.has_grow

    def __repr__(self) -> str:
        return (
            f"NcclLibrary({self.version_string}, path={self.path!r}, "
            f"shrink={self.has_shrink}, grow={self.has_grow})"
        )

    @property
    def version_string(self) -> str:
        """The version as ``major.minor.patch`` (codes are 10000*major + 100*minor + patch)."""
        v = self.version
        if v < 10000:  # NCCL <= 2.8 used 1000*major + 100*minor + patch
            return f"{v // 1000}.{v % 1000 // 100}.{v % 100}"
        return f"{v // 10000}.{v % 10000 // 100}.{v % 100}"

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except _C.NcclError as e:
            raise NcclError(str(e)) from None

    def get_unique_id(self) -> bytes:
        """Return a fresh 128-byte id that all ranks of a new communicator must share."""
        return self._call(self._lib.get_unique_id)

    def comm_init_rank(self, nranks: int, unique_id: bytes, rank: int) -> int:
        """Create this process's rank of a communicator; blocks until all nranks join.

        Arguments:
            nranks: ranks in the communicator.
            unique_id: the bytes of one rank's :meth:`get_unique_id`, shared by all.
            rank: this process's rank in [0, nranks).

        Returns:
            The communicator handle (an integer).

        Raises:
            NcclError: NCCL failed (no device, peers mismatched, ...).
            ValueError: rank out of range or an id of the wrong length.
        """
        return self._call(self._lib.comm_init_rank, nranks, unique_id, rank)

    def comm_split(self, comm: int, color: int, key: int) -> int:
        """Split comm: ranks passing the same color share a new communicator, ordered by key.

        Returns:
            The new communicator, or 0 when color is -1 (NCCL_SPLIT_NOCOLOR).
        """
        return self._call(self._lib.comm_split, comm, color, key)

    def comm_shrink(
        self, comm: int, exclude_ranks: Sequence[int], abort_pending: bool = False
    ) -> int:
        """Return a new communicator without the given ranks (NCCL >= 2.27).

        Arguments:
            comm: the parent communicator (every surviving rank calls this).
            exclude_ranks: ranks of comm to leave out (e.g. the dead ones).
            abort_pending: NCCL_SHRINK_ABORT: abort the parent's pending work first
                (use when a rank died mid-operation).

        Raises:
            NcclError: the library lacks ncclCommShrink, or the call failed.
        """
        return self._call(self._lib.comm_shrink, comm, list(exclude_ranks), abort_pending)

    def comm_get_unique_id(self, comm: int) -> bytes:
        """Return the id the root of a grow hands to the joining ranks (NCCL >= 2.28)."""
        return self._call(self._lib.comm_get_unique_id, comm)

    def comm_grow(self, comm: int, nranks: int, unique_id: bytes | None, rank: int) -> int:
        """Grow a communicator to nranks ranks (NCCL >= 2.28).

        Arguments:
            comm: the existing communicator (0 on a joining rank).
            nranks: the size of the new communicator.
            unique_id: the root's :meth:`comm_get_unique_id`: passed by the root and
                by joining ranks; None on existing non-root ranks.
            rank: -1 on existing ranks, the assigned new rank on joining ones.

        Returns:
            The new communicator.
        """
        return self._call(self._lib.comm_grow, comm, nranks, unique_id or b"", rank)

    def comm_destroy(self, comm: int) -> None:
        """Free a communicator whose work has finished."""
        self._call(self._lib.comm_destroy, comm)

    def comm_abort(self, comm: int) -> None:
        """Free a communicator and abort its pending operations (a peer died)."""
        self._call(self._lib.comm_abort, comm)

    def comm_get_async_error(self, comm: int) -> int:
        """Return the communicator's asynchronous state (0 fine, 7 in progress, else error)."""
        return self._call(self._lib.comm_get_async_error, comm)

    def comm_count(self, comm: int) -> int:
        """Return the number of ranks in comm."""
        return self._call(self._lib.comm_count, comm)

    def comm_user_rank(self, comm: int) -> int:
        """Return this process's rank in comm."""
        return self._call(self._lib.comm_user_rank, comm)

    def error_string(self, code: int) -> str:
        """Return NCCL's text for an ncclResult_t code."""
        return self._lib.error_string(code)

    def group_send_recv(
        self, comm: int, sends: Sequence[P2pOp], recvs: Sequence[P2pOp], stream: int
    ) -> None:
        """Enqueue all sends and receives as one NCCL group on a CUDA stream.

        Arguments:
            comm: the communicator.
            sends: ``(peer, device_ptr, nbytes)`` per outgoing buffer.
            recvs: ``(peer, device_ptr, nbytes)`` per incoming buffer.
            stream: the ``cudaStream_t`` as an integer
                (``torch.cuda.current_stream().cuda_stream``).

        Raises:
            NcclError: a send, receive or the group failed.
        """
        self._call(self._lib.group_send_recv, comm, list(sends), list(recvs), stream)


@functools.cache
def _load_path(path: str) -> NcclLibrary:
    return NcclLibrary(_C.NcclLibrary(path))


def load_nccl(path: str | None = None) -> NcclLibrary:
    """Load NCCL (cached: every caller in the process shares one library).

    Arguments:
        path: load exactly this library; default: the search order of the
            module docstring, first one that loads wins.

    Returns:
        The loaded :class:`NcclLibrary`.

    Raises:
        NcclNotFoundError: nothing loaded; the message lists every place tried and why
            each failed.
    """
    places = [("argument", path)] if path is not None else candidate_paths()
    tried: list[tuple[str, str, str]] = []
    for where, candidate in places:
        if not _exists(candidate):
            tried.append((where, candidate, "not found"))
            continue
        try:
            return _load_path(candidate)
        except RuntimeError as e:  # dlopen failed or symbols missing: try the next one
            tried.append((where, candidate, str(e)))
    raise NcclNotFoundError(_not_found_message(tried))
