"""Property-based fuzzing of plan_reshard against reference slicing, and of its input checks.

The reference is written here: every source rank's shard is the full tensor sliced
to its box, a plan is carried out by slicing (each piece read from its sender's
shard and written into its receiver's), and every destination shard must come out
equal to the full tensor sliced to its box, each element written exactly once.
Huge sizes must be planned with byte counts that add up (never wrapped) or rejected
with PlanError; non-integer sizes, ranks and degrees with LayoutError.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from nereus_comm.errors import LayoutError, PlanError
from nereus_comm.layout import Layout, TensorSpec
from nereus_comm.plan import plan_reshard

FUZZ = settings(max_examples=60)
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8]


@st.composite
def _layout(draw, num_layers: int, pool: list[int]) -> Layout:
    pp = draw(st.integers(1, min(3, num_layers)))
    dp, tp = draw(st.integers(1, 2)), draw(st.integers(1, 4))
    n = dp * tp * pp
    ranks = draw(st.permutations(pool))[:n]
    assume(len(ranks) == n)
    nodes = draw(st.one_of(st.none(), st.lists(st.integers(0, 2), min_size=n, max_size=n)))
    return Layout(dp, tp, pp, tuple(ranks), node_of=None if nodes is None else tuple(nodes))


@st.composite
def _case(draw):
    num_layers = draw(st.integers(1, 4))
    specs = []
    for i in range(draw(st.integers(1, 3))):
        shape = tuple(draw(st.lists(st.integers(0, 7), min_size=0, max_size=3)))
        split = draw(st.one_of(st.none(), st.integers(0, len(shape) - 1))) if shape else None
        key = draw(st.one_of(st.none(), st.integers(0, num_layers - 1)))
        specs.append(TensorSpec(f"t{i}", shape, draw(st.sampled_from(DTYPES)), split, key))
    pool = list(range(draw(st.integers(1, 12))))
    src = draw(_layout(num_layers, pool))
    dst = draw(_layout(num_layers, pool))
    # Both sides see the same layers (a layout's own num_layers or the inferred one).
    src = Layout(src.dp, src.tp, src.pp, src.ranks, src.node_of, num_layers)
    dst = Layout(dst.dp, dst.tp, dst.pp, dst.ranks, dst.node_of, num_layers)
    assume(not (src.node_of and dst.node_of))  # a rank on two nodes is a LayoutError
    return specs, src, dst


def _rel(box, own):
    """Slices of `box` (global) inside a shard whose own box is `own`."""
    return tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(box, own))


@FUZZ
@given(_case(), st.integers(0, 2**31))
def test_plan_carried_out_by_slicing_rebuilds_every_shard_exactly_once(case, seed):
    specs, src, dst = case
    gen = torch.Generator().manual_seed(seed)
    full = [torch.randint(0, 100, s.shape, generator=gen).to(s.dtype) for s in specs]

    def boxes(layout, r):
        return {i: b for i, s in enumerate(specs) if (b := layout.box(s, r)) is not None}

    def cut(t, box):
        return t[tuple(slice(a, b) for a, b in box)]

    shards = {r: {i: cut(full[i], b).clone() for i, b in boxes(src, r).items()} for r in src.ranks}
    plan = plan_reshard(specs, src, dst)
    for r in dst.ranks:
        own = boxes(dst, r)
        out = {i: torch.zeros_like(cut(full[i], box)) for i, box in own.items()}
        hits = {i: torch.zeros(t.shape, dtype=torch.int64) for i, t in out.items()}
        moves = [(r, p) for p in plan.local_copies(r)]
        moves += [(m.src, p) for m in plan.recvs(r) for p in m.pieces]
        for sender, piece in moves:
            i = piece.tensor
            held = src.box(specs[i], sender)
            out[i][_rel(piece.box, own[i])] = shards[sender][i][_rel(piece.box, held)]
            hits[i][_rel(piece.box, own[i])] += 1
        for i, box in own.items():
            assert torch.equal(out[i], cut(full[i], box)), (r, specs[i])
            assert bool((hits[i] == 1).all()), (r, specs[i], "written other than once")
    sent = sum(m.nbytes for r in src.ranks for m in plan.sends(r))
    assert sent == plan.stats.total_bytes


_DIM = st.one_of(st.integers(0, 9), st.sampled_from([2**20, 2**31, 2**40, 2**61, 2**63, 2**64]))


@FUZZ
@given(
    st.lists(st.lists(_DIM, min_size=1, max_size=3), min_size=1, max_size=3),
    st.integers(1, 4),
    st.integers(1, 4),
)
def test_huge_sizes_are_planned_exactly_or_rejected(shapes, src_tp, dst_tp):
    """Byte counts add up exactly (Python ints) or the plan is refused: never wrapped."""
    specs = []
    for i, shape in enumerate(shapes):
        try:
            specs.append(TensorSpec(f"t{i}", tuple(shape), torch.float32, split_dim=0))
        except LayoutError:
            assert max(shape) > 2**63 - 1
            return
    src = Layout(1, src_tp, 1, tuple(range(src_tp)))
    dst = Layout(1, dst_tp, 1, tuple(range(src_tp, src_tp + dst_tp)))
    total = sum(s.nbytes for s in specs)
    if total * max(src_tp, dst_tp) > 2**63 - 1:
        with pytest.raises(PlanError, match="2\\*\\*63 - 1 bytes"):
            plan_reshard(specs, src, dst)
        return
    plan = plan_reshard(specs, src, dst)
    # Disjoint rank sets: every byte of every destination shard is sent, once.
    assert plan.stats.total_bytes == total
    for r in dst.ranks:
        want = sum(math.prod(b - a for a, b in dst.box(s, r)) * 4 for s in specs)
        assert sum(m.nbytes for m in plan.recvs(r)) == want


_NOT_INT = st.sampled_from([1.0, 1.7, True, False, "1", None, 2**70, -1])


@FUZZ
@given(st.sampled_from(["dp", "tp", "pp", "rank", "node", "num_layers"]), _NOT_INT)
def test_layout_integers_are_checked(field, value):
    kw = dict(dp=1, tp=2, pp=1, ranks=(0, 1), node_of=None, num_layers=None)
    if field == "rank":
        kw["ranks"] = (0, value)
    elif field == "node":
        kw["node_of"] = (0, value)
    else:
        kw[field] = value
    if value is None and field == "num_layers":
        Layout(**kw)  # None is allowed there: the caller decides
        return
    if field == "node" and value == -1:
        assert Layout(**kw).node_of == (0, -1)  # node ids are labels, any int32
        return
    with pytest.raises(LayoutError, match=r"must be an int|must be a sequence"):
        Layout(**kw)


@FUZZ
@given(st.sampled_from(["shape", "split_dim", "stage_key"]), _NOT_INT)
def test_tensor_spec_integers_are_checked(field, value):
    kw = dict(shape=(4, 4), split_dim=0, stage_key=0)
    if field == "shape":
        kw["shape"] = (4, value)
    else:
        kw[field] = value
    if (value is None and field != "shape") or (field == "split_dim" and value == -1):
        TensorSpec("w", dtype=torch.float32, **kw)  # None: replicated / every stage; -1: last
        return
    with pytest.raises(LayoutError):
        TensorSpec("w", dtype=torch.float32, **kw)
