"""bench_extend's storage-based ways: their worker commands and the tensor store.

Imported by benchmarks/bench_extend.py (and so by its workers, which import that
module): the commands that save, consolidate and load checkpoints (DCP, UCP-style,
checkpoint/restart), push and fetch a Tenplex-style in-memory tensor store, and check
a loaded layout against the reference; and :class:`TensorStore`, the store itself
(a server thread in the driver process, reached over TCP). Every loader writes into
the same kind of memory as the EMU units (``nereus_rl.emu.worker.carve_shards``).
"""

from __future__ import annotations

import os
import threading
from multiprocessing.connection import Client, Listener

import torch

from nereus_comm.layout import Layout
from nereus_rl.emu.comm import box_slices
from nereus_rl.emu.state import synthetic
from nereus_rl.emu.worker import carve_shards, release
from nereus_rl.runtime.context import WorkerContext, register

STAGE = "actor"
AUTHKEY = b"nereus-bench"

# ------------------------------------------------------------------ worker commands


def _stage(ctx: WorkerContext):
    return ctx.state["emu.stages"][STAGE]


def _shards_of(ctx: WorkerContext, layout: Layout) -> dict[str, torch.Tensor]:
    """This rank's shards in ``layout``, from the unit that holds them."""
    for unit in ctx.state["emu.units"].values():
        if unit["stage"] == STAGE and ctx.rank in unit["layout"]:
            return unit["tensors"]
    raise RuntimeError(f"rank {ctx.rank} holds no unit of {STAGE}")


@register("bench.verify")
def verify(ctx: WorkerContext, layout: Layout, key: str, seed: int) -> bool:
    """Whether the tensors stored under ctx.state[key] are this rank's exact shards."""
    specs, nl = _stage(ctx)
    got = ctx.state.pop(key)
    ok = True
    for spec in specs:
        box = layout.box(spec, ctx.rank, nl)
        if box is not None and not torch.equal(got[spec.name], synthetic(spec, box, seed)):
            ok = False
    release(ctx.state.pop("bench.block", None))  # a loader's destination, back to the arena
    return ok


def _destination(ctx: WorkerContext, layout: Layout) -> dict[str, torch.Tensor]:
    """This rank's empty shards of ``layout``, made as an EMU unit's are (the arena)."""
    specs, nl = _stage(ctx)
    block, tensors = carve_shards(ctx, specs, layout, nl, "a loaded layout")
    ctx.state["bench.block"] = block
    return tensors


@register("bench.stash_unit")
def stash_unit(ctx: WorkerContext, uid: int) -> None:
    ctx.state["bench.loaded"] = ctx.state["emu.units"][uid]["tensors"]


@register("bench.init_world")
def init_world(ctx: WorkerContext, world_size: int) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        store = dist.PrefixStore("bench/world/", ctx.store)
        dist.init_process_group("gloo", store=store, rank=ctx.rank, world_size=world_size)


def _mesh(ranks):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", list(ranks))


def _dtensors(specs, nl, layout: Layout, rank: int, mesh, tensors):
    assert layout.pp == 1 and (layout.dp == 1 or layout.tp == 1), "1-D meshes only"
    from torch.distributed.tensor import DTensor, Replicate, Shard

    sd = {}
    for spec in specs:
        box = layout.box(spec, rank, nl)
        if box is None:
            continue
        local = tensors[spec.name]
        # A 1-D mesh over the layout's ranks: tp shards, or dp replicas (tp = 1).
        split = spec.split_dim is not None and layout.tp > 1
        place = [Shard(spec.split_dim) if split else Replicate()]
        stride = torch.empty(spec.shape, dtype=spec.dtype, device="meta").stride()
        sd[spec.name] = DTensor.from_local(
            local, mesh, place, run_check=False, shape=torch.Size(spec.shape), stride=stride
        )
    return sd


@register("bench.dcp_meshes")
def dcp_meshes(ctx: WorkerContext, groups: list[tuple[int, ...]]) -> None:
    # DeviceMesh creation is collective over the default group: every rank makes every mesh.
    ctx.state["bench.meshes"] = {tuple(g): _mesh(g) for g in groups}


def _dcp_state(ctx: WorkerContext, layout: Layout, tensors: dict):
    """The stage's state on ``layout`` as DTensors over this rank's ``tensors`` (what
    dcp saves from or loads into), and the layout's mesh."""
    specs, nl = _stage(ctx)
    mesh = ctx.state["bench.meshes"][tuple(layout.ranks)]
    return _dtensors(specs, nl, layout, ctx.rank, mesh, tensors), mesh


@register("bench.dcp_save")
def dcp_save(ctx: WorkerContext, src: Layout, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    if ctx.rank not in src:
        return
    sd, mesh = _dcp_state(ctx, src, _shards_of(ctx, src))
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(path), process_group=mesh.get_group())


