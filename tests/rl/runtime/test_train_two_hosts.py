"""The trainer with workers on two hosts: two network namespaces joined by a veth pair.

The driver runs in the first namespace (its store and liveness listener on that
namespace's address) and spawns two local workers there; two more join from the
second namespace as an operator starts them on another machine (``nereus-rl worker
--store ADDR:PORT --secret-file PATH``). gloo binds each namespace's veth end (see
tests/support/netns.py), and between the namespaces nereus_comm sees two hosts: the
models' collectives run over gloo, the weight sync's reshard over the socket route's
TCP streams (route "auto"), no shared memory or cross-memory attach.

A fixed plan over the four devices, its stages across both hosts, no adaptation:
the run must match, step for step, a local run with the same seed (training on CPU
is deterministic), and both hosts' workers must hold devices of the plan.

Run as a script (``--driver ADDRESS``), this file is the driver's side.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

QUICK = {"warm_steps": 30, "batch": 4, "group_size": 4}


def _opts() -> dict:
    """The run's options: a fixed plan whose stages straddle the hosts (workers 0 and 1
    on the first, 2 and 3 on the second): actor_train's dp pair (its gradient
    all-reduce) and the weight sync to rollout cross between them."""
    from nereus_rl.core.globalplan import GlobalPlan, StagePlan

    def stage(name: str, model: str, trains: bool, devices: tuple[int, ...]) -> StagePlan:
        return StagePlan(name, model, trains, len(devices), 1, 1, tuple((d,) for d in devices))

    plan = GlobalPlan((
        stage("rollout", "actor", False, (2, 3)),
        stage("reference", "reference", False, (1, 3)),
        stage("actor_train", "actor", True, (0, 2)),
    ))  # fmt: skip
    return dict(devices=4, steps=3, adapt=False, seed=0, calibration_probes=0, plan=plan, **QUICK)


def _summary(res, device_worker: dict[int, int] | None = None) -> dict:
    return {
        "error": res.error,
        "rewards": res.rewards,
        "loss": [m["loss"] for m in res.metrics],
        "kl": [m["kl"] for m in res.metrics],
        # per step that ran a weight sync (the last one runs none)
        "sync_net": [m["sync_bytes_net"] for m in res.metrics if "sync_bytes_net" in m],
        "plan": repr(res.plans[-1][1]) if res.plans else None,
        "devices": sorted(res.plans[-1][1].devices) if res.plans else [],
        "device_worker": {str(k): v for k, v in (device_worker or {}).items()},
    }


def _driver_main(host: str) -> None:
    """The driver's side: print the store's address, wait for two joiners, train."""
    from nereus_rl.runtime.driver import Driver
    from nereus_rl.trainer.config import TrainConfig
    from nereus_rl.trainer.trainer import Trainer

    driver = Driver(host=host, heartbeat_timeout=10.0, call_timeout=120.0)
    try:
        driver.spawn_local(2)
        print(json.dumps({"address": driver.address, "secret_file": str(driver.secret_file)}))
        sys.stdout.flush()
        driver.wait_for_workers(4, timeout=120)
        tr = Trainer(TrainConfig(**_opts()), driver=driver)
        try:
            tr.start()
            res = tr.run()
            device_worker = dict(tr.device_worker)
        finally:
            tr.close()
        print(json.dumps(_summary(res, device_worker)), flush=True)
    finally:
        driver.shutdown()


@pytest.mark.slow
def test_trainer_runs_with_workers_on_two_hosts_and_matches_the_local_run():
    from support.netns import netns_unavailable, two_hosts

    from nereus_rl import train

    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    with two_hosts() as hosts:
        driver = hosts.popen(
            0,
            [sys.executable, __file__, "--driver", hosts.addresses[0]],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        joiners = []
        try:
            first = json.loads(driver.stdout.readline())
            assert first["address"].startswith(hosts.addresses[0] + ":"), first
            for _ in range(2):
                joiners.append(
                    hosts.popen(
                        1,
                        [
                            sys.executable,
                            "-m",
                            "nereus_rl.cli",
                            "worker",
                            "--store",
                            first["address"],
                            "--secret-file",
                            first["secret_file"],
                        ],
                        stdout=subprocess.DEVNULL,
                    )
                )
            out, err = driver.communicate(timeout=480)
            assert driver.returncode == 0, err[-4000:]
            remote = json.loads(out.strip().splitlines()[-1])
            for j in joiners:
                j.wait(timeout=30)  # they leave when the driver shuts down
        finally:
            for p in (driver, *joiners):
                if p.poll() is None:
                    p.kill()
                    p.wait()
    assert remote["error"] is None, remote["error"]
    # Workers 2 and 3 joined from the other namespace; all four hold devices of the plan.
    assert remote["devices"] == [0, 1, 2, 3], remote
    assert sorted(remote["device_worker"].values()) == [0, 1, 2, 3], remote
    local = _summary(train(**_opts()))
    assert local["error"] is None, local["error"]
    assert remote["plan"] == local["plan"]
    assert remote["rewards"] == local["rewards"]
    assert remote["loss"] == local["loss"]
    assert remote["kl"] == local["kl"]
    # The weight sync crosses the hosts (actor_train on 0 and 2, rollout on 2 and 3):
    # those bytes took the socket route there; on one host none did.
    assert remote["sync_net"] and all(n > 0 for n in remote["sync_net"]), remote["sync_net"]
    assert local["sync_net"] and not any(local["sync_net"]), local["sync_net"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--driver", required=True, metavar="ADDRESS", help="the store's address")
    args = ap.parse_args()
    _driver_main(args.driver)


if __name__ == "__main__":
    main()
