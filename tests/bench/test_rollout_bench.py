"""bench_rollout at its smallest size: both generators run on the same batches, greedy
outputs agree token for token, and the record and table hold every case."""

from __future__ import annotations

import json

import pytest

from nereus_rl.data.datasets import OptionalDependencyError
from nereus_rl.data.tokenizers import import_transformers

try:
    import_transformers()
except OptionalDependencyError:
    pytest.skip("transformers is not installed", allow_module_level=True)

from benchmarks import bench_rollout as bench

pytestmark = pytest.mark.slow


def test_goal_by_batch():
    assert [bench.goal_for(b) for b in (1, 2, 8, 32)] == [1.0, 1.0, 1.5, 1.5]


def test_tiny_run_writes_every_case(tmp_path, capsys):
    out = tmp_path / "rollout.json"
    assert bench.main(["--size", "tiny", "--repeats", "1", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    cases = [(r["batch"], r["mode"]) for r in rec["rows"]]
    assert cases == [(1, "greedy"), (1, "sampled"), (8, "greedy"), (8, "sampled")]
    for r in rec["rows"]:
        assert r["nereus_tok_s"] > 0 and r["transformers_tok_s"] > 0
        assert r["ratio"] == pytest.approx(r["nereus_tok_s"] / r["transformers_tok_s"])
        assert r["meets_goal"] == (r["ratio"] >= r["goal"])
        if r["mode"] == "greedy":  # the same model and batch: the same tokens
            assert r["greedy_equal"], r
    # the batch of 8 has prompts of different lengths (left-padded, masked)
    assert len(set(rec["rows"][2]["prompt_lengths"])) > 1
    text = capsys.readouterr().out
    assert "nereus tok/s" in text and "all goals met" in text
