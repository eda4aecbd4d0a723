"""Countdown: reach a target from given numbers, each used at most once, with + - * / and parentheses.

Each problem is made by building a random expression over the given numbers (whole, positive intermediate values,
exact divisions only), so a solution exists; its value is the target (2-999, never one of the numbers), and the
expression is the problem's `answer` (one solution of possibly many). Levels: `n3` (3 numbers, the family's default)
and `n4` (4 numbers), each 1-25.

The reply's expression (`parse_expression`): what follows its last `Answer:` on that line, up to an `=`
(`Answer: (3 + 5) * 2 = 16` gives `(3 + 5) * 2`); or else, in its last line with an `=`, the digits, operators,
parentheses and spaces right before the first `=` (`so 3 * 8 = 24` gives `3 * 8`). The multiplication, division
and minus signs are read as `*`, `/` and `-`; Markdown `*`, `$` and backticks around it and a final period are
dropped. It is right when it evaluates to the target and the numbers it uses are some of the given ones, each at
most as many times as given (`check`).

The expression is evaluated by walking its syntax tree (`ast.parse`, nothing executed), which may hold only whole
numbers, + - * / and parentheses: no names, calls, attributes, powers, unary signs or other literals. So
`__import__('os')` is refused as it is read. Evaluation is exact (fractions): `8 / (3 - 8 / 3)` is 24. The format
rule: the reply's last `Answer:` is followed on its line by an expression this evaluator takes.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from collections import Counter
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any

from producers.tasks.answers import last_tag_end
from producers.tasks.base import GeneratedTask, Problem, make_problem

FAMILY = "countdown"
LEVELS: dict[str, int] = {"n3": 3, "n4": 4}
"""Each level's count of given numbers."""
DEFAULT_LEVEL = "n3"
NUMBER_RANGE = (1, 25)
TARGET_RANGE = (2, 999)
INSTRUCTION = "Give the expression after 'Answer:'."
MAX_EXPRESSION = 200
"""A longer expression is not read (no deeply nested input reaches the parser)."""

