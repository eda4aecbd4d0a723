"""A worker that joins mid-run takes the current version from a peer (`consumers.peer`): real worker processes (the
torch engine on the CPU, so gloo), a real redis-server, the trainer publishing by `nccl://` (nothing stored) or
`redis://`. A vLLM worker on the CPU does not share (vLLM repacks its weights there); on a GPU (skipped elsewhere, run
on the device machine: `python -m pytest tests/consumers/test_join.py -k gpu`) a vLLM joiner takes the version from a
vLLM peer on the same GPU, from host copies."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
import torch

from consumers.engines.vllm_extension import RolloutsWorkerExtension, checkpoint_views
from consumers.peer import over_host
from consumers.sync import AWAITING_WEIGHTS
from pipeline.codec import as_entries, as_text
from pipeline.control import BELLS, bell_index
from pipeline.local import RedisServer, free_port
from pipeline.processes import stop_process
from pipeline.wire import Control, Keys
from producers.client import RolloutClient
from tests.fixtures import StartWorker, wait_until
from tests.reference import check_spans_and_logprobs

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM shares from a GPU only (run on the device)")
VLLM_ON_GPU = ("--engine", "vllm", "--kv-cache-bytes", "1000000000", "--engine-args",
               '{"gpu_memory_utilization": 0.3, "enforce_eager": true}')  # fmt: skip
"""Two vLLM workers on one GPU: each a small share of its memory (vLLM refuses to start on less free memory than its
`gpu_memory_utilization` asks) and a 1 GB KV cache."""

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
    """A peer whose engine holds its weights in a process of its own cannot push them (it never says `shares`):
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
    """What a person reads with redis-cli: `cmd share worker PEER joiner NAME`, and `joiner_gpu UUID` from a joiner
    on a GPU; a joiner without one, and other commands, carry no `joiner_gpu` (nor `joiner`)."""
    from pipeline.streams import Streams

    streams = Streams(real_redis, ns)
    streams.control.send(Control(cmd="share", worker="peer", joiner="late"), ring=False)
    streams.control.send(Control(cmd="drain", worker="peer"), ring=False)
    streams.control.send(Control(cmd="share", worker="peer", joiner="gpu1", joiner_gpu="GPU-1234"), ring=False)
    (_, share), (_, drain), (_, on_gpu) = as_entries(real_redis.xrange(Keys(ns).control))
    assert (share[b"cmd"], share[b"worker"], share[b"joiner"]) == (b"share", b"peer", b"late")
    assert b"joiner" not in drain and b"joiner_gpu" not in share and b"joiner_gpu" not in drain
    assert on_gpu[b"joiner_gpu"] == b"GPU-1234"
    assert Control.from_fields(on_gpu).joiner_gpu == "GPU-1234" and Control.from_fields(share).joiner_gpu == ""
    streams.control.ring_one("peer", "share")  # the peer's bell rings, not the fleet's
    rung = [k for k in range(BELLS) if real_redis.xlen(Keys(ns).bell(k))]
    assert rung == [bell_index("peer")]


def test_a_push_goes_from_host_copies_unless_every_rank_has_a_gpu_of_its_own() -> None:
    """NCCL puts no two ranks of a group on one GPU ("Duplicate GPU detected"), and reaches no rank without one."""
    assert not over_host("GPU-a", ["GPU-b"])
    assert not over_host("GPU-a", ["GPU-b", "GPU-c"])
    assert over_host("GPU-a", ["GPU-a"]), "a joiner on the peer's GPU"
    assert over_host("GPU-a", ["GPU-b", "GPU-b"]), "two joiners on one GPU"
    assert over_host("GPU-a", ["GPU-b", ""]), "a joiner on the CPU, or that did not say"
    assert over_host("", ["GPU-b"]), "a peer on the CPU"
    assert over_host("", [""])


