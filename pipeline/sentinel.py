"""Redis behind Sentinel: a `redis+sentinel://` URL names the Sentinels and the service, and every connection asks
them where the primary is whenever it connects.

A client follows a failover by itself. Its connections are redis-py's Sentinel-managed ones (`master_for`) under the
retry policy that `connections.connect` gives every client, so a refused connection or a timeout reconnects, and a
reconnect asks the Sentinels again. A server that is no longer a primary that may write answers `READONLY` (demoted to a
replica; a blocking read on it is woken with `UNBLOCKED`) or `NOREPLICAS` (a stale primary cut off from its replicas,
with `min-replicas-to-write` set): either drops the connection and counts as a lost one, so the command is sent again,
to the primary the Sentinels name now. Every write the pipeline makes is safe to run twice (the README's "Semantics we
chose").

The asyncio twin (`async_connections`, for `pipeline.pipelined`) does the same with connections of its own that ask
the Sentinels through the synchronous client's manager, on a thread: no asyncio Sentinel client, so it works on
any event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
import redis.asyncio.connection
import redis.connection
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError, Sentinel, SentinelConnectionPool, SentinelManagedConnection

SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}
"""The URL schemes of a primary found through Sentinel, and whether its connections (and the Sentinels') use TLS."""

SENTINEL_TIMEOUT_S = 2.0
"""How long a question to one Sentinel may take (connecting, then its answer) before the next one is asked."""

USAGE = "redis+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB][?ssl_ca_certs=...]"


@dataclass(frozen=True)
class SentinelTarget:
    """What a Sentinel URL names: the Sentinels to ask, the service (Sentinel's name for the primary) and the
    primary's database, credentials and TLS settings. The credentials are the primary's; Sentinels are asked
    without them."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    tls_options: dict[str, str] = field(default_factory=dict)
    """`ssl_*` settings from the URL's query (`ssl_ca_certs=...`), for the primary's and the Sentinels' sockets."""


def is_sentinel_url(url: str) -> bool:
    return urlsplit(url).scheme in SCHEMES


def parse_sentinel_url(url: str) -> SentinelTarget:
    """The parts of a Sentinel URL; `ValueError` saying what to fix when one is missing or malformed (the URL shown
    without its password)."""
    parts = urlsplit(url)
    auth, _, hosts = parts.netloc.rpartition("@")
    shown = f"{parts.scheme}://{'***@' if auth else ''}{hosts}{parts.path}"
    if parts.scheme not in SCHEMES:
        raise ValueError(f"not a Sentinel URL: {shown} (redis+sentinel:// or rediss+sentinel://)")
    sentinels = []
    for where in filter(None, hosts.split(",")):
        host, colon, port = where.rpartition(":")
        if not colon or not port.isdigit():
            raise ValueError(f"a Sentinel without its port in {shown}: {USAGE}")
        sentinels.append((host.strip("[]"), int(port)))
    if not sentinels:
        raise ValueError(f"no Sentinel in {shown}: {USAGE}")
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError(f"{shown} names no service: {USAGE}")
    query = dict(parse_qsl(parts.query))
    if unknown := sorted(k for k in query if not k.startswith("ssl_")):
        raise ValueError(f"{shown}: unknown option {', '.join(unknown)} (a Sentinel URL takes ssl_* options only)")
    if query and not SCHEMES[parts.scheme]:
        raise ValueError(f"{shown}: ssl_* options need TLS: rediss+sentinel://")
    username, _, password = auth.partition(":") if auth else ("", "", "")
    return SentinelTarget(
        sentinels=tuple(sentinels),
        service=unquote(path[0]),
        db=int(path[1]) if len(path) == 2 else 0,
        username=unquote(username) or None,
        password=unquote(password) or None,
        tls=SCHEMES[parts.scheme],
        tls_options=query,
    )


NOT_PRIMARY = ("READONLY", "NOREPLICAS", "You can't write against a read only replica", "UNBLOCKED")
"""How the error replies of a server that is no primary that may write begin (`no_longer_primary`)."""


def no_longer_primary(error: redis.ResponseError) -> bool:
    """An error reply that says the server is not (or no longer) a primary that may write: `READONLY` (a replica),
    `NOREPLICAS` (a primary cut off from its replicas, with `min-replicas-to-write`), `UNBLOCKED` (a blocking read, a
    worker's `XREADGROUP`, woken as its server was made a replica: "instance state changed (master -> replica?)").
    Not counted, it reached the worker's read loop as an error that loop does not retry (it retries lost ones)."""
    return str(error).startswith(NOT_PRIMARY)


def _lost_primary(connection: Any, error: redis.ResponseError) -> redis.ConnectionError:
    return redis.ConnectionError(f"{connection.host}:{connection.port} is no primary that may write now: {error}")


class PrimaryConnection(SentinelManagedConnection):
    """A connection to the primary the Sentinels name, that counts `NOREPLICAS` as a lost connection, as redis-py
    counts `READONLY`.

    It asks the Sentinels on every connect. redis-py's own asks only in `connect()`, which its pool calls; a command
    retried after a lost connection reconnects through `connect_check_health`, which would try the old address for
    the whole retry policy (~`connections.RECONNECT_S`) before the next command asked again."""

    def named_primary(self) -> bool:
        """Whether the Sentinels name this connection's server the primary now (a stale primary, back after a failover
        with a replica still following it, acknowledges writes that the new primary never gets)."""
        return bool(primary_address(self.connection_pool) == (str(self.host), int(self.port)))

    def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        if self._sock is None:
            self.host, self.port = primary_address(self.connection_pool)
        # One try a connect: the client's retry policy tries again, and each try asks the Sentinels anew.
        super().connect_check_health(check_health, retry_socket_connect=False)

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)
        except redis.ResponseError as exc:
            if not no_longer_primary(exc):
                raise
            self.disconnect()  # type: ignore[no-untyped-call]  # redis-py: unannotated
            raise _lost_primary(self, exc) from exc


