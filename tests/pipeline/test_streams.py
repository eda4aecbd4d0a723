"""The stream layer on fakeredis and on a real redis-server."""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import redis

from pipeline.codec import as_entries, for_redis
from pipeline.connections import connect, retried_failures, socket_timeout_s
from pipeline.control import ABORT_COST_S, BELLS, WAKE_COST_S, WAKE_WAVE, bell_index, wave_gap, waves
from pipeline.local import RedisServer
from pipeline.lua import register_all, sources
from pipeline.publisher import Publisher
from pipeline.registry import sweep_chance
from pipeline.streams import (
    BLOCK_MARGIN_MS,
    SCRIPTS,
    TRIM_CHUNK,
    Entry,
    Publish,
    Streams,
    entries_from_reply,
    trim_consumed,
)
from pipeline.wire import GENERATORS, HAND_OFF, PARTIALS_FIELD, TRAINER, Control, PauseMode, Prompt, Rollout
from producers.client import READ_BYTES, RolloutClient
from producers.gateway.sessions import SCRIPTS as gateway_scripts
from staleness.admission import SCRIPTS as staleness_scripts
from staleness.manager import Manager
from tests.fixtures import EVERY_SERVER, wait_until


def prompt(pid: str, n: int = 2) -> Prompt:
    return Prompt(id=pid, n=n, tokens=[1, 2, 3])


def rollouts_for(p: Prompt, worker: str = "w") -> list[Rollout]:
    return [
        Rollout(
            prompt_id=p.id,
            sample=k,
            n=p.n,
            version=0,
            version_end=0,
            finish_reason="length",
            worker=worker,
            prompt_tokens=p.tokens,
            tokens=np.arange(4),
            logprobs=np.full(4, -1.0),
            spans=[(0, 0, 4)],
        )
        for k in range(p.n)
    ]


def taken(client: redis.Redis, ns: str, count: int) -> tuple[Streams, list[Prompt], list[Entry]]:
    """`count` prompts `p0`, `p1`... queued on a namespace's streams and read by worker `w1`: work to publish."""
    streams = Streams(client, ns)
    streams.ensure_groups()
    prompts = [prompt(f"p{i}") for i in range(count)]
    streams.writer.add_prompts(prompts)
    return streams, prompts, streams.work.read_work("w1", count, None)


def test_a_read_serves_partials_then_the_inbox_then_prompts_and_a_take_keeps_to_its_room(
    any_redis: redis.Redis, ns: str
) -> None:
    """One XREADGROUP over several streams applies its COUNT to each: a blocking read for one entry takes one from
    each stream that has work. A take (its share, `share.lua`: all that waits for a lone worker, up to its room)
    reads partials alone while they last, then the rest of its share from the inbox and prompts, as many of each
    (the worker holds what does not fit). A claim of abandoned work counts in all, partials first."""
    streams = Streams(any_redis, ns)
    streams.ensure_groups()
    streams.work.join("w1")
    partials, inbox, prompts = streams.keys.partials, streams.keys.inbox("w1"), streams.keys.prompts
    for k in range(4):
        any_redis.xadd(partials, {"k": k})
    for k in range(3):
        streams.writer.add_to_inbox("w1", prompt(f"mine{k}"))
    streams.writer.add_prompts([prompt(f"p{k}") for k in range(4)])

    def take(room: int) -> list[str]:
        return [entry.stream for entry in streams.work.take("w1", room, 0, 3000)[0]]

    assert [entry.stream for entry in streams.work.read_work("w1", 1, None)] == [partials, inbox, prompts]
    assert take(2) == [partials] * 2  # partials alone while they last
    assert take(3) == [partials, inbox, inbox, prompts, prompts]  # the rest of its share: COUNT 2 on each stream
    assert take(10) == [prompts]  # one waits in the shared streams: its share
    assert take(10) == []
    wait_until(lambda: asked_ago_ms(any_redis, streams, "w1") > 10, 10, "w1's last ask to age 10 ms")
    claimed, _ = streams.work.claim_abandoned(
        "w2", min_idle_ms=0, count=5, horizon_ms=10
    )  # w1 asked too long ago to count
    assert [entry.stream for entry in claimed] == [partials] * 4 + [prompts]  # of 8 pending on w1
    any_redis.delete(prompts)  # deleted under its readers: the next XADD makes it again, without the group
    streams.writer.add_prompts([prompt("again")])
    assert take(10) == [prompts]


@pytest.mark.parametrize("stream", ["prompts", "partials"])
def test_a_take_leaves_the_other_workers_with_room_their_share(any_redis: redis.Redis, ns: str, stream: str) -> None:
    """Four workers asked for work (the ready set): of 16 entries (prompts, or the partials an abort sync left) the
    first to ask takes a quarter, though it has room for all; one that holds more than the least-holding worker is
    told it is the others' turn; a full worker leaves the ready set, one that stopped asking drops off it after the
    horizon, and then the last one asking takes all that waits."""
    streams = Streams(any_redis, ns)
    streams.ensure_groups()
    for name in ("w1", "w2", "w3", "w4"):
        assert streams.work.take(name, 64, 0, 60_000) == ([], False)  # nothing waits: on the ready set, with room
    key = getattr(streams.keys, stream)
    for k in range(16):
        any_redis.xadd(key, for_redis(prompt(f"p{k}").to_fields()) if stream == "prompts" else {"k": k})

    def took(name: str, room: int, held: int, horizon_ms: int = 60_000) -> int | str:
        entries, others_turn = streams.work.take(name, room, held, horizon_ms)
        assert all(entry.stream == key for entry in entries)
        return "others' turn" if others_turn else len(entries)

    assert took("w1", 64, 0) == 4
    assert took("w2", 64, 0) == 3  # 12 wait: a quarter, rounded up
    assert took("w1", 64, 4) == "others' turn"  # w3 and w4 hold nothing yet
    assert took("w3", 1, 0) == 1  # full now: off the ready set
    assert any_redis.zscore(streams.keys.ready, "w3") is None
    assert took("w4", 64, 0) == 3  # 8 wait over three with room
    assert took("w2", 64, 3) == 2  # holds the least (3, as w4): 5 wait over three

    def others_quiet() -> float:
        return min(asked_ago_ms(any_redis, streams, "w2"), asked_ago_ms(any_redis, streams, "w4"))

    wait_until(lambda: others_quiet() > 100, 10, "the others to go quiet for 100 ms")
    assert took("w1", 64, 4, horizon_ms=100) == 3  # all that waits: it is the only one with room that asks
    assert any_redis.xinfo_groups(key)[0]["pending"] == 16


def test_a_heartbeat_with_room_counts_a_waiting_worker_in_the_others_shares(any_redis: redis.Redis, ns: str) -> None:
    """A worker that waits for work in a blocking read asks for no share, but its heartbeat says it has room: the
    others then leave it its share; once its heartbeat says it is full (or paused) it is counted no more."""
    streams = Streams(any_redis, ns)
    streams.ensure_groups()
    streams.registry.heartbeat("waiting", {"status": "serving"}, ttl_s=5, dead_after_s=2.5, room=8, held=0)
    streams.writer.add_prompts([prompt(f"p{k}") for k in range(8)])
    entries, _ = streams.work.take("busy", 64, 0, 60_000)
    assert len(entries) == 4  # half: the waiting worker is on the ready set
    streams.registry.heartbeat("waiting", {"status": "serving"}, ttl_s=5, dead_after_s=2.5, room=0, held=8)
    assert any_redis.zscore(streams.keys.ready, "waiting") is None
    entries, _ = streams.work.take("busy", 64, 4, 60_000)
    assert len(entries) == 4  # alone on the ready set: all that waits


