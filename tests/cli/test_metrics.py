"""Prometheus: `rollouts exporter` and the `--metrics-port` of workers and the manager, scraped over HTTP
as Prometheus would and parsed with `prometheus_client`'s own parser; the values are checked against
what Redis says (XLEN, XINFO GROUPS, the heartbeat hash) and what the pipeline did."""

from __future__ import annotations

import os
import signal
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from pipeline.codec import as_fields
from pipeline.local import RedisServer, free_port
from pipeline.processes import start_command, stop_process
from pipeline.wire import Control, Keys
from producers.client import RolloutClient
from rollouts.app import open_streams
from staleness.metrics import SyncMetrics
from tests.cli.test_cli import assert_clean_error, rollouts
from tests.fixtures import StartWorker, wait_until

Scrape = Callable[[], list[Sample]]


def scrape(port: int) -> list[Sample]:
    """Every sample on http://127.0.0.1:PORT/metrics, through the Prometheus text parser."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=15) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def value(samples: list[Sample], name: str, **labels: str) -> float:
    """The sum of the samples called `name` whose labels include `labels` (one sample, or a histogram's
    `_count` over its label values); KeyError when there is none."""
    found = [s.value for s in samples if s.name == name and labels.items() <= s.labels.items()]
    if not found:
        raise KeyError(f"no sample {name} {labels}")
    return sum(found)


def has(samples: list[Sample], name: str, **labels: str) -> bool:
    return any(s.name == name and labels.items() <= s.labels.items() for s in samples)


@pytest.fixture
def serve() -> Iterator[Callable[..., tuple[Scrape, subprocess.Popen[bytes]]]]:
    """Start `rollouts ARGS --PORT-FLAG PORT` as a process and return a scraper of its endpoint, once it answers."""
    started: list[subprocess.Popen[bytes]] = []

    def start(*args: str, port_flag: str = "--port", log: Path | None = None) -> tuple[Scrape, subprocess.Popen]:
        port = free_port()
        process = start_command(*args, port_flag, str(port), log_file=log)
        started.append(process)

        def answers() -> bool:
            assert process.poll() is None, f"rollouts {args[0]} exited with {process.returncode}"
            try:
                scrape(port)
            except (urllib.error.URLError, ConnectionError):
                return False
            return True

        wait_until(answers, 60, f"rollouts {args[0]} to serve metrics on {port}")
        return (lambda: scrape(port)), process

    yield start
    for process in started:
        stop_process(process)


def group_info(client: redis.Redis, stream: str, group: str) -> dict[str, int | None]:
    (info,) = [g for g in client.xinfo_groups(stream) if g["name"].decode() == group]
    return {"lag": info.get("lag"), "pending": info["pending"], "consumers": info["consumers"]}


def test_the_exporter_worker_and_manager_endpoints_report_what_happened(
    redis_server: RedisServer,
    ns: str,
    workers: StartWorker,
    tiny_model_dir: Path,
    tiny_model_dir_v1: Path,
    serve: Callable[..., tuple[Scrape, subprocess.Popen[bytes]]],
    tmp_path: Path,
) -> None:
    url, keys = redis_server.url, Keys(ns)
    client = RolloutClient(url, ns, trim_every_s=3600)  # keep acked rollouts, to count them
    raw = client.streams.redis
    fleet, _ = serve("exporter", "--redis", url, "--ns", ns, log=tmp_path / "exporter.log")
    manager, _ = serve(
        "manager", "--redis", url, "--ns", ns, "--interval", "0.1", "--abandoned-after-s", "2",
        port_flag="--metrics-port", log=tmp_path / "manager.log",
    )  # fmt: skip
    K, N = 6, 2
    for i in range(K):
        client.submit(tokens=[5, 6, 7 + i], n=N, max_tokens=8, id=f"p{i}")

    # Queued, no worker yet: the exporter shows what XLEN and XINFO GROUPS say.
    s = fleet()
    assert value(s, "rollouts_up", ns=ns) == 1
    assert value(s, "rollouts_stream_length", stream="prompts") == raw.xlen(keys.prompts) == K
    prompts = group_info(raw, keys.prompts, "generators")
    assert prompts == {"lag": K, "pending": 0, "consumers": 0}
    assert value(s, "rollouts_stream_group_lag", stream="prompts", group="generators") == K
    assert value(s, "rollouts_stream_group_pending", stream="prompts", group="generators") == 0
    assert value(s, "rollouts_admission_submitted_samples_total") == K * N
    assert value(s, "rollouts_policy_version") == 0 and value(s, "rollouts_paused") == 0
    assert not has(s, "rollouts_worker_info") and not has(s, "rollouts_admission_capacity_samples")

    metrics_port = free_port()
    workers("mw", "--metrics-port", str(metrics_port))
    worker = lambda: scrape(metrics_port)  # noqa: E731
    groups = client.collect(K, timeout=120)
    assert sorted(g.prompt_id for g in groups) == [f"p{i}" for i in range(K)]
    generated = sum(len(r.tokens) for g in groups for r in g.rollouts)

    # Everything read: the exporter agrees with Redis (the worker may trim the prompts meanwhile: re-read both).
    def exporter_agrees() -> bool:
        s = fleet()
        beat = {k.decode(): v.decode() for k, v in as_fields(raw.hgetall(keys.worker("mw"))).items()}
        return (
            value(s, "rollouts_stream_length", stream="prompts") == raw.xlen(keys.prompts)
            and value(s, "rollouts_worker_inflight_samples", worker="mw") == float(beat["inflight"]) == 0
            and value(s, "rollouts_worker_generated_tokens_total", worker="mw") == int(beat["generated_tokens"])
            and int(beat["published"]) == K * N  # a heartbeat from after the last rollout
        )

    wait_until(exporter_agrees, 30, "the exporter to show the heartbeat after the last rollout")
    s = fleet()
    assert value(s, "rollouts_stream_length", stream="rollouts") == raw.xlen(keys.rollouts) == K * N
    for stream, group in (("prompts", "generators"), ("rollouts", "trainer")):
        assert group_info(raw, getattr(keys, stream), group) == {"lag": 0, "pending": 0, "consumers": 1}
        assert value(s, "rollouts_stream_group_lag", stream=stream, group=group) == 0
        assert value(s, "rollouts_stream_group_pending", stream=stream, group=group) == 0
        assert value(s, "rollouts_stream_group_consumers", stream=stream, group=group) == 1
    assert value(s, "rollouts_worker_info", worker="mw", status="serving", engine="torch") == 1
    assert value(s, "rollouts_workers", status="serving") == 1
    assert value(s, "rollouts_worker_policy_version", worker="mw") == 0
    assert value(s, "rollouts_worker_published_rollouts_total", worker="mw") == K * N
    assert value(s, "rollouts_worker_generated_tokens_total", worker="mw") == generated
    assert 0 <= value(s, "rollouts_worker_heartbeat_age_seconds", worker="mw") < 5

    # The worker's own endpoint: one latency observation per sample, the tokens the heartbeat counts.
    w = worker()
    assert value(w, "rollouts_generation_seconds_count", worker="mw", ns=ns) == K * N
    assert value(w, "rollouts_generation_seconds_bucket", le="+Inf") == K * N
    beat_tokens = raw.hget(keys.worker("mw"), "generated_tokens")
    assert beat_tokens is not None
    assert value(w, "rollouts_generated_tokens_total") == generated == float(beat_tokens)
    assert value(w, "rollouts_generation_tokens_sum") == generated
    assert value(w, "rollouts_published_rollouts_total") == K * N
    assert value(w, "rollouts_error_rollouts_total") == 0 and value(w, "rollouts_dead_letters_total") == 0
    assert value(w, "rollouts_sync_stall_seconds_count") == 0
    assert value(w, "process_resident_memory_bytes") > 0

    # A weight sync: the policy version moves, the worker and the manager each saw one stall.
    assert client.publish_weights(tiny_model_dir_v1) == 1
    assert client.last_sync is not None
    stall = client.last_sync.stall_s
    wait_until(lambda: value(fleet(), "rollouts_worker_policy_version", worker="mw") == 1, 30, "the worker on v1")
    s = fleet()
    assert value(s, "rollouts_policy_version") == 1 and value(s, "rollouts_sync_epoch") == 1
    assert value(s, "rollouts_paused") == 0 and value(s, "rollouts_worker_sync_epoch", worker="mw") == 1
    wait_until(lambda: value(worker(), "rollouts_sync_stall_seconds_count") == 1, 30, "the worker's resume")
    w = worker()
    assert 0 < value(w, "rollouts_sync_stall_seconds_sum") < stall + 1
    assert value(w, "rollouts_sync_pause_seconds_count") == value(w, "rollouts_weight_load_seconds_count") == 1
    wait_until(lambda: value(manager(), "rollouts_manager_syncs_total") == 1, 30, "the manager to see the sync")
    m = manager()
    assert value(m, "rollouts_manager_sync_stall_seconds_count", ns=ns) == 1
    assert 0 < value(m, "rollouts_manager_sync_stall_seconds_sum") <= stall + 0.01  # time.time() vs monotonic
    assert value(m, "rollouts_manager_evictions_total") == 0
    assert value(m, "rollouts_manager_abandoned_syncs_total") == 0

    # A driver that dies mid-sync and a worker that never acks: the manager finishes the sync and evicts it.
    # Its heartbeat (TTL 5 x 10 s) outlives the SIGSTOP below, even on a loaded machine: evicted, not gone.
    stuck = workers("stuck", "--engine", "synthetic", "--heartbeat-s", "10")  # never acks: its engine is moot
    os.kill(stuck.pid, signal.SIGSTOP)
    args = ("--redis", url, "--ns", ns, "--from", str(tiny_model_dir), "--ack-timeout-s", "600")
    driver = start_command("publish-weights", *args, log_file=tmp_path / "driver.log")
    wait_until(lambda: raw.hget(keys.worker("mw"), "epoch") == b"2", 60, "mw to ack the second sync")
    driver.kill()
    driver.wait()
    wait_until(lambda: value(manager(), "rollouts_manager_abandoned_syncs_total") == 1, 30, "the manager to finish it")
    m = manager()
    assert value(m, "rollouts_manager_evictions_total") == 1, (tmp_path / "manager.log").read_text()[-2000:]
    assert value(m, "rollouts_manager_syncs_total") == value(m, "rollouts_manager_sync_stall_seconds_count") == 2
    assert value(m, "rollouts_manager_sync_stall_seconds_sum") - stall >= 2  # --abandoned-after-s
    os.kill(stuck.pid, signal.SIGCONT)
    assert stuck.wait(timeout=60) == 1
    assert value(fleet(), "rollouts_policy_version") == 2

    # A prompt the engine refuses and an entry that does not decode: counted where they happened.
    client.submit(tokens=[5] * 600, n=1, max_tokens=8, id="too-long")  # the tiny model's context is 512
    raw.xadd(keys.prompts, {b"v": b"1", b"id": b"junk"})
    wait_until(lambda: value(worker(), "rollouts_dead_letters_total", stage="decode") == 1, 30, "the dead letter")
    wait_until(lambda: value(worker(), "rollouts_error_rollouts_total") == 1, 30, "the error rollout")
    assert value(worker(), "rollouts_generation_seconds_count", finish_reason="error") == 1
    wait_until(lambda: value(fleet(), "rollouts_stream_length", stream="dead") == 1, 30, "the dead stream")


def test_the_scoring_stage_and_admission_limits_are_exported(
    redis_server: RedisServer, ns: str, serve: Callable[..., tuple[Scrape, subprocess.Popen[bytes]]]
) -> None:
    client = RolloutClient(redis_server.url, ns, max_staleness=2, batch_size=4)
    client.submit(tokens=[1, 2], n=3)
    keys = client.streams.keys
    # The fields the scoring stage's leader writes (consumers.scoring.stage): status, and counters beside.
    client.streams.redis.hset(
        keys.scorer,
        mapping={"leader": "s1", "mode": "rq", "open_groups": 2, "running": 1, "queued": 3, "rq_workers": 2,
                 "retries": 1, "ts": 0, "groups": 7, "rollouts": 28, "reward_errors": 1},
    )  # fmt: skip
    fleet, _ = serve("exporter", "--redis", redis_server.url, "--ns", ns)
    s = fleet()
    assert value(s, "rollouts_admission_capacity_samples") == (2 + 0 + 1) * 4
    assert value(s, "rollouts_admission_used_samples") == 3 and value(s, "rollouts_admission_free_samples") == 9
    assert value(s, "rollouts_admission_max_staleness") == 2 and value(s, "rollouts_admission_batch_size_samples") == 4
    assert value(s, "rollouts_scorer_info", leader="s1", mode="rq") == 1
    assert value(s, "rollouts_scorer_open_groups") == 2 and value(s, "rollouts_scorer_running_groups") == 1
    assert value(s, "rollouts_scorer_rq_queued_jobs") == 3 and value(s, "rollouts_scorer_rq_workers") == 2
    assert value(s, "rollouts_scorer_scored_groups_total") == 7
    assert value(s, "rollouts_scorer_forwarded_rollouts_total") == 28
    assert value(s, "rollouts_scorer_reward_errors_total") == 1 and value(s, "rollouts_scorer_retries_total") == 1
    assert value(s, "rollouts_scorer_status_age_seconds") > 1e9  # ts 0: written long ago
    assert not has(s, "rollouts_stream_length", stream="scoring")  # no prompt named a reward_fn


@pytest.mark.parametrize("redis_server", ["bundled"], indirect=True)
def test_on_redis_6_2_lag_is_left_out_and_a_lost_redis_reads_up_0_until_it_is_back(
    redis_server: RedisServer, ns: str, serve: Callable[..., tuple[Scrape, subprocess.Popen[bytes]]]
) -> None:
    client = RolloutClient(redis_server.url, ns)
    client.submit(tokens=[1, 2], n=2)
    fleet, _ = serve("exporter", "--redis", redis_server.url, "--ns", ns)
    s = fleet()
    assert value(s, "rollouts_stream_group_pending", stream="prompts", group="generators") == 0
    assert not has(s, "rollouts_stream_group_lag"), "6.2 has no lag: no sample rather than a wrong one"

    with RedisServer() as own:  # a server of this test's own, to stop under the exporter
        fleet, exporter = serve("exporter", "--redis", own.url, "--ns", ns)
        assert value(fleet(), "rollouts_up") == 1
    s = fleet()  # an HTTP 200 all the same
    assert value(s, "rollouts_up", ns=ns) == 0 and not has(s, "rollouts_stream_length")
    assert exporter.poll() is None
    with RedisServer(port=own.port):  # back: the next scrape reconnects
        assert value(fleet(), "rollouts_up") == 1 and value(fleet(), "rollouts_stream_length", stream="prompts") == 0


def test_wrong_redis_or_a_taken_port_is_one_line(redis_server: RedisServer, ns: str, tiny_model_dir: Path) -> None:
    assert_clean_error(rollouts("exporter", "--redis", f"redis://127.0.0.1:{free_port()}/0"), "cannot reach Redis")
    with RedisServer() as busy:  # a port that is taken
        taken = str(busy.port)
        url = redis_server.url
        assert_clean_error(
            rollouts("exporter", "--redis", url, "--port", taken), f"cannot serve metrics on 0.0.0.0:{taken}"
        )
        worker = ("worker", "--redis", url, "--ns", ns, "--model", str(tiny_model_dir), "--metrics-port", taken)
        assert_clean_error(rollouts(*worker), "cannot serve metrics", "Pass another --metrics-port")
        assert_clean_error(rollouts("manager", "--redis", url, "--metrics-port", taken), "cannot serve metrics")


def test_an_abandoned_sync_is_counted_with_its_evictions_and_resume(redis_server: RedisServer, ns: str) -> None:
    # The manager finished a sync whose driver died: it evicted a worker and resumed the rest (the control stream
    # has both), then counts the sync as abandoned. The counters move together, not one scrape apart.
    streams = open_streams(redis_server.url, ns)
    syncs = SyncMetrics(streams)
    streams.control.send(Control(cmd="stop", worker="stuck"), ring=False)
    streams.control.send(Control(cmd="resume", epoch=1, version=1, uri="/w"), ring=False)
    syncs.abandoned()
    samples = [s for f in text_string_to_metric_families(generate_latest(syncs.registry).decode()) for s in f.samples]
    assert value(samples, "rollouts_manager_abandoned_syncs_total") == 1
    assert value(samples, "rollouts_manager_evictions_total") == 1
    assert value(samples, "rollouts_manager_syncs_total") == 1
