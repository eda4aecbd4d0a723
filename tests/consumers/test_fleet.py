"""A fleet of worker processes behind one queue: a step's work spreads over the workers with room, a lone worker
still fills its engine's batch, a dead or frozen worker's work is started elsewhere within seconds (the oldest first),
and a live worker's long sample is never taken from it."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import cast

import pytest

from pipeline.codec import as_entries
from pipeline.local import RedisServer
from pipeline.wire import GENERATORS
from producers.client import RolloutClient
from tests.fixtures import StartWorker, holds_work, wait_until

SYNTHETIC = ("--engine", "synthetic")


def pending_on(client: RolloutClient, worker: str) -> set[bytes]:
    """The prompt entries pending on `worker` (taken, not finished)."""
    r, key = client.streams.redis, client.streams.keys.prompts
    return {
        cast(bytes, p["message_id"]) for p in r.xpending_range(key, GENERATORS, "-", "+", 10_000, consumername=worker)
    }


def test_a_step_spreads_over_four_workers_and_none_takes_more_than_its_share(
    redis_server: RedisServer, ns: str, workers: StartWorker
) -> None:
    """Three steps of 16 prompts x 4 samples, one step at a time, over four idle workers that could each take a whole
    step (64 samples of room): no worker serves more than half of a step's 64 (before the fleet shared, one served
    52-64; its quarter and two groups was the bound here, which a loaded 2-core machine, waking one worker late, broke
    at 28 about once in three runs, on main too), at least three workers serve each step, and every worker serves
    some of the three (a loaded CI once left one worker out of a whole step, that step lasting about a second)."""
    names = [f"w{k}" for k in range(4)]
    flags = (*SYNTHETIC, "--engine-args", '{"steps_per_s": 100}', "--max-inflight", "64")
    workers.many(*[(name, *flags) for name in names])
    client = RolloutClient(redis_server.url, ns)
    everyone: Counter[str] = Counter()
    for step in range(3):
        ids = [client.submit(tokens=[4, 5, step, k], n=4, max_tokens=60, seed=k) for k in range(16)]
        groups = client.collect(len(ids), timeout=120)
        served = Counter(r.worker for g in groups for r in g.rollouts)
        assert sum(served.values()) == 64
        assert max(served.values()) <= 32, f"step {step}: {dict(served)}"
        assert len(served) >= 3, f"step {step}: {dict(served)}"
        everyone += served
    assert set(everyone) == set(names), dict(everyone)


def test_a_lone_worker_still_fills_its_engines_batch(redis_server: RedisServer, ns: str, workers: StartWorker) -> None:
    """Alone, a worker takes all that fits: 8 prompts x 4 samples put 32 in flight at once."""
    workers("alone", *SYNTHETIC, "--engine-args", '{"steps_per_s": 20}', "--max-inflight", "32")
    client = RolloutClient(redis_server.url, ns)
    client.submit(tokens=[4, 5, 6], n=4, max_tokens=400, seed=0)  # its first entry says how many samples one holds
    wait_until(holds_work(client, "alone"), 30, "the worker to take the first prompt")
    for k in range(7):
        client.submit(tokens=[4, 5, 7 + k], n=4, max_tokens=400, seed=k)

    def inflight() -> int:
        return int(client.streams.registry.live_workers()["alone"].get("inflight", 0))

    wait_until(lambda: inflight() == 32, 30, "32 samples in flight on the lone worker")
    assert len(pending_on(client, "alone")) == 8


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_a_dead_workers_work_is_started_elsewhere_within_seconds(
    redis_server: RedisServer, ns: str, workers: StartWorker, how: signal.Signals
) -> None:
    """A worker killed (or frozen) with prompts in flight: a live worker with room starts them within the silence
    its heartbeat declares (2.5 s) and a claim period or two, long before they idle past --claim-idle-ms (10 s);
    each prompt is delivered once to the trainer."""
    flags = ("--max-inflight", "8", "--claim-idle-ms", "10000")
    doomed = workers("doomed", *SYNTHETIC, "--engine-args", '{"steps_per_s": 10}', *flags)  # 100 s a sample
    client = RolloutClient(redis_server.url, ns)
    ids = [client.submit(tokens=[4, 5, k], n=2, max_tokens=1000, seed=k) for k in range(4)]
    wait_until(lambda: len(pending_on(client, "doomed")) == 4, 30, "the doomed worker to take all four")
    workers("rescuer", *SYNTHETIC, "--engine-args", '{"steps_per_s": 500}', *flags)
    orphaned = pending_on(client, "doomed")
    assert len(orphaned) == 4
    os.kill(doomed.pid, how)
    began = time.monotonic()
    wait_until(lambda: orphaned <= pending_on(client, "rescuer"), 15, "the rescuer to take the orphaned prompts")
    took = time.monotonic() - began
    assert took < 2.5 + 1.5, f"took {took:.1f} s"
    if how == signal.SIGSTOP:
        os.kill(doomed.pid, signal.SIGKILL)
    groups = client.collect(len(ids), timeout=180)
    assert sorted(g.prompt_id for g in groups) == sorted(ids)
    assert client.stats["duplicates"] == 0


def test_a_worker_restarted_under_its_name_takes_up_what_its_dead_process_left(
    redis_server: RedisServer, ns: str, workers: StartWorker
) -> None:
    """A supervisor restarts a killed worker under the same name: the name's heartbeat goes on, so no other worker
    would take the dead process's work over until it idled past --claim-idle-ms (60 s here). The new process takes
    it up as it starts, before any new work, and each prompt is delivered once."""
    flags = ("--engine-args", '{"steps_per_s": 50}', "--max-inflight", "8", "--claim-idle-ms", "60000")
    first = workers("w", *SYNTHETIC, *flags)
    client = RolloutClient(redis_server.url, ns)
    ids = [client.submit(tokens=[4, 5, k], n=2, max_tokens=400, seed=k) for k in range(4)]  # 8 s a sample
    wait_until(lambda: len(pending_on(client, "w")) == 4, 30, "the worker to take all four")
    os.kill(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    restarted = time.monotonic()
    workers("w", *SYNTHETIC, *flags)  # (the dead process's heartbeat may still say "serving")

    def taken_up() -> bool:
        r, key = client.streams.redis, client.streams.keys.prompts
        pending = r.xpending_range(key, GENERATORS, "-", "+", 100, consumername="w")
        return len(pending) == 4 and all(p["times_delivered"] == 2 for p in pending)

    wait_until(taken_up, 40, "the restarted process to take up the four")
    assert time.monotonic() - restarted < 40  # long before the 60 s idle claim
    groups = client.collect(len(ids), timeout=120)
    assert sorted(g.prompt_id for g in groups) == sorted(ids)
    assert {r.worker for g in groups for r in g.rollouts} == {"w"}
    assert client.stats["duplicates"] == 0


def test_a_dead_workers_work_goes_before_newer_prompts(
    redis_server: RedisServer, ns: str, workers: StartWorker
) -> None:
    """The rescuer is busy with newer prompts when a worker dies: as its room opens it takes the dead worker's
    prompts (the oldest, which a step waits on) before any of the newer ones that wait behind them."""
    slow = ("--engine-args", '{"steps_per_s": 25}', "--max-inflight", "8")
    doomed = workers("doomed", *SYNTHETIC, *slow)
    client = RolloutClient(redis_server.url, ns)
    ids = [client.submit(tokens=[4, 5, k], n=2, max_tokens=100, seed=k) for k in range(4)]
    wait_until(lambda: len(pending_on(client, "doomed")) == 4, 30, "the doomed worker to take all four")
    workers("rescuer", *SYNTHETIC, *slow)
    ids += [client.submit(tokens=[4, 6, k], n=2, max_tokens=200, seed=k) for k in range(12)]  # 8 s: past the silence
    wait_until(lambda: len(pending_on(client, "rescuer")) == 4, 30, "the rescuer to fill up with newer prompts")
    os.kill(doomed.pid, signal.SIGSTOP)  # frozen first: it may have finished its four and taken newer ones meanwhile
    orphaned, waiting = pending_on(client, "doomed"), lag(client)
    assert orphaned and waiting >= 4
    os.kill(doomed.pid, signal.SIGKILL)
    wait_until(lambda: orphaned <= pending_on(client, "rescuer") | done(client, orphaned), 30, "the orphans taken")
    assert lag(client) == waiting, f"{waiting - lag(client)} newer prompts went first"
    groups = client.collect(len(ids), timeout=180)
    assert sorted(g.prompt_id for g in groups) == sorted(ids)


def test_partials_after_an_abort_sync_spread_over_the_workers(
    redis_server: RedisServer, ns: str, workers: StartWorker, tiny_model_dir_v1: Path
) -> None:
    """Four workers that hand their interrupted samples off (`--hand-off-partials`) hold 16 long samples between them
    when an abort sync comes: all 16 go to `{ns}:partials`, and after the resume no worker continues more than 6 of
    the 16 (its quarter and two: a loaded machine may wake one late, as in the step test above), and at least three of
    the four continue some. Heartbeats every second, not the tests' 0.3 s: a worker counts in the others' shares for
    its take horizon (`WorkerSettings.take_horizon_ms`: 0.9 s at 0.3 s, 3 s at 1 s), and in full runs on 2 busy cores
    a worker held back longer than 0.9 s dropped out of the fleet that the others shared the 16 by (6, 5, 5 and 0; 8,
    3, 3 and 2)."""
    names = [f"w{k}" for k in range(4)]
    flags = (*SYNTHETIC, "--engine-args", '{"steps_per_s": 20}', "--max-inflight", "16", "--hand-off-partials",
             "--heartbeat-s", "1")  # after the fixture's FAST flags: this one counts  # fmt: skip
    workers.many(*[(name, *flags) for name in names])
    client = RolloutClient(redis_server.url, ns)
    ids = [client.submit(tokens=[4, 5, k], n=1, max_tokens=200, seed=k) for k in range(16)]  # 10 s a sample
    r, key = client.streams.redis, client.streams.keys.prompts
    wait_until(lambda: lag(client) == 0 and r.xpending(key, GENERATORS)["pending"] == 16, 30, "all 16 taken")
    assert client.publish_weights(tiny_model_dir_v1, mode="abort") == 1
    groups = client.collect(len(ids), timeout=120)
    assert sorted(g.prompt_id for g in groups) == sorted(ids)
    rollouts = [r for g in groups for r in g.rollouts]
    assert all(r.spans[-1][0] == 1 for r in rollouts), "each continued under the new version"
    continued = Counter(r.worker for r in rollouts)
    assert set(continued) <= set(names) and len(continued) >= 3, dict(continued)
    assert max(continued.values()) <= 6, dict(continued)
    assert client.stats["duplicates"] == 0


def test_a_worker_that_hands_its_samples_off_acks_an_abort_pause_once_they_are_on_partials_holding_none(
    redis_server: RedisServer, ns: str, workers: StartWorker
) -> None:
    """The ack of an `abort` pause (a sleep's here, a sync's alike) is written once the samples the pause ended are
    on `{ns}:partials`: its heartbeat then says the worker holds none of them (only the entries that reached the engine
    as it paused, which go on here after the resume), and the fleet's shares at the resume count it by that, not by
    what it held before the pause. Its heartbeat beats every 60 s here: the ack is the only write after the pause."""
    full = ("--max-inflight", "4")  # no read waits for new work: it would take a partial back as the pause hands it off
    quiet = ("--heartbeat-s", "60")
    workers("w", *SYNTHETIC, "--engine-args", '{"steps_per_s": 20}', *full, "--hand-off-partials", *quiet)
    client = RolloutClient(redis_server.url, ns)
    ids = [client.submit(tokens=[4, 5, k], n=1, max_tokens=100, seed=k) for k in range(4)]  # 5 s a sample
    wait_until(lambda: len(pending_on(client, "w")) == 4, 30, "the worker to take all four")
    assert client.sleep(1, mode="abort").acked == ["w"]
    r, keys = client.streams.redis, client.streams.keys
    held, handed_off = int(r.hget(keys.worker("w"), "held") or -1), r.xlen(keys.partials)
    assert held == len(pending_on(client, "w")) == 4 - handed_off, "its ack says what it holds"
    assert handed_off >= 1
    client.wake()
    groups = client.collect(len(ids), timeout=60)
    assert sorted(g.prompt_id for g in groups) == sorted(ids)
    assert client.stats["duplicates"] == 0


def lag(client: RolloutClient) -> int:
    """How many prompts wait that no worker has taken yet."""
    return int(client.streams.redis.xinfo_groups(client.streams.keys.prompts)[0]["lag"])


def done(client: RolloutClient, entries: set[bytes]) -> set[bytes]:
    """Of `entries`, those no longer pending on anyone (published)."""
    r, key = client.streams.redis, client.streams.keys.prompts
    pending = {p["message_id"] for p in r.xpending_range(key, GENERATORS, "-", "+", 10_000)}
    return entries - pending


def test_a_live_workers_long_sample_is_never_taken_from_it(
    redis_server: RedisServer, ns: str, workers: StartWorker
) -> None:
    """A sample that runs for many times the silence after which a worker is dead stays with its worker, while
    another with room asks for work all along; it is delivered once."""
    workers("patient", *SYNTHETIC, "--engine-args", '{"steps_per_s": 50}', "--max-inflight", "1")
    client = RolloutClient(redis_server.url, ns)
    long = client.submit(tokens=[4, 5, 6], n=1, max_tokens=400, seed=0)  # 8 s
    wait_until(holds_work(client, "patient"), 30, "the worker to take the long prompt")
    workers("eager", *SYNTHETIC)
    (group,) = client.collect(1, timeout=60)
    assert group.prompt_id == long and [r.worker for r in group.rollouts] == ["patient"]
    entry = group.rollouts[0]
    assert entry.worker == "patient"
    assert client.streams.redis.xlen(client.streams.keys.dead) == 0


def test_a_sync_waits_on_a_worker_killed_before_it_no_longer_than_the_silence_it_declared(
    redis_server: RedisServer, ns: str, workers: StartWorker, tiny_model_dir_v1: Path
) -> None:
    """A worker killed just before a sync is gone once the silence its heartbeat declared has passed (5 s at a 2 s
    heartbeat: when claimers take its work too), not when its heartbeat hash expires (10 s) or at the ack deadline
    (60 s): the sync says so and the live worker moves to the new version."""
    workers("live", *SYNTHETIC)
    doomed = workers("doomed", *SYNTHETIC, "--heartbeat-s", "2")
    client = RolloutClient(redis_server.url, ns)
    os.kill(doomed.pid, signal.SIGKILL)
    killed = time.monotonic()
    assert client.publish_weights(tiny_model_dir_v1) == 1
    took = time.monotonic() - killed
    report = client.last_sync
    assert report is not None and report.acked == ["live"] and report.gone == ["doomed"], report
    assert report.evicted == [], report
    assert took < 5 + 1.5, f"the sync waited {took:.1f} s on the dead worker"


POISON = 7
"""A token that kills the synthetic worker that starts a prompt holding it (`poison_token`)."""


def test_a_poison_prompt_is_dead_lettered_after_its_run_alone_and_the_prompts_that_died_beside_it_are_not(
    redis_server: RedisServer, ns: str, workers: StartWorker
) -> None:
    """Six prompts and a poison one (it kills whatever runs it) on one worker, restarted under its name each time it
    dies, as a supervisor does; `--max-deliveries 2`. The first death takes the six with it; handed out a second time,
    each runs alone, so the six finish and only the poison's runs alone die (two, `alone_tries`); handed out again
    after those, the poison is a dead letter. (Counting deliveries alone, the six would die beside it twice and be
    dead-lettered too.)"""
    client = RolloutClient(redis_server.url, ns)
    ids = [client.submit(tokens=[4, 5, k], n=2, max_tokens=50, seed=k) for k in range(3)]
    poison = client.submit(tokens=[4, POISON, 9], n=2, max_tokens=50, seed=9)
    ids += [client.submit(tokens=[4, 6, k], n=2, max_tokens=50, seed=k) for k in range(3)]
    flags = ("--engine-args", f'{{"steps_per_s": 50, "poison_token": {POISON}}}', "--max-deliveries", "2")
    supervised, deaths = [workers("w", *SYNTHETIC, *flags, "--max-inflight", "16")], []
    stop = threading.Event()

    def supervise() -> None:  # restart the worker under its name whenever it dies
        while not stop.wait(0.1):
            if supervised[-1].poll() is not None:
                deaths.append(supervised[-1].returncode)
                supervised.append(workers("w", *SYNTHETIC, *flags, "--max-inflight", "16"))

    thread = threading.Thread(target=supervise, daemon=True)
    thread.start()
    try:
        groups = client.collect(len(ids), timeout=120)
        wait_until(lambda: client.streams.redis.xlen(client.streams.keys.dead) == 1, 60, "the poison's dead letter")
    finally:
        stop.set()
        thread.join()
    assert sorted(g.prompt_id for g in groups) == sorted(ids)
    assert client.stats["duplicates"] == 0
    ((_, fields),) = as_entries(client.streams.redis.xrange(client.streams.keys.dead))
    assert fields[b"id"].decode() == poison and fields[b"stage"] == b"deliver"
    assert b"2 of them run alone" in fields[b"error"], fields[b"error"]
    assert deaths == [-signal.SIGKILL] * 3, "it killed its worker once beside the six, twice alone"
    assert [k for k in client.streams.redis.scan_iter(f"{{{ns}}}:alone:*")] == [], "no mark outlives its entry"


def test_entries_that_died_with_their_worker_twice_run_apart_from_each_other(
    redis_server: RedisServer, ns: str, workers: StartWorker
) -> None:
    """Three prompts die with their worker twice: `kill -9`, restarted under its name (it takes them up again), then
    `kill -9` for good as soon as it has them. Handed out a third time, to the worker that claims them, they run one
    after another, never two at once (its heartbeat never shows more than one prompt's 2 samples in flight; together
    they were 6), and each is delivered once: a poison prompt among them could no longer take the others with it."""
    flags = ("--engine-args", '{"steps_per_s": 50}', "--max-inflight", "16")
    client = RolloutClient(redis_server.url, ns)
    ids = [client.submit(tokens=[4, 5, k], n=2, max_tokens=100, seed=k) for k in range(3)]  # 2 s a sample
    r, key = client.streams.redis, client.streams.keys.prompts

    def handed_out(times: int) -> bool:
        pending = r.xpending_range(key, GENERATORS, "-", "+", 100, consumername="doomed")
        return len(pending) == 3 and all(p["times_delivered"] == times for p in pending)

    doomed = workers("doomed", *SYNTHETIC, *flags)
    wait_until(lambda: handed_out(1), 30, "the three taken")
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.wait(timeout=30)
    doomed = workers("doomed", *SYNTHETIC, *flags)  # takes them up: a second hand-out
    wait_until(lambda: handed_out(2), 30, "the three taken up again")
    os.kill(doomed.pid, signal.SIGKILL)  # at once: 2 s a sample, and a worker's start may take longer
    doomed.wait(timeout=30)
    peak, stop = [0], threading.Event()

    def watch() -> None:
        while not stop.wait(0.05):
            beat = client.streams.registry.live_workers().get("rescuer", {})
            peak[0] = max(peak[0], int(beat.get("inflight", 0)))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    workers("rescuer", *SYNTHETIC, *flags)
    try:
        groups = client.collect(len(ids), timeout=60)
    finally:
        stop.set()
        watcher.join()
    assert sorted(g.prompt_id for g in groups) == sorted(ids)
    assert {r.worker for g in groups for r in g.rollouts} == {"rescuer"}
    assert client.stats["duplicates"] == 0
    assert peak[0] == 2, f"{peak[0]} samples in flight at once"


def test_a_publish_after_a_failover_lost_the_last_bump_takes_a_version_and_epoch_no_worker_has_seen(
    redis_server: RedisServer, ns: str, workers: StartWorker, tiny_model_dir_v1: Path
) -> None:
    """Two workers serve version 1 (epoch 1). The state then reads version 0, epoch 0, as after a failover that lost
    the last sync's bump with an unreplicated primary. The next publish must not call other weights "1" again: it
    takes version 2 and epoch 2 (above what the workers report), both workers ack it, and what they make next says 2."""
    workers.many(("a", *SYNTHETIC), ("b", *SYNTHETIC))
    client = RolloutClient(redis_server.url, ns)
    assert client.publish_weights(tiny_model_dir_v1) == 1
    state = client.streams.keys.state
    client.streams.redis.hset(state, mapping={"version": 0, "epoch": 0})  # what a failover can leave
    assert client.publish_weights(tiny_model_dir_v1) == 2
    report = client.last_sync
    assert report is not None and report.epoch == 2 and sorted(report.acked) == ["a", "b"], report
    ids = [client.submit(tokens=[4, 5, k], n=2, max_tokens=8, seed=k) for k in range(4)]
    assert {r.version for g in client.collect(len(ids), timeout=60) for r in g.rollouts} == {2}
