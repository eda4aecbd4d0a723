"""The task library's rewards: for the scoring stage by import path, and for a trainer in its own process.

The scoring stage (`rollouts scorer --tokenizer DIR`) gives a reward function each rollout as a dict with the reply
decoded in `text` and the prompt's `meta`, which names the task and level: so one function scores every task.

- `"producers.tasks.rewards:exact_match"`: 1.0 when the reply's answer is right, else 0.0.
- `"producers.tasks.rewards:exact_match_with_format"`: the same plus `meta["format_weight"]` (default
  `FORMAT_WEIGHT`) when the reply follows the format (an `Answer:` followed on its line by a value: see
  `producers.tasks.answers` and `producers.tasks.countdown`).

A view without `text` (a scorer started without `--tokenizer`) fails with a `ValueError` that says so, which the
stage turns into the group's `reward_error`. In a trainer: `score_text(text, meta)`, or `text_reward(decode)` for
the reward function of `producers.grpo.grpo_step`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from producers.tasks.registry import get_task

if TYPE_CHECKING:
    from pipeline.wire import Rollout

FORMAT_WEIGHT = 0.1
"""What `exact_match_with_format` adds for a reply that follows the format, unless the prompt's meta sets
`format_weight`."""
NEEDS_TEXT = "needs the reply's text: start the scorer with --tokenizer DIR (the workers' model or tokenizer)"


def task_of(meta: Mapping[str, Any]) -> str:
    """The registry name of the task `meta` is a problem of (`arithmetic:sum-1d`)."""
    if not isinstance(meta, Mapping) or "task" not in meta:
        raise ValueError(f"meta {meta!r:.120} names no task: submit the problem's meta (`Problem.meta`)")
    return f"{meta['task']}:{meta['level']}" if meta.get("level") else str(meta["task"])


def score_text(text: str, meta: Mapping[str, Any], format_weight: float = 0.0) -> float:
    """The reward of the reply `text` to the problem whose meta is `meta`: 1.0 or 0.0 (garbage text: 0.0), plus
    `format_weight` when the reply follows the format. `ValueError` when `meta` is not a problem's."""
    return get_task(task_of(meta)).reward(text, meta, format_weight)


def _text(rollout: Mapping[str, Any]) -> str:
    text = rollout.get("text")
    if text is None:
        raise ValueError(f"producers.tasks.rewards {NEEDS_TEXT}")
    return str(text)


def exact_match(rollout: Mapping[str, Any]) -> float:
    """The scoring stage's reward: 1.0 when the reply (`rollout["text"]`) answers `rollout["meta"]` right, else 0.0."""
    return score_text(_text(rollout), rollout["meta"])


def exact_match_with_format(rollout: Mapping[str, Any]) -> float:
    """`exact_match`, plus `meta["format_weight"]` (default `FORMAT_WEIGHT`) when the reply follows the format."""
    meta = rollout["meta"]
    weight = meta.get("format_weight", FORMAT_WEIGHT) if isinstance(meta, Mapping) else FORMAT_WEIGHT
    return score_text(_text(rollout), meta, float(weight))


def text_reward(decode: Callable[[Sequence[int]], str], format_weight: float = 0.0) -> Callable[[Rollout], float]:
    """A trainer's reward function of one rollout (`producers.grpo.RewardFn`): its tokens through `decode` (e.g.
    `lambda ids: tokenizer.decode(ids, skip_special_tokens=True)`), scored against its meta by `score_text`."""

    def reward(rollout: Rollout) -> float:
        return score_text(decode(rollout.tokens.tolist()), rollout.meta, format_weight)

    return reward
