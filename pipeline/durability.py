"""When a write counts as done: the durability modes, chosen in the Redis URL (`?durability=replica`).

Redis acknowledges a write once it is in the primary's memory; its replicas and its AOF's fsync follow later. A
primary that dies takes the writes not yet on a replica with it (asynchronous replication), and one restarted from its
AOF loses up to a second of writes under `appendfsync everysec`. The modes:

- `default`: done once the primary has it. A dead primary loses what its replicas (or its AOF, if it restarts from
  it) had not yet got.
- `aof`: done once the primary's AOF has it on disk (`WAITAOF 1 0`: Redis >= 7.2, Valkey). Nothing lost if the
  primary restarts from that disk; a failover to a replica still loses what the replica lacked.
- `replica`: done once `replicas` replicas have it (`WAIT N`). Nothing lost if a replica that had it is the one
  promoted (Sentinel promotes the most up-to-date replica).
- `replica-aof`: done once `replicas` replicas have it on disk (`WAITAOF 0 N`: Redis >= 7.2, Valkey). Nothing lost
  even if every server restarts at once.

How: after each write, on the same connection (`WAIT` counts that connection's writes), the client asks for the mode's
`WAIT`/`WAITAOF` and checks the count it returns; behind Sentinel it then checks that the Sentinels still name that
server the primary (a stale primary back after a failover can have a replica that acknowledges, until Sentinel makes
that replica follow the new primary and it drops what it had). A short count (`timeout_ms` passed: a replica down or
lagging) asks again on that connection, for up to `patience_s`. Past that, or if the server refuses to wait (Sentinel
made it a replica), the call fails with `NotDurableError`, a `redis.ConnectionError`: the client's retry policy drops
the connection and sends the write again, to the primary Sentinel names now (a command retried after a lost connection
may run twice already: every write the pipeline makes allows it; a script that finds its first run done, an admission's
marker or a sync's token, writes all the same, so that the wait on the new connection covers the first run's writes),
until it is durable or the retries run out; then the caller treats it as not done (a worker leaves its prompt pending, a
trainer's `submit` raises). The writes covered are every write command, script and transaction of a client that
`connections.connect` made: publishes and their acks, admissions, syncs' begins, acks and version bumps; not heartbeats
(`without_waiting`: soft state, written again every period; one held back while no replica follows a new primary would
make its worker look dead). A blocking read that moves entries into a group's pending list (`XREADGROUP`) is not waited
for: lost, the entries are handed out again, and a publish already made of them is dropped as a duplicate."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
import redis.client

Mode = Literal["default", "aof", "replica", "replica-aof"]
MODES: tuple[Mode, ...] = ("default", "aof", "replica", "replica-aof")
OPTIONS = ("durability", "replicas", "durability_timeout_ms")
"""The URL query options this module reads (and takes out of the URL before redis-py sees it)."""
WAITAOF_SINCE = (7, 2, 0)

WRITES = frozenset(
    b"EVAL EVALSHA EVAL_RO FCALL XADD XACK XCLAIM XAUTOCLAIM XDEL XTRIM XGROUP XSETID SET SETEX PSETEX SETNX MSET "
    b"GETSET GETDEL GETEX DEL UNLINK COPY RENAME RENAMENX EXPIRE PEXPIRE EXPIREAT PEXPIREAT PERSIST HSET HSETNX "
    b"HMSET HDEL HINCRBY HINCRBYFLOAT INCR INCRBY INCRBYFLOAT DECR DECRBY APPEND SETRANGE ZADD ZREM ZINCRBY "
    b"ZREMRANGEBYSCORE ZREMRANGEBYRANK ZPOPMIN ZPOPMAX SADD SREM SPOP SMOVE LPUSH RPUSH LPOP RPOP LREM LSET LTRIM "
    b"LMOVE RPOPLPUSH PFADD RESTORE".split()
)
"""Commands that change data: each is followed by the mode's wait. (`EVAL_RO` is listed for safety: cheap.)"""


STALE = (
    "acknowledged by a server the Sentinels no longer name the primary (a stale primary, back after a failover with "
    "a replica still following it): sending it again, to the primary they name"
)


class NotDurableError(redis.ConnectionError):
    """A write that fewer servers acknowledged than the durability mode asks for, within its timeout. A
    `ConnectionError`, so that the client's retry policy sends it again on a new connection."""


