"""The `vllm` engine against the `torch` engine and an independent reference (plain transformers forward passes).

One real vLLM engine (its own processes) serves the whole module: it takes ~20-40 s to start on a
2-core machine, so it is the session's (`vllm_served`, shared with test_transports). It runs on an
event loop in a thread of its own, so its output handler keeps going between the calls of a test.
Tests that change the weights leave it at another version; the `engine` fixture loads the seed-0
weights back as version 0 before each test.

A missing or broken vLLM fails this module (the import below), it never skips it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
import vllm  # noqa: F401  (not importorskip: without vLLM this module must fail)

from consumers.engines import create_engine
from consumers.engines.base import EngineClosedError, EngineInputError, Generation
from consumers.engines.tiny_model import EOS, SPECIAL_TOKENS
from consumers.engines.torch_engine import TorchEngine
from consumers.engines.vllm_engine import VllmEngine
from pipeline.wire import Sampling
from tests.engine_loop import Served, wait_until_async
from tests.reference import forward_logprobs, kept_cache_log_softmax, random_prompts

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("one_thread")]

ATOL = 1e-4
EOS_ID = SPECIAL_TOKENS.index(EOS)
"""The tiny model's eos token id (its config's `eos_token_id`)."""
LONG_PROMPT = np.arange(10, 20, dtype=np.int32)
LONG_SEED = 0
"""With `LONG_PROMPT` under the seed-0 weights, vLLM samples 480 tokens from this seed without an eos
(`test_greedy_parity_with_the_torch_engine` checks it), so such a request is still running when aborted."""
EOS_PROMPT = np.array(
    [328, 264, 142, 161, 26, 44, 14, 94, 417, 334, 467, 260, 312, 497, 375, 325, 281,
     289, 479, 146, 418, 345, 7, 205, 439, 286, 22, 393, 375, 434, 94, 51, 442, 17],
    dtype=np.int32,
)  # fmt: skip
"""Greedy decoding from this prompt reaches the eos token after 5 tokens (seed-0 weights)."""


def children() -> dict[int, str]:
    """Live child processes of this one, with their command lines (multiprocessing's resource tracker left out)."""
    found = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(proc.cmdline()) or proc.name()
        except psutil.Error:
            continue
        if "resource_tracker" not in cmdline:
            found[proc.pid] = cmdline
    return found


@pytest.fixture(scope="module")
def served(vllm_served: Served) -> Served:
    """The session's shared `VllmEngine(tiny_model_dir)` (tests/fixtures.py: test_transports uses it too)."""
    return vllm_served


@pytest.fixture
def engine(served: Served, tiny_model_dir: Path) -> Iterator[VllmEngine]:
    """The shared engine, serving the seed-0 weights as version 0, not paused."""
    engine = served.engine
    if engine.version != 0:
        served.run(engine.load_weights(str(tiny_model_dir), version=0))
    yield engine
    if engine._llm is not None:
        served.run(engine.resume())


def max_forward_diff(model_dir: Path, prompt: np.ndarray, gen: Generation, start: int = 0, end=None) -> float:
    """Largest |engine logprob - forward-pass logprob| over tokens [start, end) (whole prefix as context)."""
    end = len(gen.tokens) if end is None else end
    expected = forward_logprobs(model_dir, prompt.tolist(), gen.tokens[:end].tolist())[start:end]
    return float(np.abs(gen.logprobs[start:end] - expected).max(initial=0.0))


def assert_matches_forward(model_dir: Path, prompt: np.ndarray, gen: Generation, start: int = 0, end=None) -> float:
    diff = max_forward_diff(model_dir, prompt, gen, start, end)
    assert diff <= ATOL, f"logprobs differ from a forward pass by up to {diff:.2e}"
    return diff


# -- before start ------------------------------------------------------------------------------


def test_limits_are_known_before_start_and_create_engine_builds_it(tiny_model_dir: Path) -> None:
    engine = create_engine("vllm", str(tiny_model_dir), max_model_len=100, seed=None, engine_args={"max_num_seqs": 8})
    assert isinstance(engine, VllmEngine)
    assert (engine.name, engine.version, engine.max_model_len, engine.vocab_size) == ("vllm", 0, 100, 512)
    assert engine.args["max_num_seqs"] == 8 and engine.args["kv_cache_memory_bytes"] == 256 << 20
    assert VllmEngine(tiny_model_dir).max_model_len == 512


@pytest.mark.parametrize(
    ("tokens", "sampling", "message"),
    [
        (np.ones(512, dtype=np.int32), Sampling(), r"prompt has 512 tokens; the model's context is 512"),
        (np.array([], dtype=np.int32), Sampling(), r"prompt has no tokens"),
        (np.array([5, 512], dtype=np.int32), Sampling(), r"token ids must be in \[0, 512\), got \[5, 512\]"),
        (np.array([5, 6]), Sampling(temperature=-0.5), r"temperature must be >= 0, got -0.5"),
        (np.array([5, 6]), Sampling(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (np.array([5, 6]), Sampling(max_tokens=0), r"max_tokens must be >= 1"),
        (np.array([5, 6]), Sampling(stop_token_ids=[9999]), r"stop_token_ids \[9999\] are outside"),
        (np.array([5, 6]), Sampling(temperature=2.5), r"temperature must be in \[0, 2\], got 2.5"),  # vLLM's own
        (np.array([5.0, 6.0]), Sampling(), r"integer token ids"),
    ],
)
def test_bad_requests_raise_engine_input_error_before_start(
    tiny_model_dir: Path, tokens: np.ndarray, sampling: Sampling, message: str
) -> None:
    engine = VllmEngine(tiny_model_dir)  # never started: no vLLM process is needed to refuse a request
    with pytest.raises(EngineInputError, match=message):
        asyncio.run(engine.generate("bad", tokens, sampling))
    assert engine._llm is None


# -- (a) parity with the torch engine, eos, stop tokens, context -------------------------------


def test_greedy_parity_with_the_torch_engine(served: Served, engine: VllmEngine, tiny_model_dir: Path) -> None:
    batch = [*random_prompts([1, 4, 9, 23, 57, 120, 3]), EOS_PROMPT]
    greedy = Sampling(max_tokens=40, temperature=0.0)

    async def with_torch() -> list[Generation]:
        async with TorchEngine(tiny_model_dir, num_threads=1) as torch_engine:
            return await asyncio.gather(*[torch_engine.generate(f"t{i}", p, greedy) for i, p in enumerate(batch)])

    async def with_vllm() -> tuple[list[Generation], Generation]:
        gens = await asyncio.gather(*[engine.generate(f"a{i}", p, greedy) for i, p in enumerate(batch)])
        long = await engine.generate("a-long", LONG_PROMPT, Sampling(max_tokens=480, temperature=1.0, seed=LONG_SEED))
        return gens, long

    expected = asyncio.run(with_torch())
    gens, long = served.run(with_vllm())
    engines_diff, forward_diff = 0.0, 0.0
    for prompt, want, got in zip(batch, expected, gens, strict=True):
        assert got.tokens.dtype == np.int32 and got.logprobs.dtype == np.float32
        assert got.tokens.tolist() == want.tokens.tolist()
        assert got.finish_reason == want.finish_reason
        assert got.spans == want.spans == [(0, 0, len(got.tokens))]
        engines_diff = max(engines_diff, float(np.abs(got.logprobs - want.logprobs).max()))
        forward_diff = max(forward_diff, assert_matches_forward(tiny_model_dir, prompt, got))
    assert engines_diff <= ATOL, f"vllm and torch logprobs differ by up to {engines_diff:.2e}"
    print(f"greedy parity: max |vllm - torch| = {engines_diff:.2e}, max |vllm - forward| = {forward_diff:.2e}")
    # The eos token ends generation with "stop" and is included, in both engines.
    assert gens[-1].finish_reason == "stop" and gens[-1].tokens[-1] == EOS_ID and len(gens[-1].tokens) < 40
    for gen in gens:
        assert len(gen.tokens) == 40 if gen.finish_reason == "length" else gen.tokens[-1] == EOS_ID
    # The sampled request the abort and pause tests rely on runs to max_tokens; its logprobs are raw.
    assert long.finish_reason == "length" and len(long.tokens) == 480 and EOS_ID not in long.tokens
    assert_matches_forward(tiny_model_dir, LONG_PROMPT, long)


def test_sampling_stop_tokens_and_context_limit(served: Served, engine: VllmEngine, tiny_model_dir: Path) -> None:
    batch = random_prompts([3, 30, 90], seed=5)
    samplings = [
        Sampling(max_tokens=60, temperature=1.0, seed=1),
        Sampling(max_tokens=60, temperature=0.7, top_p=0.8, seed=2),  # logprobs stay raw
        Sampling(max_tokens=60, temperature=1.0),  # unseeded
    ]

    async def go() -> dict[str, Any]:
        out: dict[str, Any] = {
            "sampled": await asyncio.gather(
                *[engine.generate(f"s{i}", p, s) for i, (p, s) in enumerate(zip(batch, samplings, strict=True))]
            )
        }
        free = out["sampled"][0].tokens.tolist()
        out["stop_at"] = stop_at = next(i for i in range(3, len(free)) if free[i] not in free[:i])
        out["stop"] = await engine.generate(
            "s-stop", batch[0], samplings[0].model_copy(update={"stop_token_ids": [free[stop_at]]})
        )
        out["again"] = await engine.generate("s-again", batch[0], samplings[0])
        out["context"] = await engine.generate(
            "s-ctx", np.arange(6, 506, dtype=np.int32), Sampling(max_tokens=100, temperature=0.0)
        )
        return out

    out = served.run(go())
    for prompt, sampling, gen in zip(batch, samplings, out["sampled"], strict=True):
        assert len(gen.tokens) == len(gen.logprobs) > 0 and gen.spans == [(0, 0, len(gen.tokens))]
        if gen.finish_reason == "length":
            assert len(gen.tokens) == sampling.max_tokens and EOS_ID not in gen.tokens
        else:
            assert gen.finish_reason == "stop" and gen.tokens[-1] == EOS_ID and EOS_ID not in gen.tokens[:-1]
        assert_matches_forward(tiny_model_dir, prompt, gen)
    first = out["sampled"][0]
    assert out["again"].tokens.tolist() == first.tokens.tolist()  # a seed fixes the tokens
    stop, stop_at = out["stop"], out["stop_at"]
    assert stop.finish_reason == "stop" and stop.tokens.tolist() == first.tokens[: stop_at + 1].tolist()
    assert out["context"].finish_reason == "length" and len(out["context"].tokens) == 512 - 500


async def generating(
    engine: VllmEngine, request_id: str, sampling: Sampling, tokens: int = 5
) -> tuple[asyncio.Future[Generation], int]:
    """A request of `LONG_PROMPT` started and `tokens` tokens on; with the engine's `generated_tokens` before it."""
    base = engine.generated_tokens
    request = asyncio.ensure_future(engine.generate(request_id, LONG_PROMPT, sampling))
    await wait_until_async(lambda: engine.generated_tokens >= base + tokens)
    return request, base


# -- (b) abort ---------------------------------------------------------------------------------


def test_abort_returns_partial_tokens_with_true_logprobs(
    served: Served, engine: VllmEngine, tiny_model_dir: Path
) -> None:
    sampling = Sampling(max_tokens=480, temperature=1.0, seed=LONG_SEED)

    async def go() -> tuple[Generation, Generation, Generation]:
        request, _ = await generating(engine, "b-long", sampling)
        await engine.abort(["b-long", "unknown-id"])
        partial = await request
        after = await engine.generate("b-after", LONG_PROMPT, Sampling(max_tokens=5, temperature=1.0, seed=1))
        full = await engine.generate("b-full", LONG_PROMPT, sampling)
        return partial, after, full

    partial, after, full = served.run(go())
    assert partial.finish_reason == "abort"
    assert 5 <= len(partial.tokens) < 480
    assert partial.spans == [(0, 0, len(partial.tokens))]
    assert partial.tokens.tolist() == full.tokens[: len(partial.tokens)].tolist()  # the same seeded tokens, cut
    diff = assert_matches_forward(tiny_model_dir, LONG_PROMPT, partial)
    print(f"abort: {len(partial.tokens)} tokens, max |vllm - forward| = {diff:.2e}")
    assert after.finish_reason == "length" and len(after.tokens) == 5


# -- (c) pause("abort"), new weights, continue -------------------------------------------------


def test_pause_abort_load_resume_continues_under_new_weights(
    served: Served, engine: VllmEngine, tiny_model_dir: Path, tiny_model_dir_v1: Path
) -> None:
    max_tokens = 480
    sampling = Sampling(max_tokens=max_tokens, temperature=1.0, seed=LONG_SEED)

    async def go() -> tuple[Generation, Generation, Generation]:
        request, _ = await generating(engine, "c-run", sampling)
        await engine.pause("abort")
        partial = await request
        assert partial.finish_reason == "abort"
        queued = asyncio.ensure_future(
            engine.generate("c-queued", LONG_PROMPT, Sampling(max_tokens=3, temperature=0.0))
        )
        await engine.load_weights(str(tiny_model_dir_v1), version=1)
        assert engine.version == 1
        assert not queued.done()  # a request that came while paused waits for resume
        await engine.resume()
        # The worker's continuation: prompt + partial tokens, the remaining max_tokens, under the new weights.
        continued = await engine.generate(
            "c-continued",
            np.concatenate([LONG_PROMPT, partial.tokens]),
            sampling.model_copy(update={"max_tokens": max_tokens - len(partial.tokens)}),
        )
        return partial, continued, await queued

    partial, continued, queued = served.run(go())
    k = len(partial.tokens)
    assert 5 <= k < max_tokens and partial.spans == [(0, 0, k)]
    v0_diff = assert_matches_forward(tiny_model_dir, LONG_PROMPT, partial)
    n = len(continued.tokens)
    assert continued.spans == [(1, 0, n)]
    assert n == max_tokens - k if continued.finish_reason == "length" else continued.tokens[-1] == EOS_ID
    v1_diff = assert_matches_forward(tiny_model_dir_v1, np.concatenate([LONG_PROMPT, partial.tokens]), continued)
    assert (
        max_forward_diff(tiny_model_dir, np.concatenate([LONG_PROMPT, partial.tokens]), continued) > 0.1
    )  # v1, not v0
    assert queued.spans == [(1, 0, 3)] and queued.finish_reason == "length"
    assert_matches_forward(tiny_model_dir_v1, LONG_PROMPT, queued)
    print(
        f"pause abort: partial {k} tokens (v0) max diff {v0_diff:.2e}; "
        f"continuation {n} tokens (v1) max diff {v1_diff:.2e}"
    )


# -- (d) pause("keep"), new weights, resume: spans ---------------------------------------------


def test_pause_keep_load_resume_splits_spans(
    served: Served, engine: VllmEngine, tiny_model_dir: Path, tiny_model_dir_v1: Path
) -> None:
    async def go() -> tuple[Generation, Generation, int]:
        request, base = await generating(engine, "d-kept", Sampling(max_tokens=200, temperature=1.0, seed=LONG_SEED))
        await engine.pause("keep")
        await engine.load_weights(str(tiny_model_dir_v1), version=1)
        await engine.reset_prefix_cache()
        frozen = engine.generated_tokens - base
        assert not request.done()
        await engine.resume()
        kept = await request
        fresh = await engine.generate("d-fresh", LONG_PROMPT, Sampling(max_tokens=20, temperature=1.0, seed=3))
        return kept, fresh, frozen

    kept, fresh, frozen = served.run(go())
    assert engine.version == 1
    assert len(kept.spans) == 2, kept.spans
    (v0, s0, k), (v1, k1, n) = kept.spans
    assert (v0, s0, v1, k1, n) == (0, 0, 1, k, len(kept.tokens)) and 5 <= k < n
    assert k == frozen  # nothing was generated between the pause and the resume
    assert kept.finish_reason in ("length", "stop")
    d0 = assert_matches_forward(tiny_model_dir, LONG_PROMPT, kept, 0, k)  # old weights for the old span
    d1 = assert_matches_forward(tiny_model_dir_v1, LONG_PROMPT, kept, k, n)  # new weights over the whole prefix
    assert fresh.spans == [(1, 0, len(fresh.tokens))]
    assert_matches_forward(tiny_model_dir_v1, LONG_PROMPT, fresh)
    print(f"pause keep: spans {kept.spans}, max diff v0 span {d0:.2e}, v1 span {d1:.2e}")


def test_a_pause_abort_ends_the_requests_a_keep_pause_froze_with_their_tokens_so_far(
    served: Served, engine: VllmEngine, tiny_model_dir: Path
) -> None:
    """What a worker stopped during a `keep` sleep or sync does: no resume will come, so it ends what it holds."""

    async def go() -> tuple[Generation, int, Generation]:
        sampling = Sampling(max_tokens=200, temperature=1.0, seed=LONG_SEED)
        request, base = await generating(engine, "e-frozen", sampling)
        await engine.pause("keep")
        frozen = engine.generated_tokens - base
        assert not request.done()
        await engine.pause("abort")
        ended = await asyncio.wait_for(request, 30)
        await engine.resume()
        after = await engine.generate("e-after", LONG_PROMPT, Sampling(max_tokens=5, temperature=1.0, seed=1))
        return ended, frozen, after

    ended, frozen, after = served.run(go())
    assert ended.finish_reason == "abort" and len(ended.tokens) == frozen >= 5
    assert ended.spans == [(0, 0, frozen)]
    assert_matches_forward(tiny_model_dir, LONG_PROMPT, ended)
    assert after.finish_reason == "length" and len(after.tokens) == 5


# -- pause("inflight"): the running request keeps its KV cache across the load ----------------


def test_pause_inflight_load_resume_keeps_running_requests_with_their_kv_cache(
    served: Served, engine: VllmEngine, tiny_model_dir: Path, tiny_model_dir_v1: Path
) -> None:
    """vLLM paused with `keep` and `clear_cache=False` (PipelineRL's way): the request goes on over the KV blocks v0
    wrote, so span 1's logprobs are those of v1 over v0's cache (`kept_cache_log_softmax`), not of a v1 recompute.
    Blocks v0 computed stay in the prefix cache (it cannot be reset while the request holds blocks), and a request
    that starts after the load finds none of them: their hashes are salted with the version."""
    cached_prompt = random_prompts([140], seed=7)[0]  # one full KV block (128 tokens on CPU) and then some

    async def go() -> tuple[Generation, Generation, Generation, int]:
        await engine.generate("f-warm", cached_prompt, Sampling(max_tokens=2, seed=1))
        again = await engine.generate("f-again", cached_prompt, Sampling(max_tokens=2, seed=1))
        sampling = Sampling(max_tokens=200, temperature=1.0, seed=LONG_SEED)
        request, base = await generating(engine, "f-kept", sampling, tokens=40)  # 3 full KV blocks of 16 tokens
        await engine.pause("inflight")
        await engine.load_weights(str(tiny_model_dir_v1), version=1)
        frozen = engine.generated_tokens - base
        assert not request.done()
        await engine.resume()
        kept = await request
        fresh = await engine.generate("f-fresh", cached_prompt, Sampling(max_tokens=20, temperature=1.0, seed=3))
        return again, kept, fresh, frozen

    again, kept, fresh, frozen = served.run(go())
    assert again.cached_tokens == 128  # the prefix cache is on: v0's block is found under v0
    assert engine.version == 1
    assert len(kept.spans) == 2, kept.spans
    (v0, s0, k), (v1, k1, n) = kept.spans
    assert (v0, s0, v1, k1, n) == (0, 0, 1, k, len(kept.tokens)) and 40 <= k == frozen < n
    d0 = assert_matches_forward(tiny_model_dir, LONG_PROMPT, kept, 0, k)  # old weights for the old span
    prompt, tokens = LONG_PROMPT.tolist(), kept.tokens.tolist()
    index = torch.tensor(tokens)[:, None]
    mixed = kept_cache_log_softmax({0: tiny_model_dir, 1: tiny_model_dir_v1}, prompt, tokens, kept.spans)
    d1 = float(np.abs(kept.logprobs[k:] - mixed.gather(1, index)[k:, 0].numpy()).max())
    assert d1 <= ATOL, f"span 1 differs from v1 over v0's cache by up to {d1:.2e}"
    recompute_gap = max_forward_diff(tiny_model_dir_v1, LONG_PROMPT, kept, k, n)
    assert recompute_gap > 100 * ATOL  # not recomputed: a v1 pass over the whole prefix gives other logprobs
    assert fresh.cached_tokens == 0 and fresh.spans == [(1, 0, len(fresh.tokens))]
    assert_matches_forward(tiny_model_dir_v1, cached_prompt, fresh)
    print(
        f"pause inflight: spans {kept.spans}, max diff v0 span {d0:.2e}, v1-over-v0-cache span {d1:.2e}, "
        f"vs a full v1 recompute {recompute_gap:.2f}"
    )


# -- weight loads: checks, one file, tensors from memory ---------------------------------------


def test_bad_checkpoints_are_refused_and_tensors_load_from_memory(
    served: Served, engine: VllmEngine, tiny_model_dir: Path, tiny_model_dir_v1: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    save_file({"lm_head.weight": torch.zeros(3, 3)}, str(tmp_path / "model.safetensors"))
    v1_tensors = load_file(str(tiny_model_dir_v1 / "model.safetensors"))

    async def go() -> tuple[Generation, Generation, Generation]:
        with pytest.raises(ValueError, match="does not fit the model"):
            await engine.load_weights(str(tmp_path), version=7)
        with pytest.raises(FileNotFoundError):
            await engine.load_weights(str(tmp_path / "nowhere"), version=7)
        with pytest.raises(ValueError, match=r"shape mismatches"):
            await engine.load_tensors({**v1_tensors, "lm_head.weight": torch.zeros(3, 3)}, version=7)
        assert engine.version == 0
        old = await engine.generate("g-old", LONG_PROMPT, Sampling(max_tokens=10, seed=1))
        await engine.load_tensors({k: v.numpy() for k, v in v1_tensors.items()}, version=7)
        from_memory = await engine.generate("g-memory", LONG_PROMPT, Sampling(max_tokens=10, seed=1))
        await engine.load_weights(str(tiny_model_dir / "model.safetensors"), version=8)  # one file
        from_file = await engine.generate("g-file", LONG_PROMPT, Sampling(max_tokens=10, seed=1))
        return old, from_memory, from_file

    old, from_memory, from_file = served.run(go())
    # On a CPU vLLM repacks each linear layer's weight after loading it: a version goes through its layerwise reload
    # (a GPU loads unquantized weights directly: tests/staleness/test_ipc.py's vLLM test, run on the device).
    assert engine.load_path == "layerwise: vLLM repacks weights after loading them on cpu"
    assert old.spans == [(0, 0, 10)]
    assert_matches_forward(tiny_model_dir, LONG_PROMPT, old)
    assert from_memory.spans == [(7, 0, 10)]
    assert_matches_forward(tiny_model_dir_v1, LONG_PROMPT, from_memory)
    assert from_file.spans == [(8, 0, 10)] and from_file.tokens.tolist() == old.tokens.tolist()
    assert_matches_forward(tiny_model_dir, LONG_PROMPT, from_file)


def test_tensors_are_staged_in_memory_or_on_disk_and_past_the_rpc_limit_with_no_room_refused(
    served: Served, engine: VllmEngine, tiny_model_dir: Path, tiny_model_dir_v1: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A version sent as tensors reaches vLLM's worker processes as a file staged where this host has room (`/dev/shm`
    first, the temp dir next), as a blob through vLLM's RPC where none has, and is refused in one line where it is
    past the RPC's 4 GiB and none has room: each load serves the weights it was given, and the staged file is gone."""
    from safetensors.torch import load_file

    import consumers.engines.vllm_engine as module

    v1 = load_file(str(tiny_model_dir_v1 / "model.safetensors"))
    v0 = load_file(str(tiny_model_dir / "model.safetensors"))
    staged = tmp_path / "staged"
    staged.mkdir()
    monkeypatch.setattr(module, "STAGING_DIRS", (str(staged),))
    assert module.staging_dir(1 << 20) == str(staged)

    async def go() -> tuple[Generation, Generation]:
        await engine.load_tensors(v1, version=11)  # staged under `staged`, then removed
        first = await engine.generate("g-staged", LONG_PROMPT, Sampling(max_tokens=10, seed=1))
        monkeypatch.setattr(module, "staging_dir", lambda nbytes: None)  # no room anywhere: through the RPC
        await engine.load_tensors(v0, version=12)
        second = await engine.generate("g-rpc", LONG_PROMPT, Sampling(max_tokens=10, seed=1))
        monkeypatch.setattr(module, "RPC_LIMIT", 1024)  # and past the RPC's limit: refused, weights as they were
        with pytest.raises(ValueError, match=r"more than vLLM's RPC carries \(4 GiB\), and neither /dev/shm nor"):
            await engine.load_tensors(v1, version=13)
        assert engine.version == 12
        return first, second

    first, second = served.run(go())
    assert first.spans == [(11, 0, 10)] and second.spans == [(12, 0, 10)]
    assert_matches_forward(tiny_model_dir_v1, LONG_PROMPT, first)
    assert_matches_forward(tiny_model_dir, LONG_PROMPT, second)
    assert not any(staged.iterdir())


# -- (e) bad input on a running engine ---------------------------------------------------------


def test_engine_keeps_serving_after_bad_requests(served: Served, engine: VllmEngine, tiny_model_dir: Path) -> None:
    async def go() -> Generation:
        with pytest.raises(EngineInputError, match="prompt has 600 tokens"):
            await engine.generate("e-long", np.ones(600, dtype=np.int32), Sampling())
        with pytest.raises(EngineInputError, match="temperature must be >= 0"):
            await engine.generate("e-neg", LONG_PROMPT, Sampling(temperature=-1))
        with pytest.raises(EngineInputError, match=r"temperature must be in \[0, 2\]"):  # refused by vLLM itself
            await engine.generate("e-hot", LONG_PROMPT, Sampling(temperature=5.0))
        base = engine.generated_tokens
        first = asyncio.ensure_future(engine.generate("dup", LONG_PROMPT, Sampling(max_tokens=480, seed=LONG_SEED)))
        await wait_until_async(lambda: engine.generated_tokens > base)
        with pytest.raises(EngineInputError, match="already in flight"):
            await engine.generate("dup", LONG_PROMPT, Sampling())
        await engine.abort(["dup"])
        assert (await first).finish_reason == "abort"
        return await engine.generate("e-ok", LONG_PROMPT, Sampling(max_tokens=5, seed=1))

    ok = served.run(go())
    assert ok.finish_reason == "length" and len(ok.tokens) == 5
    assert_matches_forward(tiny_model_dir, LONG_PROMPT, ok)


# -- (f) shutdown ------------------------------------------------------------------------------


def test_many_seeded_requests_with_long_prompts_are_all_served(served: Served, engine: VllmEngine) -> None:
    """More prompt tokens at once than one step's budget, every request seeded: vLLM 0.32's CPU engine died
    on this with chunked prefill ("CPU Generator does not use offset"); the engine must serve them all."""
    many = random_prompts([300] * 40, seed=5)

    async def run() -> list[Generation]:
        return await asyncio.gather(
            *(engine.generate(f"many-{i}", p, Sampling(max_tokens=8, seed=i)) for i, p in enumerate(many))
        )

    generations = served.run(run())
    assert all(1 <= len(g.tokens) <= 8 for g in generations)
    assert all(g.finish_reason in ("stop", "length") for g in generations)


@pytest.mark.closes_shared_engine
def test_shutdown_fails_pending_requests_and_leaves_no_process(served: Served, engine: VllmEngine) -> None:
    """Last in the session (`closes_shared_engine`): it stops the shared engine (the fixture's own shutdown is then a
    no-op) after its other users (test_transports, test_top_logprobs) ran."""
    assert served.engine_pids, "the engine started no process of its own?"
    assert any("EngineCore" in cmd for pid, cmd in children().items() if pid in served.engine_pids), children()

    async def go() -> None:
        base = engine.generated_tokens
        pending = asyncio.ensure_future(
            engine.generate("f-pending", LONG_PROMPT, Sampling(max_tokens=480, seed=LONG_SEED))
        )
        await wait_until_async(lambda: engine.generated_tokens > base)
        await engine.shutdown()
        with pytest.raises(EngineClosedError):
            await pending
        with pytest.raises(EngineClosedError):
            await engine.generate("f-late", LONG_PROMPT, Sampling(max_tokens=3))
        await engine.shutdown()  # idempotent

    served.run(go(), timeout=60)
    _, alive = psutil.wait_procs([p for p in map(_process, served.engine_pids) if p is not None], timeout=10)
    assert not alive, f"engine processes left behind: {alive}"
    assert not [cmd for cmd in children().values() if "VLLM" in cmd], children()


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def test_engine_args_that_vllm_does_not_take_are_refused_by_name_before_vllm_starts(tiny_model_dir: Path) -> None:
    """`--engine-args` become `AsyncEngineArgs` fields: a misspelt one is a one-line ValueError (the CLI's `error:`),
    not a TypeError from inside vLLM's start."""
    with pytest.raises(ValueError, match="AsyncEngineArgs has no max_num_seq, no_such_arg"):
        VllmEngine(tiny_model_dir, engine_args={"no_such_arg": 1, "max_num_seq": 8, "max_num_seqs": 8})
