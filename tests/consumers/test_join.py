"""A worker that joins mid-run takes the current version from a peer (`consumers.peer`): real worker processes (the
torch engine on the CPU, so gloo), a real redis-server, the trainer publishing by `nccl://` (nothing stored) or
`redis://`."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import redis

from consumers.sync import AWAITING_WEIGHTS
from pipeline.codec import as_entries, as_text
from pipeline.control import BELLS, bell_index
from pipeline.local import RedisServer, free_port
from pipeline.processes import stop_process
from pipeline.wire import Control, Keys
from producers.client import RolloutClient
from tests.fixtures import StartWorker, wait_until
from tests.reference import check_spans_and_logprobs

JOIN_DEADLINE_S = 20.0
"""A joiner's catch-up (`join_s`: from reading the state to serving), the tiny model on a loaded 2-core machine."""


def heartbeat(client: RolloutClient, name: str, field: str) -> str:
    return as_text(client.streams.redis.hget(client.streams.keys.worker(name), field) or b"")


def shares_asked(client: RolloutClient) -> list[Control]:
    """The `share` commands on the control stream so far."""
    entries = as_entries(client.streams.redis.xrange(client.streams.keys.control))
    commands = [Control.from_fields(fields) for _id, fields in entries]
    return [c for c in commands if c.cmd == "share"]


def only_from(client: RolloutClient, name: str, ids: list[str], weights: dict[int, Path], version: int) -> None:
    """Every rollout of `ids` came from worker `name`, tagged `version`, its logprobs those of `weights`."""
    rollouts = [r for g in client.collect(len(ids), timeout=120) for r in g.rollouts]
    assert {r.worker for r in rollouts} == {name}
    for rollout in rollouts:
        assert rollout.spans == [(version, 0, rollout.n_tokens)]
        check_spans_and_logprobs(rollout, weights)


def freeze(*procs: subprocess.Popen[bytes]) -> None:
    """Stop these workers (SIGSTOP; the fixture's teardown continues them) so that the work goes elsewhere."""
    for proc in procs:
        os.kill(proc.pid, signal.SIGSTOP)


def test_a_worker_that_joins_mid_run_serves_the_current_version_taken_from_a_peer(
    redis_server: RedisServer, ns: str, tiny_model_dir_v1: Path, workers: StartWorker
) -> None:
    early = workers.many(("early1",), ("early2",))
    client = RolloutClient(redis_server.url, ns)
    assert client.publish_weights(tiny_model_dir_v1, transport=f"nccl://127.0.0.1:{free_port()}") == 1
    wait_until(lambda: heartbeat(client, "early1", "shares") == "1", 30, "the peers to say they share")

    workers("late")  # nothing stores version 1: only a peer has it
    assert heartbeat(client, "late", "version") == "1"
    assert heartbeat(client, "late", "joined_from") == "peer:early1"  # by name: joiners at once ask the same one
    assert 0 < float(heartbeat(client, "late", "join_s")) < JOIN_DEADLINE_S
    wait_until(lambda: heartbeat(client, "early1", "shared_pushes") == "1", 10, "the peer to count its push")
    assert heartbeat(client, "early1", "status") == "serving"  # it went on serving

    freeze(*early)  # what comes next is the joiner's alone
    ids = [client.submit(tokens=[7, 8 + i], n=2, max_tokens=20, id=f"after{i}") for i in range(3)]
    only_from(client, "late", ids, {1: tiny_model_dir_v1}, 1)


def test_two_workers_that_join_at_once_are_served_by_one_push(
    redis_server: RedisServer, ns: str, tiny_model_dir_v1: Path, workers: StartWorker
) -> None:
    workers("peer", "--share-window-s", "8")  # joiners whose engines come up within 8 s of each other
    client = RolloutClient(redis_server.url, ns)
    assert client.publish_weights(tiny_model_dir_v1, transport=f"nccl://127.0.0.1:{free_port()}") == 1
    workers.many(("late1",), ("late2",))
    assert [heartbeat(client, n, "joined_from") for n in ("late1", "late2")] == ["peer:peer", "peer:peer"]
    assert [heartbeat(client, n, "version") for n in ("late1", "late2")] == ["1", "1"]
    pushes = lambda: (heartbeat(client, "peer", "shared_pushes"), heartbeat(client, "peer", "shared_joiners"))  # noqa: E731
    wait_until(lambda: pushes() == ("1", "2"), 10, f"one push to both joiners (pushes, joiners: {pushes()})")


