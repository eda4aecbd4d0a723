"""GSM-style word problems from templates: buying, giving away, sharing equally (the division is exact), rates, and
problems of two steps. The answer is always a whole number.

A problem is its template and its numbers; the names and objects in its text are drawn from a hash of those, so a
problem is the same text in every run, and the held-out split goes by template and numbers: a held-out problem is
never trained on under other names.

Levels: `one-step` (`more`, `give-away`, `share`, `buy`, `rate`), `two-step` (`change`, `packs`, `wages`), and
`mixed` (all of them, the family's default). SmolLM2-135M-Instruct answered `more` ("Tom has a apples, buys b more")
right 4 % of the time at temperature 1.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from producers.tasks.answers import NumericTask
from producers.tasks.base import Problem, make_problem

FAMILY = "word-problems"
NAMES = ("Tom", "Anna", "Ravi", "Mia", "Lucas", "Sara", "Kenji", "Lena", "Omar", "Zoe", "Ben", "Ines")
THINGS = ("apples", "marbles", "stickers", "pencils", "cookies", "stamps", "shells", "cards", "books", "balloons")
ITEMS = ("notebooks", "pens", "toy cars", "mugs", "tickets", "plants", "candles", "hats")
MACHINES = (("printer", "pages"), ("bakery oven", "loaves"), ("machine", "bottles"), ("robot", "boxes"))


@dataclass(frozen=True)
class Words:
    """The names and objects of one problem's text."""

    name: str
    friend: str
    things: str
    items: str
    machine: str
    products: str


def words_for(key: str) -> Words:
    """Names and objects drawn from the problem's key (its template and numbers): the same in every run."""
    rng = random.Random(f"words|{key}")
    name, friend = rng.sample(NAMES, 2)
    machine, products = rng.choice(MACHINES)
    return Words(name, friend, rng.choice(THINGS), rng.choice(ITEMS), machine, products)


Numbers = tuple[int, ...]


@dataclass(frozen=True)
class Template:
    """One kind of problem: how to draw its numbers, its text, and its answer from them."""

    name: str
    steps: int
    numbers: Callable[[random.Random], Numbers]
    text: Callable[[Words, Numbers], str]
    answer: Callable[[Numbers], int]


def _give_away_numbers(rng: random.Random) -> Numbers:
    had = rng.randint(10, 50)
    return had, rng.randint(1, had - 1)


def _share_numbers(rng: random.Random) -> Numbers:
    friends = rng.randint(2, 9)
    return friends, friends * rng.randint(2, 12)


def _change_numbers(rng: random.Random) -> Numbers:
    count, price = rng.randint(2, 6), rng.randint(2, 12)
    return count, price, count * price + rng.randint(1, 30)


TEMPLATES: dict[str, Template] = {
    t.name: t
    for t in (
        Template(
            "more",
            1,
            lambda r: (r.randint(2, 20), r.randint(2, 20)),
            lambda w, n: (
                f"{w.name} has {n[0]} {w.things} and buys {n[1]} more. How many {w.things} does {w.name} have now?"
            ),
            lambda n: n[0] + n[1],
        ),
        Template(
            "give-away",
            1,
            _give_away_numbers,
            lambda w, n: (
                f"{w.name} has {n[0]} {w.things} and gives {n[1]} of them to {w.friend}. How many "
                f"{w.things} does {w.name} have left?"
            ),
            lambda n: n[0] - n[1],
        ),
        Template(
            "share",
            1,
            _share_numbers,
            lambda w, n: (
                f"{w.name} shares {n[1]} {w.things} equally among {n[0]} friends. How many {w.things} "
                "does each friend get?"
            ),
            lambda n: n[1] // n[0],
        ),
        Template(
            "buy",
            1,
            lambda r: (r.randint(2, 9), r.randint(2, 20)),
            lambda w, n: (
                f"{w.name} buys {n[0]} {w.items} that cost {n[1]} dollars each. How many dollars does {w.name} spend?"
            ),
            lambda n: n[0] * n[1],
        ),
        Template(
            "rate",
            1,
            lambda r: (r.randint(2, 30), r.randint(2, 10)),
            lambda w, n: (
                f"A {w.machine} makes {n[0]} {w.products} every hour. How many {w.products} does it make "
                f"in {n[1]} hours?"
            ),
            lambda n: n[0] * n[1],
        ),
        Template(
            "change",
            2,
            _change_numbers,
            lambda w, n: (
                f"{w.name} has {n[2]} dollars and buys {n[0]} {w.items} at {n[1]} dollars each. How "
                f"many dollars does {w.name} have left?"
            ),
            lambda n: n[2] - n[0] * n[1],
        ),
        Template(
            "packs",
            2,
            lambda r: (r.randint(2, 20), r.randint(2, 6), r.randint(2, 12)),
            lambda w, n: (
                f"{w.name} has {n[0]} {w.things}. Then {w.name} buys {n[1]} packs with {n[2]} "
                f"{w.things} in each pack. How many {w.things} does {w.name} have now?"
            ),
            lambda n: n[0] + n[1] * n[2],
        ),
        Template(
            "wages",
            2,
            lambda r: (r.randint(5, 25), r.randint(2, 8), r.randint(2, 6)),
            lambda w, n: (
                f"{w.name} earns {n[0]} dollars an hour and works {n[1]} hours a day for {n[2]} days. "
                f"How many dollars does {w.name} earn?"
            ),
            lambda n: n[0] * n[1] * n[2],
        ),
    )
}
LEVELS: dict[str, tuple[str, ...]] = {
    "mixed": tuple(TEMPLATES),
    "one-step": tuple(t.name for t in TEMPLATES.values() if t.steps == 1),
    "two-step": tuple(t.name for t in TEMPLATES.values() if t.steps == 2),
}
DEFAULT_LEVEL = "mixed"


class WordProblemsTask(NumericTask):
    family = FAMILY

    def __init__(self, level: str = DEFAULT_LEVEL) -> None:
        super().__init__(level, LEVELS)
        self.templates = [TEMPLATES[name] for name in LEVELS[level]]

    def make(self, template: Template, numbers: Numbers) -> Problem:
        key = f"{FAMILY}|{template.name}|{list(numbers)}"
        return make_problem(
            FAMILY,
            self.level,
            template.text(words_for(key), numbers),
            str(template.answer(numbers)),
            template=template.name,
            numbers=list(numbers),
        )

    def draw(self, rng: random.Random) -> Problem:
        template = rng.choice(self.templates)
        return self.make(template, template.numbers(rng))

    def split_key(self, problem: Problem) -> str:
        return f"{FAMILY}|{problem.meta['template']}|{problem.meta['numbers']}"
