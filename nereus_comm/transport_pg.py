"""ProcessGroupTransport: the Transport contract over any torch.distributed group.

A framework that already holds a process group (gloo for host memory, NCCL for
device memory) hands it to :class:`ProcessGroupTransport`, and reshard() moves the
bytes over that group: no second communicator, no second rendezvous. Each exchange
is one ``torch.distributed.batch_isend_irecv`` call.

The NCCL communicators that nereus_comm opens itself (``NcclTransport`` and the
``CommPool``'s split, shrink and grow) stay on the dlopened NCCL path; this module
only borrows a group someone else built.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from nereus_comm.errors import (
    PeerTimeoutError,
    TensorMismatchError,
    TransportArgumentError,
    TransportError,
)
from nereus_comm.transport import (
    GLOO_CHUNK_BYTES,
    LIVENESS_POLL_S,
    Liveness,
    Transport,
    await_lost,
    dead_among,
    lost_error,
    wait_works,
)

__all__ = ["ProcessGroupTransport"]

# Backends whose Work reports completion without a blocking wait (is_completed()
# queries the CUDA event), so an exchange can poll it and ask liveness in between.
_POLLED_BACKENDS = frozenset({"nccl"})


def _peers(ranks) -> str:
    return ", ".join(str(r) for r in sorted(set(ranks)))


def _pieces(t: torch.Tensor, chunk_bytes: int | None) -> list[torch.Tensor]:
    # A flat uint8 view of the same storage: the wire moves bytes, whatever the dtype,
    # and both sides cut a buffer at the same offsets since their sizes match.
    flat = t.reshape(-1).view(torch.uint8)
    if chunk_bytes is None or flat.numel() <= chunk_bytes:
        return [flat]
    return [flat[i : i + chunk_bytes] for i in range(0, flat.numel(), chunk_bytes)]


class ProcessGroupTransport(Transport):
    """Exchange over any torch.distributed process group with ``batch_isend_irecv``.

    Peers are global ranks, as everywhere in nereus_comm; they are mapped to the
    group's ranks (``torch.distributed.get_group_rank``) once, here. The group must
    be one torch.distributed knows (the default group, ``new_group``,
    ``split_group``); for a standalone ``ProcessGroupGloo`` use
    :class:`~nereus_comm.transport.GlooTransport` with ``ranks`` and ``rank``.

    - gloo (host memory): the batch's sends and receives are posted in one
      ``batch_isend_irecv`` call (gloo has no coalescing, so torch posts them one by
      one; receives first, so that early data lands in place). Buffers larger than
      ``chunk_bytes`` travel as consecutive chunks, as with GlooTransport. A wait
      that times out closes the group's gloo pairs: the transport (and the group) is
      broken after a PeerTimeoutError or PeerLostError.
    - NCCL (device memory, this rank's GPU): torch coalesces the batch into one
      NCCL group call on its NCCL stream, ordered after the current stream's work;
      the exchange polls its completion (asking liveness in between) and then makes
      the current stream wait on it. On a timeout, a death or an NCCL error the
      group is aborted (``ProcessGroup.abort``), since a communicator with
      transfers stuck on a dead peer cannot be used again: build a new group. As
      torch requires of ``batch_isend_irecv``, the group must have run a collective
      (e.g. ``dist.barrier(group)``) before a batch that leaves out some of its ranks.
    - other backends: posted the same way, each Work waited on with a timeout.

    Example, a framework passing its own data-parallel group (global ranks 2..5)::

        dp_group = torch.distributed.new_group(ranks=[2, 3, 4, 5])  # gloo
        transport = ProcessGroupTransport(dp_group)
        result = reshard(plan, torch.distributed.get_rank(), shards, transport)

        # Device memory over the framework's NCCL group (tensors on this rank's GPU):
        torch.cuda.set_device(local_rank)
        nccl_group = torch.distributed.new_group(ranks=[2, 3, 4, 5], backend="nccl")
        result = reshard(plan, rank, gpu_shards, ProcessGroupTransport(nccl_group))

    Arguments:
        group: the process group (None: the default group). This process must be
            a member.
        device_type: the memory it moves, "cpu" or "cuda". Default: from the
            group's backend (gloo: "cpu", NCCL: "cuda"); required for a group whose
            backend serves both with different backends (``"cpu:gloo,cuda:nccl"``)
            or a backend other than these two.
        device: the CUDA device for "cuda" (default: the group's bound device, else
            the current device); every tensor must be on it.
        chunk_bytes: larger buffers travel as chunks of this size. Default: gloo
            :data:`~nereus_comm.transport.GLOO_CHUNK_BYTES` (see GlooTransport: each
            gloo op costs CPU, bounded chunks let early ones land), others unchunked.

    Raises:
        TransportArgumentError: torch.distributed is not initialized, this process is
            not in the group, ``device_type`` is not one the group serves or cannot
            be told, CUDA is unavailable for "cuda", or ``chunk_bytes`` < 1.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        device_type: str | None = None,
        device: int | str | torch.device | None = None,
        chunk_bytes: int | None = None,
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise TransportArgumentError(
                "torch.distributed is not initialized; call init_process_group(...) first "
                "(a standalone gloo group goes through GlooTransport(group, ranks, rank))"
            )
        if group is None:
            group = dist.group.WORLD
        if not isinstance(group, dist.ProcessGroup):
            # new_group returns a marker, not a group, on processes outside it.
            raise TransportArgumentError(
                f"rank {dist.get_rank()} is not a member of this group ({group!r}); "
                "only the group's members build a transport over it"
            )
        self.group = group
        self.rank = dist.get_rank()
        self.ranks = tuple(dist.get_global_rank(group, i) for i in range(group.size()))
        if self.rank not in self.ranks:
            raise TransportArgumentError(f"rank {self.rank} is not in the group {self.ranks}")
        # global rank -> group rank, resolved once instead of per op.
        self._group_rank = {r: dist.get_group_rank(group, r) for r in self.ranks}
        self.device_type, self.backend = self._device_and_backend(group, device_type)
        if self.device_type == "cuda":
            if not torch.cuda.is_available():
                raise TransportArgumentError(
                    f"the group moves cuda memory over {self.backend}, but CUDA is not "
                    "available in this process"
                )
            if device is None:
                device = group.bound_device_id or torch.cuda.current_device()
            device = (
                torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
            )
            if device.type != "cuda":
                raise TransportArgumentError(f"device must be a CUDA device, got {device}")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            self.device = device
        else:
            self.device = torch.device(self.device_type)
        if chunk_bytes is None and self.backend == "gloo":
            chunk_bytes = GLOO_CHUNK_BYTES
        if chunk_bytes is not None and chunk_bytes < 1:
            raise TransportArgumentError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes

    @staticmethod
    def _device_and_backend(group: dist.ProcessGroup, device_type: str | None) -> tuple[str, str]:
        # get_backend_config names a backend per device ("cpu:gloo,cuda:gloo" for a
        # plain gloo group, which would accept CUDA tensors only by staging them).
        config = dist.get_backend_config(group)
        served = dict(part.split(":", 1) for part in config.split(",") if ":" in part)
        if device_type is None:
            name = str(dist.get_backend(group))
            if name == "gloo":
                device_type = "cpu"
            elif name == "nccl":
                device_type = "cuda"
            elif len(set(served.values())) == 1 and len(served) == 1:
                device_type = next(iter(served))
            else:
                raise TransportArgumentError(
                    f"the group's backend is {config!r}; pass device_type='cpu' or 'cuda' "
                    "to say which memory this transport moves"
                )
        if device_type not in ("cpu", "cuda"):
            raise TransportArgumentError(
                f"device_type must be 'cpu' or 'cuda', got {device_type!r}"
            )
        if device_type not in served:
            raise TransportArgumentError(
                f"the group's backend {config!r} serves no {device_type} memory"
            )
        return device_type, served[device_type]

    def __repr__(self) -> str:
        return (
            f"ProcessGroupTransport(rank={self.rank}, ranks={list(self.ranks)}, "
            f"backend={self.backend}, device={self.device})"
        )

    def connection_key(self) -> object:
        """The process group: transports built per call over one group share it."""
        return self.group

    def _checked(self, buffers, kind: str) -> list[tuple[int, torch.Tensor]]:
        out = super()._checked(buffers, kind)
        if self.device_type == "cuda":
            for peer, t in out:
                if t.device != self.device:
                    raise TensorMismatchError(
                        f"{kind} to/from {peer}: tensor is on {t.device}, this transport "
                        f"moves {self.device} memory"
                    )
        return out

    def _issue(self, ops: list[dist.P2POp]) -> list[dist.Work]:
        """Post ``ops`` as one batch (a hook so that a benchmark can compare postings)."""
        # gloo has no coalescing, so torch posts the ops one by one (isend/irecv per
        # op): the same as posting them ourselves. Measured on 4 gloo ranks, a 64 MiB
        # reshard costs the same CPU either way (per-op/batch within 1%, wall time
        # within noise), so gloo keeps the one call too.
        if self.device_type == "cuda":
            with torch.cuda.device(self.device):
                return dist.batch_isend_irecv(ops)
        return dist.batch_isend_irecv(ops)

    def _post(self, sends, recvs, timeout, liveness):
        deadline = time.monotonic() + timeout
        ops: list[dist.P2POp] = []
        what: list[tuple[str, int]] = []
        # Receives first: gloo posts in list order, so data arriving early lands in place.
        for kind, op, buffers in (("recv from", dist.irecv, recvs), ("send to", dist.isend, sends)):
            for peer, t in buffers:
                for piece in _pieces(t, self.chunk_bytes):
                    ops.append(
                        dist.P2POp(op, piece, group=self.group, group_peer=self._group_rank[peer])
                    )
                    what.append((kind, peer))
        if not ops:
            return [], what, deadline, timeout, liveness
        try:
            works = self._issue(ops)
        except RuntimeError as e:  # gloo: a pair closed earlier, the peer is gone
            self._fail(f"posting failed: {e}")
            peers = {p for _, p in what}
            lost = await_lost(liveness, self.ranks, deadline)
            if lost:
                raise lost_error(self.rank, lost, peers, "a connection closed") from e
            raise PeerTimeoutError(
                f"rank {self.rank}: could not post transfers to peers {_peers(peers)} over "
                f"{self.backend} (a connection is closed or the group aborted): {e}"
            ) from e
        return works, what, deadline, timeout, liveness

    def _wait(self, state) -> None:
        works, what, deadline, timeout, liveness = state
        if not works:
            return
        if self.backend in _POLLED_BACKENDS:
            self._wait_polling(works, {p for _, p in what}, deadline, timeout, liveness)
            return
        if len(works) == len(what):  # one Work per op: a failure names its op
            pending = [(k, p, w) for (k, p), w in zip(what, works, strict=True)]
        else:  # a coalescing backend: every Work stands for the whole batch
            peers = sorted({p for _, p in what})
            pending = [("exchange with", p, w) for w in works for p in peers]
        wait_works(self, pending, deadline, timeout, liveness, backend=self.backend)

    def _wait_polling(
        self,
        works: Sequence[dist.Work],
        peers: set[int],
        deadline: float,
        timeout: float,
        liveness: Liveness | None,
    ) -> None:
        next_check = time.monotonic() + LIVENESS_POLL_S
        while True:
            try:
                done = all(w.is_completed() for w in works)
            except RuntimeError as e:  # an NCCL error, rethrown by the Work
                self._fail(f"NCCL error: {e}")
                raise TransportError(
                    f"rank {self.rank}: {self.backend} reported an error during an exchange "
                    f"with peers {_peers(peers)}: {e}; the group was aborted"
                ) from e
            if done:
                break
            now = time.monotonic()
            if liveness is not None and now >= next_check:
                next_check = now + LIVENESS_POLL_S
                lost = dead_among(liveness, self.ranks)
                if lost:
                    self._fail(f"ranks {_peers(lost)} died")
                    raise lost_error(self.rank, lost, peers, "known from liveness")
            if now > deadline:
                self._fail("timed out")
                raise PeerTimeoutError(
                    f"rank {self.rank}: transfers with peers {_peers(peers)} did not finish "
                    f"within {timeout:g} s; the {self.backend} group was aborted. The peer may "
                    "have died; form a new group without it."
                )
            time.sleep(0.0002)
        for w in works:
            w.wait()  # orders the current stream after the transfers (no CPU wait)

    def _fail(self, reason: str) -> None:
        self._break(reason)
        if self.backend in _POLLED_BACKENDS:
            # Transfers stuck on a dead peer would block every later op of the
            # communicator; aborting is the only way to free it.
            try:
                self.group.abort()
            except RuntimeError:
                pass
