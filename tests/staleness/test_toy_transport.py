"""A weight transport added in one file and one registry line (`register_transport`, below): `toy://NS` keeps each
version as CPU tensors in this process's memory, which the trainer and an in-process worker share. Nothing else
names it: `RolloutClient.publish_weights` opens it from its uri, the worker's sync asks its capabilities (stored,
fetched ahead) and loads what it fetches, and a worker that starts late loads the current version from it.

Real redis-server, real `Worker` and torch engine in this process, real `SyncDriver`: the version is loaded, the
generation after the sync is tagged with it and its logprobs are its forward pass's."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import torch

from consumers.engines.torch_engine import TorchEngine
from consumers.settings import WorkerSettings
from consumers.worker import Worker
from pipeline.connections import connect
from pipeline.local import RedisServer
from pipeline.streams import Streams
from pipeline.wire import PauseMode
from producers.client import RolloutClient
from staleness.weights import transport_of
from staleness.weights.base import (
    Fetched,
    Opening,
    PublishStats,
    Transport,
    WeightsUri,
    register_transport,
    release_older,
)
from staleness.weights.sources import WeightSource, named_tensors
from tests.reference import forward_logprobs

events: list[tuple[Any, ...]] = []
"""What the toy's worker side and the engine did, in order: `("fetch", v)`, `("pause", mode)`, `("load", v)`."""
_HELD: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
"""The toy's versions, by (namespace, version): this process's memory."""


class ToyTransport(Transport):
    """`toy://NS`: each version a dict of CPU tensors in this process (both sides: `publish` keeps a copy,
    `fetch_stored` hands it over). Stored, and fetched before the pause; no adapters."""

    scheme = "toy"
    fetches_ahead = True
    carries_adapters = False

    def __init__(self, ns: str) -> None:
        self.ns = ns
        self.last_publish: PublishStats | None = None

    @classmethod
    def open(cls, spec: str, parsed: WeightsUri, opening: Opening) -> ToyTransport:
        return cls(opening.namespace(spec, parsed)[1])

    def publish(self, tensors: WeightSource, version: int, *, adapter_config: Mapping[str, Any] | None = None) -> str:
        if (self.ns, version) in _HELD:
            raise FileExistsError(f"toy version {version} exists")
        stats = PublishStats()
        held = {}
        for name, tensor in named_tensors(tensors):
            held[name] = tensor.clone()
            stats.tensors += 1
            stats.bytes += tensor.nbytes
        _HELD[(self.ns, version)] = held
        self.last_publish = stats
        return str(WeightsUri("toy", self.ns, version))

    def stored(self) -> set[int]:
        return {version for ns, version in _HELD if ns == self.ns}

    def versions(self) -> list[int]:
        return sorted(self.stored())

    def remove(self, version: int) -> bool:
        return _HELD.pop((self.ns, version), None) is not None

    def release(self, keep: Iterable[int]) -> list[int]:
        return release_older(self, keep)

    @classmethod
    def fetch_stored(cls, uri: WeightsUri, version: int, redis_client: redis.Redis | None) -> Fetched:
        events.append(("fetch", version))
        held = _HELD.get((uri.location, version))
        if held is None:
            raise FileNotFoundError(f"toy version {version} is not held here")
        return dict(held)


register_transport(ToyTransport)


class RecordedEngine(TorchEngine):
    """The torch engine, noting its pauses and loads in `events` (instrumented, not replaced)."""

    async def pause(self, mode: PauseMode) -> None:
        events.append(("pause", mode))
        await super().pause(mode)

    async def load_tensors(self, named_tensors: Any, version: int) -> None:
        events.append(("load", version))
        await super().load_tensors(named_tensors, version)


