"""How a worker leaves: a stop notice, its deadline, and the drain that hands off what will not finish in time.

A notice comes as SIGTERM (`rollouts worker`), a `drain` command on `{ns}:control` (`rollouts drain NAME`), or a file
that appears (`WorkerSettings.notice_file`, for a preemption notice a node agent writes). From then the worker takes no
work; what runs may finish for `drain_timeout_s`, or until `hand_off_s` before the notice's deadline (`grace_s`);
then what still runs ends with its tokens so far, and each entry publishes its finished samples and hands its
unfinished ones to `{ns}:partials` with its ack, in one step: any worker continues them, so no sample is lost and no
finished token is generated again. The worker then exits inside the deadline.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable

from consumers.house import House
from consumers.settings import ABORT_RETRY_S, NOTICE_POLL_S

log = logging.getLogger(__name__)


class Departure:
    """A worker's stop notice and deadline, and its drain (`Worker.stop` asks; `Worker.run` drains)."""

    def __init__(self, house: House, tasks: set[asyncio.Task], end_running: Callable[[], Awaitable[int]]) -> None:
        self._name, self._settings, self._worker = house.name, house.settings, house.worker
        self._stopping = house.state.stopping
        self._tasks, self._end_running = tasks, end_running
        self.deadline: float | None = None
        """When the worker must have exited (`time.monotonic()`); None: no deadline."""

    def notice(self, grace_s: float | None) -> None:
        """A stop notice with `grace_s` (else the settings') to exit: a later notice may bring the deadline nearer,
        never further."""
        grace = grace_s if grace_s is not None else self._settings.grace_s
        if grace is None:
            return
        deadline = time.monotonic() + grace
        if self.deadline is None or deadline < self.deadline:
            log.info("%s: stop notice: exiting within %.1f s", self._name, grace)
            self.deadline = deadline

    async def watch_notice_file(self) -> None:
        """A stop notice once `notice_file` appears."""
        path = self._settings.notice_file
        if path is None:
            return
        while not self._stopping.is_set():
            if os.path.exists(path):
                log.info("%s: the notice file %s appeared", self._name, path)
                self._worker.stop()
                return
            await asyncio.sleep(NOTICE_POLL_S)

    async def drain(self) -> None:
        """Let in-flight work finish for `drain_timeout_s`, or until `hand_off_s` before the deadline; then end what
        still runs with its tokens so far, so that each entry hands its unfinished samples to `{ns}:partials` with its
        ack. What cannot be handed off in time (a publish that does not return) is cancelled and stays pending."""
        if not self._tasks:
            return
        window, until = self._settings.drain_timeout_s, None
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            keep = min(self._settings.hand_off_s, max(left, 0.0) / 2)
            window = min(window, left - keep)
            until = self.deadline - keep / 2  # the other half: the engine's shutdown and the goodbye
        _done, pending = await asyncio.wait(list(self._tasks), timeout=max(window, 0.0))
        if not pending:
            return
        log.info("%s: %d entries still running at the drain's end: their unfinished samples go to partials with "
                 "their tokens so far", self._name, len(pending))  # fmt: skip
        until = until if until is not None else time.monotonic() + self._settings.hand_off_s
        while pending and time.monotonic() < until:
            await self._end_running()
            wait = max(min(ABORT_RETRY_S, until - time.monotonic()), 0.0)
            _done, pending = await asyncio.wait(pending, timeout=wait)
        for task in pending:
            task.cancel()
        if pending:
            log.warning("%s: %d prompts left unfinished; they stay pending for other workers", self._name, len(pending))
