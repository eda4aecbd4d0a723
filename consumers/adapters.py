"""A worker's LoRA adapters: loaded on demand, evicted when idle, paused one at a time for their own syncs.

A prompt that names an adapter is served under that adapter's current version. The worker does not know its
adapters in advance: the first request for one reads its state (`{ns}:adapter:NAME:state`), fetches that version
from the transport and loads it into the engine; with every one of the engine's `max_loras` slots taken, the
least recently used adapter that no request is using makes room (a request waits for a slot rather than fail).
A request never runs under an adapter that is not loaded, or under another one: it holds its adapter from before
the load until its generation ends, so the adapter cannot be evicted under it.

Each adapter syncs on its own (`staleness.manager.Manager(adapter=...)`): its `weights` command closes its gate
(fresh requests for it wait), pauses only its requests in the engine (abort: they end with their tokens so far and
go on after its resume, since the worker's continuations wait at the gate too; keep: they freeze), loads the new
version if the adapter is loaded here (one that is not is loaded at the new version when next needed) and acks with
`epoch@NAME` in the heartbeat; its `resume` opens the gate. Every other adapter and the base model go on
generating meanwhile.

A worker that stops waits for no adapter: a request waiting for one (at its gate, for a slot, for a pushed
version) ends with `Stopping`, and `unfreeze` ends the requests a `keep` sync froze, so that their samples go on
elsewhere from their tokens so far, not after the worker's drain timeout.

An adapter published by a transport that pushes and stores nothing (`nccl://`) is nowhere to fetch later: every live
worker joins its push (before it pauses the adapter, as for the base model) and keeps a CPU copy of the version it
received, from which it loads the adapter on demand. A worker that started after that push has no copy: its requests
for the adapter wait for the adapter's next sync. Which way an adapter's version comes is its transport's to say
(`Transport.stores`, `Transport.pushes`), never its scheme.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from consumers.engines.base import EngineInputError
from consumers.house import House
from pipeline.wire import Control, PauseMode, ack_field
from staleness.state import adapter_names, read_state, weights_command
from staleness.weights import Joined, fetch_adapter, import_transport, join_pushed, receive_adapter, transport_of

log = logging.getLogger(__name__)

SYNC_POLL_S = 0.05
"""How often a request for an adapter whose sync is under way (found in its state) looks again."""


class NotHere(LookupError):
    """The adapter's version was pushed (nccl) before this worker could receive it: wait for its next sync."""


class Stopping(Exception):
    """The worker stops while a request waits for its adapter here: the request goes on elsewhere."""


