"""The token-set task's reward, as the trainer and the scoring stage compute it."""

from __future__ import annotations

import pytest

from producers.tasks import TokenSetTask, token_set_reward

SET = TokenSetTask().set_ids(0)


def sample(tokens: list[int], finish: str = "length", **meta: object) -> dict[str, object]:
    return {"tokens": tokens, "finish_reason": finish, "meta": {"ids": SET, **meta}}


def test_the_reward_is_the_share_of_set_tokens_a_final_stop_token_aside() -> None:
    assert token_set_reward(sample([SET[0], SET[1], 300, 301])) == 0.5
    assert token_set_reward(sample([SET[0], 2], finish="stop")) == 1.0, "the EOS that ended it does not count"
    assert token_set_reward(sample([])) == 0.0


def test_where_a_length_is_demanded_stopping_early_scores_only_its_share_of_it() -> None:
    stop = TokenSetTask().stop_ids(8)[3]
    assert token_set_reward(sample([SET[0], SET[1], stop], finish="stop", length=8)) == 2 / 8
    assert token_set_reward(sample([SET[0]] * 8 + [300] * 8, length=8)) == 0.5, "past the demand: the share again"


def test_stop_ids_are_no_marker_set_member_or_filler() -> None:
    task = TokenSetTask()
    stops = set(task.stop_ids(task.max_stop_ids))
    taken = {*range(*task.filler_ids), *(task.first_marker_id + k for k in range(task.n_sets))}
    taken |= {i for k in range(task.n_sets) for i in task.set_ids(k)}
    assert len(stops) == task.max_stop_ids and not stops & taken
    with pytest.raises(ValueError, match="the task has 0 to 64"):
        task.stop_ids(65)