def test_without_a_peer_that_can_share_a_joiner_loads_the_store_or_awaits_the_next_sync(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, tiny_model_dir_v1: Path, workers: StartWorker
) -> None:
    """A peer whose engine holds its weights in a process of its own does not export them (it never says `shares`):
    under `redis://` the joiner reads the store; told `--join-from peer` (no peer) or `--join-from sync`, it awaits the
    next sync though the version is stored, and the `nccl://` sync reaches it."""
    workers("remote", "--engine-process")
    client = RolloutClient(redis_server.url, ns)
    assert client.publish_weights(tiny_model_dir_v1, transport=f"redis://{ns}") == 1
    assert heartbeat(client, "remote", "shares") == "0"
    stored = workers("stored")
    assert (heartbeat(client, "stored", "joined_from"), heartbeat(client, "stored", "version")) == ("store", "1")
    assert stop_process(stored) == 0  # it could share now: out of the way

    workers("pushed-only", "--join-from", "peer", until=AWAITING_WEIGHTS)  # the only peer cannot share
    assert heartbeat(client, "pushed-only", "joined_from") == "sync"
    workers("sync-only", "--join-from", "sync", until=AWAITING_WEIGHTS)  # version 1 is stored: it waits all the same
    assert heartbeat(client, "sync-only", "joined_from") == "sync"
    assert shares_asked(client) == []  # nobody was asked
    assert client.publish_weights(tiny_model_dir, transport=f"nccl://127.0.0.1:{free_port()}") == 2
    serving = lambda: [heartbeat(client, n, "status") for n in ("pushed-only", "sync-only")] == ["serving"] * 2  # noqa: E731
    wait_until(serving, 30, "the next sync to reach both")


def test_a_peer_that_does_not_answer_in_time_leaves_the_joiner_to_the_store(
    redis_server: RedisServer, ns: str, tiny_model_dir_v1: Path, workers: StartWorker
) -> None:
    peer = workers("peer", "--share-window-s", "5")
    client = RolloutClient(redis_server.url, ns)
    assert client.publish_weights(tiny_model_dir_v1, transport=f"redis://{ns}") == 1
    late = workers.spawn("late")
    wait_until(lambda: bool(shares_asked(client)), 120, "the joiner to ask the peer")
    freeze(peer)  # inside its window: it never answers
    wait_until(lambda: heartbeat(client, "late", "status") == "serving", 60, "the joiner to give up on the peer")
    assert (heartbeat(client, "late", "joined_from"), heartbeat(client, "late", "version")) == ("store", "1")
    assert late.poll() is None
    peer.kill()  # continued, it would push to the joiner that left, and stop only after PEER_ANSWER_S (10 s)
    peer.wait(timeout=30)


def test_a_version_published_while_a_worker_joins_is_the_one_it_serves(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, tiny_model_dir_v1: Path, workers: StartWorker
) -> None:
    peer = workers("peer", "--share-window-s", "5")
    client = RolloutClient(redis_server.url, ns)
    assert client.publish_weights(tiny_model_dir_v1, transport=f"nccl://127.0.0.1:{free_port()}") == 1
    workers.spawn("late")
    wait_until(lambda: bool(shares_asked(client)), 120, "the joiner to ask the peer for version 1")
    assert shares_asked(client)[0].joiner == "late"
    # Version 2 (the seed-0 weights) while the peer gathers joiners: it reaches the peer, not the joiner (which does
    # not beat yet, so the sync does not wait for it).
    assert client.publish_weights(tiny_model_dir, transport=f"nccl://127.0.0.1:{free_port()}") == 2
    assert client.last_sync is not None and client.last_sync.acked == ["peer"]
    wait_until(lambda: heartbeat(client, "late", "status") == "serving", 60, "the joiner to serve")
    assert heartbeat(client, "late", "version") == "2"

    freeze(peer)
    ids = [client.submit(tokens=[5, 6 + i], n=2, max_tokens=20, id=f"v2-{i}") for i in range(3)]
    only_from(client, "late", ids, {2: tiny_model_dir}, 2)


def test_share_is_a_directed_control_command_in_plain_text(real_redis: redis.Redis, ns: str) -> None:
    """What a person reads with redis-cli: `cmd share worker PEER joiner NAME`; other commands carry no `joiner`."""
    from pipeline.streams import Streams

    streams = Streams(real_redis, ns)
    streams.control.send(Control(cmd="share", worker="peer", joiner="late"), ring=False)
    streams.control.send(Control(cmd="drain", worker="peer"), ring=False)
    (_, share), (_, drain) = as_entries(real_redis.xrange(Keys(ns).control))
    assert (share[b"cmd"], share[b"worker"], share[b"joiner"]) == (b"share", b"peer", b"late")
    assert b"joiner" not in drain
    streams.control.ring_one("peer", "share")  # the peer's bell rings, not the fleet's
    rung = [k for k in range(BELLS) if real_redis.xlen(Keys(ns).bell(k))]
    assert rung == [bell_index("peer")]
