"""Redis Cluster: a namespace's client follows the node that serves its slot, through migrations and failovers.

Every key of a namespace carries the hash tag `{ns}`, so a namespace lives in one slot, on one node: scripts,
transactions and blocking reads work as on a single Redis, and a fleet shards by namespace. A process that names its
namespace (`connections.connect(url, ns=...)`) and is given any node of a cluster gets a plain `redis.Redis` whose
connections are `SlotConnection`s (`AsyncSlotConnection` for a worker's asyncio publisher): the code paths, the
pipelines and the reply shapes stay those of a single Redis. What follows the slot is one `SlotRoute` a client,
shared by its connections, as redis-py's Sentinel support (`redis.sentinel.SentinelManagedConnection`) follows a
primary:

- **connecting**, a connection goes to the node the route last saw serving the slot, or asks the seeds (the node
  the URL names, then every node the cluster listed last time) `CLUSTER SLOTS`, any one that answers;
- **`MOVED`** for the slot (a migration ended, a replica was promoted): the route remembers the new owner, the
  connection drops, and `redis.ConnectionError` hands the command to the client's retry policy
  (`connections.Reconnecting`), which sends it again, to the new owner;
- **`ASK`** (the slot is being migrated and the key has left), **`TRYAGAIN`** (a multi-key command or script whose
  keys the migration has split), **`CLUSTERDOWN`** (a failover under way) and **`UNBLOCKED`** (Redis 7 wakes a
  blocked `XREADGROUP` whose stream `MIGRATE` took away) are retried the same way, after the policy's backoff;
- **a refused or timed-out connection** (the node died; the cluster is promoting its replica) forgets the owner:
  the next try asks the seeds.

Without `ASKING`, on purpose: the source answers `ASK` or `TRYAGAIN` until the migration ends (`CLUSTER SETSLOT
slot NODE`), then `MOVED`, so a retried command waits the migration out (moving a namespace's few dozen keys takes
milliseconds) and then goes to the new owner. `ASKING` would let it run on the target earlier, but only for one
command: it does not fit a pipelined batch (`pipeline.pipelined`, `Writer.publish_many`: each command would need
its own `ASKING`), nor a blocking read, which the target would take and then answer `MOVED` at once, and a script
whose keys are still split answers `TRYAGAIN` on either node anyway.

Retrying is safe: every write the pipeline makes may run twice (the README's "Semantics we chose"); a batch cut
short by a redirect was partly run, and is sent again whole. A script loaded on the old owner is unknown on the new
one: the first call there answers `NOSCRIPT`, and every caller loads it again (redis-py's `Script`,
`lua.load_missing`, `Writer.load_publish` after `streams.script_unknown`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import redis
import redis.asyncio.connection
import redis.connection
import redis.exceptions
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

Address = tuple[str, int]

ASK_TIMEOUT_S = 2.0
"""How long asking one seed `CLUSTER SLOTS` may take (to connect, then for the answer) before the next is asked."""
ASK_SETTINGS = ("username", "password", "credential_provider", "protocol")
"""The settings of a client's connections that asking the seeds takes over (and every `ssl_*` one)."""


def namespace_slot(ns: str) -> int:
    """The Redis Cluster slot of every key of namespace `ns` (they share the hash tag `{ns}`)."""
    return key_slot(("{" + ns + "}").encode())


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _owner_in(ranges: Sequence[Any], slot: int, here: str) -> Address | None:
    """The primary that serves `slot` in a `CLUSTER SLOTS` reply (None: no node does); an empty host is `here`."""
    for start, end, primary, *_replicas in ranges:
        if int(start) <= slot <= int(end):
            return _text(primary[0]) or here, int(primary[1])
    return None


def _nodes_in(ranges: Sequence[Any], here: str) -> list[Address]:
    """Every node, primary or replica, that a `CLUSTER SLOTS` reply names, in order, once each."""
    nodes: dict[Address, None] = {}
    for _start, _end, *members in ranges:
        for member in members:
            nodes[(_text(member[0]) or here, int(member[1]))] = None
    return list(nodes)


def slot_owner(client: redis.Redis, slot: int) -> Address | None:
    """The (host, port) of the cluster node serving `slot`, or None when `client`'s server is no cluster node.

    `CLUSTER SLOTS` (Redis 3 to 7, unlike 7.0's `CLUSTER SHARDS`) lists ranges with their primary first; a node
    that announces no address (an empty host) is reached at the address we already use. A server that refuses
    the command (cluster support disabled, or a proxy or user without it) is taken for a single Redis: were it a
    cluster node after all, a command on a key it does not own fails with `MOVED`, which names the slot."""
    try:
        ranges = client.execute_command("CLUSTER", "SLOTS")
    except redis.ResponseError:
        return None
    owner = _owner_in(ranges, slot, client.connection_pool.connection_kwargs.get("host", "localhost"))
    if owner is None:
        raise redis.exceptions.ClusterDownError(
            f"no node of the cluster serves slot {slot} (not every slot is assigned yet?)"
        )
    return owner


