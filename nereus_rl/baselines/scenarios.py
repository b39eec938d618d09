"""Random plan changes for the transition tests and benchmarks.

Six model-stages (the PPO set) share a small cluster; every device holds a few
units within its memory. A scenario is a current plan, a target plan of one
transition type, and the devices that exist or were lost:

- ``scale_up``: devices join; stages gain units.
- ``scale_down``: devices leave (gracefully); stages lose units.
- ``rebalance``: two stages trade units on the same devices.
- ``tp_pp_change``: stages change tensor or pipeline degree (split, merge or
  re-layout in place) while another stage moves.
- ``device_loss``: devices die with the units on them; the rest re-plan.

Every type also re-places some units at random, so stages move onto devices
other stages still hold: the transient ownership conflicts the DAG resolves.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nereus_rl.core.globalplan import GlobalPlan, StagePlan
from nereus_rl.transition import (
    InfeasibleTargetError,
    TransitionDAG,
    Unit,
    compile_transition,
)
from nereus_rl.transition.native import memory_by_layout

#: (stage, model, trains) in workload order (the stage-order tie-break).
STAGES: tuple[tuple[str, str, bool], ...] = (
    ("rollout", "actor", False),
    ("reference", "reference", False),
    ("critic_inference", "critic", False),
    ("reward", "reward", False),
    ("actor_train", "actor", True),
    ("critic_train", "critic", True),
)
TRANSITION_TYPES = ("scale_up", "scale_down", "rebalance", "tp_pp_change", "device_loss")

#: Scenario memory: 8 GB weights per model, x3 while training; 40 GB devices.
SCENARIO_MODEL_BYTES = 8e9
SCENARIO_TRAIN_FACTOR = 3.0
SCENARIO_CAPACITY = 40e9


def scenario_unit_memory(unit: Unit) -> float:
    """Bytes per device of a unit in the scenarios."""
    b = SCENARIO_MODEL_BYTES * (SCENARIO_TRAIN_FACTOR if unit.trains else 1.0)
    return b / (unit.tp * unit.pp)


memory_by_layout(scenario_unit_memory)  # the native compiler calls it once per layout


def _stage_mem(trains: bool, tp: int, pp: int) -> float:
    return SCENARIO_MODEL_BYTES * (SCENARIO_TRAIN_FACTOR if trains else 1.0) / (tp * pp)


@dataclass(frozen=True)
class Scenario:
    """One random plan change.

    Attributes:
        kind: the transition type.
        current, target: the plans before and after.
        devices: the devices that exist after the change.
        lost: devices that died.
    """

    kind: str
    current: GlobalPlan
    target: GlobalPlan
    devices: frozenset[int]
    lost: frozenset[int]

    def __repr__(self) -> str:
        return (
            f"Scenario({self.kind}: {self.current!r} -> {self.target!r}, lost {sorted(self.lost)})"
        )


_LAYOUTS = ((1, 1), (2, 1), (1, 2), (2, 2))


class _Filler:
    """Places units on devices with free memory, one stage slot per device."""

    def __init__(self, devices: Sequence[int], rng: random.Random) -> None:
        self.free = dict.fromkeys(devices, SCENARIO_CAPACITY)
        self.rng = rng
        self.taken: dict[str, set[int]] = {}

    def put(self, stage: str, devs: tuple[int, ...], m: float) -> bool:
        if any(d not in self.free or self.free[d] < m - 1e-3 for d in devs):
            return False
        taken = self.taken.setdefault(stage, set())
        if taken.intersection(devs):
            return False
        for d in devs:
            self.free[d] -= m
        taken.update(devs)
        return True

    def place(self, stage: str, k: int, m: float) -> tuple[int, ...] | None:
        taken = self.taken.setdefault(stage, set())
        ok = [d for d, f in self.free.items() if f >= m - 1e-3 and d not in taken]
        if len(ok) < k:
            return None
        devs = tuple(self.rng.sample(ok, k))
        assert self.put(stage, devs, m)
        return devs


def random_plan(
    rng: random.Random,
    devices: Sequence[int],
    *,
    keep: GlobalPlan | None = None,
    keep_prob: float = 0.0,
    layouts: dict[str, tuple[int, int]] | None = None,
    dps: dict[str, int] | None = None,
    max_dp: int = 3,
) -> GlobalPlan | None:
    """A random memory-feasible plan over ``devices`` (None when placement fails).

    Arguments:
        rng: randomness.
        devices: the devices to use.
        keep: a plan whose units may stay (each with ``keep_prob``) when layouts match.
        keep_prob: chance that a unit of ``keep`` stays where it is.
        layouts: fixed (tp, pp) per stage; others drawn at random.
        dps: fixed dp per stage; others drawn in 1..max_dp.
        max_dp: the largest dp drawn.
    Returns:
        the plan, or None.
    """
    fill = _Filler(devices, rng)
    chosen: dict[str, tuple[int, int, int]] = {}
    for name, _, _ in STAGES:
        tp, pp = (layouts or {}).get(name) or rng.choice(_LAYOUTS)
        dp = (dps or {}).get(name) or rng.randint(1, max_dp)
        chosen[name] = (tp, pp, dp)
    units: dict[str, list[tuple[int, ...]]] = {n: [] for n, _, _ in STAGES}
    if keep is not None:
        for sp in keep.stages:
            tp, pp, dp = chosen[sp.stage]
            if (sp.tp, sp.pp) != (tp, pp):
                continue
            for u in sp.units:
                if len(units[sp.stage]) < dp and rng.random() < keep_prob:
                    if fill.put(sp.stage, u, _stage_mem(sp.trains, tp, pp)):
                        units[sp.stage].append(u)
    order = list(STAGES)
    rng.shuffle(order)
    for name, _, trains in order:
        tp, pp, dp = chosen[name]
        while len(units[name]) < dp:
            devs = fill.place(name, tp * pp, _stage_mem(trains, tp, pp))
            if devs is None:
                return None
            units[name].append(devs)
    return GlobalPlan(
        tuple(
            StagePlan(n, m, t, len(units[n]), chosen[n][0], chosen[n][1], tuple(units[n]))
            for n, m, t in STAGES
        )
    )


def _layouts(plan: GlobalPlan) -> dict[str, tuple[int, int]]:
    return {sp.stage: (sp.tp, sp.pp) for sp in plan.stages}


def _dps(plan: GlobalPlan) -> dict[str, int]:
    return {sp.stage: sp.dp for sp in plan.stages}


def _follow(
    rng: random.Random,
    devices: Sequence[int],
    cur: GlobalPlan,
    keep_prob: float,
    dps: dict[str, int],
) -> GlobalPlan | None:
    """A target in ``cur``'s layouts with ``dps``, keeping ``cur``'s units with ``keep_prob``."""
    return random_plan(rng, devices, keep=cur, keep_prob=keep_prob, layouts=_layouts(cur), dps=dps)


def _regroup(sp: StagePlan, rng: random.Random) -> StagePlan | None:
    """The same devices in another layout: merge pairs, split halves, or tp<->pp."""
    opts = []
    if sp.dp % 2 == 0 and sp.tp * sp.pp <= 2:
        opts.append("merge")
    if sp.tp * sp.pp >= 2:
        opts.append("split")
    if sp.tp != sp.pp:
        opts.append("swap")
    if not opts:
        return None
    how = rng.choice(opts)
    if how == "merge":
        tp, pp = (sp.tp * 2, sp.pp) if rng.random() < 0.5 else (sp.tp, sp.pp * 2)
        units = tuple(sp.units[i] + sp.units[i + 1] for i in range(0, sp.dp, 2))
    elif how == "split":
        tp, pp = (sp.tp // 2, sp.pp) if sp.tp % 2 == 0 else (sp.tp, sp.pp // 2)
        k = tp * pp
        units = tuple(part for u in sp.units for part in (u[:k], u[k:]))
    else:
        tp, pp = sp.pp, sp.tp
        units = sp.units
    return StagePlan(sp.stage, sp.model, sp.trains, len(units), tp, pp, units)


def random_scenario(
    kind: str,
    rng: random.Random,
    num_devices: int = 12,
    *,
    min_fill: float = 0.0,
    max_dp: int = 3,
) -> Scenario:
    """One random plan change of type ``kind`` on up to ``num_devices`` devices.

    Arguments:
        kind: one of :data:`TRANSITION_TYPES`.
        rng: randomness.
        num_devices: cluster size (the largest device set either plan uses).
        min_fill: redraw until the current plan fills at least this fraction of the
            memory of the devices it uses, on average (dense, shared devices).
        max_dp: the largest dp drawn for a stage of the current plan.
    Returns:
        the scenario (memory-feasible current and target plans).
    Raises:
        ValueError: ``kind`` is not a transition type.
    """
    if kind not in TRANSITION_TYPES:
        raise ValueError(f"unknown transition type {kind!r}; use one of {TRANSITION_TYPES}")
    all_devs = list(range(num_devices))
    k = max(1, num_devices // 6)
    for _ in range(1000):
        lost: frozenset[int] = frozenset()
        if kind == "scale_up":
            cur = random_plan(rng, all_devs[:-k], max_dp=max_dp)
            if cur is None:
                continue
            dps = {n: d + rng.randint(0, 1) for n, d in _dps(cur).items()}
            tgt = _follow(rng, all_devs, cur, 0.5, dps)
            devices = frozenset(all_devs)
        elif kind == "scale_down":
            cur = random_plan(rng, all_devs, max_dp=max_dp)
            if cur is None:
                continue
            dps = {n: max(1, d - rng.randint(0, 1)) for n, d in _dps(cur).items()}
            gone = set(rng.sample(all_devs, k))
            keep_devs = [d for d in all_devs if d not in gone]
            tgt = _follow(rng, keep_devs, cur, 0.5, dps)
            devices = frozenset(keep_devs)
        elif kind == "rebalance":
            cur = random_plan(rng, all_devs, max_dp=max_dp)
            if cur is None:
                continue
            dps = _dps(cur)
            names = [n for n, _, _ in STAGES]
            b = rng.choice([n for n in names if dps[n] > 1] or names)
            a = rng.choice([n for n in names if n != b])
            dps[b] = max(1, dps[b] - 1)
            dps[a] += 1
            tgt = _follow(rng, all_devs, cur, 0.6, dps)
            devices = frozenset(all_devs)
        elif kind == "tp_pp_change":
            cur = random_plan(rng, all_devs, max_dp=max_dp)
            if cur is None:
                continue
            stages = list(cur.stages)
            idx = rng.sample(range(len(stages)), 2)
            new = _regroup(stages[idx[0]], rng)
            if new is None:
                continue
            stages[idx[0]] = new
            mover = stages[idx[1]]
            tgt = _replace_stage(rng, all_devs, GlobalPlan(tuple(stages)), mover.stage)
            devices = frozenset(all_devs)
        else:  # device_loss
            cur = random_plan(rng, all_devs, max_dp=max_dp)
            if cur is None:
                continue
            lost = frozenset(rng.sample(all_devs, k))
            alive = [d for d in all_devs if d not in lost]
            kept_states = {
                s
                for sp in cur.stages
                for u in sp.units
                if not lost.intersection(u)
                for s in Unit("", sp.stage, sp.model, sp.trains, 1, 1, ()).states
            }
            needed = {s for n, m, t in STAGES for s in Unit("", n, m, t, 1, 1, ()).states}
            if needed - kept_states:
                continue
            tgt = _follow(rng, alive, cur, 0.7, _dps(cur))
            devices = frozenset(alive)
        if tgt is None or _over_memory(tgt) or _fill(cur) < min_fill:
            continue
        return Scenario(kind, cur, tgt, devices, lost)
    raise AssertionError(f"could not draw a {kind} scenario on {num_devices} devices")


def _replace_stage(
    rng: random.Random, devices: Sequence[int], plan: GlobalPlan, stage: str
) -> GlobalPlan | None:
    """``plan`` with ``stage``'s units re-placed at random where memory allows."""
    fill = _Filler(devices, rng)
    for sp in plan.stages:
        if sp.stage != stage:
            for u in sp.units:
                if not fill.put(sp.stage, u, _stage_mem(sp.trains, sp.tp, sp.pp)):
                    return None
    out = []
    for sp in plan.stages:
        if sp.stage == stage:
            units = []
            for _ in range(sp.dp):
                devs = fill.place(sp.stage, sp.tp * sp.pp, _stage_mem(sp.trains, sp.tp, sp.pp))
                if devs is None:
                    return None
                units.append(devs)
            sp = StagePlan(sp.stage, sp.model, sp.trains, sp.dp, sp.tp, sp.pp, tuple(units))
        out.append(sp)
    return GlobalPlan(tuple(out))


