"""Prompt datasets: JSONL and Parquet loading, every bad-input error (naming the file
and the row), and deterministic sampling."""

import json
import random
import re
import sys

import pytest

from nereus_rl.data import (
    DatasetError,
    OptionalDependencyError,
    Problem,
    PromptDataset,
    PromptExample,
    load_prompts,
)


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


ROWS = [{"prompt": f"what is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(10)]


def test_jsonl(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    ds = load_prompts(path)
    assert len(ds) == 10
    assert [e.prompt for e in ds] == [r["prompt"] for r in ROWS]
    assert ds[3] == PromptExample("what is 3 + 1?", "#### 4", f"{path}:4", 4)
    assert isinstance(ds[0], Problem)  # usable wherever the trainer takes a Problem
    assert ds.source == str(path) and "10 rows" in repr(ds)
    assert [e.row for e in ds[2:4]] == [3, 4]


def test_jsonl_field_names_blank_lines_bom_and_numbers(tmp_path):
    path = tmp_path / "d.ndjson"
    lines = [
        json.dumps({"question": "q1", "gt": 42, "extra": [1]}),
        "",
        "   ",
        json.dumps({"question": "q2", "gt": 0.5}),
        json.dumps({"question": "q3", "gt": 1e-05}),
        json.dumps({"question": "q4", "gt": 3.0}),
    ]
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode())
    ds = load_prompts(path, prompt_field="question", answer_field="gt")
    assert [(e.answer, e.row) for e in ds] == [("42", 1), ("0.5", 4), ("0.00001", 5), ("3", 6)]


def test_no_answer_field(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p"}])
    assert load_prompts(path, answer_field=None)[0].answer == ""


def test_format_override(tmp_path):
    path = write_jsonl(tmp_path / "d.txt", ROWS[:2])
    with pytest.raises(DatasetError, match=r"d\.txt: cannot tell the format.*'\.txt'"):
        load_prompts(path)
    assert len(load_prompts(path, format="jsonl")) == 2


@pytest.mark.parametrize(
    "lines, line, message",
    [
        ([ROWS[0], "{not json"], 2, "invalid JSON"),
        ([ROWS[0], ROWS[1], "[1, 2]"], 3, "expected a JSON object, got list"),
        ([ROWS[0], {"answer": "1"}], 2, "no field 'prompt' \\(the row's fields: 'answer'\\)"),
        ([{"prompt": "p"}], 1, "no field 'answer'"),
        ([ROWS[0], {"prompt": 7, "answer": "1"}], 2, "field 'prompt' is int \\(7\\), not a string"),
        ([{"prompt": None, "answer": "1"}], 1, "field 'prompt' is NoneType"),
        ([{"prompt": "  ", "answer": "1"}], 1, "field 'prompt' is an empty prompt"),
        ([{"prompt": "p", "answer": None}], 1, "field 'answer' is NoneType"),
        ([{"prompt": "p", "answer": True}], 1, "field 'answer' is bool"),
        ([{"prompt": "p", "answer": [1]}], 1, "field 'answer' is list"),
        (['{"prompt": "p", "answer": NaN}'], 1, "field 'answer' is nan, not a finite number"),
    ],
)
def test_jsonl_bad_rows_name_file_and_line(tmp_path, lines, line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DatasetError, match=f"^{re.escape(str(path))}:{line}: {message}"):
        load_prompts(path)


def test_jsonl_bad_utf8_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(json.dumps(ROWS[0]).encode() + b"\n" + b'{"prompt": "\xff"}\n')
    with pytest.raises(DatasetError, match=f"^{re.escape(str(path))}:2: not UTF-8"):
        load_prompts(path)


def test_missing_file_directory_and_empty(tmp_path):
    with pytest.raises(
        DatasetError, match=f"^{re.escape(str(tmp_path / 'nope.jsonl'))}: no such file"
    ):
        load_prompts(tmp_path / "nope.jsonl")
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(DatasetError, match=r"dir\.jsonl: not a file"):
        load_prompts(tmp_path / "dir.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DatasetError, match=f"^{re.escape(str(empty))}: the dataset holds no rows"):
        load_prompts(empty)


def test_sampling_is_deterministic(tmp_path):
    ds = load_prompts(write_jsonl(tmp_path / "d.jsonl", ROWS))
    a = ds.sample(4, random.Random(7))
    assert a == ds.sample(4, random.Random(7))
    assert len({e.row for e in a}) == 4  # distinct rows without replacement
    rng = random.Random(7)
    first, second = ds.sample(4, rng), ds.sample(4, rng)
    assert first == a and second != first  # the caller's generator moves on
    assert ds.sample(0, random.Random(0)) == []
    many = ds.sample(25, random.Random(1), replace=True)
    assert len(many) == 25 and many == ds.sample(25, random.Random(1), replace=True)
    with pytest.raises(ValueError, match="cannot draw 11 distinct rows"):
        ds.sample(11, random.Random(0))
    with pytest.raises(ValueError, match="cannot sample -1"):
        ds.sample(-1, random.Random(0))


def test_sampling_does_not_touch_the_global_generator(tmp_path):
    ds = load_prompts(write_jsonl(tmp_path / "d.jsonl", ROWS))
    random.seed(3)
    expected = random.random()
    random.seed(3)
    ds.sample(5, random.Random(0))
    assert random.random() == expected


def test_from_records():
    ds = PromptDataset.from_records([{"q": "a", "a": 1}], prompt_field="q", answer_field="a")
    assert ds[0] == PromptExample("a", "1", "<records>: row 1", 1)
    with pytest.raises(DatasetError, match=r"^<records>: row 2: no field 'q'"):
        PromptDataset.from_records([{"q": "a", "a": 1}, {}], prompt_field="q", answer_field="a")
    with pytest.raises(DatasetError, match=r"^<records>: row 1: expected a mapping, got str"):
        PromptDataset.from_records(["x"])
    with pytest.raises(DatasetError, match=r"^<records>: the dataset holds no rows"):
        PromptDataset.from_records([])


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    # None in sys.modules makes the import fail as if the package were not installed.
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(OptionalDependencyError, match=r"'pyarrow'.*pip install pyarrow"):
        load_prompts(path)


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed (optional)")
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(
        pa.table({"question": ["q1", "q2", "q3"], "gt": [1, 22, -3], "other": [0.1, 0.2, 0.3]}),
        path,
    )
    ds = load_prompts(path, prompt_field="question", answer_field="gt")
    assert ds[1] == PromptExample("q2", "22", f"{path}: row 2", 2)
    assert [e.answer for e in ds] == ["1", "22", "-3"]
    assert ds.sample(2, random.Random(0)) == ds.sample(2, random.Random(0))
    assert len(load_prompts(tmp_path / "d.parquet", "question", "gt", format="parquet")) == 3


def test_parquet_bad_input_names_file_and_row(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed (optional)")
    import pyarrow.parquet as pq

    nulls = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"prompt": ["a", None, "c"], "answer": ["1", "2", "3"]}), nulls)
    with pytest.raises(
        DatasetError, match=f"^{re.escape(str(nulls))}: row 2: field 'prompt' is NoneType"
    ):
        load_prompts(nulls)

    ints = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"prompt": [5, 6], "answer": ["1", "2"]}), ints)
    with pytest.raises(
        DatasetError, match=f"^{re.escape(str(ints))}: row 1: field 'prompt' is int"
    ):
        load_prompts(ints)

    no_col = tmp_path / "no_col.parquet"
    pq.write_table(pa.table({"prompt": ["a"], "label": ["1"]}), no_col)
    with pytest.raises(
        DatasetError, match=f"^{re.escape(str(no_col))}: row 1: no field 'answer'.*'label'"
    ):
        load_prompts(no_col)

    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": []}), empty)
    with pytest.raises(DatasetError, match=f"^{re.escape(str(empty))}: the dataset holds no rows"):
        load_prompts(empty)

    junk = tmp_path / "junk.parquet"
    junk.write_text("this is not parquet")
    with pytest.raises(DatasetError, match=f"^{re.escape(str(junk))}: not a readable Parquet file"):
        load_prompts(junk)
