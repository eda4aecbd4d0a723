"""The weight-sync protocol: pause → load v+1 → ack → resume, across every live worker.

`Manager.sync(version, uri)` drives one epoch on `{ns}:control`:
1. begin (atomic): `{ns}:state` must be at `version - 1` and not paused; it becomes paused with
   a new epoch, and `weights(epoch, version, uri, mode)` goes out to every worker;
2. each live worker pauses (mode `abort`: in-flight samples go durably to `{ns}:partials`;
   `keep`: they freeze in the engine), loads `version` and acks by writing `epoch` and `version`
   into its heartbeat hash;
3. a worker that has not acked by the deadline is evicted (`stop` for it; its pending work is
   claimed by the others); a worker that died is simply no longer waited for;
4. finish (atomic): the state moves to `version`, unpaused, and `resume(epoch)` goes out.
After steps 1 and 4 the manager rings the workers' bells (`ControlStream.ring`), a wave of ~32 workers at a time:
workers block on their bell, not on `control`, so that 1,000 of them do not wake (and ack, and
read work) in one instant. The resume's ring goes on in a thread of the manager's while the trainer goes back to work:
the state has moved and the command is written, so the ring only wakes the workers sooner (`Manager.settle`).
A worker that joins later loads the state's version before it takes work.

`Manager.sleep(level)` is the first half of a colocated trainer's step: every live worker pauses, puts its engine to
sleep (its GPU memory freed for the training step) and acks; the state stays paused, `asleep` at the level, with no
resume. The next `sync` (the step's new weights) wakes each worker before it loads, and its resume ends the sleep;
`wake()` ends it without a new version. A sleep is never taken for an abandoned sync: the trainer is training.

A manager for one LoRA adapter (`Manager(streams, adapter="a")`) runs the same protocol on that adapter's own
state (`{ns}:adapter:a:state`), epochs and acks (heartbeat field `epoch@a`): only the adapter's requests pause,
every other adapter and the base model go on generating.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis

from pipeline.control import ABORT_COST_S, WAKE_COST_S
from pipeline.lua import register_all
from pipeline.streams import Streams
from pipeline.wire import (
    ADAPTER_PATTERN,
    ASLEEP_FIELD,
    HAND_OFF,
    PARTIALS_FIELD,
    SLEEP_LEVELS,
    Control,
    PauseMode,
    ack_field,
)
from staleness.state import PolicyState, read_state, weights_command

log = logging.getLogger(__name__)

SCRIPTS = Path(__file__).with_name("lua")
"""Where `begin_sync.lua` and `finish_sync.lua` live."""


class SyncError(RuntimeError):
    """The state refused a sync (another one is under way, or the version is not the next one)."""


@dataclass
class SyncReport:
    version: int
    epoch: int
    acked: list[str] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)
    """Workers that died before or during the sync (silent past their deadline on `{ns}:beats`, as claimers judge the
    dead, or their heartbeat expired): not waited for, nor evicted (one only frozen loads the version as it wakes)."""
    stall_s: float = 0.0
    """From the `weights` command to the `resume`: how long the trainer waited, and about how long each worker stood
    still (a worker pauses when its wave is rung and resumes when its wave is rung again, at the same pace). For a
    sleep: from the `sleep` command to the last ack."""
    awake: list[str] = field(default_factory=list)
    """A sleep's workers that paused and acked but whose engine could not sleep (the reason is in their log)."""


