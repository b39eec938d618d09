"""Resharding demo: a small transformer's training state changes layout twice.

Local worker processes (ranks of one gloo group) hold the state of a small
decoder-only transformer (bf16 weights, fp32 master weights and both Adam
moments) sharded as dp2 x tp(W/2); it is resharded to tp W, then to
tp(W/2) x pp2, and every byte of every shard is checked against the slice of
the full state. Prints each plan's stats and the measured time.

It uses nereus_comm as another framework would: describe the state
(TensorSpec), the layouts (Layout), plan once (plan_reshard, the same on every
rank), and call reshard on every rank with its shards and a transport. The
worker processes come from nereus_comm.testing's LocalWorkers; a framework uses
its own (torch.distributed ranks, Ray actors, ...).

    python examples/reshard_demo.py [--workers 4] [--hidden 256]
"""

from __future__ import annotations

import argparse
import sys
import time
from itertools import pairwise

import torch

from nereus_comm import (
    GlooTransport,
    Layout,
    TensorSpec,
    plan_reshard,
    reshard,
    shards_from_full,
    transformer_state_specs,
)
from nereus_comm.testing import LocalWorkers, WorkerContext

NUM_LAYERS = 4


def model_shape(hidden: int) -> dict[str, int]:
    """The demo model's sizes for a hidden size (256 gives a ~67 MiB training state)."""
    return dict(
        num_layers=NUM_LAYERS,
        hidden=hidden,
        ffn=hidden * 43 // 16,
        num_heads=8,
        num_kv_heads=4,
        vocab=hidden * 16,
    )


def full_state(specs: list[TensorSpec], seed: int) -> dict[str, torch.Tensor]:
    """Deterministic full tensors for every spec (the same in every process)."""
    g = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.shape, generator=g).to(s.dtype) for s in specs}


def demo_layouts(num_workers: int) -> list[Layout]:
    """dp2 x tp(W/2) -> tp W -> tp(W/2) x pp2 over ranks 0..W-1."""
    w = num_workers
    half = w // 2
    return [
        Layout(2, half, 1, tuple(range(w))),
        Layout(1, w, 1, tuple(range(w))),
        Layout(1, half, 2, tuple(reversed(range(w)))),
    ]


def _worker(ctx: WorkerContext, specs, layouts, seed: int) -> list[dict]:
    transport = GlooTransport()
    full = full_state(specs, seed)
    num_layers = NUM_LAYERS
    shards = shards_from_full(full, specs, layouts[0], ctx.rank, num_layers)
    rows = []
    for src, dst in pairwise(layouts):
        plan = plan_reshard(specs, src, dst, num_layers)
        res = reshard(plan, ctx.rank, shards, transport, timeout=60)
        want = shards_from_full(full, specs, plan.dst, ctx.rank)
        bad = [n for n in want if not torch.equal(res.tensors[n], want[n])]
        if sorted(res.tensors) != sorted(want):
            bad.append("<set of tensors>")
        rows.append(
            {
                "seconds": res.seconds,
                "sent": res.bytes_sent,
                "local": res.bytes_local,
                "checked": sum(t.nbytes for t in want.values()),
                "bad": bad,
            }
        )
        shards = res.tensors
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the demo; return 0 when every byte matched."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4, help="local processes (even, >= 2)")
    parser.add_argument("--hidden", type=int, default=256, help="model width (multiple of 8)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.workers < 2 or args.workers % 2:
        parser.error("--workers must be an even number >= 2")
    if args.hidden < 8 or args.hidden % 8:
        parser.error("--hidden must be a multiple of 8")
    start = time.perf_counter()
    specs = transformer_state_specs(**model_shape(args.hidden))
    layouts = demo_layouts(args.workers)
    total = sum(s.nbytes for s in specs)
    print(
        f"state: {len(specs)} tensors, {total / 2**20:.1f} MiB "
        f"(bf16 weights, fp32 master + Adam moments) of a {NUM_LAYERS}-layer model"
    )
    plans = [plan_reshard(specs, a, b, NUM_LAYERS) for a, b in pairwise(layouts)]
    for plan in plans:
        print(f"plan {plan.src!r} -> {plan.dst!r}\n  {plan.stats!r}")
    with LocalWorkers(args.workers) as pool:
        started = time.perf_counter()
        print(f"{args.workers} workers up in {started - start:.1f} s")
        per_rank = pool.run(_worker, specs, layouts, args.seed)
    ok = True
    for step, plan in enumerate(plans):
        rows = [r[step] for r in per_rank]
        seconds = max(r["seconds"] for r in rows)
        sent = sum(r["sent"] for r in rows)
        bad = {rank: r["bad"] for rank, r in enumerate(rows) if r["bad"]}
        ok &= not bad and sent == plan.stats.total_bytes
        checked = sum(r["checked"] for r in rows)
        print(
            f"step {step + 1}: {plan.src!r} -> {plan.dst!r}: {seconds * 1e3:.1f} ms "
            f"(slowest rank), {sent / 2**20:.2f} MiB sent (plan: "
            f"{plan.stats.total_bytes / 2**20:.2f} MiB), {checked / 2**20:.2f} MiB of shards "
            f"{'all equal to the reference' if not bad else f'WRONG on ranks {bad}'}"
        )
    print(f"{'OK' if ok else 'FAILED'} in {time.perf_counter() - start:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
