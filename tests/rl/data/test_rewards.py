"""User reward functions: loading by module path and by file path, the check before
training, and the run-time wrapper's errors (naming the function and the row)."""

import math
import pickle
import re
import sys
import textwrap
from fractions import Fraction

import pytest

from nereus_rl.data import (
    Problem,
    RewardFnError,
    RewardFunction,
    RewardRuntimeError,
    check_reward_fn,
    load_prompts,
    load_reward_fn,
    numeric_match,
    resolve_reward,
    wrap_reward_fn,
)

SOURCE = textwrap.dedent(
    """
    def reward(prompt, response, answer):
        return float(response.strip() == answer)

    def boom(prompt, response, answer):
        raise KeyError("missing key")

    def two_args(prompt, response):
        return 1.0

    class Scorer:
        @staticmethod
        def score(prompt, response, answer):
            return 0.5

    NOT_CALLABLE = 3
    """
)


@pytest.fixture
def module_dir(tmp_path, monkeypatch):
    """A folder on sys.path holding ``nrw_user_reward.py`` (removed from sys.modules after)."""
    (tmp_path / "nrw_user_reward.py").write_text(SOURCE)
    (tmp_path / "nrw_broken.py").write_text("raise RuntimeError('import failed')\n")
    (tmp_path / "nrw_needs_dep.py").write_text("import nrw_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in ("nrw_user_reward", "nrw_broken", "nrw_needs_dep"):
        sys.modules.pop(name, None)


def test_load_from_module_path(module_dir):
    rf = load_reward_fn("nrw_user_reward:reward")
    assert isinstance(rf, RewardFunction) and rf.name == "nrw_user_reward:reward"
    assert rf("p", " 4 ", "4") == 1.0 and rf("p", "5", "4") == 0.0
    assert load_reward_fn("nrw_user_reward:Scorer.score")("p", "r", "a") == 0.5
    # An installed package's function, by its dotted path.
    assert load_reward_fn("nereus_rl.data.verifiers:numeric_match").fn is numeric_match


def test_load_from_file_path(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "my_reward.py"
    path.parent.mkdir()
    path.write_text(SOURCE)
    rf = load_reward_fn(f"{path}:reward")
    assert rf("p", "4", "4") == 1.0 and rf.name == f"{path}:reward"
    monkeypatch.chdir(tmp_path)
    again = load_reward_fn("sub/my_reward.py:reward")  # relative to the current folder
    assert again.fn is rf.fn  # one module per file
    # Pickles as its spec (absolute path), so it can reach a worker process.
    clone = pickle.loads(pickle.dumps(again))
    assert clone.fn is rf.fn and clone("p", "4", "4") == 1.0


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_colon_here", "expected 'package.module:function'"),
        ("mod:", "expected 'package.module:function'"),
        (":fn", "expected 'package.module:function'"),
        ("mod:not-an-identifier", "expected 'package.module:function'"),
        ("nrw_missing_module:fn", "no module named 'nrw_missing_module'.*PYTHONPATH"),
        ("nrw_user_reward:nope", "'nrw_user_reward' has no attribute 'nope'"),
        ("nrw_user_reward:Scorer.nope", "'nrw_user_reward.Scorer' has no attribute 'nope'"),
        ("nrw_user_reward:NOT_CALLABLE", "is int, not a callable"),
        ("nrw_user_reward:two_args", r"cannot be called as fn\(prompt, response, answer\)"),
        ("nrw_broken:fn", "importing 'nrw_broken' raised RuntimeError: import failed"),
        ("nrw_needs_dep:fn", "importing 'nrw_needs_dep' raised ModuleNotFoundError"),
        ("missing/file.py:fn", "no such file"),
    ],
)
def test_load_errors_name_the_spec(module_dir, spec, message):
    with pytest.raises(RewardFnError, match=f"^reward function {re.escape(repr(spec))}.*{message}"):
        load_reward_fn(spec)


def test_load_error_from_a_file_that_raises(tmp_path):
    path = tmp_path / "bad_reward.py"
    path.write_text("1 / 0\n")
    with pytest.raises(RewardFnError, match="raised ZeroDivisionError") as info:
        load_reward_fn(f"{path}:fn")
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert not [m for m in sys.modules if m.startswith("_nereus_reward_bad_reward")]


