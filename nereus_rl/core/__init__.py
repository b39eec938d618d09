"""Plain data every layer shares: plans, cluster and model specs, workloads.

:mod:`.globalplan` (``GlobalPlan``, ``StagePlan``: each stage's layout and devices),
:mod:`.spec` (``ClusterSpec``, ``ModelSpec`` and their presets) and :mod:`.workload`
(``Workload``: the stages of one RL step). The bottom layer: it imports nothing of
nereus_rl (core <- costmodel <- planner <- policy; core <- transition <- emu), and
importing it starts nothing.
"""

from nereus_rl.core.globalplan import GlobalPlan, StagePlan, fmt_bytes, fmt_devices
from nereus_rl.core.spec import (
    MODEL_PRESETS,
    ClusterSpec,
    DeviceSpec,
    LinkTier,
    LocalCpuClusterSpec,
    ModelSpec,
    SpecError,
    cluster_preset,
    local_cpu_cluster,
    model_preset,
)
from nereus_rl.core.workload import (
    ALGOS,
    DEFAULT_BUCKETS,
    StageWork,
    Workload,
    WorkloadError,
    bucket_of,
    make_workload,
    response_bucket,
)

__all__ = [
    "ALGOS",
    "DEFAULT_BUCKETS",
    "MODEL_PRESETS",
    "ClusterSpec",
    "DeviceSpec",
    "GlobalPlan",
    "LinkTier",
    "LocalCpuClusterSpec",
    "ModelSpec",
    "SpecError",
    "StagePlan",
    "StageWork",
    "Workload",
    "WorkloadError",
    "bucket_of",
    "cluster_preset",
    "fmt_bytes",
    "fmt_devices",
    "local_cpu_cluster",
    "make_workload",
    "model_preset",
    "response_bucket",
]