class PrimarySSLConnection(PrimaryConnection, redis.connection.SSLConnection):
    """`PrimaryConnection` over TLS."""


def primary_client(url: str, redis_class: type[redis.Redis] = redis.Redis, **options: Any) -> redis.Redis:
    """A client (of `redis_class`) of the primary that the URL's Sentinels name for its service, unconnected and
    never retrying by itself (`connections.connect` sets the retry policy). `options` go to each connection
    (`socket_timeout=`)."""
    target = parse_sentinel_url(url)
    tls = {"ssl": True, **target.tls_options} if target.tls else {}
    asking = {"socket_timeout": SENTINEL_TIMEOUT_S, "socket_connect_timeout": SENTINEL_TIMEOUT_S, **tls}
    sentinel = Sentinel(list(target.sentinels), sentinel_kwargs=asking)
    client: redis.Redis = sentinel.master_for(
        target.service,
        redis_class=redis_class,
        connection_class=PrimarySSLConnection if target.tls else PrimaryConnection,
        db=target.db,
        username=target.username,
        password=target.password,
        decode_responses=False,
        health_check_interval=30,
        retry=Retry(NoBackoff(), 0),
        **target.tls_options,
        **options,
    )
    return client


def every_server(url: str) -> list[redis.Redis]:
    """A plain client (no retries) of each server of the URL's service, the primary first, then every replica the
    Sentinels know: for what each server keeps for itself and no replica copies, such as ACL users."""
    target = parse_sentinel_url(url)
    tls = {"ssl": True, **target.tls_options} if target.tls else {}
    asking = {"socket_timeout": SENTINEL_TIMEOUT_S, "socket_connect_timeout": SENTINEL_TIMEOUT_S, **tls}
    sentinel = Sentinel(list(target.sentinels), sentinel_kwargs=asking)
    addresses = [sentinel.discover_master(target.service), *sentinel.discover_slaves(target.service)]
    settings: dict[str, Any] = {
        "db": target.db, "username": target.username, "password": target.password, "retry": Retry(NoBackoff(), 0),
        **tls,
    }  # fmt: skip
    return [redis.Redis(host=host, port=int(port), **settings) for host, port in addresses]


