"""The Ray runtime (nereus_rl.runtime.ray_runtime): the runtime interface on Ray actors,
the trainer launched on Ray, and a node lost mid-run.

Every Ray here stays on loopback: one small ray.cluster_utils.Cluster per module (a
head without CPUs and two nodes of 2 logical CPUs), every node at 127.0.0.1, with
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (else Ray's address resolution may switch to the
machine's external address), no dashboard and no usage stats. A test checks that no
Ray process listens outside loopback, and the fixture checks that no Ray process is
left behind.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

# Ray reads these when it is imported (RAY_ENV: loopback address resolution, no usage
# stats); harmless to the other tests.
os.environ.update({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"})
ray = pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[ray]')")


from support.ray_cluster import loopback_ray_cluster  # noqa: E402

from nereus_rl.cli import main as cli_main  # noqa: E402
from nereus_rl.runtime import RemoteError, Runtime, WorkerLostError  # noqa: E402
from nereus_rl.runtime.ray_runtime import NODE_POLL_S, RayDriver  # noqa: E402
from nereus_rl.trainer.trainer import (  # noqa: E402
    TrainConfig,
    TrainConfigError,
    Trainer,
    simple_plan,
    train,
)

#: The CLI's --quick batch and group size (nereus_rl.cli.QUICK); a 30-step warm start (as
#: tests/rl/trainer/test_trainer.py's, whose cached warm start it shares), not 100.
QUICK = {"warm_steps": 30, "batch": 4, "group_size": 4}
LOOPBACK = ("127.0.0.1", "[::ffff:127.0.0.1]", "::ffff:127.0.0.1")


def _descendants() -> dict[int, str]:
    """pid -> command line of this test process's descendants (Ray's daemons and actors)."""
    parent, cmd = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # the field after the parenthesised name, which may hold spaces
                parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
    found, frontier = {}, {os.getpid()}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier and p not in found}
        found.update({p: cmd.get(p, "") for p in frontier})
    return found


def _listeners(pids: set[int]) -> list[tuple[str, str]]:
    """(local address:port, process) of the TCP listeners of ``pids`` (``ss -ltnp``)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        cols = line.split()
        if len(cols) < 6:
            continue
        owners = {int(p) for p in re.findall(r"pid=(\d+)", cols[5])}
        if owners & pids:
            found.append((cols[3], cols[5]))
    return found


# ---------------------------------------------------------------- no Ray started


def test_the_local_default_does_not_import_ray():
    code = (
        "import sys, nereus_rl, nereus_rl.cli, nereus_rl.runtime, nereus_rl.trainer.trainer; "
        "print('ray' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"launcher": "slurm"}, "launcher"),
        ({"ray_address": "auto"}, "launcher='ray'"),
    ],
)
def test_launcher_options_are_checked_before_anything_starts(options, words):
    with pytest.raises(TrainConfigError, match=words):
        train(steps=1, **options)


def test_cli_ray_refuses_hand_started_worker_options(capsys):
    assert cli_main(["train", "--ray", "--port", "0", "--quick"]) == 2
    assert "--ray" in capsys.readouterr().err


# ---------------------------------------------------------------- on a Ray cluster


