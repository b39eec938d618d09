import dataclasses
import itertools
import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import nereus_rl.costmodel.work as cw
from nereus_rl.core.globalplan import GlobalPlan, StagePlan
from nereus_rl.core.spec import cluster_preset, local_cpu_cluster, model_preset
from nereus_rl.core.workload import StageWork, make_workload
from nereus_rl.costmodel.costmodel import DEFAULT_EFFICIENCY, CostModel, CostModelError, UnitLayout
from nereus_rl.costmodel.work import CLASS_INDEX, NUM_CLASSES
from nereus_rl.models.model import Decoder, get_preset

GIB = 2**30


def _sp(stage, model, trains, dp, tp, pp, start=0):
    n = tp * pp
    units = tuple(tuple(range(start + u * n, start + (u + 1) * n)) for u in range(dp))
    return StagePlan(stage, model, trains, dp, tp, pp, units)


@pytest.fixture
def cm():
    return CostModel(cluster_preset("h200x32"))


def test_memory_llama8b_hand_computed(cm):
    # Llama-3.1-8B: layer = 2*4096^2 + 2*4096*1024 + 3*4096*14336 + 2*4096 = 218,112,000;
    # one vocab matrix = 128256*4096 = 525,336,576.
    w = make_workload("ppo", batch=256, prompt_len=1024, response_len=1024, micro_batch=1)
    train = w.stage("actor_train")
    # tp1 pp1: 16 B/param x (32 layers + 2 vocab matrices) + 32 layers x s*h*34 + 8 B logits.
    full = 16 * (32 * 218_112_000 + 2 * 525_336_576)
    act = 32 * 2048 * 4096 * (10 + 24)
    logits = 8 * 2048 * 128256
    assert cm.stage_memory(train, 1, 1, 1, "bf16") == full + act + logits
    # tp8 pp4: 8 layers + one vocab matrix per device /8; 4 micro-batches in flight.
    params_dev = (8 * 218_112_000 + 525_336_576) // 8
    act = 8 * 4 * 2048 * 4096 * (10 + 3)
    logits = 8 * 2048 * 128256 // 8
    assert cm.stage_memory(train, 8, 8, 4, "bf16") == 16 * params_dev + act + logits
    # Rollout tp4: bf16 weights + KV cache of 64 sequences x 2048 tokens (2 kv heads/device).
    roll = w.stage("rollout")
    weights = 2 * (32 * 218_112_000 + 2 * 525_336_576) // 4
    kv = 64 * 2048 * 2 * 32 * 256 * 2
    logits = 4 * 64 * 128256 // 4
    assert cm.stage_memory(roll, 4, 4, 1, "bf16") == weights + kv + logits
    assert kv == 4 * GIB


def test_colocated_memory_sums(cm):
    w = make_workload("grpo", batch=64, group_size=4)
    plan = GlobalPlan(
        (
            _sp("rollout", "actor", False, 2, 4, 1),
            _sp("reference", "reference", False, 8, 1, 1),
            _sp("actor_train", "actor", True, 1, 4, 2),
        )
    )
    peak = cm.peak_memory(plan, w)
    m = {
        s.stage: cm.stage_memory(s, sp.dp, sp.tp, sp.pp, "bf16")
        for s, sp in zip(w.planned_stages, plan.stages)
    }
    assert peak[0] == m["rollout"] + m["reference"] + m["actor_train"]
    assert set(peak) == set(range(8))
    # cached per (plan, workload): a caller's changes to the dict it got stay its own
    peak[0] = -1
    assert cm.peak_memory(plan, w)[0] == m["rollout"] + m["reference"] + m["actor_train"]


def test_monotonic(cm):
    w = make_workload("ppo", reward="llama-3.1-8b", batch=256)
    times = []
    for dp in (1, 2, 4, 8, 16, 32):
        plan = GlobalPlan((_sp("reference", "reference", False, dp, 1, 1),))
        times.append(cm._stage_works(plan, _only(w, "reference"))["reference"] @ cm._x)
    assert all(b <= a for a, b in itertools.pairwise(times)) and times[-1] < times[0] / 20
    plan = GlobalPlan(tuple(_sp(s.stage, s.model, s.trains, 4, 2, 1) for s in w.planned_stages))
    prev = None
    for r in (256, 512, 1024, 2048, 4096):
        est = cm.step_latency(plan, w.with_response_len(r))
        if prev is not None:
            for name, st in est.stages.items():
                assert st.seconds >= prev.stages[name].seconds
        prev = est


def _only(w, name):
    from dataclasses import replace

    return replace(w, stages=(w.stage(name),))


