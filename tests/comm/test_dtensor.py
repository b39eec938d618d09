"""reshard_dtensors on 4 local gloo ranks (slow: importing torch.distributed.tensor
takes each of 4 workers ~4 s on 2 cores): real FSDP2 x TP state (fully_shard on a
tensor-parallel model makes _StridedShard), AdamW state after a step, bf16 parameters
with fp32 masters, mesh shape and rank set changes DTensor.redistribute cannot make,
uneven shapes; every destination shard compared bit for bit with the full tensor
(DTensor.full_tensor() on the source) cut here with torch.chunk. Bad input is refused
on every rank before a byte moves."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import nereus_comm.dtensor as dtensor_module
from nereus_comm import ProcessGroupTransport
from nereus_comm.dtensor import DTensorReshardError, reshard_dtensors
from nereus_comm.optim_state import flatten_state, param_name, unflatten_state
from nereus_comm.testing import LocalWorkers, WorkerContext

WORLD = 4


@pytest.fixture(scope="module")
def pool():
    with LocalWorkers(WORLD, timeout=90) as p:
        yield p


# -- the independent reference ------------------------------------------------------------


def _chunk(t: torch.Tensor, n: int, dim: int, c: int) -> torch.Tensor:
    parts = torch.chunk(t, n, dim=dim)
    return parts[c] if c < len(parts) else t.narrow(dim, t.shape[dim], 0)


def _reference(full: torch.Tensor, mesh: DeviceMesh, placements) -> torch.Tensor | None:
    """This rank's shard, cut with torch.chunk left to right over the mesh dims."""
    ranks = mesh.mesh
    where = (ranks == dist.get_rank()).nonzero()
    if len(where) == 0:
        return None
    coords = where[0].tolist()
    t = full
    for m, p in enumerate(placements):
        n, c = ranks.shape[m], coords[m]
        if isinstance(p, _StridedShard):
            sf = int(p.split_factor)
            t = torch.cat([_chunk(_chunk(t, sf, p.dim, j), n, p.dim, c) for j in range(sf)], p.dim)
        elif isinstance(p, Shard):
            t = _chunk(t, n, p.dim, c)
    return t.contiguous()


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8),
            b.contiguous().reshape(-1).view(torch.uint8),
        )
    )


def _check(out: dict, fulls: dict, mesh: DeviceMesh, placements_of) -> list[str]:
    """Names of the entries of `out` that differ from the reference (or are missing)."""
    bad = []
    for name, full in fulls.items():
        if name not in out:
            bad.append(f"{name}: missing")
            continue
        got = out[name]
        if isinstance(got, DTensor):
            pl = placements_of(name, tuple(full.shape))
            want = _reference(full, mesh, pl)
            if got.device_mesh != mesh or tuple(got.placements) != tuple(pl):
                bad.append(f"{name}: on {got.device_mesh} {got.placements}")
            elif not _bits_equal(got.to_local(), want) or tuple(got.shape) != tuple(full.shape):
                bad.append(f"{name}: values")
        elif not _bits_equal(got, full):
            bad.append(f"{name}: plain tensor values")
    return bad


# -- an FSDP2 x TP model with AdamW state ---------------------------------------------------


