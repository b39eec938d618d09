"""nereus_comm: elastic communication for sharded training state.

Plans which bytes of sharded state move from which rank to which between two
layouts (C++ planner), packs and unpacks them (C++ host path, Triton on GPU),
moves them over gloo (CPU; shared memory between ranks on one host) or NCCL
(GPU, loaded at run time), pools
communicators, and lets processes join a running job.

Example (on every rank of both layouts)::

    specs = [TensorSpec("w", (1024, 512), torch.float32, split_dim=0)]
    plan = plan_reshard(specs, Layout(dp=2, tp=2, pp=1, ranks=(0, 1, 2, 3)),
                        Layout(dp=1, tp=4, pp=1, ranks=(0, 1, 2, 3)))
    out = reshard(plan, rank, {"w": my_shard}, GlooTransport())
"""

from nereus_comm import _C  # noqa: F401  (fail early if the native core is missing)
from nereus_comm.errors import (
    LayoutError,
    MembershipError,
    NereusCommError,
    PeerTimeoutError,
    PlanError,
    TensorMismatchError,
    TransportError,
)
from nereus_comm.layout import Layout, TensorSpec, local_region
from nereus_comm.pack import Region, pack, unpack
from nereus_comm.plan import ReshardPlan, plan_reshard
from nereus_comm.pool import CommPool, GlooBackend, NcclBackend
from nereus_comm.reshard import ReshardResult, reshard
from nereus_comm.transport import GlooTransport, NcclTransport, Transport
from nereus_comm.transport_shm import ShmTransport
from nereus_comm.world import World

__version__ = "0.1.0"

__all__ = [
    "CommPool",
    "GlooBackend",
    "GlooTransport",
    "Layout",
    "LayoutError",
    "MembershipError",
    "NcclBackend",
    "NcclTransport",
    "NereusCommError",
    "PeerTimeoutError",
    "PlanError",
    "Region",
    "ReshardPlan",
    "ReshardResult",
    "ShmTransport",
    "TensorMismatchError",
    "TensorSpec",
    "Transport",
    "TransportError",
    "World",
    "local_region",
    "pack",
    "plan_reshard",
    "reshard",
    "unpack",
]
