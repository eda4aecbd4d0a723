"""Redis behind Sentinel: a `redis+sentinel://` URL names the Sentinels and the service, and every part follows the
primary Sentinel names, through a failover too (a primary, a replica and three Sentinels on loopback)."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from pipeline.connections import connect, parse_sentinel_url, redact
from pipeline.local import RedisServer, find_redis_server, free_port, valkey_binary
from pipeline.processes import start_worker, stop_processes, wait_for_worker
from producers.client import RolloutClient
from tests.fixtures import FAST, VALKEY_MISSING, wait_until

SERVICE = "rollouts"


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


@dataclass
class Topology:
    primary: RedisServer
    replica: RedisServer
    sentinels: list[subprocess.Popen[bytes]]
    ports: list[int]

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in self.ports) + f"/{SERVICE}"

    def primary_port(self) -> int:
        sentinel = redis.Redis(port=self.ports[0], socket_timeout=2)
        try:
            _host, port = sentinel.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
            return int(port)
        finally:
            sentinel.close()


SERVERS = ["installed", "valkey"]
"""`topology` params: the installed Redis (`redis-server --sentinel`) and Valkey 8.1 (`valkey-server --sentinel`)."""


@pytest.fixture
def topology(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Topology]:
    """A primary, its replica and three Sentinels (quorum 2) that call a primary down after 1 s of silence, all of
    the server its param names (`SERVERS`; the installed Redis by default)."""
    binary = valkey_binary() if getattr(request, "param", "installed") == "valkey" else find_redis_server()
    if binary is None:
        pytest.skip(VALKEY_MISSING)
    primary = RedisServer(binary=binary).start()
    replica = RedisServer(binary=binary).start()
    redis.Redis(port=primary.port).config_set("repl-diskless-sync-delay", 0)
    redis.Redis(port=replica.port).replicaof("127.0.0.1", primary.port)
    ports = [free_port() for _ in range(3)]
    sentinels = []
    for port in ports:
        conf = tmp_path / f"sentinel-{port}.conf"
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {tmp_path}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {primary.port} 2\n"
            f"sentinel down-after-milliseconds {SERVICE} 1000\n"
            f"sentinel failover-timeout {SERVICE} 5000\n"
        )
        sentinels.append(subprocess.Popen([binary.path, str(conf), "--sentinel"], stdout=subprocess.DEVNULL))
    up = Topology(primary, replica, sentinels, ports)
    try:
        wait_until(lambda: _in_sync(replica), 30, "the replica in sync")
        wait_until(lambda: _replicas_seen(up) >= 1, 30, "the Sentinels to see the replica")
        yield up
    finally:
        stop_processes(sentinels)
        replica.stop()
        primary.stop()


def _in_sync(replica: RedisServer) -> bool:
    client = redis.Redis(port=replica.port, decode_responses=True)
    try:
        return bool(client.info("replication").get("master_link_status") == "up")
    finally:
        client.close()


def _replicas_seen(up: Topology) -> int:
    try:
        sentinel = redis.Redis(port=up.ports[0], socket_timeout=1)
        try:
            return len(sentinel.execute_command("SENTINEL", "REPLICAS", SERVICE))
        finally:
            sentinel.close()
    except redis.RedisError:
        return 0


@pytest.mark.parametrize("topology", SERVERS, indirect=True)
def test_a_fleet_given_only_the_sentinels_delivers_every_sample_once_through_a_failover(
    topology: Topology, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A trainer client and two synthetic workers know only the Sentinels. The primary is killed (`kill -9`) while
    prompts are under way; Sentinel promotes the replica, and every part follows it by itself: every prompt comes
    back once, none twice."""
    ns = "sentinel"
    client = RolloutClient(topology.url, ns)
    assert isinstance(connect(topology.url), redis.Redis)
    slow = ("--engine", "synthetic", "--engine-args", '{"steps_per_s": 40}')
    procs = [
        start_worker(topology.url, ns, tiny_model_dir, name, *FAST, *slow, log_file=tmp_path / f"{name}.log")
        for name in ("w1", "w2")
    ]
    try:
        watcher = connect(topology.url)
        for name, proc in zip(("w1", "w2"), procs, strict=True):
            wait_for_worker(watcher, ns, name, proc, timeout_s=120)
        ids = [client.submit(tokens=[4, 5, k], n=2, max_tokens=40, seed=k) for k in range(24)]
        first = client.collect(2, timeout=60)
        before = topology.primary_port()
        assert topology.primary.process is not None
        os.kill(topology.primary.process.pid, signal.SIGKILL)
        wait_until(lambda: topology.primary_port() != before, 60, "Sentinel to promote the replica")
        rest = client.collect(len(ids) - len(first), timeout=120)
        got = [g.prompt_id for g in first + rest]
        assert sorted(got) == sorted(ids)
        assert client.stats["duplicates"] == 0
        assert all(p.poll() is None for p in procs), "a worker gave up on the failover"
    finally:
        stop_processes(procs)
