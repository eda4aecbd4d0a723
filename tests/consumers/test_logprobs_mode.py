"""Logprob semantics per request (`Sampling.logprobs_mode`): `raw` (the default) is log_softmax(logits) of a forward
pass; `processed` is log_softmax(logits / temperature) renormalized over the tokens top-p kept, for the sampled tokens
(raw again for a greedy sample). Both against an independent forward pass (`tests.reference`, 1e-4 as the other
logprob tests), on the torch engine (either, per request, in one batch) and on a vLLM worker (one mode per engine: a
prompt that asks for the other becomes an error rollout that says why), through the wire and `RolloutClient.submit`.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from consumers.engines.base import EngineInputError, Generation
from consumers.engines.torch_engine import TorchEngine
from consumers.engines.vllm_engine import VllmEngine
from pipeline.local import RedisServer
from pipeline.wire import Prompt, Rollout, Sampling
from producers.client import RolloutClient
from tests.fixtures import StartWorker
from tests.reference import forward_logprobs, processed_logprobs, random_prompts

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-4
SAMPLINGS = [
    Sampling(max_tokens=40, temperature=0.7, top_p=0.9, seed=1, logprobs_mode="processed"),
    Sampling(max_tokens=40, temperature=0.7, top_p=0.9, seed=1),  # the same sample, raw
    Sampling(max_tokens=40, temperature=1.3, seed=2, logprobs_mode="processed"),  # temperature alone
    Sampling(max_tokens=40, temperature=0.5, top_p=0.6, seed=3, logprobs_mode="processed"),
    Sampling(max_tokens=20, temperature=0.0, logprobs_mode="processed"),  # greedy: raw
]


def expected(model_dir: Path, prompt: list[int], tokens: list[int], sampling: Sampling) -> np.ndarray:
    if sampling.logprobs_mode == "raw":
        return forward_logprobs(model_dir, prompt, tokens)
    return processed_logprobs(model_dir, prompt, tokens, sampling.temperature, sampling.top_p)


def check(model_dir: Path, prompt: list[int], tokens: list[int], logprobs: np.ndarray, sampling: Sampling) -> float:
    """Assert the logprobs are the sampling's kind; returns how far they are from the other kind (0 when greedy)."""
    np.testing.assert_allclose(logprobs, expected(model_dir, prompt, tokens, sampling), atol=ATOL)
    flipped = "raw" if sampling.logprobs_mode == "processed" else "processed"
    other = sampling.model_copy(update={"logprobs_mode": flipped})
    return float(np.abs(logprobs - expected(model_dir, prompt, tokens, other)).max())


def submit(client: RolloutClient, prompt_id: str, prompt: np.ndarray, sampling: Sampling) -> None:
    client.submit(
        tokens=prompt,
        n=2,
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=sampling.seed,
        logprobs_mode=sampling.logprobs_mode,  # type: ignore[arg-type]  # the wire's str, one of LOGPROBS_MODES here
        id=prompt_id,
    )


def test_the_field_is_left_out_at_its_default_and_a_bad_value_is_a_problem_not_a_dead_letter() -> None:
    plain = Prompt(id="p", n=1, tokens=np.array([1, 2], dtype=np.int32), sampling=Sampling(max_tokens=4))
    assert json.loads(plain.to_fields()[b"sampling"]) == {"max_tokens": 4}  # as before the field existed
    assert Prompt.from_fields(plain.to_fields()).sampling.logprobs_mode == "raw"
    asked = plain.model_copy(update={"sampling": Sampling(max_tokens=4, logprobs_mode="processed")})
    assert json.loads(asked.to_fields()[b"sampling"]) == {"max_tokens": 4, "logprobs_mode": "processed"}
    assert Prompt.from_fields(asked.to_fields()).sampling.logprobs_mode == "processed"
    odd = Prompt.from_fields({**plain.to_fields(), b"sampling": b'{"logprobs_mode": "logits"}'})  # decodes
    assert odd.sampling.problems() == ["logprobs_mode must be one of raw, processed, got 'logits'"]


def test_the_torch_engine_reports_each_request_its_own_kind_in_one_batch(tiny_model_dir: Path) -> None:
    prompts = random_prompts([5, 9, 3, 12, 7], seed=4)

    async def go() -> list[Generation]:
        async with TorchEngine(tiny_model_dir, num_threads=1, max_batch=8) as engine:
            calls = [engine.generate(f"r{i}", p, s) for i, (p, s) in enumerate(zip(prompts, SAMPLINGS, strict=True))]
            return await asyncio.gather(*calls)

    gens = asyncio.run(go())
    distance = [
        check(tiny_model_dir, p.tolist(), g.tokens.tolist(), g.logprobs, s)
        for p, g, s in zip(prompts, gens, SAMPLINGS, strict=True)
    ]
    assert min(distance[:4]) > 0.05, f"processed and raw must differ for these samplings: {distance}"
    assert distance[4] < ATOL, "a greedy sample's processed logprobs are its raw ones"


