"""Batches pipelined on one asyncio connection (`pipeline.pipelined`), and the worker's publisher on it, on a real
redis-server: each batch its own replies, in order, through errors, a killed connection and a flushed script."""

from __future__ import annotations

import asyncio
from typing import Any

import hiredis
import pytest
import redis
import redis.asyncio.connection

from pipeline.codec import as_entries
from pipeline.connections import async_retry, async_twin, connect, socket_timeout_s
from pipeline.local import RedisServer
from pipeline.pipelined import PipelinedConnection, writes
from pipeline.publisher import Publisher
from pipeline.wire import GENERATORS
from tests.fixtures import REDIS_VERSIONS
from tests.pipeline.test_streams import rollouts_for, taken


def pipe_to(client: redis.Redis) -> PipelinedConnection:
    make = async_twin(client)
    assert make is not None
    return PipelinedConnection(make, async_retry(client), socket_timeout_s(client))


def packed(*command: str) -> bytes:
    """One command, packed by `hiredis.pack_command`."""
    return hiredis.pack_command(command)  # type: ignore[arg-type]  # its stub takes a one-element tuple


def echoes(batch: int, size: int) -> list[bytes]:
    return [packed("ECHO", f"{batch}.{k}") for k in range(size)]


@pytest.mark.parametrize("redis_server", REDIS_VERSIONS, indirect=True)
def test_concurrent_batches_each_get_their_own_replies(redis_server: RedisServer, ns: str) -> None:
    """60 batches of 1-9 commands from 60 tasks at once, all on one connection: each gets exactly its replies, in
    its order; an error reply is its command's answer only."""
    client = connect(redis_server.url)
    client.set(f"{ns}:text", "not a number")
    pipe = pipe_to(client)

    async def one(batch: int) -> list[Any]:
        commands = echoes(batch, 1 + batch % 9)
        if batch == 17:
            commands.insert(2, packed("INCR", f"{ns}:text"))
        return await pipe.call(commands)

    async def run() -> list[list[Any]]:
        try:
            return await asyncio.gather(*(one(b) for b in range(60)))
        finally:
            await pipe.close()

    results = asyncio.run(run())
    for batch, replies in enumerate(results):
        wanted: list[Any] = [f"{batch}.{k}".encode() for k in range(1 + batch % 9)]
        if batch == 17:
            error = replies.pop(2)
            assert isinstance(error, redis.ResponseError) and "not an integer" in str(error)
        assert replies == wanted
    assert client.client_list() and len([c for c in client.client_list() if c["cmd"] == "echo"]) == 0  # closed
    client.close()


@pytest.mark.parametrize("redis_server", REDIS_VERSIONS, indirect=True)
def test_a_killed_connection_fails_every_batch_on_it_and_each_is_sent_again(redis_server: RedisServer, ns: str) -> None:
    """A batch blocks the connection (BLPOP) while 5 more wait behind it on the same socket; the connection is killed
    from outside. Every batch is sent again on a new connection (the client's retry policy) and gets its own
    replies, none a reply meant for another."""
    client = connect(redis_server.url)
    pipe = pipe_to(client)

    async def run() -> list[list[Any]]:
        blocked = asyncio.create_task(pipe.call([*echoes(0, 2), packed("BLPOP", f"{ns}:none", "1")]))
        behind = [asyncio.create_task(pipe.call(echoes(b, 3))) for b in range(1, 6)]
        for _ in range(200):  # the BLPOP is blocking on the server: kill its connection there
            blocking = [c for c in client.client_list() if c["cmd"] == "blpop"]
            if blocking:
                client.client_kill_filter(_id=blocking[0]["id"])
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the BLPOP never blocked")
        try:
            return await asyncio.wait_for(asyncio.gather(blocked, *behind), timeout=20)
        finally:
            await pipe.close()

    results = asyncio.run(run())
    assert results[0] == [b"0.0", b"0.1", None]  # sent again: the BLPOP timed out on the new connection
    assert results[1:] == [[f"{b}.{k}".encode() for k in range(3)] for b in range(1, 6)]
    client.close()


@pytest.mark.parametrize("cancelled", ["reading", "waiting"])
def test_a_batch_cancelled_before_its_replies_came_leaves_none_of_them_to_another_batch(
    installed_redis: RedisServer, ns: str, cancelled: str
) -> None:
    """A caller gives up (cancelled) before its replies came: the first batch while Redis blocks on its BLPOP, or the
    second while it waits for its turn to read. The replies still due on that socket must reach nobody else: the
    connection is closed, and the batches on it are sent again and get their own."""
    client = connect(installed_redis.url)
    pipe = pipe_to(client)

    async def run() -> list[list[Any] | None]:
        calls = [asyncio.create_task(pipe.call([packed("BLPOP", f"{ns}:none", "1"), *echoes(0, 1)]))]
        calls += [asyncio.create_task(pipe.call(echoes(b, 3))) for b in range(1, 6)]
        while not [c for c in client.client_list() if c["cmd"] == "blpop"]:
            await asyncio.sleep(0.01)
        gone = 0 if cancelled == "reading" else 1
        calls[gone].cancel()
        try:
            done = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), timeout=20)
        finally:
            await pipe.close()
        assert isinstance(done[gone], asyncio.CancelledError)
        return [None if k == gone else result for k, result in enumerate(done)]  # type: ignore[misc]  # the one exception, the cancelled call's, is None

    results = asyncio.run(run())
    if cancelled == "waiting":
        assert results[0] == [None, b"0.0"]  # sent again: the BLPOP timed out on the new connection
    assert results[2:] == [[f"{b}.{k}".encode() for k in range(3)] for b in range(2, 6)]
    client.close()