def _fsdp_tp_state(mesh: DeviceMesh, *, bf16_masters: bool = False):
    """(flat training state, full tensor of each tensor entry) of a small FSDP2 x TP
    model after one AdamW step."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(10, 12), torch.nn.ReLU(), torch.nn.Linear(12, 7, bias=True)
    )
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(3, 10)).sum().backward()
    opt.step()
    names = [n for n, _ in model.named_parameters()]
    masters = None
    params = dict(model.state_dict())
    if bf16_masters:  # bf16 parameters, the fp32 ones kept as masters
        masters = params
        params = {
            n: DTensor.from_local(
                p.to_local().to(torch.bfloat16), p.device_mesh, p.placements, run_check=False,
                shape=p.shape, stride=p.stride(),
            )
            for n, p in masters.items()
        }  # fmt: skip
    flat = flatten_state(params, opt.state_dict(), param_names=names, masters=masters)
    fulls = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v.clone())
        for k, v in flat.items()
        if isinstance(v, torch.Tensor)
    }
    return flat, fulls


def _src_mesh() -> DeviceMesh:
    return DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("dp", "tp"))


def _fsdp_tp_to(ctx: WorkerContext, dst_ranks, dst_shape, which: str, bf16: bool) -> dict:
    flat, fulls = _fsdp_tp_state(_src_mesh(), bf16_masters=bf16)
    dst = DeviceMesh("cpu", torch.tensor(dst_ranks).reshape(dst_shape))

    def placements_of(name: str, shape: tuple[int, ...]):
        if which == "shard0":
            return [Shard(0)] * dst.ndim
        if which == "tp":  # Megatron-like TP on a 1-D mesh: weights by rows, others replicated
            return [Shard(0) if len(shape) == 2 else Replicate()]
        return [Replicate()] * dst.ndim

    state = flat if ctx.rank in (0, 1, 2, 3) else None
    out = reshard_dtensors(state, dst, placements_of, timeout=60)
    if ctx.rank not in dst_ranks:
        return {"out": sorted(out), "bad": []}
    bad = _check(out, fulls, dst, placements_of)
    model, optim, masters = unflatten_state(out)
    return {
        "bad": bad,
        "strided": str(flat["0.weight"].placements),
        "groups": optim["param_groups"][0]["params"],
        "state_keys": {k: sorted(v) for k, v in optim["state"].items()},
        "lr": optim["param_groups"][0]["lr"],
        "dtypes": {k: str(v.dtype) for k, v in model.items()},
        "masters": None if masters is None else {k: str(v.dtype) for k, v in masters.items()},
        "param_of": param_name("optim.exp_avg.0.weight"),
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dst_ranks", "dst_shape", "which"),
    [
        ((0, 1, 2, 3), (4,), "tp"),  # FSDP2 x TP -> TP only, 4 ranks
        ((2, 0, 1), (3,), "shard0"),  # 4 -> 3, a 1-D mesh in another order
        ((0, 1), (2,), "shard0"),  # shrink to 2
        ((3, 1), (1, 2), "replicate"),  # a 2-D mesh of 2 other ranks, replicated
    ],
)
def test_fsdp_tp_training_state(pool, dst_ranks, dst_shape, which) -> None:
    out = pool.run(_fsdp_tp_to, dst_ranks, dst_shape, which, False)
    for r, res in enumerate(out):
        if r not in dst_ranks:
            assert res == {"out": [], "bad": []}
            continue
        assert res["bad"] == [], (r, res["bad"])
        assert "_StridedShard" in res["strided"]  # fully_shard on a TP parameter
        assert res["groups"] == [0, 1, 2, 3]
        assert res["state_keys"] == {i: ["exp_avg", "exp_avg_sq", "step"] for i in range(4)}
        assert res["lr"] == 0.01 and res["param_of"] == "0.weight"


@pytest.mark.slow
def test_bf16_params_with_fp32_masters(pool) -> None:
    out = pool.run(_fsdp_tp_to, (1, 2, 3), (3,), "shard0", True)
    for r in (1, 2, 3):
        res = out[r]
        assert res["bad"] == [], (r, res["bad"])
        assert set(res["dtypes"].values()) == {"torch.bfloat16"}
        assert set(res["masters"].values()) == {"torch.float32"}


# -- distribute_tensor states: grow, other ranks, uneven -------------------------------------


def _distributed(ctx: WorkerContext, src_ranks, src_shape, src_pl, dst_ranks, dst_shape, dst_pl):
    src = DeviceMesh("cpu", torch.tensor(src_ranks).reshape(src_shape))
    dst = DeviceMesh("cpu", torch.tensor(dst_ranks).reshape(dst_shape))
    g = torch.Generator().manual_seed(3)
    fulls = {
        "w": torch.randn(7, 5, generator=g),  # 7 rows over 4: 2, 2, 2, 1
        "h": torch.randn(3, 9, generator=g).to(torch.bfloat16),  # 3 over 4: one empty
        "ids": torch.randint(0, 2**40, (6, 4), generator=g),
    }
    state = None
    if ctx.rank in src_ranks:
        # src_data_rank=None: each rank cuts its shard from its own full copy
        state = {k: distribute_tensor(v, src, src_pl, src_data_rank=None) for k, v in fulls.items()}
        state["note"] = "kept"
    out = reshard_dtensors(state, dst, dst_pl, timeout=60)
    if ctx.rank not in dst_ranks:
        return {"bad": [] if out == {} else ["out on a non-destination rank"]}
    bad = _check(out, fulls, dst, lambda n, s: dst_pl)
    if out.get("note") != "kept":
        bad.append("note")
    return {"bad": bad}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("src", "dst"),
    [
        # grow 2 -> 4 onto a 2-D mesh (ranks 2, 3 start with nothing)
        (((0, 1), (2,), [Shard(0)]), ((0, 1, 2, 3), (2, 2), [Shard(0), Shard(1)])),
        # another rank set, 2-D -> 1-D
        (((0, 1), (1, 2), [Replicate(), Shard(1)]), ((2, 3), (2,), [Shard(0)])),
        # FSDP x TP -> 4 -> 3 ranks, uneven everywhere
        (((0, 1, 2, 3), (2, 2), [Shard(0), Shard(1)]), ((3, 2, 1), (3,), [Shard(1)])),
        # replicated over a 2-D mesh -> a strided shard
        (
            ((0, 1, 2, 3), (2, 2), [Replicate(), Replicate()]),
            ((0, 1, 2, 3), (2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),
        ),
    ],
)
def test_distributed_states(pool, src, dst) -> None:
    out = pool.run(_distributed, *src, *dst)
    for r, res in enumerate(out):
        assert res["bad"] == [], (r, res)


@contextlib.contextmanager
def _counted(module, name: str):
    """``module.name`` counting its calls (the list yielded) while the block runs; the
    worker processes have no monkeypatch fixture."""
    calls: list[int] = []
    real = getattr(module, name)

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    setattr(module, name, counting)
    try:
        yield calls
    finally:
        setattr(module, name, real)


def _checks(ctx: WorkerContext, which: str) -> dict:
    import importlib

    # the module, not the function nereus_comm exports by the same name
    reshard_module = importlib.import_module("nereus_comm.reshard")
    mesh = DeviceMesh("cpu", torch.arange(4))
    full = torch.arange(32.0).reshape(8, 4)  # two rows a rank
    state = {"w": distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)}
    dst = DeviceMesh("cpu", torch.tensor([2, 0, 1]))
    pl: Any = [Shard(1)]
    if which == "callable":
        pl = lambda name, shape: [Shard(1)]  # noqa: E731
    elif which == "mapping" and ctx.rank == 3:
        pl = {"w": [Shard(1)]}  # the same destination, given another way
    dtensor_module._SEEN.pop(dist.group.WORLD, None)  # a cold call
    with _counted(reshard_module, "_verify_plan") as calls:
        out = reshard_dtensors(state, dst, pl, timeout=30)
    if ctx.rank == 3:  # off the destination mesh: nothing comes back
        bad = [] if out == {} else ["rank 3 got tensors"]
    else:
        bad = _check(out, {"w": full}, dst, lambda n, s: [Shard(1)])
    return {"verified": len(calls), "bad": bad}


@pytest.mark.slow
def test_a_cold_call_checks_the_plan_with_peers_only_where_destinations_may_differ(pool):
    # The same destination list on every rank: its digest rides in the first
    # all_gather and the per-peer plan check is skipped.
    for r, res in enumerate(pool.run(_checks, "same")):
        assert res == {"verified": 0, "bad": []}, (r, res)
    # A callable is described only by its results: every rank with peers checks.
    for r, res in enumerate(pool.run(_checks, "callable")):
        assert res == {"verified": 1, "bad": []}, (r, res)
    # Rank 3 gives the destination another way: the digests differ, so every rank
    # checks its plan with its peers (and a plan that differed would raise there).
    for r, res in enumerate(pool.run(_checks, "mapping")):
        assert res == {"verified": 1, "bad": []}, (r, res)


def _donate(ctx: WorkerContext) -> dict:
    # TP2 x DP2 -> TP4: ranks 0 and 3 keep a contiguous half of their source shard.
    src = DeviceMesh("cpu", torch.arange(4).reshape(2, 2))
    dst = DeviceMesh("cpu", torch.arange(4))
    full = torch.arange(64.0).reshape(16, 4)
    state = {"w": distribute_tensor(full, src, [Replicate(), Shard(0)], src_data_rank=None)}
    mine = state["w"].to_local()
    base = mine.untyped_storage().data_ptr()
    out = reshard_dtensors(state, dst, [Shard(0)], timeout=30, donate=True)
    local = out["w"].to_local()
    bad = _check(out, {"w": full}, dst, lambda n, s: [Shard(0)])
    aliased = local.untyped_storage().data_ptr() == base
    # without donate: a fresh tensor, the source untouched
    again = reshard_dtensors(state, dst, [Shard(0)], timeout=30)["w"].to_local()
    fresh = again.untyped_storage().data_ptr() != base
    return {"bad": bad, "aliased": aliased, "fresh": fresh}


@pytest.mark.slow
def test_donate_returns_kept_blocks_without_a_copy(pool):
    out = pool.run(_donate)
    for r, res in enumerate(out):
        assert res["bad"] == [] and res["fresh"], (r, res)
    # ranks 0 and 3 keep a quarter that is a contiguous half of their own shard
    assert [res["aliased"] for res in out] == [True, False, False, True], out


# -- refused before anything moves -------------------------------------------------------------


class _Counting(ProcessGroupTransport):
    posted = 0

    def _issue(self, ops):
        self.posted += 1
        return super()._issue(ops)


def _refused(ctx: WorkerContext, case: str) -> dict:
    mesh = DeviceMesh("cpu", torch.arange(4))
    full = torch.arange(8.0)
    state = {"ok": distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)}
    dst = DeviceMesh("cpu", torch.arange(3))
    pl = [Shard(0)]
    if case == "partial":
        state["grad_sum"] = DTensor.from_local(torch.ones(2), mesh, [Partial()], run_check=False)
    elif case == "shape":
        tmpl = distribute_tensor(torch.zeros(9), dst, [Shard(0)], src_data_rank=None)
        pl = {"ok": tmpl}
    elif case == "dim":
        pl = [Shard(1)]
    elif case == "disagree" and ctx.rank == 2:
        state["ok"] = distribute_tensor(
            torch.arange(8.0).double(), mesh, [Shard(0)], src_data_rank=None
        )
    elif case == "unpicklable" and ctx.rank == 1:
        state["hook"] = lambda: None  # a value travels pickled; a lambda does not pickle
    t = _Counting(dist.group.WORLD)
    try:
        reshard_dtensors(state, dst, pl, transport=t, timeout=30)
    except DTensorReshardError as e:
        return {"error": str(e), "posted": t.posted}
    return {"error": None, "posted": t.posted}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("partial", "tensor 'grad_sum': placement Partial"),
        ("shape", r"tensor 'ok' is \[8\] in the source but its destination template is \[9\]"),
        ("dim", "tensor 'ok'.*shards dim 1"),
        ("disagree", r"tensor 'ok': rank 0 holds a dtensor \[8\] torch.float32 .* rank 2 holds"),
        ("unpicklable", r"rank\(s\) \[1\] pass a state entry that does not pickle"),
    ],
)
def test_bad_input_refused_on_every_rank(pool, case, match) -> None:
    import re

    out = pool.run(_refused, case)
    for r, res in enumerate(out):
        assert res["error"] is not None and re.search(match, res["error"]), (r, res)
        assert res["posted"] == 0


# -- flatten / unflatten (one process) --------------------------------------------------------


def test_flatten_and_unflatten_an_adamw_state() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(
        [{"params": [model[0].weight, model[1].bias]}, {"params": [model[0].bias], "lr": 0.5}],
        lr=0.1,
    )
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    names = ["0.weight", "1.bias", "0.bias"]  # the optimizer's order, not the model's
    masters = {n: p.detach().double() for n, p in model.named_parameters()}
    flat = flatten_state(model.state_dict(), opt.state_dict(), param_names=names, masters=masters)
    assert flat["optim.exp_avg.1.bias"] is opt.state[model[1].bias]["exp_avg"]
    assert flat["optim.step.0.bias"] is opt.state[model[0].bias]["step"]
    assert flat["optim.param_groups"][1]["params"] == ["0.bias"]
    assert flat["optim.param_groups"][1]["lr"] == 0.5
    assert "optim.exp_avg.1.weight" not in flat  # a parameter the optimizer does not hold
    assert param_name("optim.exp_avg_sq.0.weight") == "0.weight"
    assert param_name("master.1.bias") == "1.bias" and param_name("1.bias") == "1.bias"
    model_sd, optim_sd, masters_back = unflatten_state(flat)
    assert model_sd.keys() == model.state_dict().keys()
    assert masters_back.keys() == masters.keys()
    # The rebuilt optimizer state loads into a fresh optimizer over the same groups.
    fresh = torch.optim.AdamW(
        [{"params": [model[0].weight, model[1].bias]}, {"params": [model[0].bias], "lr": 0.5}],
        lr=0.1,
    )
    fresh.load_state_dict(optim_sd)
    for p in (model[0].weight, model[1].bias, model[0].bias):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert _bits_equal(fresh.state[p][key], opt.state[p][key])


def test_flatten_refuses_ambiguous_names() -> None:
    from nereus_comm import LayoutError

    with pytest.raises(LayoutError, match=r"'optim\.x'"):
        flatten_state({"optim.x": torch.zeros(1)})
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(LayoutError, match="pass param_names"):
        flatten_state(model.state_dict(), opt.state_dict())
    with pytest.raises(LayoutError, match="2 parameters but 1 param_names"):
        flatten_state(model.state_dict(), opt.state_dict(), param_names=["weight"])


def test_torch_placements_convert_and_partial_is_refused() -> None:
    from nereus_comm.dtensor import from_torch_placements
    from nereus_comm.placement import Replicate as R
    from nereus_comm.placement import Shard as S
    from nereus_comm.placement import StridedShard

    got = from_torch_placements([_StridedShard(0, split_factor=2), Shard(-1), Replicate()], 2)
    assert got == (StridedShard(0, 2), S(1), R())
    with pytest.raises(DTensorReshardError, match="tensor 'g': placement Partial"):
        from_torch_placements([Partial()], 1, "g")
    with pytest.raises(DTensorReshardError, match=r"tensor 'b'.*shards dim 1 of a 1-D"):
        from_torch_placements([Shard(1)], 1, "b")


# -- a repeated call: a fingerprint instead of the metadata ---------------------------------------


def _repeated(ctx: WorkerContext) -> dict:
    src = DeviceMesh("cpu", torch.arange(4).reshape(2, 2))
    dst = DeviceMesh("cpu", torch.tensor([3, 1, 0]))
    g = torch.Generator().manual_seed(5)
    fulls = {"w": torch.randn(9, 6, generator=g), "h": torch.randn(5, generator=g).bfloat16()}
    state = {
        k: distribute_tensor(v, src, [Shard(0), Shard(v.dim() - 1)], src_data_rank=None)
        for k, v in fulls.items()
    }
    with _counted(dtensor_module, "_gather_descriptions") as calls:
        seen, bad = [], []
        for step, (note, pl) in enumerate(
            [("a", [Shard(0)]), ("a", [Shard(0)]), ("a", [Shard(1)]), ("b", [Shard(1)])]
        ):
            before = len(calls)
            for k, v in fulls.items():  # new values, same description: still the fast path
                state[k].to_local().copy_(_reference(v + step, src, state[k].placements))

            def placements_of(name, shape, pl=pl):
                return [Shard(0)] if len(shape) == 1 else pl

            out = reshard_dtensors({**state, "note": note}, dst, placements_of, timeout=30)
            seen.append(len(calls) - before)
            if ctx.rank in (0, 1, 3):
                want = {k: v + step for k, v in fulls.items()}
                bad += [f"{step}: {b}" for b in _check(out, want, dst, placements_of)]
                if out["note"] != note:
                    bad.append(f"{step}: note")
        # A rank that now holds another dtype: every rank refuses, before any byte moves.
        if ctx.rank == 2:
            state["w"] = distribute_tensor(
                fulls["w"].double(), src, [Shard(0), Shard(1)], src_data_rank=None
            )
        try:
            reshard_dtensors({**state, "note": "b"}, dst, [Shard(0)], timeout=30)
            refused = None
        except DTensorReshardError as e:
            refused = str(e)
    return {"metadata_exchanges": seen, "bad": bad, "refused": refused}


@pytest.mark.slow
def test_a_repeated_call_exchanges_a_fingerprint_only(pool) -> None:
    for r, res in enumerate(pool.run(_repeated)):
        # first call: the metadata; the same state again, or to other placements: the
        # fingerprint only; a changed value: the metadata again
        assert res["metadata_exchanges"] == [1, 0, 0, 1], (r, res)
        assert res["bad"] == [], (r, res)
        assert res["refused"] and "tensor 'w'" in res["refused"], (r, res)
