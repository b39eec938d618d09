"""The local-CPU preset's core sharing and co-runner interference in the cost model."""

import numpy as np
import pytest

import nereus_rl.costmodel_work as cw
from nereus_rl.costmodel import DEFAULT_EFFICIENCY, CostModel
from nereus_rl.costmodel_work import CLASS_INDEX, stage_work
from nereus_rl.spec import LocalCpuClusterSpec, cluster_preset, local_cpu_cluster, model_preset
from nereus_rl.workload import StageWork

COMPUTE = [CLASS_INDEX[c] for c in ("gemm", "attention", "mem", "elementwise", "launch")]
INTERF = CLASS_INDEX["interference"]
TIERS = ("intra", "intra", "intra")


def _train(b=8, mb=2, seq=32):
    return StageWork("actor_train", "actor", "train", model_preset("tiny"), False, b, seq, 0, mb)


def _gen():
    return StageWork("rollout", "actor", "generate", model_preset("tiny"), False, 8, 10, 12)


def test_preset_shares_every_cpu_part_of_a_core():
    one, two = local_cpu_cluster(2, 1.0), local_cpu_cluster(2, 2.0)
    assert isinstance(two, LocalCpuClusterSpec)
    assert (one.cores, two.cores, local_cpu_cluster(4, 2.0).cores) == (2.0, 1.0, 2.0)
    # Eager-op dispatch is CPU work like the FLOPs: it slows down with the share too.
    assert two.device.kernel_overhead_s == 2 * one.device.kernel_overhead_s
    assert two.with_devices(3).cores == two.cores


@pytest.mark.parametrize("sw", [_train(), _gen()], ids=["train", "generate"])
def test_stage_on_fewer_workers_than_cores_gets_whole_cores(sw):
    four_on_two = local_cpu_cluster(4, 2.0)  # the device spec: half a core
    whole = local_cpu_cluster(2, 1.0)  # a worker per core
    w2 = stage_work(sw, 2, 1, 1, TIERS, four_on_two, "fp32")
    np.testing.assert_allclose(
        w2[COMPUTE], stage_work(sw, 2, 1, 1, TIERS, whole, "fp32")[COMPUTE], rtol=1e-12
    )
    # Four busy workers on two cores: half a core each, as the device spec says.
    w4 = stage_work(sw, 4, 1, 1, TIERS, four_on_two, "fp32")
    w4_whole = stage_work(sw, 4, 1, 1, TIERS, local_cpu_cluster(4, 1.0), "fp32")
    np.testing.assert_allclose(w4[COMPUTE], 2 * w4_whole[COMPUTE], rtol=1e-12)
    # One worker alone is no faster than a whole core.
    w1 = stage_work(sw, 1, 1, 1, TIERS, four_on_two, "fp32")
    w1_whole = stage_work(sw, 1, 1, 1, TIERS, local_cpu_cluster(1, 1.0), "fp32")
    np.testing.assert_allclose(w1[COMPUTE], w1_whole[COMPUTE], rtol=1e-12)


def test_interference_counts_co_running_workers():
    cl = local_cpu_cluster(4, 2.0)
    sw = _train()
    launch, mem = CLASS_INDEX["launch"], CLASS_INDEX["mem"]
    assert stage_work(sw, 1, 1, 1, TIERS, cl, "fp32")[INTERF] == 0.0
    for dp, tp in ((2, 1), (4, 1), (2, 2)):
        w = stage_work(sw, dp, tp, 1, TIERS, cl, "fp32")
        want = (dp * tp - 1) * cw.INTERFERENCE_PER_CORUNNER * (w[launch] + w[mem])
        assert w[INTERF] == pytest.approx(want)
    # Devices that do not share a machine's cores and caches: no such term, no scaling.
    h200 = cluster_preset("h200x32")
    m8b = model_preset("llama-3.1-8b")
    big = StageWork("actor_train", "actor", "train", m8b, False, 64, 512, 0, 1)
    assert stage_work(big, 4, 2, 1, TIERS, h200, "bf16")[INTERF] == 0.0


def test_interference_is_conservative_until_measured_then_fitted():
    cl = local_cpu_cluster(2, 1.0)
    true = {c: 0.5 for c in DEFAULT_EFFICIENCY}
    true["interference"] = 0.2
    x_true = np.array([1 / true[c] for c in cw.CLASSES])
    cm = CostModel(cl)
    for mb in (1, 2, 4, 8):
        for seq in (32, 64, 128):
            cm.observe_work(stage_work(_train(mb=mb, seq=seq), 1, 1, 1, TIERS, cl, "fp32"), 1.0)
    # One process never co-runs: the class keeps its conservative start.
    assert cm.efficiency("interference") == DEFAULT_EFFICIENCY["interference"]
    cm = CostModel(cl)
    for _ in range(3):
        for dp in (1, 2):
            for mb in (1, 2, 4, 8):
                for seq in (32, 64, 128):
                    w = stage_work(_train(mb=mb, seq=seq), dp, 1, 1, TIERS, cl, "fp32")
                    cm.observe_work(w, float(w @ x_true))
    assert cm.efficiency("interference") == pytest.approx(0.2, rel=0.05)
    assert DEFAULT_EFFICIENCY["interference"] < 0.2  # the start over-prices it
