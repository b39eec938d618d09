"""The local-CPU preset's core sharing and co-runner interference in the cost model."""

import numpy as np
import pytest

import nereus_rl.costmodel.work as cw
from nereus_rl.core.spec import LocalCpuClusterSpec, cluster_preset, local_cpu_cluster, model_preset
from nereus_rl.core.workload import StageWork
from nereus_rl.costmodel.costmodel import DEFAULT_EFFICIENCY, CostModel
from nereus_rl.costmodel.work import CLASS_INDEX, stage_work

COMPUTE = [CLASS_INDEX[c] for c in ("gemm", "attention", "mem", "elementwise", "launch")]
INTERF = CLASS_INDEX["interference"]
CONTEND = CLASS_INDEX["contention"]
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
    w1 = stage_work(sw, 1, 1, 1, TIERS, cl, "fp32")
    assert w1[INTERF] == w1[CONTEND] == 0.0
    # (workers, those time-slicing a core with another, those at once on other cores):
    # 4 workers on 2 cores: 2 wait for a core, 1 runs beside on the other core.
    for dp, tp, sliced, beside in ((2, 1, 0, 1), (4, 1, 2, 1), (2, 2, 2, 1)):
        w = stage_work(sw, dp, tp, 1, TIERS, cl, "fp32")
        unit = cw.INTERFERENCE_PER_CORUNNER * (w[launch] + w[mem])
        assert w[INTERF] == pytest.approx(sliced * unit)
        assert w[CONTEND] == pytest.approx(beside * unit)
    # Two workers on one core only time-slice; one worker with half a core has no peer.
    w = stage_work(sw, 2, 1, 1, TIERS, local_cpu_cluster(2, 2.0), "fp32")
    assert w[CONTEND] == 0.0 and w[INTERF] > 0.0
    w = stage_work(sw, 1, 1, 1, TIERS, local_cpu_cluster(1, 2.0), "fp32")
    assert w[CONTEND] == w[INTERF] == 0.0
    # Devices that do not share a machine's cores and caches: no such term, no scaling.
    h200 = cluster_preset("h200x32")
    m8b = model_preset("llama-3.1-8b")
    big = StageWork("actor_train", "actor", "train", m8b, False, 64, 512, 0, 1)
    assert stage_work(big, 4, 2, 1, TIERS, h200, "bf16")[[INTERF, CONTEND]].tolist() == [0, 0]


def test_interference_is_conservative_until_measured_then_fitted():
    one_per_core, two_on_one = local_cpu_cluster(2, 1.0), local_cpu_cluster(2, 2.0)
    true = {c: 0.5 for c in DEFAULT_EFFICIENCY}
    true["interference"], true["contention"] = 0.3, 0.2
    x_true = np.array([1 / true[c] for c in cw.CLASSES])
    cm = CostModel(one_per_core)
    for mb in (1, 2, 4, 8):
        for seq in (32, 64, 128):
            w = stage_work(_train(mb=mb, seq=seq), 1, 1, 1, TIERS, one_per_core, "fp32")
            cm.observe_work(w, 1.0)
    # One process never co-runs: the classes keep their conservative start.
    for c in ("interference", "contention"):
        assert cm.efficiency(c) == DEFAULT_EFFICIENCY[c]
    cm = CostModel(one_per_core)
    for _ in range(3):
        for cl, dp in ((one_per_core, 1), (one_per_core, 2), (two_on_one, 2)):
            for mb in (1, 2, 4, 8):
                for seq in (32, 64, 128):
                    w = stage_work(_train(mb=mb, seq=seq), dp, 1, 1, TIERS, cl, "fp32")
                    cm.observe_work(w, float(w @ x_true))
    # Each mechanism is learnt from the layout that has it.
    assert cm.efficiency("interference") == pytest.approx(0.3, rel=0.05)
    assert cm.efficiency("contention") == pytest.approx(0.2, rel=0.05)
    assert DEFAULT_EFFICIENCY["interference"] < 0.2  # the start over-prices both
    assert DEFAULT_EFFICIENCY["contention"] < 0.2


@pytest.mark.parametrize("sw", [_train(), _gen()], ids=["train", "generate"])
def test_capped_workers_keep_their_own_cores(sw):
    # A quarter of a core each (a CPU quota per worker): eight workers hold two cores,
    # and a stage on two of them runs no faster than on its quarter cores.
    capped = local_cpu_cluster(8, 2.0, worker_cores=0.25)
    assert capped.capped and capped.cores == 2.0
    assert capped.device.kernel_overhead_s == local_cpu_cluster(8, 4.0).device.kernel_overhead_s
    quarter = stage_work(sw, 2, 1, 1, TIERS, capped, "fp32")
    shared = stage_work(sw, 2, 1, 1, TIERS, local_cpu_cluster(8, 4.0), "fp32")
    np.testing.assert_allclose(quarter[COMPUTE], 4 * shared[COMPUTE], rtol=1e-12)
    # Every worker busy: a quarter core each, capped or shared alike.
    np.testing.assert_allclose(
        stage_work(sw, 8, 1, 1, TIERS, capped, "fp32")[COMPUTE],
        stage_work(sw, 8, 1, 1, TIERS, local_cpu_cluster(8, 4.0), "fp32")[COMPUTE],
        rtol=1e-12,
    )


def test_worker_cores_outside_a_core_is_refused():
    from nereus_rl.core.spec import SpecError

    for bad in (0.0, -1.0, 1.5):
        with pytest.raises(SpecError, match="worker_cores"):
            local_cpu_cluster(4, worker_cores=bad)
