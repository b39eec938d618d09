"""bench_costmodel's measuring: worker processes, rounds over the grid, repetitions.

bench_costmodel.py scores what this measures (its docstring gives the protocol). A plan
is ``(preset, micro_batch, seq_len, layout)``; ``LAYOUTS`` maps a layout to (processes,
workers per core, the core of each process). Each repetition of a plan records, per
process, its wall and CPU seconds, the CPU seconds of each part of the step (each
micro-batch's forward + backward, then the optimizer step, which is the same work in
every plan of a preset and layout and so also tells how fast the host ran in that
round), the steal ticks of its core (/proc/stat), its involuntary context switches and
the runnable tasks at its ends (/proc/loadavg). On a shared virtual machine identical
work takes 1x-2x its fastest CPU time from one repetition to the next, and the
slow-downs that matter last longer than a repetition and leave no trace in these
counters: hence rounds, and the median over them.
"""

from __future__ import annotations

import functools
import os
import random
import resource
import time

import numpy as np
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from nereus_rl.models.model import Decoder, get_preset

BATCH = 8
MIN_REPS = 2  # timed repetitions of a plan per round, at least
LAYOUTS = {"1p": (1, 1.0, [0]), "2p-2core": (2, 1.0, [0, 1]), "2p-1core": (2, 2.0, [0, 0])}


def train_step(model, opt, mbs) -> list[float]:
    """One training step of the project's model: forward + backward per micro-batch, AdamW.

    Returns the thread CPU time at the end of each part (each micro-batch's forward +
    backward, then the optimizer step), so a step can be timed part by part.
    """
    vocab = model.config.vocab
    ends = []
    for x in mbs:
        logits = model(x[:, :-1])
        F.cross_entropy(logits.reshape(-1, vocab), x[:, 1:].reshape(-1)).backward()
        ends.append(time.thread_time())
    opt.step()
    opt.zero_grad(set_to_none=False)
    ends.append(time.thread_time())
    return ends


def steal_ticks(core: int) -> int:
    """Hypervisor steal of one CPU so far, in USER_HZ ticks (/proc/stat ``cpuN``, 8th value)."""
    with open("/proc/stat") as fh:
        for line in fh:
            if line.startswith(f"cpu{core} "):
                return int(line.split()[8])
    return 0


def running() -> int:
    """Runnable tasks on the machine now (/proc/loadavg's 4th field, the reader included)."""
    with open("/proc/loadavg") as fh:
        return int(fh.read().split()[3].split("/")[0])


def _worker(rank, tasks, results, barrier):
    torch.set_num_threads(1)
    cache = {}
    while True:
        task = tasks.get()
        if task is None:
            return
        preset, b, mb, seq, core = task
        os.sched_setaffinity(0, {core})
        if preset not in cache:
            model = Decoder(get_preset(preset), seed=0)
            cache[preset] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False))
        model, opt = cache[preset]
        gen = torch.Generator().manual_seed(rank)
        # +1 token: the model sees seq tokens and predicts the next of each.
        data = torch.randint(0, model.config.vocab, (b, seq + 1), generator=gen)
        mbs = [data[i : i + mb] for i in range(0, b, mb)]

        step = functools.partial(train_step, model, opt, mbs)
        c0 = time.thread_time()
        step()  # warm-up; its CPU time tells the parent how many repetitions fit
        results.put((rank, time.thread_time() - c0))
        reps = tasks.get()
        out = []
        for _ in range(reps):
            if barrier is not None:
                barrier.wait()  # both processes compute at the same time, every repetition
            run0, st0 = running(), steal_ticks(core)
            ivcsw0 = resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw
            t0, c0 = time.perf_counter(), time.thread_time()
            ends = step()
            wall = time.perf_counter() - t0
            ivcsw = resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw - ivcsw0
            steal = steal_ticks(core) - st0
            parts = np.diff([c0, *ends]).tolist()
            out.append((wall, ends[-1] - c0, parts, steal, ivcsw, max(run0, running())))
        results.put((rank, out))


def measure(grid, rounds, budget_s, max_reps):
    """Every repetition of every plan of ``grid``, per plan in grid order.

    Each round visits the plans in its own seeded order. Each plan gets, in each round,
    a warm-up step and then as many timed repetitions as
    fit ``budget_s`` of wall time at its warm-up speed (at least ``MIN_REPS``, at most
    ``max_reps``). A repetition is a dict: wall and CPU seconds and the CPU seconds of
    each part (for two processes the slower process's, per repetition and part: both
    start it together at a barrier), the round, and whether it was clean.
    """
    ctx = mp.get_context("spawn")
    tasks = [ctx.Queue() for _ in range(2)]
    results = ctx.Queue()
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_worker, args=(r, tasks[r], results, barrier)) for r in range(2)]
    solo_tasks, solo_res = ctx.Queue(), ctx.Queue()
    solo = ctx.Process(target=_worker, args=(0, solo_tasks, solo_res, None))
    for p in [*procs, solo]:
        p.start()
    plans = [
        (preset, mb, seq, lay)
        for preset, (mbs, seqs) in grid.items()
        for mb in mbs
        for seq in seqs
        for lay in LAYOUTS
    ]
    reps_of = {p: [] for p in plans}
    try:
        for rnd in range(rounds):
            order = list(plans)
            random.Random(rnd).shuffle(order)  # seeded: the same orders in every run
            for plan in order:
                preset, mb, seq, lay = plan
                dp, wpc, cores = LAYOUTS[lay]
                b = BATCH // dp
                qs, res = ([solo_tasks], solo_res) if dp == 1 else (tasks, results)
                for r, q in enumerate(qs):
                    q.put((preset, b, min(mb, b), seq, cores[r]))
                warm = max(res.get()[1] for _ in qs)
                # Time-slicing one core: each repetition takes about wpc x its CPU time.
                n = int(min(max_reps, max(MIN_REPS, budget_s / (warm * wpc))))
                for q in qs:
                    q.put(n)
                got = [g[1] for g in sorted(res.get() for _ in qs)]
                for i in range(n):
                    per = [g[i] for g in got]  # (wall, cpu, parts, steal, ivcsw, running)
                    # Clean: no steal on the cores used, no other task runnable at either
                    # end, and (a worker per core) never preempted. Two workers on one
                    # core preempt each other, which is the layout, not noise.
                    clean = (
                        all(x[3] == 0 for x in per)
                        and max(x[5] for x in per) <= dp
                        and (wpc > 1 or all(x[4] == 0 for x in per))
                    )
                    reps_of[plan].append(
                        {
                            "round": rnd,
                            "wall": max(x[0] for x in per),
                            "cpu": max(x[1] for x in per),
                            "parts": np.max([x[2] for x in per], axis=0).tolist(),
                            "cpu_each": [x[1] for x in per],
                            "parts_each": [x[2] for x in per],
                            "clean": bool(clean),
                            "steal": max(x[3] for x in per),
                            "preempted": max(x[4] for x in per),
                            "running": max(x[5] for x in per),
                        }
                    )
    finally:
        for q in [*tasks, solo_tasks]:
            q.put(None)
        for p in [*procs, solo]:
            p.join(timeout=30)
    return [(plan, reps_of[plan]) for plan in plans]
