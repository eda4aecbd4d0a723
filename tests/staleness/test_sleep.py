"""A colocated trainer's step: `RolloutClient.sleep` pauses every worker and puts its engine to sleep (its weights and
KV cache off the device), the fleet stays asleep through the step, and `publish_weights` wakes each worker before it
loads; `wake()` ends a level-1 sleep without a new version. The engine half on the torch engine in process, the
protocol with real worker processes, a real redis-server and the manager's own abandoned-sync check."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from consumers.engines.base import WAKE_ALL, Generation, SleepNotSupported, WakePart
from consumers.engines.torch_engine import TorchEngine
from consumers.worker import Worker
from pipeline.codec import as_entries
from pipeline.connections import connect
from pipeline.local import RedisServer
from pipeline.streams import Streams
from pipeline.wire import GENERATORS, Partial, PauseMode, Sampling
from producers.client import RolloutClient
from staleness.manager import Manager, SyncError, SyncReport
from staleness.weights.sources import state_dict_of
from tests.consumers.test_torch_engine import LONG_PROMPT, LONG_SEED
from tests.fixtures import StartWorker, wait_until
from tests.reference import check_spans_and_logprobs, forward_logprobs

LONG = Sampling(max_tokens=500, temperature=1.0, seed=LONG_SEED)


async def wait_for(condition: object, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def matches(model_dir: Path, gen: Generation, start: int, end: int) -> None:
    expected = forward_logprobs(model_dir, LONG_PROMPT.tolist(), gen.tokens[:end].tolist())[start:end]
    np.testing.assert_allclose(gen.logprobs[start:end], expected, atol=1e-4)


@pytest.mark.parametrize("level", [1, 2])
def test_a_sleeping_torch_engine_holds_no_weights_on_its_device_and_a_load_after_waking_serves_the_new_version(
    tiny_model_dir: Path, tiny_model_dir_v1: Path, level: int, one_thread: None
) -> None:
    v1 = state_dict_of(tiny_model_dir_v1)

    async def go() -> tuple[Generation, tuple[list[str], int]]:
        async with TorchEngine(tiny_model_dir, num_threads=1) as engine:
            request = asyncio.ensure_future(engine.generate("long", LONG_PROMPT, LONG))
            await wait_for(lambda: engine.generated_tokens >= 5)
            await engine.pause("keep")
            await engine.sleep(level)
            held = (
                sorted({p.device.type for p in engine._model.parameters()}),
                sum(p.numel() for p in engine._model.parameters()),
            )
            assert engine.asleep == level
            await engine.wake_up(("kv_cache",))  # its cache is built as it generates: nothing to take back
            assert engine.asleep == level
            await engine.wake_up(("weights",))
            await engine.load_tensors(v1, 1)
            await engine.resume()
            return await request, held

    gen, (devices, elements) = asyncio.run(go())
    assert devices == ["cpu"] and (elements > 0) == (level == 1)  # level 2: no weights at all until the wake
    (v0, s0, k), (v1_, k1, n) = gen.spans
    assert (v0, s0, v1_, k1, n) == (0, 0, 1, k, len(gen.tokens)) and 5 <= k < n
    matches(tiny_model_dir, gen, 0, k)
    matches(tiny_model_dir_v1, gen, k, n)  # a level-2 engine's fresh memory holds exactly what the load wrote


def test_a_level_1_sleep_woken_without_a_load_goes_on_with_its_own_weights(
    tiny_model_dir: Path, one_thread: None
) -> None:
    async def go() -> Generation:
        async with TorchEngine(tiny_model_dir, num_threads=1) as engine:
            request = asyncio.ensure_future(engine.generate("long", LONG_PROMPT, LONG))
            await wait_for(lambda: engine.generated_tokens >= 5)
            await engine.pause("keep")
            await engine.sleep(1)
            await engine.wake_up()
            await engine.resume()
            return await request

    gen = asyncio.run(go())
    assert gen.spans == [(0, 0, len(gen.tokens))] and len(gen.tokens) == 500
    matches(tiny_model_dir, gen, 0, len(gen.tokens))


class StagedEngine(TorchEngine):
    """The torch engine, keeping the order of its wakes, loads and resumes (instrumented, not replaced)."""

    events: list[tuple[object, ...]]

    async def wake_up(self, parts: Sequence[WakePart] = WAKE_ALL) -> None:
        self.events.append(("wake", *parts))
        await super().wake_up(parts)

    async def load_tensors(self, named_tensors: Any, version: int) -> None:
        self.events.append(("load", version, self.asleep))
        await super().load_tensors(named_tensors, version)

    async def resume(self) -> None:
        self.events.append(("resume",))
        await super().resume()


def in_process_worker(url: str, ns: str, engine: StagedEngine) -> tuple[RolloutClient, StagedEngine, Worker]:
    engine.events = []
    return RolloutClient(url, ns), engine, Worker(Streams(connect(url, ns=ns), ns), engine, "staged")


async def serve_sleep_and_publish(client: RolloutClient, worker: Worker, engine: StagedEngine, v1: Path) -> None:
    """One sample served (the engine started), a level-1 sleep the worker acks, then v1 published from memory."""
    await asyncio.to_thread(client.submit, tokens=[5, 6, 7], n=1, max_tokens=4, seed=1)
    await asyncio.to_thread(functools.partial(client.collect, 1, timeout=120))
    assert (await asyncio.to_thread(client.sleep, 1)).acked == [worker.name]
    assert engine.asleep == 1 and engine.events == []
    assert await asyncio.to_thread(client.publish_weights, state_dict_of(v1)) == 1


def test_a_sync_after_a_sleep_wakes_the_weights_before_its_load_and_the_kv_cache_at_its_resume(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, tiny_model_dir_v1: Path, one_thread: None
) -> None:
    """The load runs with the weights awake and the KV cache still asleep (vLLM's staged wake: the load's buffers and
    the cache are never in memory together); the resume wakes the rest, before the engine schedules again."""
    client, engine, worker = in_process_worker(redis_server.url, ns, StagedEngine(tiny_model_dir, num_threads=1))

    async def main() -> None:
        running = asyncio.create_task(worker.run())
        try:
            await serve_sleep_and_publish(client, worker, engine, tiny_model_dir_v1)
            await wait_for(lambda: ("resume",) in engine.events)
            await asyncio.to_thread(client.submit, tokens=[5, 6, 7], n=1, max_tokens=4, seed=2)
            (group,) = await asyncio.to_thread(functools.partial(client.collect, 1, timeout=120))
            assert group.rollouts[0].spans == [(1, 0, group.rollouts[0].n_tokens)]
        finally:
            worker.stop()
            await asyncio.wait_for(running, 60)

    asyncio.run(main())
    # The torch engine's cache is built as it generates: its weights' wake is its whole wake (asleep 0 at the load).
    assert engine.events == [("wake", "weights"), ("load", 1, 0), ("wake", "kv_cache"), ("resume",)]


class CacheWakeFails(StagedEngine):
    """The torch engine, failing to take its KV cache back (as a GPU whose memory the trainer still holds would)."""

    async def wake_up(self, parts: Sequence[WakePart] = WAKE_ALL) -> None:
        if "kv_cache" in parts:
            raise RuntimeError("CUDA out of memory")
        await super().wake_up(parts)


def test_a_worker_that_cannot_take_its_kv_cache_back_at_the_resume_stops_and_says_why(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, tiny_model_dir_v1: Path, one_thread: None
) -> None:
    """The cache's wake comes after the ack: a worker that fails it must not stay paused, holding its work."""
    client, engine, worker = in_process_worker(redis_server.url, ns, CacheWakeFails(tiny_model_dir, num_threads=1))

    async def main() -> None:
        running = asyncio.create_task(worker.run())
        await serve_sleep_and_publish(client, worker, engine, tiny_model_dir_v1)
        await asyncio.wait_for(running, 60)  # the worker's run ends: it stopped

    asyncio.run(main())
    assert worker.failure == "could not wake or resume its engine after sync 2: CUDA out of memory"
    assert ("resume",) not in engine.events


