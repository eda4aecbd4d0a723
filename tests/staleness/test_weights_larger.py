"""`redis://` syncs of a model that is not a toy (a few M parameters, many chunks) through a real worker process, and
the reader that takes chunks from the socket straight into the tensors' buffer (`redis_store._RawGets`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import redis

from consumers.engines.tiny_model import build_tiny_model
from pipeline.local import RedisServer
from pipeline.processes import start_worker, stop_processes, wait_for_worker
from producers.client import Group, RolloutClient
from staleness.weights import redis_store
from staleness.weights.redis_store import RedisTransport
from staleness.weights.sources import state_dict_of
from tests.fixtures import FAST, wait_until
from tests.reference import check_spans_and_logprobs
from tests.staleness.test_transports import assert_bitwise_equal
from tests.staleness.test_weight_sync import generating


@pytest.fixture(scope="module")
def small_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two random Qwen2s of hidden 256 x 4 layers (2.9M parameters, 11 MiB of float32), seeds 0 and 1."""
    root = tmp_path_factory.mktemp("small-models")
    return tuple(build_tiny_model(root / f"seed{s}", seed=s, hidden_size=256, num_layers=4) for s in (0, 1))  # type: ignore[return-value]


def test_a_redis_sync_of_a_3m_model_mid_generation_delivers_the_trainers_weights_to_a_worker_process(
    redis_server: RedisServer, ns: str, small_models: tuple[Path, Path], tmp_path: Path
) -> None:
    v0, v1 = small_models
    log = tmp_path / "worker.log"
    worker = start_worker(redis_server.url, ns, v0, "w-large", *FAST, "--log-level", "info", log_file=log)
    try:
        client = RolloutClient(redis_server.url, ns)
        wait_for_worker(client.streams.redis, ns, "w-large", worker, timeout_s=240)
        prompts = [client.submit(tokens=[5 + i, 40, 41, 42], n=2, max_tokens=120, seed=i) for i in range(6)]
        wait_until(generating(client, 3), 60, "generation to start")
        # 1 MiB chunks: 12 of them, read back by the worker in one pipelined round trip, into one buffer
        assert client.publish_weights(v1, transport="redis://", bucket_bytes=1 << 20) == 1
        assert client.last_sync is not None and client.last_sync.acked == ["w-large"]
        stored = RedisTransport(client.streams.redis, ns)
        assert stored.manifest(1)["chunks"] == 12
        assert_bitwise_equal(stored.fetch(1), state_dict_of(v1))  # what the worker read is what the trainer holds
        groups: list[Group] = client.collect(len(prompts), timeout=240)
        rollouts = [r for g in groups for r in g.rollouts]
        assert sorted(r.id for r in rollouts) == sorted(f"{p}:{k}" for p in prompts for k in range(2))
        for rollout in rollouts:  # each token's logprob is its version's model's: the worker serves v1's weights
            check_spans_and_logprobs(rollout, {0: v0, 1: v1})
        assert any(r.spans[-1][0] == 1 for r in rollouts), "some tokens were generated under the synced version"
        # the worker fetched the version before it paused: paused, it only copied it into the model
        text = " ".join(re.sub(r"\S+\.py:\d+", " ", log.read_text()).split())  # less rich's column of code lines
        assert "sync 1: fetched or joined in" in text, text[-2000:]
    finally:
        stop_processes([worker])


def test_the_raw_reader_reads_from_its_own_connection_over_resp2_and_resp3(
    real_redis: redis.Redis, ns: str, small_models: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = state_dict_of(small_models[0])
    writer = RedisTransport(real_redis, ns, chunk_bytes=300_000)
    writer.publish(weights, 4)
    opened: list[object] = []
    real_open = redis_store._RawGets.open

    def counted(client: redis.Redis) -> redis_store._RawGets | None:
        raw = real_open(client)
        opened.append(raw)
        return raw

    monkeypatch.setattr(redis_store._RawGets, "open", staticmethod(counted))
    kwargs = real_redis.connection_pool.connection_kwargs
    for protocol in (2, 3):
        client = redis.Redis(host=kwargs["host"], port=kwargs["port"], protocol=protocol)
        clients_before = len(client.client_list())
        reader = RedisTransport(client, ns, batch_bytes=1 << 20)  # 3 chunks a round trip: several round trips
        assert_bitwise_equal(reader.fetch(4), weights)
        assert opened[-1] is not None, "a plain client reads from the socket"
        assert len(client.client_list()) <= clients_before, "the reader's own connection is closed"
        client.delete(reader.keys.weights_chunk(4, 5), reader.keys.weights_chunk(4, 9))
        with pytest.raises(ValueError, match=r"2 of \d+ chunks are missing \(\[5, 9\]"):
            reader.fetch(4)
        writer.remove(4)
        writer.publish(weights, 4)
        client.close()
