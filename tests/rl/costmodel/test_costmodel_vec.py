"""costmodel_vec prices a stage table bit for bit like the scalar costmodel_work calls."""

import numpy as np
import pytest

from nereus_rl.core.spec import MODEL_PRESETS, cluster_preset
from nereus_rl.core.workload import make_workload
from nereus_rl.costmodel import vec as costmodel_vec
from nereus_rl.costmodel.work import stage_memory, stage_work
from nereus_rl.planner.tables import _layout_arrays, _layouts, _layouts_of

CLUSTERS = ("h200x8", "h200x32", "h100x256", "a100x1024", "h100x4096", "local-cpu")
RESPONSE_LENS = (0, 1, 256, 1024, 4096)


def _workloads(model: str, response_len: int):
    small = MODEL_PRESETS[model].num_layers < 32
    batch = 16 if small else 256
    yield make_workload("ppo", actor=model, batch=batch, response_len=response_len, epochs=2)
    yield make_workload(
        "ppo", actor=model, batch=batch, response_len=response_len, reward=model, micro_batch=3
    )
    yield make_workload("grpo", actor=model, batch=batch, group_size=4, response_len=response_len)
    yield make_workload(
        "remax", actor=model, batch=batch, prompt_len=512, response_len=response_len
    )


def _check(cluster_name: str, model: str, response_len: int, dtype: str = "bf16") -> int:
    """Compare every stage and layout; returns how many rows were compared."""
    cluster = cluster_preset(cluster_name)
    n = 0
    for wl in _workloads(model, response_len):
        for sw in wl.stages:
            if sw.kind == "rule":  # no model: the planner gives it no table; all zeros
                layouts = _layouts_of(cluster.num_devices, 1, 1)
            else:
                layouts = _layouts(cluster.num_devices, sw)
            dp, tp, pp, _, inter = _layout_arrays(
                layouts, cluster.devices_per_node, cluster.num_nodes == 1
            )
            got_w = costmodel_vec.stage_work_many(sw, dp, tp, pp, inter, cluster, dtype)
            got_m = costmodel_vec.stage_memory_many(sw, dp, tp, pp, dtype)
            tiers = [tuple("inter" if f else "intra" for f in row) for row in inter]
            want_w = np.array(
                [
                    stage_work(sw, d, t, p, tr, cluster, dtype)
                    for (d, t, p), tr in zip(layouts, tiers)
                ]
            )
            want_m = [stage_memory(sw, d, t, p, dtype) for d, t, p in layouts]
            assert got_w.shape == want_w.shape and got_w.dtype == want_w.dtype
            bad = np.argwhere(got_w != want_w)
            assert np.array_equal(got_w, want_w), (
                f"{cluster_name} {model} r={response_len} {sw.stage}: first mismatch at "
                f"layout {layouts[bad[0][0]]} class {bad[0][1]}"
            )
            assert got_m.tolist() == want_m, (cluster_name, model, response_len, sw.stage)
            n += len(layouts)
    return n


@pytest.mark.parametrize("cluster_name", CLUSTERS)
@pytest.mark.parametrize("model", sorted(MODEL_PRESETS))
def test_bitwise_equal_to_scalar(cluster_name, model):
    n = sum(_check(cluster_name, model, r) for r in RESPONSE_LENS)
    assert n > 0


def test_fp32_and_all_tier_combinations():
    """Every inter/intra combination of the three groups, on a multi-node cluster, fp32."""
    cluster = cluster_preset("h100x64")
    sw_all = make_workload("ppo", actor="medium", batch=64, response_len=300, dtype="fp32").stages
    flags = np.array([[(k >> j) & 1 for j in range(3)] for k in range(8)], dtype=bool)
    for sw in sw_all:
        if sw.kind == "rule":
            continue
        layouts = [lay for lay in _layouts(64, sw) for _ in range(8)]
        dp, tp, pp = (np.array([lay[i] for lay in layouts]) for i in range(3))
        inter = np.tile(flags, (len(layouts) // 8, 1))
        got = costmodel_vec.stage_work_many(sw, dp, tp, pp, inter, cluster, "fp32")
        for row, lay, f in zip(got, layouts, inter):
            tiers = tuple("inter" if x else "intra" for x in f)
            want = stage_work(sw, *lay, tiers, cluster, "fp32")
            assert np.array_equal(row, want), (sw.stage, lay, tiers)


def test_bad_arrays_raise():
    sw = make_workload("grpo", actor="tiny", batch=4, group_size=2).stages[0]
    c = cluster_preset("h200x8")
    with pytest.raises(ValueError, match="one entry per layout"):
        costmodel_vec.stage_work_many(sw, [1, 2], [1], [1], np.zeros((2, 3), bool), c, "bf16")
    with pytest.raises(ValueError, match="integer"):
        costmodel_vec.stage_memory_many(sw, [1.0], [1], [1], "bf16")