def _device_bytes(plan: GlobalPlan) -> dict[int, float]:
    """Bytes the plan's units take on each device it uses."""
    used: dict[int, float] = {}
    for sp in plan.stages:
        for u in sp.units:
            for d in u:
                used[d] = used.get(d, 0.0) + _stage_mem(sp.trains, sp.tp, sp.pp)
    return used


def _fill(plan: GlobalPlan) -> float:
    """Mean fraction of device memory the plan uses, over the devices it uses."""
    used = _device_bytes(plan)
    return sum(used.values()) / (len(used) * SCENARIO_CAPACITY)


def _over_memory(plan: GlobalPlan) -> bool:
    return any(b > SCENARIO_CAPACITY + 1e-3 for b in _device_bytes(plan).values())


def compile_scenario(
    sc: Scenario, *, capacity: float = SCENARIO_CAPACITY, **options: Any
) -> TransitionDAG:
    """``compile_transition`` of a scenario with its devices, lost devices and memory.

    Arguments:
        sc: the scenario.
        capacity: bytes per device (``SCALED_CAPACITY`` for :func:`scaled_scenario`).
        **options: further keyword arguments of ``compile_transition`` (``refine``,
            ``stage_slots``, ``cost_fn``).
    Returns:
        the compiled DAG from ``sc.current`` to ``sc.target``.
    Raises:
        InfeasibleTargetError: no safe order reaches the target.
    """
    return compile_transition(
        sc.current,
        sc.target,
        devices=sc.devices,
        lost_devices=sc.lost,
        unit_memory=scenario_unit_memory,
        capacity=capacity,
        **options,
    )


