"""reshard(): execute a ReshardPlan on one rank.

Every rank of the source and destination layouts calls :func:`reshard` with the
same plan. Each rank:

1. validates every tensor it was handed (and every ``out`` tensor) against its
   spec and its box in the layout: name, shape, dtype, device, contiguity, and
   that its bytes are its data (no DTensor or other subclass, sparse, quantized,
   nested or meta tensor). A source shard, or an ``out`` shard, may be a strided
   view whose elements lie in rows of one stride (``full[:, a:b]``): its pieces are
   read, or written, in place. Then
   it checks with every peer it exchanges bytes with that both derived the same
   plan: each sends each peer a 40-byte digest of the specs, the layouts, the
   route and the pair's wire buffers, in one batched exchange; where two disagree,
   both send each other their spec tables and raise PlanError naming the tensors
   (or settings) that differ. Nothing moves before all checks pass;
2. builds the wire buffers of each message (:func:`wire_groups`): every piece
   of at least 512 KiB travels as its own buffer, the smaller ones share one.
   A buffer that is one contiguous block of a shard is sent from, or received
   into, the shard's own storage (zero copy); the others go through one
   staging buffer, filled by a single :func:`~nereus_comm.pack.pack` call.
   So a piece is copied only on a side where it is strided. Both sides derive
   the same buffers from the plan alone: no extra communication;
3. posts every buffer in one batched transport call and, while the bytes
   travel, copies the bytes it already holds and needs (the plan's local
   copies) with one :func:`~nereus_comm.pack.copy_tables` call;
4. drains the receive staging buffer with a single
   :func:`~nereus_comm.pack.unpack` call.

Peers on the same host (``route="auto"``, the default, for host memory) skip the
transport. Same host means equal
:func:`~nereus_comm.transport_shm.host_identity`: hostname, boot id, /dev/shm and
network namespace, swapped once per peer pair; peers on other hosts, or in another
network namespace of this one, always take the transport. A same-host pair takes
one route for all its bytes. Where the kernel allows cross-memory attach between
them, the pair's bytes flow one way only and its message's contiguous runs are long
(:data:`CMA_MIN_RUN_BYTES` on average: whole shards, as in an Extend or a weight
sync), the receiver reads the sender's shards straight into its own (one copy in
all, no packing; see :mod:`nereus_comm.transport_cma`); the sender publishes where
its pieces are and waits until its receivers are done. The other pairs (bytes both
ways, short runs, or the kernel refuses: probed once per peer pair and group, the
reason kept in ``ReshardResult.fallback_reasons``): the sender packs them straight
into a shared-memory segment the receiver maps and the receiver unpacks straight out
of it (one copy each side, see
:mod:`nereus_comm.transport_shm`); the segments are set up over the transport on
first use, kept per process group and reused by every later call.
Peers on other hosts (host memory) take the socket route under "auto": one TCP
stream per pair, set up over the transport on first use and kept per process group,
on which the kernel copies every row of every piece straight from the source shards
and into the destination shards (short rows through a small bounce buffer), so a
strided piece costs no staging copy on either side (see
:mod:`nereus_comm.transport_net`). ``route="transport"`` sends everything through
the transport (the old path); ``route="cma"``, ``"shm"`` and ``"net"`` require that
route for every peer.

Example::

    plan = plan_reshard(specs, src_layout, dst_layout)
    result = reshard(plan, rank, my_src_shards, GlooTransport())
    result.tensors            # my destination shards, keyed by spec name
"""

from __future__ import annotations

import hashlib
import json
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from nereus_comm.errors import PeerLostError, PeerTimeoutError, PlanError, TensorMismatchError
from nereus_comm.layout import Layout, TensorSpec
from nereus_comm.pack import Region, RegionTable, columns_table, copy_tables, pack, unpack
from nereus_comm.plan import ReshardPlan
from nereus_comm.reshard_program import (
    DIRECT_MIN_BYTES,
    VERIFY_RECORD_BYTES,
    RankProgram,
    Slot,
    check_shards,
    plan_table,
    program,
    rebind_destinations,
    rebind_sources,
    slot_columns,
    wire_groups,
)
from nereus_comm.transport import Liveness, Transport, TransportArgumentError
from nereus_comm.transport_cma import CmaRoute
from nereus_comm.transport_net import NetRoute
from nereus_comm.transport_shm import ShmTransport, peers_lost, sweep_orphans

__all__ = [
    "CMA_MIN_RUN_BYTES",
    "DIRECT_MIN_BYTES",
    "ROUTES",
    "ReshardResult",
    "Workspace",
    "prepare_reshard",
    "reshard",
    "shards_from_full",
    "wire_groups",
]

#: reshard(route=...): "auto" (cross-memory attach with same-host peers that allow
#: it, shared memory with the other same-host peers, TCP streams of the socket route
#: with peers on other hosts, the transport with any left), "cma" (cross-memory attach
#: with every peer, else an error), "shm" (shared memory with every peer, else an
#: error), "net" (the socket route with every peer, else an error) or "transport"
#: (everything through the transport).
ROUTES = ("auto", "cma", "shm", "net", "transport")