def is_sentinel_pool(pool: object) -> bool:
    return isinstance(pool, SentinelConnectionPool)


def primary_address(pool: SentinelConnectionPool) -> tuple[str, int]:
    """Where the primary of `pool`'s service is by the Sentinels' latest configuration: of every Sentinel that answers,
    the answer with the highest configuration epoch (each failover raises it). redis-py takes the first Sentinel's
    answer, and one that has not heard of a failover yet names the old primary: back from a stop, that stale primary
    takes writes (and, with a replica still following it, acknowledges them) that the new primary never gets.
    `redis.ConnectionError` (`MasterNotFoundError`) when no Sentinel names a primary that is up."""
    manager, newest = pool.sentinel_manager, None
    for sentinel in manager.sentinels:
        try:
            state = sentinel.sentinel_master(pool.service_name)
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
            continue
        if "failover_in_progress" in str(state.get("flags", "")).split(","):
            # Mid-failover a Sentinel still names the old primary here (`SENTINEL MASTER`), and once it is back from a
            # stop it looks up: a write it takes, acknowledged by a replica not yet moved to the new primary, is lost
            # when Sentinel moves them both. No primary until the failover is over.
            raise MasterNotFoundError(f"a failover of {pool.service_name!r} is under way")
        if not manager.check_master_state(state, pool.service_name):
            continue
        epoch = int(state.get("config-epoch", 0))
        if newest is None or epoch > newest[0]:
            newest = (epoch, str(state["ip"]), int(state["port"]))
    if newest is None:
        raise MasterNotFoundError(f"no Sentinel names a primary of {pool.service_name!r} that is up")
    return newest[1], newest[2]


def plain_settings(pool: SentinelConnectionPool) -> tuple[type[redis.connection.AbstractConnection], dict[str, Any]]:
    """The class and settings of a plain connection to the primary that the Sentinels name now (no Sentinel
    machinery: for a one-off check such as `connections.redis_unreachable`)."""
    host, port = primary_address(pool)
    kwargs = {k: v for k, v in pool.connection_kwargs.items() if k != "connection_pool"}
    tls = issubclass(pool.connection_class, redis.connection.SSLConnection)
    connection_class = redis.connection.SSLConnection if tls else redis.connection.Connection
    return connection_class, {**kwargs, "host": host, "port": port}


class AsyncPrimaryConnection(redis.asyncio.connection.Connection):
    """An asyncio connection that asks the Sentinels where the primary is each time it connects (through the
    synchronous client's manager, on a thread), and drops itself on `READONLY` or `NOREPLICAS` as a lost connection."""

    def __init__(self, *, find_primary: Callable[[], tuple[str, int]], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._find_primary = find_primary

    async def named_primary(self) -> bool:
        """Whether the Sentinels name this connection's server the primary now (see `PrimaryConnection`)."""
        return bool(await asyncio.to_thread(self._find_primary) == (str(self.host), int(self.port)))

    async def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        if not self.is_connected:
            self.host, self.port = await asyncio.to_thread(self._find_primary)
        await super().connect_check_health(check_health, retry_socket_connect=False)

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)
        except redis.ResponseError as exc:
            if not no_longer_primary(exc):
                raise
            await self.disconnect(nowait=True)
            raise _lost_primary(self, exc) from exc


class AsyncPrimarySSLConnection(AsyncPrimaryConnection, redis.asyncio.connection.SSLConnection):
    """`AsyncPrimaryConnection` over TLS."""


def async_connections(
    pool: SentinelConnectionPool, settings: dict[str, Any]
) -> Callable[[], redis.asyncio.connection.AbstractConnection]:
    """Makes unconnected asyncio connections to the primary of `pool`'s service with `settings` (see
    `connections.async_twin`)."""
    tls = issubclass(pool.connection_class, redis.connection.SSLConnection)
    twin = AsyncPrimarySSLConnection if tls else AsyncPrimaryConnection
    return lambda: twin(find_primary=lambda: primary_address(pool), **settings)
