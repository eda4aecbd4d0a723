"""The control stream and the workers' doorbells: how a command on `{ns}:control` reaches every worker.

A worker never blocks on `control` itself: it blocks on its own doorbell (`{ns}:bell:K`, `bell_index`), and reads
`control` without blocking when that rings. A command is sent (`ControlStream.send`), then the bells are rung a wave
of workers at a time (`ControlStream.ring`, `waves`, `wave_gap`), so that the clients that arrive meanwhile wait for
one wave at most, never for the whole fleet.
"""

from __future__ import annotations

import time
import zlib
from typing import TYPE_CHECKING, cast

from pipeline.codec import as_entries, for_redis
from pipeline.wire import Control

if TYPE_CHECKING:
    from pipeline.streams.base import Entry, StreamBase

BELLS = 64
"""Doorbells of a namespace (`{ns}:bell:K`). A worker blocks on its own (`bell_index`), never on `control`: a write
to a stream wakes every client blocked on it in one go, and Redis spends a reply and a write a woken read, so one
command read by a large fleet of blocked workers would hold every other client up while Redis serves them all."""
WAKE_WAVE = 32
"""At most about this many workers are woken together by a ring; a fleet of up to `BELLS * WAKE_WAVE` workers is rung
in waves of this size, a larger one a bell a wave."""
WAKE_COST_S = 60e-6
"""What a woken worker costs Redis next: it reads `control`, acks or resumes, reads work. A ring leaves that much per
worker of a wave before the next (`wave_gap`), so that a client that arrives meanwhile (a publish) waits behind one
wave at most."""
ABORT_COST_S = 250e-6
"""What a woken worker costs Redis in a sync that pauses in `abort` mode: the above, plus the publish of its interrupted
samples and, after the resume, their reading back by whoever continues them; paced with a margin, because a fleet's
workers do not react at an even pace."""
CONTROL_BATCH = 100
"""Control entries one read returns at most."""
CONTROL_RECHECK_S = 5.0
"""A worker reads `control` at least this often without a ring: a ring that never came (its sender died between
writing the command and ringing) is then late by this much at most, not lost."""


def bell_index(worker: str) -> int:
    """The doorbell a worker blocks on: the same for a name in every process (CRC-32, not Python's salted hash)."""
    return zlib.crc32(worker.encode()) % BELLS


def waves(fleet: int) -> list[range]:
    """The bells rung together, wave by wave, for a fleet of `fleet` workers: ~`WAKE_WAVE` workers a wave, so one
    wave (one pipeline) for a fleet of up to 32 and 32 waves for 1,000."""
    per_wave = max(1, BELLS * WAKE_WAVE // max(fleet, 1))
    return [range(first, min(first + per_wave, BELLS)) for first in range(0, BELLS, per_wave)]


def wave_gap(fleet: int, per_worker_s: float) -> float:
    """The pause after each wave of a ring: the Redis time that a wave's workers cost next (`per_worker_s` each)."""
    return per_worker_s * fleet / len(waves(fleet))


class ControlStream:
    """The control stream of one namespace and its doorbells, over the client of the `Streams` it belongs to
    (`streams.control`)."""

    def __init__(self, streams: StreamBase) -> None:
        self._streams = streams

    def send(self, command: Control, ring: bool = True) -> bytes:
        """Append a command to `control` and ring the workers' bells (`ring=False`: a caller that sends several and
        rings once after them)."""
        entry_id = cast(bytes, self._streams.redis.xadd(self._streams.keys.control, for_redis(command.to_fields())))
        if ring:
            self.ring(command.cmd)
        return entry_id

    def ring(self, cmd: str, per_worker_s: float = WAKE_COST_S) -> int:
        """Wake the workers to read `control` after a command was written there, a wave at a time; returns the waves.

        Each wave is one pipeline, whose reply comes back once Redis has served the reads it woke; the next goes
        once Redis has served what those workers do next, `per_worker_s` each (`wave_gap`; `ABORT_COST_S` for a sync
        that pauses in `abort` mode). The clients waiting meanwhile (a publish, a heartbeat) are served between two
        waves: they wait for one wave at most, never for the whole fleet. `cmd` only labels the ring for a person
        reading `{ns}:bell:K`."""
        client, keys = self._streams.redis, self._streams.keys
        fleet = int(client.scard(keys.workers))
        gap = wave_gap(fleet, per_worker_s)
        plan = waves(fleet)
        for number, wave in enumerate(plan):
            if number:
                time.sleep(gap)  # the last wave's workers read control, ack, read work: let Redis serve that
            pipe = client.pipeline(transaction=False)
            for index in wave:
                pipe.xadd(keys.bell(index), {"cmd": cmd}, maxlen=1, approximate=False)
            pipe.execute()
        return len(plan)

    def ring_one(self, worker: str, cmd: str) -> None:
        """Wake only `worker` (and the few that share its bell) to read `control`: a command for one worker (a
        `share`) need not wake the fleet."""
        bell = self._streams.keys.bell(bell_index(worker))
        self._streams.redis.xadd(bell, {"cmd": cmd}, maxlen=1, approximate=False)

    def bell_id(self, worker: str) -> bytes:
        """The last ring of `worker`'s bell (`0-0` if never rung): where its `wait_for_bell` starts."""
        last = as_entries(self._streams.redis.xrevrange(self._streams.keys.bell(bell_index(worker)), count=1))
        return last[0][0] if last else b"0-0"

    def wait_for_bell(self, worker: str, after: bytes, block_ms: int) -> bytes:
        """Block until `worker`'s bell rings after `after` (or `block_ms` passes); returns the last ring's id (`after`
        if none). A ring between the worker's last read of `control` and this call returns at once: none is missed."""
        bell = self._streams.keys.bell(bell_index(worker))
        entries = self._streams.read({bell: after}, 1, block_ms)
        return entries[-1].id if entries else after

    def last_id(self) -> bytes:
        """Where a reader that starts now picks up the control stream (`0-0` when it is empty)."""
        last = as_entries(self._streams.redis.xrevrange(self._streams.keys.control, count=1))
        return last[0][0] if last else b"0-0"

    def read(self, after: bytes, block_ms: int | None) -> list[Entry]:
        """Control commands after `after` (every worker reads all of them: no consumer group). Workers read without
        blocking, when their bell rings (`wait_for_bell`); a few other readers (admission) block here."""
        return self._streams.read({self._streams.keys.control: after}, CONTROL_BATCH, block_ms)
