"""A worker's take budget (`consumers.budget.TakeBudget`), on its own: no Redis, no engine.

It counts the samples and tokens in flight against two caps, says how much room is left and how many entries to take
for it, lets an entry larger than a cap run alone, and wakes an entry that waits for room when room opens or the
worker stops."""

from __future__ import annotations

import asyncio

from consumers.budget import TakeBudget


def budget(samples: int, tokens: int | None = None) -> TakeBudget:
    return TakeBudget(lambda: (samples, tokens))


def test_an_empty_budget_has_all_its_samples_free_and_takes_one_entry_until_it_has_seen_one() -> None:
    b = budget(8)
    assert b.free() == 8
    assert b.entries_for(b.free()) == 1
    assert b.entries_to_take() == 1
    assert not b.full()


def test_entries_are_taken_for_the_room_at_the_mean_entry_seen() -> None:
    b = budget(8)
    b.seen(4, 10)
    assert b.entries_for(8) == 2
    assert b.entries_for(3) == 1  # always at least one
    b.add(4, 40)
    assert b.free() == 4 and b.entries_to_take() == 1


def test_the_mean_entry_moves_a_tenth_of_the_way_to_each_new_one() -> None:
    b = budget(100)
    b.seen(4, 100)
    b.seen(14, 200)
    assert b.mean_n == 5.0 and b.mean_tokens == 110.0


def test_the_token_budget_counts_as_samples_of_the_mean_size() -> None:
    b = budget(100, tokens=1000)
    b.seen(1, 100)
    assert b.free() == 10
    b.add(3, 300)
    assert b.free() == 7


def test_no_token_budget_and_a_zero_token_budget_both_mean_no_token_cap() -> None:
    for tokens in (None, 0):
        b = budget(4, tokens=tokens)
        assert b.max_tokens is None
        b.seen(1, 10**6)
        b.add(1, 10**6)
        assert b.free() == 3
        assert b.fits(3, 3 * 10**6)


def test_an_entry_fits_beside_the_work_in_flight_only_under_both_caps() -> None:
    b = budget(4, tokens=100)
    b.add(2, 50)
    assert b.fits(2, 50)
    assert not b.fits(3, 10)  # over the samples
    assert not b.fits(1, 51)  # over the tokens


def test_an_entry_larger_than_the_token_budget_runs_alone() -> None:
    b = budget(16, tokens=100)
    b.seen(1, 500)
    assert b.fits(1, 500)  # nothing in flight: it fits
    b.add(1, 500)
    assert not b.fits(1, 1)  # and nothing else fits beside it
    assert b.free() <= 0 and b.full() and b.entries_to_take() == 0


def test_an_entry_of_more_samples_than_the_cap_runs_alone() -> None:
    b = budget(4)
    assert b.fits(10, 10)
    b.add(10, 10)
    assert not b.fits(1, 1)
    assert b.full()


def test_a_full_budget_takes_nothing_and_an_empty_one_always_takes_one() -> None:
    b = budget(2)
    b.seen(2, 10)
    b.add(2, 20)
    assert b.full() and b.entries_to_take() == 0
    b.remove(2, 20)
    assert not b.full() and b.entries_to_take() == 1


def test_an_entry_waiting_for_room_keeps_the_budget_full() -> None:
    async def main() -> None:
        b = budget(4)
        b.add(4, 40)
        waiter = asyncio.create_task(b.wait_for_room(2, 20, asyncio.Event()))
        await asyncio.sleep(0)
        assert b.waiting == 1 and b.full()
        b.remove(4, 40)
        assert await asyncio.wait_for(waiter, 1) is True
        assert b.waiting == 0

    asyncio.run(main())


def test_waiting_for_room_ends_when_an_entry_ends_and_the_new_one_fits() -> None:
    async def main() -> None:
        b = budget(4)
        b.add(2, 20)
        b.add(2, 20)
        waiter = asyncio.create_task(b.wait_for_room(3, 30, asyncio.Event()))
        await asyncio.sleep(0)
        b.remove(2, 20)  # 2 in flight: 3 more do not fit yet
        await asyncio.sleep(0)
        assert not waiter.done()
        b.remove(2, 20)  # nothing in flight: it fits
        assert await asyncio.wait_for(waiter, 1) is True

    asyncio.run(main())


def test_a_stop_ends_the_wait_for_room_without_room() -> None:
    async def main() -> None:
        b = budget(1)
        b.add(1, 10)
        stopping = asyncio.Event()
        waiter = asyncio.create_task(b.wait_for_room(1, 10, stopping))
        await asyncio.sleep(0)
        stopping.set()
        b.wake()
        assert await asyncio.wait_for(waiter, 1) is False
        assert b.waiting == 0 and b.samples == 1

    asyncio.run(main())


def test_the_caps_are_asked_each_time_so_an_engine_that_learns_its_budget_late_is_heeded() -> None:
    tokens: list[int | None] = [None]
    b = TakeBudget(lambda: (8, tokens[0]))
    b.seen(1, 100)
    assert b.free() == 8
    tokens[0] = 300
    assert b.max_tokens == 300 and b.free() == 3


def test_an_entry_taken_and_not_yet_started_is_room_spoken_for_until_its_task_runs() -> None:
    b = budget(2)
    b.seen(1, 10)
    b.taken()
    b.taken()  # both taken in one read; their tasks have not run: a heartbeat now offers no room
    assert b.entries_to_take() == 0
    b.starting()
    b.add(1, 10)  # the first one's task runs: decoded and counted in the same step
    assert b.entries_to_take() == 0
    b.starting()
    b.add(1, 10)
    assert b.entries_to_take() == 0 and b.full()
    b.remove(1, 10)
    assert b.entries_to_take() == 1
