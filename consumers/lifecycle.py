"""Lazy start and idle release: the worker's engine is started when work arrives and shut down when idle.

A worker run with `--lazy` registers and heartbeats as `idle` with no engine; the first entry it takes starts the
engine (`starting`), brings it to the state's policy version and serves. With `--release-after-s S`, an engine that
served nothing for S seconds is shut down (`released`) and started again on demand. Neither engine restarts itself
after `shutdown` (vLLM's `AsyncLLM` cannot), so a release builds a fresh, unstarted engine object from the same
factory: building one reads the model's config only, so the worker still knows its name and context length.

While there is no engine, weight syncs are acked at once (no trainer waits for a cold start): a version its
transport stores (`fs://`, `redis://`) is simply loaded from the state when the engine starts; a pushed one (`nccl://`)
is nowhere to fetch later, so the worker joins the push with one rank of its own and keeps a CPU copy (`received`) to
load at start. For the same reason an engine whose version was pushed (and of which no copy is kept) is never
released: the worker could not get that version back until the next sync.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import redis

from consumers.engines import create_engine
from consumers.engines.base import Engine
from staleness.weights import join_pushed, transport_of

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

EngineFactory = Callable[[], Engine]
"""Builds an unstarted engine (cheap: it reads the model's config), as `create_engine(kind, model, **options)`."""


def engine_factory(
    kind: str, model: str, options: dict[str, Any], client: redis.Redis, ns: str, member: str
) -> EngineFactory:
    """The worker's engine factory (`rollouts worker`, a Ray actor): `create_engine` with these options, each time
    the engine starts again. A `remote` engine also gets the pause holders of the server it may share with the
    namespace's other workers (`consumers.engines.shared_server`), which live in Redis, not in the options."""
    if kind == "remote":
        from consumers.engines.shared_server import SharedPause

        options = options | {"pauses": SharedPause(client, ns, str(options["url"]), member)}
    return functools.partial(create_engine, kind, model, **options)


class WorkerStatus(StrEnum):
    """The heartbeat's `status`: what the worker and its engine are doing now (`rollouts top` shows it)."""

    STARTING = "starting"
    """Its engine is starting (at launch, or on demand with `--lazy` / after a release)."""
    IDLE = "idle"
    """`--lazy`: no engine started yet; the first work starts it."""
    SERVING = "serving"
    PAUSED = "paused"
    """Standing still for a weight sync, between its pause and the manager's resume."""
    AWAITING_WEIGHTS = "awaiting weights"
    """Its version was pushed (nccl) before it could receive it: it takes no work until the next sync."""
    ASLEEP = "asleep"
    """Paused, its engine asleep (`RolloutClient.sleep`: a colocated trainer's step), until a sync or a wake."""
    RELEASED = "released"
    """`--release-after-s`: its engine was shut down after that long without work; work starts it again."""
    STOPPING = "stopping"


@dataclass
class Received:
    """A version pushed while the worker had no engine: CPU tensors to load when it starts."""

    version: int
    tensors: dict[str, torch.Tensor]


class EngineSlot:
    """The worker's engine: always an object (for its name and limits), started or not, rebuilt after a release."""

    def __init__(self, engine: Engine, factory: EngineFactory | None, member: str, freeze: bool = False) -> None:
        self.engine = engine
        self.factory = factory
        self.member = member
        """The worker's name: its name in the groups of pushes (nccl)."""
        self.freeze = freeze
        """Freeze the process's heap once the engine has started (`freeze_heap`), and unfreeze it at a release."""
        self.started = False
        """`start()` ran (and no release since)."""
        self.ready = False
        """Started and brought to the current version (the worker sets it): requests may go to it."""
        self.lock = asyncio.Lock()
        """One start, release or weight sync at a time: a sync never meets a half-started engine."""
        self.last_work = time.monotonic()
        """When the engine last finished work (or started): the idle clock of `--release-after-s`."""
        self.received: Received | None = None
        self.pushed_uris: set[str] = set()
        """Pushes (nccl rendezvous) this worker joined: what it holds of them is left whenever the engine starts or
        stops (`Transport.leave`)."""
        self._stopped: asyncio.Task[None] | None = None
        """The shutdown of the last released engine, under way: the next start waits for it (so that two engines
        never hold the GPU at once), a sync does not."""
        self.starts = 0
        self.cold_start_s = 0.0
        """The last start: the engine's, plus loading the current version."""

    async def start(self) -> None:
        """Start the engine (the caller holds `lock` and then loads the current version), then freeze the heap."""
        await self._released()
        self._forget_groups()
        await self.engine.start()
        if self.freeze:
            freeze_heap()
        self.started = True
        self.starts += 1

    def release(self) -> None:
        """Put a fresh, unstarted engine from the factory in place and shut the old one down in the background
        (vLLM takes seconds): a sync meanwhile is acked at once, a start waits for it."""
        if self.factory is None:
            raise RuntimeError("an engine without a factory cannot be released: it could not start again")
        old, self.engine = self.engine, self.factory()
        self.started = self.ready = False
        if self.freeze:  # the old engine's objects go back to the collector, which frees them once it is shut down
            gc.unfreeze()
        self._stopped = asyncio.create_task(old.shutdown())
        self._forget_groups()

    async def shutdown(self) -> None:
        """At the worker's end: the engine, and a released one still shutting down."""
        await self._released()
        await self.engine.shutdown()

    async def _released(self) -> None:
        """Wait for the released engine's shutdown; one that failed is logged (its processes are gone or going)."""
        stopped, self._stopped = self._stopped, None
        if stopped is not None:
            try:
                await stopped
            except Exception:
                log.exception("the released engine's shutdown failed")

    def idle_for(self) -> float:
        return time.monotonic() - self.last_work

    def copy_of(self, version: int) -> Received | None:
        """The CPU copy of `version` received from a push, if this worker holds one."""
        return self.received if self.received is not None and self.received.version == version else None

    def _forget_groups(self) -> None:
        """The processes that held our part of the pushes (their groups) are gone (or new): the trainer must build
        them anew."""
        for uri in self.pushed_uris:
            transport_of(uri).leave(uri, self.member)


def freeze_heap() -> None:
    """Collect, then move every object alive now out of the collector's sight (`gc.freeze`).

    A started engine leaves its process with objects that live as long as it does: vLLM's `AsyncLLM` with the tiny
    model, hundreds of thousands. A full collection walks them all, and while it runs the worker's event loop stands
    still: no request goes to the engine, no output comes back, nothing is published. Python runs one whenever the
    objects that survived since the last outgrow a quarter of those it holds. Frozen, they are skipped: the same
    collection takes well under a millisecond. vLLM freezes its own engine core and API server so
    (`vllm.utils.gc_utils.freeze_gc_heap`). A release unfreezes them first (`EngineSlot.release`), so that the old
    engine can be freed."""
    gc.collect()
    gc.freeze()


async def receive_copy(uri: str, version: int, epoch: int, member: str) -> Received:
    """Join sync `epoch`'s push as one rank of this process (no engine needed) and keep CPU copies."""
    joined = await join_pushed(uri, version, epoch, member=member)  # one rank of this process: what an adapter takes
    tensors, _ = await joined.receive()
    return Received(version, tensors)
