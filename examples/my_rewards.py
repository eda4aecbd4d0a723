"""Reward functions that the scoring stage runs: a prompt names one, and its group reaches the trainer scored.

    client.submit("What is 12 + 30?", n=8, meta={"answer": "42"}, reward_fn="my_rewards:exact_match")
    MY_REWARDS_MODEL=./tiny PYTHONPATH=examples rollouts scorer --redis URL --ns exp1   # where this file imports

A function gets each rollout as a plain dict (`id prompt_id sample n prompt_tokens tokens finish_reason version meta
error`, token ids as lists, `meta` the prompt's) and returns a number; one marked `@group_reward` gets the whole group
and returns one number per sample, in sample order. Either may be `async def`.

`MY_REWARDS_MODEL` (environment, where the scorer or the score-workers run): the directory of the workers' model, whose
tokenizer turns a sample's token ids back into text. Without it every group these functions score gets a
`reward_error` that says to set it.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from consumers.scoring.job import group_reward


@functools.cache
def _tokenizer() -> Any:
    from transformers import AutoTokenizer

    model = os.environ.get("MY_REWARDS_MODEL")
    if not model:
        raise RuntimeError("set MY_REWARDS_MODEL to the workers' model directory where the scorer runs")
    return AutoTokenizer.from_pretrained(model)  # the workers' model directory


def decode(tokens: list[int]) -> str:
    """A sample's text, without special tokens or surrounding blanks."""
    return str(_tokenizer().decode(tokens, skip_special_tokens=True)).strip()


def exact_match(rollout: dict[str, Any]) -> float:
    """1 when the sample's text is the prompt's `meta["answer"]`, else 0."""
    return float(decode(rollout["tokens"]) == rollout["meta"]["answer"])


@group_reward
def pairwise(group: list[dict[str, Any]]) -> list[float]:
    """Each sample's share of the others it beats: a right answer beats a wrong one, and between two alike the
    shorter wins (ties count half)."""

    def score(rollout: dict[str, Any]) -> tuple[float, int]:
        return exact_match(rollout), -len(rollout["tokens"])

    scores = [score(r) for r in group]
    others = max(1, len(group) - 1)
    return [
        sum(1.0 if mine > theirs else 0.5 if mine == theirs else 0.0 for j, theirs in enumerate(scores) if j != i)
        / others
        for i, mine in enumerate(scores)
    ]
