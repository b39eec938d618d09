"""A Ray cluster on loopback for tests: ray.cluster_utils.Cluster, every node on 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])


@contextlib.contextmanager
def loopback_ray_cluster(nodes: int, cpus_per_node: int = 2) -> Iterator[object]:
    """A head without CPUs and ``nodes`` nodes of ``cpus_per_node`` CPUs, all on
    127.0.0.1 (RAY_ENV keeps Ray's own address resolution there, no dashboard), with
    this process's ray.init connected to it. The actors import the tests' own commands
    (``tests.support``), so PYTHONPATH gains the repository root. At the end Ray is shut
    down, the cluster stopped and the environment restored."""
    import ray
    from ray.cluster_utils import Cluster

    from nereus_rl.runtime.ray_runtime import RAY_ENV

    saved = {k: os.environ.get(k) for k in (*RAY_ENV, "PYTHONPATH")}
    os.environ.update(RAY_ENV)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, saved["PYTHONPATH"]]))
    cluster = None
    try:
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 0,
                "node_ip_address": "127.0.0.1",
                "include_dashboard": False,
            },
        )
        for _ in range(nodes):
            cluster.add_node(num_cpus=cpus_per_node, node_ip_address="127.0.0.1")
        ray.init(address=cluster.address, _node_ip_address="127.0.0.1", configure_logging=False)
        yield cluster
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
