"""Generate ``arith_word.jsonl``: arithmetic word problems with GSM8K-style answers.

Each row is ``{"prompt": question, "answer": worked solution ending "#### N"}``, where
N is an integer (negative for some temperature problems, above 1,000 for the stadium
ones; the solutions write thousands with commas, the final line never does). Ten
templates take turns, filled from one seeded ``random.Random``, so a seed and a row
count fix the file byte for byte::

    python -m nereus_rl.data.make_arith_word --out PATH [--n 300] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path

from nereus_rl.data.datasets import ARITH_WORD

DEFAULT_ROWS = 300
DEFAULT_SEED = 0

_PEOPLE = (
    ("Ava", "she", "her"),
    ("Liam", "he", "his"),
    ("Maya", "she", "her"),
    ("Noah", "he", "his"),
    ("Zoe", "she", "her"),
    ("Omar", "he", "his"),
    ("Priya", "she", "her"),
    ("Diego", "he", "his"),
    ("Hana", "she", "her"),
    ("Kofi", "he", "his"),
)
_ITEMS = ("apples", "stickers", "marbles", "pencils", "cards", "shells", "stamps", "beads")

Template = Callable[[random.Random], tuple[str, list[str], int]]


def _person(rng: random.Random) -> tuple[str, str, str]:
    return rng.choice(_PEOPLE)


def _two_people(rng: random.Random) -> tuple[tuple[str, str, str], tuple[str, str, str]]:
    a = _person(rng)
    b = rng.choice([p for p in _PEOPLE if p != a])
    return a, b


def _c(n: int) -> str:
    """``n`` with thousands commas, as a person writes it."""
    return f"{n:,}"


def _add_sub(rng: random.Random) -> tuple[str, list[str], int]:
    (name, pron, _), (friend, _, _) = _two_people(rng)
    item = rng.choice(_ITEMS)
    a, b = rng.randint(5, 60), rng.randint(2, 40)
    c = rng.randint(1, a + b)
    q = (
        f"{name} has {a} {item}. {pron.capitalize()} buys {b} more and then gives {c} to "
        f"{friend}. How many {item} does {name} have now?"
    )
    steps = [
        f"After buying, {name} has {a} + {b} = {a + b} {item}.",
        f"After giving {c} away, {pron} has {a + b} - {c} = {a + b - c} {item}.",
    ]
    return q, steps, a + b - c


def _boxes(rng: random.Random) -> tuple[str, list[str], int]:
    boxes, per, loose = rng.randint(3, 25), rng.randint(4, 12), rng.randint(1, 20)
    q = (
        f"A bakery packs {boxes} boxes with {per} muffins in each box. It also has {loose} "
        "loose muffins. How many muffins does the bakery have in total?"
    )
    steps = [
        f"The boxes hold {boxes} * {per} = {boxes * per} muffins.",
        f"With the loose ones, that is {boxes * per} + {loose} = {boxes * per + loose} muffins.",
    ]
    return q, steps, boxes * per + loose


def _share(rng: random.Random) -> tuple[str, list[str], int]:
    name, _, _ = _person(rng)
    item = rng.choice(_ITEMS)
    k, each, kept = rng.randint(2, 9), rng.randint(3, 15), rng.randint(1, 10)
    total = k * each + kept
    q = (
        f"{name} has {total} {item}. {name} keeps {kept} and shares the rest equally among "
        f"{k} friends. How many {item} does each friend get?"
    )
    steps = [
        f"{name} shares {total} - {kept} = {total - kept} {item}.",
        f"Each friend gets {total - kept} / {k} = {each} {item}.",
    ]
    return q, steps, each


def _change(rng: random.Random) -> tuple[str, list[str], int]:
    name, pron, _ = _person(rng)
    qty, price = rng.randint(2, 8), rng.randint(2, 12)
    cost = qty * price
    bill = next(b for b in (20, 50, 100) if b >= cost)
    q = (
        f"{name} buys {qty} notebooks at ${price} each and pays with a ${bill} bill. How many "
        f"dollars of change does {pron} get?"
    )
    steps = [
        f"The notebooks cost {qty} * ${price} = ${cost}.",
        f"The change is ${bill} - ${cost} = ${bill - cost}.",
    ]
    return q, steps, bill - cost


def _travel(rng: random.Random) -> tuple[str, list[str], int]:
    speed, hours, extra = rng.randint(30, 80), rng.randint(2, 6), rng.randint(5, 95)
    q = (
        f"A train travels at {speed} miles per hour for {hours} hours, then another {extra} "
        "miles. How many miles does it travel in total?"
    )
    steps = [
        f"In {hours} hours it covers {speed} * {hours} = {speed * hours} miles.",
        f"In total it travels {speed * hours} + {extra} = {speed * hours + extra} miles.",
    ]
    return q, steps, speed * hours + extra


def _fraction_spent(rng: random.Random) -> tuple[str, list[str], int]:
    name, pron, _ = _person(rng)
    d = rng.choice((2, 3, 4, 5))
    money = d * rng.randint(4, 30)
    part = money // d
    lunch = rng.randint(1, money - part)
    left = money - part - lunch
    q = (
        f"{name} had ${money}. {pron.capitalize()} spent 1/{d} of it on a book and ${lunch} "
        f"on lunch. How many dollars does {pron} have left?"
    )
    steps = [
        f"The book cost ${money} / {d} = ${part}.",
        f"{name} has ${money} - ${part} - ${lunch} = ${left} left.",
    ]
    return q, steps, left


def _temperature(rng: random.Random) -> tuple[str, list[str], int]:
    start, drop = rng.randint(-5, 15), rng.randint(3, 25)
    end = start - drop
    q = (
        f"At noon the temperature was {start} degrees. By midnight it had dropped {drop} "
        "degrees. What was the temperature at midnight, in degrees?"
    )
    return q, [f"The temperature at midnight was {start} - {drop} = {end} degrees."], end


def _stadium(rng: random.Random) -> tuple[str, list[str], int]:
    sections, seats = rng.randint(8, 30), rng.randint(10, 25) * 100 + rng.choice((0, 50))
    total = sections * seats
    empty = rng.randint(100, total // 4)
    q = (
        f"A stadium has {sections} sections with {_c(seats)} seats each. At one game, "
        f"{_c(empty)} seats were empty. How many seats were filled?"
    )
    steps = [
        f"The stadium has {sections} * {_c(seats)} = {_c(total)} seats.",
        f"Filled seats: {_c(total)} - {_c(empty)} = {_c(total - empty)}.",
    ]
    return q, steps, total - empty


def _discount(rng: random.Random) -> tuple[str, list[str], int]:
    price, pct = 20 * rng.randint(2, 15), rng.choice((10, 20, 25, 50))
    off = price * pct // 100
    q = f"A jacket costs ${price}. It is on sale for {pct}% off. What is the sale price in dollars?"
    steps = [
        f"The discount is {pct}% of ${price} = ${off}.",
        f"The sale price is ${price} - ${off} = ${price - off}.",
    ]
    return q, steps, price - off


def _compare(rng: random.Random) -> tuple[str, list[str], int]:
    (a, _, _), (b, _, _) = _two_people(rng)
    item = rng.choice(_ITEMS)
    x, k = rng.randint(3, 20), rng.randint(2, 4)
    fewer = rng.randint(1, k * x - 1)
    bx, cx = k * x, k * x - fewer
    q = (
        f"{a} has {x} {item}. {b} has {k} times as many {item} as {a}, and their teacher has "
        f"{fewer} fewer {item} than {b}. How many {item} do the three have altogether?"
    )
    steps = [
        f"{b} has {k} * {x} = {bx} {item}.",
        f"The teacher has {bx} - {fewer} = {cx} {item}.",
        f"Altogether they have {x} + {bx} + {cx} = {x + bx + cx} {item}.",
    ]
    return q, steps, x + bx + cx


TEMPLATES: tuple[Template, ...] = (
    _add_sub,
    _boxes,
    _share,
    _change,
    _travel,
    _fraction_spent,
    _temperature,
    _stadium,
    _discount,
    _compare,
)


def generate_rows(n: int = DEFAULT_ROWS, seed: int = DEFAULT_SEED) -> list[dict[str, str]]:
    """``n`` rows ``{"prompt", "answer"}``; the templates take turns, in order.

    Raises:
        ValueError: ``n`` < 1.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        question, steps, value = TEMPLATES[i % len(TEMPLATES)](rng)
        rows.append({"prompt": question, "answer": "\n".join([*steps, f"#### {value}"])})
    return rows


def render(n: int = DEFAULT_ROWS, seed: int = DEFAULT_SEED) -> bytes:
    """The JSONL file's bytes: one object per line, ASCII, ``\\n`` line ends."""
    lines = [json.dumps(r, ensure_ascii=True) + "\n" for r in generate_rows(n, seed)]
    return "".join(lines).encode("ascii")


def main(argv: Sequence[str] | None = None) -> int:
    """Write the dataset; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m nereus_rl.data.make_arith_word",
        description="Generate arithmetic word problems with GSM8K-style '#### N' answers.",
    )
    parser.add_argument("--out", type=Path, default=ARITH_WORD, help=f"default: {ARITH_WORD}")
    parser.add_argument("--n", type=int, default=DEFAULT_ROWS, help="rows (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="default: %(default)s")
    args = parser.parse_args(argv)
    if args.n < 1:
        parser.error(f"--n must be >= 1, got {args.n}")
    args.out.write_bytes(render(args.n, args.seed))
    print(f"wrote {args.n} rows to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
