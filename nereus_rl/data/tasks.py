"""Bundled verifiable tasks, a character-level tokenizer, a supervised warm start,
and response-length schedules (a curriculum, or a trace replayed from a file).

Every task has a *level* that sets how long its responses are, so the RL loop
can make responses longer over a run (:class:`LengthCurriculum`) or follow a
recorded length trace (:class:`LengthTrace`). Prompts of one level have one
length, so a batch needs no padding mask. Rewards are rules: 1.0 for the exact
answer followed by EOS, else (with ``partial_credit``) half the share of answer
characters in the right place.

Tasks:
    ``addition``: ``"0347+0291="`` -> the sum, zero-padded to level+1 digits and written
        least-significant digit first (``"8360"`` for 638); level = digits per operand.
        Reversed digits let a small model carry left to right, as it generates.
    ``reverse``: ``"hello|"`` -> ``"olleh"``; level = string length.
    ``sort``: ``"dbca|"`` -> ``"abcd"``; level = string length.
"""

from __future__ import annotations

import csv
import json
import math
import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F

from nereus_rl.models.generate import generate

DATA_DIR = Path(__file__).parent
DEFAULT_TRACE = DATA_DIR / "length_trace.csv"


class UnknownTaskError(ValueError):
    """A task name is not one of :data:`TASKS`."""


class TraceFormatError(ValueError):
    """A response-length trace file is malformed; the message names the file and line."""


