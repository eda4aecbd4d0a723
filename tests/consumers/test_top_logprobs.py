"""The k most likely alternatives of each generated token (`Sampling.top_logprobs`), against plain transformers forward
passes: on the wire (raw arrays, checked on read), from the torch engine (raw and processed, in a batch), through a
worker and the gateway's OpenAI and vLLM routes (SkyRL's default `logprobs: 1` among them), across an abort sync,
and from a vLLM engine; and refused, in one line, by engines that cannot rank."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from consumers.engines import create_engine
from consumers.engines.base import EngineInputError, EngineLifecycle, Generation
from consumers.engines.remote_engine import RemoteVllmEngine
from consumers.engines.synthetic_engine import SyntheticEngine
from consumers.engines.torch_engine import TorchEngine
from pipeline.codec import as_entries, encode_float32, encode_int32
from pipeline.local import RedisServer
from pipeline.wire import MAX_TOP_LOGPROBS, Keys, Partial, Prompt, Rollout, Sampling, WireError
from producers.client import RolloutClient
from tests.fixtures import StartGateway, StartWorker, openai_client, wait_until
from tests.reference import forward_distributions, forward_logprobs

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 2e-4


def forward_top(
    model_dir: Path, prompt: list[int], tokens: list[int], k: int, temperature: float = 0.0, top_p: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """The k most likely tokens before each of `tokens` and their logprobs, `[len(tokens), k]`, most likely first."""
    values, ids = forward_distributions(model_dir, prompt, tokens, temperature, top_p).topk(k, dim=-1)
    return ids.numpy(), values.numpy()


def assert_top(
    ids: np.ndarray, logprobs: np.ndarray, model_dir: Path, prompt: list[int], tokens: list[int], **how: Any
) -> None:
    """`ids`/`logprobs` are the forward pass's top-k: the same logprobs, and the same token at each rank but where two
    are tied (within `ATOL`, or both -inf: tokens top-p dropped, in any order)."""
    want_ids, want = forward_top(model_dir, prompt, tokens, ids.shape[1] + 1, **how)
    assert_same_top(ids, logprobs, want_ids, want)


def assert_same_top(ids: np.ndarray, logprobs: np.ndarray, want_ids: np.ndarray, want: np.ndarray) -> None:
    """As `assert_top`, against the forward pass's `want_ids`/`want`, which may hold one rank more than `ids`: the next
    best, so that a last rank tied with it (once, 1.4e-6 apart) may name either token."""
    k = ids.shape[1]
    np.testing.assert_allclose(np.maximum(logprobs, -1e4), np.maximum(want[:, :k], -1e4), atol=ATOL)
    floor = np.maximum(want, -1e4)
    ties = np.abs(np.diff(floor, axis=1)) < ATOL
    tied = (np.pad(ties, ((0, 0), (0, 1))) | np.pad(ties, ((0, 0), (1, 0))) | np.isneginf(want))[:, :k]
    bad = ~((ids == want_ids[:, :k]) | tied).all(axis=1)
    assert not bad.any(), (np.where(bad), ids[bad], want_ids[bad], logprobs[bad], want[bad])


# -- the wire ------------------------------------------------------------------------------------


def rollout_with(n_tokens: int, k: int) -> Rollout:
    rng = np.random.default_rng(0)
    return Rollout(
        prompt_id="p",
        sample=0,
        n=1,
        version=0,
        version_end=0,
        finish_reason="length",
        worker="w",
        prompt_tokens=[1, 2, 3],
        tokens=rng.integers(0, 100, n_tokens),
        logprobs=-rng.random(n_tokens),
        spans=[(0, 0, n_tokens)] if n_tokens else [],
        top_token_ids=rng.integers(0, 100, (n_tokens, k)),
        top_logprobs=-rng.random((n_tokens, k)),
    )


def test_alternatives_on_the_wire_are_raw_arrays_checked_on_read_and_optional() -> None:
    """`top_token_ids` (int32) and `top_logprobs` (float32) are raw little-endian `[n_tokens * k]`, k read from their
    length; an entry without them decodes as before (v stays 1); a shape that does not fit is a `WireError`."""
    rollout = rollout_with(5, 3)
    fields = rollout.to_fields()
    assert fields[b"v"] == b"1"
    assert fields[b"top_token_ids"] == np.asarray(rollout.top_token_ids, "<i4").tobytes()
    assert fields[b"top_logprobs"] == np.asarray(rollout.top_logprobs, "<f4").tobytes()
    back = Rollout.from_fields(fields)
    assert back.top_token_ids is not None and back.top_logprobs is not None
    assert back.top_token_ids.shape == (5, 3) and back.top_token_ids.dtype == np.int32
    np.testing.assert_array_equal(back.top_token_ids, rollout.top_token_ids)
    np.testing.assert_array_equal(back.top_logprobs, rollout.top_logprobs)
    old = {k: v for k, v in fields.items() if not k.startswith(b"top_")}
    plain = Rollout.from_fields(old)
    assert plain.top_token_ids is None and plain.top_logprobs is None
    assert b"top_token_ids" not in plain.to_fields()

    hostile = [
        {b"top_token_ids": fields[b"top_token_ids"]},  # one without the other
        {b"top_logprobs": fields[b"top_logprobs"]},
        {b"top_token_ids": fields[b"top_token_ids"], b"top_logprobs": fields[b"top_logprobs"][:-4]},
        {b"top_token_ids": encode_int32(np.arange(7)), b"top_logprobs": encode_float32(np.zeros(7))},  # 7 % 5
        {b"top_token_ids": b"", b"top_logprobs": b""},  # k = 0
        {b"top_token_ids": b"\x01\x02\x03", b"top_logprobs": fields[b"top_logprobs"]},  # not int32s
    ]
    for extra in hostile:
        with pytest.raises(WireError):
            Rollout.from_fields(old | extra)
    empty = rollout_with(0, 2).model_copy(update={"top_token_ids": None, "top_logprobs": None}).to_fields()
    with pytest.raises(WireError):  # alternatives of no tokens
        Rollout.from_fields(empty | {b"top_token_ids": encode_int32([1]), b"top_logprobs": encode_float32([0.0])})
    with pytest.raises(WireError):  # a writer's shapes are checked too
        rollout_with(4, 2).model_copy(update={"top_logprobs": np.zeros((4, 3), np.float32)}).check()

    # A partial keeps them for the rest of its sample; a prompt asks with `sampling.top_logprobs`.
    prompt = Prompt(id="p", n=1, tokens=[1, 2, 3], sampling=Sampling(top_logprobs=3))
    assert json.loads(prompt.to_fields()[b"sampling"]) == {"top_logprobs": 3}
    assert b"top_logprobs" not in Prompt(id="q", n=1, tokens=[1]).to_fields()[b"sampling"]
    partial = Partial(
        prompt=prompt,
        sample=0,
        generated=rollout.tokens,
        logprobs=rollout.logprobs,
        spans=rollout.spans,
        top_token_ids=rollout.top_token_ids,
        top_logprobs=rollout.top_logprobs,
    )
    again = Partial.from_fields(partial.to_fields())
    assert again.prompt.sampling.top_logprobs == 3 and again.top_token_ids is not None
    np.testing.assert_array_equal(again.top_token_ids, rollout.top_token_ids)
    with pytest.raises(WireError):
        Partial.from_fields(partial.to_fields() | {b"top_logprobs": encode_float32(np.zeros(4))})
    assert Sampling(top_logprobs=MAX_TOP_LOGPROBS).problems() == []
    assert "top_logprobs" in Sampling(top_logprobs=MAX_TOP_LOGPROBS + 1).problems()[0]


# -- engines -------------------------------------------------------------------------------------


def test_the_torch_engine_reports_a_forward_passs_top_k_in_its_logprobs_mode(tiny_model_dir: Path) -> None:
    """In one batch: a greedy row (its one alternative is its token), a sampled raw row and a sampled processed row
    (temperature and top-p: the top-k of the distribution it sampled from, -inf past what top-p kept), a row that
    asked none. The sampled tokens' own logprobs are what they are without alternatives."""
    prompt = np.arange(10, 20, dtype=np.int32)
    asks = {
        "greedy": Sampling(max_tokens=12, temperature=0, top_logprobs=1),
        "raw": Sampling(max_tokens=12, temperature=1.0, seed=3, top_logprobs=5),
        "processed": Sampling(
            max_tokens=12, temperature=0.7, top_p=0.8, seed=5, top_logprobs=4, logprobs_mode="processed"
        ),
        "none": Sampling(max_tokens=12, temperature=1.0, seed=3),
    }

    async def go() -> dict[str, Generation]:
        async with TorchEngine(tiny_model_dir, num_threads=1) as engine:
            done = await asyncio.gather(*(engine.generate(name, prompt, s) for name, s in asks.items()))
            with pytest.raises(EngineInputError, match=r"top_logprobs must be in \[0, 20\]"):
                await engine.generate("x", prompt, Sampling(top_logprobs=MAX_TOP_LOGPROBS + 1))
            return dict(zip(asks, done, strict=True))

    out = asyncio.run(go())
    p = prompt.tolist()
    for name, gen in out.items():
        tokens = gen.tokens.tolist()
        if name == "none":
            assert gen.top_token_ids is None and gen.top_logprobs is None
            continue
        assert gen.top_token_ids is not None and gen.top_logprobs is not None
        assert gen.top_token_ids.shape == (len(tokens), asks[name].top_logprobs)
        how = {"temperature": 0.7, "top_p": 0.8} if name == "processed" else {}
        assert_top(gen.top_token_ids, gen.top_logprobs, tiny_model_dir, p, tokens, **how)
    greedy = out["greedy"]
    assert greedy.top_token_ids is not None
    assert greedy.top_token_ids[:, 0].tolist() == greedy.tokens.tolist()
    np.testing.assert_allclose(greedy.logprobs, forward_logprobs(tiny_model_dir, p, greedy.tokens.tolist()), atol=ATOL)
    raw = out["raw"]
    assert out["none"].tokens.tolist() == raw.tokens.tolist()  # the same seed: alternatives change nothing drawn
    np.testing.assert_array_equal(out["none"].logprobs, raw.logprobs)
    processed = out["processed"]
    assert processed.top_logprobs is not None and np.isneginf(processed.top_logprobs).any()  # top-p dropped them


