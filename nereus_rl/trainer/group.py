"""The run's workers as the driver addresses them, and the calls made over all of them.

A plan names devices (0 .. devices-1); a worker process holds each. A
:class:`WorkerGroup` keeps the two maps between them that the trainer, its EMU units
(:mod:`nereus_rl.trainer.units`) and its recovery (:mod:`nereus_rl.trainer.recover`)
share: device -> worker (a recovery drops lost devices and may give one to a joined
worker) and device -> rank in the workers' default process group (formed anew after a
loss). The stage commands of :mod:`nereus_rl.trainer.worker` address a stage's units by
those ranks (:meth:`WorkerGroup.desc`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from typing import Any

from nereus_rl.core.globalplan import GlobalPlan, StagePlan
from nereus_rl.trainer.config import SYNC_PAIRS, stage_desc


class WorkerGroup:
    """The workers of one run (see the module docstring).

    Arguments:
        driver: the runtime Driver the workers join (None until the run has one).
        device: ``"cpu"`` or ``"cuda"``: where the workers hold their stages
            (passed to ``rl.init``).

    Attributes:
        workers: the run's workers, in device order.
        device_worker: plan device id -> worker.
        world_rank: plan device id -> rank in the workers' default group.
    """

    def __init__(self, driver, device: str = "cpu") -> None:
        self.driver = driver
        self.device = device
        self.workers: list[int] = []
        self.device_worker: dict[int, int] = {}
        self.world_rank: dict[int, int] = {}

    def attach(self, workers: Iterable[int]) -> None:
        """Use ``workers`` (device i is the i-th, and rank i of the default group)."""
        self.workers = list(workers)
        self.world_rank = {d: d for d in range(len(self.workers))}
        self.device_worker = dict(enumerate(self.workers))

    def rebase(self, device_worker: dict[int, int]) -> None:
        """Use the workers of ``device_worker`` (the devices left after a loss, and joined
        workers); the default group's ranks follow device order (:meth:`init_world` forms
        it)."""
        alive = sorted(device_worker)
        self.device_worker = {d: device_worker[d] for d in alive}
        self.workers = [device_worker[d] for d in alive]
        self.world_rank = {d: i for i, d in enumerate(alive)}

    def init_world(self) -> None:
        """Join every worker in a new default process group (``rl.init``), its ranks
        :attr:`world_rank`'s."""
        n = len(self.workers)
        # a fresh prefix per run: workers reused by another run must not meet old keys
        prefix = f"rl.world.{uuid.uuid4().hex[:12]}/"
        pend = [
            self.driver.submit(
                [w], "rl.init", i, n, prefix, device=self.device, workers=self.workers
            )
            for i, w in enumerate(self.workers)
        ]
        for p in pend:
            self.driver.wait(p)

    def desc(self, sp: StagePlan) -> dict[str, Any]:
        """The stage commands' description of ``sp``: its units as default-group ranks."""
        d = stage_desc(sp)
        d["units"] = [[self.world_rank[x] for x in u] for u in d["units"]]
        return d

    def ranks(self, devices: Iterable[int]) -> list[int]:
        """The workers of plan devices ``devices``."""
        return [self.device_worker[d] for d in devices]

    def call_all(self, fn: str, *args, **kwargs) -> dict[int, Any]:
        """Run command ``fn`` on every worker and wait for the replies.

        Every worker runs every stage command (non-members return at once), so that
        collectives over the default group and ``new_group`` calls stay in step.
        """
        return self.driver.call(self.workers, fn, *args, **kwargs)

    def submit_all(self, fn: str, *args, **kwargs):
        """Send command ``fn`` to every worker; do not wait (``driver.wait`` the result)."""
        return self.driver.submit(self.workers, fn, *args, **kwargs)

    def lost(self) -> list[int]:
        """The group's workers known lost now (sorted).

        Losses a recovery already dropped are not the group's workers any more, so a
        second death is told apart from the first.
        """
        lost = set(self.driver.check_liveness())
        return [w for w in self.workers if w in lost]


def sync_weights(group: WorkerGroup, plan: GlobalPlan) -> dict[str, float]:
    """actor_train -> rollout (PPO: critic_train -> critic_inference too) on ``plan``,
    through nereus_comm reshard (``rl.move``), collective over the workers; never a
    gather on one rank.

    Returns:
        ``sync_s`` (seconds), ``sync_bytes_sent`` (bytes sent between workers) and
        ``sync_bytes_net`` (of those, the bytes sent to workers on other hosts, over
        the socket route).
    """
    t0 = time.perf_counter()
    sent = net = 0.0
    names = plan.stage_names
    for src, dst in SYNC_PAIRS:
        if src in names and dst in names:
            rep = group.call_all(
                "rl.move",
                group.desc(plan.stage(src)),
                group.desc(plan.stage(dst)),
                params_only=True,
                replace=False,
            )
            sent += sum(r["bytes_sent"] for r in rep.values())
            net += sum(r.get("bytes_net", 0.0) for r in rep.values())
    return {"sync_s": time.perf_counter() - t0, "sync_bytes_sent": sent, "sync_bytes_net": net}
