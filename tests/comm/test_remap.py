"""The C++ shard-remap planner against the pure-Python reference and against the
rules a plan must keep (coverage, exactly-once, lower bound, locality, one
message per pair, balancing, node preference), plus bad input."""

import itertools

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from support.reference_planner import reference_plan

from nereus_comm.errors import LayoutError, PlanError
from nereus_comm.layout import Layout, TensorSpec, box_nbytes, local_region
from nereus_comm.plan import plan_reshard
from nereus_comm.specs import transformer_state_specs

DTYPES = [torch.float32, torch.bfloat16, torch.int64]


def _axis(spec, box):
    """A box's range along the spec's cut axis ((0, 1) when it has none)."""
    return box[spec.cut_dim] if spec.cut_dim is not None else (0, 1)


def _item(plan, piece):
    return (piece.tensor, *_axis(plan.specs[piece.tensor], piece.box))


def _all_ranks(plan):
    return sorted(set(plan.src.ranks) | set(plan.dst.ranks))


def _as_reference(plan):
    """The plan in reference_plan's format, checking both sides of every message agree."""
    local, messages = {}, {}
    for r in _all_ranks(plan):
        if pieces := plan.local_copies(r):
            local[r] = sorted(_item(plan, p) for p in pieces)
        for m in plan.recvs(r):
            assert m.dst == r
            assert (m.src, m.dst) not in messages, "two messages for one pair"
            messages[(m.src, m.dst)] = m
    sent = {}
    for r in _all_ranks(plan):
        for m in plan.sends(r):
            assert m.src == r
            sent[(m.src, m.dst)] = m
    assert sent.keys() == messages.keys()
    for key, m in messages.items():
        assert sent[key].pieces == m.pieces, "sender and receiver disagree on pieces"
        keys = [(p.tensor, p.box) for p in m.pieces]
        assert keys == sorted(keys)
    return local, {k: sorted(_item(plan, p) for p in m.pieces) for k, m in messages.items()}


def _check_rules(plan):
    """Coverage, exactly once, lower bound, locality: independent of the reference."""
    specs, src, dst = plan.specs, plan.src, plan.dst
    got = {}  # (dst rank, tensor) -> list of (start, stop)
    lower = 0
    for r in dst.ranks:
        for p in plan.local_copies(r):
            got.setdefault((r, p.tensor), []).append(_item(plan, p)[1:])
        for m in plan.recvs(r):
            for p in m.pieces:
                spec = specs[p.tensor]
                have = src.box(spec, m.src) if m.src in src else None
                assert have is not None, "sender does not hold the tensor"
                (a, b), (lo, hi) = _axis(spec, p.box), _axis(spec, have)
                assert lo <= a < b <= hi, "sender does not hold the piece"
                assert p.nbytes == box_nbytes(p.box, spec)
                mine = src.box(spec, r) if r in src else None
                if mine is not None:
                    lo, hi = _axis(spec, mine)
                    assert b <= lo or hi <= a, "a byte the receiver holds was sent"
                got.setdefault((r, p.tensor), []).append(_item(plan, p)[1:])
        for i, spec in enumerate(specs):
            box = dst.box(spec, r)
            if box is None or box_nbytes(box, spec) == 0:
                assert (r, i) not in got
                continue
            want = _axis(spec, box)
            ranges = sorted(got.get((r, i), []))
            # the pieces tile the box exactly: no gap, no byte twice
            assert ranges and ranges[0][0] == want[0] and ranges[-1][1] == want[1], (r, spec)
            assert all(x[1] == y[0] for x, y in itertools.pairwise(ranges)), (r, spec, ranges)
            lower += box_nbytes(box, spec)
            mine = src.box(spec, r) if r in src else None
            if mine is not None:
                lo, hi = _axis(spec, mine)
                overlap = max(0, min(hi, want[1]) - max(lo, want[0]))
                lower -= box_nbytes(box, spec) * overlap // (want[1] - want[0])
    stats = plan.stats
    assert stats.lower_bound_bytes == lower
    assert stats.total_bytes == lower
    messages = [m for r in dst.ranks for m in plan.recvs(r)]
    assert stats.num_messages == len(messages)
    assert stats.total_bytes == sum(m.nbytes for m in messages)
    cross = sum(m.nbytes for m in messages if src.node(m.src) != dst.node(m.dst))
    assert stats.cross_node_bytes == cross
    send = {}
    for m in messages:
        send[m.src] = send.get(m.src, 0) + m.nbytes
    assert stats.max_send_bytes == max(send.values(), default=0)
    for r in sorted(set(src.ranks) | set(dst.ranks)):
        recv = sum(m.nbytes for m in plan.recvs(r))
        local = sum(p.nbytes for p in plan.local_copies(r))
        assert plan.rank_bytes(r) == (send.get(r, 0), recv, local)