class CharTokenizer:
    """Character-level tokenizer: id 0 is PAD, 1 is EOS, then one id per character."""

    PAD = 0
    EOS = 1
    CHARS = "0123456789abcdefghijklmnopqrstuvwxyz+=|"

    def __init__(self) -> None:
        self._ids = {c: i + 2 for i, c in enumerate(self.CHARS)}

    @property
    def vocab_size(self) -> int:
        return len(self.CHARS) + 2

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``.

        Raises:
            ValueError: a character outside :attr:`CHARS`.
        """
        try:
            return [self._ids[c] for c in text]
        except KeyError as e:
            raise ValueError(
                f"character {e.args[0]!r} in {text!r} is not in the tokenizer's alphabet "
                f"{self.CHARS!r}"
            ) from None

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` up to the first EOS; PAD is skipped and ids past the alphabet
        (a model's vocab may be larger) read as ``?``, which no answer contains."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.EOS:
                break
            if i >= 2:
                out.append(self.CHARS[i - 2] if i - 2 < len(self.CHARS) else "?")
        return "".join(out)


TOKENIZER = CharTokenizer()


@dataclass(frozen=True)
class Problem:
    """One prompt and its verifiable answer (without EOS)."""

    prompt: str
    answer: str


class Task:
    """A verifiable task family. Subclasses define ``_make`` and ``response_len``."""

    name = "task"
    min_level = 1
    max_level = 1
    # Warm-start defaults: enough for a policy that sometimes succeeds, so RL has a signal.
    warm_levels = (1, 1)
    warm_lr = 3e-3

    def __init__(self, partial_credit: bool = True) -> None:
        self.partial_credit = partial_credit

    def response_len(self, level: int) -> int:
        """Tokens of a correct response at ``level``, EOS included."""
        raise NotImplementedError

    def _make(self, level: int, rng: random.Random) -> Problem:
        raise NotImplementedError

    def check_level(self, level: int) -> None:
        """Raise ValueError unless ``min_level <= level <= max_level``."""
        if not self.min_level <= level <= self.max_level:
            raise ValueError(
                f"task {self.name!r} has levels {self.min_level}..{self.max_level}, got {level}"
            )

    def level_for_response_len(self, length: int) -> int:
        """The highest level whose responses fit in ``length`` tokens (clamped to the range)."""
        level = self.min_level
        while level < self.max_level and self.response_len(level + 1) <= length:
            level += 1
        return level

    def sample(self, n: int, level: int, rng: random.Random) -> list[Problem]:
        """``n`` problems of ``level`` drawn from ``rng`` (all prompts the same length)."""
        self.check_level(level)
        return [self._make(level, rng) for _ in range(n)]

    def reward(self, problem: Problem, response: str) -> float:
        """1.0 for the exact answer; else half the share of answer characters in place
        (with ``partial_credit``) or 0.0."""
        if response == problem.answer:
            return 1.0
        if not self.partial_credit:
            return 0.0
        hits = sum(a == b for a, b in zip(problem.answer, response))
        return 0.5 * hits / max(len(problem.answer), len(response))


class Addition(Task):
    name = "addition"
    min_level = 1
    max_level = 12
    # Mixing in 2-digit sums within 300 steps leaves the tiny model at ~0% on both.
    warm_levels = (1, 1)
    warm_lr = 1e-2

    def response_len(self, level: int) -> int:
        return level + 2

    def _make(self, level: int, rng: random.Random) -> Problem:
        a, b = rng.randrange(10**level), rng.randrange(10**level)
        prompt = f"{a:0{level}d}+{b:0{level}d}="
        return Problem(prompt, f"{a + b:0{level + 1}d}"[::-1])


class _StringTask(Task):
    min_level = 2
    max_level = 40
    warm_levels = (2, 4)
    alphabet = "abcdefghij"

    def response_len(self, level: int) -> int:
        return level + 1

    def _transform(self, s: str) -> str:
        raise NotImplementedError

    def _make(self, level: int, rng: random.Random) -> Problem:
        s = "".join(rng.choice(self.alphabet) for _ in range(level))
        return Problem(s + "|", self._transform(s))


class Reverse(_StringTask):
    name = "reverse"

    def _transform(self, s: str) -> str:
        return s[::-1]


class Sort(_StringTask):
    name = "sort"

    def _transform(self, s: str) -> str:
        return "".join(sorted(s))


TASKS: dict[str, type[Task]] = {"addition": Addition, "reverse": Reverse, "sort": Sort}


def get_task(name: str, **kwargs) -> Task:
    """A task by name (``addition``, ``reverse``, ``sort``).

    Raises:
        UnknownTaskError: unknown name.
    """
    if name not in TASKS:
        raise UnknownTaskError(f"unknown task {name!r}; choose one of {sorted(TASKS)}")
    return TASKS[name](**kwargs)


def encode_prompts(problems: Sequence[Problem], tokenizer: CharTokenizer = TOKENIZER):
    """Prompt ids [B, P] (every prompt must have the same length).

    Raises:
        ValueError: prompts of different lengths (sample a batch from one level).
    """
    ids = [tokenizer.encode(p.prompt) for p in problems]
    if len({len(i) for i in ids}) > 1:
        raise ValueError("prompts in a batch must share one length; sample them at one level")
    return torch.tensor(ids, dtype=torch.long)


def score_responses(
    task: Task,
    problems: Sequence[Problem],
    responses: torch.Tensor,
    tokenizer: CharTokenizer = TOKENIZER,
) -> torch.Tensor:
    """Rewards [B] of generated response ids [B, N] (decoded up to EOS).

    A response that never emits EOS within its limit scores as its decoded text, so it
    can still earn partial credit but never the exact-answer reward unless its text is
    exactly the answer.
    """
    return torch.tensor(
        [task.reward(p, tokenizer.decode(r.tolist())) for p, r in zip(problems, responses)]
    )


# Response-length schedules --------------------------------------------------------


class LengthSchedule(Protocol):
    def response_len(self, step: int) -> int: ...


@dataclass(frozen=True)
class LengthCurriculum:
    """Response length rising linearly from ``start`` to ``end`` tokens over ``num_steps``
    RL steps, then staying at ``end``."""

    start: int
    end: int
    num_steps: int

    def response_len(self, step: int) -> int:
        if self.num_steps <= 1:
            return self.end
        frac = min(max(step, 0) / (self.num_steps - 1), 1.0)
        return round(self.start + (self.end - self.start) * frac)


@dataclass(frozen=True)
class LengthTrace:
    """A recorded response length per RL step (after the last step the last value holds)."""

    lengths: tuple[int, ...]
    source: str = ""

    def response_len(self, step: int) -> int:
        return self.lengths[min(max(step, 0), len(self.lengths) - 1)]

    def __repr__(self) -> str:
        return (
            f"LengthTrace({self.source or 'inline'}: {len(self.lengths)} steps, "
            f"{min(self.lengths)}..{max(self.lengths)} tokens)"
        )

    @classmethod
    def from_file(cls, path: str | Path = DEFAULT_TRACE) -> LengthTrace:
        """Load a trace: CSV with a ``step,response_len`` header (``#`` lines are comments;
        steps 0, 1, 2, ... in order) or JSON (a list of lengths, or
        ``{"response_len": [...]}``).

        Raises:
            TraceFormatError: unreadable file, bad header, a step out of order or a length
                that is not a positive integer; the message names the file and line.
        """
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise TraceFormatError(f"{path}: cannot read the trace file ({e})") from None
        if path.suffix.lower() == ".json":
            return cls(_parse_json_trace(path, text), str(path))
        return cls(_parse_csv_trace(path, text), str(path))


def _positive_int(value, where: str) -> int:
    try:
        n = int(str(value).strip())
    except ValueError:
        n = None
    if n is None or n < 1 or (isinstance(value, float) and value != n):
        raise TraceFormatError(f"{where}: response length {value!r} is not a positive integer")
    return n


def _parse_csv_trace(path: Path, text: str) -> tuple[int, ...]:
    lengths: list[int] = []
    header_seen = False
    for lineno, row in enumerate(csv.reader(text.splitlines()), start=1):
        if not row or row[0].lstrip().startswith("#"):
            continue
        where = f"{path}:{lineno}"
        if not header_seen:
            if [c.strip() for c in row] != ["step", "response_len"]:
                raise TraceFormatError(
                    f"{where}: expected the header 'step,response_len', got {','.join(row)!r}"
                )
            header_seen = True
            continue
        if len(row) != 2:
            raise TraceFormatError(f"{where}: expected 2 fields (step,response_len), got {row}")
        if row[0].strip() != str(len(lengths)):
            raise TraceFormatError(
                f"{where}: expected step {len(lengths)}, got {row[0].strip()!r} "
                "(steps must be 0, 1, 2, ... in order)"
            )
        lengths.append(_positive_int(row[1], where))
    if not lengths:
        raise TraceFormatError(f"{path}: the trace holds no steps")
    return tuple(lengths)


_JSON_SCALAR = re.compile(r'"(?:[^"\\]|\\.)*"|-?\d[\d.eE+-]*|true|false|null')


def _parse_json_trace(path: Path, text: str) -> tuple[int, ...]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceFormatError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    if isinstance(data, dict):
        data = data.get("response_len")
    if not isinstance(data, list) or not data:
        raise TraceFormatError(
            f"{path}:1: expected a non-empty list of lengths or {{'response_len': [...]}}"
        )
    # Offsets of the list's scalars, to name the line of a bad entry.
    scalars = list(_JSON_SCALAR.finditer(text))
    if isinstance(json.loads(text), dict):
        keys = [i for i, m in enumerate(scalars) if m.group() == '"response_len"']
        scalars = scalars[keys[0] + 1 :] if keys else scalars

    def line_of(i: int) -> int:
        pos = scalars[i].start() if i < len(scalars) else len(text)
        return text.count("\n", 0, pos) + 1

    out = []
    for i, v in enumerate(data):
        if isinstance(v, bool) or not isinstance(v, (int, float, str)):
            raise TraceFormatError(f"{path}:{line_of(i)}: entry {i} ({v!r}) is not a length")
        out.append(_positive_int(v, f"{path}:{line_of(i)}: entry {i}"))
    return tuple(out)


# Supervised warm start --------------------------------------------------------------


@dataclass(frozen=True)
class WarmStartResult:
    """What the warm start did: steps, wall seconds, and the last step's loss."""

    steps: int
    seconds: float
    final_loss: float


