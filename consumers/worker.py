"""The consumer worker: read work, keep many samples in flight on one engine, publish rollouts.

One asyncio loop per worker. Redis calls run on threads through the synchronous stream
layer; the engine runs its own compute. What the loop guarantees:
- many requests in flight at once, so that the engine's batching stays full;
- `{ns}:partials` is read before `{ns}:prompts`;
- a prompt is acked in the same atomic step that publishes its rollouts (at-least-once);
- work held by a worker that stopped beating is claimed by the others;
- bad input never stops the loop: undecodable entries become dead letters, requests the
  engine refuses become `finish_reason=error` rollouts;
- with `lazy` / `release_after_s`, the engine starts when work arrives and is shut down when idle, and a weight
  sync while there is none is acked at once and loaded at the next start (`consumers.lifecycle`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import redis

from consumers.adapters import Stopping, WorkerAdapters
from consumers.engines.base import (
    WAKE_ALL,
    Engine,
    EngineClosedError,
    EngineInputError,
    Generation,
    SleepNotSupported,
    WakePart,
    continuation_seed,
)
from consumers.lifecycle import EngineFactory, EngineSlot, WorkerStatus, receive_copy
from consumers.metrics import WorkerMetrics
from pipeline.connections import give_up_reconnecting, redis_address, redis_unreachable
from pipeline.control import CONTROL_BATCH, CONTROL_RECHECK_S
from pipeline.publisher import Publisher
from pipeline.registry import default_name, sweep_chance
from pipeline.streams import Entry, Streams
from pipeline.wire import (
    ASLEEP_FIELD,
    CONTINUE_HERE,
    HAND_OFF,
    PARTIALS_FIELD,
    Control,
    Partial,
    PauseMode,
    Prompt,
    Rollout,
    WireError,
    join_spans,
)
from staleness.state import read_state, weights_command
from staleness.weights import (
    fetches_ahead,
    is_stored,
    join_version,
    load_joined,
    load_prefetched,
    load_version,
    prefetch_version,
)
from staleness.weights.layout import LAYOUT_FIELD, advertise, layout_of

if TYPE_CHECKING:
    from staleness.weights.nccl import BroadcastLink

log = logging.getLogger(__name__)
T = TypeVar("T")


AWAITING_WEIGHTS = WorkerStatus.AWAITING_WEIGHTS
"""Heartbeat status of a worker that joined after a broadcast (nccl) sync: it takes no work until the next."""

_EMPTY_TOKENS = np.zeros(0, dtype=np.int32)
_EMPTY_LOGPROBS = np.zeros(0, dtype=np.float32)


def _untouched(prompt: Prompt, sample: int) -> Partial:
    """A sample of `prompt` nothing has been generated of yet: a partial that another worker starts from scratch."""
    return Partial(prompt=prompt, sample=sample, generated=_EMPTY_TOKENS, logprobs=_EMPTY_LOGPROBS, spans=[])


DEFAULT_MAX_INFLIGHT = 256
"""Samples a worker takes at once when neither its settings nor its engine say (`WorkerSettings.max_inflight`)."""
LEFTOVERS_MAX = 10_000
"""At most this many entries of each stream that an earlier process under the worker's name left are taken up."""
TURN_WAIT_S = 0.002
"""How long a worker that holds its share of the waiting work waits before it asks again (doubling up to a read's
wait): the others with room take theirs within a few milliseconds, and one that stops asking leaves the ready set."""
REDIS_CHECK_S = 1.0
"""How often a stopping worker checks that its Redis still answers (`Worker._watch_redis_while_stopping`)."""


