"""How a worker takes work: a burst that comes while the worker waits with little room starts on the engine at once;
work read past the room waits its turn."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from consumers.engines.base import Generation
from consumers.engines.synthetic_engine import SyntheticEngine
from consumers.engines.torch_engine import TorchEngine
from consumers.engines.torch_scheduler import Request
from consumers.worker import Worker, WorkerSettings
from pipeline.codec import for_redis
from pipeline.connections import connect
from pipeline.local import RedisServer
from pipeline.streams import Streams
from pipeline.wire import Partial, Sampling
from producers.client import RolloutClient

pytestmark = pytest.mark.usefixtures("one_thread")


class CountingEngine(TorchEngine):
    """The torch engine, counting the requests each step takes in (instrumented, not replaced)."""

    admitted: list[int]

    def _admit(self, room: int) -> list[Request]:
        taken = super()._admit(room)
        if taken:
            self.admitted.append(len(taken))
        return taken


def test_a_burst_read_while_room_was_short_starts_in_one_engine_step(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path
) -> None:
    """Two prompts fill the worker (8 samples); once the short one ends its read waits for one entry (4 samples of
    room). The long one ends, then two prompts arrive together: both must reach the engine in one step, not the
    first alone and the second a step behind (out of step with it for the rest of the batch). The read blocks for
    up to 5 s, so it is still the one asked with little room when the burst comes."""
    client = RolloutClient(redis_server.url, ns)
    engine = CountingEngine(tiny_model_dir, num_threads=1)
    engine.admitted = []
    streams = Streams(connect(redis_server.url, ns=ns), ns)
    worker = Worker(streams, engine, "reader", WorkerSettings(max_inflight=8, block_ms=5000))
    stop = Sampling(max_tokens=4, seed=1, stop_token_ids=[])

    async def main() -> None:
        running = asyncio.create_task(worker.run())
        try:
            await asyncio.to_thread(client.submit, tokens=[5, 6, 7], n=4, max_tokens=4, seed=1, id="short")
            # Served first, so that the worker knows its samples a prompt.
            await asyncio.to_thread(functools.partial(client.collect, 1, timeout=120))
            long = [client.make_prompt(tokens=[5, 6, 8], n=4, sampling=stop.model_copy(update={"max_tokens": 120}))]
            short = [client.make_prompt(tokens=[5, 6, 9], n=4, sampling=stop)]
            await asyncio.to_thread(client.submit_prompts, long + short)
            await asyncio.to_thread(functools.partial(client.collect, 2, timeout=120))
            engine.admitted.clear()
            burst = [client.make_prompt(tokens=[7, 8, i], n=4, sampling=stop) for i in (10, 11)]
            await asyncio.to_thread(client.submit_prompts, burst)
            await asyncio.to_thread(functools.partial(client.collect, 2, timeout=120))
        finally:
            worker.stop()
            await asyncio.wait_for(running, 60)

    asyncio.run(main())
    assert engine.admitted[0] == 8, f"the burst entered the engine as {engine.admitted}"


class PeakEngine(SyntheticEngine):
    """The synthetic engine, keeping the most requests it ever had at once (instrumented, not replaced)."""

    active = 0
    peak = 0

    async def generate(self, *args: Any, **kwargs: Any) -> Generation:
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            return await super().generate(*args, **kwargs)
        finally:
            self.active -= 1


def test_work_read_past_the_room_waits_its_turn_and_is_served_once(redis_server: RedisServer, ns: str) -> None:
    """A worker with room for one prompt of 4 samples, whose first read finds a prompt in its inbox and one in
    `prompts` (one read takes one from each): the second waits, held, until the first is done, then is served; both
    groups arrive once."""
    client = RolloutClient(redis_server.url, ns)
    streams = Streams(connect(redis_server.url, ns=ns), ns)
    streams.ensure_groups()
    streams.work.join("holder")
    sampling = Sampling(max_tokens=32, seed=1)
    mine, shared = (client.make_prompt(tokens=[5, 6, k], n=4, sampling=sampling, id=f"p{k}") for k in (1, 2))
    streams.writer.add_to_inbox("holder", mine)
    client.submit_prompts([shared])
    engine = PeakEngine(steps_per_s=200)
    worker = Worker(streams, engine, "holder", WorkerSettings(max_inflight=4, block_ms=2000))

    async def main() -> list[str]:
        running = asyncio.create_task(worker.run())
        try:
            groups = await asyncio.to_thread(functools.partial(client.collect, 2, timeout=60))
            return sorted(f"{group.prompt_id}:{sorted(r.sample for r in group.rollouts)}" for group in groups)
        finally:
            worker.stop()
            await asyncio.wait_for(running, 60)

    assert asyncio.run(main()) == ["p1:[0, 1, 2, 3]", "p2:[0, 1, 2, 3]"]
    assert engine.peak == 4, f"{engine.peak} samples were generated at once where 4 fit"


def test_a_worker_with_partials_waiting_serves_them_before_it_takes_a_prompt(
    redis_server: RedisServer, ns: str
) -> None:
    """Partials (an abort's interrupted samples) and a prompt both queued as a worker starts, room for 4 samples: the
    worker reads partials alone until they run short, so the partials' group is whole before the prompt is taken.
    Reading them together would take the prompt beside the first partial, start it first, and finish it first."""
    client = RolloutClient(redis_server.url, ns)
    streams = Streams(connect(redis_server.url, ns=ns), ns)
    streams.ensure_groups()
    sampling = Sampling(max_tokens=24, seed=1)
    old = client.make_prompt(tokens=[5, 6, 7], n=4, sampling=sampling, id="old")
    for k in range(4):
        made, logprobs = np.arange(4, dtype=np.int32) + 10, np.full(4, -1.0, np.float32)
        partial = Partial(prompt=old, sample=k, generated=made, logprobs=logprobs, spans=[(0, 0, 4)])
        streams.redis.xadd(streams.keys.partials, for_redis(partial.to_fields()))
    client.submit_prompts([client.make_prompt(tokens=[5, 6, 8], n=4, sampling=sampling, id="new")])
    worker = Worker(streams, PeakEngine(steps_per_s=200), "drainer", WorkerSettings(max_inflight=4, block_ms=2000))

    async def main() -> list[str]:
        running = asyncio.create_task(worker.run())
        try:
            groups = await asyncio.to_thread(functools.partial(client.collect, 2, timeout=60))
            return [group.prompt_id for group in groups]
        finally:
            worker.stop()
            await asyncio.wait_for(running, 60)

    assert asyncio.run(main()) == ["old", "new"]
