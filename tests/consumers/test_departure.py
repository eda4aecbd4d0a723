"""A worker that is told to go: a stop notice is a deadline (SIGTERM with `--grace-s`, a notice file), the work that
would not finish inside it goes to `{ns}:partials` with its tokens so far, another worker finishes it, each sample once
and no finished token generated twice (`consumers.departure`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from pipeline.codec import as_entries
from pipeline.local import RedisServer
from pipeline.processes import start_command
from pipeline.wire import Partial, Rollout
from producers.client import RolloutClient
from tests.fixtures import StartWorker, wait_until

LONG_SAMPLES = ("--engine", "synthetic", "--engine-args", '{"steps_per_s": 10, "lengths": "uniform:150-200"}')
"""A synthetic worker whose samples take 15-20 s: longer than the deadlines below."""
MEDIUM_SAMPLES = ("--engine", "synthetic", "--engine-args", '{"steps_per_s": 80, "lengths": "uniform:150-200"}')
"""Samples of ~2-3 s: they finish inside a deadline of 20 s."""
SHORT_SAMPLES = ("--engine", "synthetic", "--engine-args", '{"steps_per_s": 400, "lengths": "uniform:150-200"}')


def busy_for(client: RolloutClient, name: str, seconds: float) -> Callable[[], bool]:
    """True once worker `name` has generated for `seconds` (its heartbeat's `busy_s`): its samples have tokens."""
    key = client.streams.keys.worker(name)
    return lambda: float(client.streams.redis.hget(key, "busy_s") or 0) >= seconds


def generated_tokens(client: RolloutClient, name: str) -> int:
    return int(client.streams.redis.hget(client.streams.keys.worker(name), "generated_tokens") or 0)


def handed_off(client: RolloutClient) -> list[Partial]:
    return [Partial.from_fields(f) for _, f in as_entries(client.streams.redis.xrange(client.streams.keys.partials))]


def finished_elsewhere(
    client: RolloutClient, ids: list[str], n: int, handed: list[Partial], workers: StartWorker, leaving: str
) -> list[Rollout]:
    """Start a finisher, collect every sample, and check each arrived once, the handed-off ones continued from their
    tokens so far: the finisher generates only what `leaving` had not (its heartbeat's count says so)."""
    workers("finisher", *SHORT_SAMPLES)
    rollouts = [r for g in client.collect(len(ids), timeout=120) for r in g.rollouts]
    assert sorted(r.id for r in rollouts) == sorted(f"{p}:{k}" for p in ids for k in range(n))
    assert client.stats["duplicates"] == 0
    by_id = {r.id: r for r in rollouts}
    for partial in handed:
        rollout = by_id[f"{partial.prompt.id}:{partial.sample}"]
        done = len(partial.generated)
        assert rollout.worker == "finisher" and list(rollout.tokens[:done]) == list(partial.generated)
    continued = sum(len(partial.generated) for partial in handed)
    by_finisher = sum(len(r.tokens) for r in rollouts if r.worker == "finisher")
    wait_until(lambda: generated_tokens(client, "finisher") == by_finisher - continued, 10, "the finisher's count")
    assert all(r.worker in (leaving, "finisher") for r in rollouts)
    return rollouts


def test_a_sigterm_with_a_deadline_exits_inside_it_and_what_would_not_finish_goes_on_elsewhere_from_its_tokens(
    redis_server: RedisServer, ns: str, workers: StartWorker
) -> None:
    """`--grace-s 4`: samples of 15-20 s cannot finish; the worker exits within the 4 s, each unfinished sample handed
    to `{ns}:partials` with its tokens, the entries acked with them; a new worker finishes each once from there."""
    leaving = workers("leaving", *LONG_SAMPLES, "--grace-s", "4")
    client = RolloutClient(redis_server.url, ns)
    ids = [client.submit(tokens=[5 + i, 9], n=2, max_tokens=200, seed=i) for i in range(4)]
    wait_until(busy_for(client, "leaving", 1.5), 30, "every sample to have tokens")
    noticed = time.monotonic()
    os.kill(leaving.pid, signal.SIGTERM)
    assert leaving.wait(timeout=20) == 0
    took = time.monotonic() - noticed
    assert took < 4.0, f"exited {took:.2f} s after a notice of 4 s"
    handed = handed_off(client)
    assert len(handed) == 8 and all(len(p.generated) >= 10 for p in handed), [len(p.generated) for p in handed]
    assert client.streams.redis.xpending(client.streams.keys.prompts, "generators")["pending"] == 0, "all acked"
    finished_elsewhere(client, ids, 2, handed, workers, "leaving")


def test_samples_that_finish_inside_the_deadline_are_published_by_the_leaving_worker(
    redis_server: RedisServer, ns: str, workers: StartWorker
) -> None:
    """Samples of ~2-3 s under a deadline of 20 s: the drain lets them finish where they run; nothing is handed off."""
    leaving = workers("leaving", *MEDIUM_SAMPLES, "--grace-s", "20")
    client = RolloutClient(redis_server.url, ns)
    ids = [client.submit(tokens=[5 + i, 9], n=2, max_tokens=200, seed=i) for i in range(2)]
    wait_until(busy_for(client, "leaving", 0.5), 30, "the samples to have tokens")
    os.kill(leaving.pid, signal.SIGTERM)
    assert leaving.wait(timeout=20) == 0
    assert handed_off(client) == []
    groups = client.collect(len(ids), timeout=10)
    assert {r.worker for g in groups for r in g.rollouts} == {"leaving"}


def test_a_notice_file_that_appears_is_a_stop_notice_with_the_deadline(
    redis_server: RedisServer, ns: str, workers: StartWorker, tmp_path: Path
) -> None:
    """`--notice-file`: the file a node agent writes on a preemption notice; its appearance stops the worker as a
    SIGTERM with `--grace-s` does."""
    notice = tmp_path / "preempted"
    leaving = workers("leaving", *LONG_SAMPLES, "--grace-s", "3", "--notice-file", str(notice))
    client = RolloutClient(redis_server.url, ns)
    ids = [client.submit(tokens=[5, 9], n=2, max_tokens=200, seed=0)]
    wait_until(busy_for(client, "leaving", 1.5), 30, "the samples to have tokens")
    noticed = time.monotonic()
    notice.write_text("")
    assert leaving.wait(timeout=20) == 0
    assert time.monotonic() - noticed < 3.0 + 0.5, "the file is looked for every 0.5 s"
    handed = handed_off(client)
    assert len(handed) == 2
    finished_elsewhere(client, ids, 2, handed, workers, "leaving")


def test_rollouts_drain_takes_a_named_worker_out_shown_stopping_in_top_while_the_others_serve_on(
    redis_server: RedisServer, ns: str, workers: StartWorker, tmp_path: Path
) -> None:
    """`rollouts drain w1 --grace-s 6`: `w1` takes nothing more, shows `stopping` in `top`, hands what would not
    finish inside the deadline on and leaves; the command says when; `w2` serves on and every sample arrives once."""
    workers.many(("w1", *LONG_SAMPLES), ("w2", *SHORT_SAMPLES))
    client = RolloutClient(redis_server.url, ns)
    ids = [client.submit(tokens=[5 + i, 9], n=2, max_tokens=200, seed=i) for i in range(6)]
    wait_until(busy_for(client, "w1", 1.0), 30, "w1 to be generating")
    drain = start_command("drain", "w1", "--redis", redis_server.url, "--ns", ns, "--grace-s", "6",
                          log_file=tmp_path / "drain.log")  # fmt: skip
    wait_until(lambda: snapshot_status(client, "w1") == "stopping", 10, "top to show w1 stopping")
    assert drain.wait(timeout=30) == 0, (tmp_path / "drain.log").read_text()
    assert "w1: left after" in (tmp_path / "drain.log").read_text()
    assert client.streams.registry.live_worker_names() == ["w2"]
    rollouts = [r for g in client.collect(len(ids), timeout=120) for r in g.rollouts]
    assert sorted(r.id for r in rollouts) == sorted(f"{p}:{k}" for p in ids for k in range(2))
    assert client.stats["duplicates"] == 0


def test_rollouts_drain_of_a_worker_that_is_not_there_says_which_are(
    redis_server: RedisServer, ns: str, workers: StartWorker
) -> None:
    workers("w1", *SHORT_SAMPLES)
    result = subprocess.run(
        [sys.executable, "-m", "rollouts", "drain", "nobody", "--redis", redis_server.url, "--ns", ns],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "no live worker named nobody" in result.stderr and "(live: w1)" in result.stderr, result.stderr


def snapshot_status(client: RolloutClient, name: str) -> str | None:
    """Worker `name`'s status as `rollouts top` shows it (`pipeline.top.snapshot`)."""
    from pipeline.top import snapshot

    return snapshot(client.streams)["workers"].get(name, {}).get("status")