def test_refinement_converges_and_unseen_stays_conservative(cm):
    true = {"gemm": 0.62, "attention": 0.41, "launch": 0.9, "allreduce:intra": 0.7}
    rng = np.random.default_rng(0)
    assert cm.efficiency("gemm") == DEFAULT_EFFICIENCY["gemm"] <= 0.3
    for _ in range(60):
        work = {c: float(rng.uniform(0.1, 2.0)) for c in true}
        measured = sum(v / true[c] for c, v in work.items())
        cm.observe_work(work, measured)
    for c, e in true.items():
        assert cm.efficiency(c) == pytest.approx(e, rel=0.02)
    assert cm.efficiency("p2p:inter") == DEFAULT_EFFICIENCY["p2p:inter"]
    assert cm.seen("p2p:inter") == 0 and cm.seen("gemm") == 60
    with pytest.raises(CostModelError, match="> 0"):
        cm.observe_work({"gemm": 1.0}, 0.0)


def test_observe_from_plan_moves_prediction_to_measurement(cm):
    w = make_workload("grpo", batch=64, group_size=4)
    plan = GlobalPlan(tuple(_sp(s.stage, s.model, s.trains, 4, 2, 1) for s in w.planned_stages))
    before = cm.step_latency(plan, w).stages["actor_train"].seconds
    for _ in range(30):
        cm.observe(plan, w, {"actor_train": before * 0.5})
    after = cm.step_latency(plan, w).stages["actor_train"].seconds
    assert after == pytest.approx(before * 0.5, rel=0.02)


def test_observe_of_a_step_solves_once_bit_for_bit(cm):
    """observe() of several stages: the efficiencies a solve after each stage would end
    with, bit for bit, with one version bump and one listener call; bad input moves
    nothing."""
    w = make_workload("ppo", reward="llama-3.1-8b", batch=64)
    plan = GlobalPlan(tuple(_sp(s.stage, s.model, s.trains, 4, 2, 1) for s in w.planned_stages))
    est = cm.step_latency(plan, w).stages
    measured = {name: e.seconds * f for (name, e), f in zip(est.items(), (0.5, 0.7, 1.3, 2.0))}
    assert len(measured) == 4
    one_by_one = CostModel(cm.cluster, forgetting=0.9)
    for name, t in measured.items():
        one_by_one.observe_work(cm._stage_works(plan, w)[name], t)
    step = CostModel(cm.cluster, forgetting=0.9)
    calls = []
    step.add_refine_listener(lambda: calls.append(step.version))
    step.observe(plan, w, measured)
    assert np.array_equal(step.inverse_efficiencies, one_by_one.inverse_efficiencies)
    assert not np.array_equal(step.inverse_efficiencies, cm.inverse_efficiencies)
    assert step.version == 1 and calls == [1]
    x = step.inverse_efficiencies
    for bad in ({**measured, "critic_train": 0.0}, {**measured, "nope": 1.0}):
        with pytest.raises(CostModelError):
            step.observe(plan, w, bad)
        assert np.array_equal(step.inverse_efficiencies, x) and step.version == 1


def _solve_reference(cm):
    """The refinement's solve as first written (prior terms rebuilt every iteration)."""
    lam = cm._prior / cm._x0**2
    free = np.ones(NUM_CLASSES, dtype=bool)
    x = cm._x0.copy()
    for _ in range(NUM_CLASSES):
        A = cm._A + np.diag(lam)
        rhs = cm._b + lam * cm._x0
        fixed = ~free
        rhs_f = rhs[free] - A[np.ix_(free, fixed)] @ x[fixed]
        x[free] = np.linalg.solve(A[np.ix_(free, free)], rhs_f)
        low = free & (x < 1.0)
        if not low.any():
            break
        x[low] = 1.0
        free &= ~low
    return x


def test_solve_equals_its_first_form_bit_for_bit():
    rng = np.random.default_rng(1)
    bound = 0
    for _ in range(200):
        cm = CostModel(cluster_preset("h200x32"), forgetting=float(rng.choice([1.0, 0.9])))
        for _ in range(int(rng.integers(1, 12))):
            w = rng.uniform(0, 1, NUM_CLASSES) * (rng.uniform(0, 1, NUM_CLASSES) < 0.5)
            cm.observe_work(w, float(rng.uniform(0.1, 10)))
            assert np.array_equal(cm.inverse_efficiencies, _solve_reference(cm))
        bound += bool((cm.inverse_efficiencies == 1.0).any())
    assert bound > 50  # the active set (bound 1/e >= 1) was exercised


