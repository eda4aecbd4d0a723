"""The writer: prompts onto `{ns}:prompts` and inboxes, rollouts published (with their source acked) and deduped."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, cast

import hiredis
import redis
from redis.commands.core import Script

from pipeline.codec import for_redis
from pipeline.durability import confirm, durability_of
from pipeline.streams.base import Entry, StreamBase
from pipeline.wire import GENERATORS, Fields, Partial, Prompt, Rollout

DEDUPE_BUCKETS = 8
"""The dedupe TTL is cut into this many time buckets (one hash each): a publish checks ~9 `HGET`s per prompt."""


class Publish(NamedTuple):
    """What a worker made of one source entry: its rollouts, the samples a pause interrupted, where the rollouts
    go (`reply_to`: a gateway's replies), and the entry to ack with them."""

    rollouts: Sequence[Rollout]
    source: Entry
    partials: Sequence[Partial] = ()
    reply_to: str | None = None


class Writer(StreamBase):
    """What producers and workers write: prompts, and rollouts published atomically with the ack of their source."""

    def __init__(
        self, client: redis.Redis, ns: str, scripts: Mapping[str, Script] | None = None, dedupe_ttl_s: int = 86_400
    ) -> None:
        super().__init__(client, ns, scripts)
        self.dedupe_ttl_s = dedupe_ttl_s
        self.clock: Callable[[], float] = time.time
        """The dedupe buckets' clock (a test moves it)."""
        self.durability = durability_of(client)
        """When a write counts as done (the URL's `durability=`): `_pipelined` waits for it as the client does."""

    def add_prompts(self, prompts: Sequence[Prompt]) -> list[bytes]:
        pipe = self.redis.pipeline(transaction=False)
        for prompt in prompts:
            pipe.xadd(self.keys.prompts, for_redis(prompt.to_fields()))
        return pipe.execute()

    def add_to_inbox(self, worker: str, prompt: Prompt) -> bytes:
        return cast(bytes, self.redis.xadd(self.keys.inbox(worker), for_redis(prompt.to_fields())))

    def publish_rollouts(
        self, rollouts: Sequence[Rollout], source: Entry, partials: Sequence[Partial] = (), reply_to: str | None = None
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
                append_fields(args, partial.to_fields())
            _append_rollouts(args, publish.rollouts)
            commands.append(self._publish_command(keys, args))
        return commands

    def load_publish(self) -> None:
        """Load the publish script into Redis again (a restarted Redis, or `SCRIPT FLUSH`)."""
        script = self.scripts["publish"]
        script.sha = self.redis.script_load(script.script)

    def dedupe_buckets(self, now: float | None = None) -> tuple[list[str], int]:
        """The dedupe hashes a publish checks (oldest first, the current one last), and the current one's expiry.

        The TTL is cut into `DEDUPE_BUCKETS` buckets of `size` seconds: an id published within the TTL is in one of
        the last `ceil(ttl / size) + 1` buckets, and a bucket lives `size` seconds past the last it can be needed.
        Redis holds a few bytes per rollout (a bit in its prompt's bitmap) and a few dozen keys, not a key per id."""
        size = max(1, math.ceil(self.dedupe_ttl_s / DEDUPE_BUCKETS))
        current = int((self.clock() if now is None else now) // size)
        span = math.ceil(self.dedupe_ttl_s / size)
        return [self.keys.published(size, b) for b in range(current - span, current + 1)], (span + 2) * size

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

    def _publish_command(self, keys: list[str], args: list[Any]) -> bytes:
        return cast(bytes, hiredis.pack_command(("EVALSHA", self.scripts["publish"].sha, len(keys), *keys, *args)))

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


def script_unknown(replies: Sequence[Any]) -> list[int]:
    """Where in `replies` Redis did not know the script called (those calls ran nothing)."""
    return [i for i, reply in enumerate(replies) if isinstance(reply, redis.exceptions.NoScriptError)]


def publish_results(replies: Sequence[Any]) -> list[int | Exception]:
    """The publish script's replies as `publish_many` returns them: a count, -1, or the call's error."""
    return [r if isinstance(r, Exception) else int(r) for r in replies]


def append_fields(args: list[Any], fields: Fields) -> None:
    """A script's arguments for one entry: its field count (names and values), then the names and values."""
    args.append(2 * len(fields))
    for pair in fields.items():
        args.extend(pair)


def _append_rollouts(args: list[Any], rollouts: Sequence[Rollout]) -> None:
    """The publish script's rollout arguments: prompt id, sample, field count, fields... for each (what the rollouts
    of a group share, encoded once)."""
    shared: dict[int, bytes] = {}
    for rollout in rollouts:
        args += [rollout.prompt_id, rollout.sample]
        append_fields(args, rollout.to_fields(shared))