def test_an_engine_in_its_own_process_hands_the_alternatives_over(tiny_model_dir: Path) -> None:
    """`--engine-process`: the channel carries them as raw int32 / float32 with their k."""
    prompt = np.arange(10, 20, dtype=np.int32)

    async def go() -> tuple[Generation, Generation]:
        engine = create_engine("torch", str(tiny_model_dir), process=True, num_threads=1)
        assert isinstance(engine, EngineLifecycle)  # `async with`: every engine inherits it
        async with engine:
            asked = engine.generate("a", prompt, Sampling(max_tokens=8, seed=1, top_logprobs=3))
            plain = engine.generate("b", prompt, Sampling(max_tokens=8, seed=1))
            a, b = await asyncio.gather(asked, plain)
            return a, b

    asked, plain = asyncio.run(go())
    assert asked.top_token_ids is not None and asked.top_logprobs is not None and plain.top_token_ids is None
    assert asked.top_token_ids.shape == (len(asked.tokens), 3)
    assert_top(asked.top_token_ids, asked.top_logprobs, tiny_model_dir, prompt.tolist(), asked.tokens.tolist())


def test_engines_that_cannot_rank_refuse_in_one_line(tiny_model_dir: Path) -> None:
    """The synthetic engine (no model) and the remote one (it asks its server for the sampled token's logprob only)
    answer with an error rollout's message, before any request leaves them."""
    synthetic = SyntheticEngine(str(tiny_model_dir))
    remote = RemoteVllmEngine(tiny_model_dir, url="http://127.0.0.1:9")  # never reached: refused before

    async def go() -> None:
        await synthetic.start()
        with pytest.raises(EngineInputError, match=r"^top_logprobs=2 alternatives were asked for, but the synthetic"):
            await synthetic.generate("r", np.asarray([1, 2, 3]), Sampling(top_logprobs=2))
        await synthetic.shutdown()
        with pytest.raises(EngineInputError, match=r"^top_logprobs=1 alternatives were asked for, but the remote"):
            await remote.generate("r", np.asarray([1, 2, 3]), Sampling(top_logprobs=1))

    asyncio.run(go())


