"""Admission control and the staleness bound: real redis-server, worker processes where it crosses them."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from pipeline.codec import as_entries, as_fields, for_redis
from pipeline.local import RedisServer
from pipeline.wire import GENERATORS, TRAINER, Prompt, Rollout
from producers.client import Group, ParkingBound, RolloutClient, SampleStaleness
from staleness.admission import AdmissionTimeout, StaleRollouts, SubmissionTooLarge
from staleness.manager import Manager
from tests.fixtures import StartWorker, wait_until


class Background:
    """Run `fn` in a thread; keep its result or exception for the test to check."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.finished_at: float | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.result = fn()
        except BaseException as exc:
            self.error = exc
        self.finished_at = time.monotonic()

    def join(self, timeout_s: float) -> Any:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"still running after {timeout_s}s"
        if self.error is not None:
            raise self.error
        return self.result


def state(client: RolloutClient) -> dict[str, str]:
    return {
        k.decode(): v.decode() for k, v in as_fields(client.streams.redis.hgetall(client.streams.keys.state)).items()
    }


def queued_samples(client: RolloutClient) -> int:
    """Samples on `{ns}:prompts`, counted from the entries themselves (not from our counter)."""
    return sum(Prompt.from_fields(f).n for _, f in as_entries(client.streams.redis.xrange(client.streams.keys.prompts)))


def fake_rollouts(
    client: RolloutClient, prompt_id: str, versions: list[int], spans: list[list[tuple[int, int, int]]] | None = None
) -> None:
    """A group's rollouts written straight onto `{ns}:rollouts`, as a worker (or another language) would: sample k
    begins at `versions[k]`, its tokens of one version (two tokens), or of `spans[k]`."""
    for sample, version in enumerate(versions):
        its_spans = spans[sample] if spans else [(version, 0, 2)]
        length = its_spans[-1][2]
        rollout = Rollout(
            prompt_id=prompt_id,
            sample=sample,
            n=len(versions),
            version=its_spans[0][0],
            version_end=its_spans[-1][0],
            finish_reason="length",
            worker="fake",
            prompt_tokens=[1, 2, 3],
            tokens=[4 + i % 9 for i in range(length)],
            logprobs=[-0.5] * length,
            spans=its_spans,
        )
        client.streams.redis.xadd(client.streams.keys.rollouts, for_redis(rollout.to_fields()))


# -- admission -----------------------------------------------------------------------------------


def test_a_full_admission_blocks_until_new_weights_are_published(
    redis_server: RedisServer, ns: str, tiny_model_dir_v1: Path
) -> None:
    client = RolloutClient(redis_server.url, ns, max_staleness=0, batch_size=4)
    assert (state(client)["max_staleness"], state(client)["batch_size"]) == ("0", "4"), "limits are in the state"
    for i in range(4):
        client.submit(tokens=[5, 6, i], timeout=0.2)
    assert state(client)["submitted"] == "4"

    fifth = Background(lambda: client.submit(tokens=[5, 6, 7], id="fifth", timeout=60))
    fifth.thread.join(0.5)
    assert fifth.thread.is_alive(), "the 5th sample must wait: capacity at version 0 is (0 + 0 + 1) * 4 = 4"
    assert client.streams.redis.xlen(client.streams.keys.prompts) == 4

    published_at = time.monotonic()
    assert client.publish_weights(tiny_model_dir_v1, transport="redis://") == 1  # no worker: the state alone moves
    assert fifth.join(10) == "fifth"
    assert fifth.finished_at is not None and fifth.finished_at - published_at < 2.0
    assert state(client)["submitted"] == "5" == str(queued_samples(client))
    last = Prompt.from_fields(as_entries(client.streams.redis.xrevrange(client.streams.keys.prompts, count=1))[0][1])
    assert (last.id, last.submitted_version) == ("fifth", 1), "prompts carry the version they were admitted under"

    # Version 1: capacity 8. Fill it, then a Manager in another thread moves the version (redis transport uri).
    client.submit_prompts([client.make_prompt(tokens=[9, i]) for i in range(3)], timeout=0.2)
    waiting = Background(lambda: client.submit(tokens=[9, 9], n=2, id="after-v2", timeout=60))
    waiting.thread.join(0.3)
    assert waiting.thread.is_alive()
    from staleness.weights import open_transport
    from staleness.weights.sources import state_dict_of

    store = open_transport("redis://", redis_client=client.streams.redis, ns=ns)
    uri = store.publish(state_dict_of(tiny_model_dir_v1), 2)
    syncer = Background(lambda: Manager(client.streams, ack_timeout_s=5).sync(2, uri))
    assert syncer.join(30).version == 2
    assert waiting.join(10) == "after-v2"
    assert state(client)["submitted"] == "10" == str(queued_samples(client))