def test_a_heartbeat_survives_a_redis_that_lost_its_scripts(any_redis: redis.Redis, ns: str) -> None:
    """It sends `beat.lua` by SHA alone in its pipeline; a Redis restarted without the scripts (here flushed)
    answers NOSCRIPT, and the script is loaded and the heartbeat sent again."""
    streams = Streams(any_redis, ns)
    streams.ensure_groups()
    streams.work.join("w1")
    streams.writer.add_prompts([prompt("p0")])
    any_redis.script_flush()
    assert streams.registry.heartbeat("w1", {"status": "serving"}, ttl_s=5, dead_after_s=2.5, room=4) == 1
    assert any_redis.zscore(streams.keys.beats, "w1") is not None
    assert any_redis.zscore(streams.keys.ready, "w1") is not None


def test_a_silent_workers_work_is_claimed_at_once_and_a_live_workers_never(any_redis: redis.Redis, ns: str) -> None:
    """A worker whose heartbeat has been silent longer than the silence it declared loses its work to a claimer as
    soon as the work idles `quick_ms`, oldest first, whatever `min_idle_ms` says; a live worker's work idle just as
    long stays with it, and so does the work of a consumer that never declared one (until `min_idle_ms`)."""
    streams = Streams(any_redis, ns)
    streams.ensure_groups()
    streams.writer.add_prompts([prompt(f"p{k}") for k in range(6)])
    for name in ("alive", "silent"):
        streams.registry.heartbeat(name, {"status": "serving"}, ttl_s=5, dead_after_s=0.2)
    mine = streams.work.read_work("alive", 2, None) + streams.work.read_work("silent", 2, None)
    streams.work.read_work("never-beat", 2, None)

    def deadline_passed() -> bool:
        seconds, micros = any_redis.time()
        return seconds * 1000 + micros / 1000 > float(any_redis.zscore(streams.keys.beats, "silent") or 0) + 50

    wait_until(deadline_passed, 10, "the silent worker's deadline to pass")
    streams.registry.heartbeat("alive", {"status": "serving"}, ttl_s=5, dead_after_s=0.2)
    wait_until(lambda: idle_ms(any_redis, streams) >= 100, 10, "the work to idle 100 ms")
    claimed, _ = streams.work.claim_abandoned("rescuer", min_idle_ms=60_000, count=10, quick_ms=100)
    assert [Prompt.from_fields(e.fields).id for e in claimed] == ["p2", "p3"]
    assert streams.work.delivery_count(mine[0]) == 1
    streams.registry.forget_worker("silent")
    assert any_redis.zscore(streams.keys.beats, "silent") is None


def test_a_dead_workers_work_is_shared_out_to_the_workers_that_hold_least(any_redis: redis.Redis, ns: str) -> None:
    """Two rescuers with room: the one that holds more is told it is the other's turn, the other takes its half."""
    streams = Streams(any_redis, ns)
    streams.ensure_groups()
    streams.writer.add_prompts([prompt(f"p{k}") for k in range(4)])
    streams.work.read_work("gone", 4, None)  # never beat: claimed once idle past min_idle_ms
    assert streams.work.take("busy", 64, 4, 60_000) == ([], False)
    assert streams.work.take("idle", 64, 0, 60_000) == ([], False)
    wait_until(lambda: idle_ms(any_redis, streams) >= 20, 10, "the work to idle 20 ms")
    assert streams.work.claim_abandoned("busy", 10, 64, 10, 60_000, held=4) == ([], True)
    claimed, others_turn = streams.work.claim_abandoned("idle", 10, 64, 10, 60_000, held=0)
    assert [Prompt.from_fields(e.fields).id for e in claimed] == ["p0", "p1"] and not others_turn


def asked_ago_ms(client: redis.Redis, streams: Streams, name: str) -> float:
    """How long ago (Redis's clock) worker `name` last asked for work with room (its score on the ready set)."""
    seconds, micros = client.time()
    return seconds * 1000 + micros / 1000 - float(client.zscore(streams.keys.ready, name) or 0)


def idle_ms(client: redis.Redis, streams: Streams) -> int:
    """The least idle time of the prompts pending on anyone."""
    pending = client.xpending_range(streams.keys.prompts, GENERATORS, "-", "+", 100)
    return min(int(p["time_since_delivered"]) for p in pending)


def test_groups_are_created_once(any_redis: redis.Redis, ns: str) -> None:
    streams = Streams(any_redis, ns)
    streams.ensure_groups()
    streams.ensure_groups()
    assert [g["name"] for g in any_redis.xinfo_groups(streams.keys.prompts)] == [GENERATORS.encode()]
    assert [g["name"] for g in any_redis.xinfo_groups(streams.keys.rollouts)] == [TRAINER.encode()]


def test_partials_are_read_before_prompts(any_redis: redis.Redis, ns: str) -> None:
    streams = Streams(any_redis, ns)
    streams.ensure_groups()
    streams.writer.add_prompts([prompt("a"), prompt("b")])
    any_redis.xadd(streams.keys.partials, {b"x": b"1"})
    entries = streams.work.read_work("w1", count=10, block_ms=None)
    assert [e.stream for e in entries] == [streams.keys.partials, streams.keys.prompts, streams.keys.prompts]
    assert streams.work.read_work("w1", count=10, block_ms=None) == []


def test_publish_is_atomic_idempotent_and_acks(any_redis: redis.Redis, ns: str) -> None:
    streams = Streams(any_redis, ns)
    streams.ensure_groups()
    p = prompt("p1", n=3)
    streams.writer.add_prompts([p])
    (entry,) = streams.work.read_work("w1", 10, None)
    assert streams.writer.publish_rollouts(rollouts_for(p), entry) == 3
    assert any_redis.xpending(streams.keys.prompts, GENERATORS)["pending"] == 0
    # The same work finished a second time (a slow worker whose entry was claimed) publishes nothing.
    assert streams.writer.publish_rollouts(rollouts_for(p, worker="w2"), entry) == -1
    # The same prompt id submitted again: its rollout ids are already published.
    streams.writer.add_prompts([p])
    (again,) = streams.work.read_work("w2", 10, None)
    assert streams.writer.publish_rollouts(rollouts_for(p), again) == 0
    ids = [fields[b"id"] for _, fields in as_entries(any_redis.xrange(streams.keys.rollouts))]
    assert ids == [b"p1:0", b"p1:1", b"p1:2"]
    assert any_redis.xpending(streams.keys.prompts, GENERATORS)["pending"] == 0


def test_the_dedupe_remembers_each_id_for_its_ttl_in_a_few_hashes(any_redis: redis.Redis, ns: str) -> None:
    """No key per rollout: a bit per sample under its prompt id, in time buckets; an id comes out once within the
    TTL (published whole, sample by sample, or added without a source entry) and again only after it (and at most one
    bucket, TTL / 8, later)."""
    streams = Streams(any_redis, ns, dedupe_ttl_s=240)  # 8 buckets of 30 s
    streams.ensure_groups()
    now = 1_000_000.0
    streams.writer.clock = lambda: now
    p = prompt("p1", n=4096)
    (first, *_) = rollouts_for(p)
    made = [first.model_copy(update={"sample": k}) for k in (0, 9, 4095)]

    def publish(rollouts: list[Rollout]) -> int:
        streams.writer.add_prompts([p])
        (entry,) = streams.work.read_work("w1", 1, None)
        return streams.writer.publish_rollouts(rollouts, entry)

    assert publish(made[:1]) == 1
    now += 100  # another bucket: samples 9 and 4095 are new, sample 0 is not
    assert publish(made) == 2
    now += 130  # 230 s after the first: still within the TTL
    assert publish(made) == 0 and streams.writer.add_rollouts(made) == 0
    keys = [k for k in any_redis.scan_iter(match=f"{{{ns}}}:published:*")]
    assert len(keys) == 2  # two buckets, whatever the number of rollouts
    now += 41  # 271 s after the first (past the TTL and the bucket it fell in), 171 s after the others
    assert publish(made) == 1  # only sample 0 is new again
    ids = [fields[b"id"] for _, fields in as_entries(any_redis.xrange(streams.keys.rollouts))]
    assert ids == [b"p1:0", b"p1:9", b"p1:4095", b"p1:0"]
    ttl = any_redis.ttl(streams.writer.dedupe_buckets()[0][-1])
    assert 0 < ttl <= 300  # a bucket lives as long as a publish may look at it, then goes