def test_a_vllm_model_pushes_its_stacked_parameters_as_the_checkpoints_tensors() -> None:
    """`checkpoint_views`: q/k/v and gate/up split by their layer's `output_sizes`, a padded vocabulary cut back, a tied
    `lm_head` once; views of the parameters, not copies."""

    class Stacked(torch.nn.Module):
        def __init__(self, sizes: list[int], columns: int, bias: bool) -> None:
            super().__init__()
            self.output_sizes = sizes
            self.weight = torch.nn.Parameter(torch.arange(sum(sizes) * columns, dtype=torch.float32).view(-1, columns))
            self.bias = torch.nn.Parameter(torch.arange(sum(sizes), dtype=torch.float32)) if bias else None

    class Vocab(torch.nn.Module):
        org_vocab_size = 5

        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(8, 4))  # padded to 8 rows for the kernels

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.packed_modules_mapping = {
                "qkv_proj": ["q_proj", "k_proj", "v_proj"],
                "gate_up_proj": ["gate_proj", "up_proj"],
            }
            self.model = torch.nn.Module()
            self.model.embed_tokens = Vocab()
            layer = torch.nn.Module()
            layer.self_attn = torch.nn.Module()
            layer.self_attn.qkv_proj = Stacked([4, 2, 2], 4, bias=True)
            layer.mlp = torch.nn.Module()
            layer.mlp.gate_up_proj = Stacked([6, 6], 4, bias=False)
            self.model.layers = torch.nn.ModuleList([layer])
            self.lm_head = self.model.embed_tokens  # tied, as vLLM ties it

    model = Model()
    views = dict(checkpoint_views(model))
    assert {name: tuple(t.shape) for name, t in views.items()} == {
        "model.embed_tokens.weight": (5, 4),
        "model.layers.0.self_attn.q_proj.weight": (4, 4),
        "model.layers.0.self_attn.k_proj.weight": (2, 4),
        "model.layers.0.self_attn.v_proj.weight": (2, 4),
        "model.layers.0.self_attn.q_proj.bias": (4,),
        "model.layers.0.self_attn.k_proj.bias": (2,),
        "model.layers.0.self_attn.v_proj.bias": (2,),
        "model.layers.0.mlp.gate_proj.weight": (6, 4),
        "model.layers.0.mlp.up_proj.weight": (6, 4),
    }
    qkv = dict(model.named_modules())["model.layers.0.self_attn.qkv_proj"]
    assert isinstance(qkv, Stacked)
    assert views["model.layers.0.self_attn.k_proj.weight"].tolist() == qkv.weight[4:6].tolist()
    assert views["model.layers.0.self_attn.v_proj.bias"].tolist() == [6.0, 7.0]
    assert views["model.layers.0.self_attn.v_proj.weight"].data_ptr() == qkv.weight[6:].data_ptr(), "a view"
    qkv.output_sizes = [4, 2, 1]
    with pytest.raises(ValueError, match=r"qkv_proj.weight \[8, 4\] does not split into q_proj, k_proj, v_proj"):
        checkpoint_views(model)


def test_a_vllm_worker_process_pushes_on_a_thread_and_says_how_it_goes() -> None:
    """`rollouts_push_weights` returns at once (vLLM's engine core goes on stepping) and pushes on a thread;
    `rollouts_push_state` says when it is staged (the joiners may be told) and hands out its stats once. Here in this
    process, over gloo, a stacked model as vLLM holds it, received in checkpoint names."""
    from staleness.weights.nccl import PeerPush, drop_link, join_broadcast, receive_broadcast

    model = torch.nn.Module()
    setattr(model, "packed_modules_mapping", {"gate_up_proj": ["gate_proj", "up_proj"]})  # noqa: B010 (vLLM's)
    model.mlp = torch.nn.Module()
    model.mlp.gate_up_proj = torch.nn.Linear(3, 4, bias=False)
    model.mlp.gate_up_proj.output_sizes = [2, 2]  # type: ignore[assignment]  # as vLLM's merged layer says
    model.norm = torch.nn.LayerNorm(3)

    class Worker(RolloutsWorkerExtension):
        device = torch.device("cpu")
        rank = 0
        model_runner = SimpleNamespace(get_model=lambda: model)

    worker, push = Worker(), PeerPush("127.0.0.1", free_port(), 4, 1, 1, 20.0, on_host=True)
    assert worker.rollouts_push_weights(push.to_dict()) == 0
    with pytest.raises(RuntimeError, match="a push to joiners is under way"):
        worker.rollouts_push_weights(push.to_dict())
    wait_until(lambda: worker.rollouts_push_state()["staged"], 20, "the push to be staged")
    link = join_broadcast(push.uri, 1, version=4, timeout_s=20, member="joiner")
    try:
        got = {name: t.clone() for name, t in receive_broadcast(link)}
    finally:
        drop_link(push.uri, "joiner")
    states: list[dict[str, Any]] = []

    def ended() -> bool:
        states.append(worker.rollouts_push_state())
        return bool(states[-1]["done"])

    wait_until(ended, 20, "the push to end")
    assert states[-1]["error"] == "" and (states[-1]["stats"]["workers"], states[-1]["stats"]["backend"]) == (1, "gloo")
    weight = model.mlp.gate_up_proj.weight
    assert sorted(got) == ["mlp.gate_proj.weight", "mlp.up_proj.weight", "norm.bias", "norm.weight"]
    assert torch.equal(got["mlp.up_proj.weight"], weight[2:].detach())
    assert worker.rollouts_push_state()["error"] == "no push under way in this process"  # its result went once