class Manager:
    """Keeps `{ns}:state` and drives weight syncs (and sleeps); safe to use from the trainer's process or its own."""

    def __init__(
        self, streams: Streams, ack_timeout_s: float = 60.0, poll_s: float = 0.02, adapter: str | None = None
    ) -> None:
        if adapter is not None and not re.match(ADAPTER_PATTERN, adapter):
            raise ValueError(f"adapter name {adapter!r} must match {ADAPTER_PATTERN}")
        self.streams = streams
        self.ack_timeout_s = ack_timeout_s
        self.poll_s = poll_s
        self.adapter = adapter
        """The LoRA adapter whose syncs this manager drives; None: the base model."""
        scripts = register_all(streams.redis, SCRIPTS)
        self._begin, self._finish = scripts["begin_sync"], scripts["finish_sync"]
        self._begin_sleep = scripts["begin_sleep"]
        self._keys = [streams.keys.state_of(adapter), streams.keys.control]
        self._ack_field = ack_field(adapter)
        self._ringing: threading.Thread | None = None

    def state(self) -> PolicyState:
        return read_state(self.streams.redis, self.streams.keys, self.adapter)

    def live_workers(self) -> dict[str, dict[str, str]]:
        """Workers whose heartbeat has not expired, with their heartbeat fields."""
        return self.streams.registry.live_workers()

    def highest(self, field: str) -> int:
        """The highest number a live worker reports in heartbeat `field` (0: none). A failover that lost the state's
        last bump leaves the state below what the workers report: those numbers name weights and syncs already, and
        the next ones go above (`next_version` for `version`; `sync` and `begin_sync.lua` for the ack field's epoch)."""
        values = self.streams.registry.live_workers_with(field).values()
        return max((int(v) for v in values if v.lstrip("-").isdigit()), default=0)

    def next_version(self, state: PolicyState | None = None) -> int:
        """The version the next sync makes: one above both the state's and any live worker's, so that no number ever
        names two different weights, even after a failover that lost the last `publish_weights`'s bump."""
        state = self.state() if state is None else state
        version = self.highest("version") if self.adapter is None else 0
        if version > state.version:
            log.warning(
                "the state is at version %d but a worker serves version %d (a failover lost the last bump?): the next "
                "version is %d", state.version, version, version + 1,
            )  # fmt: skip
        return max(state.version, version) + 1

    def sync(
        self,
        version: int,
        uri: str,
        mode: PauseMode = "abort",
        transfer: Callable[[int, int], object] | None = None,
        expected: int | None = None,
    ) -> SyncReport:
        """Move every live worker to `version` (loadable from `uri`); returns who acked, who was evicted.

        `transfer(epoch, n_workers)` runs after the `weights` command went out and before the wait for
        acks (an nccl broadcast); acks are then due `ack_timeout_s` after it returns. If it raises, the
        sync is still concluded (laggards evicted, everyone resumed) before the error propagates.
        """
        self.settle()  # the last sync's resume fully rung first: two rings at once would wake waves twice as fast
        started = time.monotonic()
        weights = Control(cmd="weights", version=version, uri=uri, mode=mode, adapter=self.adapter or "").to_fields()
        if self.adapter is not None:
            self.streams.redis.sadd(self.streams.keys.adapters, self.adapter)  # `top` and joiners find it
        try:
            token = uuid.uuid4().hex  # the same call retried by redis-py begins no second sync
            current = version - 1 if expected is None else expected
            floor = self.highest(self._ack_field)  # one read of the fleet: the epoch only
            epoch = int(self._begin(keys=self._keys, args=[current, version, token, floor, *_flat(weights)]))
        except Exception as exc:  # the script's error replies say why
            raise SyncError(str(exc)) from None
        waiting, hand_off = self._fleet(mode)
        pace = ring_pace(mode, hand_off)
        self.streams.control.ring("weights", pace)  # the workers, a wave at a time (`ControlStream.ring`)
        report = SyncReport(version=version, epoch=epoch)
        try:
            if transfer is not None:
                transfer(epoch, len(waiting))
        finally:
            self._conclude(report, uri, waiting, deadline=time.monotonic() + self.ack_timeout_s, pace=pace)
            report.stall_s = time.monotonic() - started
        return report

    def sleep(self, level: int = 1, mode: PauseMode = "abort") -> SyncReport:
        """Pause every live worker (`mode`: `abort` or `keep`; a sleeping engine keeps no KV cache, so `inflight` is
        refused) and put its engine to sleep at `level` (`SLEEP_LEVELS`); returns once each acked (a worker that does
        not ack in time is evicted). The fleet stays paused until the next `sync`, which wakes it, or `wake()`.
        `SyncReport.awake` names the workers that paused but whose engine cannot sleep (its reason in their log).
        Raises `ValueError` for a bad level or mode, `SyncError` while a sync or a sleep is under way."""
        if self.adapter is not None:
            raise ValueError("a sleep is the whole engine's: use a manager of the base model (adapter=None)")
        if level not in SLEEP_LEVELS:
            raise ValueError(f"sleep level must be one of {', '.join(map(str, SLEEP_LEVELS))}, got {level!r}")
        if mode == "inflight":
            raise ValueError("a sleeping engine keeps no KV cache: sleep with mode 'abort' or 'keep', not 'inflight'")
        self.settle()
        started = time.monotonic()
        command = Control(cmd="sleep", level=level, mode=mode).to_fields()
        try:
            token = uuid.uuid4().hex
            epoch = int(self._begin_sleep(keys=self._keys, args=[level, token, *_flat(command)]))
        except Exception as exc:
            raise SyncError(str(exc)) from None
        waiting, _ = self._fleet(mode)
        self.streams.control.ring("sleep", ring_pace(mode, False))
        report = SyncReport(version=self.state().version, epoch=epoch)
        self._wait_acks(report, waiting, deadline=time.monotonic() + self.ack_timeout_s)
        for name in sorted(waiting):
            self.evict(name)
            report.evicted.append(name)
        asleep = self.streams.registry.heartbeat_field(set(report.acked), ASLEEP_FIELD)
        report.awake = sorted(name for name, value in asleep.items() if not int(value or 0))
        report.stall_s = time.monotonic() - started
        return report

    def wake(self) -> SyncReport | None:
        """End the fleet's sleep without a new version: every worker wakes its engine and goes on (its interrupted
        samples with it). None if the fleet is not asleep; `ValueError` after a level-2 sleep, which freed the weights
        (only a sync ends it)."""
        self.settle()
        state = self.state()
        if not state.asleep:
            return None
        if state.asleep == 2:
            raise ValueError("a level-2 sleep freed the weights: end it with publish_weights (a version to load)")
        report = SyncReport(version=state.version, epoch=state.epoch)
        _, hand_off = self._fleet("abort")
        self._conclude(report, state.weights_uri, set(), deadline=time.monotonic(), pace=ring_pace("abort", hand_off))
        return report

    def finish_abandoned(self, older_than_s: float | None = None) -> SyncReport | None:
        """Finish a sync whose driver died (a trainer killed mid-sync leaves every worker paused).

        A sync is abandoned once its `weights` command is older than `older_than_s` (default: the ack
        deadline, plus 5 s): laggards are evicted and the workers resumed, as the driver would have.
        """
        self.settle()
        state = self.state()
        if not state.paused or state.asleep:  # a sleep lasts a training step: its trainer wakes the fleet
            return None
        command = weights_command(self.streams.redis, self.streams.keys, state.epoch, adapter=self.adapter)
        age = time.time() - command.ts if command is not None else float("inf")
        if age < (self.ack_timeout_s + 5.0 if older_than_s is None else older_than_s):
            return None
        version = state.pending_version if state.pending_version is not None else state.version + 1
        uri = command.uri if command is not None else state.weights_uri
        report = SyncReport(version=version, epoch=state.epoch)
        mode = command.mode if command is not None else "abort"
        live, hand_off = self._fleet(mode)
        self._conclude(report, uri, live, deadline=time.monotonic(), pace=ring_pace(mode, hand_off))
        if command is not None:  # the stall so far: from its `weights` command (the driver's clock) to now
            report.stall_s = max(0.0, time.time() - command.ts)
        return report

    def _fleet(self, mode: PauseMode) -> tuple[set[str], bool]:
        """The live workers, and whether an `abort` pause sends any one's interrupted samples through Redis
        (`--hand-off-partials`, in its heartbeat). For an abort sync both come from one `HGET` a worker; a keep sync
        needs only the names (`EXISTS`)."""
        if mode != "abort":
            return set(self.streams.registry.live_worker_names()), False
        fields = self.streams.registry.live_workers_with(PARTIALS_FIELD)
        return set(fields), HAND_OFF in fields.values()

    def _conclude(self, report: SyncReport, uri: str, waiting: set[str], deadline: float, pace: float) -> None:
        """Wait for acks of `report.epoch` until `deadline`, evict who did not ack, then resume everyone (rung at
        `pace`: an abort pause's resume in a fleet that hands off sends it to read back the samples it interrupted)."""
        self._wait_acks(report, waiting, deadline)
        for name in sorted(waiting):
            self.evict(name, ring=False)  # the resume's ring below wakes them
            report.evicted.append(name)
        resume = Control(
            cmd="resume", epoch=report.epoch, version=report.version, uri=uri, adapter=self.adapter or ""
        ).to_fields()
        self._finish(keys=self._keys, args=[report.version, uri, *_flat(resume)])
        self._ringing = threading.Thread(target=self._ring_resume, args=(pace,), name="resume-ring")
        self._ringing.start()  # not a daemon: a trainer that exits right after a sync still rings every wave

    def _wait_acks(self, report: SyncReport, waiting: set[str], deadline: float) -> None:
        """Move the workers of `waiting` that ack `report.epoch` into `report.acked` (those that are gone into
        `report.gone`: past their deadline on `{ns}:beats`, or their heartbeat expired) until none is left or
        `deadline`; who is still in `waiting` then did not ack."""
        while waiting:
            # only the field, of those not acked yet
            epochs = self.streams.registry.heartbeat_field(waiting, self._ack_field)
            for name, epoch in epochs.items():
                if epoch is None:
                    report.gone.append(name)
                    waiting.discard(name)
                elif int(epoch or -1) >= report.epoch:
                    report.acked.append(name)
                    waiting.discard(name)
            if not waiting or time.monotonic() > deadline:
                break
            time.sleep(self.poll_s)

    def _ring_resume(self, pace: float) -> None:
        try:
            self.streams.control.ring("resume", pace)
        except redis.RedisError as exc:  # the command is written: workers find it within `CONTROL_RECHECK_S` anyway
            log.warning("ringing the workers after a sync failed (%s); they will read the resume unrung", exc)

    def settle(self) -> None:
        """Wait until the last sync's resume has been rung to every wave (~0.1-0.25 s after `sync` returned at 1,000
        workers; at once for a fleet of one wave)."""
        if self._ringing is not None:
            self._ringing.join()
            self._ringing = None

    def evict(self, name: str, ring: bool = True) -> None:
        """Tell a worker to stop and forget it: its pending work goes to the others once it idles."""
        self.streams.control.send(Control(cmd="stop", worker=name), ring=ring)
        self.streams.registry.forget_worker(name)


def ring_pace(mode: PauseMode, hand_off: bool) -> float:
    """What each worker woken by a sync's rings costs Redis next (`ControlStream.ring`). An abort pause in a fleet that
    hands its interrupted samples off publishes them, and the fleet reads them back after the resume; one whose workers
    continue them in place (the default) costs what a `keep` pause does."""
    return ABORT_COST_S if mode == "abort" and hand_off else WAKE_COST_S


def _flat(fields: dict[bytes, bytes]) -> list[bytes]:
    return [item for pair in fields.items() for item in pair]