def test_a_timeout_says_what_was_full_and_what_to_do(redis_server: RedisServer, ns: str) -> None:
    client = RolloutClient(redis_server.url, ns, max_staleness=0, batch_size=4, submit_timeout_s=0.5)
    client.submit(tokens=[1, 2], n=4)
    started = time.monotonic()
    with pytest.raises(AdmissionTimeout) as caught:
        client.submit(tokens=[1, 2], n=1)  # the constructor's timeout
    assert 0.5 <= time.monotonic() - started < 2.0
    assert isinstance(caught.value, TimeoutError)
    message = str(caught.value)
    for needle in (
        "full for 0.5s",
        "4 samples in use (submitted 4 - stale 0) + 1 asked > capacity 4 at policy version 0",
        "(0 + 0 + 1) * 4",
        "publish_weights",
        "raise max_staleness",
    ):
        assert needle in message, message
    with pytest.raises(AdmissionTimeout, match=r"full for 0\.2s"):
        client.submit(tokens=[1, 2], timeout=0.2)  # overridden per call
    assert state(client)["submitted"] == "4" == str(queued_samples(client)), "a refused submit writes nothing"


def test_two_producers_never_overshoot_the_capacity(redis_server: RedisServer, ns: str) -> None:
    trainer = RolloutClient(redis_server.url, ns)
    manager = Manager(trainer.streams, ack_timeout_s=1)
    producers = [RolloutClient(redis_server.url, ns, max_staleness=1, batch_size=8) for _ in range(2)]
    sizes = [1, 3]  # samples per prompt of each producer

    def fill(client: RolloutClient, n: int, start: threading.Barrier) -> int:
        start.wait()
        admitted = 0
        try:
            while True:
                client.submit(tokens=[7, n], n=n, timeout=0.4)
                admitted += n
        except AdmissionTimeout:
            return admitted

    per_producer = [0, 0]
    for version, capacity in ((0, 16), (1, 24), (2, 32)):
        if version:
            manager.sync(version, f"redis://{ns}/v{version}")
        barrier = threading.Barrier(len(producers))
        runs = [Background(partial(fill, c, n, barrier)) for c, n in zip(producers, sizes, strict=True)]
        per_producer = [total + run.join(60) for total, run in zip(per_producer, runs, strict=True)]
        # The 1-sample producer keeps going until nothing at all is free, so the capacity is met exactly.
        assert sum(per_producer) == capacity == int(state(trainer)["submitted"]) == queued_samples(trainer)
    assert all(per_producer), f"both producers got samples in: {per_producer}"


def test_a_submission_larger_than_the_window_fails_at_once(redis_server: RedisServer, ns: str) -> None:
    client = RolloutClient(redis_server.url, ns, max_staleness=0, batch_size=4)
    started = time.monotonic()
    with pytest.raises(SubmissionTooLarge, match=r"5 samples can never be admitted.*\(0 \+ 1\) \* 4 = 4"):
        client.submit(tokens=[1, 2], n=5)
    with pytest.raises(SubmissionTooLarge, match="6 samples"):
        client.submit_prompts([client.make_prompt(tokens=[1, i], n=2) for i in range(3)])
    assert time.monotonic() - started < 0.5
    assert isinstance(SubmissionTooLarge("x"), ValueError)
    assert client.streams.redis.xlen(client.streams.keys.prompts) == 0 and "submitted" not in state(client)

    unlimited = RolloutClient(redis_server.url, ns)  # no limits: nothing is held back, everything is counted
    unlimited.submit_prompts([unlimited.make_prompt(tokens=[1, i], n=50) for i in range(3)], timeout=0.1)
    assert state(unlimited)["submitted"] == "150" == str(queued_samples(unlimited))
    with pytest.raises(ValueError, match="both max_staleness and batch_size"):
        RolloutClient(redis_server.url, ns, max_staleness=1)


