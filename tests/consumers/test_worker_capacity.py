"""How much a worker takes at once, and how it continues a sample an abort cut.

A worker takes no more samples than its engine decodes at once (the engine's `max_batch`, unless `--max-inflight` says
otherwise) and no more tokens (prompt + `max_tokens` a sample) than its token budget: more would only queue inside the
engine. A sample an abort pause cut goes on with a seed of its own, so that its later tokens do not replay the random
draws of its first ones."""

from __future__ import annotations

import asyncio
import functools
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import consumers.engines.torch_scheduler as torch_scheduler
from consumers.engines.base import Generation
from consumers.engines.synthetic_engine import SyntheticEngine
from consumers.engines.torch_engine import TorchEngine
from consumers.worker import Worker, WorkerSettings
from pipeline.connections import connect
from pipeline.local import RedisServer
from pipeline.streams import Entry, Streams
from pipeline.wire import Partial, Rollout, Sampling
from producers.client import RolloutClient
from tests.engine_loop import wait_until_async
from tests.fixtures import StartWorker

LONG_SEED = 4
"""With the prompt 10..19, this seed samples hundreds of tokens without an eos under the tiny model's weights."""

# -- admission sized to the engine ------------------------------------------------------------------------------------


def test_a_worker_process_keeps_in_flight_within_its_engines_rows_and_its_token_budget(
    redis_server: RedisServer, ns: str, workers: StartWorker
) -> None:
    """A `rollouts worker` on a synthetic engine of 8 rows, without `--max-inflight`, and a budget of 120 tokens; 30
    prompts of 2 samples, short ones (3 + 8 tokens a sample) and long ones (3 + 40), far more than fits. Its heartbeat
    never shows more than 8 samples or 120 tokens in flight, it does fill them, and every sample arrives once."""
    client = RolloutClient(redis_server.url, ns)
    prompts = [
        client.make_prompt(tokens=[5, 6, 7], n=2, sampling=Sampling(max_tokens=40 if i % 3 == 0 else 8), id=f"p{i}")
        for i in range(30)
    ]
    client.submit_prompts(prompts)
    engine = ["--engine", "synthetic", "--max-batch", "8", "--engine-args", '{"steps_per_s": 50}']
    workers("w1", *engine, "--max-inflight-tokens", "120")
    seen: list[tuple[int, int]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.02):  # the poll interval of the watch, which runs until the groups are in
            beat = client.streams.registry.live_workers().get("w1", {})
            if "inflight" in beat:
                seen.append((int(beat["inflight"]), int(beat["inflight_tokens"])))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        groups = client.collect(30, timeout=120)
    finally:
        done.set()
        watcher.join(10)
    ids = [r.id for g in groups for r in g.rollouts]
    assert sorted(ids) == sorted(f"p{i}:{k}" for i in range(30) for k in range(2)), "each sample once"
    assert client.stats["duplicates"] == 0
    assert max(s for s, _ in seen) <= 8 and max(t for _, t in seen) <= 120, seen
    assert max(t for _, t in seen) > 60, f"the budget was never used: {seen}"


class PeakEngine(SyntheticEngine):
    """The synthetic engine, keeping the most samples and tokens (prompt + max_tokens) it ran at once."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.samples = self.tokens = self.peak_samples = self.peak_tokens = 0

    async def generate(
        self, request_id: str, prompt_tokens: np.ndarray, sampling: Sampling, adapter: str | None = None
    ) -> Generation:
        size = len(prompt_tokens) + sampling.max_tokens
        self.samples, self.tokens = self.samples + 1, self.tokens + size
        self.peak_samples, self.peak_tokens = max(self.peak_samples, self.samples), max(self.peak_tokens, self.tokens)
        try:
            return await super().generate(request_id, prompt_tokens, sampling, adapter)
        finally:
            self.samples, self.tokens = self.samples - 1, self.tokens - size


@pytest.mark.parametrize(
    ("settings", "samples", "tokens"),
    [
        pytest.param(WorkerSettings(), 6, None, id="the-engines-rows"),
        pytest.param(WorkerSettings(max_inflight=4), 4, None, id="max-inflight-wins"),
        pytest.param(WorkerSettings(max_inflight_tokens=50), None, 50, id="token-budget"),
    ],
)
def test_the_engine_never_runs_more_than_the_worker_may_take(
    redis_server: RedisServer, ns: str, settings: WorkerSettings, samples: int | None, tokens: int | None
) -> None:
    """An engine of 6 rows, 12 prompts of 2 samples (3 + 10 tokens each; some of 3 + 20): by default the worker fills
    exactly the engine's rows; `max_inflight` wins over them; a token budget caps prompt + max_tokens in flight."""
    client = RolloutClient(redis_server.url, ns)
    prompts = [
        client.make_prompt(tokens=[5, 6, 7], n=2, sampling=Sampling(max_tokens=20 if i % 4 == 0 else 10), id=f"p{i}")
        for i in range(12)
    ]
    client.submit_prompts(prompts)
    engine = PeakEngine(max_batch=6, steps_per_s=200)
    settings.block_ms = 200
    worker = Worker(Streams(connect(redis_server.url, ns=ns), ns), engine, "cap", settings)

    async def main() -> int:
        running = asyncio.create_task(worker.run())
        try:
            groups = await asyncio.to_thread(functools.partial(client.collect, 12, timeout=60))
            return sum(len(g.rollouts) for g in groups)
        finally:
            worker.stop()
            await asyncio.wait_for(running, 60)

    assert asyncio.run(main()) == 24
    if samples is not None:
        assert worker.max_inflight == samples and engine.peak_samples == samples
    if tokens is not None:
        assert worker.max_inflight_tokens == tokens
        assert 26 <= engine.peak_tokens <= tokens, engine.peak_tokens  # 26: one prompt's two short samples


