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

`Worker` is the read, claim and run loop, and composes its rooms: how much it takes (`TakeBudget`,
`consumers.budget`: samples and tokens in flight under its caps, no Redis, no engine), the entries it sets aside to run
apart or alone (`Suspects`, `consumers.suspects`), one sample and the rest of one a pause cut (`SampleGenerator`,
`consumers.continuation`), its engine's start on demand and idle release (`EngineKeeper`, `consumers.engine_keeper`,
over the slot of `consumers.lifecycle`), its way out on a stop notice, inside its deadline (`Departure`,
`consumers.departure`), its way out without Redis (`RedisLoss`, `consumers.redis_loss`), its
`ServingState` and `Heartbeat` (`consumers.serving`), its side of the weight-sync protocol (`consumers.sync`) and its
adapters (`consumers.adapters`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import signal
import time
from collections import deque
from collections.abc import Collection

import redis

from consumers.adapters import WorkerAdapters
from consumers.budget import DEFAULT_MAX_INFLIGHT, TakeBudget
from consumers.continuation import SampleGenerator, untouched
from consumers.departure import Departure
from consumers.engine_keeper import EngineKeeper
from consumers.engines.base import Engine, EngineClosedError
from consumers.house import House
from consumers.lifecycle import EngineFactory, EngineSlot, WorkerStatus
from consumers.metrics import WorkerMetrics
from consumers.redis_loss import RedisLoss
from consumers.serving import Heartbeat, ServingState
from consumers.settings import WorkerSettings
from consumers.suspects import Held, Suspects
from consumers.sync import WorkerSync
from pipeline.publisher import Publisher
from pipeline.registry import default_name, sweep_chance
from pipeline.streams import Entry, Streams, trim_consumed
from pipeline.wire import Partial, Prompt, Rollout, WireError

log = logging.getLogger(__name__)


LEFTOVERS_MAX = 10_000
"""At most this many entries of each stream that an earlier process under the worker's name left are taken up."""
STOOD_STILL_S = 1.0
"""A read of work that returns this much later than its wait could last stood still (its process stopped, or starved
of CPU): control is read and obeyed before what it brought starts or the next read, so that a worker evicted meanwhile
(its sync's ack missed) hands its work back instead of generating it under the version it held."""
TURN_WAIT_S = 0.002
"""How long a worker that holds its share of the waiting work waits before it asks again (doubling up to a read's
wait): the others with room take theirs within a few milliseconds, and one that stops asking leaves the ready set."""
HAND_OFF_WAIT_S = 1.0
"""How long a sync waits, after its `abort` pause, for the samples it ended to be published before it acks
(`Worker.handed_off`): each is one Redis write. (A sample that reached the engine as it paused waits for the resume.)"""


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
        streams.writer.dedupe_ttl_s = self.settings.dedupe_ttl_s
        self.metrics = metrics or WorkerMetrics(streams.keys.ns, self.name)
        """What only this process knows, for Prometheus (served by `rollouts worker --metrics-port`)."""
        self.failure: str | None = None
        """Why the worker stopped on its own (its engine died); None after a requested stop."""
        self.publisher = Publisher(streams.writer)
        """Publishes what finishes while another publish is on the wire in one round trip with it."""
        self.budget = TakeBudget(lambda: (self.max_inflight, self.max_inflight_tokens))
        """The samples and tokens it holds in flight, under its caps: how much more it takes."""
        self.state = ServingState(engine.version, self.budget)
        """What the worker is doing now (status, serving or paused, asleep, work in flight): what its heartbeat says."""
        self._inflight: Held = {}
        """Every entry it holds: started, held for room, or set aside to run apart or alone (`Suspects`)."""
        self._held: deque[Entry] = deque()
        """Entries taken but not started for want of room (a blocking read over three streams: `WorkReader.read_work`).
        They are in `_inflight` too, so they are touched every heartbeat and nobody claims them; they start first."""
        self._drain_on_stop = True
        self._tasks: set[asyncio.Task] = set()
        self._generating: set[asyncio.Task] = set()
        """The tasks of `_tasks` whose samples are on the engine, until they publish (`handed_off`)."""
        self._fleet = 1
        """Workers on the registry at the last heartbeat: how often this one claims and sweeps (`sweep_chance`)."""
        house = House(self.name, self.settings, streams, self._slot, self.state, self.metrics, self)
        """What every room shares (`consumers.house`)."""
        self.heartbeat = Heartbeat(house, self)
        self._adapters = WorkerAdapters(house, self.heartbeat.beat)
        """LoRA adapters: loaded on demand, evicted when idle, each paused alone for its own syncs."""
        self._sync = WorkerSync(house, self._adapters, self.heartbeat.beat, self.handed_off)
        """Its side of the weight-sync protocol: follows control, pauses, loads, sleeps, wakes, resumes, acks; and of
        joining from a peer, and sharing with joiners (`consumers.peer`)."""
        self.heartbeat.fields = lambda: self._adapters.heartbeat_fields() | self._sync.peer_fields()
        self._suspects = Suspects(house, self._inflight, self._start, self.budget)
        """Entries handed out again and again: run apart, then alone, then dead-lettered."""
        self._samples = SampleGenerator(house, self._adapters)
        """One sample on the engine, or the rest of one a pause interrupted."""
        self._generate_sample = self._samples.generate
        self._generate_rest = self._samples.rest
        self._keeper = EngineKeeper(house, self._sync, self._adapters, self.heartbeat.beat, self._inflight)
        """Starts the engine when work needs it, releases it when idle."""
        self._departure = Departure(house, self._tasks, self._samples.end_running)
        """Its stop notice, deadline and drain."""
        self._redis_loss = RedisLoss(house, self._inflight, self._tasks)
        """The way out once Redis is gone."""

    @property
    def engine(self) -> Engine:
        """The engine now: a fresh, unstarted one after a release (`consumers.lifecycle`)."""
        return self._slot.engine

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

    def stop(self, drain: bool = True, grace_s: float | None = None) -> None:
        """Ask the worker to stop taking work and, if `drain`, to let in-flight work finish for up to
        `drain_timeout_s`, then end what still runs and hand its samples, tokens so far, to `{ns}:partials`.

        `grace_s` (else the settings'): the notice's deadline; the worker exits within it (`WorkerSettings.grace_s`).
        A later notice may bring the deadline nearer, never further. Safe to call from a signal handler in the loop.
        Without `drain`, in-flight work is dropped here and stays pending in Redis, where the other workers claim it.
        """
        self._departure.notice(grace_s)
        self._drain_on_stop = self._drain_on_stop and drain
        self.state.stopping.set()
        self.budget.wake()
        self.state.set_serving(True)  # wake a paused read loop so that it sees the stop

    async def run(self) -> None:
        await asyncio.to_thread(self.streams.ensure_groups)
        await asyncio.to_thread(self.streams.work.join, self.name)
        began = time.monotonic()
        if self.settings.lazy:
            self.state.status = WorkerStatus.IDLE
        else:
            try:
                await self._slot.start()
            except Exception as exc:
                self._keeper.could_not_start(exc)
                await self._slot.shutdown()
                await asyncio.to_thread(self.streams.registry.forget_worker, self.name)
                return
        control_from = await self._sync.catch_up()
        if self._slot.started:
            self._keeper.started("launch", began)
        upkeep = asyncio.create_task(self._upkeep())
        control = asyncio.create_task(self._sync.follow_control(control_from))
        release = asyncio.create_task(self._keeper.release_when_idle())
        watch = asyncio.create_task(self._redis_loss.watch())
        notice = asyncio.create_task(self._departure.watch_notice_file())
        try:
            await self._take_up_leftovers()
            await self._read_loop()
            self.state.status = WorkerStatus.STOPPING
            await self._redis_loss.unless_gone(self.heartbeat.beat)
            if self._drain_on_stop:
                await self._redis_loss.unless_gone(self._hand_back_held)
                await self._sync.unfreeze()
                await self._departure.drain()
        finally:
            upkeep.cancel()
            control.cancel()
            release.cancel()
            watch.cancel()
            notice.cancel()
            for task in list(self._tasks):
                task.cancel()
            await self._slot.shutdown()
            await self.publisher.close()
            forget = self.streams.registry.forget_worker
            await self._redis_loss.unless_gone(lambda: asyncio.to_thread(forget, self.name))

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
                await self._keeper.ready()  # no engine (lazy, released): take no more until it serves what it holds
                continue
            if self.budget.full():
                await self.budget.changed()
                next_claim = 0.0  # room again: a dead worker's work, the oldest, goes before new work
                continue
            free = max(self.budget.free(), 1)  # nothing in flight: an entry larger than a cap runs alone
            if self._held:
                for _ in range(min(self.budget.entries_for(free), len(self._held))):
                    self._start(self._held.popleft())
                await asyncio.sleep(0)
                continue
            if await self._suspects.turn():  # one waits to run alone, or runs alone, or the next runs apart
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
                                turn_wait = min(2 * turn_wait, self.settings.read_block_ms / 1000)
                            continue  # the room left is less now
                except redis.ConnectionError as exc:
                    log.warning("%s: claiming abandoned work failed (%s); retrying", self.name, exc)
            count = self.budget.entries_for(free)
            try:
                began = time.monotonic()
                entries, others_turn = await asyncio.to_thread(self._take_work, count)
                if time.monotonic() - began > self.settings.read_block_ms / 1000 + STOOD_STILL_S:
                    await self._sync.obey_control()  # it stood still: an eviction or a sync meanwhile goes first
            except redis.ConnectionError as exc:  # Redis gone for longer than the client's reconnects: keep trying
                if self.state.redis_gone:  # stopping without it (`RedisLoss.lost` said so)
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
                turn_wait = min(2 * turn_wait, self.settings.read_block_ms / 1000)
                continue
            turn_wait = TURN_WAIT_S
            fits = max(count, self.budget.entries_for(self.budget.free()))  # its room may have grown during the read
            for entry in entries[fits:]:  # more than there was room for: taken now, started when there is room
                self._inflight[entry.stream, entry.id] = entry
                self._held.append(entry)
            # fakeredis (and a BLOCK that timed out) answer an empty read: just read again.
            for entry in entries[:fits]:
                self._start(entry)
            await asyncio.sleep(0)  # let them decode and count their samples before the room is measured again

    def _take_work(self, count: int) -> tuple[list[Entry], bool]:
        """In a thread: up to `count` entries, no more than this worker's share of what waits (`WorkReader.take`); when
        nothing waits, a blocking read for one entry (Redis wakes the worker that has waited longest), then the rest
        of its share of the burst it woke to that fits now (its room may have grown while it waited), in the same
        hand-off from the event loop and back, so that the burst starts together: the engine would otherwise start
        on the first entry alone and take the rest a step behind, out of step with it for the whole batch. (What the
        thread reads of the worker's state, counts and flags, it only reads.) Also says whether it took nothing
        because the work that waits is the other workers' turn."""
        held = len(self._inflight)
        entries, others_turn = self.streams.work.take(self.name, count, held, self.settings.take_horizon_ms)
        if entries or others_turn or self.state.stopping.is_set():
            return entries, others_turn
        entries = self.streams.work.read_work(self.name, 1, self.settings.read_block_ms)
        if not entries or self.budget.mean_n is None or self.state.stopping.is_set():
            return entries, False  # none came, or it cannot tell what more would fit
        room = self.budget.entries_for(self.budget.free()) - len(entries)
        if room <= 0:
            return entries, False
        try:
            more, _ = self.streams.work.take(self.name, room, held + len(entries), self.settings.take_horizon_ms)
        except redis.ConnectionError as exc:
            log.warning("%s: reading more work failed (%s); serving what was read", self.name, exc)
            more = []
        return entries + more, False

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
                    untouched_samples = [done or untouched(prompt, k) for k, done in samples]
                    await self.publisher.publish([], entry, untouched_samples, prompt.reply_to)
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
        self.budget.taken()
        task = asyncio.create_task(self._serve(entry))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- serving one entry --------------------------------------------------------------------

    async def _serve(self, entry: Entry) -> None:
        """Generate what one entry asks for and publish it with the entry's ack, in one atomic step.

        A prompt entry asks for its `n` samples; a partial entry for the rest of one sample. Samples that an abort
        pause interrupts are continued here after the resume, or go to `{ns}:partials` in the same step if the worker
        hands them off (`hand_off_partials`) or stops. However it ends,
        the entry stops being held here (`_start` took it); if it was not acked, it stays pending.
        """
        counted = tokens = 0
        self.budget.starting()
        try:
            decoded = await self._decode(entry)
            if decoded is None:
                return
            prompt, samples = decoded
            size = min(len(prompt.tokens) + prompt.sampling.max_tokens, self.engine.max_model_len)
            self.budget.seen(len(samples), size)
            if not await self.budget.wait_for_room(len(samples), len(samples) * size, self.state.stopping):
                return
            counted, tokens = len(samples), len(samples) * size
            self.budget.add(counted, tokens)
            self.state.account()
            await self._generate_and_publish(entry, prompt, samples)
        finally:
            del self._inflight[entry.stream, entry.id]
            self.budget.remove(counted, tokens)
            self._slot.last_work = time.monotonic()
            self.state.account()

    async def _generate_and_publish(
        self, entry: Entry, prompt: Prompt, samples: list[tuple[int, Partial | None]]
    ) -> None:
        task = asyncio.current_task()
        try:
            if not await self._keeper.ready():
                return  # the engine could not start: the worker stops and the entry stays pending
            if task is not None:
                self._generating.add(task)
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
        finally:
            if task is not None:
                self._generating.discard(task)

    async def handed_off(self) -> None:
        """After an `abort` pause: wait until the entries whose samples were on the engine have published what it
        ended (to `{ns}:partials`, where this worker hands them off), up to `HAND_OFF_WAIT_S`. The ack that follows
        then says how many entries it still holds: the others' shares at the resume count it by that, not by what it
        held before the pause."""
        generating = list(self._generating)
        if generating:
            await asyncio.wait(generating, timeout=HAND_OFF_WAIT_S)

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
                        await asyncio.to_thread(trim_consumed, self.streams.redis, stream)
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
        if self.state.stopping.is_set() or self.state.asleep or self.budget.waiting or self._held:
            return 0
        if self._suspects.alone:
            return 0
        if self._inflight and not self._slot.ready:
            return 0
        return self.budget.entries_to_take()

    # -- claims: a dead worker's work, leftovers of an earlier process, entries that ran apart or alone ------

    async def _claim_abandoned(self) -> tuple[int, bool]:
        """Take over a dead or hung worker's work (`WorkReader.claim_abandoned`) while there is room, its share of it;
        returns how many entries it claimed, and whether such work waits that is another worker's turn."""
        free = self.budget.free()
        if free <= 0 or not self.state.serving.is_set():
            return 0, False
        count = self.budget.entries_for(free)
        quick_ms = int(self.settings.heartbeat_s * 1000)  # a silent worker's entries idle a beat: none it just took
        claimed, others_turn = await asyncio.to_thread(
            self.streams.work.claim_abandoned,
            self.name,
            self.settings.claim_idle_ms,
            count,
            quick_ms,
            self.settings.take_horizon_ms,
            len(self._inflight),
        )
        for entry in claimed:
            if (entry.stream, entry.id) in self._inflight:
                continue  # ours already (we stalled past the idle limit): keep serving it once
            if await self._suspects.check(entry):
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
            entries = await asyncio.to_thread(self.streams.work.leftovers, self.name, LEFTOVERS_MAX)
        except redis.ConnectionError as exc:
            log.warning("%s: reading what an earlier process of its name left failed (%s)", self.name, exc)
            return
        if entries:
            log.info("%s: taking up %d entries an earlier process of its name left pending", self.name, len(entries))
        for entry in entries:
            if not await self._suspects.check(entry):
                self._inflight[entry.stream, entry.id] = entry
                self._held.append(entry)


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
