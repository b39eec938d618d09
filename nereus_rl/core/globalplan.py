"""GlobalPlan: where every model-stage of one RL step runs, and how it is split.

This is the common currency of the decision layer (planner, cost model,
admission), the transition compiler and the trainer. It is plain, frozen data
with a short printed form, so a plan can be printed, compared, hashed and
cached.

A model-stage (``rollout``, ``actor_train``, ...) runs as ``dp`` identical
units (Elastic Model Units); each unit spans ``tp * pp`` devices ordered
pp-major, then tp (device ``units[u][p * tp + t]`` holds pipeline stage ``p``,
tensor shard ``t``). Stages whose device sets overlap are colocated: they
time-share those devices inside a synchronous step.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


def _is_pow2(x: int) -> bool:
    return x >= 1 and (x & (x - 1)) == 0


def fmt_bytes(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1: 3.61 MiB, 80.0 GiB."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def fmt_devices(devs: tuple[int, ...] | list[int]) -> str:
    """Compress sorted device ids into ranges: (0,1,2,3,6) -> '0-3,6'."""
    s = sorted(devs)
    out: list[str] = []
    i = 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and s[j + 1] == s[j] + 1:
            j += 1
        out.append(str(s[i]) if i == j else f"{s[i]}-{s[j]}")
        i = j + 1
    return ",".join(out)


class KeepsHash:
    """A frozen dataclass's hash, computed once (plans and workloads: the decisions hash
    them thousands of times per boundary, the cost model's caches being keyed by them).
    The kept hash is of this process's string hashing (randomized per process), so it is
    not pickled: an object sent to another process hashes there anew. A subclass gives
    ``_hash_key`` and sets ``__hash__ = KeepsHash._cached_hash`` in its body (dataclass
    would otherwise generate its own)."""

    def _hash_key(self) -> tuple:
        raise NotImplementedError

    def _cached_hash(self) -> int:
        h = self.__dict__.get("_hash")
        if h is None:
            h = self.__dict__["_hash"] = hash(self._hash_key())
        return h

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_hash", None)
        return state


@dataclass(frozen=True)
class StagePlan(KeepsHash):
    """One model-stage's parallel layout and devices.

    Attributes:
        stage: stage name, e.g. ``"rollout"`` or ``"actor_train"``.
        model: which model's state the stage holds (``"actor"``, ``"critic"``,
            ``"reference"``, ``"reward"``); stages with the same model can copy
            state from each other (rollout units are refreshed from actor_train).
        trains: whether the stage holds optimizer state (gradients, Adam moments).
        dp, tp, pp: parallel degrees; ``dp`` is the number of units.
        units: the devices of each unit, ``dp`` tuples of ``tp * pp`` device ids.
    """

    stage: str
    model: str
    trains: bool
    dp: int
    tp: int
    pp: int
    units: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"StagePlan {self.stage!r}: {name}={v!r} must be a positive int")
        if len(self.units) != self.dp:
            raise ValueError(
                f"StagePlan {self.stage!r}: dp={self.dp} but {len(self.units)} units given; "
                "give one device tuple per unit"
            )
        seen: set[int] = set()
        for u in self.units:
            if len(u) != self.tp * self.pp:
                raise ValueError(
                    f"StagePlan {self.stage!r}: unit {u} has {len(u)} devices, "
                    f"expected tp*pp={self.tp * self.pp}"
                )
            dup = seen.intersection(u)
            if dup or len(set(u)) != len(u):
                raise ValueError(
                    f"StagePlan {self.stage!r}: device(s) {sorted(dup) or list(u)} used twice "
                    "within one stage; units of one stage must be disjoint"
                )
            seen.update(u)

    @property
    def num_devices(self) -> int:
        return self.dp * self.tp * self.pp

    # Derived once per (immutable) plan: the decisions ask a plan's devices, groups and
    # hash thousands of times per boundary (the cost model's caches are keyed by plan).
    @cached_property
    def devices(self) -> frozenset[int]:
        return frozenset(d for u in self.units for d in u)

    def _hash_key(self) -> tuple:
        return (self.stage, self.model, self.trains, self.dp, self.tp, self.pp, self.units)

    __hash__ = KeepsHash._cached_hash

    def is_pow2(self) -> bool:
        """True when dp, tp and pp are all powers of two (the planner's plan space)."""
        return _is_pow2(self.dp) and _is_pow2(self.tp) and _is_pow2(self.pp)

    def __repr__(self) -> str:
        return (
            f"{self.stage}[dp{self.dp} tp{self.tp} pp{self.pp} @ "
            f"{fmt_devices(sorted(self.devices))}]"
        )


@dataclass(frozen=True)
class GlobalPlan(KeepsHash):
    """Every model-stage's StagePlan for one RL job. Stage order is the workload's order."""

    stages: tuple[StagePlan, ...]

    def __post_init__(self) -> None:
        names = [s.stage for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"GlobalPlan: stage names must be unique, got {names}")

    def stage(self, name: str) -> StagePlan:
        """The StagePlan of stage ``name``; KeyError names the stages there are."""
        for s in self.stages:
            if s.stage == name:
                return s
        raise KeyError(f"no stage {name!r} in plan; stages are {[s.stage for s in self.stages]}")

    @property
    def stage_names(self) -> tuple[str, ...]:
        return tuple(s.stage for s in self.stages)

    @cached_property
    def devices(self) -> frozenset[int]:
        out: set[int] = set()
        for s in self.stages:
            out |= s.devices
        return frozenset(out)

    def _hash_key(self) -> tuple:
        return self.stages

    __hash__ = KeepsHash._cached_hash

    def colocation_groups(self) -> list[tuple[str, ...]]:
        """Stages grouped by shared devices (connected components of device overlap)."""
        groups = self.__dict__.get("_groups")
        if groups is None:
            groups = self.__dict__["_groups"] = self._colocation_groups()
        return list(groups)

    def _colocation_groups(self) -> list[tuple[str, ...]]:
        parent = {s.stage: s.stage for s in self.stages}

        def find(x: str) -> str:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for i, a in enumerate(self.stages):
            for b in self.stages[i + 1 :]:
                if a.devices & b.devices:
                    parent[find(a.stage)] = find(b.stage)
        groups: dict[str, list[str]] = {}
        for s in self.stages:
            groups.setdefault(find(s.stage), []).append(s.stage)
        return [tuple(g) for g in groups.values()]

    def __repr__(self) -> str:
        return "GlobalPlan(" + " | ".join(repr(s) for s in self.stages) + ")"