def test_refine_listener_is_weak_for_bound_methods(cm):
    class Holder:
        def __init__(self):
            self.n = 0

        def hit(self):
            self.n += 1

    h = Holder()
    cm.add_refine_listener(h.hit)
    cm.observe_work({"gemm": 1.0}, 2.0)
    assert h.n == 1
    cm.add_refine_listener(lambda: None)
    back = pickle.loads(pickle.dumps(cm))  # listeners are not pickled
    assert back._listeners == [] and np.array_equal(back._x, cm._x)
    del h  # the cost model does not keep it alive, and drops it
    cm.observe_work({"gemm": 1.0}, 2.0)
    assert len(cm._listeners) == 1  # the plain function only


def test_sync_tier(cm):
    w = make_workload("grpo", batch=64, group_size=4)
    colo = GlobalPlan(tuple(_sp(s.stage, s.model, s.trains, 2, 4, 1) for s in w.planned_stages))
    apart = GlobalPlan(
        (
            _sp("rollout", "actor", False, 2, 4, 1, 0),
            _sp("reference", "reference", False, 2, 4, 1, 0),
            _sp("actor_train", "actor", True, 2, 4, 1, 8),
        )
    )
    a, b = cm.step_latency(colo, w), cm.step_latency(apart, w)
    assert a.sync_s < b.sync_s / 5  # NVLink vs InfiniBand
    x = np.zeros(NUM_CLASSES)
    x[CLASS_INDEX["gemm"]] = 1
    assert a.total_s == pytest.approx(sum(a.phase_s))


def test_primitive_costs(cm):
    m = make_workload("ppo").stage("actor_train").model_spec
    state = 14 * m.num_params  # master weights + Adam moments, bf16 weights
    ext = cm.primitive_cost(
        "extend",
        m,
        trains=True,
        src=(UnitLayout(2, 1, (0, 1)),),
        dst=(UnitLayout(4, 1, (2, 3, 4, 5)),),
    )
    assert ext.bytes_moved == pytest.approx(state, rel=1e-3) and ext.tier == "intra"
    far = cm.primitive_cost(
        "extend", m, trains=True, src=(UnitLayout(2, 1, (0, 1)),), dst=(UnitLayout(2, 1, (8, 9)),)
    )
    assert far.tier == "inter" and far.seconds > ext.seconds
    merge = cm.primitive_cost(
        "merge",
        m,
        trains=False,
        src=(UnitLayout(1, 1, (0,)), UnitLayout(1, 1, (1,))),
        dst=(UnitLayout(2, 1, (0, 1)),),
    )
    assert merge.bytes_moved == 0
    split = cm.primitive_cost(
        "split",
        m,
        trains=False,
        src=(UnitLayout(2, 1, (0, 1)),),
        dst=(UnitLayout(1, 1, (0,)), UnitLayout(1, 1, (1,))),
    )
    assert split.bytes_moved == pytest.approx(2 * m.num_params, rel=1e-3)  # each gets half
    assert (
        cm.primitive_cost("destroy", m, trains=True, src=(UnitLayout(1, 1, (0,)),)).bytes_moved == 0
    )
    with pytest.raises(CostModelError, match="takes 2 source"):
        cm.primitive_cost("merge", m, trains=False, src=(UnitLayout(1, 1, (0,)),), dst=())


