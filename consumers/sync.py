"""The worker's side of the staleness manager's protocol (`staleness.manager`): weight syncs, sleeps and resumes.

`WorkerSync` follows `{ns}:control` and obeys it: a `weights` command pauses the engine (`abort`, `keep` or
`inflight`), loads the new version and acks with the sync's epoch in the heartbeat; a `sleep` pauses it and puts it to
sleep (a colocated trainer's step), acked the same way; the manager's `resume` wakes it and lets it generate again;
`stop` stops the worker. An adapter's `weights` and `resume` go to `WorkerAdapters`, which pauses that adapter alone.
A worker that starts catches up first: it loads the state's version, or does its part of the sync or sleep under way.

It talks to the rest of the worker through narrow interfaces: the engine through its `EngineSlot` (whose lock makes
a sync wait for a start or release under way), what the worker is doing through its `ServingState` (it clears
`serving` for a pause and sets it at the resume), the ack through the heartbeat's write (`ack`), and the worker
itself only to stop it (`consumers.house.Stoppable`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from consumers.adapters import WorkerAdapters
from consumers.engines.base import WAKE_ALL, Engine, SleepNotSupported, WakePart
from consumers.house import House
from consumers.lifecycle import WorkerStatus, receive_copy
from consumers.peer import PeerJoin, PeerShare
from pipeline.control import CONTROL_BATCH, CONTROL_RECHECK_S
from pipeline.streams import Entry
from pipeline.wire import Control, PauseMode, WireError
from staleness.state import read_state, weights_command
from staleness.weights import Incoming, begin_load, import_transport, load_version, transport_of
from staleness.weights.delta import HeldWeights

log = logging.getLogger(__name__)
T = TypeVar("T")

SYNC_WAIT_S = 60.0
"""How long a worker that joined from a peer waits for a sync under way to end before it looks at the state again."""


AWAITING_WEIGHTS = WorkerStatus.AWAITING_WEIGHTS
"""Heartbeat status of a worker that joined after a sync whose transport pushes (nccl) and stores nothing: it takes no
work until the next."""


class WorkerSync:
    """One worker's side of the sync protocol: follows control, pauses, loads, sleeps, wakes, resumes and acks."""

    def __init__(
        self,
        house: House,
        adapters: WorkerAdapters,
        ack: Callable[[], Awaitable[object]],
        handed_off: Callable[[], Awaitable[None]],
    ) -> None:
        self.streams, self.name, self.metrics = house.streams, house.name, house.metrics
        self._slot, self._state, self._worker = house.slot, house.state, house.worker
        self.held = HeldWeights()
        """The last version fetched whole or by delta, where the trainer sends deltas: the base of the next."""
        self._adapters = adapters
        self._ack = ack
        """Writes the heartbeat, which carries `epoch` and `version`: the ack of a sync or a sleep."""
        self._handed_off = handed_off
        self._hand_off = house.settings.hand_off_partials
        """Waits, after an `abort` pause, until what it ended is published: the ack then says what the worker holds."""
        self._heartbeat_s = house.settings.heartbeat_s
        """How long a failed read of control waits before it is tried again."""
        self._block_ms = house.settings.block_ms
        """How long a wait for this worker's bell lasts before control is looked at again."""
        self._sync_began = 0.0
        """When the pause for the current weight sync began (monotonic), for the stall until its resume."""
        self._sleeping: set[WakePart] = set()
        """The parts of the engine's sleep not woken yet (`_wake`)."""
        self._frozen = False
        """Its engine holds requests frozen (a `keep` or `inflight` pause, a sync's or a sleep's) until the resume."""
        self.loaded_from = ""
        """Where the engine's version came from ("": the model directory), to tell whether a release may lose it."""
        self._join_from = house.settings.join_from
        self.share = PeerShare(house)
        """Its side as a peer: sends the version it holds to workers that join mid-run (`consumers.peer`)."""
        self.join = PeerJoin(house)
        """Its side as a joiner: the current version from a peer, at its launch."""
        self._after = b"0-0"
        """The id of the last control entry obeyed."""
        self._obeying = asyncio.Lock()
        """One read-and-obey of control at a time: the follower's, or a read loop's after it stood still."""

    @property
    def engine(self) -> Engine:
        return self._slot.engine

    async def catch_up(self) -> bytes:
        """Before taking work: load the state's version, or join the sync under way. Returns where to follow control.

        A version that was pushed (nccl) is nowhere to fetch: the worker then waits, taking no work,
        for the next sync. Without an engine (`lazy`) nothing loads yet (`load_current`).
        """
        control_from = await asyncio.to_thread(self.streams.control.last_id)
        await self._adapters.catch_up()  # adapters sync on their own: ack any sync of one under way
        began = time.monotonic()
        async with self._slot.lock:
            await self.load_current(joining=True)
            self._slot.ready = self._slot.started
        self.join.join_s = time.monotonic() - began
        return control_from

    def peer_fields(self) -> dict[str, object]:
        """Its heartbeat's fields as a peer and as a joiner (`consumers.peer`)."""
        return self.share.heartbeat_fields() | self.join.heartbeat_fields()

    async def load_current(self, joining: bool = False) -> None:
        """Bring a started engine to the state's version, or do this worker's part of the sync or sleep under way.

        Without an engine nothing loads: the worker takes work, whose arrival starts the engine and comes back here,
        unless the version could not be loaded then (pushed before this worker could receive it): then it
        awaits the next sync. A worker that joins a sleeping fleet sleeps with it (a colocated trainer's step is under
        way), its engine at the fleet's version, until the sync or wake that ends the sleep. `joining`: its launch,
        whose version comes from a peer first where `join_from` allows (`consumers.peer`), then from the store, else
        with the next sync; a version published meanwhile is loaded too before it serves. The caller holds the
        slot's lock."""
        state = await asyncio.to_thread(read_state, self.streams.redis, self.streams.keys)
        command = None
        if state.paused:  # a sync or a sleep is under way: do our part of it, then wait for its resume
            command = await asyncio.to_thread(
                weights_command, self.streams.redis, self.streams.keys, state.epoch, cmds=("weights", "sleep")
            )
        for named in {state.weights_uri, command.uri if command is not None else ""} - {""}:
            await import_transport(named)
        if command is not None and command.cmd == "weights":
            if self.loadable(command.version, command.uri):
                await self._sync_weights(command)
            else:
                self._await_next_sync(command.version)
            return
        if state.version != self.engine.version and state.weights_uri:
            if joining and self._slot.started and self._join_from in ("auto", "peer"):
                uri = await self.join.load(state.version)
                if uri is not None:  # where a release may get it back: the store, if it keeps that version
                    stored = self.engine.version == state.version and transport_of(state.weights_uri).stores
                    self._loaded(state.weights_uri if stored else uri, self.engine.version)
                    await self._sync_ended()
                    await self.load_current(joining=True)  # a version published while it joined: that one too
                    return
            if not self.loadable(state.version, state.weights_uri) or (joining and self._join_from in ("peer", "sync")):
                self._await_next_sync(state.version)
                if joining:
                    self.join.source = "sync"
                return
            if self._slot.started:
                await self._load(state.weights_uri, state.version)
                if joining:
                    self.join.source = "store"
        self._state.unstarted_version = state.version
        if command is not None:  # the fleet's sleep, which this worker joins at the fleet's version
            self._state.status = self._unstarted()  # until `_sleep` pauses a started engine
            await self._sleep(command)
            return
        self._state.epoch = state.epoch
        self._state.status = WorkerStatus.SERVING if self._slot.started else self._unstarted()
        self._state.set_serving(True)

    async def _sync_ended(self) -> None:
        """After a join from a peer: wait (up to `SYNC_WAIT_S`) for a sync under way to end. It counts only the workers
        that beat, which a joiner does not yet: its push would not wait for it, so the joiner takes its version after
        it, from a peer or the store."""
        deadline = time.monotonic() + SYNC_WAIT_S
        while time.monotonic() < deadline:
            state = await asyncio.to_thread(read_state, self.streams.redis, self.streams.keys)
            command = None
            if state.paused:
                command = await asyncio.to_thread(
                    weights_command, self.streams.redis, self.streams.keys, state.epoch, cmds=("weights",)
                )
            if command is None or not transport_of(command.uri).pushes:
                return
            await asyncio.sleep(self._heartbeat_s / 4)

    def loadable(self, version: int, uri: str) -> bool:
        """Whether `version` can be loaded now or at a later start: its transport stores it, or a copy of it pushed is
        held."""
        return not uri or transport_of(uri).stores or self._slot.copy_of(version) is not None

    async def _load(self, uri: str, version: int) -> None:
        """Load `version` into the started engine: from the CPU copy of a push if one is held, else fetched."""
        copy = self._slot.copy_of(version)
        if copy is not None:
            await self.engine.load_tensors(copy.tensors, version)
        else:
            await load_version(self.engine, uri, version, self.streams.redis, held=self.held)
        self._loaded(uri, version)

    def _loaded(self, uri: str, version: int) -> None:
        self.loaded_from = uri
        if self._slot.copy_of(version) is None:
            self._slot.received = None  # an older version's copy: no start will want it

    def _unstarted(self) -> WorkerStatus:
        """The status of a worker without an engine: never started, or released."""
        return WorkerStatus.RELEASED if self._slot.starts else WorkerStatus.IDLE

    def _await_next_sync(self, version: int) -> None:
        self._state.status = AWAITING_WEIGHTS
        log.info("%s: version %d was pushed before this worker joined; waiting for the next sync", self.name, version)

    # -- following control --------------------------------------------------------------------

    async def follow_control(self, after: bytes) -> None:
        """Obey the commands on `control` after `after`: read when this worker's bell rings (`ControlStream.ring`), and
        at least every `CONTROL_RECHECK_S` besides. Blocking on the bell, not on `control`, lets a manager wake a fleet
        in waves: 1,000 workers blocked on `control` would all be served in the same instant by Redis."""
        self._after = after
        bell: bytes | None = None
        read, read_at = True, 0.0
        while not self._state.stopping.is_set():
            if bell is None:  # where the bell stood before the first read: a ring after it is not missed
                bell = await self._control_call(self.streams.control.bell_id, self.name)
                continue
            if read:
                count = await self.obey_control()
                if count is None:
                    continue
                read_at = time.monotonic()
                if count >= CONTROL_BATCH:
                    continue  # there may be more: read again before waiting
            rang = await self._control_call(self.streams.control.wait_for_bell, self.name, bell, self._block_ms)
            read = rang is None or rang != bell or time.monotonic() - read_at >= CONTROL_RECHECK_S
            bell = rang or bell

    async def obey_control(self) -> int | None:
        """Read `control` past the last entry obeyed and obey what is there; returns how many entries came (None: the
        read failed). The follower's read, and a read loop's whose read stood still (a process stopped, or starved):
        the stop or the sync that came meanwhile goes before the work that read brought."""
        async with self._obeying:
            entries = await self._control_call(self.streams.control.read, self._after, None)
            if entries:
                self._after = await self._obey_entries(entries, self._after)
            return None if entries is None else len(entries)

    async def _control_call(self, call: Callable[..., T], *args: object) -> T | None:
        """One Redis call of the control loop, on a thread; a failure is logged and answered with None after a
        heartbeat period (the loop then tries again)."""
        try:
            return await asyncio.to_thread(call, *args)
        except Exception:
            if self._state.redis_gone:  # stopping without it: nothing to retry
                return None
            log.exception("%s: reading control failed; retrying", self.name)
            await asyncio.sleep(self._heartbeat_s)
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
        if command.cmd == "weights":
            await import_transport(command.uri)
        if command.adapter and command.cmd in ("weights", "resume"):
            await self._adapters.obey(command)  # one adapter's sync: nothing else pauses
        elif command.cmd in ("weights", "resume"):
            async with self._slot.lock:  # not while the engine starts (and loads) or stops
                if command.cmd == "weights" and command.epoch > self._state.epoch:
                    await self._sync_weights(command)
                elif command.cmd == "resume" and command.epoch >= self._state.epoch:
                    await self._resume()
        elif command.cmd == "sleep":
            async with self._slot.lock:
                if command.epoch > self._state.epoch:
                    await self._sleep(command)
        elif command.cmd == "share" and command.worker == self.name and command.joiner:
            self.share.request(command.joiner, command.joiner_gpu)  # served on a task of its own: control goes on
        elif command.cmd == "drain" and command.worker in ("", self.name):
            log.info("%s: asked to drain", self.name)
            self._worker.stop(drain=True, grace_s=command.grace_s or None)  # `rollouts drain`: a planned departure
        elif command.cmd == "stop" and command.worker in ("", self.name):
            if command.worker:
                self._worker.failure = "evicted by the manager (no ack of a weight sync in time)"
            self._worker.stop(drain=not command.worker)

    # -- pause, sleep, wake, resume -----------------------------------------------------------

    async def _settled(self) -> None:
        """Before an ack: after an `abort` pause of a worker that hands its samples off, the samples it ended are
        published, so that the ack's heartbeat says what this worker holds at the resume. (One that continues them
        holds them until the resume, as its ack says.)"""
        if not self._frozen and (self._hand_off or self._state.stopping.is_set()):
            await self._handed_off()

    async def _pause(self, mode: PauseMode) -> None:
        """Pause the engine for a sync or a sleep (`mode`; `abort` once the worker stops: it freezes nothing then),
        noting whether it now holds requests frozen."""
        mode = "abort" if self._state.stopping.is_set() else mode
        await self.engine.pause(mode)
        self._frozen = mode != "abort"

    async def unfreeze(self) -> None:
        """A stop while its engine holds requests frozen (a `keep` sleep or sync, of the base model or of an adapter):
        the resume that would go on with them may be long in coming (a trainer's step, a held sync), so they end here
        with their tokens so far, and their samples go to `{ns}:partials` with their entries' acks
        (`SampleGenerator.generate`) for another worker to continue. Under the slot's lock: a load under way finishes
        first."""
        async with self._slot.lock:
            if not self._slot.started:
                return  # released (or never started): it holds no request
            if self._frozen:
                await self.engine.pause("abort")
                self._frozen = False
            await self._adapters.unfreeze()

    async def _resume(self) -> None:
        """The manager's resume after a sync: generate again (without an engine: take work again)."""
        if self._state.serving.is_set() or self._state.status == AWAITING_WEIGHTS:
            return
        if self._slot.started:
            try:
                await self._wake()  # after a sleep, the KV cache: the largest allocation, and after the ack
                await self.engine.resume()
                self._frozen = False
            except Exception as exc:  # acked, but it cannot go on
                self._give_up(f"could not wake or resume its engine after sync {self._state.epoch}: {exc}")
                return
            self._state.status = WorkerStatus.SERVING
        self._state.set_serving(True)
        self._state.last_stall_s = time.monotonic() - self._sync_began
        self.metrics.resumed(self._state.last_stall_s)
        await self._ack()

    async def _sleep(self, command: Control) -> None:
        """Pause (`command.mode`), put the engine to sleep at `command.level` and ack; stay paused until a sync (which
        wakes it before it loads) or the manager's resume. An engine that cannot sleep (`SleepNotSupported`) stays
        paused, awake, and acks all the same, its heartbeat's `asleep` 0: the trainer's report names it. Without an
        engine there is nothing to free: it acks at once. The caller holds the slot's lock."""
        self._state.set_serving(False)
        self._sync_began = time.monotonic()
        if self._slot.started:
            self._state.status = WorkerStatus.PAUSED
            await self._pause(command.mode)
            try:
                await self.engine.sleep(command.level)
                self._state.asleep, self._sleeping = command.level, set(WAKE_ALL)
                self._state.status = WorkerStatus.ASLEEP
            except SleepNotSupported as exc:
                log.error("%s: paused for a sleep, but its engine cannot sleep: %s", self.name, exc)
            await self._settled()
        self._state.epoch = command.epoch
        await self._ack()
        log.info("%s: asleep at level %d (epoch %d) in %.3f s", self.name, self._state.asleep, command.epoch,
                 time.monotonic() - self._sync_began)  # fmt: skip

    async def _wake(self, parts: Sequence[WakePart] = WAKE_ALL) -> None:
        """Take back what the engine's sleep freed: its weights before a load, everything at the resume that ends a
        sleep (so that a load runs without the KV cache in memory: vLLM's staged wake)."""
        waking = [part for part in WAKE_ALL if part in parts and part in self._sleeping]
        if waking:
            await self.engine.wake_up(waking)
            self._sleeping.difference_update(waking)
        if not self._sleeping:
            self._state.asleep = 0

    # -- weight syncs -------------------------------------------------------------------------

    async def _sync_weights(self, command: Control) -> None:
        """Pause, load `command.version`, ack with the epoch; stay paused until the manager's resume.

        What need not stop generation is done first, as the version's transport says (`begin_load`): a push (nccl) is
        joined, so that the wait for the other workers to join and a new group's setup are not time this worker stands
        still, and it pauses only to receive; a version fetched ahead (redis) is fetched and checked, and paused, the
        worker only copies it into the model. A version that cannot be loaded stops the worker (exit 1, for a
        supervisor to restart it): it must not serve the old one as the new, and its work goes to the others. The
        caller holds the slot's lock.
        """
        if not self._slot.started:
            await self._sync_unstarted(command)
            return
        if transport_of(command.uri).pushes:
            self._slot.pushed_uris.add(command.uri)
        incoming: Incoming | None = None
        fetch_began = time.monotonic()
        if command.version != self.engine.version and self._slot.copy_of(command.version) is None:
            try:
                incoming = await begin_load(self.engine, command.uri, command.version, self.streams.redis,
                                            epoch=command.epoch, member=self.name, held=self.held)  # fmt: skip
            except Exception as exc:
                self._cannot_load(command, exc)
                return
        self._state.set_serving(False)
        self._state.status = WorkerStatus.PAUSED
        started = self._sync_began = time.monotonic()
        fetch_s = started - fetch_began
        await self._pause(command.mode)
        await self._wake(("weights",))  # the weights' memory back before the load fills it; the cache's at the resume
        paused = time.monotonic()
        if command.version != self.engine.version:
            try:
                if incoming is not None:
                    await incoming.load(self.engine)
                    self._loaded(command.uri, command.version)
                else:
                    await self._load(command.uri, command.version)
            except Exception as exc:
                self._cannot_load(command, exc)
                return
        await self._settled()  # (the load went on meanwhile)
        self._state.epoch = command.epoch
        await self._ack()  # the ack: `epoch` and `version` in the heartbeat
        self.metrics.synced(paused - started, time.monotonic() - paused)
        log.info(
            "%s: sync %d: fetched or joined in %.3f s, paused in %.3f s, version %d loaded and acked in %.3f s",
            self.name, command.epoch, fetch_s, paused - started, command.version, time.monotonic() - paused,
        )  # fmt: skip

    async def _sync_unstarted(self, command: Control) -> None:
        """A sync while there is no engine: nothing to pause or load, so ack at once (no trainer waits for a cold
        start). A stored version is loaded from the state when the engine starts; a pushed one is received now
        into a CPU copy, to load then. A worker that cannot receive it awaits the next sync (it takes no work)."""
        self._state.set_serving(False)  # as every worker, it takes no work until the resume
        self._sync_began = time.monotonic()
        if not transport_of(command.uri).stores:
            self._slot.pushed_uris.add(command.uri)
            try:
                self._slot.received = await receive_copy(command.uri, command.version, command.epoch, self.name)
                self._state.status = self._unstarted()
            except Exception as exc:
                log.error("%s: could not receive version %d from %s: %s", self.name, command.version, command.uri, exc)
                self._slot.received = None
                self._state.status = AWAITING_WEIGHTS
        self._state.epoch, self._state.unstarted_version = command.epoch, command.version
        await self._ack()
        log.info("%s: sync %d acked without an engine: version %d loads when it starts", self.name, command.epoch,
                 command.version)  # fmt: skip

    def _cannot_load(self, command: Control, exc: Exception) -> None:
        self._give_up(f"could not load weights version {command.version} from {command.uri}: {exc}")

    def _give_up(self, failure: str) -> None:
        """Stop now (exit 1, for a supervisor to restart it), saying why: its work goes to the others."""
        log.error("%s: %s", self.name, failure)
        self._worker.failure = failure
        self._worker.stop(drain=False)
