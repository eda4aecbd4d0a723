"""A worker whose Redis is gone as it stops: it leaves without it, at once, saying what it could not hand on.

Without this, a stopping worker whose Redis is gone would wait out each call's reconnects on its way out
(~`RECONNECT_S`, 30 s, for its last heartbeat, as many for the read under way, its drain's publishes...).
`RedisLoss` checks, once the worker stops, that its Redis still answers (a connection of its own, never retried),
skips the way out's Redis calls once it does not, and then gives up every call under way and drops the work in
flight, whose publishes could only fail (it stays pending in Redis, for another worker if Redis comes back).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sized

import redis

from consumers.house import House
from pipeline.connections import give_up_reconnecting, redis_address, redis_unreachable

log = logging.getLogger(__name__)

REDIS_CHECK_S = 1.0
"""How often a stopping worker checks that its Redis still answers (`RedisLoss.watch`)."""


class RedisLoss:
    """One worker's way out without Redis."""

    def __init__(self, house: House, held: Sized, tasks: set[asyncio.Task]) -> None:
        self._name, self._streams, self._state, self._worker = house.name, house.streams, house.state, house.worker
        self._held, self._tasks = held, tasks

    async def watch(self) -> None:
        """Once the worker stops, check every `REDIS_CHECK_S` that its Redis still answers."""
        await self._state.stopping.wait()
        while not self._state.redis_gone:
            problem = await asyncio.to_thread(redis_unreachable, self._streams.redis)
            if problem is not None:
                self.lost(problem)
                return
            await asyncio.sleep(REDIS_CHECK_S)

    async def unless_gone(self, call: Callable[[], Awaitable[object]]) -> None:
        """A Redis call of the way out, skipped once Redis is gone; one that fails for want of Redis means it is."""
        if self._state.redis_gone:
            return
        try:
            await call()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            self.lost(str(exc))

    def lost(self, problem: str) -> None:
        """Stop without Redis: say in one line what the worker could not hand on, give up every Redis call under way
        (`give_up_reconnecting`) and drop the work in flight, whose publishes could only fail."""
        if self._state.redis_gone:
            return
        self._state.redis_gone = True
        entries, samples = len(self._held), self._state.inflight_samples
        held = (
            f"the work it held ({entries} {'entry' if entries == 1 else 'entries'}, {samples} samples) "
            "was neither published nor handed on and stays pending there, for another worker if Redis comes back "
            "with its data"
            if entries
            else "it held no work"
        )
        log.error(
            "%s: its Redis at %s is gone (%s); stopping without it: %s; its heartbeat expires by itself",
            self._name, redis_address(self._streams.redis), problem, held,
        )  # fmt: skip
        give_up_reconnecting(self._streams.redis)
        self._worker.stop(drain=False)
        for task in list(self._tasks):
            task.cancel()