def test_the_same_prompt_ids_submitted_again_are_neither_queued_nor_counted_and_the_caller_is_told(
    redis_server: RedisServer, ns: str
) -> None:
    client = RolloutClient(redis_server.url, ns, max_staleness=1, batch_size=8)
    prompts = [client.make_prompt(tokens=[1, i], n=2, id=f"p{i}") for i in range(3)]
    assert client.submit_prompts(prompts) == 3
    assert client.submit_prompts(prompts) == 0  # a producer restarted from its checkpoint, or a retried call
    assert client.streams.redis.xlen(client.streams.keys.prompts) == 3 and state(client)["submitted"] == "6"


# -- the staleness bound -------------------------------------------------------------------------


def test_over_stale_rollouts_are_parked_not_trained_on(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, tiny_model_dir_v1: Path, workers: StartWorker
) -> None:
    workers("w1", "--engine", "synthetic")  # the bound is tested, not the engine's numbers: it serves sooner
    client = RolloutClient(redis_server.url, ns)
    r, keys = client.streams.redis, client.streams.keys
    old = {client.submit(tokens=[5 + i, 40, 41], n=2, max_tokens=8, seed=i) for i in range(4)}
    wait_until(lambda: r.xlen(keys.rollouts) == 8, 60, "the version-0 rollouts, unread")
    originals = {f[b"id"]: f for _, f in as_entries(r.xrange(keys.rollouts))}
    assert client.publish_weights(tiny_model_dir_v1) == 1
    assert client.publish_weights(tiny_model_dir) == 2
    assert client.last_sync is not None and client.last_sync.acked == ["w1"]
    fresh = {client.submit(tokens=[9 + i, 50, 51], n=2, max_tokens=8, seed=i) for i in range(4)}

    got: list[Group] = []
    batches = client.batches(groups_per_batch=2, timeout=60, max_staleness=1)
    while len(got) < len(fresh):
        batch = next(batches)
        assert batch.trainer_version == 2
        for rollout in batch.rollouts:
            assert batch.trainer_version - rollout.version <= 1
        got += batch.groups
    batches.close()  # acks the last batch

    assert {g.prompt_id for g in got} == fresh and not {g.prompt_id for g in got} & old
    assert all(r_.version == 2 and r_.spans == [(2, 0, r_.n_tokens)] for g in got for r_ in g.rollouts)
    parked = [f for _, f in as_entries(r.xrange(keys.stale))]
    assert len(parked) == 8 and {f[b"id"] for f in parked} == set(originals)
    for fields in parked:
        assert fields[b"staleness"] == b"2" and fields[b"trainer_version"] == b"2" and fields[b"version"] == b"0"
        extra = {b"staleness", b"trainer_version"}
        assert {k: v for k, v in fields.items() if k not in extra} == originals[fields[b"id"]]
        Rollout.from_fields(fields)  # still a rollout: it can be inspected or replayed as it was
    assert state(client)["stale"] == "8" and client.stats["stale"] == 8
    assert r.xpending(keys.rollouts, TRAINER)["pending"] == 0
    assert r.xpending(keys.prompts, GENERATORS)["pending"] == 0


