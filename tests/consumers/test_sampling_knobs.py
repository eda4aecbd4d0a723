"""The sampling knobs people set (`pipeline.wire.SAMPLING_KNOBS`: `top_k`, `min_p`, `repetition_penalty`,
`presence_penalty`, `frequency_penalty`, `min_tokens`), with vLLM's meanings and order, in the torch engine and in
vLLM's CPU engine: the tokens obey each knob, a seed draws the same tokens whatever else runs, and the logprobs are
those of the distribution the docs name: `raw` the plain forward pass, `processed` a forward pass with the knobs
applied by an independent reference written from vLLM's sampler (`tests.reference.knob_distributions`), at 1e-4."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from consumers.engines.base import Generation, continued
from consumers.engines.tiny_model import EOS, SPECIAL_TOKENS
from consumers.engines.torch_engine import TorchEngine
from pipeline.codec import as_entries
from pipeline.local import RedisServer
from pipeline.wire import Keys, Prompt, Sampling
from producers.client import RolloutClient
from tests.engine_loop import Served
from tests.reference import forward_logprobs, knob_logprobs, random_prompts

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-4
EOS_ID = SPECIAL_TOKENS.index(EOS)
"""The tiny model's end of sequence: a stop token of every request."""
PROMPT = np.arange(10, 20, dtype=np.int32)
"""Greedy decoding from this prompt (seed-0 weights) repeats itself: one token ten times, then another eight."""
EOS_PROMPT = np.array(
    [328, 264, 142, 161, 26, 44, 14, 94, 417, 334, 467, 260, 312, 497, 375, 325, 281,
     289, 479, 146, 418, 345, 7, 205, 439, 286, 22, 393, 375, 434, 94, 51, 442, 17],
    dtype=np.int32,
)  # fmt: skip
"""Greedy decoding from this prompt reaches the end of sequence after 5 tokens (seed-0 weights)."""
GREEDY = Sampling(max_tokens=30, temperature=0.0)

ALL_KNOBS: dict[str, Any] = dict(
    top_k=40, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3, min_tokens=4
)
KNOBBED = [
    Sampling(max_tokens=24, temperature=0.9, top_k=5, seed=1),
    Sampling(max_tokens=24, temperature=1.2, min_p=0.2, seed=2),
    Sampling(max_tokens=24, temperature=1.0, repetition_penalty=1.8, seed=3),
    Sampling(max_tokens=24, temperature=1.0, repetition_penalty=0.7, seed=4),  # < 1 favours repeats
    Sampling(max_tokens=24, temperature=1.0, frequency_penalty=1.5, seed=5),
    Sampling(max_tokens=24, temperature=1.0, presence_penalty=-1.5, seed=6),
    Sampling(max_tokens=24, temperature=0.8, min_tokens=20, seed=7),
    Sampling(max_tokens=24, temperature=0.7, top_p=0.9, seed=8, **ALL_KNOBS),
    Sampling(max_tokens=24, temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.2),
]
"""Each knob alone and all at once, sampled; the last greedy with penalties (its processed logprobs are after the
penalties only, as vLLM's)."""


def generate(model_dir: Path, calls: list[tuple[np.ndarray, Sampling]], max_batch: int = 16) -> list[Generation]:
    """Every call at once on one torch engine (one batch when `max_batch` allows)."""

    async def go() -> list[Generation]:
        async with TorchEngine(model_dir, num_threads=1, max_batch=max_batch) as engine:
            return await asyncio.gather(*(engine.generate(f"r{i}", p, s) for i, (p, s) in enumerate(calls)))

    return asyncio.run(go())


def processed(sampling: Sampling) -> Sampling:
    return sampling.model_copy(update={"logprobs_mode": "processed"})


def repeats(tokens: np.ndarray) -> int:
    """How many of a sample's tokens it had generated before."""
    return len(tokens) - len(set(tokens.tolist()))


