"""A worker's take budget: how much work it holds in flight, and how much more it takes (prime-rl's
`orchestrator/concurrency.py`, which "owns no tasks or clients"; arq's one bounded semaphore).

`TakeBudget` owns the samples and tokens in flight (each sample counted as its prompt + `max_tokens`, the most it can
hold) against two caps, the mean entry seen so far, and an asyncio wait for room. It knows no Redis and no engine:
its caps come from a callable (`Worker` asks its settings, then its engine), so that an engine that learns its
budget once started (vLLM's KV cache) is asked again each time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

DEFAULT_MAX_INFLIGHT = 256
"""Samples a worker takes at once when neither its settings nor its engine say (`WorkerSettings.max_inflight`)."""

Limits = Callable[[], tuple[int, "int | None"]]
"""The caps now: samples in flight, and tokens in flight (None: no token cap)."""


class TakeBudget:
    """The samples and tokens a worker holds in flight, under its caps: what fits, what is free, how many entries to
    take for it, and a wait until an entry fits. An entry larger than a cap runs alone (it fits when nothing else is
    in flight)."""

    def __init__(self, limits: Limits) -> None:
        self._limits = limits
        self.samples = 0
        """Samples started and not yet ended."""
        self.tokens = 0
        """Prompt + `max_tokens` of each sample in `samples`, summed."""
        self.waiting = 0
        """Entries taken and decoded that wait for room (`wait_for_room`): none is read meanwhile."""
        self.unstarted = 0
        """Entries taken whose task has not run yet (`taken`, `starting`): their samples count only from its first step,
        so until then each is room already spoken for (a heartbeat between the two would offer it again)."""
        self.mean_n: float | None = None
        """Samples per entry (an average): how many entries fit the room. None until the first entry: until then the
        worker reads one at a time, since a fresh worker that guessed 1 would take n times too many."""
        self.mean_tokens: float | None = None
        """Prompt + `max_tokens` per sample (an average): how many samples fit the token budget."""
        self._room = asyncio.Event()

    @property
    def max_samples(self) -> int:
        return self._limits()[0]

    @property
    def max_tokens(self) -> int | None:
        return self._limits()[1] or None

    def seen(self, samples: int, size: int) -> None:
        """An entry of `samples` samples of `size` tokens each was decoded: the means move towards it."""
        self.mean_n = samples if self.mean_n is None else 0.9 * self.mean_n + 0.1 * samples
        self.mean_tokens = size if self.mean_tokens is None else 0.9 * self.mean_tokens + 0.1 * size

    def free(self) -> int:
        """Samples of room left under both caps (the token budget as samples of the mean size seen so far)."""
        samples, budget = self._limits()
        free = samples - self.samples
        if budget and self.mean_tokens is not None:
            free = min(free, int((budget - self.tokens) / self.mean_tokens))
        return free

    def fits(self, samples: int, tokens: int) -> bool:
        """Whether an entry of `samples` samples and `tokens` tokens fits beside the work in flight (alone, it does)."""
        if self.samples == 0:
            return True
        most, budget = self._limits()
        return self.samples + samples <= most and (not budget or self.tokens + tokens <= budget)

    def entries_for(self, free: int) -> int:
        """How many entries to take for `free` samples of room: one until an entry was seen, at least one."""
        return 1 if self.mean_n is None else max(1, int(free / self.mean_n))

    def full(self) -> bool:
        """Whether nothing more is to be taken now: an entry waits for room, or none is left beside the work held."""
        return bool(self.waiting) or (self.free() <= 0 and self.samples > 0)

    def entries_to_take(self) -> int:
        """Entries to take now for the room left (at least one when nothing is in flight: it runs alone), less those
        taken and not yet started; 0 if full."""
        free = self.free()
        entries = self.entries_for(free) if free > 0 or not self.samples else 0
        return max(0, entries - self.unstarted)

    def taken(self) -> None:
        """An entry was taken: its task starts at the next turn of the event loop."""
        self.unstarted += 1

    def starting(self) -> None:
        """A taken entry's task runs: in the same step it decodes and is counted (`add`) or waits for room."""
        self.unstarted -= 1

    def add(self, samples: int, tokens: int) -> None:
        """An entry starts: its samples and tokens are in flight."""
        self.samples += samples
        self.tokens += tokens

    def remove(self, samples: int, tokens: int) -> None:
        """An entry ended: its samples and tokens are no longer in flight, and whoever waits for room looks again."""
        self.samples -= samples
        self.tokens -= tokens
        self._room.set()

    def wake(self) -> None:
        """Wake whoever waits for room (an entry ended, or the worker stops)."""
        self._room.set()

    async def changed(self) -> None:
        """Wait until the room may have changed (`remove`, `wake`)."""
        self._room.clear()
        await self._room.wait()

    async def wait_for_room(self, samples: int, tokens: int, stopping: asyncio.Event) -> bool:
        """Wait until an entry fits (`fits`): room is counted at the mean entry, so one larger than the rest may have
        been read past it. False if `stopping` is set meanwhile (the entry then stays pending, for another worker)."""
        self.waiting += 1
        try:
            while not self.fits(samples, tokens):
                if stopping.is_set():
                    return False
                await self.changed()
        finally:
            self.waiting -= 1
        return True
