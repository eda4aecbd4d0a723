"""LoRA adapters in the `vllm` engine against an independent reference (the base with the adapter merged in,
`merged_model_dir`, one plain transformers forward pass) and against the `torch` engine.

vLLM has no per-adapter pause: `VllmEngine` builds one (abort in vLLM, continue as a new request), so the
tests check what a caller sees: each token's span names the adapter version that made it, and each span's
logprobs are those of that version's merged model over the whole prefix. One real vLLM engine (with
`enable_lora`, `max_loras=2`) serves the module; the `engine` fixture gives each test adapters "a" and "b" at
version 1, nothing paused.

A missing or broken vLLM fails this module (the import below), it never skips it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import vllm  # noqa: F401  (not importorskip: without vLLM this module must fail)

from consumers.engines.base import EngineClosedError, EngineInputError, Generation
from consumers.engines.tiny_model import make_adapter
from consumers.engines.torch_engine import TorchEngine
from consumers.engines.vllm_engine import VllmEngine
from pipeline.wire import Sampling
from tests.engine_loop import Served, wait_until_async
from tests.reference import forward_logprobs, merged_model_dir, random_prompts

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("one_thread")]

ATOL = 1e-4
"""fp32 engine against a fresh fp32 forward pass, as the base model's parity tests."""
FAV_A = frozenset(range(100, 108))
FAV_B = frozenset(range(300, 308))
FAV_A2 = frozenset(range(200, 208))
"""Version 2 of adapter "a" favours other tokens: which version made a token shows in the tokens too."""
PROMPT = np.arange(10, 20, dtype=np.int32)
LONG = Sampling(max_tokens=400, temperature=1.0, seed=9)
"""Under either adapter no eos comes (the favoured sets exclude it): still running when paused or aborted."""


@dataclass
class Lora:
    """An adapter made for the tests, with its reference checkpoint (the base with it merged in)."""

    tensors: dict[str, torch.Tensor]
    config: dict[str, Any]
    favoured: frozenset[int]
    merged: Path


def make(base: Path, favoured: frozenset[int], seed: int, out: Path) -> Lora:
    tensors, config = make_adapter(base, sorted(favoured), seed=seed)
    return Lora(tensors, config, favoured, merged_model_dir(base, tensors, config, out))


@pytest.fixture(scope="module")
def loras(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Lora]:
    return {
        name: make(tiny_model_dir, fav, seed, tmp_path_factory.mktemp(f"merged-{name}"))
        for name, fav, seed in (("a", FAV_A, 0), ("b", FAV_B, 1), ("a2", FAV_A2, 2))
    }


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[Served]:
    served = Served(VllmEngine(tiny_model_dir, max_loras=2, kv_cache_bytes=64 << 20))
    try:
        served.run(served.engine.start(), timeout=240)
        yield served
    finally:
        served.run(served.engine.shutdown(), timeout=60)
        served.close()


@pytest.fixture
def engine(served: Served, loras: dict[str, Lora]) -> Iterator[VllmEngine]:
    """The shared engine with adapters "a" and "b" at version 1 (loaded afresh), nothing paused."""
    engine: VllmEngine = served.engine

    async def reset() -> None:
        await engine.resume()
        for name in ("a", "b"):
            await engine.resume_adapter(name)
        for name in list(engine.adapters()):
            await engine.remove_adapter(name)
        for name in ("a", "b"):
            await engine.load_adapter(name, loras[name].tensors, loras[name].config, version=1)

    served.run(reset())
    yield engine
    served.run(engine.resume())


def max_diff(lora: Lora, prompt: np.ndarray, gen: Generation, start: int = 0, end: int | None = None) -> float:
    """Largest |engine logprob - merged-model logprob| over tokens [start, end), the whole prefix as context."""
    end = len(gen.tokens) if end is None else end
    expected = forward_logprobs(lora.merged, prompt.tolist(), gen.tokens[:end].tolist())[start:end]
    return float(np.abs(gen.logprobs[start:end] - expected).max(initial=0.0))


def assert_matches(lora: Lora, prompt: np.ndarray, gen: Generation, start: int = 0, end: int | None = None) -> None:
    diff = max_diff(lora, prompt, gen, start, end)
    assert diff <= ATOL, f"logprobs differ from the merged model's by up to {diff:.2e}"