def check_logprobs(model_dir: Path, prompt: np.ndarray, gen: Generation, sampling: Sampling) -> float:
    """Assert the logprobs are the reference's of the sampling's kind; returns how far the processed ones are from the
    raw ones (how much the knobs changed the distribution of these tokens)."""
    stops = [*sampling.stop_token_ids, EOS_ID]
    raw, shaped = knob_logprobs(model_dir, prompt.tolist(), gen.tokens.tolist(), sampling, stops)
    expected = shaped if sampling.logprobs_mode == "processed" else raw
    np.testing.assert_allclose(gen.logprobs, expected, atol=ATOL, err_msg=str(sampling))
    return float(np.abs(shaped - raw).max())


# -- the torch engine ---------------------------------------------------------------------------


def test_top_k_1_at_temperature_1_draws_the_greedy_tokens_whatever_the_seed(tiny_model_dir: Path) -> None:
    top1 = [processed(Sampling(max_tokens=30, temperature=1.0, top_k=1, seed=seed)) for seed in (1, 2, 3)]
    greedy, *sampled = generate(tiny_model_dir, [(PROMPT, GREEDY), *((PROMPT, s) for s in top1)])
    for gen in sampled:
        assert gen.tokens.tolist() == greedy.tokens.tolist()
        np.testing.assert_allclose(gen.logprobs, 0.0, atol=ATOL)  # the one token left has all the mass
    # Its raw logprobs are the model's own: a plain forward pass.
    [raw] = generate(tiny_model_dir, [(PROMPT, top1[0].model_copy(update={"logprobs_mode": "raw"}))])
    assert raw.tokens.tolist() == greedy.tokens.tolist()
    np.testing.assert_allclose(raw.logprobs, forward_logprobs(tiny_model_dir, PROMPT.tolist(), raw.tokens.tolist()),
                               atol=ATOL)  # fmt: skip


def test_min_p_near_1_draws_the_greedy_tokens_and_top_k_of_the_vocabulary_is_plain_sampling(
    tiny_model_dir: Path,
) -> None:
    near_one = [Sampling(max_tokens=30, temperature=1.0, min_p=0.999, seed=seed) for seed in (1, 2)]
    plain, whole_vocab = Sampling(max_tokens=30, seed=9), Sampling(max_tokens=30, seed=9, top_k=512)
    greedy, *gens = generate(
        tiny_model_dir, [(PROMPT, GREEDY), *((PROMPT, s) for s in [*near_one, plain, whole_vocab])]
    )
    assert all(g.tokens.tolist() == greedy.tokens.tolist() for g in gens[:2])
    assert gens[2].tokens.tolist() == gens[3].tokens.tolist() != greedy.tokens.tolist()


def test_a_huge_repetition_penalty_never_repeats_a_token_of_the_prompt_or_of_the_sample(tiny_model_dir: Path) -> None:
    huge = [Sampling(max_tokens=40, temperature=t, repetition_penalty=1e4, seed=s) for t, s in ((0.0, None), (1.0, 3))]
    plain, *gens = generate(tiny_model_dir, [(PROMPT, GREEDY.model_copy(update={"max_tokens": 40})),
                                             *((PROMPT, s) for s in huge)])  # fmt: skip
    assert repeats(plain.tokens) > 20
    for gen in gens:
        assert len(gen.tokens) == 40 and repeats(gen.tokens) == 0
        assert not set(gen.tokens.tolist()) & set(PROMPT.tolist())


def test_frequency_and_presence_penalties_lower_the_repeats_and_a_negative_one_raises_them(
    tiny_model_dir: Path,
) -> None:
    seeds = range(6)
    kinds = {
        "plain": {},
        "frequency": {"frequency_penalty": 1.5},
        "presence": {"presence_penalty": 1.5},
        "favoured": {"presence_penalty": -2.0},
    }
    calls = [(PROMPT, Sampling(max_tokens=30, seed=seed, **knobs)) for knobs in kinds.values() for seed in seeds]
    gens = generate(tiny_model_dir, calls, max_batch=len(calls))
    count = {kind: sum(repeats(g.tokens) for g in gens[k * len(seeds) : (k + 1) * len(seeds)])
             for k, kind in enumerate(kinds)}  # fmt: skip
    assert count["frequency"] < count["plain"] / 2 and count["presence"] < count["plain"] / 2, count
    assert count["favoured"] > count["plain"], count
    # Greedy too: the penalty moves the argmax away from what was generated.
    [greedy, penalized] = generate(tiny_model_dir, [(PROMPT, GREEDY), (PROMPT, GREEDY.model_copy(
        update={"frequency_penalty": 2.0}))])  # fmt: skip
    assert repeats(penalized.tokens) < repeats(greedy.tokens) / 2