class WorkerAdapters:
    """The adapters of one worker's engine: gates, per-adapter epochs, on-demand loads and evictions."""

    def __init__(self, house: House, ack: Callable[[], Awaitable[object]]) -> None:
        self.streams, self.engine, self.worker = house.streams, house.slot.engine, house.name
        self.metrics = house.metrics
        self._ack = ack
        """Writes the heartbeat (which carries `epoch@NAME`): the ack of an adapter's sync."""
        self._stopping = house.state.stopping
        """The worker's: set when it stops, after which no request waits for an adapter (`Stopping`)."""
        self._epochs: dict[str, int] = {}
        """The last sync epoch acked, per adapter."""
        self._gates: dict[str, asyncio.Event] = {}
        """Set while an adapter may generate; cleared from its `weights` command to its `resume`."""
        self._users: Counter[str] = Counter()
        """Requests holding each adapter (waiting for it, or generating under it): never evicted while held."""
        self._last_used: dict[str, float] = {}
        self._lock = asyncio.Lock()
        """One load, eviction or sync at a time: a sync never races a load of the same adapter."""
        self._freed = asyncio.Event()
        """Set when an adapter's last user lets go: a request waiting for a slot looks again."""
        self._paused_at: dict[str, float] = {}
        """When each adapter's current sync paused it here (monotonic), for its stall."""
        self._frozen: set[str] = set()
        """Adapters whose requests the engine holds frozen (paused `keep` or `inflight`) until their resume."""
        self._received: dict[str, tuple[int, dict[str, Any], dict[str, Any]]] = {}
        """Per adapter, the last version received from a push (nccl): version, CPU tensors, config."""
        self._arrived: dict[str, asyncio.Event] = {}
        """Set when a pushed version of an adapter arrives: requests that had nothing to load look again."""

    def _gate(self, adapter: str) -> asyncio.Event:
        gate = self._gates.get(adapter)
        if gate is None:
            gate = self._gates[adapter] = asyncio.Event()
            gate.set()
        return gate

    @asynccontextmanager
    async def using(self, adapter: str) -> AsyncIterator[int]:
        """Hold `adapter` loaded and unpaused for one request; yields the version it is loaded at."""
        self._users[adapter] += 1
        try:
            yield await self._ready(adapter)
        finally:
            self._users[adapter] -= 1
            self._last_used[adapter] = time.monotonic()
            if self._users[adapter] <= 0:
                del self._users[adapter]
                self._freed.set()

    async def _ready(self, adapter: str) -> int:
        """Wait until `adapter` may generate here, loading it (and making room for it) when it is not loaded.

        Raises `Stopping` where it would wait once the worker stops."""
        while True:
            await self._wait(self._gate(adapter))
            loaded = self.engine.adapters()
            if adapter in loaded:
                return loaded[adapter]
            async with self._lock:
                if adapter in self.engine.adapters() or not self._gate(adapter).is_set():
                    continue  # loaded, or its sync began, while this request waited for the lock
                state = await asyncio.to_thread(read_state, self.streams.redis, self.streams.keys, adapter)
                if state.paused:  # a sync of it is under way, begun before this worker followed control
                    arrived = None
                elif not state.weights_uri:
                    raise EngineInputError(
                        f"adapter {adapter!r} was never published in namespace {self.streams.keys.ns!r} "
                        f"(publish_weights(tensors, adapter={adapter!r}, adapter_config=...) first)"
                    )
                elif self.engine.max_loras < 1:
                    raise EngineInputError(
                        f"the {self.engine.name} engine of worker {self.worker} serves no LoRA adapters "
                        "(start it with --max-loras N)"
                    )
                elif await self._make_room():
                    try:
                        await self._load(adapter, state.weights_uri, state.version)
                    except NotHere:
                        arrived = self._arrived.setdefault(adapter, asyncio.Event())
                        arrived.clear()
                    else:
                        self.metrics.adapter_loaded("demand")
                        return state.version
                else:
                    self._freed.clear()
                    arrived = self._freed
            if arrived is None:  # outside the lock: the sync under way may need it to ack
                await self._wait(None, SYNC_POLL_S)
            else:  # a free slot (every one was in use), or a version to load (one was pushed)
                await self._wait(arrived)

    async def _wait(self, event: asyncio.Event | None, timeout: float | None = None) -> None:
        """Until `event` is set (None: none) or `timeout` passes; `Stopping` if the worker stops first, or has."""
        if event is not None and event.is_set():
            return
        waits = [asyncio.ensure_future(self._stopping.wait())]
        if event is not None:
            waits.append(asyncio.ensure_future(event.wait()))
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        if self._stopping.is_set() and not (event is not None and event.is_set()):
            raise Stopping(f"worker {self.worker} stops")

    async def _make_room(self) -> bool:
        """Evict the least recently used idle adapter if every slot is taken; False if none is idle."""
        loaded = self.engine.adapters()
        if len(loaded) < self.engine.max_loras:
            return True
        idle = [name for name in loaded if self._users[name] == 0]
        if not idle:
            return False
        victim = min(idle, key=lambda name: self._last_used.get(name, 0.0))
        await self.engine.remove_adapter(victim)
        self.metrics.adapter_evicted()
        log.info("%s: evicted adapter %s to make room", self.worker, victim)
        return True

    async def _load(self, adapter: str, uri: str, version: int) -> None:
        """Fetch (or take the copy of a push) and load; any failure is the request's error (a rollout with
        `finish_reason=error`), but `NotHere`: a pushed version this worker never received."""
        await import_transport(uri)
        try:
            if transport_of(uri).stores:
                tensors, config = await asyncio.to_thread(fetch_adapter, uri, version, self.streams.redis)
            else:
                received = self._received.get(adapter)
                if received is None or received[0] != version:
                    raise NotHere(adapter)
                _, tensors, config = received
            await self.engine.load_adapter(adapter, tensors, config, version)
        except NotHere:
            raise
        except Exception as exc:
            raise EngineInputError(f"could not load adapter {adapter!r} version {version} from {uri}: {exc}") from None
        log.info("%s: loaded adapter %s version %d", self.worker, adapter, version)

    # -- the worker's side of one adapter's sync ---------------------------------------------------

    async def obey(self, command: Control) -> None:
        """A `weights` or `resume` command of one adapter (`command.adapter`)."""
        adapter = command.adapter
        if command.cmd == "weights" and command.epoch > self._epochs.get(adapter, 0):
            await self._sync(command)
        elif command.cmd == "resume" and command.epoch >= self._epochs.get(adapter, 0):
            await self.engine.resume_adapter(adapter)
            self._frozen.discard(adapter)
            self._gate(adapter).set()
            paused = self._paused_at.pop(adapter, None)
            if paused is not None:
                self.metrics.adapter_resumed(time.monotonic() - paused)

    async def _sync(self, command: Control, join: bool = True) -> None:
        """Join its push (a transport that pushes: nccl), close the gate, pause the adapter's requests, receive the
        push, load the new version if the adapter is loaded here, ack.

        A version that cannot be loaded leaves the adapter unloaded (its requests aborted: they go on after the resume):
        the next request for it loads the state's version again, or becomes an error rollout that says why. The
        worker acks either way; one tenant's bad adapter stops no worker. `join=False`: a sync found under way at
        start, whose push this worker is too late to join."""
        adapter = command.adapter
        joined: Joined | None = None
        if join and transport_of(command.uri).pushes:
            try:  # while the adapter still generates: the wait for the other workers is not its stall
                joined = await join_pushed(command.uri, command.version, command.epoch, member=self.worker)
            except Exception as exc:
                log.error("%s: could not join the push of adapter %s: %s", self.worker, adapter, exc)
        self._gate(adapter).clear()
        self._paused_at[adapter] = time.monotonic()
        async with self._lock:
            mode: PauseMode = "abort" if self._stopping.is_set() else command.mode  # a stopping worker freezes nothing
            await self.engine.pause_adapter(adapter, mode)
            if mode != "abort":
                self._frozen.add(adapter)
            if joined is not None:
                try:
                    self._received[adapter] = (command.version, *await receive_adapter(joined, command.version))
                    self._arrived.setdefault(adapter, asyncio.Event()).set()
                except Exception as exc:
                    log.error("%s: could not receive adapter %s: %s", self.worker, adapter, exc)
            loaded = self.engine.adapters()
            if adapter in loaded and loaded[adapter] != command.version:
                try:
                    await self._load(adapter, command.uri, command.version)
                    self.metrics.adapter_loaded("sync")
                except (EngineInputError, NotHere) as exc:
                    log.error("%s: %s; unloading it", self.worker, exc)
                    await self.engine.pause_adapter(adapter, "abort")  # kept requests end, and go on after the resume
                    self._frozen.discard(adapter)
                    await self.engine.remove_adapter(adapter)
            self._epochs[adapter] = command.epoch
        await self._ack()

    async def unfreeze(self) -> None:
        """A stop: the requests of every adapter held frozen by its sync end with their tokens so far (no resume will
        reach them now); the worker hands their samples on. A sync under way here finishes first."""
        async with self._lock:
            for adapter in sorted(self._frozen):
                await self.engine.pause_adapter(adapter, "abort")
            self._frozen.clear()

    async def catch_up(self) -> None:
        """At start: take part in every adapter sync under way (ack it; the gate stays closed until its resume)."""
        for adapter in await asyncio.to_thread(adapter_names, self.streams.redis, self.streams.keys):
            state = await asyncio.to_thread(read_state, self.streams.redis, self.streams.keys, adapter)
            if not state.paused:
                continue
            command = await asyncio.to_thread(
                weights_command, self.streams.redis, self.streams.keys, state.epoch, adapter=adapter
            )
            if command is not None:
                await self._sync(command, join=False)

    def heartbeat_fields(self) -> dict[str, object]:
        """`epoch@NAME` per adapter synced (the acks) and `adapters`: the loaded ones, `name=version,...`."""
        fields: dict[str, object] = {ack_field(name): epoch for name, epoch in self._epochs.items()}
        fields["adapters"] = ",".join(f"{name}={version}" for name, version in sorted(self.engine.adapters().items()))
        return fields
