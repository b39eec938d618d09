"""Plain data of the EMU layer: stages, units, primitive records, errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nereus_comm.layout import Layout, TensorSpec


class EMUError(ValueError):
    """A primitive was asked for something it cannot do; nothing moved."""


class EMUStateLostError(RuntimeError):
    """Every unit holding a stage's state lost a shard; it cannot be rebuilt from memory."""


@dataclass(frozen=True)
class StageState:
    """What a model-stage's units hold.

    Arguments:
        name: the stage (e.g. "actor.train").
        specs: the TensorSpecs of one unit's full state.
        num_layers: layers the pipeline split divides.
        seed: seed of the synthetic initial content.
        model: the model whose weights the stage holds (None: the stage's own name).
    """

    name: str
    specs: tuple[TensorSpec, ...]
    num_layers: int
    seed: int = 0
    model: str | None = None

    def __post_init__(self) -> None:
        if self.model is None:
            object.__setattr__(self, "model", self.name)

    @property
    def nbytes(self) -> int:
        """Bytes of one full copy of the state."""
        return sum(s.nbytes for s in self.specs)

    def __repr__(self) -> str:
        return (
            f"StageState({self.name} tensors={len(self.specs)} layers={self.num_layers} "
            f"{self.nbytes / 2**20:.1f} MiB)"
        )


@dataclass(frozen=True)
class EMU:
    """One replica of one model-stage on tp x pp worker ranks.

    Arguments:
        uid: job-unique unit id.
        stage: the stage's name.
        tp, pp: tensor and pipeline degrees.
        ranks: tp * pp worker ranks, pp-major then tp (Layout order).
        num_layers: layers of the stage (for the layout's pipeline split).
    """

    uid: int
    stage: str
    tp: int
    pp: int
    ranks: tuple[int, ...]
    num_layers: int

    @property
    def degree(self) -> int:
        """Number of devices (tp * pp)."""
        return self.tp * self.pp

    @property
    def layout(self) -> Layout:
        """The unit's Layout (dp = 1)."""
        return Layout(1, self.tp, self.pp, self.ranks, num_layers=self.num_layers)

    def __repr__(self) -> str:
        return f"EMU(#{self.uid} {self.stage} tp{self.tp} pp{self.pp} ranks={list(self.ranks)})"


@dataclass(frozen=True)
class PrimitiveRecord:
    """Measured cost of one primitive.

    bytes_moved: bytes sent between ranks; bytes_local: bytes copied inside a
    rank; bytes_direct / bytes_packed: of bytes_moved, those sent straight from
    the source tensors (zero copy) / packed into per-message buffers;
    comm_setup_s: the slowest rank's communicator creation time; seconds: wall
    time on the driver (planning, setup, transfer, commit); max_bytes_per_device:
    the most bytes one rank sent or received (the transfer's critical path);
    started: ``time.perf_counter()`` on the driver when the primitive began, after
    it got its workers (so ``[started, started + seconds]`` is when it ran).
    """

    kind: str
    stage: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    num_ranks: int
    seconds: float
    bytes_moved: int = 0
    bytes_local: int = 0
    bytes_direct: int = 0
    bytes_packed: int = 0
    comm_setup_s: float = 0.0
    max_bytes_per_device: int = 0
    started: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
