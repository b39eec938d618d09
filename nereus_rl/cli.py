"""The ``nereus-rl`` command: ``train`` and ``worker``.

    nereus-rl train                 # GRPO on `sort`, 4 local CPU workers, adaptive
    nereus-rl train --quick         # the CI-sized variant (well under two minutes)
    nereus-rl train --algo ppo --steps 40 --no-adapt --run-dir runs/ppo
    nereus-rl worker --store HOST:PORT   # join a job whose driver listens there

A job with workers on other machines: start the driver with
``nereus-rl train --host 0.0.0.0 --port 29500 --local-workers 0 --devices 8`` and on each
machine ``nereus-rl worker --store DRIVER_HOST:29500`` (once per device).

nereus_comm on its own (resharding a model's state across local workers, as another
framework would use it) is shown by ``python examples/reshard_demo.py`` in the source tree.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

QUICK = {"steps": 8, "warm_steps": 100, "batch": 4, "group_size": 4}


def _progress_bar(total: int):
    start = time.perf_counter()

    def show(step: int, m: dict) -> None:
        done = step + 1
        width = 24
        fill = int(width * done / total)
        moved = " plan changed" if m.get("transition_s") else ""
        sys.stdout.write(
            f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{total} "
            f"reward {m['reward_mean']:.3f} kl {m['kl']:+.4f} len {m['response_len']} "
            f"step {m['step_s']:.2f}s ({time.perf_counter() - start:.0f}s){moved}   "
        )
        if done == total or moved:
            sys.stdout.write("\n")
        sys.stdout.flush()

    return show


def _train(args: argparse.Namespace) -> int:
    from nereus_rl.runtime import Driver
    from nereus_rl.trainer.config import check_local_devices
    from nereus_rl.trainer.report import summary_table
    from nereus_rl.trainer.trainer import TrainConfig, TrainConfigError, train

    options = dict(QUICK) if args.quick else {}
    for name in ("steps", "batch", "group_size", "lr", "trace", "plan", "admission", "device"):
        v = getattr(args, name)
        if v is not None:
            options[name] = v
    steps = options.pop("steps", 60)
    run_dir = args.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    driver = None
    try:
        if args.port is not None or args.local_workers is not None:
            driver = Driver(args.host, args.port or 0, heartbeat_timeout=30.0, call_timeout=600.0)
            local = args.devices if args.local_workers is None else args.local_workers
            if local:
                check_local_devices(TrainConfig(devices=local, device=args.device))
                driver.spawn_local(local)
            if local < args.devices:
                print(
                    f"waiting for {args.devices - local} workers: nereus-rl worker --store "
                    f"{driver.address}"
                )
                driver.wait_for_workers(args.devices, timeout=args.join_timeout)
        print(f"nereus-rl train: {args.algo} on {args.model}, task {args.task}, "
              f"{args.devices} devices, {steps} steps, run folder {run_dir}")  # fmt: skip
        result = train(
            algo=args.algo,
            model=args.model,
            task=args.task,
            devices=args.devices,
            steps=steps,
            adapt=not args.no_adapt,
            seed=args.seed,
            run_dir=run_dir,
            mode=args.mode,
            memory_budget=args.memory_budget,
            driver=driver,
            progress=_progress_bar(steps),
            **options,
        )
    except (TrainConfigError, ValueError) as e:
        print(f"nereus-rl train: {e}", file=sys.stderr)
        return 2
    finally:
        if driver is not None:
            driver.shutdown()
    print(summary_table(result))
    if result.error:
        print(f"nereus-rl train: stopped early: {result.error}", file=sys.stderr)
        return 1
    return 0


def _worker(rest: list[str]) -> int:
    from nereus_rl.runtime import worker

    return worker.main(rest)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``nereus-rl``."""
    ap = argparse.ArgumentParser(prog="nereus-rl", description="Elastic RL post-training.")
    sub = ap.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a policy (GRPO on `sort` by default)")
    t.add_argument("--algo", default="grpo", help="grpo, ppo or remax")
    t.add_argument("--model", default="tiny", help="model preset: tiny, small, medium, large")
    t.add_argument("--task", default="sort", help="bundled task: sort, reverse, addition")
    t.add_argument("--devices", type=int, default=4, help="worker processes (devices)")
    t.add_argument("--steps", type=int, default=None, help="RL steps (default 60; --quick 8)")
    t.add_argument("--mode", default="sync", help="sync, or async (rollout one step ahead)")
    t.add_argument("--no-adapt", action="store_true", help="keep the first plan")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--run-dir", type=Path, default=None, help="run folder (default runs/DATE)")
    t.add_argument("--memory-budget", type=int, default=None, help="bytes per worker")
    t.add_argument("--trace", default=None, help="response-length trace file (CSV or JSON)")
    t.add_argument("--plan", default=None, help="first plan: auto, colocated, disaggregated")
    t.add_argument("--admission", default=None, help="payback, or always (replan each trigger)")
    t.add_argument("--batch", type=int, default=None, help="prompts per step")
    t.add_argument("--group-size", type=int, default=None, help="GRPO responses per prompt")
    t.add_argument("--lr", type=float, default=None, help="learning rate")
    t.add_argument("--device", default="cpu", help="cpu, or cuda (one GPU per worker)")
    t.add_argument("--quick", action="store_true", help="a short run (CI)")
    t.add_argument("--host", default="127.0.0.1", help="address the job's store listens on")
    t.add_argument("--port", type=int, default=None, help="store port (for remote workers)")
    t.add_argument("--local-workers", type=int, default=None, help="workers to spawn here")
    t.add_argument("--join-timeout", type=float, default=300.0, help="seconds to wait for them")
    sub.add_parser("worker", help="a worker that joins a running job", add_help=False)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``nereus-rl``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "worker":
        return _worker(argv[1:])
    args = build_parser().parse_args(argv)
    return _train(args)


if __name__ == "__main__":
    sys.exit(main())