def test_publishes_sent_together_are_each_atomic_and_deduped(any_redis: redis.Redis, ns: str) -> None:
    """Several entries' publishes in one pipeline (what a worker finished at the same moment): each is still its own
    script, so an entry finished already elsewhere writes nothing while its neighbours publish; a sample twice in one
    call, or a prompt's id in two entries of one pipeline, comes out once."""
    streams = Streams(any_redis, ns)
    streams.ensure_groups()
    a, b, c = prompt("a", n=3), prompt("b"), prompt("c")
    streams.writer.add_prompts([a, b, c, a])
    e_a, e_b, e_c, e_a2 = streams.work.read_work("w1", 10, None)
    assert streams.writer.publish_rollouts(rollouts_for(b), e_b) == 2  # b finished first (a claim raced)
    twice = rollouts_for(a)[:2] + rollouts_for(a)  # samples 0 and 1 twice in one call
    done = streams.writer.publish_many(
        [Publish(twice, e_a), Publish(rollouts_for(b), e_b), Publish(rollouts_for(c), e_c)]
    )
    assert done == [3, -1, 2]
    assert streams.writer.publish_many([Publish(rollouts_for(a), e_a2)]) == [0]  # a's ids again, from another entry
    ids = [fields[b"id"] for _, fields in as_entries(any_redis.xrange(streams.keys.rollouts))]
    assert ids == [b"b:0", b"b:1", b"a:0", b"a:1", b"a:2", b"c:0", b"c:1"]
    assert any_redis.xpending(streams.keys.prompts, GENERATORS)["pending"] == 0


def test_a_publisher_coalesces_concurrent_publishes_and_answers_each(real_redis: redis.Redis, ns: str) -> None:
    """What finishes while a publish is on the wire goes out in one round trip with others, and each caller gets its
    own answer: its count, -1 for an entry finished elsewhere, or its own error (its neighbours still publish)."""
    streams, prompts, entries = taken(real_redis, ns, 40)
    streams.writer.publish_rollouts(rollouts_for(prompts[7]), entries[7])  # p7 was finished by another worker
    real_redis.set(streams.keys.replies("broken"), "not a stream")  # p9's publish fails in Redis
    publisher = Publisher(streams.writer, max_batch=8)

    async def publish_all() -> list[int | BaseException]:
        calls = [
            publisher.publish(rollouts_for(p), entry, reply_to="broken" if p.id == "p9" else None)
            for p, entry in zip(prompts, entries, strict=True)
        ]
        return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(publish_all())
    assert isinstance(results[9], redis.ResponseError) and "WRONGTYPE" in str(results[9])
    assert results[7] == -1
    assert [r for i, r in enumerate(results) if i not in (7, 9)] == [2] * 38
    assert 5 <= publisher.batches < 40  # at most 8 a pipeline, and more than one a pipeline
    published = [fields[b"prompt_id"] for _, fields in as_entries(real_redis.xrange(streams.keys.rollouts))]
    assert sorted(set(published)) == sorted(p.id.encode() for p in prompts if p.id != "p9")
    assert len(published) == 2 * 39


@pytest.mark.parametrize("senders", [1, 2])
def test_a_publisher_never_strands_a_publish_made_as_its_senders_finish(
    any_redis: redis.Redis, ns: str, senders: int
) -> None:
    """A caller woken by its publish's answer runs before the sender that answered it has ended: its next publish,
    made at once, must still be sent (CI's sync-mode GRPO run hung on a publish left waiting with no sender)."""
    streams, prompts, entries = taken(any_redis, ns, 12)
    publisher = Publisher(streams.writer, senders=senders)

    async def chain(items: list[tuple[Prompt, Entry]]) -> list[int]:
        return [await publisher.publish(rollouts_for(p), entry) for p, entry in items]

    async def publish_all() -> list[list[int]]:
        pairs = list(zip(prompts, entries, strict=True))
        chains = [chain(pairs[k::senders]) for k in range(senders)]  # as many callers as senders, each in a chain
        return await asyncio.wait_for(asyncio.gather(*chains), timeout=10)

    results = asyncio.run(publish_all())
    assert sorted(r for chain_results in results for r in chain_results) == [2] * 12
    assert any_redis.xlen(streams.keys.rollouts) == 24


def test_a_publish_writes_exactly_the_fields_of_the_wire_contract(any_redis: redis.Redis, ns: str) -> None:
    """The publish is packed by hand (`Streams._pipelined`), not by redis-py's pipeline: every entry still carries
    `Rollout.to_fields()`, the same names, order and bytes, optional fields and non-ASCII text included."""
    streams = Streams(any_redis, ns)
    streams.ensure_groups()
    a, b = prompt("a", n=3), prompt("b/é")
    streams.writer.add_prompts([a, b])
    e_a, e_b = streams.work.read_work("w1", 10, None)
    plain = rollouts_for(a)
    plain[1] = plain[1].model_copy(update={"reward": 0.5, "mask": [(0, 2)], "cached_tokens": 3, "adapter": "lora-1"})
    plain[2] = plain[2].model_copy(update={"finish_reason": "error", "error": "engine said ✗\r\n", "tokens": []})
    plain[2] = plain[2].model_copy(update={"logprobs": np.zeros(0, np.float32), "spans": []})
    other = [r.model_copy(update={"meta": {"k": "✓", "n": [1, 2]}, "timing": {"x": 1e-9}}) for r in rollouts_for(b)]
    assert streams.writer.publish_many([Publish(plain, e_a), Publish(other, e_b)]) == [3, 2]
    written = [list(fields.items()) for _, fields in as_entries(any_redis.xrange(streams.keys.rollouts))]
    assert written == [list(r.to_fields().items()) for r in plain + other]
    assert [Rollout.from_fields(dict(f)).id for f in written] == [r.id for r in plain + other]


