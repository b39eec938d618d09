import pytest

from nereus_rl.core.spec import SpecError, cluster_preset, local_cpu_cluster, model_preset
from nereus_rl.core.workload import WorkloadError, bucket_of, make_workload, response_bucket


def test_model_presets_sizes():
    assert round(model_preset("llama-3.1-8b").num_params / 1e9, 2) == 8.03
    assert round(model_preset("llama-3.1-70b").num_params / 1e9, 1) == 70.6
    tiny = model_preset("tiny")
    assert (tiny.num_layers, tiny.hidden, tiny.num_heads, tiny.num_kv_heads) == (2, 64, 4, 2)
    assert (tiny.ffn_hidden, tiny.vocab) == (176, 64)
    assert 3e6 < model_preset("small").num_params < 7e6
    assert 100e6 < model_preset("medium").num_params < 300e6
    with pytest.raises(SpecError, match="known presets"):
        model_preset("gpt-5")


def test_cluster_presets():
    c = cluster_preset("h200x32")
    assert (c.num_devices, c.devices_per_node, c.num_nodes) == (32, 8, 4)
    assert c.tier([0, 7]) is c.intra and c.tier([7, 8]) is c.inter
    assert cluster_preset("a100x4096").num_nodes == 512
    assert cluster_preset("h100x1").num_nodes == 1
    with pytest.raises(SpecError, match="power of two"):
        cluster_preset("h100x24")
    with pytest.raises(SpecError, match="unknown cluster preset"):
        cluster_preset("tpu-v5x8")
    one, two = local_cpu_cluster(2, 1.0), local_cpu_cluster(2, 2.0)
    # Two workers sharing one core each get half a core's rate.
    assert two.device.peak("fp32") == one.device.peak("fp32") / 2
    assert cluster_preset("local-cpu", num_workers=4).num_devices == 4


def test_workload_stages_per_algo():
    ppo = make_workload("ppo", reward="llama-3.1-8b")
    assert [s.stage for s in ppo.stages] == [
        "rollout",
        "reference",
        "critic_inference",
        "reward",
        "actor_train",
        "critic_train",
    ]
    assert [s.model for s in ppo.stages] == [
        "actor",
        "reference",
        "critic",
        "reward",
        "actor",
        "critic",
    ]
    grpo = make_workload("grpo", batch=32, group_size=8)
    assert grpo.stage("rollout").num_samples == 256
    assert "reward" not in [s.stage for s in grpo.planned_stages]  # rule-based: no device
    remax = make_workload("remax", batch=32)
    assert remax.stage("rollout").num_samples == 64  # sampled + greedy baseline
    assert remax.stage("actor_train").num_samples == 32
    assert ppo.with_response_len(4096).stage("rollout").response_len == 4096


def test_bad_workload_input():
    with pytest.raises(WorkloadError, match="unknown algorithm"):
        make_workload("dpo")
    with pytest.raises(WorkloadError, match="negative"):
        make_workload("ppo", response_len=-1)
    with pytest.raises(WorkloadError, match="GRPO only"):
        make_workload("ppo", group_size=4)
    with pytest.raises(WorkloadError, match="negative"):
        bucket_of(-3)


def test_buckets():
    assert bucket_of(0) == 256 and bucket_of(257) == 512 and bucket_of(20000) == 32768
    assert response_bucket([100, 200, 300, 900, 1000]) == 1024
