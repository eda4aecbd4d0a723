"""Faults, each on its own: the fixes that `rollouts chaos` (the lab's run, benchmarks/tests/test_chaos.py) led
to."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import numpy as np
import pytest
import redis
from redis.typing import EncodableT

from benchmarks.chaos_proxy import Proxy
from pipeline.connections import connect
from pipeline.local import RedisServer
from pipeline.processes import start_worker, stop_process, wait_for_worker
from pipeline.streams import Streams
from pipeline.wire import GENERATORS, Keys, Rollout
from producers.client import RolloutClient
from staleness.admission import Admission
from staleness.manager import Manager
from tests.fixtures import StartWorker, wait_until

SYNTHETIC = ("--engine", "synthetic", "--engine-args", '{"steps_per_s": 200}')


def test_a_worker_and_the_trainer_ride_out_a_redis_crash_on_appendonly_data(tmp_path: Path) -> None:
    with RedisServer(appendonly=True, data_dir=tmp_path) as server:  # its own: this test kills it
        worker = start_worker(server.url, "crash", Path("synthetic"), "w1", *SYNTHETIC, log_file=tmp_path / "w1.log")
        try:
            client = RolloutClient(server.url, "crash")
            wait_for_worker(client.streams.redis, "crash", "w1", worker, timeout_s=120)
            for i in range(8):
                client.submit(tokens=[5, 6, i + 7], n=2, max_tokens=16, seed=i, id=f"p{i}")
            got = client.collect(8, timeout=60)
            server.kill()  # kill -9: what it acknowledged was written to the AOF before the reply
            threading.Timer(1.0, server.start).start()  # back on the same port and data while the clients retry
            for i in range(8, 16):
                client.submit(tokens=[5, 6, i + 7], n=2, max_tokens=16, seed=i, id=f"p{i}")
            got += client.collect(8, timeout=60)
            assert sorted(g.prompt_id for g in got) == sorted(f"p{i}" for i in range(16))
            assert client.stats["duplicates"] == 0
            assert worker.poll() is None, (tmp_path / "w1.log").read_text()[-3000:]
            wait_until(lambda: "w1" in client.streams.registry.live_workers(), 30, "w1 to beat again")
        finally:
            stop_process(worker)


def test_a_retried_submission_is_queued_and_counted_once(real_redis: redis.Redis, ns: str) -> None:
    """redis-py retries a command whose reply a dropped connection lost: admission must not run it twice."""
    keys = Keys(ns)
    admission = Admission(real_redis, keys)
    prompts = [{b"id": f"p{i}".encode(), b"n": b"2"} for i in range(3)]
    first = admission.try_admit(prompts, 6, "submission-1")
    again = admission.try_admit(prompts, 6, "submission-1")
    assert again == dataclasses.replace(first, repeat=True) and len(first.entry_ids) == 3 and not first.repeat
    assert real_redis.xlen(keys.prompts) == 3
    assert int(real_redis.hget(keys.state, "submitted") or 0) == 6
    admission.try_admit(prompts, 6, "submission-2")  # another submission of the same fields is another submission
    assert real_redis.xlen(keys.prompts) == 6


def test_a_retried_sync_begin_begins_one_sync(redis_server: RedisServer, ns: str) -> None:
    """The same begin run twice (a lost reply, retried) is one sync; another begin meanwhile is refused."""
    manager = Manager(Streams(connect(redis_server.url), ns), ack_timeout_s=1)
    args: list[EncodableT] = [0, 1, "token-a", 0, b"cmd", b"weights", b"epoch", b"0", b"version", b"1"]
    epoch = manager._begin(keys=manager._keys, args=args)
    assert manager._begin(keys=manager._keys, args=args) == epoch
    assert manager.streams.redis.xlen(manager.streams.keys.control) == 1
    with pytest.raises(redis.ResponseError, match="already under way"):
        manager._begin(keys=manager._keys, args=[0, 1, "token-b", *args[3:]])  # the same epoch floor and fields


def test_a_trainer_restored_from_its_checkpoint_skips_what_it_trained_on(redis_server: RedisServer, ns: str) -> None:
    client = RolloutClient(redis_server.url, ns, consumer="trainer")
    rollouts = group_of("g0") + group_of("g1")
    client.streams.add_rollouts(rollouts)
    groups = client.groups(timeout=5)
    first = next(groups)  # trained on and written to the checkpoint; the trainer dies before coming back (no ack)
    restored = RolloutClient(redis_server.url, ns, consumer="trainer")
    restored.mark_seen(r.id for r in first.rollouts)
    rest = restored.collect(1, timeout=5)
    assert [g.prompt_id for g in rest] == ["g1"]
    assert restored.stats["duplicates"] == 2
    pending = restored.streams.redis.xpending(restored.streams.keys.rollouts, "trainer")["pending"]
    assert pending == 0  # the re-read duplicates were acked


def group_of(prompt_id: str, n: int = 2) -> list[Rollout]:
    return [
        Rollout(
            prompt_id=prompt_id, sample=k, n=n, version=0, version_end=0, finish_reason="length", worker="w",
            prompt_tokens=np.array([1, 2], np.int32), tokens=np.array([3, 4], np.int32),
            logprobs=np.array([-0.5, -0.5], np.float32), spans=[(0, 0, 2)], meta={}, timing={},
        )
        for k in range(n)
    ]  # fmt: skip


def test_a_trainer_read_whose_reply_is_lost_is_read_again(redis_server: RedisServer, ns: str) -> None:
    """redis-py retries a read after a dropped connection; if the first one ran, its entries are pending on the
    trainer, never handed over: the client re-reads what is pending on it, and the group still arrives."""
    proxy = Proxy(("127.0.0.1", redis_server.port))
    try:
        client = RolloutClient(proxy.url(), ns, consumer="trainer")
        client.streams.add_rollouts(group_of("g0"))
        assert [g.prompt_id for g in client.collect(1, timeout=5)] == ["g0"]
        client.streams.add_rollouts(group_of("g1"))
        proxy.lose_next_reply()  # the XREADGROUP that takes g1 runs; its reply never arrives
        assert [g.prompt_id for g in client.collect(1, timeout=5)] == ["g1"]
        assert client.stats["duplicates"] == 0
    finally:
        proxy.close()


def test_abandoned_work_is_claimed_before_new_work(redis_server: RedisServer, ns: str, workers: StartWorker) -> None:
    """Behind a queue kept full, a dead worker's prompt must not wait for the queue to drain (it would come out
    too stale to train on): the worker claims it as soon as it is idle past --claim-idle-ms, before new work."""
    client = RolloutClient(redis_server.url, ns)
    client.submit(tokens=[5, 6, 7], n=1, max_tokens=40, seed=0, id="abandoned")
    client.streams.read_work("ghost", 1, None)  # a worker took it and died: pending on `ghost`, idle from now
    for i in range(60):  # 60 s of work for one worker that runs 4 at a time
        client.submit(tokens=[5, 6, 8 + i], n=1, max_tokens=200, seed=i, id=f"fresh{i}")
    workers("w1", "--engine", "synthetic", "--engine-args", '{"steps_per_s": 50}', "--max-inflight", "4")
    order = [g.prompt_id for g in client.collect(12, timeout=60)]
    assert "abandoned" in order, order


def test_a_fresh_worker_takes_one_entry_before_it_knows_how_many_samples_one_holds(
    redis_server: RedisServer, ns: str, workers: StartWorker
) -> None:
    """A restarted worker that guessed one sample per entry took n times more than it had room for, and a kill
    left all of it behind for --claim-idle-ms."""
    client = RolloutClient(redis_server.url, ns)
    for i in range(10):
        client.submit(tokens=[5, 6, 8 + i], n=4, max_tokens=400, seed=i, id=f"p{i}")
    w1 = workers("w1", "--engine", "synthetic", "--engine-args", '{"steps_per_s": 20}', "--max-inflight", "4")
    wait_until(
        lambda: client.streams.registry.live_workers()["w1"].get("inflight") not in (None, "0"), 30, "w1 to generate"
    )
    # its first samples take 20 s: still the first
    assert client.streams.registry.live_workers()["w1"]["inflight"] == "4"
    pending = client.streams.redis.xpending(client.streams.keys.prompts, GENERATORS)
    assert pending["pending"] == 1, pending  # one entry of 4 samples fills its room; the other 9 wait in Redis
    w1.kill()  # not drained: its 400-token samples would take the teardown 20 s (a synthetic engine has no children)