class SlotRoute:
    """Where one slot is served: the cluster's seed nodes (`seeds`: those given; more are learned from the cluster's
    answers), the slot, and the node last seen serving it (`owner`, if known already).

    Shared by every connection of a client (their threads, and the asyncio publisher's), so guarded by a lock; asking
    the seeds happens outside it. `moves` counts the redirects followed (`MOVED`), `asked` the times the seeds were
    asked: what a test or a log can read."""

    def __init__(
        self,
        slot: int,
        seeds: Sequence[Address],
        settings: dict[str, Any],
        tls: bool = False,
        owner: Address | None = None,
    ) -> None:
        self.slot = slot
        self._given = list(dict.fromkeys(seeds))
        """The nodes the caller named: always asked, whatever the cluster lists."""
        self._seeds = list(self._given)
        self._settings = settings
        self._tls = tls
        self._owner = owner
        self._lock = threading.Lock()
        self.moves = 0
        self.asked = 0

    def __repr__(self) -> str:
        return f"SlotRoute(slot={self.slot}, owner={self._owner}, seeds={self._seeds})"

    def describe(self) -> str:
        """Where commands go now, for logs and `top` (no credentials)."""
        owner = self.known()
        at = f"{owner[0]}:{owner[1]}" if owner else "not known yet"
        return f"the owner of slot {self.slot} (Redis Cluster, now {at})"

    def known(self) -> Address | None:
        """The node last seen serving the slot, without asking anyone (None: the seeds must be asked)."""
        with self._lock:
            return self._owner

    def owner(self) -> Address:
        """The node that serves the slot: the one last seen, else what the first seed that answers says;
        `redis.ConnectionError` when none does (the caller's retry policy tries again)."""
        with self._lock:
            if self._owner is not None:
                return self._owner
            seeds = list(self._seeds)
        owner, nodes, seed = self._ask(seeds)
        with self._lock:
            self.asked += 1
            self._owner = owner
            # The seed that answered first next time, then what the cluster lists now, then the nodes given.
            self._seeds = list(dict.fromkeys([seed, *nodes, *self._given]))
        return owner

    def moved(self, owner: Address) -> None:
        """The slot's owner answered `MOVED` to `owner`: go there from now on."""
        with self._lock:
            self._owner = owner
            self.moves += 1

    def forget(self, owner: Address | None = None) -> None:
        """`owner` (by default whichever node is known) failed us: the next connection asks the seeds."""
        with self._lock:
            if owner is None or self._owner == owner:
                self._owner = None

    def _ask(self, seeds: Sequence[Address]) -> tuple[Address, list[Address], Address]:
        """(owner, every node listed, the seed that answered), from the first seed that answers."""
        why: list[str] = []
        for host, port in seeds:
            connection = self._connection(host, port)
            try:
                connection.connect()
                connection.send_command("CLUSTER", "SLOTS")
                ranges = connection.read_response()
            except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError, OSError) as exc:
                why.append(f"{host}:{port}: {str(exc) or type(exc).__name__}")
                continue
            finally:
                connection.disconnect()
            owner = _owner_in(ranges, self.slot, host)
            if owner is None:
                why.append(f"{host}:{port}: no node serves slot {self.slot}")
                continue
            return owner, _nodes_in(ranges, host), (host, port)
        raise redis.ConnectionError(f"no node of the cluster says who serves slot {self.slot}: " + "; ".join(why))

    def _connection(self, host: str, port: int) -> redis.connection.Connection:
        kind: type[redis.connection.Connection] = (
            redis.connection.SSLConnection if self._tls else redis.connection.Connection
        )
        timeouts = {"socket_timeout": ASK_TIMEOUT_S, "socket_connect_timeout": ASK_TIMEOUT_S}
        return kind(host=host, port=port, retry=Retry(NoBackoff(), 0), **timeouts, **self._settings)


def redirect(route: SlotRoute, error: redis.ResponseError, here: Address) -> redis.ConnectionError | None:
    """What an error reply means to a connection (at `here`) that follows `route`'s slot: the `redis.ConnectionError`
    to raise in its place, once the connection has dropped, so that the retry policy sends the command again; None
    when the error is the command's own. A `MOVED` or `ASK` for another slot is the caller's: a key outside the
    namespace, which no redirect of ours would fix."""
    if isinstance(error, redis.exceptions.AskError):  # MovedError is an AskError
        if error.slot_id != route.slot:
            return None
        if isinstance(error, redis.exceptions.MovedError):
            owner = (error.host or here[0], error.port)
            route.moved(owner)
            return redis.ConnectionError(f"slot {route.slot} moved to {owner[0]}:{owner[1]}: sending it there")
        return redis.ConnectionError(f"slot {route.slot} is being migrated ({error}): trying again")
    if isinstance(error, redis.exceptions.TryAgainError):
        return redis.ConnectionError(f"slot {route.slot} is being migrated ({error}): trying again")
    if isinstance(error, redis.exceptions.ClusterDownError):
        route.forget(here)
        return redis.ConnectionError(f"the cluster is down ({error}), a failover under way?: trying again")
    if str(error).startswith("UNBLOCKED"):
        return redis.ConnectionError(f"a blocked read was woken ({error}), its key migrated?: trying again")
    return None


