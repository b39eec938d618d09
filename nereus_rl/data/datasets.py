"""Prompt datasets that users bring: JSONL or Parquet files with a prompt and a
ground-truth answer per row.

Every row is checked when the file is loaded, so a bad file stops a run before its
first step, with a message that names the file and the row (the 1-based line of a
JSONL file, the 1-based row of a Parquet file). Parquet needs the optional package
``pyarrow``; JSONL needs nothing beyond the standard library.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Literal

from nereus_rl.data.tasks import Problem

# The generated word-problem dataset shipped with the package (make_arith_word.py).
ARITH_WORD = Path(__file__).parent / "arith_word.jsonl"
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")

DatasetFormat = Literal["jsonl", "parquet"]


class DatasetError(ValueError):
    """A prompt dataset cannot be used; the message names the file and, where one row is
    at fault, the row."""


class OptionalDependencyError(ImportError):
    """An optional package needed for this input is not installed; the message names the
    package and how to install it."""


@dataclass(frozen=True)
class PromptExample(Problem):
    """One row of a prompt dataset: a :class:`Problem` (prompt and ground-truth answer)
    that also knows where it came from, so a failure while scoring it can name the row.

    Attributes:
        where: the row's place for messages: ``"FILE:LINE"`` for JSONL,
            ``"FILE: row N"`` for Parquet and in-memory records.
        row: the 1-based line (JSONL) or row (Parquet, records).
    """

    where: str = ""
    row: int = 0


class PromptDataset(Sequence[PromptExample]):
    """A non-empty, immutable sequence of :class:`PromptExample`.

    Sampling draws only from the ``random.Random`` it is given, so a trainer that owns
    the generator (and checkpoints its state) gets the same batches on a rerun.
    """

    def __init__(self, examples: Iterable[PromptExample], source: str = "") -> None:
        """Arguments:
            examples: the rows, in file order.
            source: where they came from (a path), for messages.

        Raises:
            DatasetError: no rows.
        """
        self._examples = tuple(examples)
        self.source = source
        if not self._examples:
            raise DatasetError(f"{source or 'dataset'}: the dataset holds no rows")

    @classmethod
    def from_records(
        cls,
        records: Iterable[Mapping[str, object]],
        prompt_field: str = "prompt",
        answer_field: str | None = "answer",
        source: str = "<records>",
    ) -> PromptDataset:
        """A dataset from in-memory mappings, checked like a file's rows.

        Arguments:
            records: one mapping per row.
            prompt_field: the key of the prompt (a non-empty string).
            answer_field: the key of the ground truth (a string or a number), or None for
                datasets whose reward function needs no answer (every answer is ``""``).
            source: a name for messages.

        Raises:
            DatasetError: a row that is not a mapping, lacks a field or holds a bad value;
                no rows.
        """
        out = []
        for i, rec in enumerate(records, start=1):
            where = f"{source}: row {i}"
            if not isinstance(rec, Mapping):
                raise DatasetError(f"{where}: expected a mapping, got {type(rec).__name__}")
            out.append(_example(rec, prompt_field, answer_field, where, i))
        return cls(out, source)

    def __len__(self) -> int:
        return len(self._examples)

    def __getitem__(self, index):  # type: ignore[override]  # int -> row, slice -> tuple
        return self._examples[index]

    def __iter__(self) -> Iterator[PromptExample]:
        return iter(self._examples)

    def __repr__(self) -> str:
        return f"PromptDataset({self.source or 'inline'}: {len(self)} rows)"

    def sample(self, n: int, rng: random.Random, *, replace: bool = False) -> list[PromptExample]:
        """``n`` rows drawn from ``rng`` (the same generator state gives the same rows).

        Arguments:
            n: rows to draw (>= 0).
            rng: the caller's generator; only it is consumed.
            replace: draw with replacement (allows ``n`` above the dataset's size).

        Raises:
            ValueError: negative ``n``, or ``n`` above the size without ``replace``.
        """
        if n < 0:
            raise ValueError(f"cannot sample {n} rows")
        if replace:
            return rng.choices(self._examples, k=n)
        if n > len(self._examples):
            raise ValueError(
                f"cannot draw {n} distinct rows from {self!r}; pass replace=True or use a "
                "smaller batch"
            )
        return rng.sample(self._examples, n)


def load_prompts(
    path: str | Path,
    prompt_field: str = "prompt",
    answer_field: str | None = "answer",
    *,
    format: DatasetFormat | None = None,
) -> PromptDataset:
    """Load and check a prompt dataset.

    Arguments:
        path: a ``.jsonl``/``.ndjson`` file (one JSON object per line; blank lines are
            skipped) or a ``.parquet``/``.pq`` file.
        prompt_field: the field holding the prompt (a non-empty string).
        answer_field: the field holding the ground truth: a string, or an integer or
            finite float (kept as its decimal text, ``0.5`` -> ``"0.5"``). None when the
            reward function needs no answer: every answer is then ``""``.
        format: ``"jsonl"`` or ``"parquet"`` when the file's suffix does not say.

    Returns:
        The rows, in file order.

    Raises:
        DatasetError: a missing or unreadable file, an unknown suffix, a malformed row, a
            row without the named fields, a prompt that is not a non-empty string, an
            answer that is not a string or number, or no rows. The message names the
            file and the row.
        OptionalDependencyError: a Parquet file without ``pyarrow`` installed.
    """
    path = Path(path)
    fmt = format or _format_of(path)
    if not path.exists():
        raise DatasetError(f"{path}: no such file")
    if not path.is_file():
        raise DatasetError(f"{path}: not a file")
    if fmt == "jsonl":
        examples = _read_jsonl(path, prompt_field, answer_field)
    elif fmt == "parquet":
        examples = _read_parquet(path, prompt_field, answer_field)
    else:
        raise DatasetError(f"{path}: unknown format {fmt!r}; use 'jsonl' or 'parquet'")
    return PromptDataset(examples, str(path))


def _format_of(path: Path) -> DatasetFormat:
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    raise DatasetError(
        f"{path}: cannot tell the format from the suffix {suffix!r}; use one of "
        f"{', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)} or pass format='jsonl'/'parquet'"
    )


def _answer_text(value: object, field: str, where: str) -> str:
    if isinstance(value, str):
        return value
    # bool is an int to Python but never a ground truth; it is more likely a wrong field.
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise DatasetError(f"{where}: field {field!r} is {value!r}, not a finite number")
        # Plain decimal text (no exponent), so verifiers read 1e-05 as 0.00001 exactly.
        text = format(Decimal(repr(value)), "f")
        return text[:-2] if text.endswith(".0") else text
    raise DatasetError(
        f"{where}: field {field!r} is {type(value).__name__} ({_short(value)}); the ground "
        "truth must be a string or a number"
    )


def _example(
    record: Mapping[str, object],
    prompt_field: str,
    answer_field: str | None,
    where: str,
    row: int,
) -> PromptExample:
    for field in (prompt_field, answer_field):
        if field is not None and field not in record:
            have = ", ".join(repr(k) for k in list(record)[:10]) or "none"
            raise DatasetError(f"{where}: no field {field!r} (the row's fields: {have})")
    prompt = record[prompt_field]
    if not isinstance(prompt, str):
        raise DatasetError(
            f"{where}: field {prompt_field!r} is {type(prompt).__name__} ({_short(prompt)}), "
            "not a string"
        )
    if not prompt.strip():
        raise DatasetError(f"{where}: field {prompt_field!r} is an empty prompt")
    answer = "" if answer_field is None else _answer_text(record[answer_field], answer_field, where)
    return PromptExample(prompt, answer, where, row)


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _read_jsonl(path: Path, prompt_field: str, answer_field: str | None) -> list[PromptExample]:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DatasetError(f"{path}: cannot read the file ({e})") from None
    out = []
    # Split bytes, not text, so an undecodable byte is reported at its own line.
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        where = f"{path}:{lineno}"
        if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]  # a UTF-8 byte-order mark, as some editors write
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DatasetError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{where}: invalid JSON ({e.msg}, column {e.colno})") from None
        if not isinstance(record, dict):
            raise DatasetError(f"{where}: expected a JSON object, got {type(record).__name__}")
        out.append(_example(record, prompt_field, answer_field, where, lineno))
    if not out:
        raise DatasetError(f"{path}: the dataset holds no rows")
    return out


def _import_pyarrow_parquet(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise OptionalDependencyError(
            f"{path}: reading Parquet needs the package 'pyarrow', which is not installed; "
            "install it with `pip install pyarrow`, or convert the file to JSONL"
        ) from None
    return pq


def _read_parquet(path: Path, prompt_field: str, answer_field: str | None) -> list[PromptExample]:
    pq = _import_pyarrow_parquet(path)
    try:
        names = list(pq.read_schema(path).names)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError and others for bad files
        raise DatasetError(f"{path}: not a readable Parquet file ({e})") from None
    fields = [f for f in (prompt_field, answer_field) if f is not None]
    for field in fields:
        if field not in names:
            have = ", ".join(repr(n) for n in names[:10]) or "none"
            raise DatasetError(f"{path}: row 1: no field {field!r} (the file's columns: {have})")
    try:
        table = pq.read_table(path, columns=fields)
    except Exception as e:
        raise DatasetError(f"{path}: cannot read the Parquet data ({e})") from None
    columns = {f: table.column(f).to_pylist() for f in fields}
    out = []
    for i in range(table.num_rows):
        record = {f: columns[f][i] for f in fields}
        out.append(_example(record, prompt_field, answer_field, f"{path}: row {i + 1}", i + 1))
    if not out:
        raise DatasetError(f"{path}: the dataset holds no rows")
    return out
