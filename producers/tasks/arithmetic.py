"""Arithmetic at named levels of difficulty: sums of one to three digits, the times tables, and two or three operations
of + - * (written with the multiplication sign) with the usual precedence (* before + and -; no division).

The levels, easiest first (what SmolLM2-135M-Instruct's sampled accuracy was at temperature 1, measured with
`NUMBER_INSTRUCTION` and the reply's last number, where it was measured):

| level | question | base accuracy |
|---|---|---|
| `sum-1d` | a + b, one digit each (0-9): 100 problems, about 20 of them held out | 29 % |
| `times-table` | a * b, each 2-12 | 22 % |
| `sum-2d` | a + b, two digits each (10-99) | 3 % |
| `sum-3d` | a + b, three digits each (100-999) | |
| `ops-2` | a o b o c, each 1-9, o one of + - * | |
| `ops-3` | a o b o c o d, each 1-9 | |
| `ops-3-2d` | a o b o c o d, two digits each (10-99) | |

Sums and products alone are split by their operands as a multiset: `3 + 4` and `4 + 3` are in the same split, so a
held-out sum is not trained on with its operands swapped.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from functools import cache

from producers.tasks.answers import NumericTask
from producers.tasks.base import Problem, make_problem

FAMILY = "arithmetic"
TIMES = "\u00d7"
"""The multiplication sign, as the questions write it."""
SHOWN = {"+": "+", "-": "-", "*": TIMES}
"""How an operator is written in the question."""
LISTED_UP_TO = 20_000
"""Levels with at most this many problems are listed whole (`GeneratedTask.all_problems`), so that every draw from
one split is a sample of one fixed pool, without repeats."""


@dataclass(frozen=True)
class Level:
    """A level: `operands` numbers of `digits` digits each (one digit: 0-9; d digits: 10^(d-1) to 10^d - 1) or
    within `bounds`, joined by operators drawn from `operators` (`+`, `-`, `*`)."""

    name: str
    operands: int
    digits: int
    operators: str
    bounds: tuple[int, int] | None = None

    @property
    def low(self) -> int:
        return self.bounds[0] if self.bounds else (0 if self.digits == 1 else 10 ** (self.digits - 1))

    @property
    def high(self) -> int:
        return self.bounds[1] if self.bounds else 10**self.digits - 1

    @property
    def size(self) -> int:
        """How many problems the level has (operand and operator sequences)."""
        return (self.high - self.low + 1) ** self.operands * len(self.operators) ** (self.operands - 1)


LEVELS: dict[str, Level] = {
    level.name: level
    for level in (
        Level("sum-1d", operands=2, digits=1, operators="+"),
        Level("times-table", operands=2, digits=2, operators="*", bounds=(2, 12)),
        Level("sum-2d", operands=2, digits=2, operators="+"),
        Level("sum-3d", operands=2, digits=3, operators="+"),
        Level("ops-2", operands=3, digits=1, operators="+-*", bounds=(1, 9)),
        Level("ops-3", operands=4, digits=1, operators="+-*", bounds=(1, 9)),
        Level("ops-3-2d", operands=4, digits=2, operators="+-*"),
    )
}
DEFAULT_LEVEL = "sum-1d"


def evaluate(operands: list[int], operators: list[str]) -> int:
    """The value of `operands[0] op[0] operands[1] ...` with * before + and - (left to right otherwise)."""
    terms = [operands[0]]  # each a product, added with its sign
    for op, value in zip(operators, operands[1:], strict=True):
        if op == "*":
            terms[-1] *= value
        else:
            terms.append(value if op == "+" else -value)
    return sum(terms)


def question(operands: list[int], operators: list[str]) -> str:
    expression = str(operands[0])
    for op, value in zip(operators, operands[1:], strict=True):
        expression += f" {SHOWN[op]} {value}"
    return f"What is {expression}?"


class ArithmeticTask(NumericTask):
    family = FAMILY

    def __init__(self, level: str = DEFAULT_LEVEL) -> None:
        super().__init__(level, LEVELS)
        self.spec = LEVELS[level]

    def make(self, operands: list[int], operators: list[str]) -> Problem:
        return make_problem(
            FAMILY,
            self.level,
            question(operands, operators),
            str(evaluate(operands, operators)),
            operands=operands,
            operators="".join(operators),
        )

    def draw(self, rng: random.Random) -> Problem:
        spec = self.spec
        operands = [rng.randint(spec.low, spec.high) for _ in range(spec.operands)]
        operators = [rng.choice(spec.operators) for _ in range(spec.operands - 1)]
        return self.make(operands, operators)

    def all_problems(self) -> list[Problem] | None:
        return _listed(self.level) if self.spec.size <= LISTED_UP_TO else None

    def split_key(self, problem: Problem) -> str:
        operands: list[int] = problem.meta["operands"]
        operators: str = problem.meta["operators"]
        if len(set(operators)) == 1 and operators[0] in "+*":  # commutative: the operands as a multiset
            return f"{FAMILY}|{operators[0]}|{sorted(operands)}"
        return f"{FAMILY}|{operators}|{operands}"


@cache
def _listed(level: str) -> list[Problem]:
    task, spec = ArithmeticTask(level), LEVELS[level]
    numbers = range(spec.low, spec.high + 1)
    return [
        task.make(list(operands), list(operators))
        for operands in itertools.product(numbers, repeat=spec.operands)
        for operators in itertools.product(spec.operators, repeat=spec.operands - 1)
    ]
