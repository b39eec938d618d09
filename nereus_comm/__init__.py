"""nereus_comm: elastic communication for sharded training state.

Plans which bytes of sharded state move from which rank to which between two
layouts, packs and unpacks them, moves them over gloo (CPU) or NCCL (GPU),
pools communicators, and lets processes join a running job.
"""

from nereus_comm import _C  # noqa: F401  (fail early if the native core is missing)

__version__ = "0.1.0"