@st.composite
def _case(draw):
    num_layers = draw(st.integers(1, 4))
    specs = []
    for i in range(draw(st.integers(1, 5))):
        ndim = draw(st.integers(0, 3))
        # mostly tiny dims; some large ones so that parts exceed the 64 KiB message slack
        dim = st.integers(0, 9) | st.sampled_from([1000, 4099])
        shape = tuple(draw(st.lists(dim, min_size=ndim, max_size=ndim)))
        split = draw(st.sampled_from([None, *range(ndim)]))
        stage = draw(st.sampled_from([None, *range(num_layers)]))
        dtype = draw(st.sampled_from(DTYPES))
        specs.append(TensorSpec(f"t{i}", shape, dtype, split_dim=split, stage_key=stage))

    def layout(pool):
        dp, tp = draw(st.integers(1, 3)), draw(st.integers(1, 4))
        pp = draw(st.integers(1, min(3, num_layers)))
        n = dp * tp * pp
        ranks = draw(st.permutations(pool))[:n] if len(pool) >= n else None
        if ranks is None:
            ranks = list(range(n))
        nodes = draw(st.one_of(st.none(), st.just([r // 4 for r in ranks])))
        return Layout(dp, tp, pp, tuple(ranks), node_of=nodes, num_layers=num_layers)

    pool = list(range(draw(st.integers(1, 24))))
    return specs, layout(pool), layout(pool)


@settings(max_examples=80, deadline=None)
@given(_case())
def test_planner_matches_reference_and_rules(case):
    specs, src, dst = case
    plan = plan_reshard(specs, src, dst)
    ref = reference_plan(specs, src, dst)
    local, messages = _as_reference(plan)
    assert local == ref["local"]
    assert messages == ref["messages"]
    assert plan.stats.local_bytes == ref["local_bytes"]
    assert plan.stats.lower_bound_bytes == ref["lower_bound_bytes"]
    _check_rules(plan)


def test_transformer_pp_tp_change_matches_reference():
    specs = transformer_state_specs(4, 16, 24, 4, 2, 40)
    src = Layout(2, 2, 2, tuple(range(8)), node_of=(0, 0, 0, 0, 1, 1, 1, 1))
    dst = Layout(1, 4, 3, tuple(range(2, 14)), node_of=tuple(r // 4 for r in range(2, 14)))
    plan = plan_reshard(specs, src, dst)
    ref = reference_plan(specs, src, dst)
    assert _as_reference(plan) == (ref["local"], ref["messages"])
    _check_rules(plan)


def _shard_bytes(specs, layout, rank):
    return sum(box_nbytes(b, s) for s in specs if (b := layout.box(s, rank)) is not None)


def test_dp_grow_balances_one_to_one():
    specs = transformer_state_specs(2, 16, 32, 4, 2, 64)
    src = Layout(2, 2, 1, (0, 1, 2, 3))
    dst = Layout(4, 2, 1, tuple(range(8)))
    plan = plan_reshard(specs, src, dst)
    shard = _shard_bytes(specs, src, 0)
    assert plan.stats.local_bytes == 4 * shard
    assert plan.stats.total_bytes == 4 * shard
    # two replicas, two new ranks per tp coordinate: each holder feeds exactly one
    assert plan.stats.num_messages == 4
    assert plan.stats.max_send_bytes == shard
    assert all(len(plan.sends(r)) == 1 for r in range(4))
    assert all(plan.recvs(r) == [] for r in range(4))  # old ranks keep their shards


def test_single_new_replica_is_fed_by_all_holders():
    # 128 KiB tensors: big enough that sharing the work beats saving messages
    specs = [TensorSpec(f"w{i}", (8192, 4), torch.float32, split_dim=0) for i in range(8)]
    src = Layout(4, 1, 1, (0, 1, 2, 3))
    dst = Layout(5, 1, 1, (0, 1, 2, 3, 4))
    plan = plan_reshard(specs, src, dst)
    msgs = plan.recvs(4)
    assert [m.src for m in msgs] == [0, 1, 2, 3]
    assert all(m.nbytes == 2 * 8192 * 4 * 4 for m in msgs)
    assert plan.stats.max_send_bytes == plan.stats.total_bytes // 4


def test_prefers_a_source_on_the_same_node():
    specs = [TensorSpec("w", (8, 4), torch.float32, split_dim=0)]
    src = Layout(2, 1, 1, (0, 1), node_of=(0, 1))
    for node, want in ((1, 1), (0, 0)):
        dst = Layout(1, 1, 1, (2,), node_of=(node,))
        plan = plan_reshard(specs, src, dst)
        assert [m.src for m in plan.recvs(2)] == [want]
        assert plan.stats.cross_node_bytes == 0


def test_same_node_preference_yields_to_a_much_lighter_remote_holder():
    # rank 4 (node 0) and rank 5 (node 1) need the whole tensor; holders 0 (node 0) and
    # 1 (node 1) each serve the receiver on their own node rather than crossing.
    specs = [TensorSpec("w", (8, 4), torch.float32)]
    src = Layout(2, 1, 1, (0, 1), node_of=(0, 1))
    dst = Layout(2, 1, 1, (4, 5), node_of=(0, 1))
    plan = plan_reshard(specs, src, dst)
    assert plan.stats.cross_node_bytes == 0
    # three receivers on node 0, one holder there: the third goes to the idle remote one
    dst = Layout(3, 1, 1, (4, 5, 6), node_of=(0, 0, 0))
    plan = plan_reshard(specs, src, dst)
    assert sorted(m.src for r in (4, 5, 6) for m in plan.recvs(r)) == [0, 0, 1]


def test_identity_moves_nothing():
    specs = transformer_state_specs(2, 16, 32, 4, 2, 64)
    lay = Layout(2, 2, 2, tuple(range(8)))
    plan = plan_reshard(specs, lay, lay)
    assert plan.stats.total_bytes == 0 and plan.stats.num_messages == 0
    assert plan.stats.local_bytes == sum(_shard_bytes(specs, plan.dst, r) for r in range(8))
    assert "ReshardPlan(" in repr(plan) and "rank 0: local" in plan.describe()


def test_describe_lists_pieces_per_rank():
    specs = [TensorSpec("w", (8, 4), torch.float32, split_dim=0)]
    plan = plan_reshard(specs, Layout(1, 2, 1, (0, 1)), Layout(1, 1, 1, (0,)))
    text = plan.describe(pieces=True)
    assert "  rank 0: local 1 pieces 64B\n      w[0:4,0:4] 64B" in text
    assert "    recv <- 1: 1 pieces 64B\n      w[4:8,0:4] 64B" in text
    assert "    send -> 0: 1 pieces 64B" in text
    assert repr(plan.stats).startswith("PlanStats(sent 64B (lower bound 64B), local 64B")


def test_bad_input():
    w = TensorSpec("w", (8,), torch.float32, split_dim=0, stage_key=3)
    src = Layout(1, 1, 2, (0, 1), num_layers=2)
    dst = Layout(1, 1, 2, (0, 1), num_layers=4)
    with pytest.raises(PlanError, match="no source rank holds"):
        plan_reshard([w], src, dst)
    with pytest.raises(PlanError, match="destination cannot place"):
        plan_reshard([w], dst, src)
    lay = Layout(1, 2, 1, (0, 1))
    with pytest.raises(LayoutError, match="two specs are named 'a'"):
        plan_reshard([TensorSpec("a", (2,), torch.float32)] * 2, lay, lay)
    a = TensorSpec("a", (2,), torch.float32)
    with pytest.raises(PlanError, match="disagree"):
        plan_reshard([a], lay, lay, dst_specs=[TensorSpec("a", (3,), torch.float32)])
    with pytest.raises(PlanError, match="num_layers=4 was passed"):
        plan_reshard([w], src, lay, num_layers=4)
    with pytest.raises(LayoutError, match="exceeds num_layers"):
        plan_reshard([a], Layout(1, 1, 2, (0, 1)), lay)
    with pytest.raises(LayoutError, match="node 0 in src but node 1 in dst"):
        plan_reshard([a], Layout(1, 1, 1, (0,), node_of=(0,)), Layout(1, 1, 1, (0,), node_of=(1,)))
    plan = plan_reshard([a], lay, Layout(1, 1, 1, (5,)))
    with pytest.raises(LayoutError, match="rank 9 is in neither"):
        plan.sends(9)
    assert plan.sends(5) == [] and plan.local_copies(0) == []


def test_dst_specs_may_move_layers():
    # the same tensor moves from layer 0 to layer 1: stage 0 -> stage 1
    a = TensorSpec("a", (4,), torch.float32, stage_key=0)
    b = TensorSpec("a", (4,), torch.float32, stage_key=1)
    lay = Layout(1, 1, 2, (0, 1), num_layers=2)
    plan = plan_reshard([a], lay, lay, dst_specs=[b])
    assert [m.src for m in plan.recvs(1)] == [0]
    assert plan.stats.total_bytes == 16


def test_tp_change_keeps_senders_balanced():
    specs = transformer_state_specs(4, 64, 128, 8, 4, 256)
    src = Layout(16, 8, 1, tuple(range(128)), node_of=tuple(r // 8 for r in range(128)))
    dst = Layout(32, 4, 1, tuple(range(128)), node_of=tuple(r // 8 for r in range(128)))
    plan = plan_reshard(specs, src, dst)
    mean = plan.stats.total_bytes / 128
    assert plan.stats.max_send_bytes <= 1.15 * mean
    # every node holds a whole tp 8 group, so every byte can come from the same node
    assert plan.stats.cross_node_bytes == 0
    _check_rules(plan)


def test_replicated_tensors_ride_along():
    # a new 2-replica pp 4 copy of a 1-replica pp 2 job: each receiver needs a layer's
    # projections from one holder and the (tp-replicated) norms from either of two;
    # the norms come with the projections, so every receiver talks to one source
    specs = transformer_state_specs(4, 16, 32, 4, 2, 64)
    src = Layout(1, 2, 2, (0, 1, 2, 3))
    dst = Layout(2, 2, 4, tuple(range(4, 20)))
    plan = plan_reshard(specs, src, dst)
    assert all(len(plan.recvs(r)) == 1 for r in dst.ranks)
    assert plan.stats.num_messages == 16
    _check_rules(plan)


def _region_view(flat, region):
    off, rows, row, stride = region
    return flat.as_strided((rows, row), (stride, 1), flat.storage_offset() + off)


def _execute_in_process(specs, plan):
    """A transport-free reshard: local copies and message pieces through
    local_region, each message packed by the sender and unpacked by the receiver
    in piece order; every destination shard must equal the slice of the full tensor."""
    src, dst = plan.src, plan.dst
    gen = torch.Generator().manual_seed(0)
    full = [torch.randint(-100, 100, s.shape, generator=gen).to(s.dtype) for s in specs]

    def shard(i, layout, rank):
        box = layout.box(specs[i], rank)
        if box is None:
            return None
        return full[i][tuple(slice(a, b) for a, b in box)].contiguous().flatten()

    held = {r: {i: shard(i, src, r) for i in range(len(specs))} for r in src.ranks}
    for r in dst.ranks:
        out = {}
        for i, spec in enumerate(specs):
            box = dst.box(spec, r)
            if box is not None:
                out[i] = torch.full((max(1, spec.numel),), -1, dtype=spec.dtype)[
                    : shard(i, dst, r).numel()
                ]
        for p in plan.local_copies(r):
            spec = specs[p.tensor]
            s_reg = local_region(spec, src, r, p.box)
            d_reg = local_region(spec, dst, r, p.box)
            # the two sides may cut the same bytes into rows differently
            d_view = _region_view(out[p.tensor], d_reg)
            d_view.copy_(_region_view(held[r][p.tensor], s_reg).reshape(d_view.shape))
        for m in plan.recvs(r):
            (sent,) = [x for x in plan.sends(m.src) if x.dst == r]
            packed = [
                _region_view(
                    held[m.src][p.tensor], local_region(specs[p.tensor], src, m.src, p.box)
                )
                .flatten()
                .clone()
                for p in sent.pieces
            ]
            for p, data in zip(m.pieces, packed):
                reg = local_region(specs[p.tensor], dst, r, p.box)
                _region_view(out[p.tensor], reg).copy_(data.view(reg[1], reg[2]))
            assert len(packed) == len(m.pieces)
        for i, data in out.items():
            assert torch.equal(data, shard(i, dst, r)), (r, specs[i])


@settings(max_examples=40, deadline=None)
@given(_case())
def test_executing_the_plan_in_process_rebuilds_every_shard(case):
    specs, src, dst = case
    assume(sum(s.numel for s in specs) <= 200_000)
    _execute_in_process(specs, plan_reshard(specs, src, dst))


MIN_PIECE = 256 << 10  # kMinPieceBytes in csrc/remap/planner.cpp


def _cut_pieces(plan):
    """Message pieces that cover only part of their sender's range along the cut dim."""
    out = []
    for r in plan.dst.ranks:
        for m in plan.recvs(r):
            for p in m.pieces:
                spec = plan.specs[p.tensor]
                if spec.cut_dim is not None and _axis(spec, p.box) != _axis(
                    spec, plan.src.box(spec, m.src)
                ):
                    out.append(p)
    return out


@pytest.mark.parametrize("split", [None, 1])
def test_one_more_replica_of_one_huge_tensor_is_fed_evenly(split):
    # 64 replicas -> 65 (the 3,264 -> 3,265 rank case scaled down): a single ~1 GiB
    # tensor (replicated: cut along dim 0, contiguous; split over tp 2 along dim 1:
    # strided) must come from all holders, evenly, not from one holder per tensor
    tp = 1 if split is None else 2
    spec = TensorSpec("emb", (32771, 16381), torch.bfloat16, split_dim=split)  # odd sizes
    n = 64 * tp
    src = Layout(64, tp, 1, tuple(range(n)), node_of=tuple(r // 8 for r in range(n)))
    dst = Layout(65, tp, 1, tuple(range(n + tp)), node_of=tuple(r // 8 for r in range(n + tp)))
    plan = plan_reshard([spec], src, dst)
    stats = plan.stats
    assert stats.total_bytes == stats.lower_bound_bytes == spec.nbytes
    senders = [r for r in src.ranks if plan.sends(r)]
    assert len(senders) == n  # every holder must send for an even split
    mean = stats.total_bytes / n
    assert stats.max_send_bytes <= 1.1 * mean, (stats.max_send_bytes, mean)
    # one message per holder, no piece below the minimum
    assert stats.num_messages == n
    assert all(len(plan.sends(r)) == 1 for r in senders)
    assert all(
        p.nbytes >= MIN_PIECE for r in range(n, n + tp) for m in plan.recvs(r) for p in m.pieces
    )
    for r in range(n, n + tp):  # still valid 2-D strided blocks on both sides
        for m in plan.recvs(r):
            (p,) = m.pieces
            _, rows, row, _ = local_region(spec, src, m.src, p.box)
            assert rows * row * 2 == p.nbytes
            local_region(spec, dst, r, p.box)
    _check_rules(plan)
    ref = reference_plan([spec], src, dst)
    assert _as_reference(plan) == (ref["local"], ref["messages"])


def test_small_shares_are_not_fragmented():
    # 8 holders, one receiver of a 1 MiB tensor: an even split would be 128 KiB each,
    # but no share is cut below 256 KiB, so 4 holders send 256 KiB each
    spec = TensorSpec("w", (512, 512), torch.float32)
    src = Layout(8, 1, 1, tuple(range(8)))
    dst = Layout(9, 1, 1, tuple(range(9)))
    plan = plan_reshard([spec], src, dst)
    assert [m.nbytes for m in plan.recvs(8)] == [MIN_PIECE] * 4
    assert [m.pieces[0].box for m in plan.recvs(8)] == [
        ((128 * i, 128 * i + 128), (0, 512)) for i in range(4)
    ]
    ref = reference_plan([spec], src, dst)
    assert _as_reference(plan) == (ref["local"], ref["messages"])


def test_cut_pieces_rebuild_every_shard_and_match_the_reference():
    # tensors of 1-2 MiB over 4 replicas: receivers get shares cut inside tensors
    # (replicated along dim 0, split along dim 1 and dim 0), with local copies mixed in
    specs = [
        TensorSpec("rep", (512, 1024), torch.float32),
        TensorSpec("row", (256, 2048), torch.float32, split_dim=1),
        TensorSpec("col", (4096, 64), torch.int64, split_dim=0, stage_key=1),
        TensorSpec("step", (), torch.int64),
    ]
    nodes = tuple(r // 4 for r in range(12))
    src = Layout(4, 2, 1, tuple(range(8)), node_of=nodes[:8], num_layers=2)
    dst = Layout(2, 3, 2, tuple(range(12)), node_of=nodes, num_layers=2)
    plan = plan_reshard(specs, src, dst)
    cut = _cut_pieces(plan)
    assert {p.tensor for p in cut} == {0, 1, 2}
    assert all(p.nbytes >= MIN_PIECE for p in cut)
    _check_rules(plan)
    ref = reference_plan(specs, src, dst)
    assert _as_reference(plan) == (ref["local"], ref["messages"])
    _execute_in_process(specs, plan)


def test_byte_counts_that_overflow_int64_are_rejected():
    """A (2**40, 2**40) float32 tensor planned 0 bytes (signed overflow): now refused."""
    huge = TensorSpec("huge", (2**40, 2**40), torch.float32, split_dim=0)
    src, dst = Layout(1, 2, 1, (0, 1)), Layout(1, 1, 1, (2,))
    with pytest.raises(PlanError, match=r"huge.*2\*\*63 - 1 bytes"):
        plan_reshard([huge], src, dst)
    # Each tensor fits, their sum does not.
    half = [TensorSpec(f"h{i}", (2**30, 2**30), torch.float32, split_dim=0) for i in range(3)]
    with pytest.raises(PlanError, match="h1"):
        plan_reshard(half, src, dst)
    # All fit, but times the ranks they would not: still refused, before planning.
    one = TensorSpec("one", (2**30, 2**30), torch.float32, split_dim=0)
    with pytest.raises(PlanError, match="times 4 ranks"):
        plan_reshard([one], Layout(1, 4, 1, (0, 1, 2, 3)), dst)
    # A huge tensor that fits is planned with exact byte counts.
    big = TensorSpec("big", (2**40, 2**10), torch.float32, split_dim=0)
    plan = plan_reshard([big], src, dst)
    assert plan.stats.total_bytes == big.nbytes == 2**52


def test_native_planner_refuses_overflowing_input():
    """_C.remap_plan is reachable directly: it checks its own byte counts too."""
    import numpy as np

    from nereus_comm import _C

    node = np.zeros(1, dtype=np.int32)
    args = [(1, 1, 1), node, (1, 1, 1), node, np.array([-1], dtype=np.int64)]
    one = [np.array([2**40], np.int64), np.array([2**42], np.int64)]
    rest = [np.zeros(1, np.int32), np.full(1, -1, np.int32), np.full(1, -1, np.int32)]
    with pytest.raises(ValueError, match="2\\^63 - 1"):
        _C.remap_plan(*args, *one, *rest)


def test_plan_integers_are_checked():
    a = TensorSpec("a", (4,), torch.float32, split_dim=0)
    lay = Layout(1, 2, 1, (0, 1))
    with pytest.raises(LayoutError, match="num_layers must be an int"):
        plan_reshard([a], lay, lay, num_layers=1.5)
    plan = plan_reshard([a], lay, lay)
    for rank in (1.0, 1.7, True):
        with pytest.raises(LayoutError, match="rank must be an int"):
            plan.sends(rank)