@pytest.fixture(scope="module")
def cluster():
    with loopback_ray_cluster(nodes=2) as c:
        yield c
    deadline = time.monotonic() + 15.0
    while True:
        left = [c for c in _descendants().values() if re.search("raylet|gcs_server|ray::", c)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not left, f"Ray processes left behind: {left}"


@pytest.mark.slow
def test_runtime_interface_on_ray_actors(cluster):
    d = RayDriver(heartbeat_timeout=30.0, call_timeout=60.0)
    try:
        assert isinstance(d, Runtime)
        ranks = d.start_workers(3)
        assert ranks == [0, 1, 2] and d.workers == ranks
        # device order keeps each node's workers together
        nodes = [d.node_of[r] for r in ranks]
        assert nodes == sorted(nodes, key=nodes.index)
        d.import_module("tests.support.abort_commands")
        assert d.call(ranks, "ping") == {0: 0, 1: 1, 2: 2}
        pend = d.submit([1, 2], "ping")
        assert d.wait(pend) == {1: 1, 2: 2}
        with pytest.raises(RemoteError, match="no command"):
            d.call([0], "no.such.command")
        # a command's arguments, sent once to every actor, and collectives among them
        assert d.call([0, 1], "abort.allreduce", 2001, (0, 1)) == {0: 3.0, 1: 3.0}
        # Ray's listeners and the job's are on loopback only
        listeners = _listeners(set(_descendants()) | {os.getpid()})
        assert listeners, "ss shows no listener of this test's processes"
        outside = [x for x in listeners if not x[0].startswith(LOOPBACK)]
        assert not outside, f"listening outside loopback: {outside}"

        # 0 waits on 1 in a group with 2, 1 has returned; 2 is killed: 0's wait is
        # broken at once by the abort notice (not its 60 s group timeout), and Ray's
        # own connections of the survivors are spared (they keep answering).
        d.call([0, 1, 2], "make_group", 1001, (0, 1, 2))
        pending = d.submit([0, 1], "abort.wait_on_peer", 1001, (0, 1, 2), 0, 1)
        time.sleep(0.5)
        t0 = time.monotonic()
        d.kill(2)
        with pytest.raises(RemoteError) as e:
            d.wait(pending)
        took = time.monotonic() - t0
        assert took < 5.0, f"abort took {took:.1f} s: {e.value}"
        assert "aborted=True" in e.value.error and "lost=[2]" in e.value.error
        assert d.check_liveness() == (2,) and d.workers == [0, 1]
        with pytest.raises(WorkerLostError):
            d.call([2], "ping")
        assert d.call([0, 1], "abort.allreduce", 2001, (0, 1)) == {0: 3.0, 1: 3.0}

        # A call that owes a reply from an actor killed by Ray itself.
        t0 = time.monotonic()
        ray.kill(d.actor(1), no_restart=True)
        with pytest.raises(WorkerLostError) as lost:
            d.call([0, 1], "ping")  # 1 may be gone before or after the submit
        assert lost.value.ranks == (1,), lost.value
        assert time.monotonic() - t0 < 5.0
        assert d.call([0], "ping") == {0: 0}
    finally:
        d.shutdown()


@pytest.mark.slow
def test_ray_launched_run_matches_the_local_run(cluster):
    # A fixed plan (no adaptation, no calibration): both launchers run the same
    # commands with the same seed, and training on CPU is deterministic.
    opts = dict(devices=4, steps=3, adapt=False, seed=0, calibration_probes=0, **QUICK)
    on_ray = train(launcher="ray", **opts)
    assert on_ray.error is None, on_ray.error
    local = train(**opts)
    assert local.error is None, local.error
    assert on_ray.plans[-1][1] == local.plans[-1][1]
    assert on_ray.rewards == local.rewards
    assert [m["loss"] for m in on_ray.metrics] == [m["loss"] for m in local.metrics]
    assert [m["kl"] for m in on_ray.metrics] == [m["kl"] for m in local.metrics]


def _drain(cluster, node_id: str, seconds: float) -> None:
    """Ask the GCS to drain a node as a preemption does (the node runs on meanwhile)."""
    from ray.core.generated import autoscaler_pb2

    gcs = ray._raylet.GcsClient(address=cluster.address)
    reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
    deadline_ms = int((time.time() + seconds) * 1000)
    accepted, why = gcs.drain_node(node_id, reason, "test preemption", deadline_ms)
    assert accepted, why


@pytest.mark.slow
def test_a_draining_node_is_moved_off_before_it_goes(cluster):
    # The second node is drained after step 0 (an announced preemption): the next
    # boundary moves every stage off it at once, the urgent path, while it still runs.
    cfg = TrainConfig(
        devices=4, steps=3, adapt=True, seed=0, nodes=2, launcher="ray",
        plan=simple_plan("grpo", 4, "colocated"), calibration_probes=0, **QUICK,
    )  # fmt: skip
    tr = Trainer(cfg)
    victim = None
    try:
        tr.start()
        driver = tr.driver
        victim = driver.node_of[tr.device_worker[3]]
        on_victim = {d for d, w in tr.group.device_worker.items() if driver.node_of[w] == victim}
        assert on_victim == {2, 3}

        def progress(step, m):
            if step == 0:
                _drain(cluster, victim, 120.0)
                # the driver reads Ray's drain list at most every NODE_POLL_S: the notice
                # is in before the next boundary
                time.sleep(NODE_POLL_S + 0.1)

        tr.progress = progress
        result = tr.run()
        assert result.error is None, result.error
        assert [m["step"] for m in result.metrics] == [0, 1, 2]
        moves = [d for d in result.decisions if d["signal"] == "devices" and d["taken"]]
        rows = [
            {k: d.get(k) for k in ("step", "signal", "trigger", "urgent", "taken", "candidate")}
            for d in result.decisions
        ]
        assert moves and moves[0]["urgent"], rows
        assert moves[0]["step"] == 1
        last = result.plans[-1][1]
        assert not (set(last.devices) & on_victim), last
        assert driver.draining_workers() == {tr.group.device_worker[d] for d in on_victim}
        assert not driver.check_liveness()  # nobody died: the state moved off in time
    finally:
        tr.close()
        if victim is not None:  # the preemption happens; a fresh node takes its place
            cluster.remove_node(next(n for n in cluster.worker_nodes if n.node_id == victim))
            cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1")


@pytest.mark.slow
def test_a_node_removed_mid_run_is_recovered_from(cluster):
    # Devices 0-1 on one node, 2-3 on the other (nodes=2: the snapshot mirrors each
    # stage's state on the other node); the second node goes away after step 0.
    cfg = TrainConfig(
        devices=4, steps=3, adapt=False, seed=0, nodes=2, launcher="ray",
        plan=simple_plan("grpo", 4, "colocated"), calibration_probes=0, **QUICK,
    )  # fmt: skip
    tr = Trainer(cfg)
    try:
        tr.start()
        driver = tr.driver
        assert isinstance(driver, RayDriver)
        victim = driver.node_of[tr.device_worker[3]]
        assert driver.node_of[tr.device_worker[0]] != victim
        node = next(n for n in cluster.worker_nodes if n.node_id == victim)
        removed = []

        def progress(step, m):
            if step == 0:
                cluster.remove_node(node)
                removed.append(time.monotonic())

        tr.progress = progress
        result = tr.run()
        assert removed
        assert [m["step"] for m in result.metrics] == [0, 1, 2]
        rec = [x for x in result.decisions if "lost devices" in x["trigger"]]
        assert len(rec) == 1, result.decisions
        assert sorted(driver.check_liveness()) == sorted(
            w for w, n in driver.node_of.items() if n == victim
        )
        assert len(result.plans[-1][1].devices) == 2
    finally:
        tr.close()