def test_min_tokens_holds_back_every_stop_token_until_then(tiny_model_dir: Path) -> None:
    greedy = Sampling(max_tokens=40, temperature=0.0)
    [plain] = generate(tiny_model_dir, [(EOS_PROMPT, greedy)])
    assert plain.finish_reason == "stop" and plain.tokens.tolist()[-1] == EOS_ID and len(plain.tokens) == 6
    second = plain.tokens.tolist()[1]
    asked = [processed(greedy.model_copy(update={"min_tokens": 12})),
             greedy.model_copy(update={"min_tokens": 12, "stop_token_ids": [second]})]  # fmt: skip
    held, second_held = generate(tiny_model_dir, [(EOS_PROMPT, s) for s in asked])
    assert EOS_ID not in held.tokens.tolist()[:12] and len(held.tokens) > 12
    assert held.tokens.tolist()[:5] == plain.tokens.tolist()[:5]  # the same argmax until the eos was due
    check_logprobs(tiny_model_dir, EOS_PROMPT, held, asked[0])
    assert not {second, EOS_ID} & set(second_held.tokens.tolist()[:12]) and len(second_held.tokens) > 12
    # Sampled: never a stop token among the first min_tokens, whatever the seed.
    sampled = [
        Sampling(max_tokens=16, min_tokens=8, stop_token_ids=plain.tokens.tolist()[:2], seed=s) for s in range(8)
    ]
    for sampling, gen in zip(sampled, generate(tiny_model_dir, [(EOS_PROMPT, s) for s in sampled]), strict=True):
        stops = {*sampling.stop_token_ids, EOS_ID}
        assert len(gen.tokens) > 8 and not stops & set(gen.tokens.tolist()[:8])


def test_processed_logprobs_are_a_forward_pass_with_the_knobs_applied_and_raw_ones_the_plain_pass(
    tiny_model_dir: Path,
) -> None:
    """Every knob alone and together, each asked raw and processed, in one batch: each row its own knobs."""
    prompts = random_prompts([6, 9, 4, 11, 7, 5, 8, 10, 3], seed=5)
    calls = [(p, s) for p, s in zip(prompts, KNOBBED, strict=True)]
    calls += [(p, processed(s)) for p, s in zip(prompts, KNOBBED, strict=True)]
    gens = generate(tiny_model_dir, calls, max_batch=len(calls))
    distance = [check_logprobs(tiny_model_dir, p, g, s) for (p, s), g in zip(calls, gens, strict=True)]
    assert min(distance) > 0.05, f"every knob must change the distribution somewhere: {distance}"
    raw, shaped = gens[: len(KNOBBED)], gens[len(KNOBBED) :]
    assert [g.tokens.tolist() for g in raw] == [g.tokens.tolist() for g in shaped]  # the mode changes no token


def test_a_seeded_sample_with_knobs_draws_the_same_tokens_alone_and_in_any_batch(tiny_model_dir: Path) -> None:
    knobbed = KNOBBED[7]
    [alone] = generate(tiny_model_dir, [(PROMPT, knobbed)])
    others = [(p, s) for p, s in zip(random_prompts([5, 12, 3, 8], seed=2), KNOBBED[:4], strict=True)]
    batched = generate(tiny_model_dir, [*others[:2], (PROMPT, knobbed), *others[2:]], max_batch=3)[2]
    assert alone.tokens.tolist() == batched.tokens.tolist()
    np.testing.assert_allclose(alone.logprobs, batched.logprobs, atol=ATOL)
    [reseeded] = generate(tiny_model_dir, [(PROMPT, knobbed.model_copy(update={"seed": 99}))])
    assert reseeded.tokens.tolist() != alone.tokens.tolist()


