"""A task the random tiny model measurably learns by RL: the token set that the prompt names.

Each prompt is a few random tokens followed by one of `n_sets` marker tokens; marker `k` names a
set of `set_size` token ids. The reward of a sample is the fraction of its generated tokens (a
stop token aside) that lie in the named set: dense, verifiable, and computed from the rollout
alone (the set travels in `meta`), so recorded rollouts can be scored again offline.

Why this one: a random policy scores about `set_size / vocab` (1.6 % with the defaults). The
policy can first learn to emit the union of all sets (reward about `1 / n_sets`), and only then
to read the marker and pick the right set (reward toward 1): a curve with two phases that takes
tens of steps, where a single fixed set is learned in a handful (too easy to show anything).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.wire import Rollout


@dataclass(frozen=True)
class TokenSetTask:
    n_sets: int = 4
    set_size: int = 8
    first_set_id: int = 64
    """Set `k` is the ids `first_set_id + k * set_size + j`, `j < set_size`."""
    first_marker_id: int = 16
    """Marker `k` is the id `first_marker_id + k`."""
    prompt_tokens: tuple[int, int] = (3, 8)
    """Random tokens before the marker: between these two counts."""
    filler_ids: tuple[int, int] = (200, 500)
    """Random tokens are drawn from this id range (no marker, no set member, no special token)."""
    first_stop_id: int = 100
    """Where a policy decides its own length, stop id `j` is `first_stop_id + j` (no marker, set member or filler)."""
    max_stop_ids: int = 64

    def set_ids(self, k: int) -> list[int]:
        start = self.first_set_id + k * self.set_size
        return list(range(start, start + self.set_size))

    def stop_ids(self, count: int) -> list[int]:
        """The `count` ids that end a sample where the policy decides its length (the engine's EOS ends it too)."""
        if not 0 <= count <= self.max_stop_ids:
            raise ValueError(f"{count} stop ids: the task has 0 to {self.max_stop_ids}")
        return list(range(self.first_stop_id, self.first_stop_id + count))

    def prompt(self, rng: random.Random, named_set: int | None = None) -> tuple[list[int], dict[str, Any]]:
        """Token ids of one prompt and the `meta` its rollouts carry (which set, and its ids): of set `named_set`, or
        of one drawn from `rng`."""
        k = rng.randrange(self.n_sets) if named_set is None else named_set
        if not 0 <= k < self.n_sets:
            raise ValueError(f"set {k}: the task has sets 0 to {self.n_sets - 1}")
        filler = [rng.randrange(*self.filler_ids) for _ in range(rng.randint(*self.prompt_tokens))]
        return [*filler, self.first_marker_id + k], {"task": "token-set", "set": k, "ids": self.set_ids(k)}


def token_set_reward(rollout: Rollout | dict[str, Any]) -> float:
    """The fraction of generated tokens in `meta["ids"]`; a final stop token does not count, empty gives 0. Where the
    prompt demands a length (`meta["length"]`, the policy deciding its own), the set tokens over the larger of the
    sample's length and that one: a sample that stops early scores at most its share of the demand.

    Takes a `Rollout` (in the trainer) or the dict a scoring stage passes (`rollouts scorer`, with
    `reward_fn="producers.tasks:token_set_reward"`), so the same reward runs in either place.
    """
    view = rollout if isinstance(rollout, dict) else rollout.model_dump(include={"tokens", "finish_reason", "meta"})
    tokens = np.asarray(view["tokens"])
    if view["finish_reason"] == "stop" and len(tokens):
        tokens = tokens[:-1]
    hits = int(np.isin(tokens, np.asarray(view["meta"]["ids"])).sum())
    length = max(len(tokens), int(view["meta"].get("length", 0)))
    return hits / length if length else 0.0