def test_a_vllm_engine_without_sleep_mode_says_how_to_start_one(tiny_model_dir: Path) -> None:
    from consumers.engines.vllm_engine import VllmEngine

    with pytest.raises(SleepNotSupported, match=r"--engine-args '\{\"enable_sleep_mode\": true\}'"):
        asyncio.run(VllmEngine(tiny_model_dir).sleep(1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM's sleep mode needs CUDA (run on the device machine)")
@pytest.mark.vllm
@pytest.mark.parametrize("level", [1, 2])
def test_a_vllm_engine_on_a_gpu_keeps_its_requests_through_a_sleep_and_loads_before_its_kv_cache_wakes(
    tiny_model_dir: Path, tiny_model_dir_v1: Path, level: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request kept by `pause("keep")` outlives vLLM's sleep (vLLM's own sleep would abort it) and goes on under the
    version loaded while the KV cache was still asleep: the cache's memory comes back only with its own wake."""
    from consumers.engines.vllm_engine import VllmEngine

    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # CUDA is initialised in this process (pytest's)
    kv_bytes = 2 * 10**9
    v1 = state_dict_of(tiny_model_dir_v1)

    def free() -> int:  # nvidia-smi's reading: CUDA initialised here would fail vLLM's forked engine process
        query = ["nvidia-smi", "-i", "0", "--query-gpu=memory.free", "--format=csv,noheader,nounits"]
        return int(subprocess.run(query, capture_output=True, text=True, check=True).stdout.split()[0]) * 2**20

    async def go() -> tuple[Generation, list[int]]:
        engine = VllmEngine(tiny_model_dir, kv_cache_bytes=kv_bytes, engine_args={"enable_sleep_mode": True})
        async with engine:
            request = asyncio.ensure_future(engine.generate("long", LONG_PROMPT, LONG))
            await wait_for(lambda: engine.generated_tokens >= 5)
            await engine.pause("keep")
            memory = [free()]
            await engine.sleep(level)
            memory.append(free())
            await engine.wake_up(("weights",))
            memory.append(free())
            await engine.load_tensors(v1, 1)
            await engine.wake_up()
            memory.append(free())
            await engine.resume()
            return await request, memory

    gen, (awake, asleep, weights_woken, woken) = asyncio.run(go())
    assert asleep - awake > 0.9 * kv_bytes and weights_woken - woken > 0.9 * kv_bytes, (awake, asleep, weights_woken)
    assert gen.finish_reason != "abort"
    n = len(gen.tokens)
    prompt, tokens = LONG_PROMPT.tolist(), gen.tokens.tolist()
    near = {
        v: np.abs(gen.logprobs - forward_logprobs(model, prompt, tokens)) < 0.02
        for v, model in ((0, tiny_model_dir), (1, tiny_model_dir_v1))
    }
    if len(gen.spans) == 2:  # vLLM's per-token weight versions (0.32)
        k = gen.spans[0][2]
        assert gen.spans == [(0, 0, k), (1, k, n)]
    else:  # vLLM 0.26 (the device's build) has none: the sample is tagged with the version it ended under
        assert gen.spans == [(1, 0, n)]
        k = int(np.argmin(near[0]))  # the first token v0's forward pass does not explain
    assert 5 <= k < n and near[0][:k].all() and near[1][k:].all(), (k, n)
    assert not near[1][:k].all()  # the first stretch is v0's, not v1's as well (the second is not v0's: k's choice)


def sleep_while_running(
    client: RolloutClient, fleet: list[subprocess.Popen[bytes]], level: int, mode: PauseMode
) -> SyncReport:
    """`client.sleep(level, mode)` with the workers' samples still running when it pauses them: the workers are frozen
    (SIGSTOP) until the sleep has begun (the tiny model writes 500 tokens in about a second); a few hundred ms, inside
    their heartbeats' TTL."""
    for process in fleet:
        os.kill(process.pid, signal.SIGSTOP)
    reports: list[SyncReport] = []
    sleeping = threading.Thread(target=lambda: reports.append(client.sleep(level, mode)))
    try:
        sleeping.start()
        asleep = str(level).encode()
        wait_until(lambda: client.streams.redis.hget(client.streams.keys.state, "asleep") == asleep, 30, "the sleep")
    finally:
        for process in fleet:
            os.kill(process.pid, signal.SIGCONT)
    sleeping.join(timeout=120)
    (report,) = reports
    return report


def test_a_fleet_sleeps_through_a_training_step_and_the_publish_after_it_wakes_and_syncs_every_worker(
    redis_server: RedisServer,
    ns: str,
    tiny_model_dir: Path,
    tiny_model_dir_v1: Path,
    workers: StartWorker,
    one_thread: None,
) -> None:
    fleet = workers.many(("w1",), ("w2",))
    client = RolloutClient(redis_server.url, ns)
    beat = lambda name: client.streams.redis.hgetall(client.streams.keys.worker(name))  # noqa: E731
    for i in range(4):
        client.submit(tokens=LONG_PROMPT, n=1, max_tokens=500, temperature=1.0, seed=LONG_SEED, id=f"long-{i}")
    wait_until(lambda: sum(int(beat(w).get(b"inflight", 0)) for w in ("w1", "w2")) == 4, 60, "the samples taken")

    with pytest.raises(ValueError, match="keeps no KV cache"):
        client.sleep(1, mode="inflight")
    report = sleep_while_running(client, fleet, 2, "abort")
    assert sorted(report.acked) == ["w1", "w2"] and report.evicted == report.awake == []
    state = client.streams.redis.hgetall(client.streams.keys.state)
    assert (state[b"paused"], state[b"asleep"], state[b"version"]) == (b"1", b"2", b"0")
    for name in ("w1", "w2"):
        assert (beat(name)[b"status"], beat(name)[b"asleep"]) == (b"asleep", b"2")
    # Asleep through the step: no token is generated, and the manager does not take the sleep for an abandoned sync.
    tokens = {name: beat(name)[b"generated_tokens"] for name in ("w1", "w2")}
    ts = {name: float(beat(name)[b"ts"]) for name in ("w1", "w2")}
    wait_until(lambda: all(float(beat(n)[b"ts"]) > ts[n] + 0.5 for n in ts), 30, "heartbeats over half a second")
    assert {name: beat(name)[b"generated_tokens"] for name in ("w1", "w2")} == tokens
    assert Manager(client.streams, ack_timeout_s=0).finish_abandoned(older_than_s=0) is None
    with pytest.raises(ValueError, match="level-2 sleep freed the weights"):
        client.wake()
    with pytest.raises(SyncError, match="already under way"):
        client.sleep(1)

    assert client.publish_weights(tiny_model_dir_v1) == 1  # wakes each worker, which loads, acks and resumes
    assert client.last_sync is not None
    assert sorted(client.last_sync.acked) == ["w1", "w2"] and client.last_sync.evicted == []
    state = client.streams.redis.hgetall(client.streams.keys.state)
    assert (state[b"paused"], state[b"asleep"], state[b"version"]) == (b"0", b"0", b"1")
    groups = client.collect(4, timeout=240)
    weights = {0: tiny_model_dir, 1: tiny_model_dir_v1}
    interrupted = 0
    for group in groups:
        (rollout,) = group.rollouts
        check_spans_and_logprobs(rollout, weights)  # each span its version's logprobs: v1's from woken memory
        interrupted += [v for v, _, _ in rollout.spans] == [0, 1]
    assert interrupted >= 1  # the sleep interrupted samples in flight, and they finished under the new version

    # A level-1 sleep may end without a new version: the workers wake and go on with the weights they kept.
    client.submit(tokens=LONG_PROMPT, n=1, max_tokens=500, temperature=1.0, seed=LONG_SEED, id="after")
    wait_until(lambda: beat("w1")[b"status"] == b"serving" and beat("w2")[b"status"] == b"serving", 30, "resumed")
    assert sorted(client.sleep(1, mode="keep").acked) == ["w1", "w2"]
    woke = client.wake()
    assert woke is not None and client.wake() is None  # a second wake finds the fleet awake
    (group,) = client.collect(1, timeout=240)
    check_spans_and_logprobs(group.rollouts[0], weights)
    assert {v for v, _, _ in group.rollouts[0].spans} == {1}


def test_a_worker_stopped_asleep_in_keep_mode_hands_its_frozen_samples_on_at_once_and_another_finishes_them(
    redis_server: RedisServer,
    ns: str,
    tiny_model_dir: Path,
    tiny_model_dir_v1: Path,
    workers: StartWorker,
    one_thread: None,
) -> None:
    """No resume reaches a stopped worker: the samples its engine holds frozen end there with their tokens so far and
    go to `{ns}:partials` with their prompts' acks at once, not after its drain timeout (30 s), and a worker that
    joins the sleeping fleet continues them after the next publish."""
    w1 = workers("w1")
    client = RolloutClient(redis_server.url, ns)
    beat = lambda name: client.streams.redis.hgetall(client.streams.keys.worker(name))  # noqa: E731
    for i in range(2):
        client.submit(tokens=LONG_PROMPT, n=1, max_tokens=500, temperature=1.0, seed=LONG_SEED, id=f"long-{i}")
    wait_until(lambda: int(beat("w1").get(b"inflight", 0)) == 2, 60, "the samples taken")
    assert sleep_while_running(client, [w1], 1, "keep").acked == ["w1"]

    stopped = time.monotonic()
    w1.send_signal(signal.SIGTERM)
    assert w1.wait(timeout=60) == 0 and time.monotonic() - stopped < 15
    keys = client.streams.keys
    partials = [Partial.from_fields(fields) for _, fields in as_entries(client.streams.redis.xrange(keys.partials))]
    assert sorted(p.prompt.id for p in partials) == ["long-0", "long-1"]
    assert all(0 < len(p.generated) < 500 and p.spans == [(0, 0, len(p.generated))] for p in partials)
    assert client.streams.redis.xpending(keys.prompts, GENERATORS)["pending"] == 0  # acked with the hand-off

    workers("w2", until="asleep")  # it joins the sleeping fleet: it sleeps too, and takes nothing until the publish
    assert beat("w2")[b"asleep"] == b"1" and client.streams.redis.xpending(keys.partials, GENERATORS)["pending"] == 0
    assert client.publish_weights(tiny_model_dir_v1) == 1
    groups = client.collect(2, timeout=240)
    assert sorted(group.prompt_id for group in groups) == ["long-0", "long-1"]
    kept = {p.prompt.id: p.generated.tolist() for p in partials}
    for group in groups:
        (rollout,) = group.rollouts
        k = len(kept[group.prompt_id])
        assert rollout.tokens[:k].tolist() == kept[group.prompt_id]  # w1's tokens, continued by w2 under v1
        assert rollout.spans == [(0, 0, k), (1, k, rollout.n_tokens)]
        check_spans_and_logprobs(rollout, {0: tiny_model_dir, 1: tiny_model_dir_v1})


@pytest.mark.vllm
def test_a_worker_whose_engine_cannot_sleep_pauses_acks_awake_and_syncs_with_the_sleeping_fleet(
    redis_server: RedisServer,
    ns: str,
    tiny_model_dir_v1: Path,
    workers: StartWorker,
    one_thread: None,
) -> None:
    """A vLLM worker started without sleep mode beside a torch worker: the sleep pauses both, the trainer's report
    names the one that stayed awake, and the publish after the step syncs and resumes both."""
    workers.many(("torch-w",), ("vllm-w", "--engine", "vllm"))
    client = RolloutClient(redis_server.url, ns)
    beat = lambda name: client.streams.redis.hgetall(client.streams.keys.worker(name))  # noqa: E731

    report = client.sleep(1)
    assert sorted(report.acked) == ["torch-w", "vllm-w"] and report.awake == ["vllm-w"] and report.evicted == []
    assert (beat("torch-w")[b"status"], beat("torch-w")[b"asleep"]) == (b"asleep", b"1")
    assert (beat("vllm-w")[b"status"], beat("vllm-w")[b"asleep"]) == (b"paused", b"0")

    assert client.publish_weights(tiny_model_dir_v1) == 1
    assert client.last_sync is not None
    assert sorted(client.last_sync.acked) == ["torch-w", "vllm-w"]
    state = client.streams.redis.hgetall(client.streams.keys.state)
    assert (state[b"paused"], state[b"asleep"]) == (b"0", b"0")
    wait_until(lambda: {beat(n)[b"status"] for n in ("torch-w", "vllm-w")} == {b"serving"}, 60, "both resumed")
    for i in range(4):
        client.submit(tokens=LONG_PROMPT, n=2, max_tokens=16, temperature=1.0, seed=i)
    groups = client.collect(4, timeout=240)
    weights = {1: tiny_model_dir_v1}
    for group in groups:
        for rollout in group.rollouts:
            check_spans_and_logprobs(rollout, weights)  # every token v1's, on both engines
