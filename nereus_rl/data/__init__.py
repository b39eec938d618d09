"""Prompt data and rewards: bundled verifiable tasks, a character-level tokenizer, a
supervised warm start, and response-length schedules (a curriculum or a recorded trace,
``length_trace.csv``).

The bundled tasks are in :mod:`.tasks`. Data that users bring: prompt datasets from
JSONL or Parquet files (:mod:`.datasets`), built-in verifiers (:mod:`.verifiers`), user
reward functions loaded by name (:mod:`.rewards`), Hugging Face tokenizers from a model
folder (:mod:`.tokenizers`), what the trainer asks of either kind of prompts
(:mod:`.prompts`), and a generated arithmetic word-problem dataset, ``arith_word.jsonl``
(:mod:`.make_arith_word`). Imports ``nereus_rl.core`` and
``nereus_rl.models`` (the warm start and evaluation generate with the model) only; the
trainer uses it.
"""

from nereus_rl.data.datasets import (
    ARITH_WORD,
    DatasetError,
    OptionalDependencyError,
    PromptDataset,
    PromptExample,
    load_prompts,
)
from nereus_rl.data.prompts import DatasetPrompts, TaskPrompts, as_reward, dataset_prompts
from nereus_rl.data.rewards import (
    RewardFn,
    RewardFnError,
    RewardFunction,
    RewardRuntimeError,
    check_reward_fn,
    load_reward_fn,
    resolve_reward,
    wrap_reward_fn,
)
from nereus_rl.data.tasks import (
    DEFAULT_TRACE,
    TASKS,
    TOKENIZER,
    CharTokenizer,
    LengthCurriculum,
    LengthSchedule,
    LengthTrace,
    Problem,
    Task,
    TraceFormatError,
    UnknownTaskError,
    WarmStartResult,
    encode_prompts,
    evaluate,
    get_task,
    score_responses,
    warm_start,
)
from nereus_rl.data.tokenizers import HFTokenizer, TokenizerError, load_tokenizer
from nereus_rl.data.verifiers import (
    VERIFIERS,
    UnknownVerifierError,
    Verifier,
    VerifierError,
    exact_match,
    final_number,
    format_check,
    get_verifier,
    make_format_check,
    normalize_whitespace,
    numeric_match,
)

__all__ = [
    "ARITH_WORD",
    "DEFAULT_TRACE",
    "TASKS",
    "TOKENIZER",
    "VERIFIERS",
    "CharTokenizer",
    "DatasetError",
    "DatasetPrompts",
    "HFTokenizer",
    "LengthCurriculum",
    "LengthSchedule",
    "LengthTrace",
    "OptionalDependencyError",
    "Problem",
    "PromptDataset",
    "PromptExample",
    "RewardFn",
    "RewardFnError",
    "RewardFunction",
    "RewardRuntimeError",
    "Task",
    "TaskPrompts",
    "TokenizerError",
    "TraceFormatError",
    "UnknownTaskError",
    "UnknownVerifierError",
    "Verifier",
    "VerifierError",
    "WarmStartResult",
    "as_reward",
    "check_reward_fn",
    "dataset_prompts",
    "encode_prompts",
    "evaluate",
    "exact_match",
    "final_number",
    "format_check",
    "get_task",
    "get_verifier",
    "load_prompts",
    "load_reward_fn",
    "load_tokenizer",
    "make_format_check",
    "normalize_whitespace",
    "numeric_match",
    "resolve_reward",
    "score_responses",
    "warm_start",
    "wrap_reward_fn",
]
