"""What a verifiable task is: problems with a known answer, drawn by seed from a train or a held-out eval split, and
a reward that checks a reply's text against the answer.

A problem belongs to a split by a stable hash of its content (its *split key*: `split_of`), never by the seed that
drew it: train and eval never share a problem, whatever the seeds, and the eval split is one fixed set that a seed
only picks from. A task whose space is small (one-digit sums: 100 problems) lists it whole and samples from the
split's part; a large one draws at random and keeps what falls in the asked split.

Pure Python: the reward runs in a trainer, inline in the scoring stage and on RQ workers alike.
"""

from __future__ import annotations

import copy
import hashlib
import random
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol, get_args

Split = Literal["train", "eval"]
SPLITS: tuple[Split, ...] = get_args(Split)

EVAL_PER_MILLE = 200
"""The share of every task's problems (by split key) held out for eval: 200 of 1000 hash buckets, about 20 %."""

NUMBER_INSTRUCTION = "Give the final answer as a number after 'Answer:'."
"""What a problem with a numeric answer asks for after its question."""


def stable_hash(text: str) -> int:
    """A 64-bit hash of `text` that is the same in every process and on every machine (Python's `hash()` is not)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def split_of(key: str) -> Split:
    """The split of the problem whose split key is `key`: `eval` for about 20 % of keys (`EVAL_PER_MILLE`)."""
    return "eval" if stable_hash(f"split|{key}") % 1000 < EVAL_PER_MILLE else "train"


@dataclass(frozen=True)
class Problem:
    """One problem: what to ask the policy (`messages`, for the chat template) and what its rollouts carry (`meta`:
    the task, its level, the answer and whatever the verifier needs, JSON-able, so a recorded rollout can be scored
    again offline)."""

    id: str
    """Stable: the task, the level and a hash of the content (the same problem has the same id in every run)."""
    question: str
    messages: list[dict[str, str]]
    """One user message: the question, then the task's instruction (`NUMBER_INSTRUCTION` for numeric tasks)."""
    answer: str
    meta: dict[str, Any]
    """`task`, `level`, `answer`, and the verifier's inputs (countdown: `numbers`, `target`)."""

    @property
    def prompt(self) -> str:
        """The user message's text: what `RolloutClient.submit(text)` puts through the chat template."""
        return self.messages[0]["content"]


def make_problem(
    family: str, level: str, question: str, answer: str, instruction: str = NUMBER_INSTRUCTION, **extra: Any
) -> Problem:
    """A `Problem` of task `family:level`, its id from its content, its meta `task`, `level`, `answer` and `extra`."""
    digest = hashlib.sha256(f"{family}|{level}|{question}|{answer}".encode()).hexdigest()[:12]
    return Problem(
        id=f"{family}:{level}:{digest}",
        question=question,
        messages=[{"role": "user", "content": f"{question} {instruction}"}],
        answer=answer,
        meta={"task": family, "level": level, "answer": answer, **extra},
    )


class Task(Protocol):
    """A verifiable task: what the registry (`producers.tasks.get_task`) hands out."""

    @property
    def name(self) -> str:
        """`family:level`, as `get_task` takes it (`arithmetic:sum-1d`)."""
        ...

    def problems(self, split: Split, count: int, seed: int = 0) -> list[Problem]:
        """`count` distinct problems of `split`, the same ones for the same seed."""
        ...

    def parse(self, text: str) -> Any:
        """The answer a reply gives (None when it gives none); never raises."""
        ...

    def reward(self, text: str, meta: Mapping[str, Any], format_weight: float = 0.0) -> float:
        """1.0 when the reply's answer is right, else 0.0; plus `format_weight` when it follows the format."""
        ...


_POOLS: dict[tuple[str, str, Split], list[Problem] | None] = {}


def _copy(problem: Problem) -> Problem:
    return replace(problem, messages=[dict(m) for m in problem.messages], meta=copy.deepcopy(problem.meta))