#: route="auto" reads a peer pair's bytes by cross-memory attach only when its
#: message's contiguous runs average at least this many bytes (and they flow one
#: way). process_vm_readv costs ~0.5 us per run (it pins the pages of each iovec)
#: and copies ~0.23 ms/MiB, where packing
#: into and out of a warm shared-memory segment costs ~0.26 ms/MiB: 32 MiB as runs of
#: 256 B / 1 KiB / 4 KiB / 16 KiB / 1 MiB took 76 / 27 / 12 / 10 / 7.5 ms against
#: 8-10 ms for the two memcpys (one process, 2-core VM). Whole shards (Extend) are
#: one run each.
CMA_MIN_RUN_BYTES = 16 << 10


@dataclass(frozen=True)
class ReshardResult:
    """What one rank's reshard produced and measured.

    ``tensors`` are the rank's destination shards by spec name (empty when the rank
    is not in the destination layout). Seconds are wall-clock on this rank, from the
    end of validation to the end of unpacking (device work included).

    ``buffers_*`` count the wire buffers the plan's messages are cut into (see
    :func:`wire_groups`) and ``staged_bytes_*`` the bytes of those that are strided
    on this side, so packed or unpacked, whichever route they took: through shared
    memory a peer's buffers land back to back in its segment.
    """

    tensors: dict[str, torch.Tensor] = field(repr=False)
    seconds: float
    bytes_sent: int
    bytes_received: int
    bytes_local: int
    messages_sent: int
    messages_received: int
    buffers_sent: int
    buffers_received: int
    staged_bytes_sent: int = 0
    staged_bytes_received: int = 0
    pack_seconds: float = 0.0
    #: posting, local copies and waiting for the transfers.
    exchange_seconds: float = 0.0
    unpack_seconds: float = 0.0
    #: of exchange_seconds: posting and the cross-memory-attach reads (and shared-memory
    #: sends), then the local copies.
    read_seconds: float = 0.0
    local_seconds: float = 0.0
    #: of bytes_sent / bytes_received, those that went through shared memory and
    #: those read by cross-memory attach (the rest went through the transport).
    shm_bytes_sent: int = 0
    shm_bytes_received: int = 0
    cma_bytes_sent: int = 0
    cma_bytes_received: int = 0
    #: of bytes_sent / bytes_received, those that went over the socket route's streams.
    net_bytes_sent: int = 0
    net_bytes_received: int = 0
    #: per peer of this call that cross-memory attach could not serve (route "auto"),
    #: why not (from the probe, e.g. EPERM under Yama or missing credentials).
    fallback_reasons: dict[int, str] = field(default_factory=dict)
    #: the plan check before any data moved (``verify_plan``): its seconds (of
    #: pack_seconds) and the bytes this rank sent through the transport for it (it
    #: received as many); not counted in bytes_sent / bytes_received.
    verify_seconds: float = 0.0
    verify_bytes: int = 0

    def __repr__(self) -> str:
        return (
            f"ReshardResult({len(self.tensors)} tensors, {self.seconds * 1e3:.1f} ms, "
            f"sent {self.bytes_sent} B in {self.messages_sent} msgs/{self.buffers_sent} bufs "
            f"({self.cma_bytes_sent} B by cma, {self.shm_bytes_sent} B by shm, "
            f"{self.net_bytes_sent} B by net), received {self.bytes_received} B "
            f"({self.cma_bytes_received} B by cma, {self.shm_bytes_received} B by shm, "
            f"{self.net_bytes_received} B by net), local {self.bytes_local} B)"
        )


class Workspace:
    """Staging buffers that successive reshards reuse (no fresh pages per call).

    Pass one as ``reshard(..., workspace=ws)``. It grows to the largest staging need
    seen and keeps that memory until it is dropped; one per process and device is
    plenty (reshard calls that run at the same time need one each).

    Arguments:
        device: where the buffers live; the transport's device (``"cpu"`` for
            GlooTransport over host memory, a CUDA device for NcclTransport).

    Raises:
        RuntimeError: ``device`` is not a device torch knows (torch's own error).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, kind: str, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of exactly ``nbytes``, backed by the cached buffer for ``kind``.

        Arguments:
            kind: which buffer ("send", "recv": reshard uses both at once).
            nbytes: bytes needed (the buffer grows to fit, its old bytes dropped).

        Returns:
            A view of the buffer's first ``nbytes`` bytes on :attr:`device`; it is
            overwritten by the next call for the same ``kind``.
        """
        buf = self._buffers.get(kind)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._buffers[kind] = buf
        return buf[:nbytes]


def _region(slot: Slot, tensors: Mapping[str, torch.Tensor]) -> Region:
    name, off, rows, row, stride = slot
    return Region(tensors[name], off, rows, row, stride)


