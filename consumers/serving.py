"""What a worker is doing now, and the heartbeat that tells the fleet.

`ServingState` owns the state of a worker that more than one of its parts reads or writes: its status, whether it
may take work (cleared from a weight sync's or a sleep's pause to the manager's resume) and whether it stops, the
sync epoch it acked, the sleep level of its engine, the work it holds counted in samples and tokens, and its totals.
`Heartbeat` writes that state, with its engine's and its adapters', to `{ns}:worker:{name}` (where the staleness
manager reads the ack of a sync) and keeps the worker on the registry's ready set with the room it has. Neither
reads the worker itself: the heartbeat asks its read loop through `HeldWork`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Protocol

from consumers.budget import TakeBudget
from consumers.lifecycle import WorkerStatus
from pipeline.streams import Entry
from pipeline.wire import ASLEEP_FIELD, CONTINUE_HERE, HAND_OFF, PARTIALS_FIELD
from staleness.weights.layout import LAYOUT_FIELD, advertise, layout_of

if TYPE_CHECKING:
    from consumers.house import House

log = logging.getLogger(__name__)


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


class ServingState:
    """What the worker is doing now: what its heartbeat says, and what its read loop and its side of the sync
    protocol (`consumers.sync`) share."""

    def __init__(self, unstarted_version: int, budget: TakeBudget) -> None:
        self.budget = budget
        """The work it holds, counted in samples and tokens against its caps (`consumers.budget`)."""
        self.status = WorkerStatus.STARTING
        self.stopping = asyncio.Event()
        """Set once the worker stops taking work (`Worker.stop`)."""
        self.serving = asyncio.Event()
        """Set while the worker may take work: cleared during a weight sync (pause → load → ack → resume)."""
        self.redis_gone = False
        """Redis stopped answering while the worker stopped: it leaves without it (`RedisLoss.lost`)."""
        self.epoch = 0
        """The last weight-sync epoch this worker acked."""
        self.last_stall_s = 0.0
        """The last sync as this worker stood still in it: from its pause to its resume (heartbeat `stall_s`)."""
        self.asleep = 0
        """The level of the sleep its engine is in (`WorkerSync`), until the wake of its last part; 0: awake."""
        self.unstarted_version = unstarted_version
        """Without an engine: the version it will load at start (what its heartbeat reports, and acked)."""
        self.published = 0
        self.generated_tokens = 0
        self.tokens_per_s = 0.0
        self.started = time.time()
        self._busy = BusyClock()

    @property
    def inflight_samples(self) -> int:
        """Samples of the work taken that are not yet published (what the heartbeat's `inflight` says)."""
        return self.budget.samples

    @property
    def inflight_tokens(self) -> int:
        """Prompt + `max_tokens` of each sample in `inflight_samples`, summed (`max_inflight_tokens`)."""
        return self.budget.tokens

    def account(self) -> None:
        """Called after every change of in-flight work, and by `set_serving` (see `BusyClock`)."""
        self._busy.update(self.inflight_samples > 0 and self.serving.is_set())

    def set_serving(self, serving: bool) -> None:
        """Take work (and generate) or stand still for a weight sync; the one place that flips it."""
        if serving:
            self.serving.set()
        else:
            self.serving.clear()
        self.account()

    def busy_s(self) -> float:
        return self._busy.seconds()


class HeldWork(Protocol):
    """What a heartbeat asks of the worker's read loop."""

    def held_entries(self) -> Collection[Entry]:
        """The entries the worker holds (started, held for room, or set aside): touched, so that nobody claims them."""
        ...

    def room_to_take(self) -> int:
        """Entries it could take now (0 keeps it off the registry's ready set)."""
        ...


class Heartbeat:
    """Writes the worker's heartbeat: its `ServingState`, its engine's, and what `fields` adds (its adapters')."""

    def __init__(self, house: House, work: HeldWork) -> None:
        self._streams, self._name, self._state, self._slot = house.streams, house.name, house.state, house.slot
        self._work = work
        settings = house.settings
        self._ttl_s, self._dead_after_s = settings.heartbeat_ttl_s, settings.dead_after_s
        self._hand_off_partials = settings.hand_off_partials
        self.fields: Callable[[], dict[str, object]] = dict
        """More fields of the heartbeat (the worker's adapters' acks and versions)."""
        self._layout: str | None = None
        """The digest of the model layout this worker advertises (`_advertise_layout`); "" for none, None: not yet."""
        self._beating = asyncio.Lock()
        """One heartbeat write at a time: a snapshot taken earlier never lands over a later one."""

    async def beat(self, touch: bool = False) -> int:
        """Write the heartbeat (`touch`: and reset the idle time of the work in flight, in the same round trip);
        returns the size of the fleet on the registry."""
        async with self._beating:
            if self._layout is None and self._slot.started:
                self._layout = await asyncio.to_thread(self._advertise_layout)
            state, engine = self._state, self._slot.engine
            held_entries = self._work.held_entries()
            entries = list(held_entries) if touch else []
            room, held = self._work.room_to_take(), len(held_entries)
            status = {
                "status": state.status,
                "engine": engine.name,
                "max_model_len": engine.max_model_len,  # what a gateway may queue for this worker
                "version": engine.version if self._slot.started else state.unstarted_version,
                "epoch": state.epoch,
                "stall_s": round(state.last_stall_s, 6),
                "inflight": state.inflight_samples,
                "inflight_tokens": state.inflight_tokens,
                "published": state.published,
                "tokens_per_s": round(state.tokens_per_s, 1),
                "generated_tokens": state.generated_tokens,
                "busy_s": round(state.busy_s(), 3),
                PARTIALS_FIELD: HAND_OFF if self._hand_off_partials else CONTINUE_HERE,
                ASLEEP_FIELD: state.asleep,
                "engine_starts": self._slot.starts,  # with --lazy / --release-after-s: how often it started cold
                "cold_start_s": round(self._slot.cold_start_s, 3),
                "started": round(state.started, 3),
                "ts": round(time.time(), 3),
                "host": socket.gethostname(),  # where to look (and what to kill) when a worker is named otherwise
                "pid": os.getpid(),
                "held": held,  # entries it holds, and could take more now: what an autoscaler sizes the fleet by
                "room": room,  # (`pipeline.scaling`)
                **self.fields(),
                **({LAYOUT_FIELD: self._layout} if self._layout else {}),
            }
            return await asyncio.to_thread(
                self._streams.registry.heartbeat,
                self._name,
                status,
                self._ttl_s,
                entries,
                self._dead_after_s,
                room,
                held,
            )

    def _advertise_layout(self) -> str:
        """Put the engine's model layout in `{ns}:layouts` (once per distinct model) and return its digest, for the
        heartbeat: a trainer then refuses weights that fit no worker's model before any worker pauses
        (`staleness.weights.layout`). "" when the engine cannot say, or the write failed (it is not tried again)."""
        try:
            layout = layout_of(self._slot.engine)
            return "" if layout is None else advertise(self._streams, layout)
        except Exception:
            log.exception("%s: could not advertise the model's layout; trainers will not check weights against it",
                          self._name)  # fmt: skip
            return ""
