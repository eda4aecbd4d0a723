"""The `torch` engine against an independent reference: plain transformers forward passes.

Every logprob the engine publishes must equal log_softmax of a fresh forward pass over
prompt + generated tokens under the weights of the token's version; batching, padding,
continuous admission, pausing and weight loads must not change a single token or logprob.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypedDict, TypeVar

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from typing_extensions import Unpack

from consumers.engines.base import EngineClosedError, EngineInputError, Generation
from consumers.engines.tiny_model import EOS
from consumers.engines.torch_engine import TorchEngine
from consumers.engines.torch_scheduler import Request
from pipeline.wire import Sampling
from tests.engine_loop import wait_until_async
from tests.reference import (
    forward_logprobs,
    kept_cache_log_softmax,
    load_model,
    random_prompts,
    recomputed_log_softmax,
)

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-4
LONG_SEED = 4
"""With `LONG_PROMPT`, this seed samples 500 tokens without an eos under the seed-0 weights."""
LONG_PROMPT = np.arange(10, 20, dtype=np.int32)


def stacked(arrays: list[np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(np.stack(arrays)).long()


T = TypeVar("T")


class EngineOptions(TypedDict, total=False):
    """The `TorchEngine` options the tests set."""

    max_batch: int
    max_model_len: int | None


def run(coro_fn: Callable[[TorchEngine], Awaitable[T]], model_dir: Path, **engine_kwargs: Unpack[EngineOptions]) -> T:
    """Run `coro_fn(engine)` on a fresh, started engine in its own event loop, then shut it down."""

    async def main() -> T:
        async with TorchEngine(model_dir, num_threads=1, **engine_kwargs) as engine:
            return await coro_fn(engine)

    return asyncio.run(main())


def assert_matches_forward(
    model_dir: Path, prompt: np.ndarray, gen: Generation, start: int = 0, end: int | None = None
) -> None:
    end = len(gen.tokens) if end is None else end
    expected = forward_logprobs(model_dir, prompt.tolist(), gen.tokens[:end].tolist())[start:end]
    np.testing.assert_allclose(gen.logprobs[start:end], expected, rtol=0, atol=ATOL)


def greedy_reference(model_dir: Path, prompt: np.ndarray, max_tokens: int, eos: int) -> list[int]:
    """Token-by-token argmax over full forward passes (no cache, no batch)."""
    model = load_model(Path(model_dir))
    ids = prompt.tolist()
    out: list[int] = []
    with torch.inference_mode():
        while len(out) < max_tokens:
            token = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
            out.append(token)
            if token == eos:
                break
    return out


# -- (a) logprobs, (b) greedy, (c) seeds -------------------------------------------------------


def test_logprobs_of_a_mixed_batch_equal_a_forward_pass(tiny_model_dir: Path) -> None:
    """Prompts of different lengths, more than `max_batch` of them: padding and admission into a running batch."""
    batch = random_prompts([1, 4, 9, 23, 57, 120, 3])
    samplings = [Sampling(max_tokens=12 + 5 * i, temperature=1.0, seed=i) for i in range(len(batch))]
    samplings[2] = Sampling(max_tokens=30, temperature=0.7, top_p=0.8, seed=2)  # logprobs stay raw

    async def go(engine: TorchEngine) -> list[Generation]:
        requests = zip(batch, samplings, strict=True)
        return await asyncio.gather(*[engine.generate(f"r{i}", p, s) for i, (p, s) in enumerate(requests)])

    gens = run(go, tiny_model_dir, max_batch=4)
    for prompt, sampling, gen in zip(batch, samplings, gens, strict=True):
        assert gen.tokens.dtype == np.int32 and gen.logprobs.dtype == np.float32
        assert len(gen.tokens) == len(gen.logprobs) > 0
        assert gen.spans == [(0, 0, len(gen.tokens))]
        if gen.finish_reason == "length":
            assert len(gen.tokens) == sampling.max_tokens
        else:
            assert gen.finish_reason == "stop" and gen.tokens[-1] == 2
        assert_matches_forward(tiny_model_dir, prompt, gen)


def test_greedy_equals_token_by_token_argmax(tiny_model_dir: Path) -> None:
    batch = random_prompts([2, 15, 40], seed=1)

    async def go(engine: TorchEngine) -> list[Generation]:
        greedy = Sampling(max_tokens=40, temperature=0.0)
        return await asyncio.gather(*[engine.generate(f"g{i}", p, greedy) for i, p in enumerate(batch)])

    for prompt, gen in zip(batch, run(go, tiny_model_dir), strict=True):
        assert gen.tokens.tolist() == greedy_reference(tiny_model_dir, prompt, 40, eos=2)
        assert_matches_forward(tiny_model_dir, prompt, gen)


def test_seeded_request_is_the_same_alone_and_in_a_batch(tiny_model_dir: Path) -> None:
    prompt = random_prompts([11], seed=2)[0]
    sampling = Sampling(max_tokens=40, temperature=1.0, top_p=0.9, seed=1234)

    async def go(engine: TorchEngine) -> tuple[Generation, Generation, Generation]:
        alone = await engine.generate("alone", prompt, sampling)
        others = [
            engine.generate(f"o{i}", p, Sampling(max_tokens=10 + 7 * i, temperature=t, seed=None if i % 2 else i))
            for i, (p, t) in enumerate(zip(random_prompts([3, 70, 25, 1], seed=3), [1.0, 0.0, 0.5, 1.0], strict=True))
        ]
        # Other rows run before and after it joins; the same seeded request must not notice.
        results = await asyncio.gather(*others[:2], engine.generate("batched", prompt, sampling), *others[2:])
        other_seed = await engine.generate("other-seed", prompt, sampling.model_copy(update={"seed": 99}))
        return alone, results[2], other_seed

    alone, batched, other_seed = run(go, tiny_model_dir, max_batch=3)
    assert alone.tokens.tolist() == batched.tokens.tolist()
    np.testing.assert_allclose(alone.logprobs, batched.logprobs, rtol=0, atol=ATOL)
    assert other_seed.tokens.tolist() != alone.tokens.tolist()  # the seed is what fixes the tokens


# -- (d) finish reasons ------------------------------------------------------------------------


def test_stop_tokens_max_tokens_and_context_end_generation(tiny_model_dir: Path) -> None:
    sampling = Sampling(max_tokens=60, temperature=1.0, seed=LONG_SEED)

    async def go(engine: TorchEngine) -> tuple[dict[str, Generation], int]:
        out = {"free": await engine.generate("free", LONG_PROMPT, sampling)}
        tokens = out["free"].tokens.tolist()
        stop_at = next(i for i in range(5, len(tokens)) if tokens[i] not in tokens[:i])
        stop = sampling.model_copy(update={"stop_token_ids": [tokens[stop_at]]})
        out["stop"] = await engine.generate("stop", LONG_PROMPT, stop)
        out["short"] = await engine.generate("short", LONG_PROMPT, sampling.model_copy(update={"max_tokens": 7}))
        return out, stop_at

    out, stop_at = run(go, tiny_model_dir)
    free = out["free"]
    assert free.finish_reason == "length" and len(free.tokens) == 60
    assert out["stop"].finish_reason == "stop"
    assert out["stop"].tokens.tolist() == free.tokens[: stop_at + 1].tolist()  # the stop token is included
    assert out["short"].finish_reason == "length" and out["short"].tokens.tolist() == free.tokens[:7].tolist()

    async def context(engine: TorchEngine) -> Generation:
        return await engine.generate("ctx", LONG_PROMPT, Sampling(max_tokens=100, temperature=1.0, seed=LONG_SEED))

    capped = run(context, tiny_model_dir, max_model_len=16)
    assert capped.finish_reason == "length" and len(capped.tokens) == 16 - len(LONG_PROMPT)


def test_the_models_eos_token_stops_generation(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A copy of the model whose eos is a token greedy decoding reaches: the engine stops there, with `stop`."""
    expected = greedy_reference(tiny_model_dir, LONG_PROMPT, 30, eos=2)
    eos_at = next(i for i in range(3, len(expected)) if expected[i] not in expected[:i])
    model_dir = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    for name in ("config.json", "generation_config.json"):
        config = json.loads((model_dir / name).read_text())
        config["eos_token_id"] = expected[eos_at]
        (model_dir / name).write_text(json.dumps(config))

    async def go(engine: TorchEngine) -> Generation:
        return await engine.generate("eos", LONG_PROMPT, Sampling(max_tokens=30, temperature=0.0))

    gen = run(go, model_dir)
    assert gen.finish_reason == "stop" and gen.tokens.tolist() == expected[: eos_at + 1]