@pytest.mark.parametrize("redis_server", EVERY_SERVER, indirect=True)
def test_a_publish_after_a_script_flush_or_a_lost_reply_still_goes_once(
    redis_server: RedisServer, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The publish's own pipelined send keeps what redis-py's pipeline did for it: a script Redis no longer knows is
    loaded and run again (those calls ran nothing), and a connection lost before the replies came is retried with the
    client's policy (`connect`: reconnect and send again); the calls that ran already find their entries acked and
    write nothing (-1), so every rollout is there exactly once."""

    client = connect(redis_server.url)
    streams, prompts, entries = taken(client, ns, 6)
    first = [Publish(rollouts_for(p), e) for p, e in zip(prompts[:2], entries[:2], strict=True)]
    assert streams.writer.publish_many(first) == [2, 2]
    client.script_flush()
    assert streams.writer.publish_many([Publish(rollouts_for(prompts[2]), entries[2])]) == [2]

    read = redis.connection.Connection.read_response
    lost: list[redis.connection.Connection] = []

    def lose_the_first_reply(connection: redis.connection.Connection, *args: object, **kwargs: object) -> object:
        if not lost:  # the scripts ran (their rollouts are there), then the connection drops before any reply
            lost.append(connection)  # first: the wait below reads through this same method
            with redis.Redis.from_url(redis_server.url) as other:
                wait_until(lambda: other.xlen(streams.keys.rollouts) == 12, 10, "the scripts to run")
            connection.disconnect()
            raise redis.ConnectionError("connection lost")
        return read(connection, *args, **kwargs)

    monkeypatch.setattr(redis.connection.Connection, "read_response", lose_the_first_reply)
    failures = retried_failures(client)
    done = streams.writer.publish_many(
        [Publish(rollouts_for(p), e) for p, e in zip(prompts[3:], entries[3:], strict=True)]
    )
    assert done == [-1, -1, -1] and lost and retried_failures(client) == failures + 1
    ids = [fields[b"id"] for _, fields in as_entries(client.xrange(streams.keys.rollouts))]
    assert ids == [f"{p.id}:{k}".encode() for p in prompts for k in range(2)]
    assert client.xpending(streams.keys.prompts, GENERATORS)["pending"] == 0
    client.close()


def test_a_publisher_sends_a_full_window_as_several_pipelines_at_once(real_redis: redis.Redis, ns: str) -> None:
    """A worker's window finishing together (64 prompts) goes out as several batches on several connections, so that
    Redis runs one while the worker encodes the next; each prompt still gets its own answer."""
    streams, prompts, entries = taken(real_redis, ns, 64)
    publisher = Publisher(streams.writer)

    async def publish_all() -> list[int]:
        return await asyncio.gather(
            *(publisher.publish(rollouts_for(p), e) for p, e in zip(prompts, entries, strict=True))
        )

    assert asyncio.run(publish_all()) == [2] * 64
    assert publisher.batches >= 64 // publisher.max_batch
    assert real_redis.xlen(streams.keys.rollouts) == 128


def test_dead_letter_keeps_the_original_and_acks(any_redis: redis.Redis, ns: str) -> None:
    streams = Streams(any_redis, ns)
    streams.ensure_groups()
    any_redis.xadd(streams.keys.prompts, {b"garbage": b"\xff"})
    (entry,) = streams.work.read_work("w1", 10, None)
    assert streams.dead_letter(entry, "missing field 'v'", "decode")
    # Again (a claim that raced with it, a call retried after its reply was lost): no second dead letter.
    assert not streams.dead_letter(entry, "missing field 'v'", "decode")
    ((_, dead),) = as_entries(any_redis.xrange(streams.keys.dead))
    assert dead == {b"garbage": b"\xff", b"error": b"missing field 'v'", b"stage": b"decode"}
    assert any_redis.xpending(streams.keys.prompts, GENERATORS)["pending"] == 0


@pytest.mark.parametrize("how", ["touch", "heartbeat"])
def test_abandoned_work_is_claimed_but_touched_work_is_not(any_redis: redis.Redis, ns: str, how: str) -> None:
    """A worker keeps its work by touching it, alone or in its heartbeat's round trip (what its upkeep does)."""
    streams = Streams(any_redis, ns)
    streams.ensure_groups()
    streams.writer.add_prompts([prompt("alive"), prompt("dead")])
    alive, dead = streams.work.read_work("w1", 10, None)

    def idle_ms(entry: Entry) -> int:
        (info,) = any_redis.xpending_range(streams.keys.prompts, GENERATORS, entry.id, entry.id, 1)
        return int(info["time_since_delivered"])

    wait_until(lambda: idle_ms(dead) >= 400, 10, "the entries to idle past 400 ms")
    if how == "touch":  # w1 still works on `alive`: its idle time starts again
        streams.work.touch("w1", [alive])
    else:
        registered = streams.registry.heartbeat("w1", {"status": "serving"}, ttl_s=5, touch=[alive])
        assert registered == 1  # one worker registered
        assert any_redis.hget(streams.keys.worker("w1"), "status") == b"serving"
    assert [e.id for e in streams.work.claim_abandoned("w2", min_idle_ms=300, count=10)[0]] == [dead.id]
    assert streams.work.delivery_count(dead) == 2
    assert streams.work.delivery_count(alive) == 1


def test_work_deleted_while_pending_is_acked_not_claimed(any_redis: redis.Redis, ns: str) -> None:
    """Redis 6.2 keeps a deleted entry in the PEL (7.0 drops it on XAUTOCLAIM): either way it must leave."""
    streams = Streams(any_redis, ns)
    streams.ensure_groups()
    streams.writer.add_prompts([prompt("kept"), prompt("deleted"), prompt("kept-too")])
    held = streams.work.read_work("w1", count=10, block_ms=None)
    any_redis.xdel(streams.keys.prompts, held[1].id)

    def idle_ms() -> int:
        pending = any_redis.xpending_range(streams.keys.prompts, GENERATORS, "-", "+", 10)
        return min(int(p["time_since_delivered"]) for p in pending)

    wait_until(lambda: idle_ms() >= 20, 10, "the held entries to idle")  # fakeredis counts idle 0 as not idle
    claimed, _ = streams.work.claim_abandoned("w2", min_idle_ms=10, count=10)
    assert [Prompt.from_fields(e.fields).id for e in claimed] == ["kept", "kept-too"]
    pending = any_redis.xpending_range(streams.keys.prompts, GENERATORS, "-", "+", 10)
    assert [(p["message_id"], p["consumer"]) for p in pending] == [(held[0].id, b"w2"), (held[2].id, b"w2")]
    assert [p["times_delivered"] for p in pending] == [2, 2], "a claim counts as a delivery (poison detection)"
    for entry in claimed:
        streams.writer.publish_rollouts(rollouts_for(Prompt.from_fields(entry.fields)), entry)
    assert any_redis.xpending(streams.keys.prompts, GENERATORS)["pending"] == 0
    assert trim_consumed(streams.redis, streams.keys.prompts) == 2, "nothing pending holds back the trim"


def test_a_trainer_rereading_deleted_rollouts_acks_them(any_redis: redis.Redis, ns: str) -> None:
    streams = Streams(any_redis, ns)
    streams.ensure_groups()
    ids = [any_redis.xadd(streams.keys.rollouts, {b"i": str(i).encode()}) for i in range(5)]
    assert len(streams.trainer.read_rollouts("t", count=10, block_ms=None)) == 5
    any_redis.xdel(streams.keys.rollouts, *ids[:3])  # someone trimmed behind the trainer's back
    again = streams.trainer.read_rollouts(
        "t", count=3, block_ms=None, pending=True
    )  # a first page of deleted ones only
    assert [e.id for e in again] == ids[3:]
    assert any_redis.xpending(streams.keys.rollouts, TRAINER)["pending"] == 2


def test_trim_never_passes_the_slowest_group(any_redis: redis.Redis, ns: str) -> None:
    streams = Streams(any_redis, ns)
    streams.ensure_groups()
    rollouts = streams.keys.rollouts
    any_redis.xgroup_create(rollouts, "recorder", id="0")
    ids = [any_redis.xadd(rollouts, {b"i": str(i).encode()}) for i in range(6)]
    any_redis.xreadgroup(TRAINER, "t", {rollouts: ">"}, count=4)
    any_redis.xack(rollouts, TRAINER, *ids[:3])  # trainer: 3 acked, 1 pending
    any_redis.xreadgroup("recorder", "r", {rollouts: ">"}, count=5)
    any_redis.xack(rollouts, "recorder", *ids[:5])
    assert trim_consumed(streams.redis, rollouts) == 3
    assert [i for i, _ in as_entries(any_redis.xrange(rollouts))] == ids[3:]


def test_a_stream_that_is_gone_has_nothing_to_trim_and_a_read_makes_it_again(any_redis: redis.Redis, ns: str) -> None:
    """A worker's inbox lost with a primary whose writes no replica had: its upkeep's trim finds nothing to do (not an
    error every period), and its next read makes the inbox and its group again."""
    streams = Streams(any_redis, ns)
    streams.ensure_groups()
    streams.work.join("w1")
    inbox = streams.keys.inbox("w1")
    any_redis.delete(inbox)
    assert trim_consumed(streams.redis, inbox) == 0
    streams.work.read_work("w1", count=1, block_ms=None)
    assert [g["name"] for g in any_redis.xinfo_groups(inbox)] == [GENERATORS.encode()]


def test_a_large_backlog_is_trimmed_in_commands_of_a_bounded_size(real_redis: redis.Redis, ns: str) -> None:
    """Freeing a long consumed backlog (10 s of a busy trainer's rollouts) in one command holds Redis, and every
    client, for tens of ms; it goes in chunks of at most `TRIM_CHUNK` entries, and still exactly to the slowest group
    (its unread entries stay)."""
    streams = Streams(real_redis, ns)
    streams.ensure_groups()
    rollouts = streams.keys.rollouts
    pipe = real_redis.pipeline(transaction=False)
    for i in range(4 * TRIM_CHUNK + 7):
        pipe.xadd(rollouts, {b"i": str(i).encode(), b"tokens": bytes(4096)})  # each its own stream node, as 1k tokens
    for i in range(300):
        pipe.xadd(rollouts, {b"i": str(i).encode()})  # small ones: many to a node
    ids = pipe.execute()
    read = real_redis.xreadgroup(TRAINER, "t", {rollouts: ">"}, count=len(ids) - 3)
    real_redis.xack(rollouts, TRAINER, *[entry.id for entry in entries_from_reply(read)])
    real_redis.config_resetstat()
    assert trim_consumed(streams.redis, rollouts) == len(ids) - 3
    assert [i for i, _ in as_entries(real_redis.xrange(rollouts))] == ids[-3:]  # exactly what is still unread
    xtrim = real_redis.info("commandstats")["cmdstat_xtrim"]
    assert xtrim["calls"] >= 4 + 2, xtrim  # 4+ chunks, a call that finds nothing more, the exact remainder


@pytest.mark.parametrize("tokens", [1024, 16])
def test_the_trainer_reads_big_rollouts_a_megabyte_at_a_time(
    real_redis: redis.Redis, ns: str, monkeypatch: pytest.MonkeyPatch, tokens: int
) -> None:
    """Redis builds a reply in one go: 512 rollouts of 1k tokens (~4 MB) in one read held every client 2-5 ms. The
    trainer sizes its reads by the rollouts it reads (`READ_BYTES`), and small ones still come 512 at a time."""
    streams = Streams(real_redis, ns)
    client = RolloutClient(real_redis, ns)
    asked: list[int] = []
    read = client.streams.trainer.read_rollouts

    def counted(
        consumer: str, count: int, block_ms: int | None, pending: bool = False, after: bytes = b"0"
    ) -> list[Entry]:
        asked.append(count)
        return read(consumer, count, block_ms, pending, after)

    monkeypatch.setattr(client.streams.trainer, "read_rollouts", counted)

    def publish(first: int, last: int) -> None:
        streams.writer.add_prompts([Prompt(id=f"p{i}", n=4, tokens=[1, 2, 3]) for i in range(first, last)])
        for entry in streams.work.read_work("w", last - first, None):
            p = Prompt.from_fields(entry.fields)
            made = [r.model_copy(update={"tokens": np.arange(tokens), "logprobs": np.full(tokens, -1.0),
                                         "spans": [(0, 0, tokens)]}) for r in rollouts_for(p)]  # fmt: skip
            assert streams.writer.publish_rollouts(made, entry) == 4

    publish(0, 32)
    assert len(client.collect(32, timeout=30)) == 32 and set(asked) == {512}  # nothing read yet: the cap
    first = len(asked)
    publish(32, 132)
    groups = client.collect(100, timeout=30)
    assert sorted(g.prompt_id for g in groups) == sorted(f"p{i}" for i in range(32, 132))
    assert client.stats["duplicates"] == 0
    if tokens == 1024:  # ~8.3 KB a rollout: every read after the first ones asks for ~125 (1 MiB), not a trickle
        assert all(100 <= count <= READ_BYTES // 8192 for count in asked[first:]), asked
    else:
        assert set(asked) == {512}, asked


@pytest.mark.parametrize("protocol", [2, 3])
def test_read_helper_understands_both_protocols(redis_server: RedisServer, ns: str, protocol: int) -> None:
    client = redis.Redis.from_url(redis_server.url, protocol=protocol)
    streams = Streams(client, ns)
    streams.ensure_groups()
    streams.writer.add_prompts([prompt("p")])
    (entry,) = streams.work.read_work("w", 10, 100)
    assert isinstance(entry, Entry) and entry.stream == streams.keys.prompts
    assert Prompt.from_fields(entry.fields).id == "p"
    assert entries_from_reply(client.xreadgroup(GENERATORS, "w", {streams.keys.prompts: ">"}, block=10)) == []


def test_blocking_read_wakes_on_new_work(real_redis: redis.Redis, ns: str) -> None:
    streams = Streams(real_redis, ns)
    streams.ensure_groups()
    timer = threading.Timer(0.2, lambda: streams.writer.add_prompts([prompt("late")]))
    timer.start()
    started = time.monotonic()
    entries = streams.work.read_work("w", 10, block_ms=5000)
    timer.join()
    assert [Prompt.from_fields(e.fields).id for e in entries] == ["late"]
    assert time.monotonic() - started < 4


def test_a_read_asked_to_block_past_the_clients_socket_timeout_comes_back_empty(
    redis_server: RedisServer, ns: str
) -> None:
    """redis-py 8 times a socket out after 5 s by default; a read blocking longer timed out in the client and our
    reconnecting retry sent it again for minutes (a worker with `block_ms=5000` never stopped). Now it waits less
    than the timeout and answers an empty read, as any read that found nothing."""
    client = connect(redis_server.url, ns=ns, socket_timeout=5)  # redis-py 8's default, set for any version
    assert socket_timeout_s(client) == 5
    streams = Streams(client, ns)
    streams.ensure_groups()
    started = time.monotonic()
    assert streams.work.read_work("w", 10, block_ms=10_000) == []
    assert streams.trainer.read_rollouts("trainer-x", 10, block_ms=0) == []  # 0, Redis's "forever", is capped too
    assert time.monotonic() - started < 2 * (5 - BLOCK_MARGIN_MS / 1000) + 2
    assert retried_failures(client) == 0


def test_a_ring_rings_every_bell_once_in_waves_of_about_64_workers() -> None:
    for fleet in (0, 1, 2, 63, 64, 65, 100, 300, 1000, 4096, 5000, 20_000):
        plan = waves(fleet)
        rung = [index for wave in plan for index in wave]
        assert rung == list(range(BELLS)), fleet  # each bell once, in order
        assert (len(plan) == 1) == (fleet <= WAKE_WAVE), fleet  # a small fleet: one pipeline, no waves
        if fleet <= BELLS * WAKE_WAVE:  # a wave wakes about WAKE_WAVE workers at most (their bells' share)
            assert max(len(wave) for wave in plan) * max(fleet, 1) / BELLS <= WAKE_WAVE, fleet
    assert len(waves(1000)) == 32 and len(waves(32)) == 1 and len(waves(100_000)) == BELLS
    # A worker's bell is the same in every process (not Python's salted `hash`).
    names = [f"host-{i}" for i in range(200)]
    here = [bell_index(name) for name in names]
    code = f"from pipeline.control import bell_index; print([bell_index(n) for n in {names!r}])"
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert eval(there) == here and len(set(here)) > BELLS // 2  # and they spread over the bells


def test_workers_blocked_on_their_bells_wake_on_a_ring_and_miss_none(real_redis: redis.Redis, ns: str) -> None:
    """A ring wakes every bell's reader, wave by wave; a ring that came between a reader's last read of `control`
    and its wait is not missed; bells keep one entry each, labelled with the command."""
    streams = Streams(real_redis, ns)
    real_redis.sadd(streams.keys.workers, *[f"w{i}" for i in range(200)])  # a fleet of 200: 7 waves
    names: dict[int, str] = {}
    for i in range(2000):  # one reader per bell
        names.setdefault(bell_index(f"reader-{i}"), f"reader-{i}")
    assert len(names) == BELLS
    starts = {name: streams.control.bell_id(name) for name in names.values()}
    with ThreadPoolExecutor(BELLS) as pool:
        woken = {
            name: pool.submit(streams.control.wait_for_bell, name, starts[name], 20_000) for name in names.values()
        }
        wait_until(lambda: real_redis.info("clients")["blocked_clients"] >= BELLS, 20, "every reader to block")
        assert not any(future.done() for future in woken.values())
        assert streams.control.ring("weights") == len(waves(200)) == 7
        after = {name: future.result(timeout=20) for name, future in woken.items()}
    assert all(after[name] != starts[name] for name in after), "every bell rang"
    # Rung before the wait (after the reader's last read): the wait returns at once with that ring.
    name = names[0]
    streams.control.send(Control(cmd="resume", epoch=1, version=1))
    started = time.monotonic()
    assert streams.control.wait_for_bell(name, after[name], 20_000) != after[name]
    assert time.monotonic() - started < 5
    for index in range(BELLS):
        assert [fields for _, fields in as_entries(real_redis.xrange(streams.keys.bell(index)))] == [
            {b"cmd": b"resume"}
        ]


def test_a_sync_paces_its_waves_by_what_its_pause_costs_redis(real_redis: redis.Redis, ns: str) -> None:
    """A ring leaves Redis the time that a wave's workers cost it next before it rings the next wave: ~2 ms a wave of
    ~32 for a `keep` pause and for an `abort` pause whose workers continue their interrupted samples in place, ~8 ms
    for an `abort` pause in a fleet where any worker hands them off (`--hand-off-partials`, in its heartbeat): those
    publish their interrupted samples and the fleet reads them back (at 2 ms, 1,000 workers' partials queued a publish
    made meanwhile ~100 ms). The bells' entry ids, Redis's own clock, show the waves' pace; the stall holds two rings
    of it."""
    streams = Streams(real_redis, ns)
    fleet = 1000  # registered, none heartbeating: nobody to wait for, the rings are the whole sync
    real_redis.sadd(streams.keys.workers, *[f"w{i}" for i in range(fleet)])
    manager = Manager(streams, ack_timeout_s=1)
    plan = waves(fleet)
    runs: tuple[tuple[PauseMode, float, bool], ...] = (
        ("keep", WAKE_COST_S, False),
        ("abort", WAKE_COST_S, False),
        ("abort", ABORT_COST_S, True),
    )
    for version, (mode, per_worker_s, hand_off) in enumerate(runs, start=1):
        if hand_off:  # one worker of the fleet hands its interrupted samples off: its heartbeat says so
            real_redis.hset(streams.keys.worker("w7"), PARTIALS_FIELD, HAND_OFF)
        gap = wave_gap(fleet, per_worker_s)
        report = manager.sync(version, f"redis://{ns}/v{version}", mode=mode)
        returned = time.monotonic()
        manager.settle()  # the resume is rung in a thread of the manager's after `sync` returns ...
        assert time.monotonic() - returned >= 0.8 * (len(plan) - 1) * gap  # ... while the trainer goes back to work
        rung_ms = [int(as_entries(real_redis.xrange(streams.keys.bell(wave[0])))[0][0].split(b"-")[0]) for wave in plan]
        gaps_ms = [later - earlier for earlier, later in itertools.pairwise(rung_ms)]
        assert min(gaps_ms) >= int(gap * 1000) - 1, (mode, gaps_ms)  # the resume's ring, the last written
        assert report.stall_s >= (len(plan) - 1) * gap, mode  # and the weights' before it, within the stall
    assert wave_gap(fleet, WAKE_COST_S) == pytest.approx(0.0019, abs=2e-4)
    assert wave_gap(fleet, ABORT_COST_S) == pytest.approx(0.0078, abs=2e-4)
    assert wave_gap(20, ABORT_COST_S) > 0 and len(waves(20)) == 1  # one wave: no pause at all


def test_a_trainer_that_exits_right_after_a_sync_still_rings_every_wave(redis_server: RedisServer, ns: str) -> None:
    """The resume's ring outlives `sync`'s return; a trainer process that ends there does not leave the later waves
    unrung (they would read the resume only at their next recheck, `CONTROL_RECHECK_S` later)."""
    code = f"""
import redis
from pipeline.streams import Streams
from staleness.manager import Manager
streams = Streams(redis.Redis.from_url({redis_server.url!r}), {ns!r})
streams.redis.sadd(streams.keys.workers, *[f"w{{i}}" for i in range(1000)])
Manager(streams, ack_timeout_s=1).sync(1, "redis://{ns}/v1", mode="abort")
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    client = redis.Redis.from_url(redis_server.url)
    streams = Streams(client, ns)
    rung = [[fields for _, fields in as_entries(client.xrange(streams.keys.bell(index)))] for index in range(BELLS)]
    assert rung == [[{b"cmd": b"resume"}]] * BELLS
    client.close()


@pytest.mark.parametrize("redis_server", EVERY_SERVER, indirect=True)
def test_every_lua_script_names_its_keys_and_compiles_on_every_server(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url)
    folders = [SCRIPTS, staleness_scripts, gateway_scripts]
    names = {name for folder in folders for name in sources(folder)}
    assert names == {
        *(
            "publish",
            "claim",
            "share",
            "beat",
            "forward",
            "rehome",
            "dead_letter",
            "admit",
            "park",
            "begin_sync",
            "finish_sync",
            "begin_sleep",
        ),
        *("pin", "join_group"),
    }
    for folder in folders:
        for name, source in sources(folder).items():
            header = [line for line in source.splitlines() if line.startswith("--")]
            assert any("KEYS" in line for line in header) and any("ARGV" in line for line in header), name
            assert client.script_load(source) == register_all(client, folder)[name].sha, name  # compiles
    client.close()


def test_a_scripts_include_is_spliced_in_and_a_missing_one_is_named(tmp_path: Path, any_redis: redis.Redis) -> None:
    """A `_NAME.lua` of the folder is no script: its functions reach the scripts that include it; an include that
    is not there fails the load, naming both files."""
    (tmp_path / "_shared.lua").write_text("local function twice(x)\n  return 2 * x\nend\n")
    (tmp_path / "doubles.lua").write_text("-- KEYS: none. ARGV: a number. Twice it.\n-- include: _shared.lua\n"
                                          "return twice(tonumber(ARGV[1]))\n")  # fmt: skip
    scripts = register_all(any_redis, tmp_path)
    assert list(scripts) == ["doubles"]
    assert scripts["doubles"](keys=[], args=[21]) == 42
    (tmp_path / "lost").mkdir()
    (tmp_path / "lost" / "broken.lua").write_text("-- include: _gone.lua\nreturn 1\n")
    with pytest.raises(FileNotFoundError, match=r"broken\.lua includes _gone\.lua"):
        sources(tmp_path / "lost")


def test_scored_rollouts_go_through_scoring_and_are_forwarded_once(any_redis: redis.Redis, ns: str) -> None:
    """A prompt with a reward_fn publishes to `scoring`; forwarding acks and adds in one step, once."""
    streams = Streams(any_redis, ns)
    streams.ensure_groups()
    streams.scoring.ensure_scoring_group()
    scored = prompt("scored").model_copy(update={"reward_fn": "m:f"})
    streams.writer.add_prompts([scored, prompt("plain")])
    work = {e.fields[b"id"]: e for e in streams.work.read_work("w", 10, None)}
    made = [r.model_copy(update={"reward_fn": "m:f"}) for r in rollouts_for(scored)]
    assert streams.writer.publish_rollouts(made, work[b"scored"]) == 2
    assert streams.writer.publish_rollouts(rollouts_for(prompt("plain")), work[b"plain"]) == 2
    assert any_redis.xlen(streams.keys.scoring) == 2 and any_redis.xlen(streams.keys.rollouts) == 2
    read = streams.scoring.read_scoring(10, None)
    assert [Rollout.from_fields(e.fields).id for e in read] == ["scored:0", "scored:1"]
    # A successor re-reads what was taken and not forwarded, page by page.
    assert [e.id for e in streams.scoring.read_scoring(1, None, pending_after=b"0")] == [read[0].id]
    assert [e.id for e in streams.scoring.read_scoring(1, None, pending_after=read[0].id)] == [read[1].id]
    for rollout, reward in zip(made, (0.25, 1.0), strict=True):
        rollout.reward = reward
    assert streams.scoring.forward_scored(made, [e.id for e in read]) == 2
    assert streams.scoring.forward_scored(made, [e.id for e in read]) == -1  # already forwarded: nothing written
    assert streams.scoring.read_scoring(10, None, pending_after=b"0") == []
    forwarded = [Rollout.from_fields(fields) for _, fields in as_entries(any_redis.xrange(streams.keys.rollouts))]
    rewards = {r.id: r.reward for r in forwarded}
    assert rewards == {"plain:0": None, "plain:1": None, "scored:0": 0.25, "scored:1": 1.0}


def test_a_restarted_trainer_rereads_an_open_group_once_and_acks_it_only_when_used(
    any_redis: redis.Redis, ns: str
) -> None:
    """Pending rollouts are paged through, not re-read from the start: re-reading them would count them
    as duplicates and ack them while their group is still open (lost if the trainer then died)."""
    from producers.client import RolloutClient

    streams = Streams(any_redis, ns)
    streams.ensure_groups()
    whole = rollouts_for(prompt("g", n=4))
    for rollout in whole[:3]:
        any_redis.xadd(streams.keys.rollouts, for_redis(rollout.to_fields()))
    assert len(streams.trainer.read_rollouts("trainer-0", count=10, block_ms=None)) == 3  # handed over, then it died
    restarted = RolloutClient(any_redis, ns, consumer="trainer-0", read_count=2)
    groups = restarted._whole_groups(timeout=5, block_ms=10)
    any_redis.xadd(streams.keys.rollouts, for_redis(whole[3].to_fields()))
    group = next(groups)
    assert [r.sample for r in group.rollouts] == [0, 1, 2, 3] and restarted.stats["duplicates"] == 0
    assert any_redis.xpending(streams.keys.rollouts, TRAINER)["pending"] == 4, "nothing acked before it is used"


def whole_groups_waiting(client: redis.Redis, ns: str, *names: str) -> Streams:
    """The namespace's streams with a whole group of rollouts for each prompt name waiting on `rollouts`."""
    streams = Streams(client, ns)
    streams.ensure_groups()
    for name in names:
        for rollout in rollouts_for(prompt(name)):
            client.xadd(streams.keys.rollouts, for_redis(rollout.to_fields()))
    return streams


def test_collect_acks_its_groups_together_and_a_timeout_leaves_them_for_the_next_client(
    any_redis: redis.Redis, ns: str
) -> None:
    """`collect` acks what it returns in one XACK, not a round trip a group; one that times out has acked nothing, so
    a client started again (same consumer) gets those groups back instead of their being acked and lost."""
    from producers.client import RolloutClient

    streams = whole_groups_waiting(any_redis, ns, "a", "b", "c")
    client = RolloutClient(any_redis, ns, consumer="t")
    acks: list[int] = []
    ack = streams.trainer.ack_rollouts

    def counted_ack(ids: Sequence[bytes]) -> None:
        if ids:
            acks.append(len(ids))
        ack(ids)

    client.streams.trainer.ack_rollouts = counted_ack  # type: ignore[method-assign]  # the test counts the client's acks
    assert [g.prompt_id for g in client.collect(2, timeout=5)] == ["a", "b"]
    assert acks == [4] and any_redis.xpending(streams.keys.rollouts, TRAINER)["pending"] == 2  # c's: read, not used
    with pytest.raises(TimeoutError):
        client.collect(2, timeout=0.2)  # "c" is whole, a second group never comes
    assert any_redis.xpending(streams.keys.rollouts, TRAINER)["pending"] == 2, "c's rollouts are still pending"
    restarted = RolloutClient(any_redis, ns, consumer="t")
    assert [g.prompt_id for g in restarted.collect(1, timeout=5)] == ["c"]
    assert any_redis.xpending(streams.keys.rollouts, TRAINER)["pending"] == 0


def test_groups_one_read_completes_beyond_what_collect_asked_for_come_with_the_next_call(
    any_redis: redis.Redis, ns: str
) -> None:
    """Three groups whole in one read, `collect(1)` takes one: the other two are this client's next, with nothing
    new arriving (they were dropped once: read, never handed over, never acked, waiting for a restart). A collect
    that times out hands what it gathered to the next call too."""
    from producers.client import RolloutClient

    streams = whole_groups_waiting(any_redis, ns, "a", "b", "c")
    client = RolloutClient(any_redis, ns, consumer="t")
    assert [g.prompt_id for g in client.collect(1, timeout=5)] == ["a"]
    with pytest.raises(TimeoutError):
        client.collect(3, timeout=0.3)  # b and c, and no third
    assert [g.prompt_id for g in client.collect(2, timeout=1)] == ["b", "c"]
    assert client.stats["duplicates"] == 0 and any_redis.xpending(streams.keys.rollouts, TRAINER)["pending"] == 0


def test_a_fleet_sweeps_departed_inboxes_about_twice_a_heartbeat_whatever_its_size() -> None:
    """Every worker sweeping every heartbeat made Redis check N² heartbeats a second (a million at 1,000 workers);
    a small fleet still sweeps every heartbeat, a large one a couple of times a period in all."""
    assert sweep_chance(0) == sweep_chance(1) == sweep_chance(2) == 1.0
    for fleet in (3, 100, 1000):
        assert fleet * sweep_chance(fleet) == pytest.approx(2.0)


def test_a_worker_silent_past_its_deadline_reads_as_gone_before_its_heartbeat_expires(
    any_redis: redis.Redis, ns: str
) -> None:
    """What a sync polls for its acks: a worker whose declared silence has passed is gone, as claimers judge it,
    though its heartbeat hash lives on; one within its silence, or that declares none, is not."""
    streams = Streams(any_redis, ns)
    streams.registry.heartbeat("quiet", {"status": "serving", "epoch": 3}, ttl_s=60, dead_after_s=0.05)
    streams.registry.heartbeat("talking", {"status": "serving", "epoch": 3}, ttl_s=60, dead_after_s=60)
    streams.registry.heartbeat("old", {"status": "serving", "epoch": 3}, ttl_s=60)  # no deadline on `{ns}:beats`
    wait_until(lambda: streams.registry.heartbeat_field(["quiet"], "epoch") == {"quiet": None}, 5, "the silence")
    assert any_redis.exists(streams.keys.worker("quiet"))
    fields = streams.registry.heartbeat_field(["quiet", "talking", "old"], "epoch")
    assert fields == {"quiet": None, "talking": "3", "old": "3"}
    assert streams.registry.live_workers_with("epoch") == {"talking": "3", "old": "3"}


def test_a_read_blocked_on_an_inbox_deleted_under_it_reads_on(real_redis: redis.Redis, ns: str) -> None:
    """Redis 7 wakes a read blocked on a stream that is deleted (`UNBLOCKED the stream key no longer exists`): a
    manager evicting a stopped worker deletes its inbox so. The worker's read makes its groups again and reads on
    (it then reads its eviction on control): a worker that exited with "refused a command" instead lost its exit
    code, 1, that says it was evicted."""
    streams = Streams(real_redis, ns)
    streams.ensure_groups()
    streams.work.join("w1")
    with ThreadPoolExecutor(1) as pool:
        read = pool.submit(streams.work.read_work, "w1", 1, 20_000)
        wait_until(lambda: b"cmd=xreadgroup" in real_redis.execute_command("CLIENT", "LIST"), 10, "the read to block")
        real_redis.delete(streams.keys.inbox("w1"))
        wait_until(lambda: real_redis.exists(streams.keys.inbox("w1")) == 1, 10, "the inbox made again")
        streams.writer.add_prompts([prompt("after")])
        entries = read.result(timeout=20)
    assert [Prompt.from_fields(e.fields).id for e in entries] == ["after"]


def test_a_departed_workers_inbox_goes_back_to_the_shared_prompts(any_redis: redis.Redis, ns: str) -> None:
    """Work pinned to a worker (its inbox) is never stranded: once its heartbeat is gone, what it held or had not
    read yet moves to `{ns}:prompts`, and a late publish by the presumed-dead worker writes nothing."""
    streams = Streams(any_redis, ns)
    streams.ensure_groups()
    # the fleet's size, for `sweep_chance`
    assert streams.registry.heartbeat("w1", {"status": "serving"}, ttl_s=60) == 1
    assert streams.registry.heartbeat("w2", {"status": "serving", "epoch": 3}, ttl_s=60) == 2
    assert set(streams.registry.live_workers()) == {"w1", "w2"} and streams.registry.live_worker_names() == ["w1", "w2"]
    assert streams.registry.heartbeat_field(["w1", "w2", "w9"], "epoch") == {"w1": "", "w2": "3", "w9": None}
    streams.writer.add_to_inbox("w1", prompt("held"))
    streams.writer.add_to_inbox("w1", prompt("unread"))
    held = streams.work.read_work("w1", count=1, block_ms=None)
    assert [e.stream for e in held] == [streams.keys.inbox("w1")]
    assert streams.work.read_work("w2", count=10, block_ms=None) == []  # another worker's inbox is not read
    assert streams.registry.rehome("w1") == -1 and streams.registry.rehome_departed() == 0  # alive: untouched
    any_redis.delete(streams.keys.worker("w1"))  # its heartbeat expired
    assert set(streams.registry.live_workers()) == {"w2"} and streams.registry.live_worker_names() == [
        "w2"
    ]  # still registered
    assert streams.registry.live_workers_with("epoch") == {"w2": "3"}  # the live ones, with one field each
    assert streams.registry.rehome_departed() == 2
    assert streams.registry.rehome_departed() == 0  # once
    moved = streams.work.read_work("w2", count=10, block_ms=None)
    assert sorted(Prompt.from_fields(e.fields).id for e in moved) == ["held", "unread"]
    assert all(e.stream == streams.keys.prompts for e in moved)
    assert streams.writer.publish_rollouts(rollouts_for(prompt("held")), held[0]) == -1  # the stalled w1, too late
    by_id = {Prompt.from_fields(e.fields).id: e for e in moved}
    assert streams.writer.publish_rollouts(rollouts_for(prompt("held")), by_id["held"]) == 2
    assert any_redis.smembers(streams.keys.workers) == {b"w2"}
    streams.writer.add_to_inbox("w2", prompt("left"))
    streams.registry.forget_worker("w2")  # a worker that stops hands its inbox back on the way out
    assert [Prompt.from_fields(e.fields).id for e in streams.work.read_work("w3", 10, None)] == ["left"]
    assert not any_redis.exists(streams.keys.inbox("w2"))


def test_replies_go_to_the_gateway_that_asked(any_redis: redis.Redis, ns: str) -> None:
    streams = Streams(any_redis, ns)
    streams.ensure_groups()
    asked = prompt("call", n=1).model_copy(update={"reply_to": "gw-1"})
    streams.writer.add_to_inbox("w1", asked)
    [entry] = streams.work.read_work("w1", count=1, block_ms=None)
    assert Prompt.from_fields(entry.fields).reply_to == "gw-1"
    assert streams.writer.publish_rollouts(rollouts_for(asked), entry, reply_to="gw-1") == 1
    assert any_redis.xlen(streams.keys.rollouts) == 0
    [reply] = streams.replies.read_replies("gw-1", b"0", None)
    assert Rollout.from_fields(reply.fields).id == "call:0"
    streams.replies.delete_replies("gw-1", [reply.id])
    assert streams.replies.read_replies("gw-1", b"0", None) == []


def test_a_read_waiting_with_no_worker_alive_says_so_within_seconds(
    any_redis: redis.Redis, ns: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import producers.client

    monkeypatch.setattr(producers.client, "NO_WORKER_NOTICE_S", 0.3)
    client = RolloutClient(any_redis, ns, consumer="t")
    client.submit(tokens=[1, 2], n=2)
    with caplog.at_level("WARNING", logger="producers.client"), pytest.raises(TimeoutError):
        client.collect(1, timeout=1.5)
    said = [r.getMessage() for r in caplog.records if "no worker is alive" in r.getMessage()]
    assert len(said) == 1 and f"namespace {ns}" in said[0] and "timeout 1.5 s" in said[0], said
    # With a worker's heartbeat on the registry, the same wait says nothing of the kind.
    caplog.clear()
    client.streams.registry.heartbeat("w1", {"status": "serving"}, ttl_s=30)
    with caplog.at_level("WARNING", logger="producers.client"), pytest.raises(TimeoutError):
        client.collect(1, timeout=1.0)
    assert not [r for r in caplog.records if "no worker is alive" in r.getMessage()]


def test_a_client_of_a_redis_that_is_down_or_of_no_tokenizer_folder_fails_at_once_in_one_line(
    redis_server: RedisServer, ns: str, tmp_path: Path
) -> None:
    from pipeline.connections import RedisUnreachable
    from pipeline.local import free_port

    url = f"redis://:secret@127.0.0.1:{free_port()}/0"
    with pytest.raises(RedisUnreachable) as down:
        RolloutClient(url, ns)
    message = str(down.value)
    assert "\n" not in message and "secret" not in message, message
    assert message.startswith("cannot reach Redis at redis://:***@127.0.0.1:") and "Is redis-server running" in message
    assert down.value.__suppress_context__, "redis-py's frames are left out"
    assert isinstance(down.value, redis.ConnectionError)
    with pytest.raises(ValueError, match=r"^tokenizer \./nope: no such folder; pass a local model folder"):
        RolloutClient(redis_server.url, ns, tokenizer="./nope")
    with pytest.raises(ValueError, match="no such folder"):
        RolloutClient(redis_server.url, ns, tokenizer=tmp_path / "missing")
    RolloutClient(redis_server.url, ns, tokenizer="org/model")  # a hub name is transformers' to fetch, on first use