@register("bench.dcp_load")
def dcp_load(ctx: WorkerContext, dst: Layout, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    if ctx.rank not in dst:
        return
    out = _destination(ctx, dst)
    sd, mesh = _dcp_state(ctx, dst, out)
    dcp.load(sd, storage_reader=dcp.FileSystemReader(path), process_group=mesh.get_group())
    loaded = {k: v.to_local() for k, v in sd.items()}
    if any(loaded[k].data_ptr() != out[k].data_ptr() for k in out):
        raise RuntimeError("dcp.load replaced a destination tensor: it did not load in place")
    ctx.state["bench.loaded"] = loaded


@register("bench.save_rank")
def save_rank(ctx: WorkerContext, src: Layout, path: str, tensors_key: str | None = None) -> None:
    """Each source rank writes its shards to one file (a plain per-rank checkpoint)."""
    if ctx.rank not in src:
        return
    tensors = _shards_of(ctx, src) if tensors_key is None else ctx.state[tensors_key]
    torch.save(dict(tensors), os.path.join(path, f"rank{src.ranks.index(ctx.rank)}.pt"))


@register("bench.consolidate")
def consolidate(ctx: WorkerContext, src: Layout, path: str) -> None:
    """UCP's conversion: every tensor assembled from the rank files into its own file."""
    specs, nl = _stage(ctx)
    files = [
        torch.load(os.path.join(path, f"rank{i}.pt"), mmap=True) for i in range(len(src.ranks))
    ]
    os.makedirs(os.path.join(path, "atomic"), exist_ok=True)
    for spec in specs:
        full = torch.empty(spec.shape, dtype=spec.dtype)
        for i, r in enumerate(src.ranks):
            box = src.box(spec, r, nl)
            if box is not None:
                full[box_slices(box, tuple((0, 0) for _ in box))] = files[i][spec.name]
        torch.save(full, os.path.join(path, "atomic", spec.name + ".pt"))


@register("bench.load_atomic")
def load_atomic(ctx: WorkerContext, dst: Layout, path: str) -> None:
    if ctx.rank not in dst:
        return
    specs, nl = _stage(ctx)
    out = _destination(ctx, dst)
    for spec in specs:
        box = dst.box(spec, ctx.rank, nl)
        if box is not None:
            full = torch.load(os.path.join(path, "atomic", spec.name + ".pt"), mmap=True)
            out[spec.name].copy_(full[box_slices(box, tuple((0, 0) for _ in box))])
    ctx.state["bench.loaded"] = out


@register("bench.load_rank_files")
def load_rank_files(ctx: WorkerContext, src: Layout, dst: Layout, path: str) -> None:
    """Each new rank assembles its shards from the old ranks' files (any layout change)."""
    if ctx.rank not in dst:
        return
    specs, nl = _stage(ctx)
    files = [
        torch.load(os.path.join(path, f"rank{i}.pt"), mmap=True) for i in range(len(src.ranks))
    ]
    out = _destination(ctx, dst)
    for spec in specs:
        want = dst.box(spec, ctx.rank, nl)
        if want is None:
            continue
        t = out[spec.name]
        for i, r in enumerate(src.ranks):
            have = src.box(spec, r, nl)
            if have is None:
                continue
            inter = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(want, have))
            if all(a < b for a, b in inter) or not inter:
                t[box_slices(inter, want)] = files[i][spec.name][box_slices(inter, have)]
    ctx.state["bench.loaded"] = out


@register("bench.store_put")
def store_put(ctx: WorkerContext, src: Layout, address: tuple[str, int]) -> None:
    """Push this rank's shards into the tensor store (replicated ones from tp rank 0 only)."""
    if ctx.rank not in src:
        return
    specs, nl = _stage(ctx)
    tensors = _shards_of(ctx, src)
    t_coord = src.coords(ctx.rank)[2]
    with Client(tuple(address), authkey=AUTHKEY) as conn:
        for spec in specs:
            box = src.box(spec, ctx.rank, nl)
            if box is None or (spec.split_dim is None and t_coord != 0):
                continue
            conn.send(("put", spec.name, spec.shape, spec.dtype, box))
            conn.send_bytes(_raw(tensors[spec.name]))
        conn.send(("bye",))


@register("bench.store_get")
def store_get(ctx: WorkerContext, dst: Layout, address: tuple[str, int]) -> None:
    if ctx.rank not in dst:
        return
    specs, nl = _stage(ctx)
    out = _destination(ctx, dst)
    with Client(tuple(address), authkey=AUTHKEY) as conn:
        for spec in specs:
            box = dst.box(spec, ctx.rank, nl)
            if box is None:
                continue
            conn.send(("get", spec.name, spec.shape, spec.dtype, box))
            conn.recv_bytes_into(_raw(out[spec.name]))
        conn.send(("bye",))
    ctx.state["bench.loaded"] = out


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


# ------------------------------------------------------------------ tensor store


class TensorStore:
    """Tenplex-style in-memory tensor store: full tensors, filled and read by box over TCP."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()
        self.listener = Listener(("127.0.0.1", 0), authkey=AUTHKEY)
        self.address = self.listener.address
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._client, args=(conn,), daemon=True).start()

    def _client(self, conn) -> None:
        with conn:
            while True:
                msg = conn.recv()
                if msg[0] == "bye":
                    return
                op, name, shape, dtype, box = msg
                with self._lock:
                    full = self.tensors.get(name)
                    if full is None:
                        full = self.tensors[name] = torch.empty(shape, dtype=dtype)
                view = full[box_slices(box, tuple((0, 0) for _ in box))]
                if op == "put":
                    data = conn.recv_bytes()
                    view.copy_(torch.frombuffer(bytearray(data), dtype=dtype).view(view.shape))
                else:
                    conn.send_bytes(_raw(view))

    def close(self) -> None:
        self.listener.close()