def _bind(buffers, tensors, stage: torch.Tensor):
    """(wire buffers as (peer, tensor), staged regions) for a validated set of shards.

    A direct buffer is a view of the shard's storage; the others are consecutive
    slices of `stage`, whose regions one pack/unpack call fills or drains.
    """
    out, staged, at = [], [], 0
    for b in buffers:
        if b.direct:
            name, off, rows, row, _ = b.slots[0]
            out.append((b.peer, tensors[name].reshape(-1).narrow(0, off, rows * row)))
        else:
            out.append((b.peer, stage[at : at + b.nbytes]))
            at += b.nbytes
            staged.extend(_region(sl, tensors) for sl in b.slots)
    return out, staged


def _slot_tables(
    prog: RankProgram,
    kind: str,
    slots_by_peer: Mapping[int, Sequence[Slot]],
    tensors: Mapping[str, torch.Tensor],
    what: str,
) -> dict[int, RegionTable]:
    """Each peer's slots bound to ``tensors`` as one validated region table (no Region
    tuple per piece: a message holds hundreds of pieces of a few tensors)."""
    return {
        peer: _bound(prog.columns((kind, peer), slots), tensors, what)
        for peer, slots in slots_by_peer.items()
    }


def _bound(cols, tensors: Mapping[str, torch.Tensor], what: str) -> RegionTable:
    return columns_table([tensors[n] for n in cols.names], cols.which, cols.sizes, what)


def _staged_nbytes(buffers) -> int:
    return sum(b.nbytes for b in buffers if not b.direct)


def _stage(nbytes: int, workspace: Workspace | None, kind: str, device) -> torch.Tensor:
    if workspace is not None:
        return workspace.get(kind, nbytes)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


_SHM: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CMA: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_NET: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _route_state(cache: weakref.WeakKeyDictionary, make, transport: Transport):
    """The per-process-group state of a same-host route (one per transport connection)."""
    key = transport.connection_key()
    state = cache.get(key)
    if state is None:
        state = cache[key] = make(transport)
    return state


def _shm_for(transport: Transport) -> ShmTransport:
    """The ShmTransport of the transport's connections (one per process group)."""
    return _route_state(_SHM, ShmTransport, transport)


def _cma_for(transport: Transport) -> CmaRoute:
    """The CmaRoute of the transport's connections (one per process group)."""
    return _route_state(_CMA, CmaRoute, transport)


def _net_for(transport: Transport) -> NetRoute:
    """The NetRoute of the transport's connections (one per process group)."""
    return _route_state(_NET, NetRoute, transport)


def _within(liveness: Liveness, members: frozenset[int]) -> Liveness:
    """Liveness restricted to a plan's ranks (the transport's group may hold others)."""

    def dead() -> frozenset[int]:
        return frozenset(liveness()) & members

    return dead


def _take(buffers, chosen):
    """(the buffers not chosen, {peer: the chosen ones' slots in wire order}, {peer: their
    bytes}) for a predicate ``chosen(buffer)``."""
    rest, slots, nbytes = [], {}, {}
    for b in buffers:
        if chosen(b):
            slots.setdefault(b.peer, []).extend(b.slots)
            nbytes[b.peer] = nbytes.get(b.peer, 0) + b.nbytes
        else:
            rest.append(b)
    return tuple(rest), slots, nbytes


def _totals(buffers) -> dict[int, int]:
    out: dict[int, int] = {}
    for b in buffers:
        out[b.peer] = out.get(b.peer, 0) + b.nbytes
    return out


def _long_runs(nbytes: int, runs: int) -> bool:
    """Whether bytes in this many runs are worth a cross-memory-attach read (route auto)."""
    return nbytes >= CMA_MIN_RUN_BYTES * max(runs, 1)


#: The most bytes of a peer's plan table the check accepts (its record says how many
#: follow); far above any real table, it only keeps a garbled record from allocating.
_MAX_TABLE_BYTES = 1 << 28


def _spec_text(row: list) -> str:
    _, shape, dtype, split, stage = row
    return f"{dtype} {shape} split_dim={split} stage_key={stage}"


