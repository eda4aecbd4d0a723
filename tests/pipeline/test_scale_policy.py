"""`ScalePolicy`: the fleet's size from its need over time (`pipeline.scaling`), on a clock the test moves."""

from __future__ import annotations

import pytest

from pipeline.scaling import ScalePolicy


def test_it_grows_at_once_within_the_maximum_and_never_below_the_minimum() -> None:
    policy = ScalePolicy(1, 3, cooldown_s=30)
    assert policy.decide(0, 0, now=0).target == 1, "the minimum even with nothing to do"
    assert policy.decide(2, 1, now=1).target == 2
    up = policy.decide(9, 2, now=2)
    assert (up.target, up.why) == (3, "need 9 above 2 workers (within 1..3)")
    assert policy.decide(9, 3, now=3).why == "steady"
    assert policy.decide(None, 3, now=4).target == 3, "an unknown need keeps the size"


def test_it_shrinks_only_after_the_cooldown_to_the_most_it_needed_meanwhile() -> None:
    policy = ScalePolicy(1, 4, cooldown_s=30)
    held = policy.decide(0, 4, now=100)
    assert (held.target, held.why) == (4, "need 0 below 4 workers for 0 of 30 s")
    assert policy.decide(2, 4, now=110).target == 4
    assert policy.decide(1, 4, now=129).target == 4
    down = policy.decide(0, 4, now=130)
    assert (down.target, down.why) == (2, "need stayed below 4 workers for 30 s (within 1..4)"), "the peak: 2"
    assert policy.decide(0, 2, now=131).target == 2, "a new cool-down starts"
    assert policy.decide(0, 2, now=161).target == 1, "then the minimum, not 0"
    assert policy.decide(0, 1, now=200).why == "steady"


def test_a_need_back_up_during_the_cooldown_restarts_it() -> None:
    policy = ScalePolicy(0, 3, cooldown_s=10)
    assert policy.decide(0, 3, now=0).target == 3
    assert policy.decide(3, 3, now=9).why == "steady"
    assert policy.decide(0, 3, now=12).target == 3, "the cool-down counts from 12, not from 0"
    assert policy.decide(0, 3, now=22).target == 0, "a minimum of 0 lets the fleet go"
    assert policy.decide(None, 0, now=23).target == 0


@pytest.mark.parametrize(("minimum", "maximum"), [(-1, 2), (3, 2), (0, 0)])
def test_bad_bounds_are_refused(minimum: int, maximum: int) -> None:
    with pytest.raises(ValueError, match="minimum <= maximum"):
        ScalePolicy(minimum, maximum)