# -- (e) bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "sampling", "message"),
    [
        (np.ones(512, dtype=np.int32), Sampling(), r"prompt has 512 tokens; the model's context is 512"),
        (np.ones(600, dtype=np.int32), Sampling(), r"at most 511 prompt tokens"),
        (np.array([], dtype=np.int32), Sampling(), r"prompt has no tokens"),
        (np.array([5, 512], dtype=np.int32), Sampling(), r"token ids must be in \[0, 512\), got \[5, 512\]"),
        (np.array([-1, 5], dtype=np.int32), Sampling(), r"token ids must be in \[0, 512\)"),
        (np.array([5, 6]), Sampling(temperature=-0.5), r"temperature must be >= 0, got -0.5"),
        (np.array([5, 6]), Sampling(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (np.array([5, 6]), Sampling(max_tokens=0), r"max_tokens must be >= 1"),
        (np.array([5, 6]), Sampling(stop_token_ids=[9999]), r"stop_token_ids \[9999\] are outside"),
        (np.array([5.0, 6.0]), Sampling(), r"integer token ids"),
        (np.array([[5, 6]]), Sampling(), r"1-D array"),
    ],
)
def test_bad_requests_raise_engine_input_error(
    tiny_model_dir: Path, tokens: np.ndarray, sampling: Sampling, message: str
) -> None:
    # Checked before the engine starts: no model load is needed to refuse a request.
    engine = TorchEngine(tiny_model_dir)
    with pytest.raises(EngineInputError, match=message):
        asyncio.run(engine.generate("bad", tokens, sampling))


def test_engine_keeps_serving_after_bad_requests(tiny_model_dir: Path) -> None:
    async def go(engine: TorchEngine) -> Generation:
        with pytest.raises(EngineInputError, match="temperature"):
            await engine.generate("bad", LONG_PROMPT, Sampling(temperature=-1))
        first = asyncio.ensure_future(engine.generate("dup", LONG_PROMPT, Sampling(max_tokens=400, seed=LONG_SEED)))
        await wait_until_async(lambda: engine.stats()["running"] == 1)
        with pytest.raises(EngineInputError, match="already in flight"):
            await engine.generate("dup", LONG_PROMPT, Sampling())
        await engine.abort(["dup"])
        assert (await first).finish_reason == "abort"
        return await engine.generate("ok", LONG_PROMPT, Sampling(max_tokens=5, seed=1))

    assert len(run(go, tiny_model_dir).tokens) > 0


# -- (f) abort, (g) pause and weight loads -----------------------------------------------------


def test_abort_returns_partial_tokens_with_true_logprobs(tiny_model_dir: Path) -> None:
    async def go(engine: TorchEngine) -> tuple[Generation, Generation]:
        long = asyncio.ensure_future(
            engine.generate("long", LONG_PROMPT, Sampling(max_tokens=500, temperature=1.0, seed=LONG_SEED))
        )
        await wait_until_async(lambda: engine.generated_tokens >= 5)
        await engine.abort(["long", "unknown-id"])
        partial = await long
        after = await engine.generate("after", LONG_PROMPT, Sampling(max_tokens=5, temperature=1.0, seed=1))
        return partial, after

    partial, after = run(go, tiny_model_dir)
    assert partial.finish_reason == "abort"
    assert 5 <= len(partial.tokens) < 500
    assert partial.spans == [(0, 0, len(partial.tokens))]
    assert_matches_forward(tiny_model_dir, LONG_PROMPT, partial)
    assert after.finish_reason == "length" and len(after.tokens) == 5


def test_pause_keep_load_weights_resume_splits_spans(tiny_model_dir: Path, tiny_model_dir_v1: Path) -> None:
    async def go(engine: TorchEngine) -> tuple[Generation, Generation, int]:
        request = asyncio.ensure_future(
            engine.generate("kept", LONG_PROMPT, Sampling(max_tokens=80, temperature=1.0, seed=LONG_SEED))
        )
        await wait_until_async(lambda: engine.generated_tokens >= 5)
        await engine.pause("keep")
        frozen = engine.generated_tokens
        await engine.load_weights(str(tiny_model_dir_v1), version=1)
        await engine.reset_prefix_cache()
        assert engine.generated_tokens == frozen and not request.done()  # nothing moved while paused
        await engine.resume()
        kept = await request
        fresh = await engine.generate("fresh", LONG_PROMPT, Sampling(max_tokens=20, temperature=1.0, seed=3))
        return kept, fresh, engine.version

    kept, fresh, version = run(go, tiny_model_dir)
    assert version == 1
    assert len(kept.spans) == 2, kept.spans
    (v0, s0, k), (v1, k1, n) = kept.spans
    assert (v0, s0, v1, k1, n) == (0, 0, 1, k, len(kept.tokens)) and 5 <= k < n
    assert kept.finish_reason in ("length", "stop")
    assert_matches_forward(tiny_model_dir, LONG_PROMPT, kept, 0, k)  # old weights for the old span
    assert_matches_forward(tiny_model_dir_v1, LONG_PROMPT, kept, k, n)  # new weights over the whole prefix
    assert fresh.spans == [(1, 0, len(fresh.tokens))]
    assert_matches_forward(tiny_model_dir_v1, LONG_PROMPT, fresh)


def test_pause_inflight_load_resume_splits_spans_and_keeps_the_kv_cache(
    tiny_model_dir: Path, tiny_model_dir_v1: Path
) -> None:
    """`inflight`: the sample goes on over the cache v0 wrote; its tokens after the load are sampled by v1 over it.

    Span 0 equals a forward pass of v0; span 1 equals a pass where v0 ran the prompt and the tokens before the
    swap and v1 ran the rest over v0's keys and values (`kept_cache_log_softmax`, no engine code); and it is not
    what a full v1 recompute gives (the off-policyness the mode costs, printed)."""

    async def go(engine: TorchEngine) -> tuple[Generation, int, dict[str, int], dict[str, int]]:
        request = asyncio.ensure_future(
            engine.generate("inflight", LONG_PROMPT, Sampling(max_tokens=80, temperature=1.0, seed=LONG_SEED))
        )
        await wait_until_async(lambda: engine.generated_tokens >= 5)
        await engine.pause("inflight")
        frozen = engine.generated_tokens
        await engine.load_weights(str(tiny_model_dir_v1), version=1)
        assert engine.generated_tokens == frozen and not request.done()  # nothing moved while paused
        before = engine.stats()
        await engine.resume()
        return await request, frozen, before, engine.stats()

    kept, frozen, before, after = run(go, tiny_model_dir)
    assert len(kept.spans) == 2, kept.spans
    (v0, s0, k), (v1, k1, n) = kept.spans
    assert (v0, s0, v1, k1, n) == (0, 0, 1, k, len(kept.tokens)) and k == frozen and 5 <= k < n
    assert_matches_forward(tiny_model_dir, LONG_PROMPT, kept, 0, k)  # exactly a forward pass of v0
    prompt, tokens = LONG_PROMPT.tolist(), kept.tokens.tolist()
    index = torch.tensor(tokens)[:, None]
    weights = {0: tiny_model_dir, 1: tiny_model_dir_v1}
    mixed = kept_cache_log_softmax(weights, prompt, tokens, kept.spans)
    np.testing.assert_allclose(kept.logprobs, mixed.gather(1, index)[:, 0].numpy(), rtol=0, atol=ATOL)
    # Against a full recompute under v1 (what `keep` would have sampled from): the price of keeping the cache.
    recomputed = recomputed_log_softmax(tiny_model_dir_v1, prompt, tokens)
    gap = np.abs(kept.logprobs[k:] - recomputed.gather(1, index)[k:, 0].numpy())
    kl = (mixed[k:].exp() * (mixed[k:] - recomputed[k:])).sum(-1)
    assert gap.max() > 100 * ATOL  # the reference tells the two apart: span 1 is not a v1 recompute
    assert after["recomputed_tokens"] == before["recomputed_tokens"] == 0
    assert after["prefill_tokens"] == len(prompt)  # the prompt, once: the sync prefilled nothing again
    print(
        f"inflight: spans {kept.spans}; span 1 vs a full v1 recompute: sampled-token logprob |diff| max "
        f"{gap.max():.3f} mean {gap.mean():.3f}, KL(inflight || recompute) mean {kl.mean():.4f} max {kl.max():.4f} nats"
    )


def test_an_inflight_sync_prefills_nothing_again_and_a_keep_sync_recomputes_every_running_row(
    tiny_model_dir: Path, tiny_model_dir_v1: Path
) -> None:
    """Three running rows through an `inflight` sync, then a `keep` sync: the engine's prefill counters show the
    first recomputed nothing and the second ran each row's prompt and tokens so far again."""
    prompts = random_prompts([7, 12, 9], seed=4)  # with LONG_SEED, 120 tokens each under v0 (no eos)

    async def go(engine: TorchEngine) -> tuple[list[Generation], dict[str, int], dict[str, int]]:
        sampling = Sampling(max_tokens=120, temperature=1.0, seed=LONG_SEED)
        tasks = [asyncio.ensure_future(engine.generate(f"r{i}", p, sampling)) for i, p in enumerate(prompts)]
        await wait_until_async(lambda: engine.generated_tokens >= 3 * 5)
        await engine.pause("inflight")
        await engine.load_weights(str(tiny_model_dir_v1), version=1)
        await engine.resume()
        resumed = engine.generated_tokens
        await wait_until_async(lambda: engine.generated_tokens >= resumed + 3 * 5 or all(t.done() for t in tasks))
        after_inflight = engine.stats()
        await engine.pause("keep")
        await engine.load_weights(str(tiny_model_dir), version=2)
        await engine.resume()
        return list(await asyncio.gather(*tasks)), after_inflight, engine.stats()

    gens, after_inflight, end = run(go, tiny_model_dir)
    prompt_tokens = sum(len(p) for p in prompts)
    assert after_inflight["recomputed_tokens"] == 0 and after_inflight["prefill_tokens"] == prompt_tokens
    # The keep sync recomputed every row still running then: its prompt and its tokens before the v2 span.
    running = [len(p) + spans[-1][1] for p, g in zip(prompts, gens, strict=True) if (spans := g.spans)[-1][0] == 2]
    assert running, [g.spans for g in gens]
    assert end["recomputed_tokens"] == sum(running)
    assert end["prefill_tokens"] == prompt_tokens + sum(running)
    for p, g in zip(prompts, gens, strict=True):
        assert [v for v, _, _ in g.spans][:2] == [0, 1]
        tokens = g.tokens.tolist()
        index = torch.tensor(tokens)[:, None]
        k2 = g.spans[2][1] if len(g.spans) == 3 else len(tokens)
        mixed = kept_cache_log_softmax({0: tiny_model_dir, 1: tiny_model_dir_v1}, p.tolist(), tokens[:k2], g.spans[:2])
        np.testing.assert_allclose(g.logprobs[:k2], mixed.gather(1, index[:k2])[:, 0].numpy(), rtol=0, atol=ATOL)
        assert_matches_forward(tiny_model_dir, p, g, k2)  # after keep: v2 (the seed-0 weights) over everything


def test_pause_abort_ends_running_and_queued_requests(tiny_model_dir: Path) -> None:
    async def go(engine: TorchEngine) -> tuple[list[Generation], Generation]:
        sampling = Sampling(max_tokens=500, temperature=1.0, seed=LONG_SEED)
        tasks = [asyncio.ensure_future(engine.generate(f"p{i}", LONG_PROMPT, sampling)) for i in range(3)]
        await wait_until_async(lambda: engine.generated_tokens >= 4)  # two rows run, the third waits (max_batch=2)
        await engine.pause("abort")
        ended = await asyncio.gather(*tasks)
        waiting = asyncio.ensure_future(engine.generate("later", LONG_PROMPT, Sampling(max_tokens=3, seed=1)))
        await wait_until_async(lambda: engine.stats()["waiting"] == 1)  # queued: it must wait for resume
        assert not waiting.done()
        await engine.resume()
        return ended, await waiting

    ended, later = run(go, tiny_model_dir, max_batch=2)
    assert [g.finish_reason for g in ended] == ["abort"] * 3
    assert len(ended[0].tokens) >= 2 and len(ended[2].tokens) == 0 and ended[2].spans == []
    for gen in ended[:2]:
        assert_matches_forward(tiny_model_dir, LONG_PROMPT, gen)
    assert len(later.tokens) == 3


class AdmittingEngine(TorchEngine):
    """The torch engine, keeping the ids of the requests in the order they got rows (instrumented, not replaced)."""

    admitted: list[str]

    def _admit(self, room: int) -> list[Request]:
        taken = super()._admit(room)
        self.admitted.extend(r.id for r in taken)
        return taken


def test_after_an_abort_pause_the_samples_that_had_rows_get_rows_first(tiny_model_dir: Path) -> None:
    """Two rows, five requests: p0 and p1 run, p2-p4 wait. An abort pause ends all five; a caller that continues
    each after the resume in the order they ended (the worker does) must give p0 and p1 rows before the three that
    never started, which follow in their order. (Ended waiting-first, the running ones queued behind them.)"""

    async def go(engine: AdmittingEngine) -> tuple[list[str], list[str]]:
        sampling = Sampling(max_tokens=500, temperature=1.0, seed=LONG_SEED)
        ended: list[str] = []
        resumed = asyncio.Event()

        async def sample(request_id: str) -> Generation:
            cut = await engine.generate(request_id, LONG_PROMPT, sampling)
            ended.append(request_id)
            await resumed.wait()  # as the worker: continue it after the resume, prompt + its tokens so far
            rest = sampling.model_copy(update={"max_tokens": 3})
            return await engine.generate(f"{request_id}+", np.concatenate([LONG_PROMPT, cut.tokens]), rest)

        tasks = [asyncio.ensure_future(sample(f"p{i}")) for i in range(5)]
        await wait_until_async(lambda: engine.generated_tokens >= 4)  # p0 and p1 have rows (max_batch=2)
        await engine.pause("abort")
        await wait_until_async(lambda: len(ended) == 5)
        engine.admitted = []
        await engine.resume()
        resumed.set()
        await asyncio.gather(*tasks)
        return ended, engine.admitted

    async def main() -> tuple[list[str], list[str]]:
        async with AdmittingEngine(tiny_model_dir, num_threads=1, max_batch=2) as engine:
            engine.admitted = []
            return await go(engine)

    ended, admitted = asyncio.run(main())
    assert ended == ["p0", "p1", "p2", "p3", "p4"]
    assert admitted == ["p0+", "p1+", "p2+", "p3+", "p4+"]


def test_bad_checkpoint_is_refused_and_old_weights_keep_serving(tiny_model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"lm_head.weight": torch.zeros(3, 3)}, str(tmp_path / "model.safetensors"))

    async def go(engine: TorchEngine) -> Generation:
        with pytest.raises(ValueError, match="does not fit the model"):
            await engine.load_weights(str(tmp_path), version=7)
        with pytest.raises(FileNotFoundError):
            await engine.load_weights(str(tmp_path / "nowhere"), version=7)
        assert engine.version == 0
        return await engine.generate("ok", LONG_PROMPT, Sampling(max_tokens=10, seed=1))

    gen = run(go, tiny_model_dir)
    assert gen.spans == [(0, 0, len(gen.tokens))]
    assert_matches_forward(tiny_model_dir, LONG_PROMPT, gen)