# ----- the launch and elementwise counts are those of the model we run ------------------
class _CountOps(TorchDispatchMode):
    """Counts eager ops, and elements written by non-view ops of rank >= 2."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.elems = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t._is_view() and t.dim() >= 2:
                self.elems += t.numel()
        return out


def _count_step(num_layers: int, seq: int) -> tuple[list[int], list[int]]:
    """(ops, elements) of forward, backward and optimizer step of ``tiny`` with L layers."""
    torch.manual_seed(0)
    cfg = dataclasses.replace(get_preset("tiny"), num_layers=num_layers)
    model = Decoder(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    x = torch.randint(0, cfg.vocab, (2, seq + 1))
    for _ in range(2):  # the second step: the optimizer's state exists
        with _CountOps() as fwd:
            logits = model(x[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), x[:, 1:].reshape(-1))
        with _CountOps() as bwd:
            loss.backward()
        with _CountOps() as upd:
            opt.step()
            opt.zero_grad(set_to_none=False)
    ops = [fwd.ops, bwd.ops, upd.ops]
    elems = [fwd.elems, fwd.elems + bwd.elems]
    return ops, elems


def test_kernel_and_elementwise_counts_match_the_eager_decoder():
    (f2, b2, o2), e2 = _count_step(2, 32)
    (f4, b4, _), e4 = _count_step(4, 32)
    _, e4l = _count_step(4, 128)
    _, e2l = _count_step(2, 128)
    assert (f4 - f2) / 2 == pytest.approx(cw.KERNELS_PER_LAYER_FWD, rel=0.1)
    assert (b4 - b2) / 2 == pytest.approx(cw.KERNELS_PER_LAYER_BWD, rel=0.1)
    assert f2 - (f4 - f2) == pytest.approx(cw.KERNELS_HEAD_FWD, rel=0.2)
    assert b2 - (b4 - b2) == pytest.approx(cw.KERNELS_HEAD_BWD, rel=0.2)
    tensors = cw.TENSORS_PER_LAYER * 2 + 3
    assert o2 / tensors == pytest.approx(cw.OPT_KERNELS_PER_TENSOR, rel=0.1)
    # Elements per token per layer (units of hidden): a per-token part plus a per-layer
    # part (weight gradients) that shrinks with tokens; two lengths separate them.
    h = get_preset("tiny").hidden
    for i, want in ((0, cw.ACT_ELEMS_PER_TOKEN_LAYER_FWD), (1, cw.ACT_ELEMS_PER_TOKEN_LAYER_TRAIN)):
        short = (e4[i] - e2[i]) / 2 / (2 * 32) / h
        long = (e4l[i] - e2l[i]) / 2 / (2 * 128) / h
        per_token = short - (short - long) / (1 / 32 - 1 / 128) / 32
        assert per_token == pytest.approx(want, rel=0.1)


def test_train_work_hand_computed():
    spec = model_preset("tiny")
    cluster = local_cpu_cluster(1, 1.0)
    dev = cluster.device
    tiers = ("intra", "intra", "intra")
    L, h = spec.num_layers, spec.hidden
    params = spec.num_layers * spec.layer_params + 2 * h * spec.vocab

    def work(mb, seq):
        sw = StageWork("actor_train", "actor", "train", spec, False, 8, seq, 0, mb, 1)
        return cw.stage_work(sw, 1, 1, 1, tiers, cluster, "fp32")

    w1, w8 = work(1, 32), work(8, 32)
    per_mb = L * (cw.KERNELS_PER_LAYER_FWD + cw.KERNELS_PER_LAYER_BWD)
    per_mb += cw.KERNELS_HEAD_FWD + cw.KERNELS_HEAD_BWD
    opt = cw.OPT_KERNELS_PER_TENSOR * (cw.TENSORS_PER_LAYER * L + 3)
    launch = cw.CLASS_INDEX["launch"]
    assert w1[launch] == pytest.approx((8 * per_mb + opt) * dev.kernel_overhead_s)
    assert w8[launch] == pytest.approx((per_mb + opt) * dev.kernel_overhead_s)
    # Weights stream 4x per micro-batch; the optimizer streams 2 x 16 B per parameter.
    mem = cw.CLASS_INDEX["mem"]
    assert w1[mem] - w8[mem] == pytest.approx(7 * 4 * params * 4 / dev.mem_bw_Bps)
    assert w8[mem] == pytest.approx((4 * params * 4 + 32 * params) / dev.mem_bw_Bps)
    # Elementwise traffic depends on tokens only, not on how they are split.
    ew = cw.CLASS_INDEX["elementwise"]
    act = 2 * cw.ACT_ELEMS_PER_TOKEN_LAYER_TRAIN * 8 * 32 * h * L * 4 / dev.mem_bw_Bps
    assert w1[ew] == pytest.approx(act) and w8[ew] == pytest.approx(act)
    assert work(8, 64)[ew] == pytest.approx(2 * act)


def _tiny_extend(cm, src=(0,), dst=(1,)):
    m = model_preset("tiny")
    return cm.primitive_cost(
        "extend",
        m,
        trains=True,
        src=(UnitLayout(1, 1, src),),
        dst=(UnitLayout(1, 1, dst),),
        dtype="fp32",
    )


def test_measured_primitives_pull_predictions_to_the_measurement():
    cl = local_cpu_cluster(4)
    cm = CostModel(cl)
    before = _tiny_extend(cm)
    link = cl.intra
    # A world where the link runs at 80% of nominal, setup costs 3x nominal and the
    # fixed overhead is 3 ms (the cluster's nominal figure differs).
    true_fixed = 0.003
    true_setup = 3 * (cl.comm_setup_s + cl.comm_setup_per_rank_s)
    true_xfer = before.max_bytes_per_device / link.bandwidth_Bps / 0.8 + link.latency_s
    measured = true_xfer + true_setup + true_fixed
    assert abs(before.seconds - measured) / measured > 0.2  # starts off (else no test)
    v0 = cm.version
    for _ in range(5):
        cm.observe_primitive(
            "destroy", bytes_moved=0, max_bytes_per_device=0, tier="intra",
            seconds=true_fixed, setup_s=0.0, new_units=0, new_ranks=0,
        )  # fmt: skip
        cm.observe_primitive(
            "extend", bytes_moved=before.bytes_moved,
            max_bytes_per_device=before.max_bytes_per_device, tier="intra",
            seconds=measured, setup_s=true_setup,
        )  # fmt: skip
    after = _tiny_extend(cm)
    assert cm.version > v0 and cm.primitives_seen() == 10
    assert after.seconds == pytest.approx(measured, rel=0.02)
    assert after.setup_s == pytest.approx(true_setup, rel=0.02)
    assert after.fixed_s == pytest.approx(true_fixed, rel=0.02)
    assert true_fixed < 0.5 * cl.primitive_overhead_s
    # The first transfer was read against the fixed estimate after one destroy (and the
    # prior), so the efficiency carries a few percent of that.
    assert cm.efficiency("p2p:intra") == pytest.approx(0.8, rel=0.05)
    assert cm.seen("p2p:intra") == 5


def test_forgetting_tracks_a_slower_link():
    cl = local_cpu_cluster(4)
    cm = CostModel(cl, forgetting=0.5)
    ref = _tiny_extend(cm)
    link = cl.intra
    for eff in [0.9] * 5 + [0.2] * 10:
        xfer = ref.max_bytes_per_device / link.bandwidth_Bps / eff + link.latency_s
        cm.observe_primitive(
            "extend", bytes_moved=ref.bytes_moved,
            max_bytes_per_device=ref.max_bytes_per_device, tier="intra",
            seconds=xfer + ref.setup_s + ref.fixed_s, setup_s=ref.setup_s,
        )  # fmt: skip
    assert cm.efficiency("p2p:intra") == pytest.approx(0.2, rel=0.05)


def test_unseen_tier_keeps_its_conservative_start():
    cl = cluster_preset("h200x32")
    cm = CostModel(cl)
    m = model_preset("tiny")

    def far():
        return cm.primitive_cost(
            "extend", m, trains=True, src=(UnitLayout(1, 1, (0,)),),
            dst=(UnitLayout(1, 1, (8,)),),
        )  # fmt: skip

    def near():
        return cm.primitive_cost(
            "extend", m, trains=True, src=(UnitLayout(1, 1, (0,)),),
            dst=(UnitLayout(1, 1, (1,)),),
        )  # fmt: skip

    f0, n0 = far(), near()
    assert (f0.tier, n0.tier) == ("inter", "intra")
    for _ in range(5):  # intra transfers measured at full link speed
        xfer = n0.max_bytes_per_device / cl.intra.bandwidth_Bps + cl.intra.latency_s
        cm.observe_primitive(
            "extend", bytes_moved=n0.bytes_moved, max_bytes_per_device=n0.max_bytes_per_device,
            tier="intra", seconds=xfer + n0.setup_s + n0.fixed_s, setup_s=n0.setup_s,
        )  # fmt: skip
    f1, n1 = far(), near()
    assert cm.efficiency("p2p:intra") > 0.95 > DEFAULT_EFFICIENCY["p2p:intra"]
    assert n1.seconds < n0.seconds
    # The inter tier was never measured: its transfer is priced as before (conservative).
    assert cm.efficiency("p2p:inter") == DEFAULT_EFFICIENCY["p2p:inter"]
    assert cm.seen("p2p:inter") == 0
    assert f1.seconds - f1.setup_s - f1.fixed_s == pytest.approx(
        f0.seconds - f0.setup_s - f0.fixed_s, rel=1e-12
    )


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(kind="grow"), "unknown primitive"),
        (dict(tier="nvlink"), "unknown link tier"),
        (dict(seconds=0.0), "must be > 0"),
        (dict(max_bytes_per_device=200), "at most the total"),
        (dict(setup_s=-1.0), "must be >= 0"),
        (dict(primitives=0), "at least 1"),
    ],
)
def test_observe_primitive_bad_input(kwargs, words):
    cm = CostModel(local_cpu_cluster(4))
    args = dict(kind="extend", bytes_moved=100, max_bytes_per_device=50, tier="intra",
                seconds=0.1)  # fmt: skip
    args.update(kwargs)
    kind = args.pop("kind")
    v = cm.version
    with pytest.raises(CostModelError, match=words):
        cm.observe_primitive(kind, **args)
    assert cm.version == v and cm.primitives_seen() == 0
