"""The worker registry: each worker's expiring heartbeat (`{ns}:worker:NAME`) and the set of registered workers
(`{ns}:workers`); who lives, one field of each worker's heartbeat, and handing a departed worker's inbox back to the
shared prompts (`rehome`). A fleet shares the sweep for departed workers out (`sweep_chance`)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import redis
from redis.commands.core import Script
from redis.typing import StreamIdT

from pipeline.durability import without_waiting
from pipeline.lua import load_missing, queue, raise_first_error
from pipeline.wire import GENERATORS, Keys

if TYPE_CHECKING:
    from pipeline.streams import Entry


def default_name() -> str:
    """A process's default name in the fleet (a worker's, a scorer's, a gateway's): `host-pid`."""
    return f"{socket.gethostname()}-{os.getpid()}"


SWEEPS_PER_HEARTBEAT = 2
"""How many workers of a fleet sweep departed workers' inboxes per heartbeat period, on average (`sweep_chance`)."""


def sweep_chance(fleet: int) -> float:
    """The chance that one worker of a fleet of `fleet` sweeps this heartbeat: `SWEEPS_PER_HEARTBEAT` sweeps a period
    in all, whatever the size (always, for a fleet of that many or fewer). A departed worker's inbox is rehomed
    within a few heartbeats (the chance that none of the fleet swept in k periods is about e^-2k), and Redis checks
    ~2N heartbeats a period rather than N²."""
    return min(1.0, SWEEPS_PER_HEARTBEAT / max(fleet, 1))


def touch_pending(pipe: redis.client.Pipeline, consumer: str, entries: Iterable[Entry]) -> None:
    """Queue on `pipe` the reset of the idle time of work `consumer` still has in progress (`XCLAIM` to itself), so
    that nobody claims it from a live worker."""
    by_stream: dict[str, list[bytes]] = {}
    for entry in entries:
        by_stream.setdefault(entry.stream, []).append(entry.id)
    for stream, ids in by_stream.items():
        pipe.xclaim(stream, GENERATORS, consumer, 0, list[StreamIdT](ids), justid=True)


