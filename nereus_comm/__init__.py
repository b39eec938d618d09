"""nereus_comm: elastic communication for sharded training state.

Plans which bytes of sharded state move from which rank to which between two
layouts (C++ planner), packs and unpacks them (C++ host path, Triton on GPU),
moves them over gloo (CPU; shared memory or cross-memory attach between ranks on
one host) or NCCL (GPU, loaded at run time) or over a framework's own
torch.distributed group (ProcessGroupTransport), moves the bytes a rank keeps by
remapping pages, pools communicators, and lets processes join a running job.

Example (on every rank of both layouts)::

    specs = [TensorSpec("w", (1024, 512), torch.float32, split_dim=0)]
    plan = plan_reshard(specs, Layout(dp=2, tp=2, pp=1, ranks=(0, 1, 2, 3)),
                        Layout(dp=1, tp=4, pp=1, ranks=(0, 1, 2, 3)))
    out = reshard(plan, rank, {"w": my_shard}, GlooTransport())

Every name below is public; so are the modules that define them (``nereus_comm.x``
for a module ``x.py`` whose name does not start with ``_``). Every error derives from
:class:`NereusCommError`. :mod:`nereus_comm.testing` holds a local worker pool for
tests; ``examples/`` in the source tree shows the library in use.
"""

from nereus_comm import _C  # noqa: F401  (fail early if the native core is missing)
from nereus_comm.environment import WORKER_ENV, worker_env, worker_environ
from nereus_comm.errors import (
    LayoutError,
    MembershipError,
    NcclError,
    NcclNotFoundError,
    NereusCommError,
    PackError,
    PeerLostError,
    PeerTimeoutError,
    PlanError,
    PoolError,
    RemapError,
    TensorMismatchError,
    TransportArgumentError,
    TransportError,
)
from nereus_comm.layout import Box, Layout, TensorSpec, box_shape, local_region
from nereus_comm.nccl import load_nccl
from nereus_comm.optim_state import TrainingState, flatten_state, param_name, unflatten_state
from nereus_comm.pack import Region, copy_regions, pack, unpack
from nereus_comm.placement import ShardedPlan, ShardedResult, plan_sharded, reshard_sharded
from nereus_comm.plan import ReshardPlan, plan_reshard
from nereus_comm.pool import (
    CommPool,
    Communicator,
    GlooBackend,
    NcclBackend,
    PoolBackend,
    PoolStats,
)
from nereus_comm.remap import (
    MIN_MOVE_BYTES,
    PAGE_BYTES,
    PageMoves,
    local_page_moves,
    move_ranges,
    swap_pages,
)
from nereus_comm.reshard import (
    DIRECT_MIN_BYTES,
    ReshardResult,
    Workspace,
    prepare_reshard,
    reshard,
    shards_from_full,
)
from nereus_comm.sharding import (
    RankMesh,
    Replicate,
    Shard,
    Sharding,
    StridedShard,
    sharding_from_layout,
)
from nereus_comm.specs import transformer_state_specs
from nereus_comm.transport import GlooTransport, Liveness, NcclTransport, Transport
from nereus_comm.transport_pg import ProcessGroupTransport
from nereus_comm.transport_shm import ShmTransport
from nereus_comm.world import World

__version__ = "0.1.0"

__all__ = [
    "DIRECT_MIN_BYTES",
    "MIN_MOVE_BYTES",
    "PAGE_BYTES",
    "WORKER_ENV",
    "Box",
    "CommPool",
    "Communicator",
    "GlooBackend",
    "GlooTransport",
    "Layout",
    "LayoutError",
    "Liveness",
    "MembershipError",
    "NcclBackend",
    "NcclError",
    "NcclNotFoundError",
    "NcclTransport",
    "NereusCommError",
    "PackError",
    "PageMoves",
    "PeerLostError",
    "PeerTimeoutError",
    "PlanError",
    "PoolBackend",
    "PoolError",
    "PoolStats",
    "ProcessGroupTransport",
    "RankMesh",
    "Region",
    "RemapError",
    "Replicate",
    "ReshardPlan",
    "ReshardResult",
    "Shard",
    "ShardedPlan",
    "ShardedResult",
    "Sharding",
    "ShmTransport",
    "StridedShard",
    "TensorMismatchError",
    "TensorSpec",
    "TrainingState",
    "Transport",
    "TransportArgumentError",
    "TransportError",
    "Workspace",
    "World",
    "box_shape",
    "copy_regions",
    "flatten_state",
    "load_nccl",
    "local_page_moves",
    "local_region",
    "move_ranges",
    "pack",
    "param_name",
    "plan_reshard",
    "plan_sharded",
    "prepare_reshard",
    "reshard",
    "reshard_sharded",
    "sharding_from_layout",
    "shards_from_full",
    "swap_pages",
    "transformer_state_specs",
    "unflatten_state",
    "unpack",
    "worker_env",
    "worker_environ",
]