def _differences(rank: int, peer: int, mine: dict, theirs: dict) -> tuple[list[str], list[str]]:
    """(what differs between two ranks' plan tables, the tensor names among it)."""
    lines: list[str] = []
    names: list[str] = []
    for key, what in (("specs", ""), ("dst_specs", " (as the destination holds it)")):
        # dst_specs is None where the destination holds the specs as the source does.
        a = mine[key] if mine[key] is not None else mine["specs"]
        b = theirs[key] if theirs[key] is not None else theirs["specs"]
        if a == b or (key == "dst_specs" and mine[key] is None and theirs[key] is None):
            continue
        by_a, by_b = {r[0]: r for r in a}, {r[0]: r for r in b}
        found = False
        for name in [*by_a, *(n for n in by_b if n not in by_a)]:
            ra, rb = by_a.get(name), by_b.get(name)
            if ra == rb:
                continue
            found = True
            if name not in names:
                names.append(name)
            if rb is None:
                lines.append(f"tensor {name!r}{what}: only rank {rank} has it")
            elif ra is None:
                lines.append(f"tensor {name!r}{what}: only rank {peer} has it")
            else:
                lines.append(
                    f"tensor {name!r}{what}: {_spec_text(ra)} on rank {rank}, "
                    f"{_spec_text(rb)} on rank {peer}"
                )
        if not found:
            lines.append(f"the specs{what} are in a different order")
    for key, what in (("src", "source layout"), ("dst", "destination layout")):
        if mine[key] != theirs[key]:
            lines.append(f"the {what}: {mine[key]} on rank {rank}, {theirs[key]} on rank {peer}")
    for key in ("route", "direct_min_bytes"):
        if mine[key] != theirs[key]:
            lines.append(f"{key}={mine[key]!r} on rank {rank}, {theirs[key]!r} on rank {peer}")
    if not lines:
        lines.append(
            f"equal specs and layouts gave different plans or wire buffers (plan totals "
            f"{mine['plan']} on rank {rank}, {theirs['plan']} on rank {peer}): different "
            "nereus_comm versions?"
        )
    return lines, names


def _verify_plan(
    plan: ReshardPlan,
    prog: RankProgram,
    rank: int,
    transport: Transport,
    device: torch.device,
    route: str,
    direct_min_bytes: int,
    timeout: float,
    extra: dict,
) -> int:
    """Check with every peer of this rank that both derived the same plan; bytes sent.

    One batched exchange of VERIFY_RECORD_BYTES per peer (a digest of the plan table
    and the call's route and direct_min_bytes, one of the pair's wire buffers, and
    the table's length). Both ends of a pair compare the same two records, so where
    they differ both know it: they then exchange their tables (each knows the other's
    length from its record) and both raise PlanError naming what differs. A peer
    whose plan says the two do not exchange at all posts nothing, so this rank waits
    for it until ``timeout`` (PeerTimeoutError), as for a peer that never calls.

    Raises:
        PlanError: this rank's plan and a peer's differ (names the tensors or settings).
        PeerTimeoutError, PeerLostError: as for the data exchange.
    """
    peers = sorted(prog.peers)
    if not peers:
        return 0
    digest, table = plan_table(plan)
    call = json.dumps({"route": route, "direct_min_bytes": direct_min_bytes}).encode()
    head = hashlib.blake2b(digest + call, digest_size=16).digest()
    tail = (len(table) + 1 + len(call)).to_bytes(8, "little")
    n = VERIFY_RECORD_BYTES
    mine = b"".join(head + prog.pair_digests[p] + tail for p in peers)
    send = torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(device)
    recv = torch.empty(len(mine), dtype=torch.uint8, device=device)
    transport.exchange(
        [(p, send[i * n : (i + 1) * n]) for i, p in enumerate(peers)],
        [(p, recv[i * n : (i + 1) * n]) for i, p in enumerate(peers)],
        timeout=timeout,
        **extra,
    )
    got = recv.cpu().numpy().tobytes()
    bad = [i for i in range(len(peers)) if got[i * n : (i + 1) * n] != mine[i * n : (i + 1) * n]]
    if not bad:
        return len(mine)
    # Both ends of every differing pair are here: swap the tables to say what differs.
    payload = table + b"\n" + call
    sizes = {i: int.from_bytes(got[(i + 1) * n - 8 : (i + 1) * n], "little") for i in bad}
    readable = [i for i in bad if 0 < sizes[i] <= _MAX_TABLE_BYTES]
    theirs = {i: torch.empty(sizes[i], dtype=torch.uint8, device=device) for i in readable}
    out = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    transport.exchange(
        [(peers[i], out) for i in readable],
        [(peers[i], theirs[i]) for i in readable],
        timeout=timeout,
        **extra,
    )
    own = {**json.loads(table), **json.loads(call)}
    parts, tensors = [], []
    for i in bad:
        peer = peers[i]
        try:
            body, _, their_call = theirs[i].cpu().numpy().tobytes().partition(b"\n")
            other = {**json.loads(body), **json.loads(their_call)}
            lines, names = _differences(rank, peer, own, other)
        except (KeyError, ValueError, TypeError):
            lines, names = [f"rank {peer}'s plan record is unreadable"], []
        tensors += [t for t in names if t not in tensors]
        shown = lines[:8] + ([f"and {len(lines) - 8} more"] if len(lines) > 8 else [])
        parts.append(f"with rank {peer}: " + "; ".join(shown))
    named = f" (tensors {', '.join(map(repr, tensors[:8]))})" if tensors else ""
    raise PlanError(
        f"rank {rank}: its reshard plan differs from its peers'{named}, found before any "
        f"data moved: {' | '.join(parts)}. Every rank must plan_reshard the same specs "
        "(names, shapes, dtypes, split dims, stage keys, in the same order) and layouts, "
        "and pass reshard the same route and direct_min_bytes"
    )


