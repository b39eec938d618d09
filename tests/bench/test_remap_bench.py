"""pytest-benchmark of the hot path of planning: Llama-3.1-8B's full training state
at 3,264 ranks (dp 204 x tp 8 x pp 2 -> dp 102 x tp 8 x pp 4). With
--benchmark-disable (the suite's default) it runs once, as a plain test."""

from nereus_comm.layout import Layout
from nereus_comm.plan import plan_reshard
from nereus_comm.specs import llama_state_specs


def _layout(dp, tp, pp):
    n = dp * tp * pp
    return Layout(dp, tp, pp, tuple(range(n)), node_of=tuple(r // 8 for r in range(n)))


def test_plan_llama8b_3264_ranks(benchmark):
    specs = llama_state_specs("llama-3.1-8b")
    src, dst = _layout(204, 8, 2), _layout(102, 8, 4)
    plan = benchmark(plan_reshard, specs, src, dst)
    stats = plan.stats
    assert stats.total_bytes == stats.lower_bound_bytes > 0
    # 102 dp replicas of the layer-bound state, norms on all 8 tp ranks, and every
    # rank holds the step counter
    split = sum(s.nbytes for s in specs if s.stage_key is not None and s.split_dim is not None)
    norms = sum(s.nbytes for s in specs if s.stage_key is not None and s.split_dim is None)
    everywhere = sum(s.nbytes for s in specs if s.stage_key is None)
    want = 102 * (split + 8 * norms) + 3264 * everywhere
    assert stats.total_bytes + stats.local_bytes == want
    assert stats.num_messages <= 2 * 3264