async def wait_for(condition: Any, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def one_sample(client: RolloutClient, seed: int) -> Any:
    """One prompt through the fleet; its rollout."""
    await asyncio.to_thread(client.submit, tokens=[5, 6, 7], n=1, max_tokens=6, seed=seed)
    (group,) = await asyncio.to_thread(functools.partial(client.collect, 1, timeout=120))
    return group.rollouts[0]


def of_version(model_dir: Path, rollout: Any, version: int) -> None:
    """Every token of `rollout` is `version`'s, with its forward pass's logprobs."""
    assert rollout.spans == [(version, 0, rollout.n_tokens)]
    expected = forward_logprobs(model_dir, [5, 6, 7], rollout.tokens.tolist())
    np.testing.assert_allclose(rollout.logprobs, expected, atol=1e-4)


def test_the_registry_finds_the_toy_by_its_scheme() -> None:
    assert transport_of("toy://exp1/v3") is ToyTransport
    assert str(WeightsUri("toy", "exp1", 3)) == "toy://exp1/v3"
    assert (ToyTransport.stores, ToyTransport.fetches_ahead, ToyTransport.pushes) == (True, True, False)
    with pytest.raises(ValueError, match=r"toy:// is the transport .*ToyTransport's already"):
        register_transport(type("Other", (ToyTransport,), {}))


@pytest.mark.parametrize("ahead", [True, False], ids=["fetched-ahead", "fetched-paused"])
def test_a_transport_added_in_one_file_syncs_a_worker_and_serves_one_that_starts_late(
    redis_server: RedisServer,
    ns: str,
    tiny_model_dir: Path,
    tiny_model_dir_v1: Path,
    ahead: bool,
    monkeypatch: pytest.MonkeyPatch,
    one_thread: None,
) -> None:
    """Version 1 published by `toy://` reaches the in-process worker, which fetches it before its pause when the
    transport fetches ahead, after it when not (the capability, not the scheme, decides), and serves it; a worker
    started after the sync (told to join from the store) loads version 1 from the toy before it takes work; the
    publish of version 2 releases version 1 from the toy's store."""
    monkeypatch.setattr(ToyTransport, "fetches_ahead", ahead)
    events.clear()
    v1 = {name: tensor.clone() for name, tensor in named_tensors(tiny_model_dir_v1)}
    client = RolloutClient(redis_server.url, ns)
    first = Worker(Streams(connect(redis_server.url, ns=ns), ns), RecordedEngine(tiny_model_dir, num_threads=1), "t1")

    async def main() -> None:
        running = asyncio.create_task(first.run())
        late: Worker | None = None
        late_run: asyncio.Task[None] | None = None
        try:
            of_version(tiny_model_dir, await one_sample(client, 1), 0)  # the engine started, at version 0
            events.clear()
            assert await asyncio.to_thread(client.publish_weights, v1, transport="toy://") == 1
            assert client.last_sync is not None and client.last_sync.acked == ["t1"]
            assert client.last_publish is not None and client.last_publish.tensors == len(v1)
            assert client.last_broadcast is None  # the toy pushes nothing
            fetch, pause, load = ("fetch", 1), ("pause", "abort"), ("load", 1)
            assert events == ([fetch, pause, load] if ahead else [pause, fetch, load])
            assert first.engine.version == 1 and ToyTransport(ns).versions() == [1]
            rollout = await one_sample(client, 2)
            assert rollout.worker == "t1"
            of_version(tiny_model_dir_v1, rollout, 1)

            events.clear()  # a worker that starts now, told to take its version from the toy's store, not a peer
            late_engine = RecordedEngine(tiny_model_dir, num_threads=1)
            from_store = WorkerSettings(join_from="store")
            late = Worker(Streams(connect(redis_server.url, ns=ns), ns), late_engine, "t2", from_store)
            late_run = asyncio.create_task(late.run())
            await wait_for(lambda: late_engine.version == 1 and late.state.serving.is_set())
            assert events == [("fetch", 1), ("load", 1)]
            first.stop()
            await asyncio.wait_for(running, 60)
            rollout = await one_sample(client, 3)
            assert rollout.worker == "t2"
            of_version(tiny_model_dir_v1, rollout, 1)

            assert await asyncio.to_thread(client.publish_weights, tiny_model_dir, transport="toy://") == 2
            assert client.last_sync is not None and client.last_sync.acked == ["t2"]
            assert ToyTransport(ns).versions() == [2]  # every live worker left version 1: released
            of_version(tiny_model_dir, await one_sample(client, 4), 2)
        finally:
            first.stop()
            if late is not None and late_run is not None:
                late.stop()
                await asyncio.wait_for(late_run, 60)
            await asyncio.wait_for(running, 60)

    asyncio.run(main())


def test_the_gateway_asks_whether_a_transport_takes_host_tensors_not_which_scheme_it_is() -> None:
    """Weights sent to the gateway over HTTP sit in host memory: every transport that publishes from there takes them
    (`Transport.from_host`), the GPU-only `ipc://` and an unknown scheme do not."""
    from staleness.weights.base import takes_host_tensors

    assert [takes_host_tensors(u) for u in ("redis://", "fs:///tmp/w", "nccl://h:1", "ipc://", "s3://b")] == [
        True, True, True, False, False
    ]  # fmt: skip