class Registry:
    """The workers of one namespace (`streams.registry`)."""

    def __init__(self, client: redis.Redis, keys: Keys, rehome_script: Script, beat_script: Script) -> None:
        self._redis = client
        self._soft = without_waiting(client)
        """For heartbeats: soft state, written again every period, that no durability mode waits for (a heartbeat held
        back until a replica follows a new primary would make its worker look dead)."""
        self._keys = keys
        self._rehome_script = rehome_script
        """`lua/rehome.lua`, registered by the `Streams` this registry belongs to."""
        self._beat_script = beat_script
        """`lua/beat.lua`: a worker's deadline on `{ns}:beats`, in Redis's clock."""

    def heartbeat(
        self,
        name: str,
        status: dict[str, Any],
        ttl_s: float,
        touch: Iterable[Entry] = (),
        dead_after_s: float | None = None,
        room: int = 0,
        held: int = 0,
    ) -> int:
        """Write the worker's heartbeat hash (expiring) and keep it on the registry `{ns}:workers`; returns how many
        workers the registry holds (departed ones not yet rehomed included), for the sweep's share (`sweep_chance`).

        `touch`: work still in progress, whose idle time is reset in the same round trip (as `touch` does): a fleet's
        upkeep is then one round trip a worker a period, not two. `dead_after_s`: the silence after which the others
        take its work over (`{ns}:beats`, `lua/claim.lua`); None: only once the work idles past their
        `claim_idle_ms`. With it, `room` (entries it could take now) and `held` (entries it holds) keep it on the
        fleet's ready set while it has room (`lua/beat.lua`), so the others' shares count it while it waits."""
        key = self._keys.worker(name)
        touch = list(touch)

        def beat() -> list[Any]:
            pipe = self._soft.pipeline(transaction=True)
            touch_pending(pipe, name, touch)
            if dead_after_s is not None:
                keys = [self._keys.beats, self._keys.ready, self._keys.ready_held]
                queue(pipe, self._beat_script, keys, [name, int(dead_after_s * 1000), room, held])
            pipe.hset(key, mapping={k: str(v) for k, v in status.items()})
            pipe.pexpire(key, int(ttl_s * 1000))
            pipe.sadd(self._keys.workers, name)
            pipe.scard(self._keys.workers)
            return pipe.execute(raise_on_error=False)

        results = beat()
        if load_missing(self._redis, results, [self._beat_script]):
            results = beat()  # each command of it is safe to run twice
        return int(raise_first_error(results)[-1])

    def heartbeat_field(self, names: Iterable[str], field: str) -> dict[str, str | None]:
        """One field of each named worker's heartbeat (None for a worker that is gone: its heartbeat expired, or its
        declared silence on `{ns}:beats` has passed, as claimers judge it): what a weight sync polls for its acks, a
        field per worker rather than every heartbeat whole. One round trip, and a second only for the workers whose
        field is missing (to tell a live worker without it from one that is gone)."""
        names = list(names)
        if not names:
            return {}
        pipe = self._redis.pipeline(transaction=False)
        for name in names:
            pipe.hget(self._keys.worker(name), field)
        pipe.time()
        pipe.zmscore(self._keys.beats, names)
        *fields, (seconds, micros), deadlines = pipe.execute()
        now_ms = seconds * 1000 + micros // 1000
        silent = {n for n, deadline in zip(names, deadlines, strict=True) if deadline is not None and deadline < now_ms}
        # A field present says the heartbeat is there: only the others need a second look (a command a worker per
        # poll, not two: a sync with 1,000 workers polls every 20 ms).
        missing = [n for n, value in zip(names, fields, strict=True) if value is None and n not in silent]
        for name in missing:
            pipe.exists(self._keys.worker(name))
        alive = dict(zip(missing, pipe.execute(), strict=True)) if missing else {}

        def answer(name: str, value: bytes | None) -> str | None:
            if name in silent:
                return None
            return _text(value) if value is not None else ("" if alive[name] else None)

        return {name: answer(name, value) for name, value in zip(names, fields, strict=True)}

    def forget_worker(self, name: str) -> None:
        """A worker leaves: its heartbeat goes, and whatever is still in its inbox goes back to the shared prompts."""
        self._redis.delete(self._keys.worker(name))
        pipe = self._redis.pipeline(transaction=True)  # the ready sets change together (`lua/share.lua`)
        for fleet_set in (self._keys.ready, self._keys.ready_held, self._keys.beats):
            pipe.zrem(fleet_set, name)
        pipe.execute()
        self.rehome(name, leaving=True)

    def live_workers(self) -> dict[str, dict[str, str]]:
        """Workers on the registry whose heartbeat has not expired, with their heartbeat fields."""
        names = self._registered()
        pipe = self._redis.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(self._keys.worker(name))
        return {
            name: {_text(k): _text(v) for k, v in fields.items()}
            for name, fields in zip(names, pipe.execute(), strict=True)
            if fields
        }

    def rehome(self, worker: str, leaving: bool = False) -> int:
        """Move what waits in a departed worker's inbox to `{ns}:prompts` (`lua/rehome.lua`); -1 while it lives."""
        keys = [
            self._keys.worker(worker),
            self._keys.inbox(worker),
            self._keys.prompts,
            self._keys.workers,
            self._keys.beats,
        ]
        return int(self._rehome_script(keys=keys, args=[worker, GENERATORS, int(leaving)]))

    def rehome_departed(self) -> int:
        """Rehome the inbox of every registered worker whose heartbeat expired; returns the entries moved.

        It reads the whole registry (a check per worker), so a fleet shares the sweep out (`sweep_chance`)
        rather than have every worker run it every heartbeat: N workers sweeping N each is N² checks a second."""
        return sum(max(0, self.rehome(name)) for name in self._registry()[1])

    def live_worker_names(self) -> list[str]:
        """The registered workers whose heartbeat has not expired, by name only: an `EXISTS` each where
        `live_workers` reads every heartbeat whole (at 1,000 workers, 1,000 `HGETALL`s in one go, which held other
        clients up at the start of every sync)."""
        return self._registry()[0]

    def live_workers_with(self, field: str) -> dict[str, str]:
        """The registered workers whose heartbeat has not expired, each with one field of its heartbeat ("" where it
        has none): `live_worker_names` and that field in the same round trip (`heartbeat_field`'s `HGET`s tell a
        live heartbeat from a gone one too)."""
        fields = self.heartbeat_field(self._registered(), field)
        return {name: value for name, value in fields.items() if value is not None}

    def _registered(self) -> list[str]:
        """Every worker on the registry (`{ns}:workers`), live or not, sorted."""
        return sorted(_text(n) for n in self._redis.smembers(self._keys.workers))

    def _registry(self) -> tuple[list[str], list[str]]:
        """The workers on the registry, split into those whose heartbeat lives and those whose heartbeat expired."""
        names = self._registered()
        pipe = self._redis.pipeline(transaction=False)
        for name in names:
            pipe.exists(self._keys.worker(name))
        live = dict(zip(names, pipe.execute(), strict=True))
        return [n for n in names if live[n]], [n for n in names if not live[n]]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
