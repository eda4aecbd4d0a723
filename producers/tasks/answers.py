"""The number a reply gives, and the format rule: the parser of every task whose answer is a number.

The rule (`parse_number`): the first number after the reply's last `Answer:` (any case, `**Answer:**` too) if one
follows it; else the last number anywhere in the reply. A number is an optional minus sign (not right after a letter,
a digit or `)`, so `5-3` holds 5 and 3), digits with or without thousands commas (`1,234`; `12,34` is two numbers), and
an optional decimal part (`7.5`; in `Answer: 7.` the period ends the sentence). Numbers compare as exact fractions:
`5.0` is 5.

The format rule (`tagged_number`): the reply's last `Answer:` is followed, on its line, after nothing but spaces, `*`
(Markdown bold) or `$`, by a number. `Answer: 1,234.` and `**Answer:** $12` follow it; `Answer: about 12` and
`Answer:` then the number on the next line do not (the parser still reads 12 from both).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from producers.tasks.base import GeneratedTask

NUMBER = re.compile(r"(?:(?<![\w)])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?!\d)")
ANSWER_TAG = re.compile(r"answer\s*:", re.IGNORECASE)
TAGGED = re.compile(rf"[ \t*$]*({NUMBER.pattern})")
MAX_DIGITS = 100
"""A longer run of digits is not taken for a number (and cannot make the parser slow or raise)."""


def to_number(text: str) -> Fraction | None:
    """`text` (one number as `NUMBER` reads it: `-1,234.50`) as an exact fraction; None if it is not one."""
    cleaned = text.replace(",", "")
    if len(cleaned) > MAX_DIGITS + 2:
        return None
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def _numbers(text: str) -> list[Fraction]:
    found = (to_number(m.group()) for m in NUMBER.finditer(text))
    return [n for n in found if n is not None]


def last_tag_end(text: str) -> int | None:
    """Where the text after the reply's last `Answer:` starts; None when it has none."""
    end = None
    for m in ANSWER_TAG.finditer(text):
        end = m.end()
    return end


def parse_number(text: str) -> Fraction | None:
    """The number a reply gives (the module's rule), or None when it holds none; never raises."""
    if not isinstance(text, str):
        return None
    start = last_tag_end(text)
    if start is not None:
        after = _numbers(text[start:])
        if after:
            return after[0]
    found = _numbers(text)
    return found[-1] if found else None


def tagged_number(text: str) -> Fraction | None:
    """The number right after the reply's last `Answer:` (the format rule), or None when the reply breaks it."""
    if not isinstance(text, str):
        return None
    start = last_tag_end(text)
    if start is None:
        return None
    m = TAGGED.match(text, start)
    return to_number(m.group(1)) if m else None


def answer_number(meta: Mapping[str, Any]) -> Fraction:
    """The problem's answer (`meta["answer"]`) as a number; `ValueError` when it is not one."""
    value = to_number(str(meta["answer"]).strip())
    if value is None:
        raise ValueError(f"meta answer {meta['answer']!r:.40} is not a number")
    return value


class NumericTask(GeneratedTask):
    """A task whose answer is a number: parsed by `parse_number`, formatted as `tagged_number` says."""

    def parse(self, text: str) -> Fraction | None:
        return parse_number(text)

    def correct(self, text: str, meta: Mapping[str, Any]) -> bool:
        return parse_number(text) == answer_number(meta)

    def formatted(self, text: str, meta: Mapping[str, Any]) -> bool:
        return tagged_number(text) is not None