def test_a_group_with_one_over_stale_sample_is_parked_whole(redis_server: RedisServer, ns: str) -> None:
    client = RolloutClient(redis_server.url, ns, max_staleness=1, batch_size=4, park=ParkingBound(1))
    client.submit_prompts([client.make_prompt(tokens=[1], n=2, id=pid) for pid in ("mixed", "old", "ok")])
    manager = Manager(client.streams, ack_timeout_s=1)
    for version in (1, 2):
        manager.sync(version, f"redis://{ns}/v{version}")
    fake_rollouts(client, "mixed", [2, 0])  # sample 1 began at version 0: staleness 2
    fake_rollouts(client, "old", [0, 0])
    fake_rollouts(client, "ok", [1, 2])

    (group,) = client.collect(1, timeout=10)  # the client's parking bound is the default
    assert group.prompt_id == "ok" and group.trainer_version == 2
    parked = [
        (f[b"id"], f[b"staleness"]) for _, f in as_entries(client.streams.redis.xrange(client.streams.keys.stale))
    ]
    assert parked == [(b"mixed:0", b"0"), (b"mixed:1", b"2"), (b"old:0", b"2"), (b"old:1", b"2")]
    assert client.stats["stale"] == 4 and state(client)["stale"] == "4"
    usage = client.admission_usage()
    assert (usage.submitted, usage.stale, usage.used, usage.capacity) == (6, 4, 2, 16), "parked samples free capacity"
    assert client.streams.redis.xpending(client.streams.keys.rollouts, TRAINER)["pending"] == 0
    # Parking is idempotent: a second attempt on the same entries moves and counts nothing.
    entries = [(entry_id, 2) for entry_id, _ in as_entries(client.streams.redis.xrange(client.streams.keys.rollouts))]
    assert len(entries) == 6
    assert StaleRollouts(client.streams.redis, client.streams.keys, TRAINER).park(2, entries) == 0
    assert state(client)["stale"] == "4"
    assert client.streams.redis.xlen(client.streams.keys.stale) == 4


def test_nothing_is_parked_unless_a_parking_bound_is_named(redis_server: RedisServer, ns: str) -> None:
    """Admission bounds staleness; what it admitted reaches the trainer however many syncs a sample outlived."""
    client = RolloutClient(redis_server.url, ns, max_staleness=0, batch_size=4)
    client.submit_prompts([client.make_prompt(tokens=[1], n=2, id=pid) for pid in ("long", "old")])
    manager = Manager(client.streams, ack_timeout_s=1)
    for version in (1, 2, 3):
        manager.sync(version, f"redis://{ns}/v{version}")
    fake_rollouts(client, "long", [0, 0], spans=[[(0, 0, 1), (1, 1, 2), (3, 2, 8)], [(0, 0, 4)]])
    fake_rollouts(client, "old", [0, 0])
    batch = next(client.batches(groups_per_batch=2, timeout=10))
    assert {g.prompt_id for g in batch.groups} == {"long", "old"} and client.stats["stale"] == 0
    assert client.streams.redis.xlen(client.streams.keys.stale) == 0
    staleness = batch.staleness(trainer_version=3)
    # long:0 is 3 versions old at its first token, 0 at its last, (3 + 2 + 0 x 6) / 8 on average over its tokens
    assert SampleStaleness.of(batch.groups[0].rollouts[0], 3) == SampleStaleness(first=3, last=0, mean=5 / 8)
    assert staleness["first"] == 3 and staleness["last"] == pytest.approx(9 / 4) and staleness["max"] == 3
    assert staleness["token_mean"] == pytest.approx((5 + 3 * 4 + 3 * 2 + 3 * 2) / 16)


@pytest.mark.parametrize(("bound", "parked"), [(ParkingBound(1, max_share=0.5), False), (ParkingBound(1, 0.2), True)])
def test_a_parking_bound_on_the_share_of_old_tokens(
    redis_server: RedisServer, ns: str, bound: ParkingBound, parked: bool
) -> None:
    """A sample 2 of whose 8 tokens are more than 1 version old: kept under a 50 % bound, parked under 20 %."""
    client = RolloutClient(redis_server.url, ns, park=bound)
    client.submit_prompts([client.make_prompt(tokens=[1], n=2, id=pid) for pid in ("long", "ok")])
    manager = Manager(client.streams, ack_timeout_s=1)
    for version in (1, 2, 3):
        manager.sync(version, f"redis://{ns}/v{version}")
    fake_rollouts(client, "long", [0, 3], spans=[[(0, 0, 2), (2, 2, 5), (3, 5, 8)], [(3, 0, 2)]])
    fake_rollouts(client, "ok", [3, 3])
    got = client.collect(1 if parked else 2, timeout=10)
    assert [g.prompt_id for g in got] == (["ok"] if parked else ["long", "ok"])
    assert client.stats["stale"] == (2 if parked else 0)