def _sft_batch(task: Task, level: int, n: int, rng: random.Random, tokenizer: CharTokenizer):
    problems = task.sample(n, level, rng)
    prompts = encode_prompts(problems, tokenizer)
    answers = torch.tensor([[*tokenizer.encode(p.answer), tokenizer.EOS] for p in problems])
    seq = torch.cat([prompts, answers], 1)
    # Predict the answer and EOS only: targets are seq[1:], masked before the answer.
    mask = torch.zeros(seq.shape[0], seq.shape[1] - 1)
    mask[:, prompts.shape[1] - 1 :] = 1.0
    return seq, mask


def warm_start(
    model,
    task: Task,
    *,
    levels: tuple[int, int] | None = None,
    steps: int = 300,
    batch_size: int = 32,
    lr: float | None = None,
    seed: int = 0,
    tokenizer: CharTokenizer = TOKENIZER,
) -> WarmStartResult:
    """Supervised training on correct answers, so RL starts from a policy that sometimes
    succeeds. Single process; trains ``model`` in place with AdamW.

    Arguments:
        model: a single-process policy Decoder (no tp/pp groups).
        task: the task to learn.
        levels: (lowest, highest) level to draw from, one level per batch (default: the
            task's ``warm_levels``).
        steps: optimizer steps.
        batch_size: problems per step.
        lr: peak learning rate (default: the task's ``warm_lr``); linear warm-up over 10%
            of the steps, then cosine decay.
        seed: problem sampling seed.
        tokenizer: the tokenizer (its vocabulary must fit the model's).

    Returns:
        A :class:`WarmStartResult`.

    Raises:
        ValueError: a sharded or critic model, a vocabulary that does not fit, bad levels.
    """
    if model.groups.tp_size > 1 or model.groups.pp_size > 1 or model.is_critic:
        raise ValueError("warm_start trains a single-process policy model (no tp/pp, no critic)")
    if tokenizer.vocab_size > model.config.vocab:
        raise ValueError(
            f"tokenizer has {tokenizer.vocab_size} ids but the model's vocab is "
            f"{model.config.vocab}; use a model with a larger vocab"
        )
    lo, hi = levels or task.warm_levels
    lr = task.warm_lr if lr is None else lr
    task.check_level(lo)
    task.check_level(hi)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0))),
    )
    model.train()
    t0 = time.perf_counter()
    loss = torch.zeros(())
    for _ in range(steps):
        seq, mask = _sft_batch(task, rng.randint(lo, hi), batch_size, rng, tokenizer)
        logits = model(seq[:, :-1])
        nll = F.cross_entropy(logits.transpose(1, 2), seq[:, 1:], reduction="none")
        loss = (nll * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    return WarmStartResult(steps, time.perf_counter() - t0, float(loss.detach()))


@torch.no_grad()
def evaluate(
    model,
    task: Task,
    level: int,
    *,
    n: int = 64,
    seed: int = 1,
    temperature: float = 0.0,
    tokenizer: CharTokenizer = TOKENIZER,
) -> float:
    """Share of ``n`` fresh problems of ``level`` answered exactly (single-process model)."""
    problems = task.sample(n, level, random.Random(seed))
    gen = torch.Generator().manual_seed(seed) if temperature > 0 else None
    out = generate(
        model,
        encode_prompts(problems, tokenizer),
        task.response_len(level),
        temperature=temperature,
        generator=gen,
        eos_id=tokenizer.EOS,
        pad_id=tokenizer.PAD,
    )
    exact = [tokenizer.decode(r.tolist()) == p.answer for p, r in zip(problems, out.responses)]
    return sum(exact) / n