def share(tokens: np.ndarray, favoured: frozenset[int]) -> float:
    return float(np.isin(tokens, list(favoured)).mean())


def test_adapter_logprobs_match_the_merged_model_and_greedy_tokens_the_torch_engine(
    served: Served, engine: VllmEngine, loras: dict[str, Lora], tiny_model_dir: Path
) -> None:
    prompts = random_prompts([3, 11, 40])
    greedy = Sampling(max_tokens=24, temperature=0.0)

    async def with_torch() -> list[Generation]:
        async with TorchEngine(tiny_model_dir, num_threads=1) as torch_engine:
            await torch_engine.load_adapter("a", loras["a"].tensors, loras["a"].config, version=1)
            return [await torch_engine.generate(f"t{i}", p, greedy, adapter="a") for i, p in enumerate(prompts)]

    async def with_vllm() -> tuple[list[Generation], Generation]:
        gens = await asyncio.gather(*[engine.generate(f"g{i}", p, greedy, adapter="a") for i, p in enumerate(prompts)])
        sampled = await engine.generate("s", PROMPT, Sampling(max_tokens=30, temperature=1.0, seed=5), adapter="a")
        return gens, sampled

    expected = asyncio.run(with_torch())
    gens, sampled = served.run(with_vllm())
    for prompt, want, got in zip(prompts, expected, gens, strict=True):
        assert got.tokens.tolist() == want.tokens.tolist()
        assert got.spans == want.spans == [(1, 0, len(got.tokens))]
        assert_matches(loras["a"], prompt, got)
        assert share(got.tokens, FAV_A) > 0.8
    assert sampled.spans == [(1, 0, 30)] and sampled.finish_reason == "length"
    assert_matches(loras["a"], PROMPT, sampled)


def test_adapters_with_disjoint_favoured_sets_generate_their_own_tokens_in_one_batch(
    served: Served, engine: VllmEngine, loras: dict[str, Lora], tiny_model_dir: Path
) -> None:
    prompts = random_prompts([5, 9, 17], seed=3)
    sampling = Sampling(max_tokens=20, temperature=1.0, seed=1)

    async def go() -> list[tuple[str | None, np.ndarray, Generation]]:
        asked = [(adapter, p) for p in prompts for adapter in ("a", "b", None)]
        gens = await asyncio.gather(
            *[engine.generate(f"m{i}", p, sampling, adapter=adapter) for i, (adapter, p) in enumerate(asked)]
        )
        return [(adapter, p, g) for (adapter, p), g in zip(asked, gens, strict=True)]

    for adapter, prompt, gen in served.run(go()):
        if adapter is None:  # the base model, spans in the base version
            assert gen.spans == [(0, 0, len(gen.tokens))] and share(gen.tokens, FAV_A | FAV_B) < 0.3
            diff = np.abs(gen.logprobs - forward_logprobs(tiny_model_dir, prompt.tolist(), gen.tokens.tolist()))
            assert diff.max() <= ATOL
            continue
        assert gen.spans == [(1, 0, len(gen.tokens))]
        assert share(gen.tokens, loras[adapter].favoured) > 0.8
        assert_matches(loras[adapter], prompt, gen)