def test_a_continuation_asks_for_the_min_tokens_and_max_tokens_left() -> None:
    sampling = Sampling(max_tokens=30, min_tokens=10, top_k=5, repetition_penalty=1.2)
    assert continued(sampling, 4) == sampling.model_copy(update={"max_tokens": 26, "min_tokens": 6})
    assert continued(sampling, 12).min_tokens == 0 and continued(sampling, 0) == sampling
    assert continued(sampling, 0) is not sampling  # a copy: the worker sets its seed


def test_the_client_puts_the_knobs_on_the_prompt_and_refuses_one_out_of_range_in_one_line(
    redis_server: RedisServer, ns: str
) -> None:
    client = RolloutClient(redis_server.url, ns)
    client.submit(tokens=[5, 6], id="asked", max_tokens=8, seed=3, **ALL_KNOBS)
    client.submit(tokens=[5, 6], id="off", max_tokens=8, top_k=-1, min_p=None)  # vLLM's "off" and the default
    entries = as_entries(client.streams.redis.xrange(Keys(ns).prompts))
    sent = {Prompt.from_fields(f).id: Prompt.from_fields(f).sampling for _, f in entries}
    assert sent["asked"] == Sampling(max_tokens=8, seed=3, **ALL_KNOBS)
    assert sent["off"] == Sampling(max_tokens=8)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"presence_penalty": 3}, "presence_penalty must be in [-2, 2], got 3.0"),
        ({"top_k": -2, "min_p": 1.5}, "top_k must be -1 or 0 (off) or >= 1, got -2; min_p must be in [0, 1], got 1.5"),
        ({"min_tokens": 9}, "min_tokens must be in [0, max_tokens=8], got 9"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0 (1: off), got 0.0"),
    ]
    for knobs, message in cases:
        with pytest.raises(ValueError) as refused:
            client.submit(tokens=[5, 6], max_tokens=8, **knobs)
        assert str(refused.value) == message
    assert client.streams.redis.xlen(Keys(ns).prompts) == 2


# -- vLLM's CPU engine --------------------------------------------------------------------------


def test_vllm_and_a_remote_server_get_the_knobs_and_a_top_k_past_the_vocabulary_as_off(tiny_model_dir: Path) -> None:
    """No vLLM is started: what the request sent to vLLM holds. A top-k the wire took (an int64) but that keeps the
    whole vocabulary reaches vLLM as 0, not as a number its int32 tensors cannot hold; a `min_tokens` past the context
    left is cut to it (vLLM refuses `min_tokens` > `max_tokens`)."""
    from consumers.engines.remote_engine import RemoteVllmEngine
    from consumers.engines.vllm_engine import VllmEngine

    sampling = Sampling(max_tokens=30, top_k=7, **{k: v for k, v in ALL_KNOBS.items() if k != "top_k"})
    params = VllmEngine(tiny_model_dir)._sampling_params(4, sampling)
    sent = {name: getattr(params, name) for name in ALL_KNOBS}
    assert sent == {**ALL_KNOBS, "top_k": 7}
    assert VllmEngine(tiny_model_dir)._sampling_params(4, Sampling(top_k=2**40)).top_k == 0
    cut = VllmEngine(tiny_model_dir)._sampling_params(500, Sampling(max_tokens=30, min_tokens=30))
    assert (cut.max_tokens, cut.min_tokens) == (12, 12)
    remote = RemoteVllmEngine(tiny_model_dir, url="http://127.0.0.1:1")  # never connected
    body = remote._body("r", [5, 6], 2, sampling)["sampling_params"]
    assert {name: body[name] for name in ALL_KNOBS} == {**ALL_KNOBS, "top_k": 7}
    assert remote._body("r", [5, 6], 2, Sampling(top_k=2**40))["sampling_params"]["top_k"] == 0


