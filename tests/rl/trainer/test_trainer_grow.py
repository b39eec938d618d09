"""Devices arriving during a run (``max_devices``): workers that join a running job are
admitted at the next boundary, the devices signal fires, and the planner's move onto
them runs as live EMU primitives (Extend), with no worker lost and no state reloaded.
"""

from __future__ import annotations

import os

import pytest
import torch
from support.joiner import reap, start_joiner
from support.ray_cluster import loopback_ray_cluster
from test_trainer_recovery import _plan

from nereus_rl.runtime import Driver
from nereus_rl.trainer.config import TrainConfig, TrainConfigError, check_config
from nereus_rl.trainer.trainer import Trainer

# Ray reads these when it is imported (loopback address resolution, no usage stats): set
# before anything imports it, as tests/rl/runtime/test_ray_runtime.py does.
os.environ.update({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"})
FAST = {"warm_steps": 30, "batch": 4, "group_size": 2, "calibration_probes": 0}


P2 = _plan((0, 1), (0, 1), (0, 1))
# after the arrivals: rollout and reference on the new devices 2 and 3
P4 = _plan((2, 3), (3, 2), (0, 1))


def _force_p4(ranked):
    """The adapter's ranked_plans with the planner's choice made certain: P4 once four
    devices are held, else P2 (a pinned plan's boundary searches over devices)."""

    def ranked_plans(rlen, devices=None, k=64):
        if devices is None:
            return ranked(rlen, devices, k)
        return [(0.0, P4)] if set(devices) >= {0, 1, 2, 3} else [(1.0, P2)]

    return ranked_plans


def test_max_devices_below_devices_is_refused_before_any_process_starts():
    with pytest.raises(TrainConfigError, match="max_devices"):
        check_config(TrainConfig(devices=4, max_devices=2))
    assert TrainConfig(devices=4).device_cap == 4
    assert TrainConfig(devices=4, max_devices=6).device_cap == 6


def test_the_cost_model_spans_max_devices_and_plans_over_the_devices_held():
    cfg = TrainConfig(devices=2, max_devices=4, steps=2, **FAST)
    tr = Trainer(cfg, driver=Driver())
    try:
        assert tr.adapter.cluster.num_devices == 4
        # no worker yet: the first plan uses the two configured devices only
        assert tr.first_plan.devices <= {0, 1}
        assert tr.adapter._devices() == [0, 1]
    finally:
        tr.driver.shutdown()


def test_worker_cores_prices_each_worker_at_its_own_cores():
    with pytest.raises(TrainConfigError, match=r"worker_cores=1.5 must be a share of a core"):
        check_config(TrainConfig(devices=4, worker_cores=1.5))
    cfg = TrainConfig(devices=2, max_devices=8, steps=2, worker_cores=0.25, **FAST)
    tr = Trainer(cfg, driver=Driver())
    try:
        cluster = tr.adapter.cluster
        # eight quarter cores: what arrivals add is theirs, whatever this machine has
        assert cluster.capped and cluster.cores == 2.0 and cluster.num_devices == 8
    finally:
        tr.driver.shutdown()


@pytest.mark.slow
def test_workers_joining_a_running_job_are_extended_onto():
    # Two workers run the job; two more join after step 0 (one spawned by the driver, one
    # started by hand as `nereus-rl worker --store`). At step 1's boundary they are
    # admitted (devices 2 and 3), the devices signal fires, and the move the planner
    # chooses onto them runs as live Extends; every unit then holds its stage's state.
    cfg = TrainConfig(
        steps=3,
        devices=2,
        max_devices=4,
        plan=P2,
        admission="always",
        seed=3,
        memory_budget=2**30,
        length_start=8,
        length_end=8,
        **FAST,
    )
    joiner = None
    driver = Driver(heartbeat_timeout=60.0, call_timeout=300.0)
    try:
        driver.spawn_local(2, method="forkserver")
        tr = Trainer(cfg, driver=driver)
        try:
            tr.start()
            assert sorted(tr.device_worker) == [0, 1]
            tr.adapter.ranked_plans = _force_p4(tr.adapter.ranked_plans)

            def progress(step, m):
                nonlocal joiner
                if step == 0:
                    driver.spawn_local(1, method="forkserver")
                    joiner = start_joiner(driver.address)
                    driver.wait_for_workers(4, timeout=60)

            tr.progress = progress
            res = tr.run()
            states = {}
            for u in tr.units.emus.units():
                got = tr.units.emus.full_state(u)
                ref = states.setdefault(u.stage, got)
                for name, t in ref.items():
                    assert torch.equal(got[name], t), f"{u!r} differs on {name}"
            device_worker = dict(tr.device_worker)
        finally:
            tr.close()
    finally:
        driver.shutdown()
        reap(joiner)
    assert res.error is None, res.error
    assert [m["step"] for m in res.metrics] == [0, 1, 2]
    assert sorted(device_worker) == [0, 1, 2, 3]
    (grow,) = [d for d in res.decisions if d.get("path") == "grow"]
    assert grow["step"] == 1 and sorted(grow["joined"]) == ["2", "3"], grow
    moves = [d for d in res.decisions if d.get("taken") and d["signal"] == "devices"]
    assert moves and "gained 2 device(s) [2, 3]" in moves[0]["trigger"], res.decisions
    assert any(p.startswith("extend:") for p in moves[0]["executed_primitives"]), moves[0]
    assert not moves[0].get("fallback_stages"), moves[0]
    assert res.plans[-1] == (2, P4)
    assert res.metrics[1]["grow_s"] > 0 and res.metrics[2]["num_devices"] == 4


# ---------------------------------------------------------------- on a Ray cluster


@pytest.fixture
def ray_cluster():
    """A loopback ray.cluster_utils.Cluster: a head without CPUs and one node of 2."""
    pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[ray]')")
    with loopback_ray_cluster(nodes=1) as c:
        yield c


@pytest.mark.slow
def test_a_node_added_to_the_ray_cluster_is_extended_onto(ray_cluster):
    # One node of 2 runs the job; a second node of 2 joins the cluster after step 0. The
    # boundary after step 1 places two actors on it (RayDriver.place_arrivals), the one
    # after step 2 admits them (devices 2 and 3), and the planner's move onto them runs
    # as live Extends.
    from nereus_rl.runtime.ray_runtime import RayDriver

    cfg = TrainConfig(
        steps=4, devices=2, max_devices=4, plan=P2, admission="always", seed=3,
        memory_budget=2**30, length_start=8, length_end=8, launcher="ray", **FAST,
    )  # fmt: skip
    tr = Trainer(cfg)
    try:
        tr.start()
        driver = tr.driver
        assert isinstance(driver, RayDriver)
        tr.adapter.ranked_plans = _force_p4(tr.adapter.ranked_plans)
        first_node = {driver.node_of[w] for w in tr.workers}

        def progress(step, m):
            if step == 0:
                ray_cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1")
                ray_cluster.wait_for_nodes()
            elif step == 1:
                driver.wait_arrivals(120)  # placed at step 1's boundary

        tr.progress = progress
        res = tr.run()
        nodes = {d: driver.node_of[w] for d, w in tr.device_worker.items()}
        assert not driver.arrival_errors, driver.arrival_errors
    finally:
        tr.close()
    assert res.error is None, res.error
    assert [m["step"] for m in res.metrics] == [0, 1, 2, 3]
    (grow,) = [d for d in res.decisions if d.get("path") == "grow"]
    assert grow["step"] == 2 and sorted(grow["joined"]) == ["2", "3"], grow
    assert {nodes[2], nodes[3]}.isdisjoint(first_node) and nodes[2] == nodes[3]
    (move,) = [d for d in res.decisions if d.get("taken")]
    assert move["step"] == 2 and "gained 2 device(s) [2, 3]" in move["trigger"], move
    assert any(p.startswith("extend:") for p in move["executed_primitives"]), move
    assert res.plans[-1] == (3, P4)