def test_resolve_reward():
    assert resolve_reward("numeric").fn is numeric_match
    assert resolve_reward("nereus_rl.data.verifiers:numeric_match").fn is numeric_match
    assert pickle.loads(pickle.dumps(resolve_reward("exact"))).fn is resolve_reward("exact").fn
    with pytest.raises(RewardFnError, match="'fuzzy' is not a built-in verifier"):
        resolve_reward("fuzzy")


def test_check_reward_fn_accepts_numbers():
    assert check_reward_fn(lambda p, r, a: 1, "p", "a") == 1.0
    assert check_reward_fn(lambda p, r, a: r == a, "p", "a") == 1.0  # bool reads as 0/1
    assert check_reward_fn(lambda p, r, a: Fraction(1, 4), "p", "a") == 0.25
    assert check_reward_fn(lambda p, r, a: -2.5, "p", "a") == -2.5  # any finite real
    seen = []
    check_reward_fn(lambda p, r, a: seen.append((p, r, a)) or 0.0, "p", "a", sample_response="r")
    assert seen == [("p", "r", "a")]
    assert check_reward_fn(numeric_match, "q", "#### 7") == 1.0  # the answer as response


def raises_value_error(prompt, response, answer):
    raise ValueError("cannot parse")


@pytest.mark.parametrize(
    "fn, message",
    [
        (raises_value_error, "'.*raises_value_error' raised ValueError on a sample row: cannot"),
        (lambda p, r, a: "1.0", "returned str '1.0'"),
        (lambda p, r, a: None, "returned NoneType None"),
        (lambda p, r, a: math.nan, "returned float nan"),
        (lambda p, r, a: math.inf, "returned float inf"),
        (lambda p, r, a: 1 + 0j, "returned complex"),
        (lambda p, r: 1.0, r"cannot be called as fn\(prompt, response, answer\)"),
        (3, "is not callable"),
    ],
)
def test_check_reward_fn_errors_name_the_function(fn, message):
    with pytest.raises(RewardFnError, match=message):
        check_reward_fn(fn, "p", "a")


def test_check_reward_fn_names_a_loaded_function(module_dir):
    with pytest.raises(RewardFnError, match="'nrw_user_reward:boom' raised KeyError") as info:
        check_reward_fn(load_reward_fn("nrw_user_reward:boom"), "p", "a")
    assert isinstance(info.value.__cause__, KeyError)


def test_a_tensor_reward_gets_a_hint():
    torch = pytest.importorskip("torch")
    with pytest.raises(RewardFnError, match=r"call \.item\(\)"):
        check_reward_fn(lambda p, r, a: torch.tensor(1.0), "p", "a")


def test_run_time_errors_name_the_function_and_the_row(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "p1", "answer": "1"}\n{"prompt": "p2", "answer": "oops"}\n')
    ds = load_prompts(path)
    rf = resolve_reward("numeric")
    assert rf.score(ds[:1], ["#### 1"]) == [1.0]
    with pytest.raises(RewardRuntimeError) as info:
        rf.score(list(ds), ["1", "2"])
    err = info.value
    assert err.fn_name == "verifier numeric" and err.where == f"{path}:2"
    assert str(err).startswith(
        f"reward function 'verifier numeric' raised VerifierError on {path}:2"
    )
    assert err.__cause__ is not None

    bad = wrap_reward_fn(lambda p, r, a: float("nan"), name="judge")
    with pytest.raises(RewardRuntimeError, match=f"'judge' returned float nan on {path}:1"):
        bad.score(ds, ["a", "b"])
    with pytest.raises(RewardRuntimeError, match="on batch item 0"):
        bad.score([Problem("p", "a")], ["a"])  # no row to name: the batch position
    with pytest.raises(ValueError, match="2 problems but 1 responses"):
        rf.score(ds, ["1"])


def test_wrap_reward_fn():
    rf = wrap_reward_fn(raises_value_error)
    assert rf.name.endswith("test_rewards.raises_value_error")
    assert wrap_reward_fn(rf) is rf
    with pytest.raises(RewardRuntimeError, match="raised ValueError on a row"):
        rf("p", "r", "a")
    assert pickle.loads(pickle.dumps(wrap_reward_fn(numeric_match))).fn is numeric_match