def submit_each_sampling(
    client: RolloutClient, seed: int, timeout: float
) -> tuple[dict[str, tuple[np.ndarray, Sampling]], list[Rollout]]:
    """One prompt of each of `SAMPLINGS` (ids `p0`, `p1`, ...), each as a group of 2; what was asked by id, and every
    rollout of them (all delivered)."""
    asked = {}
    for i, (prompt, sampling) in enumerate(zip(random_prompts([6, 4, 8, 5, 9], seed=seed), SAMPLINGS, strict=True)):
        asked[f"p{i}"] = (prompt, sampling)
        submit(client, f"p{i}", prompt, sampling)
    rollouts = [r for g in client.collect(len(asked), timeout=timeout) for r in g.rollouts]
    assert len(rollouts) == 2 * len(asked)
    return asked, rollouts


def test_a_torch_worker_serves_each_prompt_the_kind_it_asked_for_through_the_wire(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, workers: StartWorker
) -> None:
    workers("w1", "--engine", "torch")
    ids, rollouts = submit_each_sampling(RolloutClient(redis_server.url, ns), seed=7, timeout=120)
    for rollout in rollouts:
        prompt, sampling = ids[rollout.prompt_id]
        assert rollout.finish_reason in ("stop", "length"), rollout.error
        check(tiny_model_dir, prompt.tolist(), rollout.tokens.tolist(), rollout.logprobs, sampling)


def test_vllm_sets_the_mode_per_engine_and_refuses_the_other_before_anything_runs(tiny_model_dir: Path) -> None:
    """No vLLM is started: what the engine is built with, and what its request check refuses."""
    raw = VllmEngine(tiny_model_dir)
    assert (raw.logprobs_mode, raw.args["logprobs_mode"]) == ("raw", "raw_logprobs")
    refusal = (
        r"^this vllm worker reports raw logprobs and cannot report processed ones \(vLLM sets logprobs_mode per "
        r"engine, not per request\): submit with logprobs_mode='raw'"
    )
    with pytest.raises(EngineInputError, match=refusal):
        raw._sampling_params(4, Sampling(logprobs_mode="processed"))
    processed = VllmEngine(tiny_model_dir, logprobs_mode="processed")
    assert processed.args["logprobs_mode"] == "processed_logprobs"
    assert processed._sampling_params(4, Sampling(logprobs_mode="processed")).logprobs == 0
    by_args = VllmEngine(tiny_model_dir, engine_args={"logprobs_mode": "processed_logprobs"})  # vLLM's own words
    assert by_args.logprobs_mode == "processed"
    ours = VllmEngine(tiny_model_dir, engine_args={"logprobs_mode": "processed"})  # ours, passed on in vLLM's
    assert (ours.logprobs_mode, ours.args["logprobs_mode"]) == ("processed", "processed_logprobs")
    with pytest.raises(ValueError, match=r"logprobs_mode is 'raw_logits': rollouts carry log-probabilities"):
        VllmEngine(tiny_model_dir, engine_args={"logprobs_mode": "raw_logits"})


@pytest.mark.vllm
def test_a_vllm_worker_started_processed_serves_processed_logprobs_and_refuses_raw_ones(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, workers: StartWorker
) -> None:
    args = json.dumps({"logprobs_mode": "processed_logprobs"})
    workers("v1", "--engine", "vllm", "--engine-args", args)
    asked, rollouts = submit_each_sampling(RolloutClient(redis_server.url, ns), seed=11, timeout=240)
    distance = []
    for rollout in rollouts:
        prompt, sampling = asked[rollout.prompt_id]
        if sampling.logprobs_mode == "raw":  # asked of a processed engine: an error rollout that says why
            assert rollout.finish_reason == "error" and rollout.n_tokens == 0
            assert rollout.error is not None and rollout.error.startswith(
                "this vllm worker reports processed logprobs and cannot report raw ones"
            )
            continue
        assert rollout.finish_reason in ("stop", "length"), rollout.error
        distance.append(check(tiny_model_dir, prompt.tolist(), rollout.tokens.tolist(), rollout.logprobs, sampling))
    assert max(distance) > 0.05, "processed logprobs must differ from raw ones somewhere"
