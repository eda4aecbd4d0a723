"""Entries handed out again and again: run apart, then alone, then dead-lettered.

An entry that died with its worker may be what killed it (a poison prompt) or may only have sat beside it. `Suspects`
tells them apart without trusting any one death: an entry handed out `apart_after` times runs apart (beside fresh
work, never beside another such entry); `max_deliveries` times, alone (the worker first finishes what it runs, then
starts it with nothing beside it and takes nothing else until it ends; `WorkReader.mark_alone` counts such starts);
handed out again after `alone_tries` runs alone (each time the worker that ran only it died or hung), it is a dead
letter. Set-aside entries are held by the worker meanwhile (in its `held` map: touched every heartbeat, claimed by
nobody).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable

import redis

from consumers.budget import TakeBudget
from consumers.house import House
from pipeline.streams import Entry

log = logging.getLogger(__name__)

Held = dict[tuple[str, bytes], Entry]
"""The entries a worker holds, by stream and id: started, held for room, or set aside here."""


class Suspects:
    """One worker's entries set aside to run apart or alone, and the turns of its read loop that start them."""

    def __init__(self, house: House, held: Held, start: Callable[[Entry], None], budget: TakeBudget) -> None:
        self._work, self._name = house.streams.work, house.name
        self._settings, self._metrics = house.settings, house.metrics
        self._held, self._start, self._budget = held, start, budget
        self._alone: deque[Entry] = deque()
        """Entries handed out `max_deliveries` times, each to run alone once what runs has ended."""
        self._running_alone: Entry | None = None
        """The entry this worker runs alone: it takes nothing else until it has ended."""
        self._apart: deque[Entry] = deque()
        """Entries handed out `apart_after` times, each to start once the one before it has ended."""
        self._running_apart: Entry | None = None

    @property
    def alone(self) -> bool:
        """Whether an entry waits to run alone or runs alone: the worker takes nothing new meanwhile."""
        return bool(self._alone) or self._running_alone is not None

    async def turn(self) -> bool:
        """A turn of the read loop for the entries set aside: True if it took the turn (an entry alone waits or runs,
        or the next entry apart started), False if the loop goes on to take work."""
        if self.alone:
            await self._alone_turn()
            return True
        if self._apart and not self._runs(self._running_apart):
            entry = self._running_apart = self._apart.popleft()
            log.info("%s: running %s %s apart", self._name, entry.stream, entry.id)
            self._start(entry)
            await asyncio.sleep(0)
            return True
        return False

    async def _alone_turn(self) -> None:
        """Nothing new is taken; once nothing else is in flight, the next entry to run alone starts, marked as started
        alone (`WorkReader.mark_alone`); once it has ended, its mark goes."""
        running = self._running_alone
        if running is not None and not self._runs(running):
            self._running_alone = None
            with contextlib.suppress(redis.RedisError):  # it expires anyway
                await asyncio.to_thread(self._work.forget_alone, running)
            return
        if running is not None or len(self._held) > len(self._alone) + len(self._apart):
            await self._budget.changed()  # as each entry ends
            return
        entry = self._alone.popleft()
        try:
            await asyncio.to_thread(self._work.mark_alone, entry)
        except redis.ConnectionError as exc:
            log.warning("%s: marking %s as run alone failed (%s); retrying", self._name, entry.id.decode(), exc)
            self._alone.appendleft(entry)
            await asyncio.sleep(self._settings.heartbeat_s)
            return
        log.warning("%s: running %s %s alone (handed out %d times or more)", self._name, entry.stream,
                    entry.id.decode(), self._settings.max_deliveries)  # fmt: skip
        self._running_alone = entry
        self._start(entry)

    def _runs(self, entry: Entry | None) -> bool:
        """Whether `entry` is still the worker's (started and not ended, or waiting its turn)."""
        return entry is not None and (entry.stream, entry.id) in self._held

    async def check(self, entry: Entry) -> bool:
        """Whether an entry handed out again is not to be served as usual, and so was dealt with here: set aside to
        run apart or alone (held meanwhile), or a dead letter."""
        deliveries = await asyncio.to_thread(self._work.delivery_count, entry)
        alone = deliveries >= self._settings.max_deliveries
        if not alone and deliveries < self._settings.apart_after:
            return False
        runs = await asyncio.to_thread(self._work.alone_runs, entry) if alone else 0
        if runs < self._settings.alone_tries:
            self._held[entry.stream, entry.id] = entry  # held: touched every heartbeat, claimed by nobody
            (self._alone if alone else self._apart).append(entry)
            return True
        reason = (
            f"handed out {deliveries} times without finishing, {runs} of them run alone (limits"
            f" {self._settings.max_deliveries} and {self._settings.alone_tries}): each worker that ran nothing else"
            " died or hung"
        )
        if await asyncio.to_thread(self._work.dead_letter, entry, reason, "deliver"):
            self._metrics.dead_letter("deliver")
        with contextlib.suppress(redis.RedisError):
            await asyncio.to_thread(self._work.forget_alone, entry)
        return True
