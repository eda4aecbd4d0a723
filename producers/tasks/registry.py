"""The verifiable tasks by name: `family:level` (`arithmetic:sum-1d`), or a family alone for its default level
(`arithmetic` is `arithmetic:sum-1d`, `word-problems` is `word-problems:mixed`, `countdown` is `countdown:n3`)."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

from producers.tasks import arithmetic, countdown, word_problems
from producers.tasks.base import GeneratedTask

_FAMILIES: dict[str, tuple[Callable[[str], GeneratedTask], list[str], str]] = {
    arithmetic.FAMILY: (arithmetic.ArithmeticTask, list(arithmetic.LEVELS), arithmetic.DEFAULT_LEVEL),
    word_problems.FAMILY: (word_problems.WordProblemsTask, list(word_problems.LEVELS), word_problems.DEFAULT_LEVEL),
    countdown.FAMILY: (countdown.CountdownTask, list(countdown.LEVELS), countdown.DEFAULT_LEVEL),
}

TASKS: tuple[str, ...] = tuple(f"{family}:{level}" for family, (_, levels, _) in _FAMILIES.items() for level in levels)
"""Every task's full name, family by family, each family's levels easiest first."""
FAMILIES: tuple[str, ...] = tuple(_FAMILIES)


@cache
def get_task(name: str) -> GeneratedTask:
    """The task called `name` (`family:level`, or a family for its default level); `ValueError` naming the known
    ones otherwise. One instance a name: it is cheap to ask again."""
    family, _, level = name.partition(":")
    if family in _FAMILIES:
        make, levels, default = _FAMILIES[family]
        if not level or level in levels:
            return make(level or default)
    raise ValueError(f"unknown task {name!r}: one of {', '.join(TASKS)} (or a family alone: {', '.join(FAMILIES)})")