@pytest.fixture(scope="module")
def vllm_processed(tiny_model_dir: Path) -> Iterator[Served]:
    """A `VllmEngine` started with processed logprobs (vLLM sets the mode per engine), for this module only."""
    from consumers.engines.vllm_engine import VllmEngine

    served = Served(VllmEngine(tiny_model_dir, logprobs_mode="processed"))
    try:
        served.run(served.engine.start(), timeout=240)
        yield served
    finally:
        served.run(served.engine.shutdown(), timeout=60)
        served.close()


def vllm_generate(served: Served, calls: list[tuple[np.ndarray, Sampling]], tag: str) -> list[Generation]:
    async def go() -> list[Generation]:
        return await asyncio.gather(*(served.engine.generate(f"{tag}{i}", p, s) for i, (p, s) in enumerate(calls)))

    return served.run(go())


@pytest.mark.vllm
def test_vllm_applies_the_knobs_as_the_reference_and_the_torch_engine_do(
    vllm_processed: Served, tiny_model_dir: Path
) -> None:
    """Processed logprobs of every knob alone and together equal the reference's; greedy tokens under penalties and
    `min_tokens` are the torch engine's; top-k 1 and min-p near 1 draw the greedy tokens; a huge repetition penalty
    repeats nothing."""
    prompts = random_prompts([6, 9, 4, 11, 7, 5, 8, 10, 3], seed=5)
    knobbed = [(p, processed(s)) for p, s in zip(prompts, KNOBBED, strict=True)]
    gens = vllm_generate(vllm_processed, knobbed, "k")
    distance = [check_logprobs(tiny_model_dir, p, g, s) for (p, s), g in zip(knobbed, gens, strict=True)]
    assert min(distance) > 0.05, distance

    greedy = [
        (PROMPT, processed(GREEDY)),
        (PROMPT, processed(GREEDY.model_copy(update={"repetition_penalty": 1.5, "frequency_penalty": 0.5}))),
        (PROMPT, processed(GREEDY.model_copy(update={"presence_penalty": 1.0}))),
        (EOS_PROMPT, processed(GREEDY.model_copy(update={"min_tokens": 12}))),
        *((PROMPT, processed(Sampling(max_tokens=30, top_k=1, seed=s))) for s in (1, 2)),
        (PROMPT, processed(Sampling(max_tokens=30, min_p=0.999, seed=3))),
        (PROMPT, processed(Sampling(max_tokens=40, repetition_penalty=1e4, seed=4))),
    ]
    ours = generate(tiny_model_dir, greedy[:4])
    theirs = vllm_generate(vllm_processed, greedy, "g")
    for (prompt, sampling), mine, vllms in zip(greedy[:4], ours, theirs[:4], strict=True):
        assert vllms.tokens.tolist() == mine.tokens.tolist(), sampling
        check_logprobs(tiny_model_dir, prompt, vllms, sampling)
    assert EOS_ID not in theirs[3].tokens.tolist()[:12] and len(theirs[3].tokens) > 12
    assert [g.tokens.tolist() for g in theirs[4:7]] == [theirs[0].tokens.tolist()] * 3
    assert repeats(theirs[7].tokens) == 0 and not set(theirs[7].tokens.tolist()) & set(PROMPT.tolist())


@pytest.mark.vllm
def test_vllms_raw_logprobs_under_the_knobs_are_the_plain_forward_pass(
    vllm_served: Served, tiny_model_dir: Path
) -> None:
    """The session's shared engine reports raw logprobs: the knobs change the tokens drawn, never their logprobs."""
    engine = vllm_served.engine
    if engine.version != 0:
        vllm_served.run(engine.load_weights(str(tiny_model_dir), version=0))
    prompts = random_prompts([6, 9, 4, 11, 7, 5, 8, 10, 3], seed=5)
    calls = list(zip(prompts, KNOBBED, strict=True))
    for (prompt, sampling), gen in zip(calls, vllm_generate(vllm_served, calls, "raw-knobs-"), strict=True):
        check_logprobs(tiny_model_dir, prompt, gen, sampling)
