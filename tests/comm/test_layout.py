"""Layouts and specs: boxes against torch.chunk / numpy.array_split, local regions
against torch slicing, and bad input."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus_comm.errors import LayoutError
from nereus_comm.layout import (
    Layout,
    TensorSpec,
    box_shape,
    chunk_range,
    layer_range,
    local_region,
    stage_of_layer,
)
from nereus_comm.specs import llama_state_specs, transformer_state_specs


@given(st.integers(0, 40), st.integers(1, 12))
def test_chunk_range_matches_torch_chunk(n, parts):
    chunks = torch.arange(n).chunk(parts)
    for i in range(parts):
        a, b = chunk_range(n, parts, i)
        got = torch.arange(n)[a:b]
        want = chunks[i] if i < len(chunks) else torch.arange(0)
        assert torch.equal(got, want), (n, parts, i)


@given(st.integers(1, 40), st.integers(1, 12))
def test_layer_ranges_match_array_split(num_layers, pp):
    if pp > num_layers:
        return
    split = np.array_split(np.arange(num_layers), pp)
    for p in range(pp):
        a, b = layer_range(num_layers, pp, p)
        assert list(range(a, b)) == split[p].tolist()
        for layer in range(a, b):
            assert stage_of_layer(layer, num_layers, pp) == p


def test_rank_order_and_boxes():
    lay = Layout(dp=2, tp=4, pp=2, ranks=tuple(range(100, 116)), num_layers=5)
    assert lay.coords(100 + (1 * 2 + 1) * 4 + 3) == (1, 1, 3)
    assert lay.rank_at(1, 0, 2) == 100 + 10
    w = TensorSpec("w", (10, 6), torch.float32, split_dim=0, stage_key=3)
    assert lay.box(w, 100) is None  # stage 0 holds layers 0-2
    assert [lay.box(w, 104 + t) for t in range(4)] == [
        ((0, 3), (0, 6)),
        ((3, 6), (0, 6)),
        ((6, 9), (0, 6)),
        ((9, 10), (0, 6)),
    ]
    # uneven: 3 rows over tp 4 -> chunks of 1, last rank empty
    s = TensorSpec("s", (3, 2), torch.float32, split_dim=0)
    assert lay.box(s, 103) == ((3, 3), (0, 2))
    norm = TensorSpec("n", (6,), torch.bfloat16)
    assert lay.box(norm, 115) == ((0, 6),)
    assert repr(lay) == "Layout(dp2 tp4 pp2 ranks=100-115 layers=5)"
    assert repr(w) == "TensorSpec(w [10, 6] float32 split=0 layer=3)"


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_local_region_matches_torch_slicing(data):
    ndim = data.draw(st.integers(1, 3))
    shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim)))
    split = data.draw(st.sampled_from([None, *range(ndim)]))
    tp = data.draw(st.integers(1, 4))
    spec = TensorSpec("x", shape, torch.float32, split_dim=split)
    lay = Layout(1, tp, 1, tuple(range(tp)))
    full = torch.arange(spec.numel, dtype=torch.float32).reshape(shape)
    rank = data.draw(st.integers(0, tp - 1))
    own = lay.box(spec, rank)
    shard = full[tuple(slice(a, b) for a, b in own)].contiguous().flatten()
    box = list(own)
    k = spec.cut_dim  # the split dim, or a replicated tensor's first dim longer than 1
    if k is not None:
        lo, hi = own[k]
        a = data.draw(st.integers(lo, hi))
        box[k] = (a, data.draw(st.integers(a, hi)))
    box = tuple(box)
    off, rows, row, stride = local_region(spec, lay, rank, box)
    got = torch.cat([shard[off + r * stride : off + r * stride + row] for r in range(rows)])
    want = full[tuple(slice(a, b) for a, b in box)].flatten()
    assert torch.equal(got, want)
    if rows == 1:
        assert stride == row
    if split is None:
        assert rows == 1  # cuts of a replicated tensor are contiguous


def test_cut_dim():
    assert TensorSpec("w", (4, 6), torch.float32, split_dim=1).cut_dim == 1
    assert TensorSpec("n", (1, 1, 6, 2), torch.float32).cut_dim == 2
    assert TensorSpec("s", (), torch.int64).cut_dim is None
    assert TensorSpec("o", (1, 1), torch.int64).cut_dim is None


def test_local_region_rejects_foreign_box():
    spec = TensorSpec("x", (8, 4), torch.float32, split_dim=0)
    lay = Layout(1, 2, 1, (0, 1))
    with pytest.raises(LayoutError, match="not a piece"):
        local_region(spec, lay, 0, ((4, 6), (0, 4)))
    with pytest.raises(LayoutError, match="not a piece"):
        local_region(spec, lay, 0, ((0, 2), (0, 2)))


def test_layout_bad_input():
    with pytest.raises(LayoutError, match="dp must be an int >= 1"):
        Layout(0, 1, 1, ())
    with pytest.raises(LayoutError, match="needs 4 ranks, got 3"):
        Layout(2, 2, 1, (0, 1, 2))
    with pytest.raises(LayoutError, match=r"distinct; repeated: \[1\]"):
        Layout(1, 2, 1, (1, 1))
    with pytest.raises(LayoutError, match="node_of has 1 entries for 2 ranks"):
        Layout(1, 2, 1, (0, 1), node_of=(0,))
    with pytest.raises(LayoutError, match="exceeds num_layers"):
        Layout(1, 1, 4, (0, 1, 2, 3), num_layers=2)
    lay = Layout(1, 2, 1, (0, 1))
    with pytest.raises(LayoutError, match="rank 7 is not in"):
        lay.coords(7)
    spec = TensorSpec("w", (4,), torch.float32, stage_key=1)
    with pytest.raises(LayoutError, match="num_layers is unknown"):
        Layout(1, 1, 2, (0, 1)).box(spec, 0)
    with pytest.raises(LayoutError, match="stage_key 1 is not below num_layers=1"):
        lay.box(spec, 0, num_layers=1)


def test_spec_bad_input():
    with pytest.raises(LayoutError, match="split_dim 2 is out of range"):
        TensorSpec("w", (4, 4), torch.float32, split_dim=2)
    with pytest.raises(LayoutError, match="negative size"):
        TensorSpec("w", (4, -1), torch.float32)
    with pytest.raises(LayoutError, match="dtype must be a torch"):
        TensorSpec("w", (4,), "float32")
    assert TensorSpec("w", (4, 4), torch.float32, split_dim=-1).split_dim == 1


def test_transformer_state_specs():
    specs = llama_state_specs("llama-3.1-8b")
    names = [s.name for s in specs]
    assert len(names) == len(set(names)) == (32 * 9 + 3) * 4 + 1
    params = sum(s.numel for s in specs if not s.name.startswith(("master.", "optim.")))
    assert params == 8_030_261_248  # Llama-3.1-8B, untied embeddings
    by_name = {s.name: s for s in specs}
    assert by_name["layers.3.self_attn.o_proj.weight"].split_dim == 1
    assert by_name["optim.exp_avg.layers.3.mlp.up_proj.weight"].dtype == torch.float32
    assert by_name["lm_head.weight"].stage_key == 31
    assert by_name["optim.step"].stage_key is None
    small = transformer_state_specs(2, 8, 16, 2, 1, 32, adam=False, master_fp32=False)
    assert len(small) == 2 * 9 + 3
    with pytest.raises(LayoutError, match="unknown model preset"):
        llama_state_specs("llama-9")
    assert box_shape(((1, 3), (0, 4))) == (2, 4)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(ranks=(0, 1.7)), "rank must be an int, got float"),
        (dict(ranks=(0, 2**70)), "rank must be an int >= 0 and <= 2147483647"),
        (dict(ranks=(0, True)), "rank must be an int, got the bool"),
        (dict(tp=2.0), "tp must be an int"),
        (dict(node_of=(0, 0.5)), "node id must be an int"),
        (dict(num_layers=2.5), "num_layers must be an int"),
    ],
)
def test_layout_integers_are_integers(kwargs, match):
    """Floats and bools were truncated (rank 1.7 -> 1): now refused with the field named."""
    args = dict(dp=1, tp=2, pp=1, ranks=(0, 1)) | kwargs
    with pytest.raises(LayoutError, match=match):
        Layout(**args)
    lay = Layout(np.int64(1), np.int32(2), 1, (np.int64(0), 1))  # numpy integers are ints
    assert lay.ranks == (0, 1) and type(lay.tp) is int
    with pytest.raises(LayoutError, match="rank must be an int"):
        lay.position(True)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(split_dim=True), "split_dim must be an int, got the bool"),
        (dict(split_dim=0.0), "split_dim must be an int, got float"),
        (dict(stage_key=1.5), "stage_key .* must be an int"),
        (dict(shape=(4, 2.5)), "size of shape .* must be an int"),
        (dict(shape=(4, 2**64)), "<= 9223372036854775807"),
    ],
)
def test_spec_integers_are_integers(kwargs, match):
    args = dict(shape=(4, 4), split_dim=0) | kwargs
    with pytest.raises(LayoutError, match=match):
        TensorSpec("w", dtype=torch.float32, **args)