class GeneratedTask(ABC):
    """A task whose problems a seeded generator makes: `problems` and `reward` here, the rest in each task."""

    family: str
    level: str

    def __init__(self, level: str, levels: Collection[str]) -> None:
        """A task of `level`, one of its family's `levels` (`ValueError` naming them otherwise)."""
        if level not in levels:
            raise ValueError(f"{self.family} level {level!r}: one of {', '.join(levels)}")
        self.level = level

    @property
    def name(self) -> str:
        return f"{self.family}:{self.level}"

    # -- what each task says ---------------------------------------------------------------------

    @abstractmethod
    def draw(self, rng: random.Random) -> Problem:
        """One problem at random (of either split)."""

    def all_problems(self) -> list[Problem] | None:
        """Every problem of the level, in a fixed order, where there are few enough to list; None where not."""
        return None

    def split_key(self, problem: Problem) -> str:
        """What decides the problem's split: by default its family and question."""
        return f"{self.family}|{problem.question}"

    @abstractmethod
    def parse(self, text: str) -> Any:
        """The answer a reply gives, or None; never raises."""

    @abstractmethod
    def correct(self, text: str, meta: Mapping[str, Any]) -> bool:
        """Whether the reply's answer is right; never raises on any text."""

    @abstractmethod
    def formatted(self, text: str, meta: Mapping[str, Any]) -> bool:
        """Whether the reply follows the format (an `Answer:` with a value the parser takes); never raises."""

    # -- shared ----------------------------------------------------------------------------------

    def split(self, problem: Problem) -> Split:
        return split_of(self.split_key(problem))

    def problems(self, split: Split, count: int, seed: int = 0) -> list[Problem]:
        """`count` distinct problems of `split` drawn with `seed`: the same list for the same arguments. `ValueError`
        when the split holds fewer (one-digit sums: about 20 eval problems)."""
        if split not in SPLITS:
            raise ValueError(f"split {split!r}: train or eval")
        if count < 0:
            raise ValueError(f"count must be >= 0, not {count}")
        rng = random.Random(f"{self.name}|{split}|{seed}")
        pool = self._pool(split)
        if pool is not None:
            if count > len(pool):
                raise ValueError(f"{self.name} has {len(pool)} {split} problems: ask for at most {len(pool)}")
            return [_copy(p) for p in rng.sample(pool, count)]  # the pool's own stay as they are
        found: dict[str, Problem] = {}
        attempts = 100 * count + 10_000
        for _ in range(attempts):
            if len(found) == count:
                break
            problem = self.draw(rng)
            if problem.id not in found and self.split(problem) == split:
                found[problem.id] = problem
        if len(found) < count:
            raise ValueError(f"{self.name}: only {len(found)} distinct {split} problems in {attempts} draws")
        return list(found.values())

    def split_size(self, split: Split) -> int | None:
        """How many problems `split` holds where the level is small enough to list them (one-digit sums: 16 eval
        problems); None where it is not (draw as many as you like)."""
        pool = self._pool(split)
        return None if pool is None else len(pool)

    def _pool(self, split: Split) -> list[Problem] | None:
        """The listed problems of `split` (None for a level too large to list), worked out once per task and split."""
        key = (type(self).__qualname__, self.name, split)
        if key not in _POOLS:
            listed = self.all_problems()
            _POOLS[key] = None if listed is None else [p for p in listed if self.split(p) == split]
        return _POOLS[key]

    def reward(self, text: str, meta: Mapping[str, Any], format_weight: float = 0.0) -> float:
        """1.0 when the reply's answer is right, else 0.0, plus `format_weight` when the reply follows the format.
        Any text scores (garbage: 0.0); a `meta` that is not this task's raises `ValueError`."""
        self.check_meta(meta)
        if not isinstance(text, str):
            return 0.0
        score = 1.0 if self.correct(text, meta) else 0.0
        return score + (format_weight if format_weight and self.formatted(text, meta) else 0.0)

    def check_meta(self, meta: Mapping[str, Any]) -> None:
        """`ValueError` when `meta` is not a problem of this task's family (what the verifier reads is missing)."""
        if not isinstance(meta, Mapping) or meta.get("task") != self.family or "answer" not in meta:
            shown = dict(meta) if isinstance(meta, Mapping) else meta
            raise ValueError(f"{self.name}: meta {shown!r:.120} is not a {self.family} problem's (task, answer)")
