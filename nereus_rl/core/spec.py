"""Cluster and model specs: plain frozen data with presets by name.

``ClusterSpec`` describes devices (memory, peak rate per dtype, memory bandwidth),
how they group into nodes, and two link tiers: ``intra`` (inside a node: NVLink,
or shared memory for local CPU workers) and ``inter`` (across nodes: InfiniBand).
``ModelSpec`` describes a Llama-style decoder. The preset values here are the
single truth for the project (``nereus_rl.models.model`` builds its models from them).

Presets:
    clusters: ``"<dev>x<N>"`` for dev in h200, h100, a100 and N a power of two
    from 1 to 4,096 (nodes of 8), e.g. ``"h200x32"``, ``"h100x1024"``,
    ``"a100x4096"``; ``"local-cpu"`` (see :func:`local_cpu_cluster`).
    models: ``"llama-3.1-8b"``, ``"llama-3.1-70b"``, and the trainer's
    ``"tiny"``, ``"small"``, ``"medium"``, ``"large"``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace


class SpecError(ValueError):
    """A spec or preset request that cannot be honoured (unknown name, bad value)."""


def _check_pow2(name: str, v: int) -> None:
    if not isinstance(v, int) or v < 1 or v & (v - 1):
        raise SpecError(f"{name}={v!r} must be a power of two (1, 2, 4, ...)")


@dataclass(frozen=True)
class LinkTier:
    """One tier of links: per-device bandwidth (bytes/s, one direction) and latency (s)."""

    name: str
    bandwidth_Bps: float
    latency_s: float

    def __repr__(self) -> str:
        return f"{self.name}({self.bandwidth_Bps / 1e9:g} GB/s, {self.latency_s * 1e6:g} us)"


@dataclass(frozen=True)
class DeviceSpec:
    """One device: memory (bytes), peak rate per dtype (FLOP/s), memory bandwidth (B/s).

    ``kernel_overhead_s`` is the fixed cost of launching one kernel (or one eager op on
    CPU); the cost model multiplies it by a kernel count per layer.
    """

    name: str
    memory_bytes: int
    peak_flops: tuple[tuple[str, float], ...]
    mem_bw_Bps: float
    kernel_overhead_s: float

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype``.

        Raises:
            SpecError: the device has no rate for ``dtype``.
        """
        for d, v in self.peak_flops:
            if d == dtype:
                return v
        have = [d for d, _ in self.peak_flops]
        raise SpecError(f"device {self.name!r} has no peak rate for dtype {dtype!r}; has {have}")

    def __repr__(self) -> str:
        return f"{self.name}({self.memory_bytes / 2**30:.0f} GiB)"


