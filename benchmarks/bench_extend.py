"""Scale a training stage from dp=1 to dp=2 five ways, on the same workers, in one run.

The stage: a decoder-only transformer's training state (fp32 parameters, Adam
moments, step, RNG) on one unit of tp=2 (ranks 0, 1). Going to dp=2 means a
second tp=2 unit on ranks 2, 3 holding the same state. Ways:

- ``emu_extend``: EMUManager.extend (nereus_comm plan + reshard; the workers share
  this host, so the receivers read the sources' shards straight into theirs by
  cross-memory attach: one copy, no staging; timed around the whole call);
- ``dcp_reshard``: torch.distributed.checkpoint through storage: the source
  ranks save DTensor shards, the new unit's ranks load theirs (what Megatron's
  distributed checkpointing does);
- ``ucp_files``: UCP-style: save per-rank shards, consolidate every tensor into
  its own file, the new ranks load their slices (mmap);
- ``tensor_store``: Tenplex-style: the source ranks push the state into an
  in-memory tensor store (here a server thread in the driver process, reached
  over TCP) and the new ranks fetch their slices from it;
- ``ckpt_restart``: save per-rank shards, end every worker, start new ones,
  rebuild the runtime, load.

Also a tp change (tp=2 -> two tp=1 units on the same devices): EMU split vs DCP.
Split moves the pages of the half each rank keeps into its new unit
(:mod:`nereus_comm.remap`); ``emu_split_copy`` is the same Split copying them
(``EMUManager(remap_pages=False)``), printed beside it with Split's breakdown.
Every way runs in the same workers, which start with THP_MEM_ALLOC_ENABLE=1 (as
the runtime starts them, unless set), and so does this process (the tensor
store).

Destination memory (``--arena``, default ``prefault``): each worker reserves its
memory budget when the EMU manager sets it up, before anything is timed, as a GPU
worker reserves its device memory (:mod:`nereus_rl.emu.arena`; the budget is what
the scenarios need at their peak, 1.7x one replica's state: a tp=1 unit beside the
tp=2 one it splits from, and the padding that keeps huge pages). Every way's new
layout is built in that memory by the same code (``nereus_rl.emu.worker.carve_shards``):
the EMU units' blocks, and the tensors the DCP, UCP-style, tensor-store and restart
loaders load into (DCP loads in place; checked). ``lazy``: the arena's blocks are
made on first use and kept; ``off``: plain allocations for every way. The restart path
starts new worker processes: their arenas are lazy (``arena_prefault=False``), so
checkpoint/restart pays the first touch of the memory its loads write, and not a
prefault of the whole budget (on a loaded 2-core machine that prefault alone takes tens
of seconds, a cost of fresh host memory that a GPU's cudaMalloc does not have).

The first run of a way is cold (the EMU's first extend builds its gloo groups and
probes cross-memory attach); every run is printed and kept in the rows.
Every way's result is checked against the reference content. Then the cost
model's predicted Extend of one 8B actor (training) and critic unit (tp=8,
from the first node to the last) on the H200 preset at 48..3,264 devices,
labelled predicted.

With ``--concurrent``, instead: one transition with independent primitives
(two stages at dp=1 on workers 0 and 2, each extended to dp=2 onto workers 1
and 3: two extends on disjoint workers, no edge between them) compiled to a
DAG and run live by the concurrent executor, once one primitive at a time
(the executor with one thread: primitives on disjoint workers one after the
other) and once concurrently; the transition's
seconds side by side, every run's state checked.

    python benchmarks/bench_extend.py --quick [--json PATH]
    python benchmarks/bench_extend.py --concurrent [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

# Before torch allocates anything: the tensor store in this process gets huge pages
# as the workers do (Driver.spawn_local sets the same default for them).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
# The repo root on sys.path, so that `benchmarks.lib` imports (see benchmarks/__init__.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The storage-based ways' worker commands and the tensor store (registered on import,
# so on the workers too: they import this module).
from benchmarks.lib.extend_baselines import STAGE, TensorStore
from nereus_comm.layout import Layout
from nereus_rl.emu.manager import EMUManager
from nereus_rl.emu.state import stage_state_specs
from nereus_rl.runtime import Driver

# ------------------------------------------------------------------ driver side


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(args) -> list[dict]:
    sizes = (
        dict(num_layers=2, hidden=384, ffn=1024, vocab=6000)
        if args.quick
        else dict(num_layers=4, hidden=1024, ffn=2816, vocab=16000)
    )
    specs = stage_state_specs(**sizes)
    state_bytes = sum(s.nbytes for s in specs)
    seed = 7
    tmp = tempfile.mkdtemp(prefix="bench_extend_", dir=args.tmp)
    rows: list[dict] = []
    src = Layout(1, 2, 1, (0, 1), num_layers=sizes["num_layers"])
    dst = Layout(1, 2, 1, (2, 3), num_layers=sizes["num_layers"])
    nl = sizes["num_layers"]
    both = Layout(2, 1, 1, (0, 1), num_layers=nl)  # tp2 -> two tp1 units
    # Each worker's budget: its peak in these scenarios (a tp=1 replica beside the tp=2
    # half it splits from: 1.5x), plus slack for alignment (tensors of 2 MiB or more are
    # placed to keep huge pages across Split's page moves: ~5% padding, emu.arena).
    arena = dict(
        arena_bytes=0 if args.arena == "off" else int(1.7 * state_bytes),
        arena_prefault=args.arena == "prefault",
    )
    print(f"state: {len(specs)} tensors, {state_bytes / 2**20:.0f} MiB per replica; dir {tmp}; "
          f"arena {args.arena} ({arena['arena_bytes'] / 2**20:.0f} MiB per worker)")  # fmt: skip

    def check(driver, layout, what) -> None:
        ok = driver.call(layout.ranks, "bench.verify", layout, "bench.loaded", seed)
        if not all(ok.values()):
            raise RuntimeError(f"{what}: the new layout's state differs from the reference")

    d = Driver(call_timeout=1800)
    try:
        d.spawn_local(4, num_threads=1)
        d.import_module("benchmarks.bench_extend")
        m = EMUManager(d, transfer_timeout=1800, **arena)  # each worker reserves its budget
        reserve_s = max(a.get("reserve_s", 0.0) for a in m.arenas.values())
        print(f"  workers' arena reservation: {reserve_s:.3f} s (slowest worker, untimed)")
        m.define_stage(STAGE, specs, seed=seed)
        a = m.create(STAGE, [0, 1], tp=2)

        d.call(d.workers, "bench.init_world", 4)
        d.call(d.workers, "bench.dcp_meshes", [src.ranks, dst.ranks, both.ranks])

        # Each way runs `repeat` times (the first run pays one-time imports and
        # connections); the fastest run counts. Every run's result is checked.
        def emu_extend():
            t0 = time.perf_counter()
            b = m.extend(STAGE, [2, 3], tp=2)
            wall = time.perf_counter() - t0
            rec = m.records[-1]
            d.call(b.ranks, "bench.stash_unit", b.uid)
            check(d, dst, "EMU extend")
            m.destroy(b)  # so that every way starts from dp=1
            return dict(
                seconds=wall,
                record_s=rec.seconds,
                bytes_moved=rec.bytes_moved,
                transfer_s=rec.extra["reshard_s"],
                exchange_s=rec.extra["exchange_s"],
                alloc_s=rec.extra["alloc_s"],
                bytes_cma=rec.extra["bytes_cma"],
                comm_setup_s=rec.comm_setup_s,
            )

        def dcp_reshard(layout=dst):
            path = os.path.join(tmp, "dcp")
            t_save = _timed(lambda: d.call(d.workers, "bench.dcp_save", src, path))
            t_load = _timed(lambda: d.call(d.workers, "bench.dcp_load", layout, path))
            check(d, layout, "dcp")
            shutil.rmtree(path)
            return dict(seconds=t_save + t_load, save_s=t_save, load_s=t_load)

        def ucp_files():
            path = os.path.join(tmp, "ucp")
            os.makedirs(path)
            t_save = _timed(lambda: d.call(d.workers, "bench.save_rank", src, path))
            t_cons = _timed(lambda: d.call([0], "bench.consolidate", src, path))
            t_load = _timed(lambda: d.call(d.workers, "bench.load_atomic", dst, path))
            check(d, dst, "ucp")
            shutil.rmtree(path)
            return dict(seconds=t_save + t_cons + t_load, save_s=t_save,
                        consolidate_s=t_cons, load_s=t_load)  # fmt: skip

        def tensor_store():
            store = TensorStore()
            t_put = _timed(lambda: d.call(d.workers, "bench.store_put", src, store.address))
            t_get = _timed(lambda: d.call(d.workers, "bench.store_get", dst, store.address))
            store.close()
            check(d, dst, "tensor store")
            return dict(seconds=t_put + t_get, put_s=t_put, get_s=t_get)

        def emu_split(remap: bool = True):
            nonlocal a
            m.remap_pages = remap
            x, y = m.split(a)
            rec = m.records[-1]
            for u, lay in (
                (x, Layout(1, 1, 1, (0,), num_layers=nl)),
                (y, Layout(1, 1, 1, (1,), num_layers=nl)),
            ):
                d.call(u.ranks, "bench.stash_unit", u.uid)
                check(d, lay, "EMU split")
            a = m.merge(x, y, tp=2)  # back to tp=2 for the next way
            merge = m.records[-1]
            m.remap_pages = True
            # Where Split's seconds go (slowest rank of each; cpu_s summed over both
            # ranks' processes): the cma reads of the peer's half, the local copies
            # (row-parallel halves, and every kept byte with remap off; they run beside
            # the reads), the page moves (in call_s, after the exchange). Route "auto"
            # reads the peer's long pieces by cma in --quick too (per wire buffer).
            keys = ("reshard_s", "read_s", "local_s", "remap_s", "alloc_s", "plan_s",
                    "call_s", "cpu_s", "bytes_remapped", "bytes_cma", "bytes_shm")  # fmt: skip
            out = dict(seconds=rec.seconds, bytes_moved=rec.bytes_moved,
                       bytes_local=rec.bytes_local, merge_s=merge.seconds,
                       merge_cpu_s=merge.extra["cpu_s"], cma_fallback=rec.extra["cma_fallback"],
                       **{k: rec.extra[k] for k in keys})  # fmt: skip
            print(
                f"    split{'' if remap else ' (remap off)'} {rec.seconds:.3f} s: "
                + " ".join(f"{k} {out[k]:.3f}" for k in keys[:-3])
                + f"; {out['bytes_remapped'] / 2**20:.0f} MiB moved by page remap of "
                f"{rec.bytes_local / 2**20:.0f} MiB kept, {out['bytes_cma'] / 2**20:.1f} MiB "
                f"by cma, {out['bytes_shm'] / 2**20:.1f} MiB by shm; merge {merge.seconds:.3f} s "
                f"(cpu {out['merge_cpu_s']:.3f})"
            )
            if out["cma_fallback"]:
                # The peer's half goes through shared memory where cma cannot read it.
                print(f"    cma unavailable, shm instead: {out['cma_fallback']}")
            return out

        ways = [
            ("dp1_to_dp2", "emu_extend", emu_extend),
            ("dp1_to_dp2", "dcp_reshard", dcp_reshard),
            ("dp1_to_dp2", "ucp_files", ucp_files),
            ("dp1_to_dp2", "tensor_store", tensor_store),
            # The copying Split first, on pages no page move has split into small ones
            # yet (moves leave 4 KiB pages behind; reads of them are slower).
            ("tp2_to_2x_tp1", "emu_split_copy", lambda: emu_split(remap=False)),
            ("tp2_to_2x_tp1", "emu_split", emu_split),
            ("tp2_to_2x_tp1", "dcp_reshard", lambda: dcp_reshard(both)),
        ]
        for scenario, way, fn in ways:
            runs = [fn() for _ in range(args.repeat)]
            best = min(runs, key=lambda r: r["seconds"])
            # Every run kept: the first is cold (an EMU's first extend builds its groups
            # and probes cross-memory attach), the others warm.
            rows.append(dict(scenario=scenario, way=way, **best, repeats=args.repeat,
                             runs_s=[r["seconds"] for r in runs], runs=runs))  # fmt: skip
            print(f"  {scenario} {way}: {[round(r['seconds'], 3) for r in runs]} s")

        # 5. Checkpoint/restart: save, end every worker, start new ones, rebuild, load.
        path = os.path.join(tmp, "ckpt")
        os.makedirs(path)
        t0 = time.perf_counter()
        d.call(d.workers, "bench.save_rank", src, path)
        d.shutdown()
        d = Driver(call_timeout=1800)
        d.spawn_local(4, num_threads=1)
        d.import_module("benchmarks.bench_extend")
        # New processes: their arenas fill on first use (see the module docstring).
        m = EMUManager(d, transfer_timeout=1800, **{**arena, "arena_prefault": False})
        m.define_stage(STAGE, specs, seed=seed)
        new = Layout(2, 2, 1, (0, 1, 2, 3), num_layers=sizes["num_layers"])
        d.call(d.workers, "bench.load_rank_files", src, new, path)
        t_cr = time.perf_counter() - t0
        check(d, new, "restart")
        reserve_s = max(a.get("reserve_s", 0.0) for a in m.arenas.values())
        print(f"  dp1_to_dp2 ckpt_restart: {t_cr:.3f} s (new workers' reservation "
              f"{reserve_s:.3f} s)")  # fmt: skip
        rows.append(dict(scenario="dp1_to_dp2", way="ckpt_restart", seconds=t_cr, repeats=1,
                         reserve_s=reserve_s))  # fmt: skip
    finally:
        d.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)

    for r in rows:
        base = {"dp1_to_dp2": "emu_extend", "tp2_to_2x_tp1": "emu_split"}[r["scenario"]]
        emu = next(x for x in rows if x["scenario"] == r["scenario"] and x["way"] == base)
        r["state_bytes"] = state_bytes
        r["arena"] = args.arena
        r["ratio_to_emu_x"] = r["seconds"] / emu["seconds"]
    return rows


def run_concurrent(args) -> list[dict]:
    """Serial vs concurrent execution of one transition of two independent extends."""
    from nereus_rl.core.globalplan import GlobalPlan, StagePlan
    from nereus_rl.emu.dag import live_impls
    from nereus_rl.transition.compile import compile_transition
    from nereus_rl.transition.execute import execute_dag

    # A small state (round trips dominate) and larger ones (copies dominate).
    sizes = [
        dict(num_layers=2, hidden=32, ffn=64, vocab=256),
        dict(num_layers=2, hidden=384, ffn=1024, vocab=6000),
    ]
    if not args.quick:
        sizes.append(dict(num_layers=4, hidden=768, ffn=2048, vocab=16000))
    seeds = {STAGE: 7, "critic": 8}  # bench.verify reads STAGE's specs: both stages share them

    def plan(**units) -> GlobalPlan:
        return GlobalPlan(tuple(
            StagePlan(st, st, True, len(us), 1, 1, tuple((x,) for x in us))
            for st, us in units.items()
        ))  # fmt: skip

    current = plan(**{STAGE: [0], "critic": [2]})
    target = plan(**{STAGE: [0, 1], "critic": [2, 3]})
    dag = compile_transition(current, target, capacity=float("inf"), stage_slots=False)
    print(f"DAG {dag.counts()}, {len(dag.edges)} edges")
    rows: list[dict] = []
    for size in sizes:
        specs = stage_state_specs(**size)
        state_bytes = sum(s.nbytes for s in specs)
        nl = size["num_layers"]
        d = Driver(call_timeout=1800)
        try:
            d.spawn_local(4, num_threads=1)
            d.import_module("benchmarks.bench_extend")
            m = EMUManager(d, transfer_timeout=1800)
            base = {}
            for st, rank in ((STAGE, 0), ("critic", 2)):
                m.define_stage(st, specs, seed=seeds[st])
                base[f"{st}#0"] = m.create(st, [rank])
            modes = ("serial", "concurrent", "serial_cold", "concurrent_cold")
            runs: dict[str, list[float]] = {mode: [] for mode in modes}
            # The first round (not counted) builds the groups and shared-memory segments.
            # A cold run starts from an empty pool: its transfer groups and their
            # shared-memory segments are built inside the transition, as on a first move
            # to new devices.
            for i in range(args.repeat + 1):
                for mode in modes:
                    if mode.endswith("_cold"):
                        m.pool.destroy_all()
                        m.flush()
                    live = dict(base)
                    t0 = time.perf_counter()
                    rep = execute_dag(
                        dag,
                        live_impls(m, live, list),
                        max_workers=1 if mode.startswith("serial") else None,
                    )
                    dt = time.perf_counter() - t0
                    if i:
                        runs[mode].append(dt)
                    for st, rank in ((STAGE, 1), ("critic", 3)):
                        (u,) = [x for x in m.units(st) if x.ranks == (rank,)]
                        d.call([rank], "bench.stash_unit", u.uid)
                        lay = Layout(1, 1, 1, (rank,), num_layers=nl)
                        ok = d.call([rank], "bench.verify", lay, "bench.loaded", seeds[st])
                        if not all(ok.values()):
                            raise RuntimeError(f"{mode}: {st}'s new unit is not the reference")
                        m.destroy(u)  # back to dp=1 for the next run
                    m.flush()
                    note = "" if i else " (warm-up)"
                    print(f"  {state_bytes / 2**20:.1f} MiB {mode}: {dt:.4f} s, "
                          f"{[repr(r) for r in rep.records]}{note}")  # fmt: skip
        finally:
            d.shutdown()
        scenario = f"2x_extend_{state_bytes / 2**20:.1f}MiB"
        for mode in modes:
            rows.append(dict(scenario=scenario, way=f"transition_{mode}",
                             seconds=min(runs[mode]), runs=[round(x, 4) for x in runs[mode]],
                             state_bytes=state_bytes, repeats=args.repeat))  # fmt: skip
        for a, b in ((rows[-4], rows[-3]), (rows[-2], rows[-1])):
            a["ratio_to_concurrent_x"] = a["seconds"] / b["seconds"]
            b["ratio_to_concurrent_x"] = 1.0
    return rows


def predicted_rows() -> list[dict]:
    """Cost-model Extend predictions for the 8B actor/critic units on H200 clusters."""
    from nereus_rl.core.spec import cluster_preset, model_preset
    from nereus_rl.costmodel.costmodel import CostModel, UnitLayout

    model = model_preset("llama-3.1-8b")
    rows = []
    for n in (48, 256, 1024, 3264):
        cm = CostModel(cluster_preset("h200x4096").with_devices(n))
        src = UnitLayout(8, 1, tuple(range(8)))
        dst = UnitLayout(8, 1, tuple(range(n - 8, n)))
        # The critic's state is taken as the same size as the actor's (a value head
        # instead of the lm head), with Adam state: both train.
        cost = cm.primitive_cost("extend", model, trains=True, src=(src,), dst=(dst,))
        rows.append(dict(scenario=f"h200x{n}_predicted", way="emu_extend_8b_unit_predicted",
                         seconds=float(cost.seconds), bytes_moved=int(cost.bytes_moved),
                         comm_setup_s=float(cost.setup_s), predicted=True))  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small state (~100 MiB), < 2 minutes")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--tmp", default=None, help="directory for checkpoint files")
    ap.add_argument("--repeat", type=int, default=2, help="runs per way (the fastest counts)")
    ap.add_argument(
        "--arena",
        choices=("prefault", "lazy", "off"),
        default="prefault",
        help="workers' destination memory for every way (see the module docstring)",
    )
    ap.add_argument(
        "--concurrent",
        action="store_true",
        help="serial vs concurrent transition of independent primitives instead",
    )
    args = ap.parse_args()
    t0 = time.perf_counter()
    if args.concurrent:
        rows = run_concurrent(args)
        print(f"\n{'scenario':<24}{'way':<24}{'seconds':>9}{'x concurrent':>14}")
        for r in rows:
            print(f"{r['scenario']:<24}{r['way']:<24}{r['seconds']:>9.4f}"
                  f"{r['ratio_to_concurrent_x']:>14.2f}")  # fmt: skip
        print(f"(state per replica and stage; total run {time.perf_counter() - t0:.0f} s)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"benchmark": "bench_extend_concurrent", "rows": rows}, f, indent=1)
        return
    rows = run(args)
    print(f"\n{'scenario':<15}{'way':<15}{'seconds':>10}{'x EMU':>9}")
    for r in rows:
        print(f"{r['scenario']:<15}{r['way']:<15}{r['seconds']:>10.3f}{r['ratio_to_emu_x']:>9.1f}")
    print(f"(state {rows[0]['state_bytes'] / 2**20:.0f} MiB per replica; "
          f"total run {time.perf_counter() - t0:.0f} s)")  # fmt: skip
    pred = predicted_rows()
    if pred:
        print("\nPREDICTED by the cost model (not measured): Extend of one 8B training unit")
        print("(tp=8, weights + fp32 master + Adam), first node -> last node, H200 preset:")
        for r in pred:
            print(f"  {r['scenario']:<22}{r['seconds']:>8.2f} s  "
                  f"{r['bytes_moved'] / 2**30:>6.1f} GiB")  # fmt: skip
        rows += pred
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "bench_extend", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