def test_shutdown_fails_pending_requests_and_cancel_frees_the_row(tiny_model_dir: Path) -> None:
    async def go() -> None:
        engine = TorchEngine(tiny_model_dir, num_threads=1, max_batch=1)
        await engine.start()
        sampling = Sampling(max_tokens=500, temperature=1.0, seed=LONG_SEED)
        cancelled = asyncio.ensure_future(engine.generate("cancelled", LONG_PROMPT, sampling))
        await wait_until_async(lambda: engine.stats()["running"] == 1)
        cancelled.cancel()
        # The only row is freed for the next request.
        assert len((await engine.generate("next", LONG_PROMPT, Sampling(max_tokens=3, seed=1))).tokens) == 3
        pending = asyncio.ensure_future(engine.generate("pending", LONG_PROMPT, sampling))
        await wait_until_async(lambda: engine.stats()["running"] == 1)
        await engine.shutdown()
        with pytest.raises(EngineClosedError):
            await pending
        with pytest.raises(EngineClosedError):
            await engine.generate("late", LONG_PROMPT, sampling)

    asyncio.run(go())


# -- (h) the tiny model ------------------------------------------------------------------------


def test_tiny_model_is_peaked_and_seeds_give_different_weights(tiny_model_dir: Path, tiny_model_dir_v1: Path) -> None:
    m0 = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    m1 = AutoModelForCausalLM.from_pretrained(tiny_model_dir_v1)
    ids = stacked(random_prompts([48, 48, 48, 48], seed=4))
    with torch.inference_mode():
        logp0 = m0(ids).logits.log_softmax(-1)
        logp1 = m1(ids).logits.log_softmax(-1)
    vocab = m0.config.vocab_size
    entropy = -(logp0.exp() * logp0).sum(-1)
    assert entropy.mean() < math.log(vocab) - 1.5, f"entropy {entropy.mean():.2f} vs log(V) {math.log(vocab):.2f}"
    assert (logp0 - logp1).abs().mean() > 0.5
    assert (logp0.argmax(-1) != logp1.argmax(-1)).float().mean() > 0.5
    assert 100_000 < sum(p.numel() for p in m0.parameters()) < 1_000_000
    assert m0.config.hidden_size // m0.config.num_attention_heads == 32  # a head size vLLM's CPU attention takes

    # One tokenizer for every seed, consistent with the model, with a chat template.
    assert (tiny_model_dir / "tokenizer.json").read_bytes() == (tiny_model_dir_v1 / "tokenizer.json").read_bytes()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(tokenizer) == vocab and tokenizer.eos_token == EOS
    assert tokenizer.eos_token_id == m0.config.eos_token_id == m0.generation_config.eos_token_id
    text = "What is 12 + 30? The answer is 42."
    assert tokenizer.decode(tokenizer(text).input_ids) == text
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    # decode reads the BatchEncoding (a UserDict, not a dict) that apply_chat_template returns, though transformers
    # types its argument without one, and types its result str | list[str] (a list for a batch).
    decoded = tokenizer.decode(chat["input_ids"] if isinstance(chat, dict) else chat)  # type: ignore[arg-type]  # above
    assert decoded.endswith("<|assistant|>")  # type: ignore[union-attr]  # one sequence: a str

    # What vLLM reads from config.json.
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["dtype"] == config["torch_dtype"] == "float32"
    assert config["tie_word_embeddings"] is False and config["eos_token_id"] == tokenizer.eos_token_id