_OPERATORS: dict[type[ast.operator], Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
_SYMBOL = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


class Refused(ValueError):
    """An expression the evaluator does not take (what is wrong with it, in the message)."""


def _walk(node: ast.expr, used: list[int]) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _walk(node.left, used), _walk(node.right, used)
        if isinstance(node.op, ast.Div) and right == 0:
            raise Refused("division by zero")
        return _OPERATORS[type(node.op)](left, right)
    raise Refused(f"{type(node).__name__} is not allowed: only whole numbers, + - * / and parentheses")


def evaluate(expression: str) -> tuple[Fraction, list[int]]:
    """The exact value of `expression` and the numbers it uses, in order; `Refused` for anything else than whole
    numbers, + - * / and parentheses (nothing in it is ever executed)."""
    if len(expression) > MAX_EXPRESSION:
        raise Refused(f"longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise Refused(f"not an expression: {type(exc).__name__}") from None
    used: list[int] = []
    return _walk(tree.body, used), used


def _clean(expression: str) -> str:
    for sign, operator_ in _SIGNS.items():
        expression = expression.replace(sign, operator_)
    return expression.strip().strip("*$` \t").rstrip(".").strip("*$` \t")


_SIGNS = {"\u00d7": "*", "\u00f7": "/", "\u2212": "-"}
"""The multiplication, division and minus signs, read as the operators."""
_BEFORE_EQUALS = re.compile(r"([\d\s+\-*/()`$\u00d7\u00f7\u2212]*)=")
"""What an expression can be written with, up to the first `=` of a line (prose before it is left out)."""


def _cut(line: str) -> str:
    return _clean(line.split("=", 1)[0])


def tagged_expression(text: str) -> str | None:
    """The expression on the line of the reply's last `Answer:` (cut at an `=`), or None without one."""
    start = last_tag_end(text)
    if start is None:
        return None
    line = text[start:].split("\n", 1)[0]
    return _cut(line) or None


def parse_expression(text: str) -> str | None:
    """The expression a reply gives (the module's rule), or None; never raises."""
    if not isinstance(text, str):
        return None
    tagged = tagged_expression(text)
    if tagged is not None:
        return tagged
    lines = [line for line in text.splitlines() if "=" in line]
    m = _BEFORE_EQUALS.search(lines[-1]) if lines else None
    return (_clean(m.group(1)) or None) if m else None


def check(expression: str | None, numbers: list[int], target: int) -> bool:
    """Whether `expression` evaluates to `target` using only `numbers`, each at most as often as given."""
    if expression is None:
        return False
    try:
        value, used = evaluate(expression)
    except Refused:
        return False
    return value == target and not Counter(used) - Counter(numbers)


def solve_once(numbers: list[int], rng: random.Random) -> tuple[str, int] | None:
    """A random expression over all of `numbers` (in a random order and shape) with whole, positive intermediate
    values, and its value; None when a draw breaks that (the caller draws again)."""
    parts: list[tuple[str, int, bool]] = [(str(n), n, True) for n in numbers]  # text, value, atomic
    rng.shuffle(parts)
    while len(parts) > 1:
        i = rng.randrange(len(parts) - 1)
        (a_text, a, a_atom), (b_text, b, b_atom) = parts[i], parts[i + 1]
        op = rng.choice([ast.Add, ast.Sub, ast.Mult, ast.Div])
        if (op is ast.Sub and a <= b) or (op is ast.Div and (b == 1 or a % b)):
            return None
        value = int(_OPERATORS[op](Fraction(a), Fraction(b)))
        left = a_text if a_atom or op in (ast.Add, ast.Sub) else f"({a_text})"
        right = b_text if b_atom else f"({b_text})"
        parts[i : i + 2] = [(f"{left} {_SYMBOL[op]} {right}", value, False)]
    return parts[0][0], parts[0][1]


class CountdownTask(GeneratedTask):
    family = FAMILY

    def __init__(self, level: str = DEFAULT_LEVEL) -> None:
        super().__init__(level, LEVELS)
        self.count = LEVELS[level]

    def make(self, numbers: list[int], expression: str, target: int) -> Problem:
        shown = ", ".join(map(str, numbers[:-1])) + f" and {numbers[-1]}"
        question = (
            f"Using the numbers {shown}, each at most once, and +, -, *, / and parentheses, write an expression "
            f"equal to {target}."
        )
        return make_problem(FAMILY, self.level, question, expression, INSTRUCTION, numbers=numbers, target=target)

    def draw(self, rng: random.Random) -> Problem:
        while True:
            numbers = [rng.randint(*NUMBER_RANGE) for _ in range(self.count)]
            solved = solve_once(numbers, rng)
            if solved is None:
                continue
            expression, target = solved
            if TARGET_RANGE[0] <= target <= TARGET_RANGE[1] and target not in numbers:
                return self.make(numbers, expression, target)

    def split_key(self, problem: Problem) -> str:
        return f"{FAMILY}|{sorted(problem.meta['numbers'])}|{problem.meta['target']}"

    def parse(self, text: str) -> str | None:
        return parse_expression(text)

    def correct(self, text: str, meta: Mapping[str, Any]) -> bool:
        numbers, target = _given(meta)
        return check(parse_expression(text), numbers, target)

    def formatted(self, text: str, meta: Mapping[str, Any]) -> bool:
        expression = tagged_expression(text) if isinstance(text, str) else None
        if expression is None:
            return False
        try:
            evaluate(expression)
        except Refused:
            return False
        return True


def _given(meta: Mapping[str, Any]) -> tuple[list[int], int]:
    try:
        numbers, target = [int(n) for n in meta["numbers"]], int(meta["target"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"countdown meta {dict(meta)!r:.120} needs `numbers` (a list of ints) and `target`") from None
    return numbers, target
