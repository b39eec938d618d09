"""Built-in verifiers: exact match, the numeric final answer, the format check, the
registry."""

from fractions import Fraction

import pytest

from nereus_rl.data import (
    VERIFIERS,
    UnknownVerifierError,
    VerifierError,
    exact_match,
    final_number,
    format_check,
    get_verifier,
    make_format_check,
    normalize_whitespace,
    numeric_match,
)

P = "a prompt"


def test_normalize_whitespace():
    assert normalize_whitespace("  a \t b\n\nc  ") == "a b c"
    assert normalize_whitespace("") == ""


@pytest.mark.parametrize(
    "response, answer, reward",
    [
        ("Paris", "Paris", 1.0),
        ("  Paris \n", "Paris", 1.0),
        ("New   York\tCity", "New York City", 1.0),
        ("paris", "Paris", 0.0),  # case counts
        ("Paris.", "Paris", 0.0),  # punctuation counts
        ("", "Paris", 0.0),
        ("", "", 1.0),
    ],
)
def test_exact_match(response, answer, reward):
    assert exact_match(P, response, answer) == reward


@pytest.mark.parametrize(
    "text, value",
    [
        ("#### 42", Fraction(42)),
        ("#### -1,234", Fraction(-1234)),
        ("#### $1,234.50", Fraction("1234.5")),
        ("steps 3 and 4\n#### 72\nthen 5 more words", Fraction(72)),  # first after ####
        ("#### 1\n#### 2", Fraction(2)),  # the last marker
        (r"\boxed{3/4}", Fraction(3, 4)),
        (r"so $\boxed{\frac{3}{4}}$.", Fraction(3, 4)),
        (r"\boxed{-\dfrac{1}{2}}", Fraction(-1, 2)),
        (r"\boxed{1{,}234}", Fraction(1234)),
        (r"\boxed{50\%}", Fraction(50)),
        (r"\boxed{x = 5}", Fraction(5)),
        (r"\boxed{\text{5 apples}}", Fraction(5)),
        (r"first \boxed{1}, finally \boxed{2}", Fraction(2)),
        ("0.50", Fraction(1, 2)),
        ("1/2", Fraction(1, 2)),
        (".5", Fraction(1, 2)),
        ("The answer is 42.", Fraction(42)),  # trailing punctuation
        ("It is 42!", Fraction(42)),
        ("I got 1,234,567.", Fraction(1234567)),
        ("x = -5", Fraction(-5)),
        ("\u22127", Fraction(-7)),  # a Unicode minus sign
        ("5-3", Fraction(3)),  # a subtraction, not -3
        ("12 / 4", Fraction(3)),
        ("first 3 then 17 apples", Fraction(17)),  # the last number
    ],
)
def test_final_number(text, value):
    assert final_number(text) == value


@pytest.mark.parametrize(
    "text",
    [
        "no answer",
        "",
        "####",  # a marker without a number
        r"\boxed{}",
        r"\boxed{3, 5}",  # a box must hold one number
        r"\boxed{three}",
        "3/0",
        "x2",  # a digit inside a word is no number
        "\u0663",  # a digit of another script
    ],
)
def test_final_number_none(text):
    assert final_number(text) is None


@pytest.mark.parametrize(
    "response, answer, reward",
    [
        ("#### -1,234", "-1234", 1.0),
        ("#### -1,234", "#### 1234", 0.0),  # the sign counts
        (r"\boxed{3/4}", "0.75", 1.0),
        (r"\boxed{3/4}", "#### 3", 0.0),
        ("0.50", "1/2", 1.0),
        ("The answer is 42.", "She sold 48/2 = <<48/2=24>>24 clips.\n#### 42", 1.0),  # GSM8K truth
        ("So she has 24 left.", "#### 72", 0.0),
        ("I am not sure.", "7", 0.0),  # no answer
        ("1e5", "100000", 0.0),  # no scientific notation: reads 5
        ("#### 0.1", "1/10", 1.0),  # exact, not a float's 0.1
        ("#### 0.30000000000000004", "0.3", 0.0),
    ],
)
def test_numeric_match(response, answer, reward):
    assert numeric_match(P, response, answer) == reward


def test_numeric_match_needs_a_number_in_the_truth():
    with pytest.raises(VerifierError, match="'Paris' holds no number"):
        numeric_match(P, "42", "Paris")


@pytest.mark.parametrize(
    "response, reward",
    [
        ("so... #### 42", 1.0),
        ("#### Paris", 1.0),  # the value is not judged
        (r"The answer is \boxed{42}.", 1.0),
        (r"\boxed{ }", 0.0),
        ("####\n42", 0.0),  # nothing on the marker's line
        ("The answer is 42.", 0.0),
        ("", 0.0),
    ],
)
def test_format_check(response, reward):
    assert format_check(P, response, "42") == reward


def test_format_check_styles():
    gsm, boxed = make_format_check("gsm8k"), make_format_check("boxed")
    assert gsm(P, "#### 4", "4") == 1.0 and gsm(P, r"\boxed{4}", "4") == 0.0
    assert boxed(P, r"\boxed{4}", "4") == 1.0 and boxed(P, "#### 4", "4") == 0.0
    assert make_format_check("any")(P, "#### 4", "4") == 1.0
    with pytest.raises(ValueError, match="unknown format style 'xml'"):
        make_format_check("xml")  # type: ignore[arg-type]


def test_registry():
    assert get_verifier("exact") is exact_match
    assert get_verifier("numeric") is numeric_match
    assert get_verifier("format") is format_check
    assert set(VERIFIERS) == {"exact", "numeric", "format"}
    with pytest.raises(UnknownVerifierError, match=r"'fuzzy'.*\['exact', 'format', 'numeric'\]"):
        get_verifier("fuzzy")


@pytest.mark.parametrize("name", sorted(VERIFIERS))
def test_rewards_are_floats_in_unit_range(name):
    fn = get_verifier(name)
    for response in ("#### 3", r"\boxed{3}", "3", "nothing", ""):
        r = fn(P, response, "#### 3")
        assert isinstance(r, float) and 0.0 <= r <= 1.0
