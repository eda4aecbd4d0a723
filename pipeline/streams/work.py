"""The worker's reader: taking work (partials, its inbox, prompts), its leftovers, claims, touches, the alone marks."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import redis

from pipeline.codec import stream_ids
from pipeline.registry import touch_pending
from pipeline.streams.base import Entry, StreamBase, entries_from_reply
from pipeline.wire import GENERATORS

ALONE_TTL_S = 86_400
"""How long the count of an entry's starts alone (`WorkReader.mark_alone`) lasts after the last."""


STREAM_GONE = ("NOGROUP", "requires the key to exist", "the stream key no longer exists")
"""What Redis answers a read of a stream that was deleted under its readers (`WorkReader._with_groups`)."""


class WorkReader(StreamBase):
    """What a worker reads from the group `generators`, and the marks it keeps on what it reads."""

    def join(self, consumer: str) -> None:
        """Make `consumer`'s inbox (a stream only it reads, for the sessions pinned to it) and its group."""
        self.ensure_group(self.keys.inbox(consumer), GENERATORS)

    def read_work(self, consumer: str, count: int, block_ms: int | None) -> list[Entry]:
        """New entries for `consumer`, waiting up to `block_ms` for some: partial rollouts first, then its inbox, then
        prompts. A worker waits here only once `take` found nothing, with a small `count`: Redis hands each new entry
        to the reader that has waited longest, so a burst that finds several workers waiting wakes each in turn.

        One XREADGROUP over the three streams applies its COUNT to each, so it may return up to `count` from each; the
        caller holds what it has no room for (`consumers.worker`)."""
        streams = [self.keys.partials, self.keys.inbox(consumer), self.keys.prompts]
        entries = self._read_new(consumer, dict.fromkeys(streams, ">"), count, self._block(block_ms))
        return _in_order(streams, entries)

    def leftovers(self, consumer: str, count: int) -> list[Entry]:
        """What an earlier process under the name `consumer` left pending (it died, and this one, starting, took its
        name): its history in the group, read again (`XREADGROUP` from id 0, a delivery each, so that an entry that
        keeps killing its worker still becomes a dead letter), partials first, then its inbox, then prompts, at most
        `count` a stream. Only for a worker that has read nothing yet: its own entries would come back too. Entries
        deleted while pending are acked."""
        streams = [self.keys.partials, self.keys.inbox(consumer), self.keys.prompts]
        reply = self._with_groups(
            consumer, lambda: self.redis.xreadgroup(GENERATORS, consumer, dict.fromkeys(streams, "0"), count=count)
        )
        entries = entries_from_reply(reply)
        for entry in entries:
            if not entry.fields:
                self.redis.xack(entry.stream, GENERATORS, entry.id)
        return _in_order(streams, [entry for entry in entries if entry.fields])

    def take(self, consumer: str, room: int, held: int, horizon_ms: int) -> tuple[list[Entry], bool]:
        """New entries for one worker of a fleet, without waiting: partials first, then its inbox, then prompts; of
        partials and prompts at most its share of the work (`lua/share.lua`): what waits over the workers that asked
        for work within `horizon_ms`, less what it holds (`held` entries) beyond the one of them that holds least, and
        no more than its `room`. So a step's work spreads over the workers with room rather than going to the first
        one to ask, and a lone worker still takes all that fits. Also returns whether it is another worker's turn:
        this one took nothing, and holds its share of what waits, or more than the worker that holds least (then it
        should not wait in a blocking read either: Redis would hand it the next new entry if it waited longest).

        While partials wait, they are read alone first (right after an abort sync), so that a worker does not sit on
        prompts behind them while others wait; the rest of the share then comes from the inbox and prompts, in one
        XREADGROUP with the share as its COUNT, which Redis applies to each stream: while both hold work it returns
        more than the share (the caller holds what has no room)."""
        keys = self.keys
        fleet_keys = [keys.partials, keys.prompts, keys.ready, keys.ready_held]
        args: list[str | int] = [GENERATORS, consumer, room, held, horizon_ms]
        share_script = self.scripts["share"]
        share, waiting, partials, above = self._with_groups(consumer, lambda: share_script(keys=fleet_keys, args=args))
        if not share:
            if not (waiting or above):
                return [], False
            mine = self._read_new(consumer, {keys.inbox(consumer): ">"}, room, None)  # its own: no turns
            return mine, not mine
        first = self._read_new(consumer, {keys.partials: ">"}, share, None) if partials else []
        if len(first) >= share:
            return first, False
        rest = {keys.inbox(consumer): ">", keys.prompts: ">"}
        entries = self._read_new(consumer, rest, share - len(first), None)
        return first + sorted(entries, key=lambda e: e.stream == keys.prompts), False  # the inbox's first

    def claim_abandoned(
        self, consumer: str, min_idle_ms: int, count: int, quick_ms: int = 1000, horizon_ms: int = 3000, held: int = 0
    ) -> tuple[list[Entry], bool]:
        """Take over work whose owner stopped (`lua/claim.lua`), partials first, oldest first: the entries of a worker
        whose heartbeat has been silent longer than the silence it declared (`{ns}:beats`), once idle `quick_ms`, and
        any entry idle past `min_idle_ms` (an owner that stopped touching it); at most `count`, and the claimer's share
        of them over the workers with room (the ready set, as `take` counts it, within `horizon_ms`, less what it holds,
        `held` entries, beyond the worker there that holds least). Also returns whether such work was found that is
        another worker's turn (this one claimed none).

        Pending entries that were deleted meanwhile are acked.
        """
        streams = [self.keys.partials, self.keys.prompts]
        args: list[str | int] = [GENERATORS, consumer, min_idle_ms, count, quick_ms, horizon_ms, held]
        keys = [*streams, self.keys.ready, self.keys.ready_held, self.keys.beats]
        reply = self.scripts["claim"](keys=keys, args=args)
        return _entries_per_stream(streams, reply[:2]), bool(reply[2])

    def touch(self, consumer: str, entries: Iterable[Entry]) -> None:
        """Reset the idle time of work still in progress, so that nobody claims it from a live worker."""
        pipe = self.redis.pipeline(transaction=False)
        touch_pending(pipe, consumer, entries)
        pipe.execute()

    def delivery_count(self, entry: Entry) -> int:
        """How many times the group has handed this entry out (1 on first delivery)."""
        pending = self.redis.xpending_range(entry.stream, GENERATORS, min=entry.id, max=entry.id, count=1)
        return int(pending[0]["times_delivered"]) if pending else 0

    def mark_alone(self, entry: Entry) -> None:
        """Count a start of `entry` alone on its worker (`Keys.alone`), for `ALONE_TTL_S` from now."""
        key = self.keys.alone(entry.stream, entry.id)
        pipe = self.redis.pipeline(transaction=True)
        pipe.incr(key)
        pipe.expire(key, ALONE_TTL_S)
        pipe.execute()

    def alone_runs(self, entry: Entry) -> int:
        """How often `entry` was started alone (`mark_alone`) without its mark going: its runs alone that did not
        finish, when it is handed out again."""
        return int(self.redis.get(self.keys.alone(entry.stream, entry.id)) or 0)

    def forget_alone(self, entry: Entry) -> None:
        self.redis.delete(self.keys.alone(entry.stream, entry.id))

    def _read_new(self, consumer: str, streams: dict[str, str], count: int, block_ms: int | None) -> list[Entry]:
        def read() -> Any:
            return self.redis.xreadgroup(GENERATORS, consumer, stream_ids(streams), count=count, block=block_ms)

        return [entry for entry in entries_from_reply(self._with_groups(consumer, read)) if entry.fields]

    def _with_groups(self, consumer: str, call: Callable[[], Any]) -> Any:
        """`call()`, once more after making the groups (and `consumer`'s inbox) again if a stream was deleted under
        its readers (or a reader never joined): Redis then answers NOGROUP, or that the key must exist, or (Redis 7,
        to a read blocked on it) that it no longer exists: a manager that evicts a stopped worker deletes its inbox
        as it hands what was there back, and the worker, woken, then reads its eviction."""
        try:
            return call()
        except redis.ResponseError as exc:
            if not any(sign in str(exc) for sign in STREAM_GONE):
                raise
            self.ensure_groups()
            self.join(consumer)
            return call()


def _in_order(streams: Sequence[str], entries: Iterable[Entry]) -> list[Entry]:
    """`entries` by the order of their streams in `streams` (each stream's own order kept)."""
    order = {stream: k for k, stream in enumerate(streams)}
    return sorted(entries, key=lambda e: order[e.stream])


def _entries_per_stream(streams: Sequence[str], reply: Any) -> list[Entry]:
    """The entries of a script's reply that holds, per stream of `streams`, `{id, {field, value, ...}}` pairs."""
    return [
        Entry(stream, entry_id, dict(zip(flat[::2], flat[1::2], strict=True)))
        for stream, items in zip(streams, reply, strict=True)
        for entry_id, flat in items
    ]
