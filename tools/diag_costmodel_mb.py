"""Is a bench_costmodel outlier the model's or the machine's? Interleaved 1-process steps.

bench_costmodel measures each plan for ~0.1 s per round, one plan after another, so a
plan's rounds sample the host's speed at different moments; on a shared VM the same step's
CPU time moves 1.5-2x between moments (other guests; no trace in /proc/stat). Here one
process pinned to core 0 cycles through a few tiny-preset plans many times, in a new
order each cycle, a warm-up step and ``--reps`` timed steps each: plans measured within
a second of each other see the same host speed, so their *ratios* (per cycle, then the
median over cycles) are what the model must reproduce, whatever the host does. Each
step is also split into its micro-batches' part and its optimizer part: the optimizer
step is the same work in every plan, so it doubles as a probe of the host's speed.

    python tools/diag_costmodel_mb.py --cycles 60 --json out.json   # ~2 min idle
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import numpy as np
import torch

from nereus_rl.models.model import Decoder, get_preset

BATCH = 8


def _step(model, opt, mbs) -> tuple[float, float]:
    """One training step: (micro-batches' CPU seconds, optimizer step's CPU seconds)."""
    vocab = model.config.vocab
    c0 = time.thread_time()
    for x in mbs:
        logits = model(x[:, :-1])
        torch.nn.functional.cross_entropy(
            logits.reshape(-1, vocab), x[:, 1:].reshape(-1)
        ).backward()
    c1 = time.thread_time()
    opt.step()
    opt.zero_grad(set_to_none=False)
    return c1 - c0, time.thread_time() - c1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=60)
    ap.add_argument("--reps", type=int, default=5, help="timed steps per plan per cycle")
    ap.add_argument("--plans", default="1x32,2x32,4x32,8x32,4x64,8x64", help="mb x seq, ...")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    plans = [tuple(int(v) for v in p.split("x")) for p in args.plans.split(",")]
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    model = Decoder(get_preset("tiny"), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    gen = torch.Generator().manual_seed(0)
    data = {
        (mb, seq): [
            d[i : i + mb]
            for d in [torch.randint(0, model.config.vocab, (BATCH, seq + 1), generator=gen)]
            for i in range(0, BATCH, mb)
        ]
        for mb, seq in plans
    }
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    # per plan, per cycle: (fastest micro-batches part, fastest optimizer part), ms
    got: dict = {p: [] for p in plans}
    for cyc in range(args.cycles):
        order = list(plans)
        random.Random(cyc).shuffle(order)
        for p in order:
            _step(model, opt, data[p])  # warm-up
            parts = np.array([_step(model, opt, data[p]) for _ in range(args.reps)])
            got[p].append((1e3 * parts[:, 0].min(), 1e3 * parts[:, 1].min()))
    load1 = os.getloadavg()
    arr = {p: np.array(v) for p, v in got.items()}
    ref = plans[0]
    took = time.perf_counter() - t0
    print(f"{args.cycles} cycles x {len(plans)} plans x {args.reps} reps, {took:.0f} s")
    print(f"load average (1 min) start/end: {load0[0]:.2f} {load1[0]:.2f}")
    print(
        f"{'mb':>3} {'seq':>4} {'step_ms med':>11} {'p25':>6} {'p75':>6} {'opt_ms med':>10} "
        f"{'mb-part/opt':>11} {'step/ref med':>12} {'IQR':>13}"
    )
    out = []
    for p in plans:
        a = arr[p]
        step = a.sum(axis=1)
        ratio = step / arr[ref].sum(axis=1)  # same cycle: same host speed
        q = np.percentile(step, [25, 50, 75])
        rq = np.percentile(ratio, [25, 50, 75])
        print(
            f"{p[0]:>3} {p[1]:>4} {q[1]:>11.2f} {q[0]:>6.2f} {q[2]:>6.2f} "
            f"{np.median(a[:, 1]):>10.2f} {np.median(a[:, 0] / a[:, 1]):>11.2f} "
            f"{rq[1]:>12.3f} {rq[0]:>6.3f}-{rq[2]:.3f}"
        )
        out.append(
            {
                "micro_batch": p[0],
                "seq_len": p[1],
                "step_ms": step.tolist(),
                "opt_ms": a[:, 1].tolist(),
                "ratio_to_ref_median": float(rq[1]),
            }
        )
    corr = np.corrcoef(
        np.concatenate([arr[p][:, 0] / np.median(arr[p][:, 0]) for p in plans]),
        np.concatenate([arr[p][:, 1] / np.median(arr[p][:, 1]) for p in plans]),
    )
    print(f"correlation of a cycle's micro-batch part with its optimizer part: {corr[0, 1]:.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "plans": out,
                    "ref": list(ref),
                    "loadavg": [load0, load1],
                    "cycles": args.cycles,
                    "reps": args.reps,
                },
                fh,
                indent=1,
            )


if __name__ == "__main__":
    main()
