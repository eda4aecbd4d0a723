"""Redis behind Sentinel: a `redis+sentinel://` URL names the Sentinels and the service, and every part follows the
primary Sentinel names, through a failover too (a primary, a replica and three Sentinels on loopback)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from pipeline.connections import connect, redact
from pipeline.local import SentinelTopology, find_redis_server, valkey_binary
from pipeline.processes import start_worker, stop_processes, wait_for_worker
from pipeline.sentinel import parse_sentinel_url
from producers.client import RolloutClient
from tests.fixtures import VALKEY_MISSING, wait_until
from tests.pipeline.test_acl import make_ca

SERVICE = "rollouts"
STEADY = ("--claim-idle-ms", "5000", "--heartbeat-s", "2")
"""Worker flags: a worker is dead to the others after 5 s of silence (2.5 heartbeats), longer than a failover takes
here (1 s down-after, then the election; a few seconds on a loaded machine). With `FAST`'s 0.3 s heartbeat, a failover
made every worker look dead for a moment: its work was claimed, and a sync right after passed it by."""


def test_a_sentinel_url_names_its_sentinels_service_database_and_credentials() -> None:
    target = parse_sentinel_url("redis+sentinel://ann:s%40cret@10.0.0.1:26379,[::1]:26380/rollouts/3")
    assert target.sentinels == (("10.0.0.1", 26379), ("::1", 26380))
    assert (target.service, target.db, target.username, target.password, target.tls) == (
        "rollouts",
        3,
        "ann",
        "s@cret",
        False,
    )
    assert parse_sentinel_url("rediss+sentinel://h:1/svc").tls
    assert redact("redis+sentinel://ann:secret@h1:1,h2:2/svc") == "redis+sentinel://ann:***@h1:1,h2:2/svc"


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+sentinel://h1:1,h2/svc", "without its port"),
        ("redis+sentinel://h1:1", "names no service"),
        ("redis+sentinel:///svc", "no Sentinel"),
        ("redis+sentinel://h1:1/svc/x", "names no service"),
    ],
)
def test_a_malformed_sentinel_url_is_refused_saying_what_to_fix(url: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_sentinel_url(url)


@dataclass(frozen=True)
class Shape:
    """How many replicas the primary has, and its `min-replicas-to-write` (every server's: a replica is promoted)."""

    replicas: int = 1
    min_replicas_to_write: int = 0
    server: str = "installed"
    """`installed` (`redis-server --sentinel`) or `valkey` (Valkey 8.1, `valkey-server --sentinel`)."""
    tls: bool = False
    """Servers, replication and Sentinels on TLS only, with a test CA (`rediss+sentinel://`)."""


@pytest.fixture
def topology(request: pytest.FixtureRequest) -> Iterator[SentinelTopology]:
    """A primary, its replicas (`Shape`, one by default) and three Sentinels (quorum 2) that call a primary down after
    1 s of silence, all of the server the shape names, the replicas in sync (`SentinelTopology`)."""
    shape: Shape = getattr(request, "param", Shape())
    binary = valkey_binary() if shape.server == "valkey" else find_redis_server()
    if binary is None:
        pytest.skip(VALKEY_MISSING)
    settings = {"min-replicas-to-write": str(shape.min_replicas_to_write), "min-replicas-max-lag": "1"}
    tls = make_ca(request.getfixturevalue("tmp_path")) if shape.tls else None
    with SentinelTopology(replicas=shape.replicas, binary=binary, service=SERVICE, settings=settings, tls=tls) as up:
        yield up


@pytest.mark.parametrize(
    ("topology", "durability"),
    [  # a replica mode's writes need a replica after the failover: two
        (Shape(replicas=1), "default"),
        pytest.param(Shape(replicas=2), "replica", marks=pytest.mark.long("the same with TLS: the [tls-replica] run")),
        (Shape(replicas=2, server="valkey"), "replica"),
        (Shape(replicas=2, tls=True), "replica"),
    ],
    indirect=["topology"],
    ids=["default", "replica", "valkey-replica", "tls-replica"],
)
def test_a_fleet_given_only_the_sentinels_delivers_every_sample_once_through_a_failover_then_syncs(
    topology: SentinelTopology, durability: str, tiny_model_dir: Path, tiny_model_dir_v1: Path, tmp_path: Path
) -> None:
    """A trainer client and two synthetic workers know only the Sentinels (over TLS too: `rediss+sentinel://`). The
    primary is killed (`kill -9`) while prompts are under way; Sentinel promotes the replica, and every part follows
    it by itself: every prompt comes back once, none twice; then after a weight sync on the new primary both workers
    serve the new version (acked, or loaded as a worker late to it beats again), and what they generate next is
    tagged with it."""
    ns = "sentinel"
    url = f"{topology.url}{'&' if '?' in topology.url else '?'}durability={durability}"
    client = RolloutClient(url, ns)
    assert isinstance(connect(url), redis.Redis)
    slow = ("--engine", "synthetic", "--engine-args", '{"steps_per_s": 40}')
    procs = [
        start_worker(url, ns, tiny_model_dir, name, *STEADY, *slow, log_file=tmp_path / f"{name}.log")
        for name in ("w1", "w2")
    ]
    try:
        watcher = connect(url)
        for name, proc in zip(("w1", "w2"), procs, strict=True):
            wait_for_worker(watcher, ns, name, proc, timeout_s=120)
        ids = [client.submit(tokens=[4, 5, k], n=2, max_tokens=40, seed=k) for k in range(24)]
        first = client.collect(2, timeout=60)
        before = topology.primary_port()
        primary = topology.server(before)
        assert primary.process is not None
        os.kill(primary.process.pid, signal.SIGKILL)
        wait_until(lambda: topology.primary_port() != before, 60, "Sentinel to promote the replica")
        failed_over = time.time()
        rest = client.collect(len(ids) - len(first), timeout=120)
        got = [g.prompt_id for g in first + rest]
        assert sorted(got) == sorted(ids)
        assert client.stats["duplicates"] == 0
        assert all(p.poll() is None for p in procs), "a worker gave up on the failover"

        # Both beating on the new primary since the failover: the sync then asks both.
        def beating_since(when: float) -> bool:
            beats = client.streams.registry.live_workers()
            return sorted(beats) == ["w1", "w2"] and all(float(b["ts"]) > when for b in beats.values())

        wait_until(lambda: beating_since(failed_over), 60, "both workers beating on the new primary")
        assert client.publish_weights(tiny_model_dir_v1, ack_timeout_s=60) == 1
        report = client.last_sync
        assert report is not None and report.acked and report.evicted == [], report
        # A worker whose heartbeat ran late past its deadline right then (a loaded host) was not asked: it is gone to
        # the sync, and loads the version itself as it beats again. Either way both serve version 1.
        assert set(report.acked) | set(report.gone) <= {"w1", "w2"}, report

        def on_v1() -> bool:
            beats = client.streams.registry.live_workers()
            return sorted(beats) == ["w1", "w2"] and all(b["version"] == "1" for b in beats.values())

        wait_until(on_v1, 60, "both workers on version 1")
        after = [client.submit(tokens=[6, 5, k], n=2, max_tokens=10, seed=k) for k in range(6)]
        groups = client.collect(len(after), timeout=60)
        assert sorted(g.prompt_id for g in groups) == sorted(after)
        assert {r.version for g in groups for r in g.rollouts} == {1}
    finally:
        stop_processes(procs)


@pytest.mark.parametrize("topology", [Shape(replicas=2, min_replicas_to_write=1)], indirect=True)
def test_a_stale_primary_that_comes_back_after_a_failover_takes_no_write_and_its_clients_move_on(
    topology: SentinelTopology, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The primary is stopped (SIGSTOP) past Sentinel's down-after, and a replica is promoted. The old primary comes
    back (SIGCONT) still taking itself for the primary, and the trainer client still holds a connection to it. With
    `min-replicas-to-write 1` it refuses that client's writes (`NOREPLICAS`: no replica follows it any more; once
    Sentinel demotes it, `READONLY`), and the client takes them to the new primary: every prompt submitted right then
    comes back once. Written on the stale primary, they would have been lost when Sentinel made it a replica.
    `min-replicas-to-write` alone leaves a window (the stale primary counts its replicas again only once a second), so
    the fleet runs with `durability=replica`: a write the stale primary took is not done until a replica has it, and
    none will, so it is sent again, to the new primary."""
    ns = "stale"
    url = topology.url + "?durability=replica"
    client = RolloutClient(url, ns)
    worker = start_worker(url, ns, tiny_model_dir, "w1", *STEADY, "--engine", "synthetic",
                          log_file=tmp_path / "w1.log")  # fmt: skip
    try:
        wait_for_worker(connect(url), ns, "w1", worker, timeout_s=120)
        warm = [client.submit(tokens=[4, 5, k], n=1, max_tokens=8, seed=k) for k in range(4)]
        assert sorted(g.prompt_id for g in client.collect(len(warm), timeout=60)) == sorted(warm)
        old = topology.server(topology.primary_port())
        assert old.process is not None
        os.kill(old.process.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: topology.primary_port() != old.port, 60, "Sentinel to promote a replica")
        finally:
            os.kill(old.process.pid, signal.SIGCONT)
        ids = [client.submit(tokens=[6, 5, k], n=1, max_tokens=8, seed=k) for k in range(8)]
        groups = client.collect(len(ids), timeout=90)
        assert sorted(g.prompt_id for g in groups) == sorted(ids)
        assert client.stats["duplicates"] == 0
    finally:
        stop_processes([worker])


def test_the_cli_given_only_the_sentinels_submits_shows_and_creates_acl_users_on_every_server(
    topology: SentinelTopology, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`rollouts submit` and `rollouts top` take a Sentinel URL like any other. ACL users are each server's own:
    `rollouts acl --apply` given the Sentinels creates the user on every server, so that the role still gets in once a
    replica is promoted."""
    import json

    from typer.testing import CliRunner

    from rollouts import app

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"tokens": [1, 2, k], "n": 2}) + "\n" for k in range(3)))
    submitted = CliRunner().invoke(app, ["submit", "--file", str(prompts), "--ns", "cli", "--redis", topology.url])
    assert submitted.exit_code == 0, submitted.output
    top = CliRunner().invoke(app, ["top", "--once", "--json", "--ns", "cli", "--redis", topology.url])
    assert top.exit_code == 0, top.output
    assert json.loads(top.output)["streams"]["prompts"]["length"] == 3

    monkeypatch.setenv("ROLLOUTS_ACL_PASSWORD", "s3cret")
    result = CliRunner().invoke(
        app, ["acl", "--role", "worker", "--user", "w1", "--ns", "acl", "--apply", "--redis", topology.url]
    )
    assert result.exit_code == 0, result.output
    assert "on the 2 servers the Sentinels know" in " ".join(result.output.split())
    for server in topology.servers:
        with contextlib.closing(redis.Redis(port=server.port)) as admin:
            assert admin.acl_getuser("w1") is not None, f"no user w1 on {server.port}"