def test_a_batch_unanswered_within_the_socket_timeout_fails_and_the_next_gets_a_new_connection(
    installed_redis: RedisServer, ns: str
) -> None:
    """The client's socket timeout bounds a batch's wait for its replies (a stuck server must not hang a worker's
    publishes); with a client that does not reconnect, the error reaches the caller at once."""
    client = connect(installed_redis.url, reconnect=False, socket_timeout=0.5)
    pipe = pipe_to(client)

    async def run() -> tuple[BaseException | None, float, list[Any]]:
        started = asyncio.get_running_loop().time()
        try:
            await pipe.call([packed("BLPOP", f"{ns}:none", "5")])
            error = None
        except BaseException as exc:
            error = exc
        took = asyncio.get_running_loop().time() - started
        try:
            return error, took, await pipe.call(echoes(1, 2))
        finally:
            await pipe.close()

    error, took, after = asyncio.run(run())
    assert isinstance(error, TimeoutError) and 0.4 < took < 3, (error, took)
    assert after == [b"1.0", b"1.1"]
    client.close()


def test_the_twin_connects_with_the_clients_database_and_name(installed_redis: RedisServer, ns: str) -> None:
    """The asyncio connection is the client's: same server, same database (here 3), same client name."""
    client = connect(installed_redis.url.rsplit("/", 1)[0] + "/3", client_name="twin-test")
    pipe = pipe_to(client)

    async def run() -> list[Any]:
        try:
            return await pipe.call([packed("SET", f"{ns}:k", "v"), packed("CLIENT", "GETNAME")])
        finally:
            await pipe.close()

    assert asyncio.run(run()) == [b"OK", b"twin-test"]
    assert client.get(f"{ns}:k") == b"v" and client.connection_pool.connection_kwargs["db"] == 3
    client.close()


def test_a_client_that_is_not_redis_pys_has_no_twin() -> None:
    import fakeredis

    assert async_twin(fakeredis.FakeRedis()) is None


@pytest.mark.parametrize("redis_server", REDIS_VERSIONS, indirect=True)
def test_the_publisher_rides_out_a_script_flush_and_a_lost_connection_with_batches_in_flight(
    redis_server: RedisServer, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's publisher on its asyncio connection: a script Redis no longer knows is loaded and run again; a
    connection lost after the first batch's scripts ran, with more batches behind it, is retried: the calls that ran
    answer -1 (their entries are acked) and every rollout is there exactly once, no prompt left pending."""
    client = connect(redis_server.url)
    streams, prompts, entries = taken(client, ns, 24)
    publisher = Publisher(streams.writer, max_batch=2, senders=4)
    pairs = list(zip(prompts, entries, strict=True))

    async def publish(items: list) -> list[int | BaseException]:
        calls = [publisher.publish(rollouts_for(p), e) for p, e in items]
        return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), timeout=30)

    client.script_flush()
    assert asyncio.run(publish(pairs[:4])) == [2] * 4

    read = PipelinedConnection._read
    lost: list[object] = []

    async def lose_the_first_replies(connection: Any, count: int) -> list[Any]:
        if not lost:  # the first batch's scripts ran (its rollouts are there), then the connection drops
            lost.append(connection)
            while client.xlen(streams.keys.rollouts) < 2 * (4 + 2):
                await asyncio.sleep(0.005)
            await connection.disconnect()
            raise redis.ConnectionError("connection lost")
        return await read(connection, count)

    monkeypatch.setattr(PipelinedConnection, "_read", staticmethod(lose_the_first_replies))
    results = asyncio.run(publish(pairs[4:]))
    assert lost and set(results) <= {2, -1} and results[:2] == [-1, -1], results
    ids = [fields[b"id"] for _, fields in as_entries(client.xrange(streams.keys.rollouts))]
    assert sorted(ids) == sorted(f"{p.id}:{k}".encode() for p in prompts for k in range(2))
    assert client.xpending(streams.keys.prompts, GENERATORS)["pending"] == 0
    client.close()


def test_small_commands_share_a_write_and_large_ones_go_alone() -> None:
    """Runs of small commands are joined up to the limit, in order; one past it is written by itself."""
    small, large = [b"a" * 10, b"b" * 10, b"c" * 10, b"d" * 10, b"e" * 10], b"L" * 100
    assert writes([*small, large, b"f" * 10], limit=30) == [b"a" * 10 + b"b" * 10 + b"c" * 10, b"d" * 10 + b"e" * 10,
                                                         large, b"f" * 10]  # fmt: skip
    assert writes([large], limit=30) == [large] and writes([], limit=30) == []


@pytest.mark.parametrize("redis_server", REDIS_VERSIONS, indirect=True)
def test_a_burst_that_finds_the_wire_idle_goes_out_in_even_pieces(redis_server: RedisServer, ns: str) -> None:
    """28 prompts finished at once, nothing on the wire: one piece a sender (4 of 7), so the first is on Redis while
    the worker encodes the rest, not 16 then 12. Every rollout is there once and nothing is left pending."""
    client = connect(redis_server.url)
    streams, prompts, entries = taken(client, ns, 28)
    publisher = Publisher(streams.writer)  # 16 a batch at most, 4 senders

    async def burst() -> list[int]:
        try:
            calls = [publisher.publish(rollouts_for(p), e) for p, e in zip(prompts, entries, strict=True)]
            return await asyncio.wait_for(asyncio.gather(*calls), timeout=30)
        finally:
            await publisher.close()

    assert asyncio.run(burst()) == [2] * 28
    assert publisher.batches == 4
    ids = [fields[b"id"] for _, fields in as_entries(client.xrange(streams.keys.rollouts))]
    assert sorted(ids) == sorted(f"{p.id}:{k}".encode() for p in prompts for k in range(2))
    assert client.xpending(streams.keys.prompts, GENERATORS)["pending"] == 0
    client.close()