def prepare_reshard(
    plan: ReshardPlan, rank: int, *, direct_min_bytes: int = DIRECT_MIN_BYTES
) -> None:
    """Derive now what ``rank``'s reshard of ``plan`` needs from the plan alone.

    Optional: :func:`reshard` does it on its first call with a plan object (its
    checks, wire buffers and local copies; tens of ms on a 1,000-tensor state) and
    keeps it while the plan lives. Calling this first moves that cost out of the
    exchange, e.g. to time planning apart from moving.

    Arguments:
        plan: the ReshardPlan the reshard will run.
        rank: this process's global rank.
        direct_min_bytes: the value the reshard call will pass (the derived program
            is kept per value).

    Returns:
        None; a reshard call with the same plan object, rank and direct_min_bytes
        finds the work done.

    Raises:
        PlanError: ``plan`` is not a ReshardPlan (make one with plan_reshard).
    """
    if not isinstance(plan, ReshardPlan):
        raise PlanError(f"expected a ReshardPlan from plan_reshard, got {type(plan).__name__}")
    program(plan, rank, direct_min_bytes)


def reshard(
    plan,
    rank: int,
    tensors: Mapping[str, torch.Tensor],
    transport: Transport,
    *,
    out: Mapping[str, torch.Tensor] | None = None,
    timeout: float = 60.0,
    direct_min_bytes: int = DIRECT_MIN_BYTES,
    workspace: Workspace | None = None,
    route: str = "auto",
    local_done: frozenset[int] = frozenset(),
    liveness: Liveness | None = None,
    verify_plan: bool = True,
) -> ReshardResult:
    """Move this rank's part of a reshard: local copies, pack, one batched exchange, unpack.

    Arguments:
        plan: the ReshardPlan (the same on every rank).
        rank: this process's global rank (must be the transport's).
        tensors: this rank's source shards by spec name (empty if not in plan.src).
        transport: moves the bytes (GlooTransport for host memory, NcclTransport for
            device memory); must reach every peer of this rank in the plan.
        out: preallocated destination shards by spec name (default: allocated here);
            like a source shard, each may be a strided view of rows of one stride
            (e.g. a column block of a larger tensor), filled in place.
        timeout: seconds for the exchange.
        direct_min_bytes: pieces from this size travel as their own buffer (see
            :func:`wire_groups`).
        workspace: reuse its staging buffers (default: allocate per call). It must be
            on the transport's device.
        route: "auto": peers on this host by cross-memory attach where the kernel
            allows it and the pair's bytes flow one way in long runs
            (CMA_MIN_RUN_BYTES), else through shared memory, peers on other hosts
            over the socket route's streams (all host memory only), the others
            through ``transport``; "cma" / "shm" / "net": every peer by cross-memory
            attach / through shared memory / over the socket route; "transport":
            every peer through ``transport``.
            Cross-memory attach is probed and shared-memory segments are set up over
            ``transport`` on first use (collective with the peers) and reused by
            later calls over the same process group. Every rank must pass the same
            route (and direct_min_bytes), as with the plan.
        local_done: indices into the plan's local copies on this rank that the caller
            made already (e.g. by moving pages, see :mod:`nereus_comm.remap`); skipped.
        liveness: a callable returning the global ranks known dead now (e.g. from a
            World's heartbeats; see :data:`nereus_comm.transport.Liveness`). Every wait
            of the transport, shared-memory and cross-memory-attach routes asks it every
            LIVENESS_POLL_S and, once a rank of this plan (source or destination) is
            dead, ends with PeerLostError naming it, however long ``timeout`` is; the
            dead peer's shared-memory files are removed. A rank of the plan, not only a
            peer of this one: a live peer may be stuck waiting on the dead one. None:
            wait until done or ``timeout``.
        verify_plan: before any data moves, check with every peer that both derived
            the same plan (one batched exchange of 40 bytes per peer, about one round
            trip; see the module docstring): specs or layouts that differ between
            ranks otherwise move garbage when their byte counts agree, or abort the
            process inside gloo when they do not. Every rank must pass the same value.
            False skips it, for a caller that guarantees agreement (e.g. every rank
            got the plan's specs from one) and cannot spare the round trip.

    Returns:
        The destination shards and what was measured.

    Raises:
        TensorMismatchError: a tensor is missing, unknown, or differs from its spec
            (shape vs its box, dtype, device: the transport's type and, for a CUDA
            transport, its GPU), is non-contiguous where no single row stride
            describes it, or its bytes are not
            its data (a DTensor or other tensor subclass, sparse, quantized, nested,
            meta, lazily conjugated); the message names the tensor and what to pass.
            Raised before any byte moves.
        PlanError: a peer's plan differs from this rank's (``verify_plan``): both
            raise, naming the tensors (or layouts, route, direct_min_bytes) that differ;
            before any data moves.
        TransportArgumentError: rank is not the transport's, a peer is unreachable,
            an unknown route, or route="cma"/"shm"/"net" with device memory or a peer
            that route cannot reach (the message says why); raised before any byte
            moves. Also when the socket route broke in an earlier call.
        TransportError: a cross-memory-attach read failed (both ends raise; those
            peers take the fallback route from then on), or a socket stream failed
            (the route is broken from then on: build a new process group).
        PeerTimeoutError: a peer did not complete within ``timeout`` (names the peer).
        PeerLostError: ``liveness`` reported a rank of the plan dead (names it; a
            PeerTimeoutError).
    """
    if route not in ROUTES:
        raise TransportArgumentError(f"route must be one of {ROUTES}, got {route!r}")
    if rank != transport.rank:
        raise TransportArgumentError(
            f"reshard on rank {rank} with a transport of rank {transport.rank}"
        )
    device_type = transport.device_type
    if route in ("cma", "shm", "net") and device_type != "cpu":
        raise TransportArgumentError(
            f"route={route!r} moves host memory, {transport!r} moves {device_type} memory; "
            "use route='auto' or 'transport'"
        )
    if workspace is not None and workspace.device.type != device_type:
        raise TransportArgumentError(
            f"the workspace holds {workspace.device} memory but {transport!r} moves "
            f"{device_type} memory; use Workspace({device_type!r})"
        )
    # The plan resolved num_layers into each layout (src and dst may differ), so
    # every box query uses the layout's own.
    prog = program(plan, rank, direct_min_bytes)
    specs, src, dst = plan.specs, plan.src, plan.dst
    dst_specs = getattr(plan, "dst_specs", specs)
    device = getattr(transport, "device", None) or torch.device(device_type)
    views = check_shards(
        tensors, specs, prog.src_expected, src, rank, device_type, "source",
        device=device, strided=True,
    )  # fmt: skip
    # Strided source shards: their pieces placed in their row layout (the rest as is).
    prog_sends, local_src, src_tensors = prog.sends, prog.local_src, tensors
    if views:
        prog_sends, local_src, src_tensors = rebind_sources(prog, tensors, views, specs, rank)
        named = (prog.local_src[i][0] for i in local_done if 0 <= i < len(prog.local_src))
        moved = sorted(set(named) & set(views))
        if moved:
            raise TensorMismatchError(
                f"local_done names local copies of source tensors {moved}, which are strided "
                "views: page moves assume contiguous shards; pass them .contiguous() or make "
                "those copies here (leave them out of local_done)"
            )
    reachable = set(transport.ranks)
    for peer in sorted(prog.peers):
        if peer not in reachable:
            raise TransportArgumentError(
                f"rank {rank} exchanges with rank {peer}, which {transport!r} cannot reach"
            )
    prog_recvs, local_dst = prog.recvs, prog.local_dst
    if out is not None:
        dst_views = check_shards(
            out, dst_specs, prog.dst_expected, dst, rank, device_type, "destination",
            device=device, strided=True,
        )  # fmt: skip
        dst_tensors = dict(out)
        # Strided destination shards (column blocks of a larger tensor): their pieces
        # land in place through their row layout, no copy of the caller's.
        dst_bound = dst_tensors
        if dst_views:
            prog_recvs, local_dst, dst_bound = rebind_destinations(
                prog, dst_tensors, dst_views, dst_specs, rank
            )
            named = (prog.local_dst[i][0] for i in local_done if 0 <= i < len(prog.local_dst))
            moved = sorted(set(named) & set(dst_views))
            if moved:
                raise TensorMismatchError(
                    f"local_done names local copies into destination tensors {moved}, which "
                    "are strided views: page moves assume contiguous shards; pass them "
                    ".contiguous() or make those copies here (leave them out of local_done)"
                )
    else:
        dst_tensors = {
            name: torch.empty(shape, dtype=dtype, device=device)
            for name, (shape, dtype) in prog.dst_expected.items()
        }
        dst_bound = dst_tensors

    if liveness is not None:
        liveness = _within(liveness, frozenset(src.ranks) | frozenset(dst.ranks))

    # Passed only when given: a Transport of another framework's may predate liveness.
    extra = {} if liveness is None else {"liveness": liveness}
    start = time.perf_counter()
    net_pending = None
    try:
        verify_bytes = 0
        if verify_plan:
            verify_bytes = _verify_plan(
                plan, prog, rank, transport, device, route, direct_min_bytes, timeout, extra
            )
        verified_at = time.perf_counter()
        deadline = time.monotonic() + timeout
        send_totals = {p: n for p, n in prog.send_totals.items() if n}
        recv_totals = {p: n for p, n in prog.recv_totals.items() if n}
        cma, cma_sends, cma_recvs, fallback = None, frozenset(), frozenset(), {}
        if route in ("auto", "cma") and device_type == "cpu" and prog.peers:
            cma = _cma_for(transport)
            cma_sends, cma_recvs = cma.prepare(
                send_totals, recv_totals, timeout=timeout, control=transport, liveness=liveness
            )
            fallback = {p: r for p, r in cma.reasons.items() if p in prog.peers}
            missing = (set(send_totals) - cma_sends) | (set(recv_totals) - cma_recvs)
            if route == "cma" and missing:
                raise TransportArgumentError(
                    f"rank {rank} cannot reach peers {sorted(missing)} by cross-memory attach "
                    f"({'; '.join(fallback.get(p, '?') for p in sorted(missing))}); use "
                    "route='auto' to let those go through shared memory or the transport"
                )
        # Route "auto" chooses per peer pair (both ends alike, from the plan): all of a pair's
        # bytes by cross-memory attach when they flow one way only and its message's runs
        # are long (see CMA_MIN_RUN_BYTES), else all through shared memory. One route per
        # pair: a pair split over both paid both routes' handshakes (bench_reshard, resize
        # on 2 workers, 64 MiB: 22 ms split against 16 ms all shm, 18 ms all cma). One way
        # only: where a pair exchanges both ways both processes copy whichever the route,
        # and packing and unpacking in user space ran 1.08-1.19x faster than the kernel's
        # cross-memory reads (bench_reshard's resize cases); where the bytes flow one way,
        # the receiver's single read beat the two copies (1.3-1.4x, sync on 2 workers).
        if route == "cma":
            long_send, long_recv = set(cma_sends), set(cma_recvs)
        else:
            both = set(send_totals) & set(recv_totals)
            long_send = {
                p
                for p in cma_sends
                if p not in both and _long_runs(send_totals[p], prog.send_runs[p])
            }
            long_recv = {
                p
                for p in cma_recvs
                if p not in both and _long_runs(recv_totals[p], prog.recv_runs[p])
            }
        sends, cma_send_slots, cma_send_bytes = _take(prog_sends, lambda b: b.peer in long_send)
        recvs, cma_recv_slots, cma_recv_bytes = _take(prog_recvs, lambda b: b.peer in long_recv)
        shm, shm_sends, shm_recvs = None, frozenset(), frozenset()
        if route in ("auto", "shm") and device_type == "cpu" and prog.peers:
            shm_send, shm_recv = _totals(sends), _totals(recvs)
            if shm_send or shm_recv or route == "shm":
                shm = _shm_for(transport)
                shm_sends, shm_recvs = shm.prepare(
                    shm_send,
                    shm_recv,
                    timeout=timeout,
                    require=route == "shm",
                    control=transport,
                    liveness=liveness,
                )
        sends, shm_send_slots, shm_send_bytes = _take(sends, lambda b: b.peer in shm_sends)
        recvs, shm_recv_slots, shm_recv_bytes = _take(recvs, lambda b: b.peer in shm_recvs)
        # What is left (peers on other hosts, for "auto") goes over the socket route's
        # streams: rows straight from and into the shards, no staging on either side.
        net, net_peers = None, frozenset()
        left = set(_totals(sends)) | set(_totals(recvs))
        if route in ("auto", "net") and device_type == "cpu" and left:
            net = _net_for(transport)
            net_peers = net.prepare(left, timeout=timeout, control=transport, liveness=liveness)
            if route == "net" and left - net_peers:
                raise TransportArgumentError(
                    f"rank {rank} cannot reach peers {sorted(left - net_peers)} by the socket "
                    "route (no address to listen on here or there, or an IPv4 one on one side "
                    "and an IPv6 one on the other: set GLOO_SOCKET_IFNAME or "
                    "NEREUS_NET_ADDRESS); use route='auto' to let those take the transport"
                )
        sends, net_send_slots, net_send_bytes = _take(sends, lambda b: b.peer in net_peers)
        recvs, net_recv_slots, net_recv_bytes = _take(recvs, lambda b: b.peer in net_peers)
        tables = {}
        if cma_send_slots or cma_recv_slots:
            # Before the transport's batch is posted, so both ends of a pair post their
            # records and their data in the same order.
            tables = cma.publish(
                {
                    p: [_region(sl, src_tensors) for sl in slots]
                    for p, slots in cma_send_slots.items()
                },
                {p: len(slots) for p, slots in cma_recv_slots.items()},
                timeout=timeout,
                control=transport,
                liveness=liveness,
            )
        send_stage = _stage(_staged_nbytes(sends), workspace, "send", device)
        recv_stage = _stage(_staged_nbytes(recvs), workspace, "recv", device)
        send_bufs, send_staged = _bind(sends, src_tensors, send_stage)
        recv_bufs, recv_staged = _bind(recvs, dst_bound, recv_stage)
        if send_staged:
            pack(send_staged, out=send_stage)
        packed_at = time.perf_counter()

        # The local copies and the shared-memory messages run while the bytes are on the wire.
        pending = transport.start(send_bufs, recv_bufs, timeout=timeout, **extra)
        if net_send_slots or net_recv_slots:
            net_pending = net.start(
                _slot_tables(prog, "net send", net_send_slots, src_tensors, "send region"),
                _slot_tables(prog, "net recv", net_recv_slots, dst_bound, "receive region"),
                owners=(src_tensors, dst_bound),
                deadline=deadline,
                timeout=timeout,
                liveness=liveness,
            )
        for peer, slots in shm_send_slots.items():
            # The pack is the send: straight from the shards into the peer's segment.
            regions = [_region(sl, src_tensors) for sl in slots]
            shm.send(
                peer,
                shm_send_bytes[peer],
                lambda view, regions=regions: pack(regions, out=view),
                deadline=deadline,
                timeout=timeout,
                liveness=liveness,
            )
        read = {}
        for peer, slots in cma_recv_slots.items():
            # The read is the whole transfer: from the peer's shards into ours.
            regions = [_region(sl, dst_bound) for sl in slots]
            read[peer] = cma.read(peer, tables[peer], regions, cma_recv_bytes[peer])
        read_at = time.perf_counter()
        # After this rank's reads, while its peers may still read from it (cma.finish waits
        # for them): the copies fill that wait. Not on a helper thread beside the reads: each
        # rank's CMA_THREADS reads already fill the cores.
        local = [i for i in range(len(local_src)) if i not in local_done]
        if local:
            if len(local) == len(local_src):  # all of them: the same columns every call
                src_cols = prog.columns("local src", local_src)
                dst_cols = prog.columns("local dst", local_dst)
            else:
                src_cols = slot_columns([local_src[i] for i in local])
                dst_cols = slot_columns([local_dst[i] for i in local])
            copy_tables(
                _bound(src_cols, src_tensors, "source region"),
                _bound(dst_cols, dst_bound, "destination region"),
            )
        copied_at = time.perf_counter()
        if shm_recv_slots:
            shm.receive(
                shm_recv_bytes,
                lambda p, view: unpack(view, [_region(sl, dst_bound) for sl in shm_recv_slots[p]]),
                deadline=deadline,
                timeout=timeout,
                liveness=liveness,
            )
        if cma_send_slots or cma_recv_slots:
            # Our sources must stay untouched until every peer reading them is done.
            cma.finish(
                read,
                list(cma_send_slots),
                timeout=max(deadline - time.monotonic(), 1.0),
                control=transport,
                liveness=liveness,
            )
        if net_pending is not None:
            net_pending.wait()
        pending.wait()
    except BaseException as e:
        if net_pending is not None:
            # The streams may hold part of this call's bytes: no later call may use them.
            net_pending.abort("the call failed while its socket transfers were under way")
        if device_type == "cpu" and isinstance(e, PeerTimeoutError):
            # As the shared-memory route does on its own timeouts: a dead peer's segment
            # files (created, never mapped) are orphans now; remove them, and this
            # process's own segments to the dead, which they may never map (an earlier
            # call's, over another group, that ended before they died).
            if isinstance(e, PeerLostError):
                peers_lost(e.ranks)
            sweep_orphans()
        raise
    exchanged_at = time.perf_counter()
    if recv_staged:
        unpack(recv_stage, recv_staged)
    if device_type == "cuda":
        torch.cuda.synchronize()
    end = time.perf_counter()

    return ReshardResult(
        tensors=dst_tensors,
        seconds=end - start,
        bytes_sent=sum(b.nbytes for b in prog.sends),
        bytes_received=sum(b.nbytes for b in prog.recvs),
        bytes_local=prog.bytes_local,
        messages_sent=prog.messages_sent,
        messages_received=prog.messages_received,
        buffers_sent=sum(1 for b in prog.sends if b.nbytes),
        buffers_received=sum(1 for b in prog.recvs if b.nbytes),
        staged_bytes_sent=_staged_nbytes(prog_sends),
        staged_bytes_received=_staged_nbytes(prog_recvs),
        shm_bytes_sent=sum(shm_send_bytes.values()),
        shm_bytes_received=sum(shm_recv_bytes.values()),
        cma_bytes_sent=sum(cma_send_bytes.values()),
        cma_bytes_received=sum(cma_recv_bytes.values()),
        net_bytes_sent=sum(net_send_bytes.values()),
        net_bytes_received=sum(net_recv_bytes.values()),
        fallback_reasons=fallback,
        pack_seconds=packed_at - start,
        exchange_seconds=exchanged_at - packed_at,
        unpack_seconds=end - exchanged_at,
        read_seconds=read_at - packed_at,
        local_seconds=copied_at - read_at,
        verify_seconds=verified_at - start,
        verify_bytes=verify_bytes,
    )


def shards_from_full(
    full: Mapping[str, torch.Tensor],
    specs: Sequence[TensorSpec],
    layout: Layout,
    rank: int,
    num_layers: int | None = None,
) -> dict[str, torch.Tensor]:
    """Cut a rank's shards out of full tensors by slicing (the reference for tests).

    Arguments:
        full: the full tensor of every spec, by name.
        specs: the specs.
        layout: the layout to cut for.
        rank: the rank (an empty dict if it is not in the layout).
        num_layers: overrides layout.num_layers.

    Returns:
        Fresh contiguous copies of the rank's boxes, by spec name.
    """
    if rank not in layout:
        return {}
    out = {}
    for spec in specs:
        box = layout.box(spec, rank, num_layers)
        if box is not None:
            out[spec.name] = full[spec.name][tuple(slice(a, b) for a, b in box)].clone()
    return out