@dataclass(frozen=True)
class Durability:
    mode: Mode = "default"
    replicas: int = 1
    """How many replicas must have a write (`replica`, `replica-aof`)."""
    timeout_ms: int = 1000
    """How long one wait may take; a short count waits again, on the same connection, for up to `patience_s`."""
    patience_s: float = 10.0
    """How long a write waits for its acknowledgements in all before it counts as not done and is sent again."""

    @property
    def waits(self) -> bool:
        return self.mode != "default"

    def wait_args(self) -> tuple[Any, ...]:
        """The command that waits for this mode's acknowledgements."""
        if self.mode == "replica":
            return ("WAIT", self.replicas, self.timeout_ms)
        if self.mode == "aof":
            return ("WAITAOF", 1, 0, self.timeout_ms)
        return ("WAITAOF", 0, self.replicas, self.timeout_ms)

    def check(self, reply: Any) -> None:
        """Raise `NotDurableError` unless `reply` (the wait's) counts what the mode asks for."""
        if isinstance(reply, Exception):
            raise NotDurableError(f"{self.wait_args()[0]} failed: {reply}") from reply
        if self.mode == "replica":
            got, wanted = int(reply), self.replicas
        else:
            local, replicas = (int(n) for n in reply)
            got, wanted = (local, 1) if self.mode == "aof" else (replicas, self.replicas)
        if got < wanted:
            raise NotDurableError(
                f"durability={self.mode}: {got} of {wanted} acknowledged within {self.timeout_ms} ms "
                "(a replica down or lagging, or this server no longer the primary); sending it again"
            )

    def needs_server(self) -> tuple[int, int, int] | None:
        """The oldest Redis that has this mode's wait (None: any supported one)."""
        return WAITAOF_SINCE if self.mode in ("aof", "replica-aof") else None


def split_url(url: str) -> tuple[str, Durability]:
    """`url` without the durability options, and the mode they name; `ValueError` saying what to fix."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    ours = {k: v for k, v in query if k in OPTIONS}
    if not ours:
        return url, Durability()
    mode = ours.get("durability", "default")
    if mode not in MODES:
        raise ValueError(f"durability={mode!r} in the Redis URL: one of {', '.join(MODES)}")
    try:
        replicas, timeout_ms = int(ours.get("replicas", 1)), int(ours.get("durability_timeout_ms", 1000))
    except ValueError:
        raise ValueError("replicas= and durability_timeout_ms= in the Redis URL take whole numbers") from None
    if replicas < 1 or timeout_ms < 1:
        raise ValueError("replicas= and durability_timeout_ms= in the Redis URL must be at least 1")
    rest = urlencode([(k, v) for k, v in query if k not in OPTIONS])
    return urlunsplit(parts._replace(query=rest)), Durability(mode, replicas, timeout_ms)


def durability_of(client: object) -> Durability:
    """The mode of a client that `connections.connect` made (`default` for any other)."""
    found = getattr(client, "durability", None)
    return found if isinstance(found, Durability) else Durability()


def without_waiting(client: redis.Redis) -> redis.Redis:
    """`client` without its durability mode's wait (the same pool, connections and retry policy): for soft state that
    is written again every period and whose loss costs nothing, such as heartbeats."""
    if not isinstance(client, DurableRedis):
        return client
    return redis.Redis(connection_pool=client.connection_pool)


def confirm(connection: Any, durability: Durability) -> None:
    """Wait on `connection` for what it wrote last to be as durable as `durability` asks: a short count waits again on
    the same connection (the write is not sent twice while the connection lives) for up to `patience_s`; then, or
    when the server refuses to wait (it became a replica), `NotDurableError`."""
    deadline = time.monotonic() + durability.patience_s
    named_primary = getattr(connection, "named_primary", None)  # behind Sentinel (`pipeline.sentinel`)
    while True:
        connection.send_command(*durability.wait_args())
        try:
            reply = connection.read_response()
        except redis.ResponseError as exc:
            reply = exc
        try:
            durability.check(reply)
            break
        except NotDurableError:
            if isinstance(reply, Exception) or time.monotonic() >= deadline:
                raise
            if named_primary is not None and not named_primary():  # no use waiting on a stale primary
                raise NotDurableError(STALE) from None
    if named_primary is not None and not named_primary():
        raise NotDurableError(STALE)


def _writes(command_name: Any) -> bool:
    name = command_name.encode() if isinstance(command_name, str) else bytes(command_name)
    return name.upper() in WRITES


class DurablePipeline(redis.client.Pipeline):
    """A pipeline whose writes, once sent and answered, wait for the client's durability mode on their connection."""

    durability = Durability()

    def _execute_transaction(self, connection: Any, commands: Any, raise_on_error: bool) -> list[Any]:
        replies: list[Any] = super()._execute_transaction(connection, commands, raise_on_error)
        if any(_writes(args[0]) for args, _ in commands):
            confirm(connection, self.durability)
        return replies

    def _execute_pipeline(self, connection: Any, commands: Any, raise_on_error: bool) -> list[Any]:
        replies: list[Any] = super()._execute_pipeline(connection, commands, raise_on_error)  # type: ignore[no-untyped-call]  # redis-py: unannotated
        if any(_writes(args[0]) for args, _ in commands):
            confirm(connection, self.durability)
        return replies


class DurableRedis(redis.Redis):
    """A client whose every write waits for its durability mode (`durability`, set by `connections.connect`)."""

    durability = Durability()

    def _send_command_parse_response(self, conn: Any, command_name: Any, *args: Any, **options: Any) -> Any:
        reply = super()._send_command_parse_response(conn, command_name, *args, **options)  # type: ignore[no-untyped-call]  # redis-py
        if _writes(command_name):
            confirm(conn, self.durability)
        return reply

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> DurablePipeline:
        pipe = DurablePipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)
        pipe.durability = self.durability
        return pipe
