"""Reward functions the scoring tests name by import path (`tests.rewards:...`), as a user names theirs.

The sleeps here are the behaviour under test, not waits: a reward function that hangs (`hangs`,
`stalls_first_call`) or is slow enough to be caught in flight (`slow`) is what the scorer must survive.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from consumers.scoring.job import group_reward


def even_share(rollout: dict[str, Any]) -> float:
    """The share of even token ids: computed from the rollout alone, so a test can check it."""
    tokens = rollout["tokens"]
    return sum(1 for t in tokens if t % 2 == 0) / max(1, len(tokens))


@group_reward
def rank_by_length(group: list[dict[str, Any]]) -> list[float]:
    """A group reward: each sample's rank by length (ties by sample index) over the group size."""
    order = sorted(range(len(group)), key=lambda i: (len(group[i]["tokens"]), i))
    ranks = [0.0] * len(group)
    for rank, i in enumerate(order):
        ranks[i] = rank / len(group)
    return ranks


async def async_even_share(rollout: dict[str, Any]) -> float:
    await asyncio.sleep(0)  # behaviour under test: a coroutine reward function that yields to the loop
    return even_share(rollout)


def raises(rollout: dict[str, Any]) -> float:
    raise ValueError("cannot parse the answer")


def not_a_number(rollout: dict[str, Any]) -> Any:
    return "high"


def hangs(rollout: dict[str, Any]) -> float:
    time.sleep(3600)  # behaviour under test: a reward function that never returns (the timeout must catch it)
    return 0.0


def slow(rollout: dict[str, Any]) -> float:
    """Slow enough that groups are in flight when a test kills a scorer."""
    time.sleep(0.3)  # behaviour under test: a slow reward function, so groups are in flight at the kill
    return even_share(rollout)


def stalls_first_call(rollout: dict[str, Any]) -> float:
    """The first call of a test (a marker file in `SCORING_TEST_DIR` decides) stalls until its scorer is killed."""
    marker = Path(os.environ["SCORING_TEST_DIR"]) / "started"
    try:
        marker.touch(exist_ok=False)
    except FileExistsError:
        return even_share(rollout)
    time.sleep(600)  # behaviour under test: a reward call that stalls until its scorer is killed
    return 0.0


def imports_transformers(rollout: dict[str, Any]) -> float:
    """`even_share`, after importing transformers inside the call (as `examples/my_rewards.py` does): in a fresh
    scorer the first import happens on its reward threads."""
    from transformers import AutoTokenizer

    return even_share(rollout) if callable(AutoTokenizer.from_pretrained) else -1.0
