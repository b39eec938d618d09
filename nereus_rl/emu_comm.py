"""How EMU moves state: nereus_comm's planner and reshard over a runtime gloo group.

Runtime workers do not share a torch.distributed default group (workers join
and leave while the job runs); each group is a standalone ProcessGroupGloo
that the driver names by id (``WorkerContext.group``). :class:`GroupTransport`
is a nereus_comm Transport over such a group, so ``nereus_comm.reshard`` runs
unchanged on it.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from nereus_comm.errors import PeerTimeoutError
from nereus_comm.layout import Layout, TensorSpec
from nereus_comm.plan import plan_reshard
from nereus_comm.reshard import DIRECT_MIN_BYTES, ReshardResult, Workspace, reshard
from nereus_comm.transport import GLOO_CHUNK_BYTES, Transport

__all__ = [
    "GroupTransport",
    "Layout",
    "TensorSpec",
    "box_slices",
    "move_state",
]


def box_slices(
    box: tuple[tuple[int, int], ...], origin: tuple[tuple[int, int], ...]
) -> tuple[slice, ...]:
    """Slices selecting global ``box`` inside a local shard whose global box is ``origin``."""
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, origin))


class GroupTransport(Transport):
    """A nereus_comm Transport over one standalone gloo group (host memory).

    Arguments:
        pg: the gloo process group.
        ranks: the global rank of each group rank (group rank i is ranks[i]).
        rank: this process's global rank.
        chunk_bytes: larger buffers travel as chunks of this size.
    """

    device_type = "cpu"

    def __init__(
        self,
        pg: dist.ProcessGroup,
        ranks: Sequence[int],
        rank: int,
        *,
        chunk_bytes: int = GLOO_CHUNK_BYTES,
    ) -> None:
        super().__init__()
        self.chunk_bytes = chunk_bytes
        self.pg = pg
        self.ranks = tuple(ranks)
        self.rank = rank
        self._index = {r: i for i, r in enumerate(self.ranks)}

    def __repr__(self) -> str:
        return f"GroupTransport(rank={self.rank}, ranks={list(self.ranks)})"

    def _post(self, sends, recvs, timeout):
        deadline = time.monotonic() + timeout
        pending = []
        try:
            # Receives first, so that data arriving early lands in place; large
            # buffers go as ~1 MiB chunks, which gloo pipelines (as GlooTransport).
            for kind, buffers in (("recv from", recvs), ("send to", sends)):
                post = self.pg.recv if kind == "recv from" else self.pg.send
                for peer, t in buffers:
                    for chunk in _chunks(t, self.chunk_bytes):
                        pending.append((kind, peer, post([chunk], self._index[peer], 0)))
        except RuntimeError as e:
            self._break(f"posting failed: {e}")
            raise PeerTimeoutError(f"could not post transfers (a peer is gone): {e}") from e
        return pending, deadline, timeout

    def _wait(self, state) -> None:
        pending, deadline, timeout = state
        failed = {}
        for what, peer, work in pending:
            try:
                work.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            except RuntimeError as e:
                failed.setdefault((what, peer), str(e).splitlines()[-1])
        if failed:
            peers = sorted({p for _, p in failed})
            self._break(f"peers {peers} timed out")
            (what, peer), why = next(iter(failed.items()))
            raise PeerTimeoutError(
                f"rank {self.rank}: peers {peers} did not complete within {timeout:g} s "
                f"({what} {peer}: {why}); the peer may have died"
            )


def _chunks(t: torch.Tensor, chunk_bytes: int) -> list[torch.Tensor]:
    flat = t.reshape(-1).view(torch.uint8)
    return [flat[i : i + chunk_bytes] for i in range(0, flat.numel(), chunk_bytes)]


def move_state(
    specs: Sequence[TensorSpec],
    src: Layout,
    dst: Layout,
    rank: int,
    tensors: Mapping[str, torch.Tensor],
    transport: Transport,
    *,
    timeout: float,
    workspace: Workspace | None = None,
) -> tuple[ReshardResult, dict[str, float]]:
    """This rank's part of moving a stage's state from layout src to layout dst.

    When the two layouts have the same (tp, pp), every piece is a whole shard on
    both ends and travels as its own buffer straight from the source tensor into
    the new one (zero copy); otherwise small pieces share a staged buffer per
    message (nereus_comm's default).

    Arguments:
        specs: the stage's tensors.
        src, dst: the layouts (each with num_layers set).
        rank: this rank.
        tensors: this rank's src shards (empty if not in src).
        transport: a transport reaching every rank of src and dst.
        timeout: seconds the exchange may take.
        workspace: staging buffers to reuse across calls.

    Returns:
        (nereus_comm's ReshardResult, {"plan_s", "bytes_packed", "bytes_direct"}),
        bytes counted on the sending side.
    """
    t0 = time.perf_counter()
    plan = plan_reshard(specs, src, dst)
    plan_s = time.perf_counter() - t0
    same = (src.tp, src.pp) == (dst.tp, dst.pp)
    result = reshard(
        plan,
        rank,
        tensors,
        transport,
        timeout=timeout,
        direct_min_bytes=1 if same else DIRECT_MIN_BYTES,
        workspace=workspace,
    )
    packed = result.staged_bytes_sent
    return result, {
        "plan_s": plan_s,
        "bytes_packed": packed,
        "bytes_direct": result.bytes_sent - packed,
    }
