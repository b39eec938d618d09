"""Instruction counts of bench_planner's unprepared quick sequence, call by call.

Each measured ``Planner.plan`` runs inside a ctypes callback, so that callgrind, told to
count only inside ``ffi_call``, dumps one profile per measured call::

    valgrind --tool=callgrind --collect-atstart=no \\
        --toggle-collect=ffi_call --dump-after=ffi_call \\
        python tools/planner_callgrind.py 32 12345 3 1
    grep -h ^totals callgrind.out.*.*

Arguments: devices, which calls of the sequence to measure (digits, 0-5), runs (a fresh
Planner and CostModel each), and the first run measured (the earlier ones warm the
process-wide caches, as the bench's first repeat does). Use the interpreter binary
itself (``python -c 'import sys; print(sys.executable)'``): valgrind does not follow a
shim script into its child.
"""

import ctypes
import sys

from nereus_rl.core.spec import cluster_preset
from nereus_rl.core.workload import make_workload
from nereus_rl.costmodel.costmodel import CostModel
from nereus_rl.planner.planner import Planner

# bench_planner.SIGNALS[:6]: (response bucket, devices lost, refine before the call)
SIGNALS = [
    (2048, 0, False),
    (4096, 0, False),
    (4096, 8, False),
    (1024, 8, False),
    (1024, 0, True),
    (2048, 0, False),
]


def main() -> None:
    n, which, runs = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    first = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    measured = ctypes.CFUNCTYPE(None)
    for run in range(runs):
        c = cluster_preset(f"h200x{n}")
        cm = CostModel(c)
        base = make_workload(
            "ppo", reward="llama-3.1-8b", batch=2 * n, prompt_len=1024, response_len=2048
        )
        planner = Planner(c, cm)
        for i, (resp, lost, refine) in enumerate(SIGNALS):
            w = base.with_response_len(resp)
            if refine:
                cm.observe_work({"gemm": 1.0, "mem": 0.5, "allreduce:intra": 0.1}, 3.1)

            def call(w=w, lost=lost, planner=planner):
                planner.plan(w, devices=range(n - lost))

            if run >= first and str(i) in which:
                measured(call)()
            else:
                call()


if __name__ == "__main__":
    main()