# -- continuations draw fresh noise -----------------------------------------------------------------------------------


def test_a_sample_cut_by_an_abort_continues_with_fresh_draws_the_same_way_each_time(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, one_thread: None
) -> None:
    """A seeded sample cut by an abort pause after some tokens: the torch engine draws a request's noise from its seed
    and its token count, which a continuation (a new request) starts at 0 again. With the seed it had, the continuation
    would replay the draws of the sample's first tokens; it must draw others, and the same cut must continue the same
    way. A sample cut before its first token continues exactly as it would have run."""
    draws: list[float] = []
    plain = torch_scheduler.sampling_uniform

    def recorded(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        u = plain(seeds, steps)
        draws.extend(u.tolist())
        return u

    monkeypatch.setattr(torch_scheduler, "sampling_uniform", recorded)
    client = RolloutClient(redis_server.url, ns)
    prompt = client.make_prompt(tokens=list(range(10, 20)), n=1, sampling=Sampling(max_tokens=60, seed=LONG_SEED))
    entry = Entry(client.streams.keys.prompts, b"1-0", {})
    engine = TorchEngine(tiny_model_dir, num_threads=1, max_batch=4)
    worker = Worker(Streams(connect(redis_server.url, ns=ns), ns), engine, "seeds")

    async def generate(done: Partial | None, tag: str) -> tuple[Rollout | Partial, list[float]]:
        draws.clear()
        result = await worker._generate_rest(prompt, 0, Entry(entry.stream, tag.encode(), {}), done)
        return result, list(draws)

    def cut(rollout: Rollout, k: int) -> Partial:
        return Partial(prompt=prompt, sample=0, generated=rollout.tokens[:k], logprobs=rollout.logprobs[:k],
                       spans=[(0, 0, k)])  # fmt: skip

    async def main() -> dict[str, Any]:
        async with engine:
            whole, whole_draws = await generate(None, "whole")
            assert isinstance(whole, Rollout) and len(whole.tokens) == 60, "the tiny model stopped early"
            draws.clear()
            running = asyncio.ensure_future(generate(None, "cut"))
            await wait_until_async(lambda: len(draws) >= 15)
            await engine.pause("abort")
            partial, _ = await running
            await engine.resume()
            assert isinstance(partial, Partial) and 15 <= len(partial.generated) < 60
            first, first_draws = await generate(partial, "again-1")
            second, _ = await generate(partial, "again-2")
            unstarted, _ = await generate(cut(whole, 0), "unstarted")
            return {"whole": whole, "whole_draws": whole_draws, "partial": partial, "first": first,
                    "first_draws": first_draws, "second": second, "unstarted": unstarted}  # fmt: skip

    out = asyncio.run(main())
    k = len(out["partial"].generated)
    first, second = out["first"], out["second"]
    assert isinstance(first, Rollout) and isinstance(second, Rollout)
    assert first.tokens[:k].tolist() == out["whole"].tokens[:k].tolist(), "the tokens before the cut are kept"
    assert first.spans == [(0, 0, len(first.tokens))] and len(out["first_draws"]) == len(first.tokens) - k > 0
    replay = out["whole_draws"][: len(out["first_draws"])]
    assert not set(out["first_draws"]) & set(replay), "the continuation replayed the draws of the sample's start"
    assert first.tokens.tolist() == second.tokens.tolist(), "the same cut continues the same way"
    assert out["unstarted"].tokens.tolist() == out["whole"].tokens.tolist()
