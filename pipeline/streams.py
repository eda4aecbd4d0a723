"""The stream layer: consumer groups, reading, claiming, publishing, dead letters, trimming.

`Streams` is the facade every side uses for the streams of the wire contract (reads, claims, acks, publishes), so
that workers, the trainer client and the CLI share one implementation; the worker registry (`streams.registry`,
`pipeline.registry`) and the control stream with its doorbells (`streams.control`, `pipeline.control`) are
mechanisms of their own, reached through it. It is synchronous; the asyncio worker calls it from a thread, which
keeps one code path for both sides.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, cast

import hiredis
import redis

from pipeline.codec import for_redis, stream_ids
from pipeline.connections import socket_timeout_s
from pipeline.control import ControlStream
from pipeline.durability import confirm, durability_of, without_waiting
from pipeline.lua import register_all
from pipeline.registry import Registry, touch_pending
from pipeline.wire import (
    GENERATORS,
    SCORER,
    SCORERS,
    TRAINER,
    Fields,
    Keys,
    Partial,
    Prompt,
    Rollout,
    dead_letter_fields,
)

SCRIPTS = Path(__file__).with_name("lua")
"""Where `publish.lua`, `claim.lua`, `forward.lua`, `rehome.lua` and `dead_letter.lua` live."""
DEDUPE_BUCKETS = 8
"""The dedupe TTL is cut into this many time buckets (one hash each): a publish checks ~9 `HGET`s per prompt."""
TRIM_CHUNK = 500
"""Entries one `XTRIM` of `trim_consumed` frees at most: a few MB of 1k-token rollouts, a short stop for Redis."""
BLOCK_MARGIN_MS = 1000
"""A blocking read waits at least this much less than its client's socket timeout (`Streams._block`)."""
ALONE_TTL_S = 86_400
"""How long the count of an entry's starts alone (`Streams.mark_alone`) lasts after the last."""


class Entry(NamedTuple):
    stream: str
    id: bytes
    fields: Fields


