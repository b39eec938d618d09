"""Helpers for testing code that uses nereus_comm: not needed to run it.

:class:`LocalWorkers` is a pool of local worker processes, ranks of one gloo group,
that a test module starts once and runs many functions through (``pool.run(fn,
...)`` calls ``fn(ctx, ...)`` on every rank with a :class:`WorkerContext`).
:mod:`nereus_comm.testing.nccl_check` exercises the NCCL calls nereus_comm makes on
one CUDA device (``from nereus_comm.testing import nccl_check``);
:mod:`nereus_comm.testing.states` gives real models' training states as plans see them.

Example::

    from nereus_comm.testing import LocalWorkers, WorkerContext

    def double(ctx: WorkerContext, x: int) -> int:   # module level: sent by pickle
        return 2 * x + ctx.rank

    with LocalWorkers(2) as pool:
        assert pool.run(double, 5) == [10, 11]
"""

from nereus_comm.testing.local_workers import LocalWorkers, WorkerContext, WorkerError

__all__ = ["LocalWorkers", "WorkerContext", "WorkerError"]
