"""The model-stages of one RL step, with their batch and sequence lengths.

A step runs in three phases, in order (each needs the previous one's output):

    phase 0  generation   rollout
    phase 1  inference    reference, critic_inference, reward
    phase 2  training     actor_train, critic_train

Algorithms:
    PPO:   rollout, reference, critic_inference, reward, actor_train, critic_train.
    GRPO:  rollout samples ``group_size`` responses per prompt; no critic.
    ReMax: rollout also decodes one greedy response per prompt (the baseline) as extra
           work *inside* the rollout stage (no separate stage: it uses the same weights
           and runs in the same batch); the reward stage scores both; no critic.

Reward: ``reward="rule"`` (the trainer's bundled tasks) is a rule-based reward of
negligible cost that needs no device: the stage is part of the workload but not of a
GlobalPlan (``Workload.planned_stages`` leaves it out). Otherwise ``reward`` names a
ModelSpec preset and the stage is a reward-model forward pass.

Response lengths are bucketed (the planner plans for a bucket, not a raw length):
:func:`bucket_of` rounds a length up to the smallest bucket edge that holds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from nereus_rl.core.globalplan import KeepsHash
from nereus_rl.core.spec import ModelSpec, SpecError, model_preset

ALGOS = ("ppo", "grpo", "remax")
DEFAULT_BUCKETS = (256, 512, 1024, 2048, 4096, 8192, 16384)
PHASE_OF = {
    "rollout": 0,
    "reference": 1,
    "critic_inference": 1,
    "reward": 1,
    "actor_train": 2,
    "critic_train": 2,
}


class WorkloadError(SpecError):
    """A workload that cannot be built as asked (bad algorithm, negative length, ...)."""


@dataclass(frozen=True)
class StageWork:
    """One model-stage's work in one step.

    Attributes:
        stage, model: names as in GlobalPlan (``"rollout"``/``"actor"``, ...).
        kind: ``"generate"``, ``"forward"``, ``"train"`` or ``"rule"`` (no device).
        model_spec: the architecture (None for a rule-based reward).
        value_head: the output is one scalar per token (critic, reward model), not logits.
        num_samples: sequences processed per step (summed over data-parallel units).
        prompt_len, response_len: tokens per sequence (response_len is a bucket edge).
        micro_batch: sequences per micro-batch (forward and train stages).
        epochs: passes over the samples per step (train stages).
    """

    stage: str
    model: str
    kind: str
    model_spec: ModelSpec | None
    value_head: bool
    num_samples: int
    prompt_len: int
    response_len: int
    micro_batch: int = 1
    epochs: int = 1

    @property
    def phase(self) -> int:
        return PHASE_OF[self.stage]

    @property
    def trains(self) -> bool:
        return self.kind == "train"

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    def __repr__(self) -> str:
        m = self.model_spec.name if self.model_spec else "rule"
        return f"{self.stage}({self.kind} {m} n={self.num_samples} s={self.seq_len})"


@dataclass(frozen=True)
class Workload(KeepsHash):
    """The stages of one RL step (in execution order) and the step's shape.

    ``rollout_ahead``: asynchronous RL, the next step's rollout runs beside this step's
    inference and training (``nereus_rl.costmodel.overlap`` prices the overlap); False:
    the phases run one after another.
    """

    algo: str
    stages: tuple[StageWork, ...]
    batch: int
    prompt_len: int
    response_len: int
    dtype: str = "bf16"
    rollout_ahead: bool = False

    @property
    def planned_stages(self) -> tuple[StageWork, ...]:
        """The stages that need devices (all but a rule-based reward)."""
        # kept on the (immutable) workload: pricing a plan reads it several times
        got = self.__dict__.get("_planned")
        if got is None:
            got = tuple(s for s in self.stages if s.kind != "rule")
            object.__setattr__(self, "_planned", got)
        return got

    @property
    def stage_order(self) -> tuple[tuple[str, int], ...]:
        """(stage, phase) of each planned stage, in execution order (kept, as
        :attr:`planned_stages`)."""
        got = self.__dict__.get("_order")
        if got is None:
            got = tuple((s.stage, s.phase) for s in self.planned_stages)
            object.__setattr__(self, "_order", got)
        return got

    def _hash_key(self) -> tuple:
        return (
            self.algo, self.stages, self.batch, self.prompt_len, self.response_len,
            self.dtype, self.rollout_ahead,
        )  # fmt: skip

    # kept once (KeepsHash): hashing the nested stages on every cache lookup was most of
    # a lookup's cost
    __hash__ = KeepsHash._cached_hash

    def stage(self, name: str) -> StageWork:
        for s in self.stages:
            if s.stage == name:
                return s
        raise KeyError(f"no stage {name!r}; stages are {[s.stage for s in self.stages]}")

    def with_response_len(self, response_len: int) -> Workload:
        """The same workload planned for another response-length bucket.

        Raises:
            WorkloadError: a negative length.
        """
        if response_len < 0:
            raise WorkloadError(f"response_len={response_len} is negative")
        # Kept per length on this (immutable) workload: a job asks for the same few
        # bucket edges over and over, and the planner keys its per-workload work by the
        # object (``Planner.plan``), so the same bucket gives the same object.
        memo = self.__dict__.get("_by_len")
        if memo is None:
            memo = {}
            object.__setattr__(self, "_by_len", memo)
        got = memo.get(response_len)
        if got is None:
            if len(memo) >= 64:
                memo.clear()
            stages = tuple(replace(s, response_len=response_len) for s in self.stages)
            got = memo[response_len] = replace(self, stages=stages, response_len=response_len)
        return got

    def __getstate__(self) -> dict:
        # The per-length memo is a cache: not pickled or copied with the workload (nor is
        # the kept hash: KeepsHash).
        state = super().__getstate__()
        for k in ("_by_len", "_planned", "_order"):
            state.pop(k, None)
        return state

    def __repr__(self) -> str:
        return (
            f"Workload({self.algo}{' async' if self.rollout_ahead else ''} batch={self.batch} "
            f"prompt={self.prompt_len} response={self.response_len}: "
            + ", ".join(repr(s) for s in self.stages)
            + ")"
        )


def bucket_of(length: float, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int:
    """The smallest bucket edge >= ``length`` (above the last edge: the next power of two).

    Raises:
        WorkloadError: a negative length.
    """
    if length < 0:
        raise WorkloadError(f"sequence length {length} is negative; lengths are token counts")
    for b in buckets:
        if length <= b:
            return int(b)
    p = 1
    while p < length:
        p *= 2
    return p


def response_bucket(
    lengths: Sequence[float], buckets: Sequence[int] = DEFAULT_BUCKETS, quantile: float = 0.9
) -> int:
    """Bucket of the ``quantile`` of an observed response-length distribution.

    Decoding a batch lasts as long as its long responses, so the plan is made for a
    high quantile rather than the mean.

    Raises:
        WorkloadError: empty input or a negative length.
    """
    if not lengths:
        raise WorkloadError("no response lengths given; pass at least one observed length")
    s = sorted(lengths)
    if s[0] < 0:
        raise WorkloadError(f"response length {s[0]} is negative")
    idx = min(len(s) - 1, int(quantile * len(s)))
    return bucket_of(s[idx], buckets)


def make_workload(
    algo: str,
    *,
    actor: str | ModelSpec = "llama-3.1-8b",
    critic: str | ModelSpec | None = None,
    reference: bool = True,
    reward: str | ModelSpec = "rule",
    batch: int = 256,
    prompt_len: int = 1024,
    response_len: int = 1024,
    group_size: int = 1,
    micro_batch: int = 1,
    infer_micro_batch: int | None = None,
    epochs: int = 1,
    dtype: str = "bf16",
    rollout_ahead: bool = False,
) -> Workload:
    """Build the workload of one RL step.

    Arguments:
        algo: ``"ppo"``, ``"grpo"`` or ``"remax"``.
        actor: actor ModelSpec or preset name; ``critic`` defaults to the actor's
            architecture (PPO only); ``reference`` adds the KL reference forward.
        reward: ``"rule"`` (no device) or a reward-model ModelSpec / preset name.
        batch: prompts per step; ``group_size`` responses per prompt (GRPO's group;
            1 otherwise).
        prompt_len, response_len: tokens; ``response_len`` is used as given (bucket it
            with :func:`bucket_of` first if it is a raw observation).
        micro_batch: sequences per training micro-batch; ``infer_micro_batch`` per
            inference micro-batch (default 4x ``micro_batch``).
        epochs: PPO epochs over the step's samples.
        dtype: compute dtype of the devices' peak rate.
        rollout_ahead: asynchronous RL (the next step's rollout beside this step's
            work; see :class:`Workload`).

    Returns:
        The Workload.

    Raises:
        WorkloadError: unknown algorithm, non-positive batch, negative lengths.
        SpecError: unknown preset name.
    """
    if algo not in ALGOS:
        raise WorkloadError(f"unknown algorithm {algo!r}; use one of {ALGOS}")
    for name, v in (("prompt_len", prompt_len), ("response_len", response_len)):
        if v < 0:
            raise WorkloadError(f"{name}={v} is negative; lengths are token counts")
    for name, v in (("batch", batch), ("group_size", group_size), ("micro_batch", micro_batch)):
        if v < 1:
            raise WorkloadError(f"{name}={v} must be >= 1")
    act = model_preset(actor) if isinstance(actor, str) else actor
    imb = infer_micro_batch or 4 * micro_batch
    if algo != "grpo" and group_size != 1:
        raise WorkloadError(f"group_size={group_size} is for GRPO only; {algo} samples one")
    samples = batch * group_size
    rollout_samples = samples * (2 if algo == "remax" else 1)
    p, r = prompt_len, response_len

    def sw(stage, model, kind, spec, n, value=False, mb=imb):
        return StageWork(stage, model, kind, spec, value, n, p, r, mb, epochs)

    stages = [sw("rollout", "actor", "generate", act, rollout_samples)]
    if reference:
        stages.append(sw("reference", "reference", "forward", act, samples))
    if algo == "ppo":
        crit = (
            act if critic is None else (model_preset(critic) if isinstance(critic, str) else critic)
        )
        stages.append(sw("critic_inference", "critic", "forward", crit, samples, True))
    elif critic is not None:
        raise WorkloadError(f"{algo} has no critic; drop critic={critic!r}")
    reward_n = rollout_samples  # ReMax scores the greedy baseline too
    if reward == "rule":
        stages.append(sw("reward", "reward", "rule", None, reward_n))
    else:
        rm = model_preset(reward) if isinstance(reward, str) else reward
        stages.append(sw("reward", "reward", "forward", rm, reward_n, True))
    stages.append(sw("actor_train", "actor", "train", act, samples, mb=micro_batch))
    if algo == "ppo":
        stages.append(sw("critic_train", "critic", "train", crit, samples, True, micro_batch))
    return Workload(algo, tuple(stages), batch, prompt_len, response_len, dtype, rollout_ahead)
