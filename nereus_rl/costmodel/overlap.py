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
reference (and, on disjoint devices, the training) behind the rollout: on a 2-core
machine, rollout, reference and training on three disjoint device sets take about a
third less per step than with the rollout and reference on the same two devices.

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

from nereus_rl.core.globalplan import GlobalPlan
from nereus_rl.core.spec import ClusterSpec, LocalCpuClusterSpec

__all__ = ["overlapped_step", "own_seconds", "rollout_slack"]

_EPS = 1e-12


def overlapped_step(
    plan: GlobalPlan,
    workload,
    seconds: Mapping[str, float],
    sync_s: float,
    cluster: ClusterSpec,
    with_stretch: bool = False,
    rest_s: float = 0.0,
) -> tuple[float, dict[str, float] | None]:
    """Seconds of one steady-state asynchronous step (and each stage's stretch).

    Arguments:
        plan: the plan.
        workload: the step's workload (its stages' order is the order they are sent).
        seconds: each planned stage's seconds alone (the rollout's include ``sync_s``,
            as the cost model prices them); a stage missing counts 0.
        sync_s: the weight sync's seconds, run after the training and the rollout.
        cluster: the devices (local CPU workers share its cores).
        with_stretch: also return each stage's stretch.
        rest_s: the driver's own seconds in the step (``step_overhead``: the replies'
            gathering, scoring, advantages), spent between this step's stages: it
            lengthens their chain, which the rollout sent ahead may hide (see
            :func:`rollout_slack`).

    Returns:
        (step seconds, stage name -> elapsed / own seconds (>= 1; 1.0 for a stage with
        no time), or None without ``with_stretch``).
    """
    end, start, work, names = _simulate(plan, workload, seconds, sync_s, cluster)
    n = len(names)
    if rest_s > 0.0:
        roll, chain = _ends(end, workload, plan)
        total = max(roll, chain + rest_s) + sync_s
    else:
        total = (max(end) if n else 0.0) + sync_s
    if not with_stretch:
        return total, None
    stretch = {names[j]: (end[j] - start[j]) / work[j] if work[j] > 0 else 1.0 for j in range(n)}
    return total, stretch


def rollout_slack(
    plan: GlobalPlan,
    workload,
    seconds: Mapping[str, float],
    sync_s: float,
    cluster: ClusterSpec,
) -> float:
    """How much later the rollout sent ahead ends than this step's chain of stages
    (seconds; negative when the chain ends last), as :func:`overlapped_step` simulates.

    The driver's rest (``rest_s``) up to this much is hidden behind the rollout: a
    measured step then says nothing of it, and an overlapped plan that gives the
    rollout devices of its own pays none of it (a model that added the rest beside the
    overlap would price a plan whose chain runs after the rollout, e.g. rollout and
    reference on two shared devices, level with one that hides the chain behind it,
    though the first is clearly slower).
    """
    end, _, _, _ = _simulate(plan, workload, seconds, sync_s, cluster)
    roll, chain = _ends(end, workload, plan)
    return roll - chain


def _ends(end: list, workload, plan: GlobalPlan) -> tuple[float, float]:
    """(the rollout's end, the latest end of the other stages) of a simulation."""
    phase = _structure(plan, workload)[2]
    roll = max((e for e, p in zip(end, phase) if p == 0), default=0.0)
    chain = max((e for e, p in zip(end, phase) if p != 0), default=0.0)
    return roll, chain