class SlotConnection(redis.connection.Connection):
    """A connection to whichever node serves its route's slot (see the module's docstring)."""

    def __init__(self, *, route: SlotRoute, **kwargs: Any) -> None:
        self.route = route
        super().__init__(**kwargs)  # type: ignore[no-untyped-call]  # redis-py's, through super(): not excluded

    def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        """Connect to the slot's owner, asking where it is again at each try (redis-py's own retries a socket to
        one address: the one a dead node had)."""
        if self._sock:
            return
        if retry_socket_connect:
            self.retry.call_with_retry(lambda: self._connect_to_owner(check_health), lambda error: None)
        else:
            self._connect_to_owner(check_health)

    def _connect_to_owner(self, check_health: bool) -> None:
        if self._sock:
            return
        address = self.route.owner()
        self.host, self.port = address
        try:
            super().connect_check_health(check_health=check_health, retry_socket_connect=False)
        except (redis.ConnectionError, redis.TimeoutError):
            self.route.forget(address)
            raise

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        here = (self.host, self.port)
        try:
            return super().read_response(*args, **kwargs)
        except redis.ResponseError as error:
            again = redirect(self.route, error, here)
            if again is None:
                raise
            self.disconnect()  # type: ignore[no-untyped-call]  # replies of a batch may be left unread on it
            raise again from error
        except (redis.ConnectionError, redis.TimeoutError):
            self.route.forget(here)
            raise


class SlotSSLConnection(SlotConnection, redis.connection.SSLConnection):
    """`SlotConnection` over TLS."""


class AsyncSlotConnection(redis.asyncio.connection.Connection):
    """`SlotConnection`'s asyncio twin (`connections.async_twin`), for a worker's publisher (`pipeline.pipelined`):
    the same route, so what one learns the other uses. Asking the seeds (rare) runs on a thread."""

    def __init__(self, *, route: SlotRoute, **kwargs: Any) -> None:
        self.route = route
        super().__init__(**kwargs)

    async def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        if self.is_connected:
            return
        if retry_socket_connect:
            await self.retry.call_with_retry(lambda: self._connect_to_owner(check_health), _nothing)
        else:
            await self._connect_to_owner(check_health)

    async def _connect_to_owner(self, check_health: bool) -> None:
        if self.is_connected:
            return
        address = self.route.known()
        if address is None:
            address = await asyncio.to_thread(self.route.owner)
        self.host, self.port = address
        try:
            await super().connect_check_health(check_health=check_health, retry_socket_connect=False)
        except (redis.ConnectionError, redis.TimeoutError):
            self.route.forget(address)
            raise

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        here = (self.host, self.port)
        try:
            return await super().read_response(*args, **kwargs)
        except redis.ResponseError as error:
            again = redirect(self.route, error, here)
            if again is None:
                raise
            await self.disconnect(nowait=True)
            raise again from error
        except (redis.ConnectionError, redis.TimeoutError):
            self.route.forget(here)
            raise


class AsyncSlotSSLConnection(AsyncSlotConnection, redis.asyncio.connection.SSLConnection):
    """`AsyncSlotConnection` over TLS."""


async def _nothing(error: Exception) -> None:
    """The retry's failure hook of `AsyncSlotConnection.connect_check_health`: nothing to undo."""


FOLLOWING = {
    redis.connection.Connection: SlotConnection,
    redis.connection.SSLConnection: SlotSSLConnection,
}
"""The connection class that follows a slot, for each of redis-py's that can (a Unix socket names one node)."""
ASYNC_CONNECTIONS: dict[type, type[redis.asyncio.connection.AbstractConnection]] = {
    SlotConnection: AsyncSlotConnection,
    SlotSSLConnection: AsyncSlotSSLConnection,
}
"""The asyncio twin of each connection class that follows a slot (`connections.async_twin`)."""


def following_options(client: redis.Redis, ns: str) -> dict[str, Any] | None:
    """What makes a client like `client` follow namespace `ns`'s slot: redis-py's `connection_class` and our `route`,
    to give `redis.Redis.from_url` with the same URL; None when `client`'s server is no cluster node (or is reached
    by a Unix socket, which names one node)."""
    pool = client.connection_pool
    following = FOLLOWING.get(pool.connection_class)
    if following is None:
        return None
    slot = namespace_slot(ns)
    owner = slot_owner(client, slot)
    if owner is None:
        return None
    kwargs = pool.connection_kwargs
    settings = {k: v for k, v in kwargs.items() if k in ASK_SETTINGS or k.startswith("ssl_")}
    entry = (str(kwargs.get("host", "localhost")), int(kwargs.get("port", 6379)))
    route = SlotRoute(slot, [entry], settings, tls=following is SlotSSLConnection, owner=owner)
    return {"connection_class": following, "route": route}