def draw_reachable(
    kind: str,
    rng: random.Random,
    *,
    num_devices: int = 12,
    min_fill: float = 0.0,
    max_dp: int = 3,
    **options: Any,
) -> tuple[Scenario, TransitionDAG, int]:
    """Draw scenarios of ``kind`` until one compiles (its target is reachable).

    Arguments:
        kind: one of :data:`TRANSITION_TYPES`.
        rng: randomness (the same draws as calling :func:`random_scenario` in a loop).
        num_devices, min_fill, max_dp: as in :func:`random_scenario`.
        **options: keyword arguments of :func:`compile_scenario`.
    Returns:
        (the scenario, its DAG, how many drawn scenarios were unreachable first).
    Raises:
        ValueError: ``kind`` is not a transition type.
    """
    redrawn = 0
    while True:
        sc = random_scenario(kind, rng, num_devices, min_fill=min_fill, max_dp=max_dp)
        try:
            return sc, compile_scenario(sc, **options), redrawn
        except InfeasibleTargetError:
            redrawn += 1


def _finite(v: Any) -> Any:
    """JSON has no inf or nan: null for a figure that does not exist."""
    return None if isinstance(v, float) and not math.isfinite(v) else v


def write_benchmark_json(path: str, benchmark: str, rows: Sequence[dict[str, Any]]) -> None:
    """Write ``{"benchmark": benchmark, "rows": rows}`` to ``path``, inf and nan as null.

    Arguments:
        path: the file to write.
        benchmark: the benchmark's name.
        rows: one dict per table row.
    """
    out = [{k: _finite(v) for k, v in r.items()} for r in rows]
    with open(path, "w") as f:
        json.dump({"benchmark": benchmark, "rows": out}, f, indent=1)