def test_pause_adapter_keep_reload_resume_continues_under_the_new_version(
    served: Served, engine: VllmEngine, loras: dict[str, Lora]
) -> None:
    fresh_prompt = random_prompts([6], seed=12)[0]

    async def go() -> tuple[Generation, Generation, int]:
        base = engine.generated_tokens
        kept = asyncio.ensure_future(engine.generate("kept", PROMPT, Sampling(max_tokens=150, seed=7), adapter="a"))
        await wait_until_async(lambda: engine.generated_tokens >= base + 5)
        await engine.pause_adapter("a", "keep")
        frozen = engine.generated_tokens - base
        fresh = asyncio.ensure_future(
            engine.generate("fresh", fresh_prompt, Sampling(max_tokens=20, seed=8), adapter="a")
        )
        # While "a" is paused, "b" requests run to the end; nothing of "a" moves.
        b_gens = await asyncio.gather(
            *[engine.generate(f"b{i}", PROMPT, Sampling(max_tokens=15), "b") for i in range(3)]
        )
        assert all(g.finish_reason == "length" for g in b_gens)
        assert engine.generated_tokens - base - sum(len(g.tokens) for g in b_gens) == frozen
        assert not kept.done() and not fresh.done()
        await engine.load_adapter("a", loras["a2"].tensors, loras["a2"].config, version=2)
        assert engine.adapters() == {"a": 2, "b": 1}
        await engine.resume_adapter("a")
        return await kept, await fresh, frozen

    kept, fresh, frozen = served.run(go())
    n = len(kept.tokens)
    assert kept.spans == [(1, 0, frozen), (2, frozen, n)] and 5 <= frozen < n, kept.spans
    assert kept.finish_reason in ("length", "stop")
    assert_matches(loras["a"], PROMPT, kept, 0, frozen)  # v1 for the tokens before the pause
    assert_matches(loras["a2"], PROMPT, kept, frozen, n)  # v2 over prompt + tokens so far, after it
    assert share(kept.tokens[:frozen], FAV_A) > 0.8 and share(kept.tokens[frozen:], FAV_A2) > 0.8
    assert fresh.spans == [(2, 0, len(fresh.tokens))]
    assert_matches(loras["a2"], fresh_prompt, fresh)


def test_pause_adapter_abort_returns_partial_tokens_and_global_abort_ends_kept_requests(
    served: Served, engine: VllmEngine, loras: dict[str, Lora]
) -> None:
    async def go() -> tuple[Generation, Generation, Generation, Generation]:
        base = engine.generated_tokens
        cut = asyncio.ensure_future(engine.generate("cut", PROMPT, LONG, adapter="a"))
        other = asyncio.ensure_future(engine.generate("other", PROMPT, Sampling(max_tokens=30, seed=2), "b"))
        await wait_until_async(lambda: engine.generated_tokens >= base + 3)
        await engine.pause_adapter("a", "abort")
        partial = await cut
        waiting = asyncio.ensure_future(engine.generate("waiting", PROMPT, LONG, adapter="a"))
        assert (await other).finish_reason == "length"  # "b" goes on
        assert not waiting.done()
        await engine.abort(["waiting"])  # ends a request held before it started
        never = await waiting
        await engine.resume_adapter("a")
        held = asyncio.ensure_future(engine.generate("held", PROMPT, LONG, adapter="a"))
        await wait_until_async(lambda: engine.generated_tokens >= base + len(partial.tokens) + 30 + 3)
        await engine.pause_adapter("a", "keep")
        await engine.pause("abort")  # the global abort-pause ends kept requests too
        return partial, never, await held, await other

    partial, never, held, other = served.run(go())
    assert partial.finish_reason == "abort" and 1 <= len(partial.tokens) < LONG.max_tokens
    assert partial.spans == [(1, 0, len(partial.tokens))]
    assert_matches(loras["a"], PROMPT, partial)
    assert never.finish_reason == "abort" and len(never.tokens) == 0 and never.spans == []
    assert held.finish_reason == "abort" and 3 <= len(held.tokens) < LONG.max_tokens
    assert_matches(loras["a"], PROMPT, held)
    assert_matches(loras["b"], PROMPT, other)


