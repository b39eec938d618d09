"""The environment a process that holds sharded state should start with.

Every worker process (a local test worker, a job's worker spawned by its driver, a
worker of another framework) allocates its shards fresh, often gigabytes at a time.
:data:`WORKER_ENV` holds the variables that make those allocations cheap;
:func:`worker_env` builds the environment of a subprocess with them and
:func:`worker_environ` sets them in this process while processes start that copy
its environment (multiprocessing's forkserver).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

__all__ = ["WORKER_ENV", "worker_env", "worker_environ"]

#: Environment every worker starts with unless the user set the variable:
#: THP_MEM_ALLOC_ENABLE=1 makes torch's CPU allocator align allocations of 2 MiB and
#: more to 2 MiB and madvise them to transparent huge pages, so fresh state (a new
#: unit's shards) faults in 512x fewer pages. torch reads it at the first allocation
#: of a process, so it must be in the environment the process starts with.
WORKER_ENV = {"THP_MEM_ALLOC_ENABLE": "1"}


def worker_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a worker subprocess: ``base`` with WORKER_ENV where unset.

    Arguments:
        base: the environment to start from (default: this process's, ``os.environ``).

    Returns:
        A new dict; ``base`` is not changed, and a variable it sets keeps its value.
    """
    env = dict(os.environ if base is None else base)
    for key, value in WORKER_ENV.items():
        env.setdefault(key, value)
    return env


@contextlib.contextmanager
def worker_environ(**extra: str) -> Iterator[None]:
    """Set WORKER_ENV (where unset) and ``extra`` in ``os.environ`` for the block.

    For start methods that copy this process's environment (multiprocessing's
    forkserver starts with it). Every variable touched is restored afterwards.

    Arguments:
        extra: variables to set for the block (they override this process's values).

    Returns:
        A context manager; nothing is yielded.
    """
    saved = {k: os.environ.get(k) for k in (*WORKER_ENV, *extra)}
    os.environ.update(extra)
    for key, value in WORKER_ENV.items():
        os.environ.setdefault(key, value)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