#: Device memory in the scaled scenario: tight enough that moved units must wait for
#: the units they replace.
SCALED_CAPACITY = 20e9


def scaled_scenario(num_devices: int) -> Scenario:
    """A cluster-scale rebalance: the actor side grows by an eighth of the devices.

    Current: rollout (tp2) and actor_train (tp4) share the first half;
    reference, reward, critic_inference (tp2) and critic_train (tp4) share the
    second. Target: the actor side takes the next eighth of the devices and
    rollout re-lays-out to tp1 (in-place splits plus extends onto the new
    devices); the critic side loses the units there (destroys, which must come
    before the extends that need their memory, with ``SCALED_CAPACITY``).

    Arguments:
        num_devices: cluster size, a multiple of 32.
    Returns:
        the scenario.
    Raises:
        ValueError: ``num_devices`` is not a positive multiple of 32.
    """
    if num_devices < 32 or num_devices % 32:
        raise ValueError(f"num_devices={num_devices}: use a positive multiple of 32")
    n = num_devices
    half, grow = n // 2, n // 8

    def units(lo: int, hi: int, k: int) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(range(s, s + k)) for s in range(lo, hi, k))

    def stage(name: str, model: str, trains: bool, tp: int, pp: int, lo: int, hi: int):
        us = units(lo, hi, tp * pp)
        return StagePlan(name, model, trains, len(us), tp, pp, us)

    cur = GlobalPlan(
        (
            stage("rollout", "actor", False, 2, 1, 0, half),
            stage("reference", "reference", False, 2, 1, half, n),
            stage("critic_inference", "critic", False, 2, 1, half, n),
            stage("reward", "reward", False, 2, 1, half, n),
            stage("actor_train", "actor", True, 4, 1, 0, half),
            stage("critic_train", "critic", True, 4, 1, half, n),
        )
    )
    tgt = GlobalPlan(
        (
            stage("rollout", "actor", False, 1, 1, 0, half + grow),
            stage("reference", "reference", False, 2, 1, half + grow, n),
            stage("critic_inference", "critic", False, 2, 1, half + grow, n),
            stage("reward", "reward", False, 2, 1, half + grow, n),
            stage("actor_train", "actor", True, 4, 1, 0, half + grow),
            stage("critic_train", "critic", True, 4, 1, half + grow, n),
        )
    )
    return Scenario("scaled_rebalance", cur, tgt, frozenset(range(n)), frozenset())