def entries_from_reply(reply: Any) -> list[Entry]:
    """Flatten an XREAD/XREADGROUP reply, whatever protocol the client speaks.

    RESP2 gives `[[stream, [(id, fields), ...]], ...]`; RESP3 gives `{stream: [[(id, fields), ...]]}`.
    Entries deleted while pending come back with no fields (`Entry.fields` empty): callers that
    re-read pending entries ack those (`Streams.read_rollouts`); everyone else skips them.
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


class Streams:
    """The streams of one namespace, over one Redis client."""

    def __init__(self, client: redis.Redis, ns: str, dedupe_ttl_s: int = 86_400) -> None:
        self.redis = client
        self.keys = Keys(ns)
        self.dedupe_ttl_s = dedupe_ttl_s
        self.clock: Callable[[], float] = time.time
        """The dedupe buckets' clock (a test moves it)."""
        scripts = register_all(client, SCRIPTS)
        self._publish, self._claim, self._forward = scripts["publish"], scripts["claim"], scripts["forward"]
        self._share = scripts["share"]
        self._dead_letter = scripts["dead_letter"]
        self.durability = durability_of(client)
        """When a write counts as done (the URL's `durability=`): `_pipelined` waits for it as the client does."""
        timeout_s = socket_timeout_s(client)
        self._max_block_ms = None if timeout_s is None else max(1, int(timeout_s * 1000) - BLOCK_MARGIN_MS)
        """The longest a blocking read may wait on this client (`_block`); None: any."""
        self.registry = Registry(client, self.keys, scripts["rehome"], scripts["beat"])
        """The workers: heartbeats, who lives, rehoming a departed worker's inbox."""
        self.control = ControlStream(self)
        """The control stream and the workers' doorbells."""

    def ensure_groups(self) -> None:
        """Create the consumer groups (and their streams) if missing; safe to call from every process."""
        for stream, group in (
            (self.keys.prompts, GENERATORS),
            (self.keys.partials, GENERATORS),
            (self.keys.rollouts, TRAINER),
        ):
            try:
                self.redis.xgroup_create(stream, group, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    # -- producer side -------------------------------------------------------------------------

    def add_prompts(self, prompts: Sequence[Prompt]) -> list[bytes]:
        pipe = self.redis.pipeline(transaction=False)
        for prompt in prompts:
            pipe.xadd(self.keys.prompts, for_redis(prompt.to_fields()))
        return pipe.execute()

    # -- worker side ---------------------------------------------------------------------------

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
        entries = self._read_group_new(consumer, dict.fromkeys(streams, ">"), count, self._block(block_ms))
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
        share, waiting, partials, above = self._with_groups(consumer, lambda: self._share(keys=fleet_keys, args=args))
        if not share:
            if not (waiting or above):
                return [], False
            mine = self._read_group_new(consumer, {keys.inbox(consumer): ">"}, room, None)  # its own: no turns
            return mine, not mine
        first = self._read_group_new(consumer, {keys.partials: ">"}, share, None) if partials else []
        if len(first) >= share:
            return first, False
        rest = {keys.inbox(consumer): ">", keys.prompts: ">"}
        entries = self._read_group_new(consumer, rest, share - len(first), None)
        return first + sorted(entries, key=lambda e: e.stream == keys.prompts), False  # the inbox's first

    def _read_group_new(self, consumer: str, streams: dict[str, str], count: int, block_ms: int | None) -> list[Entry]:
        def read() -> Any:
            return self.redis.xreadgroup(GENERATORS, consumer, stream_ids(streams), count=count, block=block_ms)

        return [entry for entry in entries_from_reply(self._with_groups(consumer, read)) if entry.fields]

    def _with_groups(self, consumer: str, call: Callable[[], Any]) -> Any:
        """`call()`, once more after making the groups (and `consumer`'s inbox) again if a stream was deleted under
        its readers (or a reader never joined): Redis then answers NOGROUP, or that the key must exist."""
        try:
            return call()
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc) and "requires the key to exist" not in str(exc):
                raise
            self.ensure_groups()
            self.join(consumer)
            return call()

    def add_to_inbox(self, worker: str, prompt: Prompt) -> bytes:
        return cast(bytes, self.redis.xadd(self.keys.inbox(worker), for_redis(prompt.to_fields())))

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
        reply = self._claim(keys=keys, args=args)
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

    def publish_rollouts(
        self,
        rollouts: Sequence[Rollout],
        source: Entry,
        partials: Sequence[Partial] = (),
        reply_to: str | None = None,
    ) -> int:
        """Publish what was made from `source` and ack it, atomically, in one round trip.

        `partials` (samples an abort pause interrupted) go to `{ns}:partials` in the same step, so
        an interrupted sample is never both lost and acked. Rollouts that name a `reward_fn` go to
        `{ns}:scoring` instead of `{ns}:rollouts`: the scoring stage forwards them once scored.
        Rollouts of a prompt that names a gateway in `reply_to` go to that gateway's `{ns}:replies:{name}`.
        Returns how many rollouts were published: fewer when some ids were already published, -1
        when `source` had already been acked (another worker finished it first; then nothing is written).
        """
        result = self.publish_many([Publish(rollouts, source, partials, reply_to)])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def publish_many(self, publishes: Sequence[Publish]) -> list[int | Exception]:
        """`publish_rollouts` for several source entries in one pipelined round trip: each is still its own atomic
        script (its rollouts published and its entry acked together, or nothing), so one that fails (its result is
        the exception) leaves the others done. What a worker finishes at the same moment goes out together."""
        return publish_results(self._run_publish(self.publish_commands(publishes)))

    def publish_commands(self, publishes: Sequence[Publish]) -> list[bytes]:
        """Each publish's script call, packed: what `publish_many` sends, and what an asyncio publisher
        (`pipeline.publisher`) sends itself. The script goes by its SHA: a `NoScriptError` in a reply means that
        call ran nothing (`script_unknown`), and it can be sent again once `load_publish` has run."""
        buckets, expiry_s = self.dedupe_buckets()
        commands = []
        for publish in publishes:
            target = self.keys.scoring if any(r.reward_fn for r in publish.rollouts) else self.keys.rollouts
            if publish.reply_to is not None:
                target = self.keys.replies(publish.reply_to)
            keys = [target, publish.source.stream, self.keys.partials, *buckets]
            args: list[Any] = [GENERATORS, publish.source.id, expiry_s, len(publish.partials)]
            for partial in publish.partials:
                _append_fields(args, partial.to_fields())
            _append_rollouts(args, publish.rollouts)
            commands.append(self._publish_command(keys, args))
        return commands

    def _publish_command(self, keys: list[str], args: list[Any]) -> bytes:
        return cast(bytes, hiredis.pack_command(("EVALSHA", self._publish.sha, len(keys), *keys, *args)))

    def load_publish(self) -> None:
        """Load the publish script into Redis again (a restarted Redis, or `SCRIPT FLUSH`)."""
        self._publish.sha = self.redis.script_load(self._publish.script)

    def _run_publish(self, commands: list[bytes]) -> list[Any]:
        """The publish script calls in one pipelined write (not redis-py's pipelined `Script`, which asks `SCRIPT
        EXISTS` in a round trip of its own before every pipeline); each call's reply or its error. Every sync publish
        goes through here: `publish_many`, replay and the gateway's finished sessions."""
        results = self._pipelined(commands)
        if unknown := script_unknown(results):  # Redis restarted or its scripts were flushed: those ran nothing
            self.load_publish()
            for i, result in zip(unknown, self._pipelined([commands[i] for i in unknown]), strict=True):
                results[i] = result
        return results

    def _pipelined(self, commands: list[bytes]) -> list[Any]:
        """Commands packed beforehand (`hiredis.pack_command`), sent in one write on one connection of the client's
        pool, and each one's reply read back, an error reply as its exception: redis-py's non-transactional pipeline,
        without its per-argument work. A publish carries ~35 arguments a rollout, and redis-py's pipeline works on each
        (its `evalsha` wrapper inspects it, its packer copies it in a generator before hiredis packs it, then each reply
        is parsed through its callbacks); this only packs, writes and reads. A lost connection is retried as redis-py
        retries a pipeline (the client's retry policy: disconnect, then send the whole batch again), which the publish
        script allows: a call that ran already finds its entry acked and writes nothing (-1)."""
        pool = self.redis.connection_pool
        connection = pool.get_connection()

        def exchange() -> list[Any]:
            connection.send_packed_command(commands)
            replies: list[Any] = []
            for _ in commands:
                try:
                    replies.append(connection.read_response())
                except redis.ResponseError as exc:  # this command's error: the next replies are still read
                    replies.append(exc)
            if self.durability.waits:
                confirm(
                    connection, self.durability
                )  # NotDurableError: the batch is sent again, as on a lost connection
            return replies

        try:
            return connection.retry.call_with_retry(exchange, lambda error, *_: connection.disconnect())
        except BaseException:
            connection.disconnect()  # replies may be left unread: the next user of this connection must not get them
            raise
        finally:
            pool.release(connection)

    def dedupe_buckets(self, now: float | None = None) -> tuple[list[str], int]:
        """The dedupe hashes a publish checks (oldest first, the current one last), and the current one's expiry.

        The TTL is cut into `DEDUPE_BUCKETS` buckets of `size` seconds: an id published within the TTL is in one of
        the last `ceil(ttl / size) + 1` buckets, and a bucket lives `size` seconds past the last it can be needed.
        Redis holds a few bytes per rollout (a bit in its prompt's bitmap) and a few dozen keys, not a key per id."""
        size = max(1, math.ceil(self.dedupe_ttl_s / DEDUPE_BUCKETS))
        current = int((self.clock() if now is None else now) // size)
        span = math.ceil(self.dedupe_ttl_s / size)
        return [self.keys.published(size, b) for b in range(current - span, current + 1)], (span + 2) * size

    def read(self, after: Mapping[str, bytes], count: int, block_ms: int | None) -> list[Entry]:
        """Entries of these streams after the ids given (`XREAD`, no consumer group), blocking up to `block_ms`."""
        return entries_from_reply(self.redis.xread(stream_ids(after), count=count, block=self._block(block_ms)))

    def _block(self, block_ms: int | None) -> int | None:
        """How long a blocking read may wait: `block_ms`, kept `BLOCK_MARGIN_MS` under the client's socket timeout.

        redis-py 8 gives every connection a 5 s socket timeout by default. A read that blocks longer times out in
        the client, and the reconnecting retry (`pipeline.connections`) sends it again, and again: a worker asked
        to block 5 s would never come back to see that it should stop. Every reader here loops on an empty
        read, so a shorter wait costs one more round trip, nothing else. `0` (Redis: wait forever) is capped too."""
        if block_ms is None or self._max_block_ms is None:
            return block_ms
        return self._max_block_ms if block_ms == 0 else min(block_ms, self._max_block_ms)

    def dead_letter(self, entry: Entry, error: str, stage: str) -> bool:
        """Move a bad entry to `{ns}:dead` with the reason and ack it, in one step (`lua/dead_letter.lua`), if it
        is still pending; returns whether it was (an entry dead-lettered already is not dead-lettered twice)."""
        group = {self.keys.rollouts: TRAINER, self.keys.scoring: SCORERS}.get(entry.stream, GENERATORS)
        args: list[Any] = [group, entry.id]
        for name, value in dead_letter_fields(entry.fields, error, stage).items():
            args += [name, value]
        return bool(self._dead_letter(keys=[entry.stream, self.keys.dead], args=args))

    # -- gateway side: replies to the prompts it queued ------------------------------------------

    def read_replies(self, gateway: str, after: bytes, block_ms: int | None) -> list[Entry]:
        """Rollouts on `gateway`'s reply stream after `after` (read without a group: one reader, it deletes them)."""
        return [e for e in self.read({self.keys.replies(gateway): after}, 512, block_ms) if e.fields]

    def delete_replies(self, gateway: str, ids: Sequence[bytes]) -> None:
        if ids:
            self.redis.xdel(self.keys.replies(gateway), *ids)

    # -- trainer side --------------------------------------------------------------------------

    def read_rollouts(
        self, consumer: str, count: int, block_ms: int | None, pending: bool = False, after: bytes = b"0"
    ) -> list[Entry]:
        """New rollouts for `consumer`; with `pending`, those it was handed before but never acked, after
        the id `after` (page through them by passing the last id read: they stay pending until acked).

        Pending entries deleted meanwhile (an `XDEL`, a `MAXLEN` trim by someone else) come back
        with no fields; they are acked here, since nobody can ever deliver them.
        """
        start = after if pending else ">"
        return self._read_group(self.keys.rollouts, TRAINER, consumer, count, block_ms, start)

    def ack_rollouts(self, ids: Sequence[bytes]) -> None:
        if ids:
            self.redis.xack(self.keys.rollouts, TRAINER, *ids)

    # -- any other group on a stream (the recorder's on `rollouts`) and replay --------------------

    def ensure_group(self, stream: str, group: str) -> None:
        """A consumer group of its own on `stream`, from the stream's start (so it reads what is still there)."""
        try:
            self.redis.xgroup_create(stream, group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def read_group(
        self, stream: str, group: str, consumer: str, count: int, block_ms: int | None, pending_after: bytes | None
    ) -> list[Entry]:
        """New entries for `consumer` of `group`; with `pending_after` (`b"0"` for the first page), those it was
        handed before and never acked, after that id. Deleted pending entries are acked."""
        start = ">" if pending_after is None else pending_after
        return self._read_group(stream, group, consumer, count, block_ms, start)

    def ack(self, stream: str, group: str, ids: Sequence[bytes], chunk: int = 10_000) -> int:
        """Ack `ids` in `group`, a chunk per command (a recording file may hold a great many); returns how many."""
        pipe = self.redis.pipeline(transaction=False)
        for at in range(0, len(ids), chunk):
            pipe.xack(stream, group, *ids[at : at + chunk])
        return sum(pipe.execute())

    def add_rollouts(self, rollouts: Sequence[Rollout]) -> int:
        """Put `rollouts` on `{ns}:rollouts` with their ids unchanged, skipping every id already published here
        (the publish dedupe: `lua/publish.lua` with no source entry); returns how many were added. Replay and the
        gateway's finished sessions add rollouts this way."""
        if not rollouts:
            return 0
        buckets, expiry_s = self.dedupe_buckets()
        keys = [self.keys.rollouts, self.keys.rollouts, self.keys.partials, *buckets]
        args: list[Any] = [GENERATORS, "", expiry_s, 0]  # no source entry to ack, no partials
        _append_rollouts(args, rollouts)
        (result,) = self._run_publish([self._publish_command(keys, args)])
        if isinstance(result, Exception):
            raise result
        return int(result)

    def _read_group(
        self, stream: str, group: str, consumer: str, count: int, block_ms: int | None, start: str | bytes
    ) -> list[Entry]:
        """`start` `>`: new entries; an id: the consumer's pending entries after it (`0`: from the first)."""
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

    # -- scoring stage ---------------------------------------------------------------------------

    def ensure_scoring_group(self) -> None:
        """The scoring stage's consumer group on `{ns}:scoring`, from the stream's start (so nothing
        workers published before the first scorer started is missed)."""
        try:
            self.redis.xgroup_create(self.keys.scoring, SCORERS, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def scorer_alive(self) -> bool:
        """Whether a scoring stage reads `{ns}:scoring` now: its leader holds `{ns}:scorer:lease`, renewed every step
        and gone `--lease-s` after the leader stops (the scorer's heartbeat)."""
        return bool(self.redis.exists(self.keys.scorer_lease))

    def read_scoring(self, count: int, block_ms: int | None, pending_after: bytes | None = None) -> list[Entry]:
        """Rollouts awaiting a reward; with `pending_after` (`b"0"` for the first page), those the scorer
        (any holder of the lease) took and never forwarded. Deleted pending entries are acked."""
        start = ">" if pending_after is None else pending_after
        return self._read_group(self.keys.scoring, SCORERS, SCORER, count, block_ms, start)

    def forward_scored(self, rollouts: Sequence[Rollout], read: Sequence[bytes]) -> int:
        """Ack the `{ns}:scoring` entries `read` and add the scored `rollouts` to `{ns}:rollouts`, atomically.

        Returns the rollouts added, or -1 when none of `read` was pending any more (nothing written).
        """
        args: list[Any] = [SCORERS, len(read), *read]
        for rollout in rollouts:
            _append_fields(args, rollout.to_fields())
        return int(self._forward(keys=[self.keys.rollouts, self.keys.scoring], args=args))

    # -- upkeep --------------------------------------------------------------------------------

    def trim_consumed(self, stream: str) -> int:
        """Drop entries every consumer group has finished with, never one still unread or pending.

        In chunks of `TRIM_CHUNK` entries, one command each, so that Redis serves other clients in between: one
        `XTRIM` of tens of thousands of large entries holds Redis for tens of milliseconds. A stream that is not
        there (never written, or lost with a primary whose writes no replica had) has nothing to trim."""
        try:
            groups = self.redis.xinfo_groups(stream)
        except redis.ResponseError as exc:
            if "no such key" not in str(exc).lower():
                raise
            return 0
        if not groups:
            return 0
        keep_from = []
        for group in groups:
            pending = self.redis.xpending(stream, group["name"])
            if pending["pending"]:
                keep_from.append(_parse_id(pending["min"]))
            else:
                ms, seq = _parse_id(group["last-delivered-id"])
                keep_from.append((ms, seq + 1))
        ms, seq = min(keep_from)
        minid, trimmed = f"{ms}-{seq}", 0
        soft = without_waiting(self.redis)  # a trim lost with a primary is done again at the next: no durability wait
        while freed := soft.xtrim(stream, minid=minid, approximate=True, limit=TRIM_CHUNK):
            trimmed += freed  # whole stream nodes, at most TRIM_CHUNK entries a command
        return trimmed + soft.xtrim(stream, minid=minid, approximate=False)  # what is left: part of one node


class Publish(NamedTuple):
    """What a worker made of one source entry: its rollouts, the samples a pause interrupted, where the rollouts
    go (`reply_to`: a gateway's replies), and the entry to ack with them."""

    rollouts: Sequence[Rollout]
    source: Entry
    partials: Sequence[Partial] = ()
    reply_to: str | None = None


def script_unknown(replies: Sequence[Any]) -> list[int]:
    """Where in `replies` Redis did not know the script called (those calls ran nothing)."""
    return [i for i, reply in enumerate(replies) if isinstance(reply, redis.exceptions.NoScriptError)]


def publish_results(replies: Sequence[Any]) -> list[int | Exception]:
    """The publish script's replies as `publish_many` returns them: a count, -1, or the call's error."""
    return [r if isinstance(r, Exception) else int(r) for r in replies]


def _append_fields(args: list[Any], fields: Fields) -> None:
    args.append(2 * len(fields))
    for pair in fields.items():
        args.extend(pair)


def _append_rollouts(args: list[Any], rollouts: Sequence[Rollout]) -> None:
    """The publish script's rollout arguments: prompt id, sample, field count, fields... for each (what the rollouts
    of a group share, encoded once)."""
    shared: dict[int, bytes] = {}
    for rollout in rollouts:
        args += [rollout.prompt_id, rollout.sample]
        _append_fields(args, rollout.to_fields(shared))


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


def _parse_id(entry_id: bytes | str) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)