# -- through a worker and the gateway ------------------------------------------------------------

SKYRL_DEFAULTS = {
    "min_tokens": 1,
    "skip_special_tokens": True,
    "include_stop_str_in_output": True,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "logprobs": 1,
    "stop": None,
}
"""SkyRL 0.4.0's generator sampling params at their defaults (`get_vllm_sampling_params`), `logprobs: 1` included."""


def root(base: str) -> str:
    return base.removesuffix("/v1")


def generate(http: httpx.Client, prompt: list[int], **sampling: Any) -> list[dict[str, Any]]:
    answer = http.post("/inference/v1/generate", json={"token_ids": prompt, "sampling_params": sampling})
    assert answer.status_code == 200, answer.text
    choices: list[dict[str, Any]] = answer.json()["choices"]
    return choices


def test_logprobs_1_through_the_generate_route_is_a_forward_passs_top_1_and_the_openai_routes_report_top_k(
    redis_server: RedisServer,
    ns: str,
    tiny_model_dir: Path,
    workers: StartWorker,
    gateways: StartGateway,
) -> None:
    """A real torch worker behind a real gateway on a real redis-server. vLLM's generate route with SkyRL's defaults
    (`logprobs: 1`) answers, in vLLM's shape, one entry a token: greedy, the forward pass's top-1 with rank 1; sampled,
    the sampled token first (vLLM's order) with its forward-pass logprob. `logprobs: 3` gives vLLM's order of the
    forward pass's top 3; chat's `top_logprobs` are its top k, completions' `logprobs: k` map the sampled token and
    the top k. More than 20, or chat's without `logprobs`, are a 400 in OpenAI's shape."""
    workers("w1")
    base = gateways("gw")
    http = httpx.Client(base_url=root(base), timeout=120)
    prompt = [5, 6, 7, 8, 9]

    [greedy] = generate(http, prompt, **(SKYRL_DEFAULTS | {"temperature": 0.0, "max_tokens": 10}))
    tokens = greedy["token_ids"]
    top_ids, top = forward_top(tiny_model_dir, prompt, tokens, 1)
    content = greedy["logprobs"]["content"]
    assert len(content) == len(tokens) >= 2
    for i, entry in enumerate(content):
        [alternative] = entry["top_logprobs"]
        assert alternative["token_id"] == top_ids[i, 0] == entry["token_id"] and alternative["rank"] == 1
        assert entry["rank"] == 1
        np.testing.assert_allclose([alternative["logprob"], entry["logprob"]], [top[i, 0]] * 2, atol=ATOL)

    # SkyRL's defaults as they are (sampled at temperature 1), n=2 as its `sample` asks.
    for choice in generate(http, prompt, **(SKYRL_DEFAULTS | {"max_tokens": 12, "seed": 7, "n": 2})):
        tokens = choice["token_ids"]
        reference = forward_logprobs(tiny_model_dir, prompt, tokens)
        top_ids, _ = forward_top(tiny_model_dir, prompt, tokens, 1)
        for i, entry in enumerate(choice["logprobs"]["content"]):
            [alternative] = entry["top_logprobs"]
            assert alternative["token_id"] == entry["token_id"] == tokens[i]
            assert alternative["rank"] == (1 if tokens[i] == top_ids[i, 0] else None)
            np.testing.assert_allclose([alternative["logprob"], entry["logprob"]], [reference[i]] * 2, atol=ATOL)

    [three] = generate(http, prompt, max_tokens=12, seed=3, logprobs=3)
    tokens = three["token_ids"]
    top_ids, top = forward_top(tiny_model_dir, prompt, tokens, 3)
    for i, entry in enumerate(three["logprobs"]["content"]):
        shown = entry["top_logprobs"]
        assert len(shown) == 3 and shown[0]["token_id"] == tokens[i]
        others = [(int(t), float(lp), r) for r, (t, lp) in enumerate(zip(top_ids[i], top[i], strict=True), 1)]
        others = [o for o in others if o[0] != tokens[i]][:2]
        assert [(s["token_id"], s["rank"]) for s in shown[1:]] == [(t, r) for t, _, r in others]
        np.testing.assert_allclose([s["logprob"] for s in shown[1:]], [lp for _, lp, _ in others], atol=ATOL)

    # OpenAI's routes: chat's top_logprobs (the k most likely), completions' logprobs=k (the sampled token + top k).
    client = openai_client(base)
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=8,
        seed=2,
        logprobs=True,
        top_logprobs=4,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True},
    )
    [c] = chat.choices
    tokens = c.model_extra["token_ids"]
    chat_prompt = chat.model_extra["prompt_token_ids"]
    assert c.logprobs is not None and c.logprobs.content is not None and len(c.logprobs.content) == len(tokens)
    ids = np.asarray([[int(t.token.removeprefix("token_id:")) for t in e.top_logprobs] for e in c.logprobs.content])
    values = np.asarray([[t.logprob for t in e.top_logprobs] for e in c.logprobs.content], dtype=np.float32)
    assert_top(ids, values, tiny_model_dir, chat_prompt, tokens)

    completion = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=8,
        seed=5,
        logprobs=2,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True},
    )
    [c] = completion.choices
    tokens = c.model_extra["token_ids"]
    top_ids, top = forward_top(tiny_model_dir, prompt, tokens, 2)
    reference = forward_logprobs(tiny_model_dir, prompt, tokens)
    assert c.logprobs is not None and c.logprobs.top_logprobs is not None
    for i, shown in enumerate(c.logprobs.top_logprobs):
        want = {f"token_id:{t}": float(lp) for t, lp in zip(top_ids[i], top[i], strict=True)}
        want[f"token_id:{tokens[i]}"] = float(reference[i])
        assert shown.keys() == want.keys()
        np.testing.assert_allclose([shown[k] for k in want], list(want.values()), atol=ATOL)

    def refused(call: Any, param: str, **kwargs: Any) -> None:
        with pytest.raises(openai.BadRequestError) as caught:
            call(model="tiny", max_tokens=2, **kwargs)
        body = caught.value.body
        assert isinstance(body, dict) and body["type"] == "invalid_request_error" and body["param"] == param, body

    hi = [{"role": "user", "content": "Hi"}]
    refused(client.chat.completions.create, "top_logprobs", messages=hi, logprobs=True, top_logprobs=21)
    refused(client.chat.completions.create, "top_logprobs", messages=hi, top_logprobs=2)  # without logprobs
    refused(client.completions.create, "logprobs", prompt=prompt, logprobs=21)
    over = http.post("/inference/v1/generate", json={"token_ids": prompt, "sampling_params": {"logprobs": 21}})
    assert over.status_code == 400 and over.json()["error"]["param"] == "sampling_params.logprobs", over.text


