"""Worker runtime: a driver process and one worker process per device.

See :mod:`nereus_rl.runtime.driver` (the driver), :mod:`nereus_rl.runtime.worker`
(the worker process) and :mod:`nereus_rl.runtime.context` (writing commands).
"""

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
    "RuntimeUserError",
    "StoreUnreachableError",
    "UnauthenticatedMessageError",
    "WorkerContext",
    "WorkerInfo",
    "WorkerLostError",
    "WorkerTimeoutError",
    "register",
]
