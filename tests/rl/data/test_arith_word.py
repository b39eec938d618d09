"""The shipped arithmetic word-problem dataset: regenerating it gives the same bytes, and
its answers are right and readable by the numeric verifier."""

import json
import operator
import re
from fractions import Fraction

from nereus_rl.data import ARITH_WORD, final_number, load_prompts, numeric_match
from nereus_rl.data.make_arith_word import DEFAULT_ROWS, TEMPLATES, generate_rows, main, render

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


def test_regenerating_gives_the_same_bytes(tmp_path, capsys):
    assert render() == ARITH_WORD.read_bytes()
    out = tmp_path / "arith.jsonl"
    assert main(["--out", str(out)]) == 0
    assert out.read_bytes() == ARITH_WORD.read_bytes()
    assert "wrote 300 rows" in capsys.readouterr().out


def test_seed_and_size_change_the_file():
    assert render(20, seed=1) != render(20, seed=0)
    assert render(20) == render(20)
    assert len(generate_rows(7)) == 7


def test_the_shipped_dataset_loads_and_every_answer_is_right():
    ds = load_prompts(ARITH_WORD)
    assert len(ds) == DEFAULT_ROWS
    assert len({e.prompt for e in ds}) > 0.95 * len(ds)  # few repeats
    assert all(e.answer.splitlines()[-1].startswith("#### ") for e in ds)
    values = [final_number(e.answer) for e in ds]
    assert all(v is not None and v.denominator == 1 for v in values)
    assert any(v < 0 for v in values) and any(v >= 1000 for v in values)
    for e in ds:
        assert numeric_match(e.prompt, e.answer, e.answer) == 1.0
    # Every "a op b [op c] = d" in the worked solutions holds.
    expr = re.compile(r"(-?[\d,]+(?: [-+*/] -?[\d,]+)+) = (-?[\d,]+)")
    checked = 0
    for e in ds:
        for lhs, rhs in expr.findall(e.answer.replace("$", "")):
            tokens = lhs.replace(",", "").split()
            value = Fraction(tokens[0])
            for op, n in zip(tokens[1::2], tokens[2::2]):
                value = OPS[op](value, Fraction(n))
            assert value == Fraction(rhs.replace(",", "")), (e.where, lhs, rhs)
            checked += 1
    assert checked > len(ds)


def test_templates_take_turns():
    rows = generate_rows(len(TEMPLATES) * 2)
    firsts = [r["prompt"].split()[0] for r in rows]
    assert firsts[1] == firsts[len(TEMPLATES) + 1] == "A"  # the bakery both times
    assert all(set(r) == {"prompt", "answer"} for r in rows)
    assert json.loads(render(1).decode()) == generate_rows(1)[0]