def test_an_abort_sync_keeps_the_alternatives_of_the_tokens_before_it(
    redis_server: RedisServer,
    ns: str,
    tiny_model_dir: Path,
    tiny_model_dir_v1: Path,
    workers: StartWorker,
) -> None:
    """Samples an abort sync interrupts go on under the new weights; each token's alternatives are those of the
    version that wrote it (its span's), over the whole prefix: the earlier tokens' come through the sync with them."""
    worker = workers("w1")
    client = RolloutClient(redis_server.url, ns)
    sampling = Sampling(max_tokens=400, temperature=1.0, top_logprobs=3)  # still running when the pause lands
    items = [
        client.make_prompt(tokens=[5 + i, 9, 11], n=2, sampling=sampling.model_copy(update={"seed": i}))
        for i in range(4)
    ]
    client.submit_prompts(items)
    beat = client.streams.redis
    generating = lambda: int(beat.hget(Keys(ns).worker("w1"), "generated_tokens") or 0) >= 16  # noqa: E731
    wait_until(generating, 60, "the worker to generate")
    os.kill(worker.pid, signal.SIGSTOP)  # the samples are still running when the sync pauses the worker
    sync = threading.Thread(
        target=client.publish_weights, args=(tiny_model_dir_v1,), kwargs={"transport": "redis://", "mode": "abort"}
    )
    try:
        sync.start()
        wait_until(lambda: beat.hget(Keys(ns).state, "paused") == b"1", 60, "the sync to begin")
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    sync.join(timeout=120)
    rollouts = [r for g in client.collect(len(items), timeout=120) for r in g.rollouts]
    assert len(rollouts) == 8
    models = {0: tiny_model_dir, 1: tiny_model_dir_v1}
    crossed = [r for r in rollouts if [s[0] for s in r.spans] == [0, 1]]
    assert crossed, [r.spans for r in rollouts]
    for rollout in rollouts:
        prompt, tokens = rollout.prompt_tokens.tolist(), rollout.tokens.tolist()
        assert rollout.top_token_ids is not None and rollout.top_logprobs is not None
        assert rollout.top_token_ids.shape == (len(tokens), 3)
        for version, start, end in rollout.spans:
            ids, values = forward_top(models[version], prompt, tokens, 4)  # the next best too: a tie with it
            got_ids, got = rollout.top_token_ids[start:end], rollout.top_logprobs[start:end]
            assert_same_top(got_ids, got, ids[start:end], values[start:end])


