"""Built-in verifiers: rule-based rewards for a response against a ground truth.

Every verifier has the reward-function contract ``fn(prompt, response, answer) ->
float`` and returns 1.0 or 0.0, so a built-in verifier and a user's reward function
are interchangeable.

- ``exact``: the response equals the answer after whitespace is normalized.
- ``numeric``: the response's final number equals the answer's, compared exactly as
  rationals (``0.50`` == ``1/2``, ``1,234`` == ``1234``). The final number is the one
  after the last ``####`` (GSM8K), else the one in the last ``\\boxed{...}``, else the
  last number in the text; the ground truth is read the same way, so a full GSM8K
  solution works as an answer.
- ``format``: the response marks a final answer (``#### ...`` or ``\\boxed{...}``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from fractions import Fraction
from typing import Literal

Verifier = Callable[[str, str, str], float]
FormatStyle = Literal["any", "gsm8k", "boxed"]


class VerifierError(ValueError):
    """A verifier cannot judge a response, e.g. its ground truth holds no number."""


class UnknownVerifierError(ValueError):
    """A verifier name is not one of :data:`VERIFIERS`."""


def normalize_whitespace(text: str) -> str:
    """``text`` with leading/trailing whitespace removed and every run of whitespace
    made one space."""
    return " ".join(text.split())


def exact_match(prompt: str, response: str, answer: str) -> float:
    """1.0 when ``response`` equals ``answer`` after :func:`normalize_whitespace`, else
    0.0. Case and punctuation count."""
    return 1.0 if normalize_whitespace(response) == normalize_whitespace(answer) else 0.0


# Numbers ------------------------------------------------------------------------------

# A number: an optional sign, an integer part with or without thousands commas, decimals,
# and an optional "/denominator". It may not start inside a word or right after a decimal
# point, so "5-3" reads as 5 and 3 (not -3), "x2" holds no number and "1.5" is one number.
_NUMBER = re.compile(
    r"""
    (?<![\w.])
    (?P<sign>[-+\u2212])?
    (?P<num>(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)
    (?:\s*/\s*(?P<den>(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?))?
    """,
    # ASCII: \d would match other scripts' digits, which Fraction() does not read.
    re.VERBOSE | re.ASCII,
)
_GSM8K_MARK = "####"
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_FRAC = re.compile(r"\\[dt]?frac\s*\{\s*([^{}]*?)\s*\}\s*\{\s*([^{}]*?)\s*\}")
# LaTeX spacing and wrappers that may sit inside a number in a box: "1{,}234", "\$5",
# "50\%", "\left(", "\!".
_LATEX_NOISE = re.compile(r"\{,\}|\\[,!;: ]|\\left|\\right|\\\$|\\%|\$")
_TEXT_CMD = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")


def _value(match: re.Match[str]) -> Fraction | None:
    num = Fraction(match["num"].replace(",", ""))
    if match["den"] is not None:
        den = Fraction(match["den"].replace(",", ""))
        if den == 0:
            return None
        num /= den
    return -num if match["sign"] in ("-", "\u2212") else num


def _numbers(text: str) -> list[Fraction | None]:
    return [_value(m) for m in _NUMBER.finditer(text)]


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), or None."""
    starts = list(_BOXED.finditer(text))
    for m in reversed(starts):
        depth, i = 1, m.end()
        while i < len(text):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[m.end() : i]
            i += 1
    return None


def _clean_latex(text: str) -> str:
    text = _TEXT_CMD.sub(r" \1 ", text)
    text = _FRAC.sub(r"(\1)/(\2)", text)
    # "(3)/(4)" from \frac{3}{4}: drop the parentheses around plain numbers so the
    # fraction reads as one number; "-\frac{3}{4}" becomes "-3/4".
    text = re.sub(r"\((\s*[-+]?[\d.,]+\s*)\)\s*/\s*\((\s*[\d.,]+\s*)\)", r"\1/\2", text)
    return _LATEX_NOISE.sub("", text)


def final_number(text: str) -> Fraction | None:
    """The final numeric answer of ``text`` as an exact rational, or None.

    The number right after the last ``####``; else the number in the last
    ``\\boxed{...}`` (which must hold exactly one, ``\\frac{a}{b}`` included); else the
    last number in the text. Thousands commas, a sign, decimals and ``a/b`` fractions
    are read exactly; trailing punctuation is ignored.
    """
    if _GSM8K_MARK in text:
        tail = text.rpartition(_GSM8K_MARK)[2]
        m = _NUMBER.search(_clean_latex(tail.lstrip()))
        return _value(m) if m else None
    boxed = _last_boxed(text)
    if boxed is not None:
        values = _numbers(_clean_latex(boxed))
        return values[0] if len(values) == 1 else None
    values = _numbers(text)
    return values[-1] if values else None


def numeric_match(prompt: str, response: str, answer: str) -> float:
    """1.0 when the final numbers of ``response`` and ``answer`` (:func:`final_number`)
    are equal as rationals, else 0.0 (also when the response holds no number).

    Raises:
        VerifierError: the ground truth ``answer`` holds no number.
    """
    truth = final_number(answer)
    if truth is None:
        raise VerifierError(f"the ground truth {answer[-80:]!r} holds no number")
    got = final_number(response)
    return 1.0 if got is not None and got == truth else 0.0


# Format --------------------------------------------------------------------------------

_GSM8K_ANSWER = re.compile(r"####[ \t]*\S")


def has_final_answer(response: str, style: FormatStyle = "any") -> bool:
    """Whether ``response`` marks a final answer: ``"gsm8k"`` wants ``#### X`` (something
    on the marker's line), ``"boxed"`` a non-empty ``\\boxed{X}``, ``"any"`` either."""
    if style not in ("any", "gsm8k", "boxed"):
        raise ValueError(f"unknown format style {style!r}; use 'any', 'gsm8k' or 'boxed'")
    if style in ("any", "gsm8k") and _GSM8K_ANSWER.search(response):
        return True
    if style in ("any", "boxed"):
        boxed = _last_boxed(response)
        return boxed is not None and bool(boxed.strip())
    return False


def format_check(prompt: str, response: str, answer: str) -> float:
    """1.0 when the response marks a final answer as ``#### X`` or ``\\boxed{X}``
    (:func:`has_final_answer`), else 0.0; the answer's value is not judged."""
    return 1.0 if has_final_answer(response) else 0.0


def make_format_check(style: FormatStyle = "any") -> Verifier:
    """A format verifier for one marker style (``"any"``, ``"gsm8k"``, ``"boxed"``).

    Raises:
        ValueError: an unknown style.
    """
    has_final_answer("", style)  # validates the style now, not at the first response

    def check(prompt: str, response: str, answer: str) -> float:
        return 1.0 if has_final_answer(response, style) else 0.0

    check.__name__ = check.__qualname__ = f"format_check_{style}"
    return check


VERIFIERS: dict[str, Verifier] = {
    "exact": exact_match,
    "numeric": numeric_match,
    "format": format_check,
}


def get_verifier(name: str) -> Verifier:
    """A built-in verifier by name: ``"exact"``, ``"numeric"`` or ``"format"``.

    Raises:
        UnknownVerifierError: an unknown name.
    """
    try:
        return VERIFIERS[name]
    except KeyError:
        raise UnknownVerifierError(
            f"unknown verifier {name!r}; choose one of {sorted(VERIFIERS)}"
        ) from None
