"""Worker runtime: a driver process and one worker per device.

One interface (:class:`~nereus_rl.runtime.base.Runtime`) with two implementations:
:class:`Driver` (:mod:`nereus_rl.runtime.driver`, local spawn and hand-started workers,
the default) and ``RayDriver`` (:mod:`nereus_rl.runtime.ray_runtime`, Ray actors; import
it from there: this package does not import Ray). See also
:mod:`nereus_rl.runtime.worker` (the worker process and the command runner) and
:mod:`nereus_rl.runtime.context` (writing commands).
"""

from nereus_rl.runtime.base import Runtime
from nereus_rl.runtime.context import WorkerContext, register
from nereus_rl.runtime.driver import Driver, PendingCall
from nereus_rl.runtime.protocol import (
    JobSecretError,
    RemoteError,
    RuntimeUserError,
    StoreUnreachableError,
    UnauthenticatedMessageError,
    WorkerInfo,
    WorkerLostError,
    WorkerTimeoutError,
)

__all__ = [
    "Driver",
    "JobSecretError",
    "PendingCall",
    "RemoteError",
    "Runtime",
    "RuntimeUserError",
    "StoreUnreachableError",
    "UnauthenticatedMessageError",
    "WorkerContext",
    "WorkerInfo",
    "WorkerLostError",
    "WorkerTimeoutError",
    "register",
]
