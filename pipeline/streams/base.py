"""What every role on the streams shares: the client, the keys, the groups, plain and group reads, dead letters.

A role (`pipeline.streams.work`, `.writer`, `.training`, `.replies`, `.scoring`) is a `StreamBase` with the methods of
one side of the wire contract; `pipeline.streams.Streams` composes them over one client for the processes that play
several. Everything here is synchronous; the asyncio worker calls it from a thread, which keeps one code path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import redis
from redis.commands.core import Script

from pipeline.codec import stream_ids
from pipeline.connections import socket_timeout_s
from pipeline.lua import register_all
from pipeline.wire import GENERATORS, SCORERS, TRAINER, Fields, Keys, dead_letter_fields

SCRIPTS = Path(__file__).parents[1] / "lua"
"""Where `publish.lua`, `claim.lua`, `forward.lua`, `rehome.lua` and `dead_letter.lua` live."""
BLOCK_MARGIN_MS = 1000
"""A blocking read waits at least this much less than its client's socket timeout (`StreamBase._block`)."""


class Entry(NamedTuple):
    stream: str
    id: bytes
    fields: Fields


def entries_from_reply(reply: Any) -> list[Entry]:
    """Flatten an XREAD/XREADGROUP reply, whatever protocol the client speaks.

    RESP2 gives `[[stream, [(id, fields), ...]], ...]`; RESP3 gives `{stream: [[(id, fields), ...]]}`.
    Entries deleted while pending come back with no fields (`Entry.fields` empty): callers that
    re-read pending entries ack those (`RolloutReader.read_rollouts`); everyone else skips them.
    """
    if not reply:
        return []
    pairs = reply.items() if isinstance(reply, dict) else reply
    entries: list[Entry] = []
    for stream, items in pairs:
        if items and isinstance(items[0], list):  # RESP3 wraps the entries once more
            items = items[0]
        name = stream.decode() if isinstance(stream, bytes) else stream
        entries.extend(Entry(name, entry_id, fields or {}) for entry_id, fields in items)
    return entries


class StreamBase:
    """The streams of one namespace over one Redis client, as every role sees them.

    `scripts`: the Lua scripts (`lua.register_all` of `SCRIPTS`) when several roles share one client, so that they are
    registered once; None: registered here."""

    def __init__(self, client: redis.Redis, ns: str, scripts: Mapping[str, Script] | None = None) -> None:
        self.redis = client
        self.keys = Keys(ns)
        self.scripts = register_all(client, SCRIPTS) if scripts is None else scripts
        timeout_s = socket_timeout_s(client)
        self._max_block_ms = None if timeout_s is None else max(1, int(timeout_s * 1000) - BLOCK_MARGIN_MS)
        """The longest a blocking read may wait on this client (`_block`); None: any."""

    def ensure_groups(self) -> None:
        """Create the consumer groups (and their streams) if missing; safe to call from every process."""
        for stream, group in (
            (self.keys.prompts, GENERATORS),
            (self.keys.partials, GENERATORS),
            (self.keys.rollouts, TRAINER),
        ):
            self.ensure_group(stream, group)

    def ensure_group(self, stream: str, group: str) -> None:
        """A consumer group on `stream`, from the stream's start (so it reads what is still there), if missing."""
        try:
            self.redis.xgroup_create(stream, group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def read(self, after: Mapping[str, bytes], count: int, block_ms: int | None) -> list[Entry]:
        """Entries of these streams after the ids given (`XREAD`, no consumer group), blocking up to `block_ms`."""
        return entries_from_reply(self.redis.xread(stream_ids(after), count=count, block=self._block(block_ms)))

    def read_group(
        self, stream: str, group: str, consumer: str, count: int, block_ms: int | None, pending_after: bytes | None
    ) -> list[Entry]:
        """New entries for `consumer` of `group`; with `pending_after` (`b"0"` for the first page), those it was
        handed before and never acked, after that id. Pending entries deleted meanwhile (an `XDEL`, a `MAXLEN` trim
        by someone else) come back with no fields: they are acked here, since nobody can ever deliver them."""
        start: str | bytes = ">" if pending_after is None else pending_after
        while True:
            reply = self.redis.xreadgroup(group, consumer, {stream: start}, count=count, block=self._block(block_ms))
            entries = entries_from_reply(reply)
            gone = [e.id for e in entries if not e.fields]
            if gone:
                self.redis.xack(stream, group, *gone)
            if len(gone) < len(entries) or not gone:  # a page of deleted entries only: read on
                return [e for e in entries if e.fields]
            if start != ">":
                start = entries[-1].id

    def ack(self, stream: str, group: str, ids: Sequence[bytes], chunk: int = 10_000) -> int:
        """Ack `ids` in `group`, a chunk per command (a recording file may hold a great many); returns how many."""
        pipe = self.redis.pipeline(transaction=False)
        for at in range(0, len(ids), chunk):
            pipe.xack(stream, group, *ids[at : at + chunk])
        return sum(pipe.execute())

    def dead_letter(self, entry: Entry, error: str, stage: str) -> bool:
        """Move a bad entry to `{ns}:dead` with the reason and ack it, in one step (`lua/dead_letter.lua`), if it
        is still pending; returns whether it was (an entry dead-lettered already is not dead-lettered twice)."""
        group = {self.keys.rollouts: TRAINER, self.keys.scoring: SCORERS}.get(entry.stream, GENERATORS)
        args: list[Any] = [group, entry.id]
        for name, value in dead_letter_fields(entry.fields, error, stage).items():
            args += [name, value]
        return bool(self.scripts["dead_letter"](keys=[entry.stream, self.keys.dead], args=args))

    def _block(self, block_ms: int | None) -> int | None:
        """How long a blocking read may wait: `block_ms`, kept `BLOCK_MARGIN_MS` under the client's socket timeout.

        redis-py 8 gives every connection a 5 s socket timeout by default. A read that blocks longer times out in
        the client, and the reconnecting retry (`pipeline.connections`) sends it again, and again: a worker asked
        to block 5 s would never come back to see that it should stop. Every reader here loops on an empty
        read, so a shorter wait costs one more round trip, nothing else. `0` (Redis: wait forever) is capped too."""
        if block_ms is None or self._max_block_ms is None:
            return block_ms
        return self._max_block_ms if block_ms == 0 else min(block_ms, self._max_block_ms)
