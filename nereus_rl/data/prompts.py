"""What the trainer asks of its prompts: draw a step's problems, turn them into token ids,
score the responses.

:class:`TaskPrompts` serves a bundled task (character tokenizer, prompts of one length,
the task's rule reward); :class:`DatasetPrompts` serves a prompt dataset that a user
brings, with a Hugging Face tokenizer and a reward function (a built-in verifier or the
user's), its prompts left-padded to the longest of the batch with an attention mask.
:func:`dataset_prompts` loads and checks all of it before a run starts, so bad input
stops the run before its first step, with an error that names the file and row or the
function.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from nereus_rl.data.datasets import DatasetError, PromptDataset, PromptExample, load_prompts
from nereus_rl.data.rewards import (
    RewardFnError,
    RewardFunction,
    check_reward_fn,
    resolve_reward,
    wrap_reward_fn,
)
from nereus_rl.data.tasks import TOKENIZER, Problem, Task, encode_prompts, score_responses
from nereus_rl.data.tokenizers import HFTokenizer, load_tokenizer
from nereus_rl.models.generate import left_pad


class TaskPrompts:
    """A bundled task's prompts (see the module docstring); every prompt of a level has
    one length, so no attention mask is built."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.eos_id: int = TOKENIZER.EOS
        self.pad_id: int = TOKENIZER.PAD

    def encode(self, problems: Sequence[Problem]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Prompt ids [B, P], and None (no padding)."""
        return encode_prompts(problems), None

    def score(self, problems: Sequence[Problem], responses: torch.Tensor) -> torch.Tensor:
        """Rewards [B] of response ids [B, N]."""
        return score_responses(self.task, problems, responses)


class DatasetPrompts:
    """A prompt dataset's prompts, its tokenizer and its reward function.

    Acts as the trainer's task too (``sample``, ``level_for_response_len`` and, for the
    cost model, ``prompt_len``): a dataset has one level, 0.

    Arguments:
        dataset: the rows.
        tokenizer: encodes prompts and decodes responses.
        reward: scores a decoded response against its row's ground truth.
    """

    name = "dataset"

    def __init__(
        self, dataset: PromptDataset, tokenizer: HFTokenizer, reward: RewardFunction
    ) -> None:
        self.dataset = dataset
        self.tokenizer = tokenizer
        self.reward = reward
        self.eos_id = tokenizer.eos_id
        self.pad_id = tokenizer.pad_id
        # Every row once, up front: the longest prompt is known before the first step
        # (the length check, the cost model's prompt length) and no step re-tokenizes.
        self._ids: dict[PromptExample, list[int]] = {}
        for ex in dataset:
            ids = tokenizer.encode(ex.prompt)
            if not ids:
                raise DatasetError(f"{ex.where}: the prompt encodes to no tokens")
            self._ids[ex] = ids
        self.longest = max(dataset, key=lambda ex: len(self._ids[ex]))
        self.max_prompt_len = len(self._ids[self.longest])

    def __repr__(self) -> str:
        return f"DatasetPrompts({self.dataset!r}, {self.tokenizer!r}, {self.reward!r})"

    # -- the task interface

    def level_for_response_len(self, length: int) -> int:
        """A dataset has one level."""
        return 0

    def sample(self, n: int, level: int, rng: random.Random) -> list[PromptExample]:
        """``n`` rows from ``rng`` (with replacement when the dataset is smaller)."""
        return self.dataset.sample(n, rng, replace=n > len(self.dataset))

    def prompt_len(self, response_len: int) -> int:
        """The prompt width the cost model prices: the longest prompt (a batch is padded
        to its longest, which a batch of a few rows comes close to)."""
        return self.max_prompt_len

    # -- ids and rewards

    def encode(self, problems: Sequence[PromptExample]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Left-padded prompt ids [B, P] and their mask [B, P] (None when every prompt
        has the same length: the unmasked path)."""
        rows = [torch.tensor(self._ids.get(p) or self.tokenizer.encode(p.prompt)) for p in problems]
        ids, mask = left_pad(rows, self.pad_id)
        return ids, (None if bool(mask.all()) else mask)

    def decode(self, responses: torch.Tensor) -> list[str]:
        """The text of each response's ids [B, N] (up to its EOS)."""
        return [self.tokenizer.decode(r.tolist()) for r in responses]

    def score(self, problems: Sequence[PromptExample], responses: torch.Tensor) -> torch.Tensor:
        """Rewards [B] of response ids [B, N], decoded and scored against each row's answer.

        Raises:
            RewardRuntimeError: the reward function raised or returned a non-number; the
                message names the function and the row.
        """
        return torch.tensor(self.reward.score(problems, self.decode(responses)))


def as_reward(reward_fn: str | Callable[..., object] | None) -> RewardFunction:
    """A reward function from what ``train(reward_fn=...)`` takes: a built-in verifier's
    name, ``"module:function"`` / ``"path/to/file.py:function"``, or a callable.

    Raises:
        RewardFnError: None, or see :func:`~nereus_rl.data.rewards.resolve_reward`.
    """
    if reward_fn is None:
        raise RewardFnError(
            "a prompt dataset needs a reward function: reward_fn='numeric' (or 'exact', "
            "'format'), 'module:function', or a callable fn(prompt, response, answer)"
        )
    if isinstance(reward_fn, str):
        return resolve_reward(reward_fn)
    return wrap_reward_fn(reward_fn)


def dataset_prompts(
    data: str | Path,
    tokenizer: str | Path,
    reward_fn: str | Callable[..., object] | None,
    *,
    vocab: int,
    max_seq_len: int,
    max_response_len: int,
    prompt_field: str = "prompt",
    answer_field: str | None = "answer",
) -> DatasetPrompts:
    """Load and check a run's prompts: the dataset, the tokenizer, the reward function.

    Arguments:
        data: a JSONL or Parquet file (:func:`~nereus_rl.data.datasets.load_prompts`).
        tokenizer: the folder of the tokenizer (the model's folder, usually).
        reward_fn: see :func:`as_reward`; it is called once on the first row (its answer
            as the response) before anything else runs.
        vocab: the model's vocabulary size (the tokenizer's ids must fit).
        max_seq_len: the model's longest sequence.
        max_response_len: the run's longest response limit.
        prompt_field, answer_field: the dataset's fields.

    Raises:
        DatasetError: see ``load_prompts``; or a prompt too long for the model with the
            run's responses (naming the row).
        TokenizerError: see :func:`~nereus_rl.data.tokenizers.load_tokenizer`.
        RewardFnError: the function cannot be loaded, raises or returns a non-number.
    """
    reward = as_reward(reward_fn)
    dataset = load_prompts(data, prompt_field, answer_field)
    tok = load_tokenizer(tokenizer, vocab=vocab)
    check_reward_fn(reward, dataset[0].prompt, dataset[0].answer)
    out = DatasetPrompts(dataset, tok, reward)
    if out.max_prompt_len + max_response_len > max_seq_len:
        raise DatasetError(
            f"{out.longest.where}: the prompt is {out.max_prompt_len} tokens, and with "
            f"{max_response_len}-token responses exceeds the model's max_seq_len={max_seq_len}"
            " (max_position_embeddings); shorten the prompts or the response limit"
        )
    return out
