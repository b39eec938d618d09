"""Prompt data and rewards: bundled verifiable tasks, a character-level tokenizer, a
supervised warm start, and response-length schedules (a curriculum or a recorded trace,
``length_trace.csv``).

Everything is in :mod:`.tasks`. Imports ``nereus_rl.core`` and ``nereus_rl.models`` (the
warm start and evaluation generate with the model) only; the trainer uses it.
"""

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

__all__ = [
    "DEFAULT_TRACE",
    "TASKS",
    "TOKENIZER",
    "CharTokenizer",
    "LengthCurriculum",
    "LengthSchedule",
    "LengthTrace",
    "Problem",
    "Task",
    "TraceFormatError",
    "UnknownTaskError",
    "WarmStartResult",
    "encode_prompts",
    "evaluate",
    "get_task",
    "score_responses",
    "warm_start",
]