@dataclass(frozen=True)
class ClusterSpec:
    """A set of identical devices in nodes of ``devices_per_node``.

    Device ``i`` lives on node ``i // devices_per_node``. ``comm_setup_s`` and
    ``comm_setup_per_rank_s`` price creating one communicator over n ranks as
    ``comm_setup_s + n * comm_setup_per_rank_s``; ``primitive_overhead_s`` is the fixed
    bookkeeping cost of one EMU primitive.
    """

    name: str
    device: DeviceSpec
    num_devices: int
    devices_per_node: int
    intra: LinkTier
    inter: LinkTier
    comm_setup_s: float = 0.05
    comm_setup_per_rank_s: float = 0.002
    primitive_overhead_s: float = 0.05

    def __post_init__(self) -> None:
        if self.num_devices < 1 or self.devices_per_node < 1:
            raise SpecError(
                f"cluster {self.name!r}: num_devices={self.num_devices} and "
                f"devices_per_node={self.devices_per_node} must be >= 1"
            )

    @property
    def num_nodes(self) -> int:
        return -(-self.num_devices // self.devices_per_node)

    def node_of(self, device: int) -> int:
        return device // self.devices_per_node

    def tier(self, devices) -> LinkTier:
        """The tier linking ``devices``: intra when they share a node (or there is one node)."""
        if self.num_nodes == 1:
            return self.intra
        nodes = {d // self.devices_per_node for d in devices}
        return self.intra if len(nodes) <= 1 else self.inter

    def with_devices(self, num_devices: int) -> ClusterSpec:
        """The same cluster with ``num_devices`` devices."""
        return replace(self, num_devices=num_devices, name=f"{self.name}:{num_devices}")

    def __repr__(self) -> str:
        return (
            f"ClusterSpec({self.name}: {self.num_devices} x {self.device!r}, "
            f"{self.devices_per_node}/node, intra {self.intra!r}, inter {self.inter!r})"
        )


# Datasheet figures (dense, no sparsity). Bandwidths are per device, one direction.
_DEVICES = {
    "h200": DeviceSpec(
        "H200",
        141 * 10**9,
        (("bf16", 989e12), ("fp16", 989e12), ("fp32", 67e12)),
        4.8e12,
        5e-6,
    ),
    "h100": DeviceSpec(
        "H100-SXM",
        80 * 2**30,
        (("bf16", 989e12), ("fp16", 989e12), ("fp32", 67e12)),
        3.35e12,
        5e-6,
    ),
    "a100": DeviceSpec(
        "A100-SXM-80GB",
        80 * 2**30,
        (("bf16", 312e12), ("fp16", 312e12), ("fp32", 19.5e12)),
        2.039e12,
        5e-6,
    ),
}
_LINKS = {
    "h200": (LinkTier("nvlink4", 450e9, 3e-6), LinkTier("ib-ndr400", 50e9, 6e-6)),
    "h100": (LinkTier("nvlink4", 450e9, 3e-6), LinkTier("ib-ndr400", 50e9, 6e-6)),
    "a100": (LinkTier("nvlink3", 300e9, 3e-6), LinkTier("ib-hdr200", 25e9, 6e-6)),
}
_CLUSTER_RE = re.compile(r"^(h200|h100|a100)x(\d+)$")


@dataclass(frozen=True)
class LocalCpuClusterSpec(ClusterSpec):
    """The local-CPU preset: worker processes that share ``cores`` CPU cores.

    The device spec is one worker when every worker is busy (its share of a core);
    ``costmodel_work`` gives a stage back the cores its idle peers leave free and
    prices the interference between the workers that run at once.
    """

    cores: float = 1.0
    #: Each worker has its own cores (``worker_cores`` of :func:`local_cpu_cluster`: a
    #: quota per worker), so a stage whose peers idle gets no more than its own.
    capped: bool = False


# gloo between local worker processes goes over loopback TCP; on a 2-core machine a
# 1 KiB to 64 KiB all-reduce takes about 0.5 to 4 ms (2 or 4 ranks on 1 or 2 cores): a
# waiting rank's wake-up, not the bytes, sets it. 0.5 ms per ring step (2(n-1) steps)
# sits inside that range.
LOCAL_LINK = LinkTier("gloo-loopback", 2e9, 500e-6)


def local_cpu_cluster(
    num_workers: int = 4,
    workers_per_core: float = 2.0,
    *,
    memory_bytes: int = 24 * 2**30,
    core_peak_flops: float = 150e9,
    core_mem_bw_Bps: float = 25e9,
    worker_cores: float | None = None,
) -> LocalCpuClusterSpec:
    """The local CPU workers as a cluster: one device per worker process.

    ``num_workers`` processes share the machine's cores, ``workers_per_core`` of them
    per core when all are busy (2 workers on 1 core: 2.0; 2 workers on 2 cores: 1.0;
    pass 1.0 to price CPU time, which time-slicing does not add to). Each worker's peak
    rate, memory bandwidth and per-op dispatch time are its share of one core's (all of
    it is CPU work), so the cost model's predictions account for the sharing; a stage
    that keeps fewer workers busy than there are cores gets whole cores (see
    ``costmodel_work.stage_work``). The peak figures are nominal; the efficiency of each
    operation class is fitted from measurements (``CostModel.observe``). Memory is the
    machine's, split evenly over the workers. All workers sit in one node linked by
    gloo over loopback.

    ``worker_cores`` (at most 1) says instead that each worker has that many cores of
    its own (a CPU quota per worker, as a device brings its own compute): the workers
    then hold ``num_workers * worker_cores`` cores in all, and a stage whose peers idle
    gets no more than its own share (``workers_per_core`` is ignored).

    Raises:
        SpecError: a non-positive count, a worker_cores outside (0, 1].
    """
    if num_workers < 1 or workers_per_core <= 0:
        raise SpecError(
            f"local-cpu: num_workers={num_workers} must be >= 1 and "
            f"workers_per_core={workers_per_core} > 0"
        )
    if worker_cores is not None:
        if not 0 < worker_cores <= 1:
            raise SpecError(
                f"local-cpu: worker_cores={worker_cores} must be in (0, 1]: a worker runs "
                "one thread"
            )
        workers_per_core = 1.0 / worker_cores
    per_core = max(workers_per_core, 1.0)
    share = 1.0 / per_core
    dev = DeviceSpec(
        "cpu-worker",
        memory_bytes // num_workers,
        (("fp32", core_peak_flops * share), ("bf16", core_peak_flops * share / 4)),
        core_mem_bw_Bps * share,
        2e-6 * per_core,
    )
    return LocalCpuClusterSpec(
        f"local-cpu:{num_workers}",
        dev,
        num_workers,
        num_workers,
        LOCAL_LINK,
        LOCAL_LINK,
        comm_setup_s=0.02,
        comm_setup_per_rank_s=0.005,
        primitive_overhead_s=0.01,
        cores=num_workers / per_core,
        capped=worker_cores is not None,
    )


def cluster_preset(name: str, **kwargs) -> ClusterSpec:
    """A ClusterSpec by name: ``"h200x32"``, ``"h100x1024"``, ``"a100x4096"``, ``"local-cpu"``.

    Arguments:
        name: ``"<h200|h100|a100>x<N>"`` (N a power of two, 1..4,096; nodes of 8 with
            NVLink inside and InfiniBand across) or ``"local-cpu"``.
        kwargs: for ``"local-cpu"``, passed to :func:`local_cpu_cluster`.

    Returns:
        The ClusterSpec.

    Raises:
        SpecError: unknown name or a device count that is not a power of two up to 4,096.
    """
    if name == "local-cpu":
        return local_cpu_cluster(**kwargs)
    m = _CLUSTER_RE.match(name)
    if not m:
        raise SpecError(
            f"unknown cluster preset {name!r}; use 'local-cpu' or '<h200|h100|a100>x<N>' "
            "such as 'h200x32'"
        )
    if kwargs:
        raise SpecError(f"cluster preset {name!r} takes no options, got {sorted(kwargs)}")
    kind, n = m.group(1), int(m.group(2))
    _check_pow2(f"{name}: device count", n)
    if n > 4096:
        raise SpecError(f"{name}: at most 4,096 devices in a preset, got {n}")
    intra, inter = _LINKS[kind]
    return ClusterSpec(name, _DEVICES[kind], n, min(8, n), intra, inter)


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-style decoder: GQA attention, SwiGLU MLP, RMSNorm, untied embeddings."""

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden: int
    vocab: int
    max_seq_len: int

    def __post_init__(self) -> None:
        for f in ("num_layers", "hidden", "num_heads", "num_kv_heads", "ffn_hidden", "vocab"):
            if getattr(self, f) < 1:
                raise SpecError(f"ModelSpec {self.name!r}: {f}={getattr(self, f)} must be >= 1")
        if self.hidden % self.num_heads or self.num_heads % self.num_kv_heads:
            raise SpecError(
                f"ModelSpec {self.name!r}: hidden ({self.hidden}) must divide by num_heads "
                f"({self.num_heads}) and num_heads by num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (q, k, v, o, gate, up, down, two norms)."""
        h, kv = self.hidden, self.num_kv_heads * self.head_dim
        return 2 * h * h + 2 * h * kv + 3 * h * self.ffn_hidden + 2 * h

    @property
    def embedding_params(self) -> int:
        """One of the two (untied) vocabulary matrices."""
        return self.vocab * self.hidden

    @property
    def num_params(self) -> int:
        return self.num_layers * self.layer_params + 2 * self.embedding_params + self.hidden

    def __repr__(self) -> str:
        return (
            f"ModelSpec({self.name}: {self.num_params / 1e6:.1f}M params, L{self.num_layers} "
            f"h{self.hidden} heads {self.num_heads}/{self.num_kv_heads} ffn{self.ffn_hidden} "
            f"V{self.vocab})"
        )


MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("llama-3.1-8b", 32, 4096, 32, 8, 14336, 128256, 131072),
        ModelSpec("llama-3.1-70b", 80, 8192, 64, 8, 28672, 128256, 131072),
        ModelSpec("tiny", 2, 64, 4, 2, 176, 64, 128),
        ModelSpec("small", 6, 256, 8, 4, 688, 256, 256),
        ModelSpec("medium", 12, 1024, 16, 8, 2816, 256, 1024),
        ModelSpec("large", 24, 1024, 16, 8, 2816, 256, 1024),
    )
}


def model_preset(name: str) -> ModelSpec:
    """A ModelSpec by name (see ``MODEL_PRESETS``).

    Raises:
        SpecError: unknown name.
    """
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise SpecError(
            f"unknown model preset {name!r}; known presets: {sorted(MODEL_PRESETS)}"
        ) from None
