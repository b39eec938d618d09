"""Step latency of an asynchronous RL step: the next step's rollout beside this one's work.

In asynchronous RL (``TrainConfig.mode="async"``, ``Workload.rollout_ahead``) the
trainer sends the next step's rollout to the rollout workers first, then this step's
inference and, once every inference reply is in, its training; the weight sync runs
when both the training and the rollout are done. Each worker runs the commands it gets
one at a time in the driver's order (``Trainer._submit_stage``), so:

* a stage on devices the rollout does not use starts at once and runs beside it;
* a stage that shares a device with the rollout waits for the rollout's end on it;
* training waits for every inference stage (its batch needs their outputs);
* stages that share devices run one after another in the order they were sent.

The synchronous composition (``costmodel.compose_phases``: phases one after another)
prices none of that overlap, so it ranks a plan that gives the rollout its own devices
no better than one that colocates it with the reference, although the first hides the
reference (and, on disjoint devices, the training) behind the rollout. Measured on the
2-core machine (ReMax async quick, fixed plans, member-only stage commands): rollout,
reference and training on three disjoint device sets 0.085-0.091 s per step against
0.12-0.14 s with the rollout and reference on the same two devices.

:func:`overlapped_step` simulates that order. Stage times are the model's (each stage
alone); on local CPU workers (``LocalCpuClusterSpec``) stages that run at once share
the cores, so while ``B`` workers are busy each progresses at ``min(1, C / B)`` of a
core against the ``min(1, C / d)`` its own ``d`` workers would get alone (``C`` the
cores): processor sharing, as the stage prices already assume within a stage. On
devices of their own (GPUs) stages that run at once do not slow each other.

The same simulation gives each stage's stretch (its elapsed time over its own time),
which turns a stage time measured beside the rollout back into the stage's own time
before it refines the model (``Adapter.boundary``).
"""

from __future__ import annotations

from collections.abc import Mapping

from nereus_rl.globalplan import GlobalPlan
from nereus_rl.spec import ClusterSpec, LocalCpuClusterSpec

__all__ = ["overlapped_step", "own_seconds"]

_EPS = 1e-12


def overlapped_step(
    plan: GlobalPlan,
    workload,
    seconds: Mapping[str, float],
    sync_s: float,
    cluster: ClusterSpec,
) -> tuple[float, dict[str, float]]:
    """Seconds of one steady-state asynchronous step, and each stage's stretch.

    Arguments:
        plan: the plan.
        workload: the step's workload (its stages' order is the order they are sent).
        seconds: each planned stage's seconds alone (the rollout's include ``sync_s``,
            as the cost model prices them); a stage missing counts 0.
        sync_s: the weight sync's seconds, run after the training and the rollout.
        cluster: the devices (local CPU workers share its cores).

    Returns:
        (step seconds, stage name -> elapsed / own seconds (>= 1; 1.0 for a stage
        with no time)).
    """
    cores = cluster.cores if isinstance(cluster, LocalCpuClusterSpec) else None
    names, devs, work, phase = [], [], [], []
    for sw in workload.planned_stages:
        if sw.stage not in seconds:
            continue
        t = float(seconds[sw.stage])
        if sw.phase == 0:
            t = max(0.0, t - sync_s)  # the sync runs after the rollout, not in it
        names.append(sw.stage)
        devs.append(plan.stage(sw.stage).devices)
        work.append(max(0.0, t))
        phase.append(sw.phase)
    n = len(names)
    left = list(work)
    start = [None] * n
    end = [None] * n
    # the earlier-sent stages each must wait for: a shared device (per-worker order)
    before = [[i for i in range(j) if devs[i] & devs[j]] for j in range(n)]
    inference = [i for i in range(n) if phase[i] == 1]
    now = 0.0
    while True:
        for j in range(n):
            if start[j] is not None:
                continue
            if phase[j] == 2 and any(end[i] is None for i in inference):
                continue  # training needs every inference stage's output
            if all(end[i] is not None for i in before[j]):
                start[j] = now
        running = [j for j in range(n) if start[j] is not None and end[j] is None]
        if not running:
            break
        rate = _rates(running, devs, cores)
        dt = min(left[j] / rate[j] for j in running)
        now += dt
        for j in running:
            left[j] -= rate[j] * dt
            if left[j] <= _EPS * max(1.0, work[j]):
                left[j] = 0.0
                end[j] = now
    stretch = {names[j]: (end[j] - start[j]) / work[j] if work[j] > 0 else 1.0 for j in range(n)}
    total = (max(end) if n else 0.0) + sync_s
    return total, stretch


def _rates(running: list[int], devs: list, cores: float | None) -> dict[int, float]:
    """Each running stage's progress per second against its own time alone."""
    if cores is None:
        return {j: 1.0 for j in running}
    busy = sum(len(devs[j]) for j in running)  # running stages never share a device
    share = min(1.0, cores / busy)
    return {j: share / min(1.0, cores / len(devs[j])) for j in running}


def own_seconds(
    plan: GlobalPlan,
    workload,
    measured: Mapping[str, float],
    est,
    cluster: ClusterSpec,
) -> dict[str, float]:
    """Stage seconds measured in an overlapped step, as each stage's own time.

    Each is divided by the stretch :func:`overlapped_step` gives its stage under
    ``est`` (the model's :class:`~nereus_rl.costmodel.StepEstimate` of ``plan`` at
    ``workload``); the rollout's measured time holds the weight sync, which runs alone,
    so only its generation share (as priced) is divided.
    """
    secs = {n: e.seconds for n, e in est.stages.items()}
    _, stretch = overlapped_step(plan, workload, secs, est.sync_s, cluster)
    out = {}
    for k, v in measured.items():
        r = stretch.get(k, 1.0)
        gen = secs.get(k, 0.0) - est.sync_s
        if k == "rollout" and gen > 0:
            # measured = gen * r + sync, with sync / gen as priced (q)
            q = est.sync_s / gen
            out[k] = v * (1.0 + q) / (r + q)
        else:
            out[k] = v / r
    return out