@pytest.mark.parametrize(("age", "share", "fix"), [(-1, 0.0, "max_age must be >= 0"), (1, 1.0, "in [0, 1)")])
def test_a_parking_bound_it_cannot_keep_says_what_to_fix(age: int, share: float, fix: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fix)):
        ParkingBound(age, share)


def test_a_fully_async_loop_keeps_every_bound(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, tiny_model_dir_v1: Path, workers: StartWorker
) -> None:
    """Producer thread and trainer loop at once, weights published mid-generation, a parking bound named: no bound is
    ever broken."""
    workers("w1", "--engine", "synthetic")  # the bounds are tested, not the engine's numbers: it serves sooner
    eta, batch_size, n, prompts = 1, 4, 2, 16
    client = RolloutClient(redis_server.url, ns, max_staleness=eta, batch_size=batch_size, submit_timeout_s=120)
    peaks: list[tuple[int, int]] = []

    def produce() -> None:
        for i in range(prompts):
            client.submit(tokens=[5 + i, 60, 61], n=n, max_tokens=120, seed=i)
            usage = client.admission_usage()
            assert usage.capacity is not None
            peaks.append((usage.used, usage.capacity))

    producer = Background(produce)
    trained: list[Group] = []
    models = [tiny_model_dir_v1, tiny_model_dir]
    groups = client.groups(timeout=15, park=ParkingBound(eta))  # a timeout means the loop is stuck: the count fails
    while len(trained) + client.stats["stale"] // n < prompts:
        try:
            group = next(groups)
        except TimeoutError:
            break
        assert group.trainer_version is not None
        assert all(group.trainer_version - r.version <= eta for r in group.rollouts)
        trained.append(group)
        if len(trained) % (batch_size // n) == 0 and len(trained) < prompts:
            client.publish_weights(models[len(trained) // 2 % 2], mode="abort")
    groups.close()
    producer.join(120)

    assert len(trained) + client.stats["stale"] // n == prompts
    assert all(used <= capacity for used, capacity in peaks)
    assert int(state(client).get("stale", 0)) == client.stats["stale"]
    assert client.streams.redis.xlen(client.streams.keys.stale) == client.stats["stale"]
    assert client.streams.redis.xpending(client.streams.keys.rollouts, TRAINER)["pending"] == 0


# -- rollouts top -------------------------------------------------------------------------------


def test_top_shows_the_stale_stream_and_the_counters(redis_server: RedisServer, ns: str) -> None:
    client = RolloutClient(redis_server.url, ns, max_staleness=1, batch_size=4, park=ParkingBound(1))
    client.submit_prompts([client.make_prompt(tokens=[1], n=2, id=pid) for pid in ("a", "b")])
    manager = Manager(client.streams, ack_timeout_s=1)
    for version in (1, 2, 3):
        manager.sync(version, f"redis://{ns}/v{version}")
    fake_rollouts(client, "a", [0, 1])
    with pytest.raises(TimeoutError):
        next(client.groups(timeout=1))  # "a" is parked (staleness 3 > 1); nothing else arrives

    def top(*extra: str) -> subprocess.CompletedProcess[str]:
        args = [sys.executable, "-m", "rollouts", "top", "--redis", redis_server.url, "--ns", ns, "--once"]
        return subprocess.run([*args, *extra], capture_output=True, text=True, timeout=60, check=True)

    snap = json.loads(top("--json").stdout)
    assert snap["streams"]["stale"] == {"length": 2, "groups": {}}
    assert snap["policy"] == {
        "version": 3,
        "epoch": 3,
        "paused": False,
        "submitted": 4,
        "stale": 2,
        "used": 2,
        "max_staleness": 1,
        "batch_size": 4,
        "capacity": 20,
        "free": 18,
    }
    assert snap["state"]["stale"] == "2" and snap["state"]["submitted"] == "4"
    table = top().stdout
    assert "stale" in table and "policy and admission" in table and "capacity" in table
