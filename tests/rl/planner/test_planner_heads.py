"""The plan space respects the attention heads: a tp degree that does not split the
query and key/value heads evenly is never offered (Megatron's num_query_groups % tp == 0
for training and forward stages; vLLM's KV-head replication also for the rollout)."""

import pytest

from nereus_rl.core.spec import ModelSpec, cluster_preset
from nereus_rl.core.workload import make_workload
from nereus_rl.costmodel.costmodel import CostModel
from nereus_rl.planner.planner import PlanInfeasibleError, Planner
from nereus_rl.planner.tables import _layouts_of, tp_allowed


def _tps(max_d, heads, kv, replicate):
    return sorted({tp for _, tp, _ in _layouts_of(max_d, heads, 4, kv, replicate_kv=replicate)})


def test_tp_degrees_divide_heads_and_kv_heads():
    # 12 heads: tp 8 does not divide them (it was offered before: 8 <= 12).
    assert _tps(64, 12, 4, False) == [1, 2, 4]
    assert _tps(64, 12, 4, True) == [1, 2, 4]
    # GQA 8 heads / 2 KV heads: training splits the 2 query groups at most in 2; a
    # generation engine may replicate a KV head per rank up to tp = 8.
    assert _tps(64, 8, 2, False) == [1, 2]
    assert _tps(64, 8, 2, True) == [1, 2, 4, 8]
    # MHA (KV heads = heads) and the device limit.
    assert _tps(4, 32, 32, False) == [1, 2, 4]
    assert not tp_allowed(3, 12, 4, True) and tp_allowed(4, 12, 4, False)


@pytest.mark.parametrize("native", [True, False])
def test_plans_never_use_a_tp_that_splits_a_head(native):
    m = ModelSpec("gqa-12", 4, 768, 12, 2, 2048, 1024, 4096)
    c = cluster_preset("h100x16")
    w = make_workload("ppo", actor=m, batch=64, prompt_len=256, response_len=256)
    planner = Planner(c, CostModel(c), native=native)
    res = planner.plan(w, k=20)
    for _, p in res.k_best:
        for sp in p.stages:
            rep = sp.stage == "rollout"
            assert tp_allowed(sp.tp, 12, 2, rep), (sp.stage, sp.tp)
    # Every stage table holds only allowed degrees (training: tp <= 2 here).
    for t in planner._tables.values():
        assert {tp for _, tp, _ in t.layouts} <= {1, 2, 4}


def test_llama_8b_training_tp_at_most_its_kv_heads():
    c = cluster_preset("h200x32")
    w = make_workload("ppo", reward="llama-3.1-8b", batch=64)
    planner = Planner(c, CostModel(c))
    planner.plan(w)
    actor = w.stage("actor_train").model_spec
    by_stage = {
        s.stage: {tp for _, tp, _ in planner._table(s, actor, w.dtype).layouts}
        for s in w.planned_stages
    }
    assert by_stage["actor_train"] == {1, 2, 4, 8}  # 8 KV heads (Megatron)
    assert by_stage["rollout"] == {1, 2, 4, 8, 16, 32}  # KV heads replicated (vLLM)


def test_infeasible_error_names_the_head_rule():
    # One KV head (MQA) and few layers: training can split neither heads nor layers
    # enough to fit; the error says which tp degrees the heads leave.
    m = ModelSpec("mqa-wide", 2, 32768, 64, 1, 131072, 1024, 4096)
    c = cluster_preset("h100x8")
    w = make_workload("grpo", actor=m, batch=8, prompt_len=128, response_len=128)
    for native in (True, False):
        with pytest.raises(PlanInfeasibleError, match=r"limited by the attention heads: ") as e:
            Planner(c, CostModel(c), native=native).plan(w)
        assert "actor_train may use tp in [1] only (mqa-wide: 64 heads, 1 KV heads" in str(e.value)
    # Where the rule removes nothing, the error does not mention it.
    w = make_workload("grpo", actor="llama-3.1-70b", batch=8)
    with pytest.raises(PlanInfeasibleError) as e:
        Planner(cluster_preset("h100x1"), CostModel(cluster_preset("h100x1"))).plan(w)
    assert "attention heads" not in str(e.value)
