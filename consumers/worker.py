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

`Worker` owns the read, claim and run loop (what it takes, how much, and what runs apart or alone) and composes
the rest: its `ServingState` and `Heartbeat` (`consumers.serving`), its side of the weight-sync protocol
(`consumers.sync`), its adapters (`consumers.adapters`) and its engine's slot (`consumers.lifecycle`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
import time
from collections import deque
from collections.abc import Awaitable, Callable, Collection

import numpy as np
import redis

from consumers.adapters import Stopping, WorkerAdapters
from consumers.engines.base import Engine, EngineClosedError, EngineInputError, Generation, continuation_seed, continued
from consumers.lifecycle import EngineFactory, EngineSlot, WorkerStatus
from consumers.metrics import WorkerMetrics
from consumers.serving import Heartbeat, ServingState
from consumers.settings import WorkerSettings
from consumers.sync import WorkerSync
from pipeline.connections import give_up_reconnecting, redis_address, redis_unreachable
from pipeline.publisher import Publisher
from pipeline.registry import default_name, sweep_chance
from pipeline.streams import Entry, Streams
from pipeline.wire import Partial, Prompt, Rollout, WireError, join_spans

log = logging.getLogger(__name__)


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


class Worker:
    """One consumer worker: reads and claims entries, runs them on its engine, publishes their rollouts."""

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
        self.failure: str | None = None
        """Why the worker stopped on its own (its engine died); None after a requested stop."""
        self.publisher = Publisher(streams)
        """Publishes what finishes while another publish is on the wire in one round trip with it."""
        self.state = ServingState(engine.version)
        """What the worker is doing now (status, serving or paused, asleep, work in flight): what its heartbeat says."""
        self._inflight: dict[tuple[str, bytes], Entry] = {}
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
        self._drain_on_stop = True
        self._tasks: set[asyncio.Task] = set()
        self._fleet = 1
        """Workers on the registry at the last heartbeat: how often this one claims and sweeps (`sweep_chance`)."""
        self.heartbeat = Heartbeat(
            streams,
            self.name,
            self.state,
            self._slot,
            self,
            self.settings.heartbeat_ttl_s,
            self.settings.dead_after_s,
            self.settings.hand_off_partials,
        )
        self._adapters = WorkerAdapters(
            streams, engine, self.name, self.heartbeat.beat, self.metrics, self.state.stopping
        )
        """LoRA adapters: loaded on demand, evicted when idle, each paused alone for its own syncs."""
        self.heartbeat.fields = self._adapters.heartbeat_fields
        self._sync = WorkerSync(
            streams,
            self.name,
            self._slot,
            self.state,
            self._adapters,
            self.heartbeat.beat,
            self.metrics,
            self,
            self.settings.heartbeat_s,
            self.settings.block_ms,
        )
        """Its side of the weight-sync protocol: follows control, pauses, loads, sleeps, wakes, resumes, acks."""

    @property
    def status(self) -> WorkerStatus:
        """What the worker and its engine are doing now (the heartbeat's `status`)."""
        return self.state.status

    @property
    def published(self) -> int:
        """Rollouts this worker published."""
        return self.state.published

    @property
    def generated_tokens(self) -> int:
        return self.state.generated_tokens

    @property
    def engine(self) -> Engine:
        """The engine now: a fresh, unstarted one after a release (`consumers.lifecycle`)."""
        return self._slot.engine

    @property
    def inflight_samples(self) -> int:
        """Samples of the work taken that are not yet published (what the heartbeat's `inflight` says)."""
        return self.state.inflight_samples

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
        free = self.max_inflight - self.state.inflight_samples
        budget = self.max_inflight_tokens
        if budget is not None and self._mean_tokens is not None:
            free = min(free, int((budget - self.state.inflight_tokens) / self._mean_tokens))
        return free

    def _fits(self, samples: int, tokens: int) -> bool:
        """Whether an entry of `samples` samples and `tokens` tokens fits beside the work in flight (alone, it does)."""
        if self.state.inflight_samples == 0:
            return True
        budget = self.max_inflight_tokens
        return self.state.inflight_samples + samples <= self.max_inflight and (
            budget is None or self.state.inflight_tokens + tokens <= budget
        )

    async def _wait_for_room(self, samples: int, tokens: int) -> bool:
        """Wait until an entry fits (`_fits`): room is counted at the mean entry, so one larger than the rest may have
        been read past it. False if the worker stops meanwhile (the entry then stays pending, for another worker)."""
        self._waiting_for_room += 1
        try:
            while not self._fits(samples, tokens):
                if self.state.stopping.is_set():
                    return False
                self._room.clear()
                await self._room.wait()
        finally:
            self._waiting_for_room -= 1
        return True

    def stop(self, drain: bool = True) -> None:
        """Ask the worker to stop taking work (and let in-flight work finish if `drain`).

        Safe to call from a signal handler in the loop. Without `drain`, in-flight work is dropped
        here and stays pending in Redis, where the other workers claim it.
        """
        self._drain_on_stop = self._drain_on_stop and drain
        self.state.stopping.set()
        self._room.set()
        self.state.set_serving(True)  # wake a paused read loop so that it sees the stop

    async def run(self) -> None:
        await asyncio.to_thread(self.streams.ensure_groups)
        await asyncio.to_thread(self.streams.join, self.name)
        began = time.monotonic()
        if self.settings.lazy:
            self.state.status = WorkerStatus.IDLE
        else:
            try:
                await self._slot.start()
            except Exception as exc:
                self._could_not_start(exc)
                await self._slot.shutdown()
                await asyncio.to_thread(self.streams.registry.forget_worker, self.name)
                return
        control_from = await self._sync.catch_up()
        if self._slot.started:
            self._engine_started("launch", began)
        upkeep = asyncio.create_task(self._upkeep())
        control = asyncio.create_task(self._sync.follow_control(control_from))
        release = asyncio.create_task(self._release_when_idle())
        watch = asyncio.create_task(self._watch_redis_while_stopping())
        try:
            await self._take_up_leftovers()
            await self._read_loop()
            self.state.status = WorkerStatus.STOPPING
            await self._unless_redis_gone(self.heartbeat.beat)
            if self._drain_on_stop:
                await self._unless_redis_gone(self._hand_back_held)
                await self._sync.unfreeze()
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
        await self.state.stopping.wait()
        while not self.state.redis_gone:
            problem = await asyncio.to_thread(redis_unreachable, self.streams.redis)
            if problem is not None:
                self._lost_redis(problem)
                return
            await asyncio.sleep(REDIS_CHECK_S)

    async def _unless_redis_gone(self, call: Callable[[], Awaitable[object]]) -> None:
        """A Redis call of the way out, skipped once Redis is gone; one that fails for want of Redis means it is."""
        if self.state.redis_gone:
            return
        try:
            await call()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            self._lost_redis(str(exc))

    def _lost_redis(self, problem: str) -> None:
        """Stop without Redis: say in one line what the worker could not hand on, give up every Redis call under way
        (`give_up_reconnecting`) and drop the work in flight, whose publishes could only fail."""
        if self.state.redis_gone:
            return
        self.state.redis_gone = True
        entries, samples = len(self._inflight), self.state.inflight_samples
        held = (
            f"the work it held ({entries} {'entry' if entries == 1 else 'entries'}, {samples} samples) "
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
        while not self.state.stopping.is_set():
            await self.state.serving.wait()
            if self.state.stopping.is_set():  # a stop sets `serving` too: during a sync, read nothing more
                break
            if self._inflight and not self._slot.ready:
                await self._engine_ready()  # no engine (lazy, released): take no more until it serves what it holds
                continue
            free = self._free_samples()
            if self._waiting_for_room or (free <= 0 and self.state.inflight_samples):
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
                if self.state.redis_gone:  # stopping without it (`_lost_redis` said so)
                    break
                log.warning("%s: reading work failed (%s); retrying", self.name, exc)
                await asyncio.sleep(self.settings.heartbeat_s)
                continue
            if self.state.stopping.is_set():  # a read that spanned the stop: what it read goes on elsewhere at once
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
        if entries or others_turn or self.state.stopping.is_set():
            return entries, others_turn
        entries = self.streams.read_work(self.name, 1, self._block_ms)
        if not entries or self._mean_n is None or self.state.stopping.is_set():
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
            self.state.inflight_samples += counted
            self.state.inflight_tokens += tokens
            self.state.account()
            await self._generate_and_publish(entry, prompt, samples)
        finally:
            del self._inflight[entry.stream, entry.id]
            self.state.inflight_samples -= counted
            self.state.inflight_tokens -= tokens
            self._slot.last_work = time.monotonic()
            self.state.account()
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
            published = await self._publish(rollouts, entry, partials, prompt)
            if published > 0:
                self.state.published += published
                self.metrics.published(published)
        except EngineClosedError as exc:
            # The engine is gone: stop, so that a supervisor restarts us and the others claim our work.
            if not self.state.stopping.is_set():
                log.error("%s: %s; stopping, prompt %s stays pending", self.name, exc, prompt.id)
                self.failure = str(exc)
                self.stop(drain=False)
        except Exception:
            # Not the prompt's fault (a failed engine step, Redis gone): leave it pending for a retry elsewhere.
            log.exception("%s: prompt %s failed; it stays pending", self.name, prompt.id)
            self.metrics.prompt_failed()

    async def _publish(self, rollouts: list[Rollout], entry: Entry, partials: list[Partial], prompt: Prompt) -> int:
        """Publish what was made of `entry`, trying again while Redis is out of reach for longer than the client's
        reconnects (a failover, a restart): the work is done and only needs delivering, and the entry, held here all
        the while, is one nobody else claims. Given up only when the worker stops."""
        while True:
            try:
                return await self.publisher.publish(rollouts, entry, partials, prompt.reply_to)
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if self.state.stopping.is_set() or self.state.redis_gone:
                    raise
                log.warning("%s: publishing prompt %s failed (%s); trying again", self.name, prompt.id, exc)
                await asyncio.sleep(self.settings.heartbeat_s)

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
            await self.state.serving.wait()  # the sync's resume, or a stop (which sets it too)
            if self.state.stopping.is_set():
                return result  # published to `{ns}:partials` with the entry's ack: another worker continues it
            done = result

    async def _generate_rest(
        self, prompt: Prompt, sample: int, entry: Entry, done: Partial | None
    ) -> Rollout | Partial:
        """Generate one sample, or the rest of `done`: a Rollout, or a Partial if a pause aborted it."""
        so_far = done.generated if done is not None else np.zeros(0, dtype=np.int32)
        sampling = continued(prompt.sampling, len(so_far))
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
        self.state.generated_tokens += len(generation.tokens)
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

    # -- the engine's lifecycle: lazy start, idle release (consumers.lifecycle) ------------------

    async def _engine_ready(self) -> bool:
        """Start the engine if there is none (the first work of a lazy or released worker) and bring it to the
        current version; False if it could not start (the worker then stops, and its work stays pending)."""
        if self._slot.ready:
            return True
        async with self._slot.lock:
            if self._slot.ready or self.state.stopping.is_set():
                return self._slot.ready
            began = time.monotonic()
            self.state.status = WorkerStatus.STARTING
            await self.heartbeat.beat()
            try:
                await self._slot.start()
                await self._sync.load_current()
            except Exception as exc:
                self._could_not_start(exc)
                self.stop(drain=False)
                return False
            self._slot.ready = True
            self._engine_started("demand", began)
            await self.heartbeat.beat()
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
        while not self.state.stopping.is_set():
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
            and self.state.serving.is_set()
            and self.state.status == WorkerStatus.SERVING
            and self._slot.idle_for() >= after
            and self._sync.loadable(self.engine.version, self._sync.loaded_from)
        )

    async def _release(self) -> None:
        """Swap in a fresh engine and let the old one shut down in the background (`EngineSlot.release`): work that
        arrives meanwhile starts the fresh one once the old is gone; a sync is acked at once."""
        self.state.status = WorkerStatus.RELEASED
        self._slot.ready = False
        self.metrics.engine_released()
        self._slot.release()
        self._adapters.engine = self.engine  # the fresh one: adapters load into it on demand
        log.info("%s: engine released after %.1f s without work", self.name, self._slot.idle_for())
        await self.heartbeat.beat()

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
            self.state.tokens_per_s = (self.state.generated_tokens - last_tokens) / max(now - last_time, 1e-6)
            last_tokens, last_time = self.state.generated_tokens, now
            try:
                self._fleet = await self.heartbeat.beat(touch=True)
                if not self.state.stopping.is_set() and random.random() < sweep_chance(self._fleet):
                    await asyncio.to_thread(self.streams.registry.rehome_departed)
                if now - last_trim > self.settings.trim_every_s:
                    last_trim = now
                    keys = self.streams.keys
                    # The shared streams' trim asks XPENDING for a summary that lists every consumer, so a fleet
                    # shares it out as it does sweeps; its own inbox, each.
                    shared = [keys.prompts, keys.partials] if random.random() < sweep_chance(self._fleet) else []
                    for stream in (*shared, keys.inbox(self.name)):
                        await asyncio.to_thread(self.streams.trim_consumed, stream)
            except Exception:
                if self.state.redis_gone:  # stopping without it: nothing to retry
                    return
                log.exception("%s: upkeep failed; retrying", self.name)
            period = self.settings.heartbeat_s
            await asyncio.sleep(period * (random.random() if first else random.uniform(0.9, 1.1)))
            first = False

    # -- what its heartbeat asks of it (`consumers.serving.HeldWork`) ---------------------------

    def held_entries(self) -> Collection[Entry]:
        """The entries this worker holds: started, held for room, or set aside to run apart or alone (its heartbeat
        touches them, so that nobody claims them)."""
        return self._inflight.values()

    def room_to_take(self) -> int:
        """Entries it could take (its heartbeat keeps it on the ready set with it): none while it is asleep,
        stopping, has entries waiting for room, or one to run alone. A sync's pause keeps it on the set: the others do
        not take its share of what waits at the resume."""
        if self.state.stopping.is_set() or self.state.asleep or self._waiting_for_room or self._held:
            return 0
        if self._alone or self._running_alone is not None:
            return 0
        if self._inflight and not self._slot.ready:
            return 0
        free = self._free_samples()
        return self._entries_for(free) if free > 0 or not self.state.inflight_samples else 0

    # -- claims: a dead worker's work, leftovers of an earlier process, entries that ran apart or alone ------

    async def _claim_abandoned(self) -> tuple[int, bool]:
        """Take over a dead or hung worker's work (`Streams.claim_abandoned`) while there is room, its share of it;
        returns how many entries it claimed, and whether such work waits that is another worker's turn."""
        free = self._free_samples()
        if free <= 0 or not self.state.serving.is_set():
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
