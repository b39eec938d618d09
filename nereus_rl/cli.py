"""The ``nereus-rl`` command: ``train`` and ``worker``.

    nereus-rl train                 # GRPO on `sort`, 4 local CPU workers, adaptive
    nereus-rl train --quick         # the CI-sized variant (well under two minutes)
    nereus-rl train --algo ppo --steps 40 --no-adapt --run-dir runs/ppo
    nereus-rl train --model PATH --data FILE --reward numeric --save-every 10
                                    # a Hugging Face folder on a JSONL/Parquet dataset
    nereus-rl worker --store HOST:PORT --secret-file PATH   # join a running job

The job's store listens on 127.0.0.1 only unless --host names another address. A job
with workers on other machines: start the driver with
``nereus-rl train --host ADDR --port 29500 --local-workers 0 --devices 8``, ADDR being
this machine's address on a private network that only the job's machines reach, copy
the secret file it prints (mode 0600) to each machine, and there run
``nereus-rl worker --store ADDR:29500 --secret-file PATH`` once per device. What an
exposed address means: anyone who can reach the port can disrupt the job (its store
has no access control of its own), and whoever holds the secret file can run code on
every worker. Every control message is checked against the secret, so nobody without
it can.

nereus_comm on its own (resharding a model's state across local workers, as another
framework would use it) is shown by ``python examples/reshard_demo.py`` in the source tree.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
import time
from pathlib import Path

QUICK = {"steps": 8, "warm_steps": 100, "batch": 4, "group_size": 4}

#: The address the job's store listens on unless --host names another.
HOST_DEFAULT = "127.0.0.1"

#: Local worker processes per core beyond which a run is refused without
#: --allow-oversubscribe. Each worker is a whole torch process time-sliced on the
#: cores; past four per core each gets under a quarter of a core, so heartbeats and
#: gloo collectives starve into timeouts, start-up alone takes minutes, and the cost
#: model's fixed share of a core per worker no longer describes the machine.
MAX_WORKERS_PER_CORE = 4

EXPOSED_WARNING = (
    "the job's store listens on {host}, not loopback: anyone who can reach port {port} "
    "there can disrupt the job, and whoever holds the secret file can run code on its "
    "workers; use an address of a private network that only the job's machines reach"
)


class CliError(ValueError):
    """A command-line argument is unusable; the message says which and what to do."""


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:  # a name: loopback if every address it resolves to is
            addrs = {i[4][0] for i in socket.getaddrinfo(host, None)}
        except OSError:
            return False
        return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def _check_run_dir(run_dir: Path) -> None:
    """Raise CliError unless ``run_dir`` is (or can be made) a writable folder."""
    if run_dir.exists():
        if not run_dir.is_dir():
            raise CliError(f"--run-dir {run_dir} is a file, not a folder; name a folder")
        if not os.access(run_dir, os.W_OK | os.X_OK):
            raise CliError(f"--run-dir {run_dir} is not writable by this user; name another")
        return
    parent = run_dir.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise CliError(f"--run-dir {run_dir} cannot be made: {parent} is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CliError(f"--run-dir {run_dir} cannot be made: {parent} is not writable")


def check_args(args: argparse.Namespace) -> None:
    """Check what the train command's arguments ask of this machine, before anything starts.

    Raises:
        CliError: an unusable run folder, more local workers than the machine can
            hold (without --allow-oversubscribe), or bad worker, port or timeout figures.
    """
    if args.run_dir is not None:
        _check_run_dir(args.run_dir)
    if args.port is not None and not 0 <= args.port <= 65535:
        raise CliError(f"--port {args.port} is not a port; use 1..65535, or 0 for any free one")
    if args.join_timeout <= 0:
        raise CliError(f"--join-timeout {args.join_timeout:g} must be positive seconds")
    if args.ray is not None and (args.port is not None or args.local_workers is not None):
        raise CliError(
            "--ray places the workers as Ray actors: leave out --port and --local-workers "
            "(they are for workers started by hand with nereus-rl worker)"
        )
    if args.local_workers is not None and not 0 <= args.local_workers <= args.devices:
        raise CliError(
            f"--local-workers {args.local_workers} must be between 0 and --devices "
            f"({args.devices}); the others join with nereus-rl worker"
        )
    local = args.devices if args.local_workers is None else args.local_workers
    if args.ray:
        local = 0  # on an existing cluster's nodes (a bare --ray: a Ray on this machine)
    cores = os.cpu_count() or 1
    limit = MAX_WORKERS_PER_CORE * cores
    if local > limit and not args.allow_oversubscribe:
        raise CliError(
            f"{local} local workers on {cores} cores is more than {MAX_WORKERS_PER_CORE} per "
            f"core ({limit}); each is a whole process, and past that they starve each other "
            "into timeouts. Use --devices <= "
            f"{limit}, start workers on other machines (--local-workers), or pass "
            "--allow-oversubscribe"
        )


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
    from nereus_rl.data.datasets import OptionalDependencyError
    from nereus_rl.runtime import Driver
    from nereus_rl.trainer.config import check_config, check_local_devices
    from nereus_rl.trainer.report import summary_table
    from nereus_rl.trainer.trainer import TrainConfig, TrainConfigError, run_prompts, train

    options = dict(QUICK) if args.quick else {}
    for name in (
        "steps", "batch", "group_size", "lr", "trace", "plan", "admission", "device", "nodes",
        "max_devices", "worker_cores",
        "checkpoint_every", "resume", "heartbeat_timeout", "data", "tokenizer", "save_every",
        "prompt_field", "answer_field",
    ):  # fmt: skip
        v = getattr(args, name)
        if v is not None:
            options[name] = v
    if args.no_mirror:
        options["mirror"] = False
    if args.ray is not None:
        options["launcher"] = "ray"
        options["ray_address"] = args.ray or None
    if args.wandb:
        options["wandb"] = True
    if args.reward is not None:
        options["reward_fn"] = args.reward
    if args.length is not None:
        options["length_start"] = options["length_end"] = args.length
    steps = options.pop("steps", 60)
    run_dir = args.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    local = args.devices if args.local_workers is None else args.local_workers
    if args.ray is not None:
        local = 0  # none on this machine: Ray places them
    try:
        # Every argument is checked here, before the banner and before any process starts.
        check_args(args)
        cfg = TrainConfig(
            algo=args.algo, model=args.model, task=args.task, devices=args.devices,
            steps=steps, adapt=not args.no_adapt, seed=args.seed, mode=args.mode,
            memory_budget=args.memory_budget, **options,
        )  # fmt: skip
        # the dataset, tokenizer and reward function too, before any process starts
        run_prompts(cfg, check_config(cfg))
        if local:
            check_local_devices(TrainConfig(devices=local, device=args.device))
    except (TrainConfigError, ValueError, OptionalDependencyError) as e:
        print(f"nereus-rl train: {e}", file=sys.stderr)
        return 2
    driver = None
    try:
        # A --host of its own (workers to join there) needs the store this driver makes;
        # with --ray the trainer starts its own.
        own_host = args.host != HOST_DEFAULT and args.ray is None
        if args.port is not None or args.local_workers is not None or own_host:
            driver = Driver(
                args.host, args.port or 0, heartbeat_timeout=args.heartbeat_timeout or 30.0,
                call_timeout=600.0,
            )  # fmt: skip
            if not _is_loopback(args.host):
                warning = EXPOSED_WARNING.format(host=args.host, port=driver.port)
                print(f"nereus-rl train: warning: {warning}", file=sys.stderr)
            if local:
                driver.spawn_local(local)
            if local < args.devices:
                print(
                    f"waiting for {args.devices - local} workers: nereus-rl worker --store "
                    f"{driver.address} --secret-file {driver.secret_file} (copy the file, mode "
                    "0600, to each worker's machine; whoever holds it can run code on the job)"
                )
                driver.wait_for_workers(args.devices, timeout=args.join_timeout)
        what = f"data {args.data}" if args.data else f"task {args.task}"
        print(f"nereus-rl train: {args.algo} on {args.model}, {what}, "
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
    except (TrainConfigError, ValueError, OptionalDependencyError) as e:
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
    t.add_argument(
        "--model", default="tiny",
        help="model preset (tiny, small, medium, large) or a Hugging Face folder's path",
    )  # fmt: skip
    t.add_argument("--task", default="sort", help="bundled task: sort, reverse, addition")
    t.add_argument(
        "--data", default=None, metavar="FILE",
        help="prompt dataset (JSONL or Parquet, fields prompt and answer) instead of --task",
    )  # fmt: skip
    t.add_argument(
        "--reward", default=None, metavar="NAME|module:function",
        help="reward of --data: numeric, exact, format, module:function or file.py:function",
    )  # fmt: skip
    t.add_argument(
        "--tokenizer", default=None, metavar="FOLDER",
        help="tokenizer folder for --data (default: the --model folder)",
    )  # fmt: skip
    t.add_argument("--prompt-field", default=None, help="the dataset's prompt field (prompt)")
    t.add_argument("--answer-field", default=None, help="the dataset's answer field (answer)")
    t.add_argument(
        "--length", type=int, default=None, metavar="N",
        help="response length limit of every step (default: a curriculum from 6 to 14)",
    )  # fmt: skip
    t.add_argument(
        "--save-every", type=int, default=None, metavar="N",
        help="also write the policy (and critic) as Hugging Face folders every N steps",
    )  # fmt: skip
    t.add_argument(
        "--wandb", action="store_true",
        help="also log to Weights & Biases (needs wandb; WANDB_MODE=offline keeps it local)",
    )  # fmt: skip
    t.add_argument("--devices", type=int, default=4, help="worker processes (devices)")
    t.add_argument(
        "--max-devices", type=int, default=None, metavar="N",
        help="grow onto workers that join while the run goes (nereus-rl worker, new Ray "
        "nodes) up to N devices (default: --devices, no growth)",
    )  # fmt: skip
    t.add_argument(
        "--worker-cores", type=float, default=None, metavar="C",
        help="CPU cores each worker has of its own (a quota per worker, at most 1), for the "
        "cost model (default: the workers share this machine's cores)",
    )  # fmt: skip
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
    t.add_argument(
        "--nodes", type=int, default=None,
        help="failure domains the devices split into (mirrors go to another node)",
    )  # fmt: skip
    t.add_argument(
        "--heartbeat-timeout", type=float, default=None, metavar="S",
        help="seconds without a heartbeat before a joined worker counts as dead (30)",
    )  # fmt: skip
    t.add_argument(
        "--checkpoint-every", type=int, default=None, metavar="N",
        help="also write the in-memory snapshot to the run folder every N steps",
    )  # fmt: skip
    t.add_argument(
        "--resume", default=None, metavar="PATH",
        help="start from a checkpoint.pt a run wrote (its states and the step after its own; "
        "the same options continue that run exactly)",
    )  # fmt: skip
    t.add_argument(
        "--no-mirror", action="store_true",
        help="keep no in-memory snapshot (a worker death may then lose the run)",
    )  # fmt: skip
    t.add_argument("--quick", action="store_true", help="a short run (CI)")
    t.add_argument(
        "--host",
        default=HOST_DEFAULT,
        help="the only address the job's store listens on (default loopback). Another one "
        "lets anyone who can reach the port disrupt the job, and whoever holds the secret "
        "file run code on its workers: use a private network's address",
    )
    t.add_argument(
        "--ray", nargs="?", const="", default=None, metavar="ADDRESS",
        help="run the workers as Ray actors, one per device: on a new local Ray on loopback "
        "(no ADDRESS), the cluster this machine belongs to (auto), or HOST:PORT",
    )  # fmt: skip
    t.add_argument("--port", type=int, default=None, help="store port (for remote workers)")
    t.add_argument("--local-workers", type=int, default=None, help="workers to spawn here")
    t.add_argument("--join-timeout", type=float, default=300.0, help="seconds to wait for them")
    t.add_argument(
        "--allow-oversubscribe",
        action="store_true",
        help=f"spawn more than {MAX_WORKERS_PER_CORE} local workers per core anyway",
    )
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