@pytest.mark.vllm
def test_a_vllm_engine_reports_a_forward_passs_top_k(vllm_served: Any, tiny_model_dir: Path) -> None:
    """`SamplingParams(logprobs=k)`: vLLM gives each position the sampled token, then the top k; the engine keeps the
    sampled token's logprob as before and the k as the alternatives, equal to a forward pass's."""
    engine = vllm_served.engine
    if engine.version != 0:
        vllm_served.run(engine.load_weights(str(tiny_model_dir), version=0))
    prompt = np.arange(10, 20, dtype=np.int32)
    asks = [
        Sampling(max_tokens=12, temperature=0.0, top_logprobs=1),
        Sampling(max_tokens=12, temperature=1.0, seed=3, top_logprobs=5),
        Sampling(max_tokens=12, temperature=1.0, seed=3),
    ]

    async def go() -> list[Generation]:
        return list(await asyncio.gather(*(engine.generate(f"top{i}", prompt, s) for i, s in enumerate(asks))))

    greedy, sampled, plain = vllm_served.run(go())
    p = prompt.tolist()
    for gen in (greedy, sampled):
        tokens = gen.tokens.tolist()
        np.testing.assert_allclose(gen.logprobs, forward_logprobs(tiny_model_dir, p, tokens), atol=ATOL)
        assert gen.top_token_ids is not None and gen.top_logprobs is not None
        assert gen.top_token_ids.dtype == np.int32 and gen.top_logprobs.dtype == np.float32
        assert_top(gen.top_token_ids, gen.top_logprobs, tiny_model_dir, p, tokens)
    assert greedy.top_token_ids is not None and greedy.top_token_ids[:, 0].tolist() == greedy.tokens.tolist()
    assert sampled.top_token_ids is not None and sampled.top_token_ids.shape == (len(sampled.tokens), 5)
    assert plain.top_token_ids is None and plain.tokens.tolist() == sampled.tokens.tolist()


def test_the_clients_submit_asks_for_k_alternatives_and_refuses_more_than_the_wire_takes(
    redis_server: RedisServer, ns: str
) -> None:
    """`RolloutClient.submit(top_logprobs=k)` queues a prompt whose sampling asks for k; past `MAX_TOP_LOGPROBS` it
    is a ValueError that says the range, and nothing is queued."""
    client = RolloutClient(redis_server.url, ns)
    client.submit(tokens=[1, 2, 3], n=2, top_logprobs=3)
    with pytest.raises(ValueError, match=rf"top_logprobs must be in \[0, {MAX_TOP_LOGPROBS}\]"):
        client.submit(tokens=[1, 2, 3], top_logprobs=MAX_TOP_LOGPROBS + 1)
    entries = as_entries(client.streams.redis.xrange(Keys(ns).prompts))
    assert [Prompt.from_fields(fields).sampling.top_logprobs for _, fields in entries] == [3]
