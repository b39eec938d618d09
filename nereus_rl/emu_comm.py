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
from nereus_comm.layout import Layout, TensorSpec, box_nbytes
from nereus_comm.plan import plan_reshard
from nereus_comm.reshard import DIRECT_MIN_BYTES, ReshardResult, reshard, wire_layout
from nereus_comm.transport import Transport

__all__ = [
    "GroupTransport",
    "Layout",
    "TensorSpec",
    "box_slices",
    "move_state",
]


def box_slices(box: tuple[tuple[int, int], ...], origin: tuple[tuple[int, int], ...]):
    """Slices selecting global ``box`` inside a local shard whose global box is ``origin``."""
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, origin))


class GroupTransport(Transport):
    """A nereus_comm Transport over one standalone gloo group (host memory).

    Arguments:
        pg: the gloo process group.
        ranks: the global rank of each group rank (group rank i is ranks[i]).
        rank: this process's global rank.
    """

    device_type = "cpu"

    def __init__(self, pg: dist.ProcessGroup, ranks: Sequence[int], rank: int) -> None:
        super().__init__()
        self.pg = pg
        self.ranks = tuple(ranks)
        self.rank = rank
        self._index = {r: i for i, r in enumerate(self.ranks)}

    def __repr__(self) -> str:
        return f"GroupTransport(rank={self.rank}, ranks={list(self.ranks)})"

    def _exchange(self, sends, recvs, timeout) -> None:
        deadline = time.monotonic() + timeout
        pending = []
        try:
            # Receives first, so that data arriving early lands in place.
            for peer, t in recvs:
                pending.append(("recv from", peer, self.pg.recv([_bytes(t)], self._index[peer], 0)))
            for peer, t in sends:
                pending.append(("send to", peer, self.pg.send([_bytes(t)], self._index[peer], 0)))
        except RuntimeError as e:
            self._break(f"posting failed: {e}")
            raise PeerTimeoutError(f"could not post transfers (a peer is gone): {e}") from e
        failed = []
        for what, peer, work in pending:
            try:
                work.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            except RuntimeError as e:
                failed.append((what, peer, str(e).splitlines()[-1]))
        if failed:
            peers = sorted({p for _, p, _ in failed})
            self._break(f"peers {peers} timed out")
            raise PeerTimeoutError(
                f"rank {self.rank}: peers {peers} did not complete within {timeout:g} s "
                f"({failed[0][0]} {failed[0][1]}: {failed[0][2]}); the peer may have died"
            )


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def move_state(
    specs: Sequence[TensorSpec],
    src: Layout,
    dst: Layout,
    rank: int,
    tensors: Mapping[str, torch.Tensor],
    transport: Transport,
    *,
    timeout: float,
) -> tuple[ReshardResult, dict[str, float]]:
    """This rank's part of moving a stage's state from layout src to layout dst.

    When the two layouts have the same (tp, pp), every piece is a whole shard on
    both ends and moves straight from the source tensor into the new one (zero
    copy); otherwise small or strided pieces are packed per message.

    Arguments:
        specs: the stage's tensors.
        src, dst: the layouts (each with num_layers set).
        rank: this rank.
        tensors: this rank's src shards (empty if not in src).
        transport: a transport reaching every rank of src and dst.
        timeout: seconds the exchange may take.

    Returns:
        (nereus_comm's ReshardResult, {"plan_s", "bytes_packed", "bytes_direct"}).
    """
    t0 = time.perf_counter()
    plan = plan_reshard(specs, src, dst)
    plan_s = time.perf_counter() - t0
    same = (src.tp, src.pp) == (dst.tp, dst.pp)
    threshold = 1 if same else DIRECT_MIN_BYTES
    packed = direct = 0
    for m in plan.sends(rank):
        wire = wire_layout(plan, m, threshold)
        for idx, group in ((wire.packed, "p"), (wire.direct, "d")):
            n = sum(box_nbytes(m.pieces[i].box, plan.specs[m.pieces[i].tensor]) for i in idx)
            if group == "p":
                packed += n
            else:
                direct += n
    result = reshard(plan, rank, tensors, transport, timeout=timeout, direct_min_bytes=threshold)
    return result, {"plan_s": plan_s, "bytes_packed": packed, "bytes_direct": direct}
