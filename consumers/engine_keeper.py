"""The worker's engine over its life: started on demand, released when idle (`consumers.lifecycle` says why).

`EngineKeeper` starts the engine the first time work needs it (a `--lazy` worker, or one whose engine was released)
and brings it to the current version (`WorkerSync.load_current`), says why an engine could not start (the worker then
stops, its work pending for the others), and with `release_after_s` shuts down an engine that served nothing for that
long. The slot (`EngineSlot`) holds the engine; the keeper decides when it starts and goes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sized

from consumers.adapters import WorkerAdapters
from consumers.engines.base import EngineClosedError
from consumers.house import House
from consumers.lifecycle import WorkerStatus
from consumers.sync import WorkerSync

log = logging.getLogger(__name__)


class EngineKeeper:
    """Starts a worker's engine when work needs it and releases it when idle."""

    def __init__(
        self,
        house: House,
        sync: WorkerSync,
        adapters: WorkerAdapters,
        beat: Callable[[], Awaitable[object]],
        held: Sized,
    ) -> None:
        self._name, self._slot, self._state = house.name, house.slot, house.state
        self._metrics, self._settings, self._worker = house.metrics, house.settings, house.worker
        self._sync, self._adapters, self._beat = sync, adapters, beat
        self._held = held
        """The entries the worker holds: an engine that holds work is never released."""

    async def ready(self) -> bool:
        """Start the engine if there is none (the first work of a lazy or released worker) and bring it to the
        current version; False if it could not start (the worker then stops, and its work stays pending)."""
        if self._slot.ready:
            return True
        async with self._slot.lock:
            if self._slot.ready or self._state.stopping.is_set():
                return self._slot.ready
            began = time.monotonic()
            self._state.status = WorkerStatus.STARTING
            await self._beat()
            try:
                await self._slot.start()
                await self._sync.load_current()
            except Exception as exc:
                self.could_not_start(exc)
                self._worker.stop(drain=False)
                return False
            self._slot.ready = True
            self.started("demand", began)
            await self._beat()
        return True

    def could_not_start(self, exc: Exception) -> None:
        """Why the engine could not start, as the worker's `failure` (the worker then stops, exit 1, its work stays
        pending). `EngineClosedError` says what to fix (a server that does not answer or lacks a flag): one line;
        anything else is unexpected, and its traceback goes to the log."""
        self._worker.failure = f"the engine could not start: {exc}"
        if isinstance(exc, EngineClosedError):
            log.error("%s: %s", self._name, self._worker.failure)
        else:
            log.exception("%s: the engine could not start", self._name)

    def started(self, why: str, began: float) -> None:
        seconds = self._slot.cold_start_s = time.monotonic() - began
        self._slot.last_work = time.monotonic()
        self._metrics.engine_started(why, seconds)
        log.info("%s: engine started (%s) in %.2f s at version %d", self._name, why, seconds,
                 self._slot.engine.version)  # fmt: skip

    async def release_when_idle(self) -> None:
        """`release_after_s`: shut the engine down once it served nothing for that long; work starts it again."""
        after = self._settings.release_after_s
        if after is None:
            return
        while not self._state.stopping.is_set():
            await asyncio.sleep(min(after, self._settings.heartbeat_s) / 2)
            if self._may_release(after):
                async with self._slot.lock:
                    if self._may_release(after):
                        await self._release()

    def _may_release(self, after: float) -> bool:
        """Idle that long, serving (not mid-sync), and able to load its version again at the next start."""
        return (
            self._slot.ready
            and not len(self._held)
            and self._state.serving.is_set()
            and self._state.status == WorkerStatus.SERVING
            and self._slot.idle_for() >= after
            and self._sync.loadable(self._slot.engine.version, self._sync.loaded_from)
        )

    async def _release(self) -> None:
        """Swap in a fresh engine and let the old one shut down in the background (`EngineSlot.release`): work that
        arrives meanwhile starts the fresh one once the old is gone; a sync is acked at once."""
        self._state.status = WorkerStatus.RELEASED
        self._slot.ready = False
        self._metrics.engine_released()
        self._slot.release()
        self._adapters.engine = self._slot.engine  # the fresh one: adapters load into it on demand
        log.info("%s: engine released after %.1f s without work", self._name, self._slot.idle_for())
        await self._beat()