def test_unknown_adapters_full_slots_and_removal_rules(
    served: Served, engine: VllmEngine, loras: dict[str, Lora]
) -> None:
    a = loras["a"]

    async def go() -> Generation:
        with pytest.raises(EngineInputError, match=r"adapter 'c' is not loaded; loaded: \['a', 'b'\]"):
            await engine.generate("c", PROMPT, Sampling(), adapter="c")
        with pytest.raises(ValueError, match=r"all max_loras=2 slots hold adapters \['a', 'b'\]"):
            await engine.load_adapter("c", a.tensors, a.config, version=1)
        bad = {k: v[:, :-1] if k.endswith("lora_A.weight") else v for k, v in a.tensors.items()}
        with pytest.raises(ValueError, match="lora_A"):
            await engine.load_adapter("a", bad, a.config, version=5)
        assert engine.adapters() == {"a": 1, "b": 1}  # nothing changed
        base = engine.generated_tokens
        live = asyncio.ensure_future(engine.generate("live", PROMPT, LONG, adapter="a"))
        await wait_until_async(lambda: engine.generated_tokens >= base + 2)
        with pytest.raises(ValueError, match=r"adapter 'a' has 1 requests in flight \(\['live'\]\)"):
            await engine.remove_adapter("a")
        await engine.abort(["live"])
        assert (await live).finish_reason == "abort"
        await engine.remove_adapter("a")
        await engine.remove_adapter("never-loaded")
        # numpy arrays load as well as torch tensors; the freed slot takes a new name.
        await engine.load_adapter("c", {k: v.numpy() for k, v in a.tensors.items()}, a.config, version=3)
        assert engine.adapters() == {"b": 1, "c": 3}
        return await engine.generate("c", PROMPT, Sampling(max_tokens=8, seed=2), adapter="c")

    gen = served.run(go())
    assert gen.spans == [(3, 0, 8)]
    assert_matches(a, PROMPT, gen)


def test_an_engine_without_lora_keeps_its_args_and_refuses_adapters(tiny_model_dir: Path) -> None:
    plain = VllmEngine(tiny_model_dir, max_loras=0)
    assert plain.max_loras == 0 and not {"enable_lora", "max_loras", "max_lora_rank"} & set(plain.args)
    with pytest.raises(EngineInputError, match="serves no LoRA adapters"):
        asyncio.run(plain.generate("x", PROMPT, Sampling(), adapter="a"))
    with pytest.raises(ValueError, match="serves no adapters"):
        asyncio.run(plain.load_adapter("a", {}, {}, version=1))
    lora = VllmEngine(tiny_model_dir, max_loras=3, max_lora_rank=8)
    assert (lora.args["enable_lora"], lora.args["max_loras"], lora.args["max_lora_rank"]) == (True, 3, 8)


def test_replacing_a_running_adapter_serves_new_requests_the_new_version_and_frees_the_old_once_done(
    served: Served, engine: VllmEngine, loras: dict[str, Lora]
) -> None:
    async def go() -> tuple[Generation, Generation, set[int], tuple[int, int]]:
        old_id = engine._adapters["b"].request.lora_int_id
        base = engine.generated_tokens
        running = asyncio.ensure_future(engine.generate("r-old", PROMPT, Sampling(max_tokens=60, seed=4), "b"))
        await wait_until_async(lambda: engine.generated_tokens >= base + 3)
        await engine.load_adapter("b", loras["a2"].tensors, loras["a2"].config, version=2)
        new = await engine.generate("r-new", PROMPT, Sampling(max_tokens=10, seed=5), "b")
        during = set(await engine._llm.list_loras())
        old = await running
        return old, new, during, (old_id, engine._adapters["b"].request.lora_int_id)

    old, new, during, (old_id, new_id) = served.run(go())
    assert old.spans == [(1, 0, len(old.tokens))] and share(old.tokens, FAV_B) > 0.8
    assert_matches(loras["b"], PROMPT, old)  # all of it under the version it started with
    assert new.spans == [(2, 0, 10)] and share(new.tokens, FAV_A2) > 0.8
    assert_matches(loras["a2"], PROMPT, new)
    assert {old_id, new_id} <= during  # both versions loaded while the old one served its request
    assert old_id not in served.run(engine._llm.list_loras())  # and the old one gone once it ended


def test_shutdown_ends_kept_and_waiting_adapter_requests(served: Served, engine: VllmEngine) -> None:
    """Last in the module: it stops the shared engine (the fixture's own shutdown is then a no-op)."""

    async def go() -> None:
        base = engine.generated_tokens
        kept = asyncio.ensure_future(engine.generate("s-kept", PROMPT, LONG, adapter="a"))
        await wait_until_async(lambda: engine.generated_tokens >= base + 3)
        await engine.pause_adapter("a", "keep")
        waiting = asyncio.ensure_future(engine.generate("s-waiting", PROMPT, LONG, adapter="a"))
        await engine.shutdown()
        for request in (kept, waiting):
            with pytest.raises(EngineClosedError):
                await request
        assert not engine._live and not engine._adapter_requests and engine._lora_dir is None

    served.run(go(), timeout=60)