def _simulate(plan, workload, seconds, sync_s, cluster) -> tuple[list, list, list, tuple]:
    """Each stage's end and start, its own work and the stages' names (see
    :func:`overlapped_step`)."""
    names, width, phase, before, inference = _structure(plan, workload)
    cores = cluster.cores if isinstance(cluster, LocalCpuClusterSpec) else None
    n = len(names)
    work = [0.0] * n
    for j, name in enumerate(names):
        t = float(seconds.get(name, 0.0))
        if phase[j] == 0:
            t -= sync_s  # the sync runs after the rollout, not in it
        work[j] = t if t > 0.0 else 0.0
    # (Priced for every candidate at every horizon length, a third of a search's
    # time: the loop tests plain flags, not generators over the stages.)
    alone = None if cores is None else [min(1.0, cores / w) for w in width]
    left = list(work)
    start: list[float] = [0.0] * n
    end: list[float | None] = [None] * n
    done = [False] * n
    infer_left = len(inference)
    now = 0.0
    waiting = list(range(n))
    running: list[int] = []
    while True:
        if waiting:
            infer_done = infer_left == 0
            still = []
            for j in waiting:
                ready = phase[j] != 2 or infer_done
                if ready:
                    for i in before[j]:
                        if not done[i]:
                            ready = False
                            break
                if ready:
                    start[j] = now
                    running.append(j)
                else:
                    still.append(j)
            waiting = still
        if not running:
            break
        if alone is None:
            rate = [1.0] * len(running)
        else:
            # processor sharing: running stages never share a device
            busy = 0
            for j in running:
                busy += width[j]
            share = min(1.0, cores / busy)
            rate = [share / alone[j] for j in running]
        dt = min([left[j] / r for j, r in zip(running, rate)])
        now += dt
        still = []
        for j, r in zip(running, rate):
            left[j] -= r * dt
            if left[j] <= _EPS * max(1.0, work[j]):
                end[j] = now
                done[j] = True
                if phase[j] == 1:
                    infer_left -= 1
            else:
                still.append(j)
        running = still
    return end, start, work, names


# (plan, planned stage names) -> the order's structure; plans repeat over a run's lengths
_STRUCTURES: dict[tuple, tuple] = {}
_STRUCTURES_SIZE = 8192


def _structure(plan: GlobalPlan, workload) -> tuple:
    """(names, devices per stage, phases, earlier stages sharing a device, the inference
    stages) of ``plan``'s planned stages in ``workload``'s order."""
    stages = workload.stage_order
    key = (plan, stages)
    got = _STRUCTURES.get(key)
    if got is None:
        if len(_STRUCTURES) >= _STRUCTURES_SIZE:
            _STRUCTURES.clear()
        names = tuple(s for s, _ in stages)
        devs = [plan.stage(s).devices for s in names]
        width = tuple(len(d) for d in devs)
        phase = tuple(p for _, p in stages)
        # the earlier-sent stages each must wait for: a shared device (per-worker order)
        before = tuple(tuple(i for i in range(j) if devs[i] & devs[j]) for j in range(len(names)))
        inference = tuple(i for i, p in enumerate(phase) if p == 1)
        got = _STRUCTURES[key] = (names, width, phase, before, inference)
    return got


def own_seconds(
    plan: GlobalPlan,
    workload,
    measured: Mapping[str, float],
    est,
    cluster: ClusterSpec,
) -> dict[str, float]:
    """Stage seconds measured in an overlapped step, as each stage's own time.

    Each is divided by the stretch :func:`overlapped_step` gives its stage under
    ``est`` (the model's :class:`~nereus_rl.costmodel.costmodel.StepEstimate` of ``plan`` at
    ``workload``); the rollout's measured time holds the weight sync, which runs alone,
    so only its generation share (as priced) is divided.
    """
    secs = {n: e.seconds for n, e in est.stages.items()}
    _, stretch = overlapped_step(plan, workload, secs, est.sync_s, cluster, with_stretch=True)
    out = {k: v / stretch.get(k, 1.0) for k, v in measured.items()}
    gen = secs.get("rollout", 0.0) - est.sync_s
    if "rollout" in measured and gen > 0:
        # measured = gen * r + sync, with sync / gen as priced (q)
        q = est.sync_s / gen
        out["rollout"] = measured["rollout"] * (1.0 + q) / (stretch["rollout"] + q)
    return out
