"""Exceptions raised by nereus_comm.

Every user error is raised before any byte moves and says what was wrong and
what to do about it. Most derive from ValueError so that callers that only
know the standard library still catch them.
"""

import operator
from collections.abc import Iterable


class NereusCommError(Exception):
    """Base class of every nereus_comm error."""


class LayoutError(NereusCommError, ValueError):
    """A layout or tensor spec is malformed (degrees, ranks, shapes, split dims)."""


class PlanError(NereusCommError, ValueError):
    """A reshard cannot be planned (a destination byte no source holds, mismatched specs)."""


class TensorMismatchError(NereusCommError, ValueError):
    """A tensor handed to reshard does not match its spec (shape, dtype, device, missing)."""


class PackError(NereusCommError, ValueError):
    """A region table cannot be copied (region outside storage, device or size mismatch)."""


class TransportError(NereusCommError, RuntimeError):
    """A transport failed to move bytes."""


class PeerTimeoutError(TransportError, TimeoutError):
    """A peer did not answer in time (it may have died). The message names the peer."""


class PeerLostError(PeerTimeoutError):
    """A rank of the exchange's group is known dead (from ``liveness``): the wait ended early.

    ``rank`` is the dead rank named first (the lowest); ``ranks`` all those known dead.
    The transport is broken, as after a timeout: form a new group without them.
    """

    def __init__(self, message: str, ranks: Iterable[int]) -> None:
        super().__init__(message)
        self.ranks: tuple[int, ...] = tuple(sorted(ranks))
        self.rank: int = self.ranks[0]

    def __reduce__(self):  # pickled across processes with its ranks
        return (type(self), (str(self), self.ranks))


class NcclNotFoundError(NereusCommError, RuntimeError):
    """libnccl.so.2 could not be loaded. The message lists every place that was tried."""


class MembershipError(NereusCommError, RuntimeError):
    """Joining, leaving or watching a World failed (store unreachable, stale generation)."""


class NcclError(TransportError):
    """An NCCL call failed; the message carries NCCL's own error text."""


class PoolError(NereusCommError, ValueError):
    """A pool request is malformed (empty, repeated, negative or lost ranks, rank out of range)."""


class TransportArgumentError(NereusCommError, ValueError):
    """An exchange was asked for with a peer or buffer the transport cannot serve."""


class RemapError(NereusCommError, ValueError):
    """A page move or swap is malformed (null address, negative or unaligned size, overlap)."""


def as_int(
    value: object,
    what: str,
    error: type[NereusCommError],
    *,
    lo: int | None = None,
    hi: int | None = None,
) -> int:
    """`value` as a Python int, checked: an int or a numpy integer, never a bool or a float.

    Integers cross into C++ and numpy as int64/int32, where a float would be truncated
    (rank 1.7 -> 1), a bool taken for 0 or 1 and a huge int wrapped; so they are checked
    here, where the message can say which argument was wrong.

    Arguments:
        value: the argument.
        what: how to name it in the message ("Layout tp", "rank").
        error: the exception class to raise.
        lo, hi: inclusive bounds (None: unbounded).

    Returns:
        The int.

    Raises:
        error: `value` is not an integer, or lies outside [lo, hi].
    """
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        raise error(f"{what} must be an int, got the bool {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise error(f"{what} must be an int, got {type(value).__name__} {value!r}") from None
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        bound = " and ".join(
            b for b in (lo is not None and f">= {lo}", hi is not None and f"<= {hi}") if b
        )
        raise error(f"{what} must be an int {bound}, got {v}")
    return v
