"""The runtime interface: what the trainer (and every layer above) asks of a driver.

Two implementations:

* :class:`nereus_rl.runtime.driver.Driver`: local spawn, the embedded default. Workers
  are processes started here (or by hand on other machines, ``nereus-rl worker``) and
  commands travel through the job's store.
* :class:`nereus_rl.runtime.ray_runtime.RayDriver`: one Ray actor per device, placed
  by a placement group's bundles; commands are actor method calls, replies are
  ObjectRefs (imported only when asked for: the default needs no Ray).

In both, a worker is a ``rank`` (an int, its World member id - 1), runs the commands
registered with :func:`nereus_rl.runtime.context.register` in the order it receives
them (:func:`nereus_rl.runtime.worker.run_command`), and moves tensors to other
workers over torch.distributed groups rendezvousing on the job's store. A worker that
dies makes the calls that owe its reply raise :class:`~nereus_rl.runtime.WorkerLostError`
and breaks the survivors' running collectives (nereus_rl.runtime.abort).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

from nereus_rl.runtime.protocol import WorkerInfo


@runtime_checkable
class Runtime(Protocol):
    """A job's control plane: its workers, the commands sent to them, their deaths.

    Attributes:
        infos: rank -> :class:`WorkerInfo` of every worker that joined (lost ones too).
        records: free-form records of timed operations, appended by layers above.
    """

    infos: dict[int, WorkerInfo]
    records: list[dict[str, Any]]

    @property
    def workers(self) -> list[int]:
        """Ranks of the joined workers not known to be lost (sorted)."""
        ...

    def start_workers(self, num_workers: int) -> list[int]:
        """Start ``num_workers`` workers (one per device) and wait until they joined.

        Returns:
            Their ranks, in device order (rank order: workers of one node or failure
            domain are consecutive where the runtime knows the nodes).

        Raises:
            WorkerLostError, WorkerTimeoutError: they could not all start.
        """
        ...

    def submit(self, ranks: Iterable[int], fn: str, *args: Any, **kwargs: Any) -> Any:
        """Send the command ``fn(*args, **kwargs)`` to each worker in ``ranks``; do not wait.

        Atomic over ``ranks``: concurrent submits reach every worker in one global
        order, so commands spanning workers never wait on each other in a cycle.

        Returns:
            A pending call for :meth:`wait`.

        Raises:
            RuntimeUserError: a rank is not a joined worker. WorkerLostError: a rank is lost.
        """
        ...

    def wait(self, pending: Any, timeout: float | None = None) -> dict[int, Any]:
        """The replies of a submitted call: rank -> value.

        Raises:
            RemoteError: the command raised on a worker. WorkerLostError: a worker that
            owes a reply died. WorkerTimeoutError: no reply within ``timeout`` seconds.
        """
        ...

    def call(
        self, ranks: Iterable[int], fn: str, *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> dict[int, Any]:
        """:meth:`submit` and :meth:`wait`."""
        ...

    def check_liveness(self) -> tuple[int, ...]:
        """Every worker known lost so far (sorted); new losses are announced to the
        survivors (their running collectives are broken)."""
        ...

    def wait_for_loss(self, timeout: float) -> tuple[int, ...]:
        """Block until some worker is lost or ``timeout`` passes; the lost workers."""
        ...

    def kill(self, rank: int) -> None:
        """Kill a worker (failure tests, drills); it is known lost on return."""
        ...

    def import_module(self, module: str) -> None:
        """Make every worker, now and joining later, import ``module`` (it registers
        commands)."""
        ...

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every worker and release what the runtime holds. Idempotent."""
        ...