@pytest.mark.long(
    "a vLLM worker on the CPU says shares 0: tests/system/test_end_to_end.py's test_every_sample_delivered_once_with_"
    "true_logprobs[vllm-installed]; a joiner beside a worker that cannot push reads the store: test_without_a_peer_..."
)
@pytest.mark.vllm
def test_a_vllm_worker_on_the_cpu_does_not_share_and_a_joiner_beside_it_reads_the_store(
    redis_server: RedisServer, ns: str, tiny_model_dir_v1: Path, workers: StartWorker
) -> None:
    """vLLM's CPU build repacks its linear weights after loading and drops `layer.weight`: its parameters are not the
    checkpoint's, so it says `shares` 0 and nobody asks it; the joiner serves the stored version."""
    workers("vllm", "--engine", "vllm", "--kv-cache-bytes", "268435456")
    client = RolloutClient(redis_server.url, ns)
    assert client.publish_weights(tiny_model_dir_v1, transport=f"redis://{ns}") == 1
    wait_until(lambda: heartbeat(client, "vllm", "version") == "1", 30, "the vLLM worker to load version 1")
    assert heartbeat(client, "vllm", "shares") == "0"
    assert "pushes no version to joiners: its parameters are not the checkpoint's values" in (
        workers.logs / "vllm.log"
    ).read_text()
    workers("late")
    assert (heartbeat(client, "late", "joined_from"), heartbeat(client, "late", "version")) == ("store", "1")
    assert shares_asked(client) == []


@GPU
@pytest.mark.vllm
def test_gpu_a_vllm_worker_joins_from_a_vllm_peer_on_the_same_gpu(
    redis_server: RedisServer, ns: str, tiny_model_dir_v1: Path, workers: StartWorker
) -> None:
    """A vLLM peer on cuda:0 holds version 1, pushed by the trainer over `nccl://` (nothing stored); a vLLM joiner on
    the same GPU takes it from the peer (from host copies over gloo: NCCL puts no two ranks on one GPU) and generates
    the peer's greedy tokens."""
    peer = workers("peer", *VLLM_ON_GPU)
    client = RolloutClient(redis_server.url, ns)
    assert client.publish_weights(tiny_model_dir_v1, transport=f"nccl://127.0.0.1:{free_port()}") == 1
    wait_until(lambda: heartbeat(client, "peer", "shares") == "1", 30, "the vLLM peer to say it shares")
    client.submit(tokens=[7, 8, 9], n=1, max_tokens=32, temperature=0.0, id="from-peer")
    (peer_rollout,) = [r for g in client.collect(1, timeout=120) for r in g.rollouts]
    assert peer_rollout.worker == "peer" and peer_rollout.spans == [(1, 0, peer_rollout.n_tokens)]

    workers("late", *VLLM_ON_GPU, "--join-from", "peer")
    assert (heartbeat(client, "late", "joined_from"), heartbeat(client, "late", "version")) == ("peer:peer", "1")
    assert shares_asked(client)[0].joiner_gpu, "the joiner said which GPU it is on"
    wait_until(lambda: heartbeat(client, "peer", "shared_pushes") == "1", 10, "the peer to count its push")
    assert "1 joined" in (workers.logs / "peer.log").read_text() and "gloo" in (workers.logs / "peer.log").read_text()

    freeze(peer)  # what comes next is the joiner's alone
    client.submit(tokens=[7, 8, 9], n=1, max_tokens=32, temperature=0.0, id="from-joiner")
    (joiner_rollout,) = [r for g in client.collect(1, timeout=120) for r in g.rollouts]
    assert joiner_rollout.worker == "late" and joiner_rollout.spans == [(1, 0, joiner_rollout.n_tokens)]
    assert joiner_rollout.tokens.tolist() == peer_rollout.tokens.tolist()