def _join_alternatives(
    done: Partial | None, generation: Generation, n_tokens: int
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The alternatives of a whole sample (`Rollout.top_token_ids`, `top_logprobs`): those of its tokens before a
    pause (`done`), then the engine's of the rest. None, None unless every part with tokens has them, with one k."""
    parts = []
    if done is not None and len(done.generated):
        parts.append((done.top_token_ids, done.top_logprobs))
    if len(generation.tokens):
        parts.append((generation.top_token_ids, generation.top_logprobs))
    ids = [p[0] for p in parts if p[0] is not None and p[1] is not None]
    logprobs = [p[1] for p in parts if p[0] is not None and p[1] is not None]
    if not n_tokens or len(ids) != len(parts) or len({a.shape[1] for a in ids}) != 1:
        return None, None
    return np.concatenate(ids), np.concatenate(logprobs)


@dataclass
class WorkerSettings:
    max_inflight: int | None = None
    """Samples in flight on the engine at once. None: as many as the engine decodes at once (`Engine.max_batch`: the
    torch and synthetic engines' rows, vLLM's `max_num_seqs`), or 256 where it does not say. Taking more only queues
    them inside the engine: they finish no sooner, and an abort pause ends and queues them all again. An entry of more
    samples than this runs alone."""
    max_inflight_tokens: int | None = None
    """Tokens in flight at once, each sample counted as its prompt + `max_tokens` (the most it can hold), so that long
    samples do not oversubscribe the engine. None: the engine's (`Engine.max_batch_tokens`: vLLM's KV cache in tokens,
    once started; no limit on the other engines); 0: no limit. An entry larger than this runs alone."""
    block_ms: int = 1000
    """How long one read waits for new work."""
    heartbeat_s: float = 1.0
    """Heartbeat period; in-flight entries are touched at the same pace."""
    heartbeat_ttl_s: float = 5.0
    """A worker whose heartbeat is older than this is shown as gone."""
    claim_idle_ms: int = 10_000
    """Work untouched for this long is claimed, whoever holds it (a worker that lives but stopped touching it)."""
    dead_after_s: float = 2.5
    """A worker whose heartbeat has been silent this long is dead to the fleet: its work is taken over (each heartbeat
    moves its deadline on `{ns}:beats`, so that each worker is judged by its own). More than two heartbeat periods."""
    apart_after: int = 3
    """An entry handed out this many times without finishing (it died with its worker twice) runs apart: beside fresh
    work, but never beside another such entry. A claim takes a dead worker's oldest entries first, so without this the
    entries a poison prompt's death took along would be handed on with it, and die with it, again and again."""
    max_deliveries: int = 5
    """An entry handed out this many times without finishing runs alone: its worker first finishes what it runs, then
    starts it with nothing beside it and takes nothing else until it ends. Handed out again after `alone_tries` runs
    alone (each time the worker that ran only that entry died or hung), it is a dead letter: the entry kills what
    runs it. So an entry that merely sat with workers that died is not dead-lettered for their deaths."""
    alone_tries: int = 2
    """Runs alone that must each end with their worker's death before an entry is a dead letter: one such death may
    be another fault's (in a fleet under frequent faults, some runs alone are struck by chance), two in a row seldom
    are."""
    trim_every_s: float = 10.0
    drain_timeout_s: float = 30.0
    """On stop, how long to let in-flight work finish; the rest stays pending for other workers."""
    dedupe_ttl_s: int = 86_400
    """How long a published rollout id is remembered (a bit in `{ns}:published:{size}:{bucket}`): the same id from
    another entry (a prompt submitted twice, a replay) within it is not published again. Redis holds ~22 B per
    rollout for it; every worker of a namespace should use the same value."""
    lazy: bool = False
    """Start the engine when the first work arrives, not at launch (`consumers.lifecycle`)."""
    release_after_s: float | None = None
    """Shut the engine down after this many seconds without work, and start it again on demand; None: never."""
    hand_off_partials: bool = False
    """What an `abort` pause does with the samples it interrupts. False: this worker continues each itself after the
    resume (its tokens so far stay in memory; the prompt stays pending here, so a worker that dies meanwhile loses
    only those tokens: the prompt is claimed and generated again). True: each goes to `{ns}:partials` with the
    entry's ack at the pause, durable, and any worker continues it. A worker that stops before its resume hands its
    interrupted samples off either way."""
    freeze_heap: bool = False
    """Freeze the process's heap (`gc.freeze`) each time the engine has started, so that Python's full collections
    skip what the engine holds (`consumers.lifecycle.freeze_heap`: a full collection over vLLM's ~700k objects stalls
    the event loop for ~0.5 s). Process-wide: for a process that is the worker's own, as `rollouts worker` and
    `rollouts launch` set it; a worker run inside another program leaves that program's collector alone."""


class BusyClock:
    """Seconds the worker spent generating: samples in flight and not paused for a weight sync.

    Its heartbeat reports the total (`busy_s`), so that a benchmark or a person can tell how much of
    the time the generator stood idle (nothing to do, or paused) without sampling it.
    """

    def __init__(self) -> None:
        self._total = 0.0
        self._since: float | None = None

    def update(self, busy: bool) -> None:
        now = time.monotonic()
        if self._since is not None:
            self._total += now - self._since
        self._since = now if busy else None

    def seconds(self) -> float:
        return self._total + (time.monotonic() - self._since if self._since is not None else 0.0)


class Worker:
    def __init__(
        self,
        streams: Streams,
        engine: Engine,
        name: str | None = None,
        settings: WorkerSettings | None = None,
        metrics: WorkerMetrics | None = None,
        factory: EngineFactory | None = None,
    ):
        self.streams = streams
        self.name = name or default_name()
        self.settings = settings or WorkerSettings()
        if self.settings.release_after_s is not None and factory is None:
            raise ValueError("release_after_s needs an engine factory: a released engine is built again to restart")
        self._slot = EngineSlot(engine, factory, self.name, self.settings.freeze_heap)
        """The engine, started at launch or on demand (`lazy`), and released when idle (`release_after_s`)."""
        streams.dedupe_ttl_s = self.settings.dedupe_ttl_s
        self.metrics = metrics or WorkerMetrics(streams.keys.ns, self.name)
        """What only this process knows, for Prometheus (served by `rollouts worker --metrics-port`)."""
        self.status = WorkerStatus.STARTING
        self.failure: str | None = None
        """Why the worker stopped on its own (its engine died); None after a requested stop."""
        self.published = 0
        self.publisher = Publisher(streams)
        """Publishes what finishes while another publish is on the wire in one round trip with it."""
        self.generated_tokens = 0
        self._inflight: dict[tuple[str, bytes], Entry] = {}
        self._inflight_samples = 0
        self._inflight_tokens = 0
        """Prompt + `max_tokens` of each sample in `_inflight_samples`, summed (`max_inflight_tokens`)."""
        self._waiting_for_room = 0
        """Entries taken and decoded that wait for room under the caps (`_wait_for_room`): none is read meanwhile."""
        self._held: deque[Entry] = deque()
        """Entries taken but not started for want of room (a blocking read over three streams: `Streams.read_work`).
        They are in `_inflight` too, so they are touched every heartbeat and nobody claims them; they start first."""
        self._alone: deque[Entry] = deque()
        """Entries handed out `max_deliveries` times, each to run alone once what runs has ended (`_suspect`). In
        `_inflight` too, so that nobody claims them from this worker meanwhile."""
        self._running_alone: Entry | None = None
        """The entry this worker runs alone: it takes nothing else until it has ended."""
        self._apart: deque[Entry] = deque()
        """Entries handed out `apart_after` times, each to start once the one before it has ended (`_suspect`); in
        `_inflight` too."""
        self._running_apart: Entry | None = None
        self._mean_n: float | None = None
        """Samples per entry (an average): how many entries fit the room. None until the first entry: until
        then the worker reads one at a time, since a fresh worker that guessed 1 would take n times too many."""
        self._mean_tokens: float | None = None
        """Prompt + `max_tokens` per sample (an average): how many samples fit the token budget."""
        self._room = asyncio.Event()
        self._stopping = asyncio.Event()
        self._serving = asyncio.Event()
        """Set while the worker may take work: cleared during a weight sync (pause → load → ack → resume)."""
        self._drain_on_stop = True
        self._redis_gone = False
        """Redis stopped answering while the worker stopped: it leaves without it (`_lost_redis`)."""
        self._epoch = 0
        """The last weight-sync epoch this worker acked."""
        self._sync_began = 0.0
        """When the pause for the current weight sync began (monotonic), for the stall until its resume."""
        self._layout: str | None = None
        """The digest of the model layout this worker advertises (`_advertise_layout`); "" for none, None: not yet."""
        self._asleep = 0
        """The level of the sleep its engine is in (`_sleep`), until the wake of its last part; 0: awake."""
        self._sleeping: set[WakePart] = set()
        """The parts of that sleep not woken yet (`_wake`)."""
        self._frozen = False
        """Its engine holds requests frozen (a `keep` or `inflight` pause, a sync's or a sleep's) until the resume."""
        self._beating = asyncio.Lock()
        """One heartbeat write at a time: a snapshot taken earlier never lands over a later one."""
        self._last_stall_s = 0.0
        """The last sync as this worker stood still in it: from its pause to its resume (heartbeat `stall_s`)."""
        self._tasks: set[asyncio.Task] = set()
        self._started = time.time()
        self._tokens_per_s = 0.0
        self._busy = BusyClock()
        self._fleet = 1
        """Workers on the registry at the last heartbeat: how often this one claims and sweeps (`sweep_chance`)."""
        self._adapters = WorkerAdapters(streams, engine, self.name, self._beat, self.metrics, self._stopping)
        """LoRA adapters: loaded on demand, evicted when idle, each paused alone for its own syncs."""
        self._loaded_from = ""
        """Where the engine's version came from ("": the model directory), to tell whether a release may lose it."""
        self._unstarted_version = engine.version
        """Without an engine: the version it will load at start (what its heartbeat reports, and acked)."""

    @property
    def engine(self) -> Engine:
        """The engine now: a fresh, unstarted one after a release (`consumers.lifecycle`)."""
        return self._slot.engine

    @property
    def inflight_samples(self) -> int:
        """Samples of the work taken that are not yet published (what the heartbeat's `inflight` says)."""
        return self._inflight_samples

    @property
    def max_inflight(self) -> int:
        """Samples this worker takes at once: its settings', else its engine's `max_batch`, else 256."""
        if self.settings.max_inflight is not None:
            return self.settings.max_inflight
        return self.engine.max_batch or DEFAULT_MAX_INFLIGHT

    @property
    def max_inflight_tokens(self) -> int | None:
        """Prompt + `max_tokens` of the samples this worker takes at once: its settings', else its engine's; None: no
        limit."""
        budget = self.settings.max_inflight_tokens
        if budget is None:
            budget = self.engine.max_batch_tokens
        return budget or None

    def _free_samples(self) -> int:
        """Samples of room left under both caps (the token budget as samples of the mean size seen so far)."""
        free = self.max_inflight - self._inflight_samples
        budget = self.max_inflight_tokens
        if budget is not None and self._mean_tokens is not None:
            free = min(free, int((budget - self._inflight_tokens) / self._mean_tokens))
        return free

    def _fits(self, samples: int, tokens: int) -> bool:
        """Whether an entry of `samples` samples and `tokens` tokens fits beside the work in flight (alone, it does)."""
        if self._inflight_samples == 0:
            return True
        budget = self.max_inflight_tokens
        return self._inflight_samples + samples <= self.max_inflight and (
            budget is None or self._inflight_tokens + tokens <= budget
        )

    async def _wait_for_room(self, samples: int, tokens: int) -> bool:
        """Wait until an entry fits (`_fits`): room is counted at the mean entry, so one larger than the rest may have
        been read past it. False if the worker stops meanwhile (the entry then stays pending, for another worker)."""
        self._waiting_for_room += 1
        try:
            while not self._fits(samples, tokens):
                if self._stopping.is_set():
                    return False
                self._room.clear()
                await self._room.wait()
        finally:
            self._waiting_for_room -= 1
        return True

    def _account(self) -> None:
        """Called after every change of in-flight work, and by `_set_serving` (see `BusyClock`)."""
        self._busy.update(self._inflight_samples > 0 and self._serving.is_set())

    def _set_serving(self, serving: bool) -> None:
        """Take work (and generate) or stand still for a weight sync; the one place that flips it."""
        if serving:
            self._serving.set()
        else:
            self._serving.clear()
        self._account()

    def stop(self, drain: bool = True) -> None:
        """Ask the worker to stop taking work (and let in-flight work finish if `drain`).

        Safe to call from a signal handler in the loop. Without `drain`, in-flight work is dropped
        here and stays pending in Redis, where the other workers claim it.
        """
        self._drain_on_stop = self._drain_on_stop and drain
        self._stopping.set()
        self._room.set()
        self._set_serving(True)  # wake a paused read loop so that it sees the stop

    async def run(self) -> None:
        await asyncio.to_thread(self.streams.ensure_groups)
        await asyncio.to_thread(self.streams.join, self.name)
        began = time.monotonic()
        if self.settings.lazy:
            self.status = WorkerStatus.IDLE
        else:
            try:
                await self._slot.start()
            except Exception as exc:
                self._could_not_start(exc)
                await self._slot.shutdown()
                await asyncio.to_thread(self.streams.registry.forget_worker, self.name)
                return
        control_from = await self._catch_up()
        if self._slot.started:
            self._engine_started("launch", began)
        upkeep = asyncio.create_task(self._upkeep())
        control = asyncio.create_task(self._follow_control(control_from))
        release = asyncio.create_task(self._release_when_idle())
        watch = asyncio.create_task(self._watch_redis_while_stopping())
        try:
            await self._take_up_leftovers()
            await self._read_loop()
            self.status = WorkerStatus.STOPPING
            await self._unless_redis_gone(self._beat)
            if self._drain_on_stop:
                await self._unless_redis_gone(self._hand_back_held)
                await self._unfreeze()
                await self._drain()
        finally:
            upkeep.cancel()
            control.cancel()
            release.cancel()
            watch.cancel()
            for task in list(self._tasks):
                task.cancel()
            await self._slot.shutdown()
            await self.publisher.close()
            await self._unless_redis_gone(lambda: asyncio.to_thread(self.streams.registry.forget_worker, self.name))

    # -- stopping without Redis ---------------------------------------------------------------

    async def _watch_redis_while_stopping(self) -> None:
        """Once the worker stops, check every `REDIS_CHECK_S` that its Redis still answers (a connection of its own,
        never retried). Without it, a worker whose Redis is gone would wait out each call's reconnects on its way out
        (~`RECONNECT_S`, 30 s, for its last heartbeat, as many for the read under way, its drain's publishes...)."""
        await self._stopping.wait()
        while not self._redis_gone:
            problem = await asyncio.to_thread(redis_unreachable, self.streams.redis)
            if problem is not None:
                self._lost_redis(problem)
                return
            await asyncio.sleep(REDIS_CHECK_S)

    async def _unless_redis_gone(self, call: Callable[[], Awaitable[object]]) -> None:
        """A Redis call of the way out, skipped once Redis is gone; one that fails for want of Redis means it is."""
        if self._redis_gone:
            return
        try:
            await call()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            self._lost_redis(str(exc))

    def _lost_redis(self, problem: str) -> None:
        """Stop without Redis: say in one line what the worker could not hand on, give up every Redis call under way
        (`give_up_reconnecting`) and drop the work in flight, whose publishes could only fail."""
        if self._redis_gone:
            return
        self._redis_gone = True
        entries = len(self._inflight)
        held = (
            f"the work it held ({entries} {'entry' if entries == 1 else 'entries'}, {self._inflight_samples} samples) "
            "was neither published nor handed on and stays pending there, for another worker if Redis comes back "
            "with its data"
            if entries
            else "it held no work"
        )
        log.error(
            "%s: its Redis at %s is gone (%s); stopping without it: %s; its heartbeat expires by itself",
            self.name, redis_address(self.streams.redis), problem, held,
        )  # fmt: skip
        give_up_reconnecting(self.streams.redis)
        self.stop(drain=False)
        for task in list(self._tasks):
            task.cancel()

    # -- reading ------------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        """Take work while there is room: abandoned work first (looked for every half heartbeat and whenever room
        opens, by a fleet of N with chance 2/N each time, as sweeps are: `sweep_chance`), then new.

        Abandoned work goes first because it is the oldest: behind a queue that admission keeps full, it
        would otherwise wait until it is too stale to train on."""
        next_claim, turn_wait = 0.0, TURN_WAIT_S
        while not self._stopping.is_set():
            await self._serving.wait()
            if self._stopping.is_set():  # a stop sets `_serving` too: during a sync, read nothing more
                break
            if self._inflight and not self._slot.ready:
                await self._engine_ready()  # no engine (lazy, released): take no more until it serves what it holds
                continue
            free = self._free_samples()
            if self._waiting_for_room or (free <= 0 and self._inflight_samples):
                self._room.clear()
                await self._room.wait()
                next_claim = 0.0  # room again: a dead worker's work, the oldest, goes before new work
                continue
            free = max(free, 1)  # nothing in flight: an entry larger than a cap runs alone
            if self._held:
                for _ in range(min(self._entries_for(free), len(self._held))):
                    self._start(self._held.popleft())
                await asyncio.sleep(0)
                continue
            if self._alone or self._running_alone is not None:
                await self._alone_turn()
                continue
            if self._apart and not self._runs(self._running_apart):
                self._running_apart = self._apart.popleft()
                log.info("%s: running %s %s apart", self.name, self._running_apart.stream, self._running_apart.id)
                self._start(self._running_apart)
                await asyncio.sleep(0)
                continue
            if time.monotonic() >= next_claim:
                next_claim = time.monotonic() + self.settings.heartbeat_s / 2
                try:  # the claim scans the group's pending list, so a large fleet shares it out as it does sweeps
                    if random.random() < sweep_chance(self._fleet):
                        claimed, others_turn = await self._claim_abandoned()
                        if claimed or others_turn:  # there may be more of it: claim again before taking new work
                            next_claim = 0.0
                            if others_turn:  # a worker that holds less takes it over first
                                await asyncio.sleep(turn_wait)
                                turn_wait = min(2 * turn_wait, self._block_ms / 1000)
                            continue  # the room left is less now
                except redis.ConnectionError as exc:
                    log.warning("%s: claiming abandoned work failed (%s); retrying", self.name, exc)
            count = self._entries_for(free)
            try:
                entries, others_turn = await asyncio.to_thread(self._take_work, count)
            except redis.ConnectionError as exc:  # Redis gone for longer than the client's reconnects: keep trying
                if self._redis_gone:  # stopping without it (`_lost_redis` said so)
                    break
                log.warning("%s: reading work failed (%s); retrying", self.name, exc)
                await asyncio.sleep(self.settings.heartbeat_s)
                continue
            if self._stopping.is_set():  # a read that spanned the stop: what it read goes on elsewhere at once
                for entry in entries:
                    self._inflight[entry.stream, entry.id] = entry
                    self._held.append(entry)
                break
            if others_turn:  # it holds its share: let the others with room take theirs, then ask again
                await asyncio.sleep(turn_wait)
                turn_wait = min(2 * turn_wait, self._block_ms / 1000)
                continue
            turn_wait = TURN_WAIT_S
            fits = max(count, self._entries_for(self._free_samples()))  # its room may have grown during the read
            for entry in entries[fits:]:  # more than there was room for: taken now, started when there is room
                self._inflight[entry.stream, entry.id] = entry
                self._held.append(entry)
            # fakeredis (and a BLOCK that timed out) answer an empty read: just read again.
            for entry in entries[:fits]:
                self._start(entry)
            await asyncio.sleep(0)  # let them decode and count their samples before the room is measured again

    async def _alone_turn(self) -> None:
        """A turn of the read loop while an entry waits to run alone or runs alone (`_suspect`): nothing new is
        taken; once nothing else is in flight, the next such entry starts, marked as started alone
        (`Streams.mark_alone`); once it has ended, its mark goes."""
        running = self._running_alone
        if running is not None and not self._runs(running):
            self._running_alone = None
            with contextlib.suppress(redis.RedisError):  # it expires anyway
                await asyncio.to_thread(self.streams.forget_alone, running)
            return
        if running is not None or len(self._inflight) > len(self._alone) + len(self._apart):
            self._room.clear()  # set as each entry ends
            await self._room.wait()
            return
        entry = self._alone.popleft()
        try:
            await asyncio.to_thread(self.streams.mark_alone, entry)
        except redis.ConnectionError as exc:
            log.warning("%s: marking %s as run alone failed (%s); retrying", self.name, entry.id.decode(), exc)
            self._alone.appendleft(entry)
            await asyncio.sleep(self.settings.heartbeat_s)
            return
        log.warning("%s: running %s %s alone (handed out %d times or more)", self.name, entry.stream,
                    entry.id.decode(), self.settings.max_deliveries)  # fmt: skip
        self._running_alone = entry
        self._start(entry)

    def _runs(self, entry: Entry | None) -> bool:
        """Whether `entry` is still this worker's (started and not ended, or waiting its turn)."""
        return entry is not None and (entry.stream, entry.id) in self._inflight

    def _take_work(self, count: int) -> tuple[list[Entry], bool]:
        """In a thread: up to `count` entries, no more than this worker's share of what waits (`Streams.take`); when
        nothing waits, a blocking read for one entry (Redis wakes the worker that has waited longest), then the rest
        of its share of the burst it woke to that fits now (its room may have grown while it waited), in the same
        hand-off from the event loop and back, so that the burst starts together: the engine would otherwise start
        on the first entry alone and take the rest a step behind, out of step with it for the whole batch. (What the
        thread reads of the worker's state, counts and flags, it only reads.) Also says whether it took nothing
        because the work that waits is the other workers' turn."""
        held = len(self._inflight)
        entries, others_turn = self.streams.take(self.name, count, held, self._horizon_ms)
        if entries or others_turn or self._stopping.is_set():
            return entries, others_turn
        entries = self.streams.read_work(self.name, 1, self._block_ms)
        if not entries or self._mean_n is None or self._stopping.is_set():
            return entries, False  # none came, or it cannot tell what more would fit
        room = self._entries_for(self._free_samples()) - len(entries)
        if room <= 0:
            return entries, False
        try:
            more, _ = self.streams.take(self.name, room, held + len(entries), self._horizon_ms)
        except redis.ConnectionError as exc:
            log.warning("%s: reading more work failed (%s); serving what was read", self.name, exc)
            more = []
        return entries + more, False

    @property
    def _block_ms(self) -> int:
        """How long a read waits for new work: at most half a heartbeat, so that a waiting worker looks for a dead
        worker's work as often as a busy one (`_claim_abandoned`)."""
        return max(1, min(self.settings.block_ms, int(self.settings.heartbeat_s * 500)))

    @property
    def _horizon_ms(self) -> int:
        """How long a worker that said it has room (a take, a heartbeat) counts as one (`Streams.take`): two of its
        reads' waits and two heartbeat periods, so a worker waiting for work is counted even when a loaded machine
        holds its read and its heartbeat back a period, and a stopped one soon is not."""
        return 2 * self._block_ms + int(2 * self.settings.heartbeat_s * 1000)

    def _entries_for(self, free: int) -> int:
        """How many entries to take for `free` samples of room."""
        return 1 if self._mean_n is None else max(1, int(free / self._mean_n))

    async def _hand_back_held(self) -> None:
        """A stopping worker's entries taken but not started (held for room, or read as it stopped; a sync may hold
        the engine paused): each goes on at once where another worker takes it, as its started samples do, not after
        it idles past a claim. Its samples go to `{ns}:partials` with nothing generated yet, acked with the entry in
        one step; one that cannot be read is dead-lettered; one whose publish fails stays pending."""
        if self._held:
            log.info("%s: %d entries taken but not started go on elsewhere", self.name, len(self._held))
        while self._held:
            entry = self._held.popleft()
            try:
                decoded = await self._decode(entry)
                if decoded is not None:
                    prompt, samples = decoded
                    untouched = [done or _untouched(prompt, k) for k, done in samples]
                    await self.publisher.publish([], entry, untouched, prompt.reply_to)
            except redis.RedisError as exc:
                log.warning("%s: entry %s stays pending (%s)", self.name, entry.id.decode(), exc)
            finally:
                del self._inflight[entry.stream, entry.id]

    async def _decode(self, entry: Entry) -> tuple[Prompt, list[tuple[int, Partial | None]]] | None:
        """An entry's prompt and the samples it asks for: a prompt's `n`, or a partial's one with what an earlier
        worker generated of it; None once an entry that cannot be read is dead-lettered."""
        try:
            if entry.stream == self.streams.keys.partials:
                partial = Partial.from_fields(entry.fields)
                return partial.prompt, [(partial.sample, partial)]
            prompt = Prompt.from_fields(entry.fields)
            return prompt, [(k, None) for k in range(prompt.n)]
        except WireError as exc:
            log.warning("%s: dead letter %s: %s", self.name, entry.id, exc)
            await asyncio.to_thread(self.streams.dead_letter, entry, str(exc), "decode")
            self.metrics.dead_letter("decode")
            return None

    def _start(self, entry: Entry) -> None:
        # Held from the moment it is taken, before it decodes: touched every heartbeat and never claimed back, even
        # while its dead letter or its publish waits for a thread (a claim of it would serve it twice).
        self._inflight[entry.stream, entry.id] = entry
        task = asyncio.create_task(self._serve(entry))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _pause(self, mode: PauseMode) -> None:
        """Pause the engine for a sync or a sleep (`mode`; `abort` once the worker stops: it freezes nothing then),
        noting whether it now holds requests frozen."""
        mode = "abort" if self._stopping.is_set() else mode
        await self.engine.pause(mode)
        self._frozen = mode != "abort"

    async def _unfreeze(self) -> None:
        """A stop while its engine holds requests frozen (a `keep` sleep or sync, of the base model or of an adapter):
        the resume that would go on with them may be long in coming (a trainer's step, a held sync), so they end here
        with their tokens so far, and their samples go to `{ns}:partials` with their entries' acks
        (`_generate_sample`) for another worker to continue. Under the slot's lock: a load under way finishes first."""
        async with self._slot.lock:
            if not self._slot.started:
                return  # released (or never started): it holds no request
            if self._frozen:
                await self.engine.pause("abort")
                self._frozen = False
            await self._adapters.unfreeze()

    async def _drain(self) -> None:
        if not self._tasks:
            return
        _done, pending = await asyncio.wait(list(self._tasks), timeout=self.settings.drain_timeout_s)
        for task in pending:
            task.cancel()
        if pending:
            log.warning("%s: %d prompts left unfinished; they stay pending for other workers", self.name, len(pending))

    # -- serving one entry --------------------------------------------------------------------

    async def _serve(self, entry: Entry) -> None:
        """Generate what one entry asks for and publish it with the entry's ack, in one atomic step.

        A prompt entry asks for its `n` samples; a partial entry for the rest of one sample. Samples that an abort
        pause interrupts are continued here after the resume, or go to `{ns}:partials` in the same step if the worker
        hands them off (`hand_off_partials`) or stops. However it ends,
        the entry stops being held here (`_start` took it); if it was not acked, it stays pending.
        """
        counted = tokens = 0
        try:
            decoded = await self._decode(entry)
            if decoded is None:
                return
            prompt, samples = decoded
            self._mean_n = len(samples) if self._mean_n is None else 0.9 * self._mean_n + 0.1 * len(samples)
            size = min(len(prompt.tokens) + prompt.sampling.max_tokens, self.engine.max_model_len)
            self._mean_tokens = size if self._mean_tokens is None else 0.9 * self._mean_tokens + 0.1 * size
            if not await self._wait_for_room(len(samples), len(samples) * size):
                return
            counted, tokens = len(samples), len(samples) * size
            self._inflight_samples += counted
            self._inflight_tokens += tokens
            self._account()
            await self._generate_and_publish(entry, prompt, samples)
        finally:
            del self._inflight[entry.stream, entry.id]
            self._inflight_samples -= counted
            self._inflight_tokens -= tokens
            self._slot.last_work = time.monotonic()
            self._account()
            self._room.set()

    async def _generate_and_publish(
        self, entry: Entry, prompt: Prompt, samples: list[tuple[int, Partial | None]]
    ) -> None:
        try:
            if not await self._engine_ready():
                return  # the engine could not start: the worker stops and the entry stays pending
            results = await asyncio.gather(*(self._generate_sample(prompt, k, entry, done) for k, done in samples))
            rollouts = [r for r in results if isinstance(r, Rollout)]
            partials = [r for r in results if isinstance(r, Partial)]
            published = await self.publisher.publish(rollouts, entry, partials, prompt.reply_to)
            if published > 0:
                self.published += published
                self.metrics.published(published)
        except EngineClosedError as exc:
            # The engine is gone: stop, so that a supervisor restarts us and the others claim our work.
            if not self._stopping.is_set():
                log.error("%s: %s; stopping, prompt %s stays pending", self.name, exc, prompt.id)
                self.failure = str(exc)
                self.stop(drain=False)
        except Exception:
            # Not the prompt's fault (a failed engine step, Redis gone): leave it pending for a retry elsewhere.
            log.exception("%s: prompt %s failed; it stays pending", self.name, prompt.id)
            self.metrics.prompt_failed()

    async def _generate_sample(
        self, prompt: Prompt, sample: int, entry: Entry, done: Partial | None
    ) -> Rollout | Partial:
        """One sample, or the rest of one (`done`: what an earlier worker generated before a pause).

        An `abort` pause ends it early. Unless the worker hands its interrupted samples off (`hand_off_partials`) or
        stops, it waits for the resume and continues it here from the tokens so far: nothing of it crosses Redis."""
        while True:
            result = await self._generate_rest(prompt, sample, entry, done)
            if isinstance(result, Rollout) or self.settings.hand_off_partials:
                return result
            await self._serving.wait()  # the sync's resume, or a stop (which sets it too)
            if self._stopping.is_set():
                return result  # published to `{ns}:partials` with the entry's ack: another worker continues it
            done = result

    async def _generate_rest(
        self, prompt: Prompt, sample: int, entry: Entry, done: Partial | None
    ) -> Rollout | Partial:
        """Generate one sample, or the rest of `done`: a Rollout, or a Partial if a pause aborted it."""
        so_far = done.generated if done is not None else np.zeros(0, dtype=np.int32)
        sampling = prompt.sampling.model_copy(update={"max_tokens": prompt.sampling.max_tokens - len(so_far)})
        if sampling.seed is not None:  # a continuation's own: the engine draws from the seed's start again
            sampling.seed = continuation_seed(sampling.seed + sample, len(so_far))
        started = time.time()
        version = self.engine.version
        error = None
        if done is not None and len(prompt.tokens) + len(so_far) >= self.engine.max_model_len:
            generation = Generation(_EMPTY_TOKENS, _EMPTY_LOGPROBS, "length", [])  # the context is full already
        else:
            try:
                # Keyed by entry, not prompt id: a resubmitted prompt id may be in flight here twice.
                request_id = f"{prompt.id}@{entry.id.decode()}:{sample}"
                tokens = np.concatenate([prompt.tokens, so_far])
                if prompt.adapter is None:
                    generation = await self.engine.generate(request_id, tokens, sampling)
                else:
                    async with self._adapters.using(prompt.adapter) as version:
                        generation = await self.engine.generate(request_id, tokens, sampling, prompt.adapter)
            except Stopping:  # it waited for its adapter: it goes on elsewhere, from its tokens so far
                generation = Generation(_EMPTY_TOKENS, _EMPTY_LOGPROBS, "abort", [])
            except EngineInputError as exc:
                error = str(exc)
                generation = Generation(_EMPTY_TOKENS, _EMPTY_LOGPROBS, "error", [])
        self.generated_tokens += len(generation.tokens)
        self.metrics.generated(time.time() - started, len(generation.tokens), generation.finish_reason)
        new_spans = generation.spans or [(version, 0, len(generation.tokens))]
        tokens = np.concatenate([so_far, generation.tokens])
        logprobs = np.concatenate([done.logprobs, generation.logprobs]) if done is not None else generation.logprobs
        spans = join_spans(done.spans if done is not None else [], new_spans, len(so_far))
        top_ids, top_logprobs = _join_alternatives(done, generation, len(tokens))
        if generation.finish_reason == "abort":  # only a pause aborts: the sample goes on after the resume
            return Partial(
                prompt=prompt,
                sample=sample,
                generated=tokens,
                logprobs=logprobs,
                spans=spans,
                top_token_ids=top_ids,
                top_logprobs=top_logprobs,
            )
        finished = time.time()
        return Rollout(
            prompt_id=prompt.id,
            sample=sample,
            n=prompt.n,
            version=spans[0][0] if spans else version,
            version_end=spans[-1][0] if spans else version,
            finish_reason=generation.finish_reason,
            worker=self.name,
            prompt_tokens=prompt.tokens,
            tokens=tokens,
            logprobs=logprobs,
            spans=spans,
            meta=prompt.meta,
            timing={"queued_s": max(0.0, started - prompt.ts), "generate_s": finished - started, "finished": finished},
            error=error,
            reward_fn=prompt.reward_fn,
            cached_tokens=generation.cached_tokens,
            adapter=prompt.adapter,
            routed_experts=generation.routed_experts if len(tokens) else None,
            top_token_ids=top_ids,
            top_logprobs=top_logprobs,
        )

    # -- weight syncs: the worker's side of the protocol in staleness.manager ----------------

    async def _catch_up(self) -> bytes:
        """Before taking work: load the state's version, or join the sync under way. Returns where to follow control.

        A version that was broadcast (nccl) is nowhere to fetch: the worker then waits, taking no work,
        for the next sync. Without an engine (`lazy`) nothing loads yet (`_load_current`).
        """
        control_from = await asyncio.to_thread(self.streams.control.last_id)
        await self._adapters.catch_up()  # adapters sync on their own: ack any sync of one under way
        async with self._slot.lock:
            await self._load_current()
            self._slot.ready = self._slot.started
        return control_from

    async def _load_current(self) -> None:
        """Bring a started engine to the state's version, or do this worker's part of the sync or sleep under way.

        Without an engine nothing loads: the worker takes work, whose arrival starts the engine and comes back here,
        unless the version could not be loaded then (broadcast before this worker could receive it): then it
        awaits the next sync. A worker that joins a sleeping fleet sleeps with it (a colocated trainer's step is under
        way), its engine at the fleet's version, until the sync or wake that ends the sleep. The caller holds the
        slot's lock."""
        state = await asyncio.to_thread(read_state, self.streams.redis, self.streams.keys)
        command = None
        if state.paused:  # a sync or a sleep is under way: do our part of it, then wait for its resume
            command = await asyncio.to_thread(
                weights_command, self.streams.redis, self.streams.keys, state.epoch, cmds=("weights", "sleep")
            )
        if command is not None and command.cmd == "weights":
            if self._loadable(command.version, command.uri):
                await self._sync_weights(command)
            else:
                self._await_next_sync(command.version)
            return
        if state.version != self.engine.version and state.weights_uri:
            if not self._loadable(state.version, state.weights_uri):
                self._await_next_sync(state.version)
                return
            if self._slot.started:
                await self._load(state.weights_uri, state.version)
        self._unstarted_version = state.version
        if command is not None:  # the fleet's sleep, which this worker joins at the fleet's version
            self.status = self._unstarted()  # until `_sleep` pauses a started engine
            await self._sleep(command)
            return
        self._epoch = state.epoch
        self.status = WorkerStatus.SERVING if self._slot.started else self._unstarted()
        self._set_serving(True)

    def _loadable(self, version: int, uri: str) -> bool:
        """Whether `version` can be loaded now or at a later start: stored (fs, redis), or a broadcast copy held."""
        return not uri or is_stored(uri) or self._slot.copy_of(version) is not None

    async def _load(self, uri: str, version: int) -> None:
        """Load `version` into the started engine: from the CPU copy of a broadcast if one is held, else fetched."""
        copy = self._slot.copy_of(version)
        if copy is not None:
            await self.engine.load_tensors(copy.tensors, version)
        else:
            await load_version(self.engine, uri, version, self.streams.redis)
        self._loaded(uri, version)

    def _loaded(self, uri: str, version: int) -> None:
        self._loaded_from = uri
        if self._slot.copy_of(version) is None:
            self._slot.received = None  # an older version's copy: no start will want it

    def _unstarted(self) -> WorkerStatus:
        """The status of a worker without an engine: never started, or released."""
        return WorkerStatus.RELEASED if self._slot.starts else WorkerStatus.IDLE

    def _await_next_sync(self, version: int) -> None:
        self.status = AWAITING_WEIGHTS
        log.info(
            "%s: version %d was broadcast before this worker joined; waiting for the next sync", self.name, version
        )

    async def _follow_control(self, after: bytes) -> None:
        """Obey the commands on `control` after `after`: read when this worker's bell rings (`ControlStream.ring`), and
        at least every `CONTROL_RECHECK_S` besides. Blocking on the bell, not on `control`, lets a manager wake a fleet
        in waves: 1,000 workers blocked on `control` would all be served in the same instant by Redis."""
        bell: bytes | None = None
        read, read_at = True, 0.0
        while not self._stopping.is_set():
            if bell is None:  # where the bell stood before the first read: a ring after it is not missed
                bell = await self._control_call(self.streams.control.bell_id, self.name)
                continue
            if read:
                entries = await self._control_call(self.streams.control.read, after, None)
                if entries is None:
                    continue
                read_at = time.monotonic()
                after = await self._obey_entries(entries, after)
                if len(entries) >= CONTROL_BATCH:
                    continue  # there may be more: read again before waiting
            rang = await self._control_call(self.streams.control.wait_for_bell, self.name, bell, self.settings.block_ms)
            read = rang is None or rang != bell or time.monotonic() - read_at >= CONTROL_RECHECK_S
            bell = rang or bell

    async def _control_call(self, call: Callable[..., T], *args: object) -> T | None:
        """One Redis call of the control loop, on a thread; a failure is logged and answered with None after a
        heartbeat period (the loop then tries again)."""
        try:
            return await asyncio.to_thread(call, *args)
        except Exception:
            if self._redis_gone:  # stopping without it: nothing to retry
                return None
            log.exception("%s: reading control failed; retrying", self.name)
            await asyncio.sleep(self.settings.heartbeat_s)
            return None

    async def _obey_entries(self, entries: list[Entry], after: bytes) -> bytes:
        """Obey control entries in order; returns the id of the last one (`after` if none)."""
        for entry in entries:
            after = entry.id
            try:
                command = Control.from_fields(entry.fields)
            except WireError as exc:
                log.warning("%s: ignoring a bad control entry %s: %s", self.name, entry.id, exc)
                continue
            await self._obey(command)
        return after

    async def _obey(self, command: Control) -> None:
        if command.adapter and command.cmd in ("weights", "resume"):
            await self._adapters.obey(command)  # one adapter's sync: nothing else pauses
        elif command.cmd in ("weights", "resume"):
            async with self._slot.lock:  # not while the engine starts (and loads) or stops
                if command.cmd == "weights" and command.epoch > self._epoch:
                    await self._sync_weights(command)
                elif command.cmd == "resume" and command.epoch >= self._epoch:
                    await self._resume()
        elif command.cmd == "sleep":
            async with self._slot.lock:
                if command.epoch > self._epoch:
                    await self._sleep(command)
        elif command.cmd == "stop" and command.worker in ("", self.name):
            if command.worker:
                self.failure = "evicted by the manager (no ack of a weight sync in time)"
            self.stop(drain=not command.worker)

    async def _resume(self) -> None:
        """The manager's resume after a sync: generate again (without an engine: take work again)."""
        if self._serving.is_set() or self.status == AWAITING_WEIGHTS:
            return
        if self._slot.started:
            try:
                await self._wake()  # after a sleep, the KV cache: the largest allocation, and after the ack
                await self.engine.resume()
                self._frozen = False
            except Exception as exc:  # acked, but it cannot go on
                self._give_up(f"could not wake or resume its engine after sync {self._epoch}: {exc}")
                return
            self.status = WorkerStatus.SERVING
        self._set_serving(True)
        self._last_stall_s = time.monotonic() - self._sync_began
        self.metrics.resumed(self._last_stall_s)
        await self._beat()

    async def _sleep(self, command: Control) -> None:
        """Pause (`command.mode`), put the engine to sleep at `command.level` and ack; stay paused until a sync (which
        wakes it before it loads) or the manager's resume. An engine that cannot sleep (`SleepNotSupported`) stays
        paused, awake, and acks all the same, its heartbeat's `asleep` 0: the trainer's report names it. Without an
        engine there is nothing to free: it acks at once. The caller holds the slot's lock."""
        self._set_serving(False)
        self._sync_began = time.monotonic()
        if self._slot.started:
            self.status = WorkerStatus.PAUSED
            await self._pause(command.mode)
            try:
                await self.engine.sleep(command.level)
                self._asleep, self._sleeping = command.level, set(WAKE_ALL)
                self.status = WorkerStatus.ASLEEP
            except SleepNotSupported as exc:
                log.error("%s: paused for a sleep, but its engine cannot sleep: %s", self.name, exc)
        self._epoch = command.epoch
        await self._beat()
        log.info("%s: asleep at level %d (epoch %d) in %.3f s", self.name, self._asleep, command.epoch,
                 time.monotonic() - self._sync_began)  # fmt: skip

    async def _wake(self, parts: Sequence[WakePart] = WAKE_ALL) -> None:
        """Take back what the engine's sleep freed: its weights before a load, everything at the resume that ends a
        sleep (so that a load runs without the KV cache in memory: vLLM's staged wake)."""
        waking = [part for part in WAKE_ALL if part in parts and part in self._sleeping]
        if waking:
            await self.engine.wake_up(waking)
            self._sleeping.difference_update(waking)
        if not self._sleeping:
            self._asleep = 0

    async def _sync_weights(self, command: Control) -> None:
        """Pause, load `command.version`, ack with the epoch; stay paused until the manager's resume.

        An nccl version is joined first, while the engine still generates (`join_version`): the wait for the
        other workers to join and a new group's setup are not time this worker stands still; it pauses only to
        receive. A `redis://` version is fetched and checked before the pause too (`prefetch_version`): paused, the
        worker only copies it into the model. A version that cannot be loaded stops the worker (exit 1, for a
        supervisor to restart it): it must not serve the old one as the new, and its work goes to the others. The
        caller holds the slot's lock.
        """
        if not self._slot.started:
            await self._sync_unstarted(command)
            return
        link: BroadcastLink | None = None
        if not is_stored(command.uri):
            self._slot.nccl_uris.add(command.uri)
        if command.version != self.engine.version and not self._loadable(command.version, command.uri):
            try:
                link = await join_version(self.engine, command.uri, command.version, command.epoch, member=self.name)
            except Exception as exc:
                self._cannot_load(command, exc)
                return
        fetched = None  # a redis:// version is fetched while the engine still generates, as a broadcast is joined
        fetch_began = time.monotonic()
        if (
            link is None
            and fetches_ahead(command.uri)
            and command.version != self.engine.version
            and self._slot.copy_of(command.version) is None
        ):
            try:
                fetched = await asyncio.to_thread(prefetch_version, command.uri, command.version, self.streams.redis)
            except Exception as exc:
                self._cannot_load(command, exc)
                return
        self._set_serving(False)
        self.status = WorkerStatus.PAUSED
        started = self._sync_began = time.monotonic()
        fetch_s = started - fetch_began
        await self._pause(command.mode)
        await self._wake(("weights",))  # the weights' memory back before the load fills it; the cache's at the resume
        paused = time.monotonic()
        if command.version != self.engine.version:
            try:
                if link is not None:
                    await load_joined(self.engine, link)
                    self._loaded(command.uri, command.version)
                elif fetched is not None:
                    await load_prefetched(self.engine, fetched, command.version)
                    self._loaded(command.uri, command.version)
                else:
                    await self._load(command.uri, command.version)
            except Exception as exc:
                self._cannot_load(command, exc)
                return
        self._epoch = command.epoch
        await self._beat()  # the ack: `epoch` and `version` in the heartbeat
        self.metrics.synced(paused - started, time.monotonic() - paused)
        log.info(
            "%s: sync %d: fetched or joined in %.3f s, paused in %.3f s, version %d loaded and acked in %.3f s",
            self.name, command.epoch, fetch_s, paused - started, command.version, time.monotonic() - paused,
        )  # fmt: skip

    async def _sync_unstarted(self, command: Control) -> None:
        """A sync while there is no engine: nothing to pause or load, so ack at once (no trainer waits for a cold
        start). A stored version is loaded from the state when the engine starts; a broadcast one is received now
        into a CPU copy, to load then. A worker that cannot receive it awaits the next sync (it takes no work)."""
        self._set_serving(False)  # as every worker, it takes no work until the resume
        self._sync_began = time.monotonic()
        if not is_stored(command.uri):
            self._slot.nccl_uris.add(command.uri)
            try:
                self._slot.received = await receive_copy(command.uri, command.version, command.epoch, self.name)
                self.status = self._unstarted()
            except Exception as exc:
                log.error("%s: could not receive version %d from %s: %s", self.name, command.version, command.uri, exc)
                self._slot.received = None
                self.status = AWAITING_WEIGHTS
        self._epoch, self._unstarted_version = command.epoch, command.version
        await self._beat()
        log.info("%s: sync %d acked without an engine: version %d loads when it starts", self.name, command.epoch,
                 command.version)  # fmt: skip

    # -- the engine's lifecycle: lazy start, idle release (consumers.lifecycle) ------------------

    async def _engine_ready(self) -> bool:
        """Start the engine if there is none (the first work of a lazy or released worker) and bring it to the
        current version; False if it could not start (the worker then stops, and its work stays pending)."""
        if self._slot.ready:
            return True
        async with self._slot.lock:
            if self._slot.ready or self._stopping.is_set():
                return self._slot.ready
            began = time.monotonic()
            self.status = WorkerStatus.STARTING
            await self._beat()
            try:
                await self._slot.start()
                await self._load_current()
            except Exception as exc:
                self._could_not_start(exc)
                self.stop(drain=False)
                return False
            self._slot.ready = True
            self._engine_started("demand", began)
            await self._beat()
        return True

    def _could_not_start(self, exc: Exception) -> None:
        """Why the engine could not start, as the worker's `failure` (the worker then stops, exit 1, its work stays
        pending). `EngineClosedError` says what to fix (a server that does not answer or lacks a flag): one line;
        anything else is unexpected, and its traceback goes to the log."""
        self.failure = f"the engine could not start: {exc}"
        if isinstance(exc, EngineClosedError):
            log.error("%s: %s", self.name, self.failure)
        else:
            log.exception("%s: the engine could not start", self.name)

    def _engine_started(self, why: str, began: float) -> None:
        seconds = self._slot.cold_start_s = time.monotonic() - began
        self._slot.last_work = time.monotonic()
        self.metrics.engine_started(why, seconds)
        log.info("%s: engine started (%s) in %.2f s at version %d", self.name, why, seconds, self.engine.version)

    async def _release_when_idle(self) -> None:
        """`release_after_s`: shut the engine down once it served nothing for that long; work starts it again."""
        after = self.settings.release_after_s
        if after is None:
            return
        while not self._stopping.is_set():
            await asyncio.sleep(min(after, self.settings.heartbeat_s) / 2)
            if self._may_release(after):
                async with self._slot.lock:
                    if self._may_release(after):
                        await self._release()

    def _may_release(self, after: float) -> bool:
        """Idle that long, serving (not mid-sync), and able to load its version again at the next start."""
        return (
            self._slot.ready
            and not self._inflight
            and self._serving.is_set()
            and self.status == WorkerStatus.SERVING
            and self._slot.idle_for() >= after
            and self._loadable(self.engine.version, self._loaded_from)
        )

    async def _release(self) -> None:
        """Swap in a fresh engine and let the old one shut down in the background (`EngineSlot.release`): work that
        arrives meanwhile starts the fresh one once the old is gone; a sync is acked at once."""
        self.status = WorkerStatus.RELEASED
        self._slot.ready = False
        self.metrics.engine_released()
        self._slot.release()
        self._adapters.engine = self.engine  # the fresh one: adapters load into it on demand
        log.info("%s: engine released after %.1f s without work", self.name, self._slot.idle_for())
        await self._beat()

    def _cannot_load(self, command: Control, exc: Exception) -> None:
        self._give_up(f"could not load weights version {command.version} from {command.uri}: {exc}")

    def _give_up(self, failure: str) -> None:
        """Stop now (exit 1, for a supervisor to restart it), saying why: its work goes to the others."""
        log.error("%s: %s", self.name, failure)
        self.failure = failure
        self.stop(drain=False)

    # -- upkeep: heartbeat, keep own work, rehome departed inboxes, trim -------------------------

    async def _upkeep(self) -> None:
        """Every heartbeat period: heartbeat, keep own work, rehome departed inboxes, trim.

        The first period is a random fraction of one and every later one is jittered by ±10 %: workers started
        together (a fleet, a restart after a Redis outage) would otherwise beat in phase, and 1,000 of them send
        Redis a burst of ~3,000 commands at the same instant every period, which every publish then queues behind.
        """
        last_trim = 0.0
        last_tokens, last_time = 0, time.monotonic()
        first = True
        while True:
            now = time.monotonic()
            self._tokens_per_s = (self.generated_tokens - last_tokens) / max(now - last_time, 1e-6)
            last_tokens, last_time = self.generated_tokens, now
            try:
                self._fleet = await self._beat(touch=True)
                if not self._stopping.is_set() and random.random() < sweep_chance(self._fleet):
                    await asyncio.to_thread(self.streams.registry.rehome_departed)
                if now - last_trim > self.settings.trim_every_s:
                    last_trim = now
                    keys = self.streams.keys
                    # The shared streams' trim asks XPENDING for a summary that lists every consumer (120 us a
                    # call with 1,000 workers), so a fleet shares it out as it does sweeps; its own inbox, each.
                    shared = [keys.prompts, keys.partials] if random.random() < sweep_chance(self._fleet) else []
                    for stream in (*shared, keys.inbox(self.name)):
                        await asyncio.to_thread(self.streams.trim_consumed, stream)
            except Exception:
                if self._redis_gone:  # stopping without it: nothing to retry
                    return
                log.exception("%s: upkeep failed; retrying", self.name)
            period = self.settings.heartbeat_s
            await asyncio.sleep(period * (random.random() if first else random.uniform(0.9, 1.1)))
            first = False

    async def _beat(self, touch: bool = False) -> int:
        """Write the heartbeat (`touch`: and reset the idle time of the work in flight, in the same round trip);
        returns the size of the fleet on the registry."""
        async with self._beating:
            if self._layout is None and self._slot.started:
                self._layout = await asyncio.to_thread(self._advertise_layout)
            status = {
                "status": self.status,
                "engine": self.engine.name,
                "max_model_len": self.engine.max_model_len,  # what a gateway may queue for this worker
                "version": self.engine.version if self._slot.started else self._unstarted_version,
                "epoch": self._epoch,
                "stall_s": round(self._last_stall_s, 6),
                "inflight": self._inflight_samples,
                "inflight_tokens": self._inflight_tokens,
                "published": self.published,
                "tokens_per_s": round(self._tokens_per_s, 1),
                "generated_tokens": self.generated_tokens,
                "busy_s": round(self._busy.seconds(), 3),
                PARTIALS_FIELD: HAND_OFF if self.settings.hand_off_partials else CONTINUE_HERE,
                ASLEEP_FIELD: self._asleep,
                "engine_starts": self._slot.starts,  # with --lazy / --release-after-s: how often it started cold
                "cold_start_s": round(self._slot.cold_start_s, 3),
                "started": round(self._started, 3),
                "ts": round(time.time(), 3),
                "host": socket.gethostname(),  # where to look (and what to kill) when a worker is named otherwise
                "pid": os.getpid(),
                **self._adapters.heartbeat_fields(),
                **({LAYOUT_FIELD: self._layout} if self._layout else {}),
            }
            entries = list(self._inflight.values()) if touch else []
            ttl_s = self.settings.heartbeat_ttl_s
            dead_after_s = self.settings.dead_after_s
            room, held = self._room_to_take(), len(self._inflight)
            return await asyncio.to_thread(
                self.streams.registry.heartbeat, self.name, status, ttl_s, entries, dead_after_s, room, held
            )

    def _room_to_take(self) -> int:
        """Entries it could take (its heartbeat keeps it on the ready set with it): none while it is asleep,
        stopping, has entries waiting for room, or one to run alone. A sync's pause keeps it on the set: the others do
        not take its share of what waits at the resume."""
        if self._stopping.is_set() or self._asleep or self._waiting_for_room or self._held:
            return 0
        if self._alone or self._running_alone is not None:
            return 0
        if self._inflight and not self._slot.ready:
            return 0
        free = self._free_samples()
        return self._entries_for(free) if free > 0 or not self._inflight_samples else 0

    def _advertise_layout(self) -> str:
        """Put the engine's model layout in `{ns}:layouts` (once per distinct model) and return its digest, for the
        heartbeat: a trainer then refuses weights that fit no worker's model before any worker pauses
        (`staleness.weights.layout`). "" when the engine cannot say, or the write failed (it is not tried again)."""
        try:
            layout = layout_of(self.engine)
            return "" if layout is None else advertise(self.streams, layout)
        except Exception:
            log.exception("%s: could not advertise the model's layout; trainers will not check weights against it",
                          self.name)  # fmt: skip
            return ""

    async def _claim_abandoned(self) -> tuple[int, bool]:
        """Take over a dead or hung worker's work (`Streams.claim_abandoned`) while there is room, its share of it;
        returns how many entries it claimed, and whether such work waits that is another worker's turn."""
        free = self._free_samples()
        if free <= 0 or not self._serving.is_set():
            return 0, False
        count = self._entries_for(free)
        quick_ms = int(self.settings.heartbeat_s * 1000)  # a silent worker's entries idle a beat: none it just took
        claimed, others_turn = await asyncio.to_thread(
            self.streams.claim_abandoned,
            self.name,
            self.settings.claim_idle_ms,
            count,
            quick_ms,
            self._horizon_ms,
            len(self._inflight),
        )
        for entry in claimed:
            if (entry.stream, entry.id) in self._inflight:
                continue  # ours already (we stalled past the idle limit): keep serving it once
            if await self._suspect(entry):
                continue
            log.info("%s: claimed abandoned %s %s", self.name, entry.stream, entry.id)
            self._start(entry)
        if claimed:
            await asyncio.sleep(0)  # as after a read: they count their samples before the room is measured
        return len(claimed), others_turn

    async def _take_up_leftovers(self) -> None:
        """Before new work, take up what an earlier process under this name left pending (it died and this one took
        its name, as a supervisor restarting it under its name does): its heartbeat goes on under the name, so the
        others would not take that work over until it idled past `claim_idle_ms`. Held, and started as room
        allows."""
        try:
            entries = await asyncio.to_thread(self.streams.leftovers, self.name, LEFTOVERS_MAX)
        except redis.ConnectionError as exc:
            log.warning("%s: reading what an earlier process of its name left failed (%s)", self.name, exc)
            return
        if entries:
            log.info("%s: taking up %d entries an earlier process of its name left pending", self.name, len(entries))
        for entry in entries:
            if not await self._suspect(entry):
                self._inflight[entry.stream, entry.id] = entry
                self._held.append(entry)

    async def _suspect(self, entry: Entry) -> bool:
        """Whether an entry handed out again is not to be served as usual, and so was dealt with here: handed out
        `apart_after` times, it is set aside to run apart (`_apart`); `max_deliveries` times, to run alone (`_alone`),
        both held meanwhile; handed out again after `alone_tries` starts alone (`Streams.alone_runs`: each time the
        worker that ran only it died or hung), it is a dead letter."""
        deliveries = await asyncio.to_thread(self.streams.delivery_count, entry)
        alone = deliveries >= self.settings.max_deliveries
        if not alone and deliveries < self.settings.apart_after:
            return False
        runs = await asyncio.to_thread(self.streams.alone_runs, entry) if alone else 0
        if runs < self.settings.alone_tries:
            self._inflight[entry.stream, entry.id] = entry  # held: touched every heartbeat, claimed by nobody
            (self._alone if alone else self._apart).append(entry)
            return True
        reason = (
            f"handed out {deliveries} times without finishing, {runs} of them run alone (limits"
            f" {self.settings.max_deliveries} and {self.settings.alone_tries}): each worker that ran nothing else died"
            " or hung"
        )
        if await asyncio.to_thread(self.streams.dead_letter, entry, reason, "deliver"):
            self.metrics.dead_letter("deliver")
        with contextlib.suppress(redis.RedisError):
            await asyncio.to_thread(self.streams.forget_alone, entry)
        return True


def run_worker(
    streams: Streams,
    engine: Engine,
    name: str | None,
    settings: WorkerSettings,
    metrics: WorkerMetrics | None = None,
    factory: EngineFactory | None = None,
) -> Worker:
    """Run a worker until SIGINT/SIGTERM, then drain and stop the engine (`factory`: see `Worker`)."""
    worker = Worker(streams, engine, name, settings, metrics, factory)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, worker.stop)
        await worker.run()

    asyncio.run(main())
    return worker