def test_a_read_blocked_on_a_primary_that_is_made_a_replica_counts_as_a_lost_connection() -> None:
    """A worker waits in `XREADGROUP ... BLOCK` on the primary; Sentinel makes that server a replica (a stale primary
    back after a failover), and the server wakes the read with an `UNBLOCKED` error. The Sentinel client counts it as
    a lost primary, as `READONLY`: the read is sent again, to the primary the Sentinels name now."""
    from pipeline.local import RedisServer
    from pipeline.sentinel import no_longer_primary

    binary = find_redis_server()
    stale, new = RedisServer(binary=binary).start(), RedisServer(binary=binary).start()
    try:
        reader = redis.Redis(port=stale.port)
        reader.xgroup_create("s", "g", id="0", mkstream=True)
        woken: list[redis.ResponseError] = []

        def read() -> None:
            try:
                reader.xreadgroup("g", "w", {"s": ">"}, count=1, block=30_000)
            except redis.ResponseError as exc:
                woken.append(exc)

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        with contextlib.closing(redis.Redis(port=stale.port)) as admin:
            wait_until(lambda: int(admin.info("clients")["blocked_clients"]) == 1, 10, "the read to block")
            admin.replicaof("127.0.0.1", new.port)
        thread.join(10)
        assert woken and str(woken[0]).startswith("UNBLOCKED"), woken
        assert no_longer_primary(woken[0])  # PrimaryConnection drops itself and raises a ConnectionError: retried
    finally:
        stale.stop()
        new.stop()
