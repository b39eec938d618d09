"""Profile EMU Split/Merge rounds alone: Split's breakdown and each worker's huge pages.

Why
    bench_extend times Split once or twice among many ways; finding where Split's
    seconds go (the cma read of the peer's half, the local copies, the page moves)
    and whether page moves keep transparent huge pages needs many rounds of Split
    and Merge on the same workers, with each worker's AnonHugePages after each.

    python tools/profile_split.py [--quick] [--rounds N] [--copy]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
# The repo root on sys.path: the workers import this module as ``tools.profile_split``.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nereus_rl.emu.manager import EMUManager
from nereus_rl.emu.state import stage_state_specs
from nereus_rl.runtime import Driver
from nereus_rl.runtime.context import WorkerContext, register


@register("profile.huge_mib")
def huge_mib(ctx: WorkerContext) -> float:
    """This worker's anonymous memory in transparent huge pages (MiB)."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) / 1024
    return 0.0


@register("profile.cma_threads")
def cma_threads(ctx: WorkerContext, n: int) -> None:
    """Threads this worker's cross-memory-attach reads use (before its first read)."""
    from nereus_comm import transport_cma

    transport_cma.CMA_THREADS = n


@register("profile.last_moves")
def last_moves(ctx: WorkerContext):
    """(seconds, bytes moved, swaps, bytes copied) of this worker's last page moves."""
    return ctx.state.get("emu.last_moves")


KEYS = ("reshard_s", "read_s", "local_s", "remap_s", "alloc_s", "call_s", "cpu_s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the bench's --quick state")
    ap.add_argument("--rounds", type=int, default=4, help="Split + Merge rounds")
    ap.add_argument("--copy", action="store_true", help="remap_pages=False")
    ap.add_argument("--cma-threads", type=int, default=0, help="override CMA_THREADS (0: keep)")
    args = ap.parse_args()
    sizes = (
        dict(num_layers=2, hidden=384, ffn=1024, vocab=6000)
        if args.quick
        else dict(num_layers=4, hidden=1024, ffn=2816, vocab=16000)
    )
    specs = stage_state_specs(**sizes)
    state = sum(s.nbytes for s in specs)
    d = Driver(call_timeout=600)
    try:
        d.spawn_local(2, num_threads=1)
        d.import_module("tools.profile_split")
        if args.cma_threads:
            d.call([0, 1], "profile.cma_threads", args.cma_threads)
        m = EMUManager(d, arena_bytes=int(1.7 * state), arena_prefault=True,
                       remap_pages=not args.copy)  # fmt: skip
        m.define_stage("actor", specs, seed=7)
        a = m.create("actor", [0, 1], tp=2)
        huge = d.call([0, 1], "profile.huge_mib")
        print(f"state {state / 2**20:.0f} MiB; huge MiB per worker {huge}")
        for i in range(args.rounds):
            t0 = time.perf_counter()
            x, y = m.split(a)
            wall = time.perf_counter() - t0
            rec = m.records[-1]
            a = m.merge(x, y, tp=2)
            mrec = m.records[-1]
            huge = d.call([0, 1], "profile.huge_mib")
            moves = d.call([0, 1], "profile.last_moves")
            print(
                f"round {i}: split {rec.seconds:.3f} s (wall {wall:.3f}) "
                + " ".join(f"{k} {rec.extra[k]:.3f}" for k in KEYS)
                + f" moved {rec.extra['bytes_remapped'] / 2**20:.0f} MiB,"
                f" {rec.extra['bytes_cma'] / 2**20:.1f} MiB by cma,"
                f" {rec.extra['bytes_shm'] / 2**20:.1f} MiB by shm;"
                f" merge {mrec.seconds:.3f} s (remap {mrec.extra['remap_s']:.3f}); huge MiB {huge}"
            )
            print(f"  merge's page moves per worker (s, bytes moved, swaps, bytes copied): {moves}")
            if rec.extra["cma_fallback"]:
                print(f"  cma unavailable, shm instead: {rec.extra['cma_fallback']}")
    finally:
        d.shutdown()


if __name__ == "__main__":
    main()
