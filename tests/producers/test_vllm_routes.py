"""The gateway's vLLM face, driven by the official `openai` client and plain HTTP against `rollouts gateway` processes
and real workers: batched completions (as TRL sends them), `logprobs: true` and `0`, vLLM's token-in/token-out
`/inference/v1/generate` with sessions, and every refused sampling field answered in OpenAI's 400 shape with
nothing queued. SkyRL's own client drives these routes in tests/producers/test_skyrl_client.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import redis

from consumers.engines.tiny_model import EOS, SPECIAL_TOKENS
from pipeline.codec import as_text
from pipeline.local import RedisServer
from pipeline.wire import Keys, Sampling
from tests.fixtures import StartGateway, StartWorker, openai_client
from tests.reference import forward_logprobs, knob_logprobs

EOS_ID = SPECIAL_TOKENS.index(EOS)
"""The tiny model's end of sequence."""


def root(base: str) -> str:
    return base.removesuffix("/v1")


def test_batched_prompts_and_logprobs_as_trl_and_tinker_send_them(
    redis_server: RedisServer,
    ns: str,
    tiny_model_dir: Path,
    workers: StartWorker,
    gateways: StartGateway,
    one_thread: None,
) -> None:
    """A list of prompts in one completions call comes back prompt by prompt, `n` choices each, each choice with its
    prompt's and its own token ids; `logprobs: true` and `0` give the sampled tokens' logprobs, which equal a
    forward pass of the served weights; `/v1/models` reports the context."""
    workers("w1")
    base = gateways("gw")
    client = openai_client(base)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    asked = {"return_token_ids": True, "return_tokens_as_token_ids": True, "top_k": -1, "min_p": 0.0}
    answer = client.completions.create(
        model="tiny", prompt=prompts, n=2, max_tokens=6, seed=1, logprobs=True, extra_body=asked
    )
    assert len(answer.choices) == 6 and [c.index for c in answer.choices] == list(range(6))
    completion_tokens = 0
    for c in answer.choices:
        prompt = prompts[c.index // 2]
        extra = c.model_extra
        assert extra["prompt_token_ids"] == prompt  # choices[::n] carry their prompt, as TRL reads them
        tokens = extra["token_ids"]
        completion_tokens += len(tokens)
        assert 1 <= len(tokens) <= 6 and c.logprobs.tokens == [f"token_id:{t}" for t in tokens]
        reference = forward_logprobs(tiny_model_dir, prompt, tokens)
        np.testing.assert_allclose(c.logprobs.token_logprobs, reference, atol=2e-4)
        assert [s[0] for s in extra["spans"]] == [0]
    assert answer.usage.prompt_tokens == sum(len(p) for p in prompts)
    assert answer.usage.completion_tokens == completion_tokens
    # `logprobs: 0` (vLLM's "the sampled token only") is `true`'s; the text of each token by default.
    alone = client.completions.create(
        model="tiny", prompt=prompts[1], max_tokens=6, seed=1, logprobs=0, extra_body={"return_token_ids": True}
    )
    [c] = alone.choices
    tokens = c.model_extra["token_ids"]
    assert alone.model_extra["prompt_token_ids"] == prompts[1] and len(c.logprobs.tokens) == len(tokens)
    reference = forward_logprobs(tiny_model_dir, prompts[1], tokens)
    np.testing.assert_allclose(c.logprobs.token_logprobs, reference, atol=2e-4)
    texts = client.completions.create(model="tiny", prompt=["The cat", "A dog"], max_tokens=4, seed=2)
    assert len(texts.choices) == 2 and all(c.logprobs is None for c in texts.choices)
    [model] = client.models.list().data
    assert model.id == "tiny" and model.model_extra["max_model_len"] == 512


def test_generate_route_tokens_in_tokens_out_with_sessions(
    redis_server: RedisServer,
    ns: str,
    tiny_model_dir: Path,
    workers: StartWorker,
    gateways: StartGateway,
    one_thread: None,
) -> None:
    """vLLM's `/inference/v1/generate`: token ids in; token ids, the sampled tokens' logprobs and vLLM's
    `weight_versions` out; `n`; `stop_token_ids` end a sample on that token; `X-Session-ID` pins the calls of a
    session to one worker (sticky least-loaded, as chat sessions) until `/finish_session`; `/tokenize` and
    `/detokenize` round-trip; `/get_world_size` counts the live workers."""
    workers.many(("w1",), ("w2",))
    url = root(gateways("gw"))
    http = httpx.Client(base_url=url, timeout=120)
    prompt = http.post("/tokenize", json={"model": "tiny", "prompt": "Once upon a time"}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": prompt}).json()["prompt"] == "Once upon a time"
    body = {"token_ids": prompt, "sampling_params": {"n": 3, "max_tokens": 8, "seed": 4, "logprobs": 0}}
    answer = http.post("/inference/v1/generate", json=body | {"return_token_ids": True}).json()
    assert answer["prompt_token_ids"] == prompt and len(answer["choices"]) == 3
    for choice in answer["choices"]:
        tokens = choice["token_ids"]
        assert [c["token_id"] for c in choice["logprobs"]["content"]] == tokens
        assert [c["token"] for c in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in tokens]  # renderers
        got = [c["logprob"] for c in choice["logprobs"]["content"]]
        np.testing.assert_allclose(got, forward_logprobs(tiny_model_dir, prompt, tokens), atol=2e-4)
        assert choice["weight_versions"] == [{"version": "0", "start": 0, "end": len(tokens)}]
    # A stop token ends the sample on it, and vLLM's stop_reason names it.
    first = answer["choices"][0]["token_ids"]
    stop = http.post(
        "/inference/v1/generate",
        json={"token_ids": prompt, "sampling_params": {"max_tokens": 8, "seed": 4, "stop_token_ids": [first[1]]}},
    ).json()["choices"][0]
    assert stop["token_ids"] == first[:2] and stop["finish_reason"] == "stop" and stop["stop_reason"] == first[1]
    assert stop["logprobs"] is None
    # min_tokens=1 (SkyRL sends it always) is honoured: never a sample of one stop token.
    masked = {"max_tokens": 1, "seed": 4, "min_tokens": 1, "stop_token_ids": first[:1]}
    once = {"token_ids": prompt, "sampling_params": masked}
    assert http.post("/inference/v1/generate", json=once).json()["choices"][0]["token_ids"] != first[:1]

    # Sessions: routing only; each session's calls stay on its worker, two sessions spread over two workers.
    keys, probe = Keys(ns), redis.Redis.from_url(redis_server.url)
    worker_of: dict[str, str] = {}
    for sid in ("traj-a", "traj-b"):
        for _ in range(2):
            call = {"token_ids": prompt, "sampling_params": {"max_tokens": 4}}
            http.post("/inference/v1/generate", json=call, headers={"X-Session-ID": sid}).raise_for_status()
            pinned_by = probe.hget(keys.session(sid), "worker")
            assert pinned_by is not None
            pinned = as_text(pinned_by)
            assert worker_of.setdefault(sid, pinned) == pinned
        assert probe.ttl(keys.session(sid)) > 0
    assert sorted(worker_of.values()) == ["w1", "w2"]
    assert http.get("/get_world_size").json() == {"world_size": 2}
    released = http.post("/finish_session", params={"session_id": "traj-a"}).json()
    assert released["released"] and not probe.exists(keys.session("traj-a"))
    assert not probe.zscore(keys.pins(worker_of["traj-a"]), "traj-a")
    assert http.get("/weight_info").json() == {"weight_version": "0"}
    probe.close()


def test_the_sampling_knobs_are_honoured_on_completions_chat_and_the_generate_route(
    redis_server: RedisServer,
    ns: str,
    tiny_model_dir: Path,
    workers: StartWorker,
    gateways: StartGateway,
    one_thread: None,
) -> None:
    """`top_k`, `min_p`, `repetition_penalty`, `presence_penalty`, `frequency_penalty` and `min_tokens` reach the
    workers from every route: top-k 1 and min-p near 1 at temperature 1 draw the greedy tokens, a huge repetition
    penalty repeats nothing, a frequency penalty repeats less, `min_tokens` holds the end of sequence back, and the
    generate route's processed logprobs are a forward pass with every knob applied (its raw ones the plain pass)."""
    workers("w1")
    base = gateways("gw")
    client, http = openai_client(base), httpx.Client(base_url=root(base), timeout=120)
    ids = {"return_token_ids": True}
    prompt = list(range(10, 20))  # greedy decoding repeats itself from here (seed-0 weights)

    def completion(**kwargs: Any) -> list[list[int]]:
        extra = ids | {k: kwargs.pop(k) for k in ("top_k", "min_p", "repetition_penalty", "min_tokens") if k in kwargs}
        answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, extra_body=extra, **kwargs)
        return [c.model_extra["token_ids"] for c in answer.choices]

    [greedy] = completion(temperature=0)
    assert len(greedy) - len(set(greedy)) > 10
    assert completion(temperature=1.0, n=2, seed=3, top_k=1) == [greedy, greedy]
    assert completion(temperature=1.0, n=2, seed=5, min_p=0.999) == [greedy, greedy]
    [spread] = completion(temperature=0, repetition_penalty=1e4)
    assert len(set(spread)) == len(spread) == 24 and not set(spread) & set(prompt)
    [fewer] = completion(temperature=0, frequency_penalty=2.0)
    assert len(fewer) - len(set(fewer)) < (len(greedy) - len(set(greedy))) / 2

    # Chat: the same knobs, OpenAI's penalties among them.
    messages = [{"role": "user", "content": "Count the cats, count the cats, count the cats."}]

    def chat(**kwargs: Any) -> list[list[int]]:
        extra = ids | {k: kwargs.pop(k) for k in ("top_k", "min_p", "repetition_penalty") if k in kwargs}
        answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, extra_body=extra,
                                                **kwargs)  # fmt: skip
        return [c.model_extra["token_ids"] for c in answer.choices]

    [chat_greedy] = chat(temperature=0)
    assert chat(temperature=1.0, n=2, seed=1, top_k=1) == [chat_greedy, chat_greedy]
    assert chat(temperature=1.0, seed=2, min_p=0.999) == [chat_greedy]
    [chat_spread] = chat(temperature=1.0, seed=2, presence_penalty=2.0, repetition_penalty=1e4)
    assert len(set(chat_spread)) == len(chat_spread)

    # vLLM's generate route: every knob in `sampling_params`, processed and raw logprobs against a forward pass.
    knobs = {"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.3,
             "min_tokens": 6}  # fmt: skip
    sampling = Sampling(max_tokens=16, temperature=0.7, top_p=0.9, **knobs)
    asked = sampling.model_dump(exclude_defaults=True) | {"logprobs": 0, "n": 2, "seed": 8}
    for mode in ("processed_logprobs", "raw_logprobs"):
        body = {"token_ids": prompt, "sampling_params": asked | {"logprobs_mode": mode}}
        choices = http.post("/inference/v1/generate", json=body).raise_for_status().json()["choices"]
        for choice in choices:
            tokens = choice["token_ids"]
            raw, shaped = knob_logprobs(tiny_model_dir, prompt, tokens, sampling, [EOS_ID])
            got = [c["logprob"] for c in choice["logprobs"]["content"]]
            np.testing.assert_allclose(got, shaped if mode == "processed_logprobs" else raw, atol=2e-4)
            assert np.abs(shaped - raw).max() > 0.05  # the knobs changed the distribution these tokens came from
    eos_prompt = [328, 264, 142, 161, 26, 44, 14, 94, 417, 334, 467, 260, 312, 497, 375, 325, 281,
                  289, 479, 146, 418, 345, 7, 205, 439, 286, 22, 393, 375, 434, 94, 51, 442, 17]  # fmt: skip
    greedy_eos = {"token_ids": eos_prompt, "sampling_params": {"max_tokens": 30, "temperature": 0}}
    [stops] = http.post("/inference/v1/generate", json=greedy_eos).raise_for_status().json()["choices"]
    assert stops["finish_reason"] == "stop" and stops["token_ids"][-1] == EOS_ID and len(stops["token_ids"]) == 6
    held_back = {"token_ids": eos_prompt, "sampling_params": {"max_tokens": 30, "temperature": 0, "min_tokens": 12}}
    [held] = http.post("/inference/v1/generate", json=held_back).raise_for_status().json()["choices"]
    assert EOS_ID not in held["token_ids"][:12] and len(held["token_ids"]) > 12


def test_every_refused_field_gets_openai_400_and_nothing_is_queued(
    redis_server: RedisServer, ns: str, gateways: StartGateway
) -> None:
    """Sampling fields the wire and the engines do not carry are refused at any value but their default, naming the
    field, and so is a knob they carry set out of its range; their defaults pass (and the call then meets no worker:
    503). The RL control routes are off unless asked
    for; vLLM routes not served say why. Nothing reaches the queue."""
    base = gateways("gw")
    client = openai_client(base)
    url = root(base)

    def refused(code: str, param: str, route: str = "completions", **kwargs: Any) -> str:
        call: dict[str, Any] = {"model": "tiny", "max_tokens": 4}
        if route == "completions":
            create: Any = client.completions.create
            call["prompt"] = [1, 2, 3]
        else:
            create = client.chat.completions.create
            call["messages"] = [{"role": "user", "content": "Hi"}]
        extra = {k: kwargs.pop(k) for k in list(kwargs) if k not in ("logprobs", "top_logprobs", "n")}
        with pytest.raises(openai.BadRequestError) as caught:
            create(**call, **kwargs, extra_body=extra)
        body = caught.value.body
        assert isinstance(body, dict) and body["type"] == "invalid_request_error", body
        assert (body["code"], body["param"]) == (code, param), body
        return str(body["message"])

    # The sampling knobs are honoured; a value outside vLLM's range is a 400 that names the field.
    assert "top_k must be -1 or 0 (off) or >= 1, got -2" in refused("invalid_value", "top_k", top_k=-2)
    refused("invalid_value", "min_p", min_p=1.5)
    refused("invalid_value", "repetition_penalty", repetition_penalty=0)
    refused("invalid_value", "repetition_penalty", route="chat", repetition_penalty=-1.2)
    refused("invalid_value", "presence_penalty", route="chat", presence_penalty=2.5)
    assert "[-2, 2]" in refused("invalid_value", "frequency_penalty", frequency_penalty=-3)
    assert "max_tokens=4" in refused("invalid_value", "min_tokens", min_tokens=5)
    refused("unsupported_parameter", "logit_bias", logit_bias={"5": 10})
    refused("unsupported_parameter", "ignore_eos", ignore_eos=True)
    refused("unsupported_parameter", "structured_outputs", structured_outputs={"regex": "a+"})
    refused("unsupported_parameter", "response_format", route="chat", response_format={"type": "json_object"})
    refused("unsupported_parameter", "best_of", best_of=2)
    refused("unsupported_parameter", "skip_special_tokens", skip_special_tokens=False)
    assert "0 to 20 alternatives" in refused("invalid_value", "logprobs", logprobs=21)
    refused("invalid_value", "top_logprobs", route="chat", logprobs=True, top_logprobs=21)
    assert "Unrecognized" in refused("unknown_parameter", "temprature", temprature=0.5)
    # Their defaults are accepted: these calls pass every check and meet no worker.
    defaults = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0, "user": "u1"}
    with pytest.raises(openai.APIStatusError) as no_worker:
        client.completions.create(model="tiny", prompt=[1, 2], max_tokens=2, extra_body=defaults)
    assert no_worker.value.status_code == 503
    assert no_worker.value.body["code"] == "no_worker"  # type: ignore[index]  # openai types the JSON body object

    # The same table on vLLM's generate route, its own fields too.
    def generate(body: dict[str, Any], status: int = 400) -> dict[str, Any]:
        answer = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=30)
        assert answer.status_code == status, answer.text
        error: dict[str, Any] = answer.json()["error"]
        assert error["message"] and error["type"], error
        return error

    prompt = {"token_ids": [1, 2, 3]}
    assert generate(prompt | {"sampling_params": {"top_k": -5}})["param"] == "sampling_params.top_k"
    assert generate(prompt | {"sampling_params": {"min_p": 2}})["param"] == "sampling_params.min_p"
    too_few = generate(prompt | {"sampling_params": {"max_tokens": 3, "min_tokens": 4}})
    assert too_few["param"] == "sampling_params.min_tokens" and too_few["code"] == "invalid_value"
    assert generate(prompt | {"sampling_params": {"logprobs": 21}})["param"] == "sampling_params.logprobs"
    assert generate(prompt | {"sampling_params": {"prompt_logprobs": 0}})["param"] == "sampling_params.prompt_logprobs"
    assert generate(prompt | {"sampling_params": {"temperature": -1}})["param"] == "sampling_params"
    assert generate(prompt | {"stream": True})["param"] == "stream"
    assert generate(prompt | {"priority": 3})["param"] == "priority"
    assert generate(prompt | {"features": {"mm_hashes": {}}})["param"] == "features"
    assert generate({"token_ids": [-1]})["param"] == "token_ids"
    # SkyRL's defaults pass, `logprobs: 1` among them (text-only flags are inert without text): 503, no worker.
    skyrl = {"min_tokens": 1, "skip_special_tokens": True, "include_stop_str_in_output": True, "top_k": -1}
    assert generate(prompt | {"sampling_params": skyrl | {"min_p": 0.0, "logprobs": 1}}, 503)["code"] == "no_worker"

    # Control routes are off without --rl-control; vLLM routes not served say why.
    off = httpx.post(f"{url}/pause", params={"mode": "keep"}, timeout=10)
    assert off.status_code == 404 and off.json()["error"]["code"] == "rl_control_off"
    sleep = httpx.post(f"{url}/sleep", timeout=10)
    assert sleep.status_code == 404 and "workers own their GPUs" in sleep.json()["error"]["message"]
    probe = redis.Redis.from_url(redis_server.url)
    assert probe.xlen(Keys(ns).prompts) == 0
    probe.close()


def test_pause_modes_and_weight_transfers_that_cannot_reach_the_workers_are_refused(
    redis_server: RedisServer, ns: str, gateways: StartGateway
) -> None:
    """`/pause?mode=wait` has no counterpart; NCCL, CUDA IPC, SkyRL delta and sharded RDT weight transfers are
    refused with a 400 that says why and what to send instead; a misnamed tensor is refused before anything is
    published; a pause holds, and is lifted by `/resume`."""
    url = root(gateways("gw", "--rl-control"))
    http = httpx.Client(base_url=url, timeout=30)

    def error(response: httpx.Response, status: int = 400) -> dict[str, Any]:
        assert response.status_code == status, response.text
        found: dict[str, Any] = response.json()["error"]
        return found

    assert "no counterpart" in error(http.post("/pause", params={"mode": "wait"}))["message"]
    assert http.post("/pause", params={"mode": "keep"}).json() == {"status": "paused", "mode": "keep"}
    assert http.get("/is_paused").json() == {"is_paused": True}
    assert http.post("/resume").json() == {"status": "resumed"}
    assert http.get("/is_paused").json() == {"is_paused": False}
    nccl = {"master_address": "10.0.0.1", "master_port": 29500, "world_size": 2, "rank_offset": 1, "packed": True}
    message = error(http.post("/init_weight_transfer_engine", json={"init_info": nccl}))["message"]
    assert "NCCL" in message and "cannot join" in message
    delta = {"base_model_path": "/m", "local_checkpoint_dir": "/c"}
    assert "delta" in error(http.post("/init_weight_transfer_engine", json={"init_info": delta}))["message"]
    rdt = {"replica_rank": 0, "num_replicas": 1}
    assert "RDT" in error(http.post("/init_weight_transfer_engine", json={"init_info": rdt}))["message"]
    assert error(http.post("/update_weights", json={"update_info": {}}), 409)["code"] == "no_update"
    assert http.post("/init_weight_transfer_engine", json={"init_info": {"transport": "redis://"}}).status_code == 200
    assert http.post("/start_weight_update").status_code == 200
    ipc = {"names": ["x"], "dtype_names": ["float32"], "shapes": [[1]], "ipc_handles_pickled": "gASV"}
    assert "pickle" in error(http.post("/update_weights", json={"update_info": ipc}))["message"]
    over_nccl = {"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[64]]}
    assert "NCCL" in error(http.post("/update_weights", json={"update_info": over_nccl}))["message"]
    wrong = {"names": ["model.nope"], "dtype_names": ["float32"], "shapes": [[1]], "data": ["AAAAAA=="]}
    assert "not a tensor" in error(http.post("/update_weights", json={"update_info": wrong}))["message"]
    assert "nothing to publish" in error(http.post("/finish_weight_update"))["message"]
    assert http.post("/shutdown_weight_transfer_engine").status_code == 200
    assert error(http.post("/finish_weight_update"), 409)["code"] == "no_update"
    assert http.get("/weight_info").json() == {"weight_version": "0"}


def test_a_checkpoint_path_through_the_weight_routes_is_published_once_in_the_held_mode(
    redis_server: RedisServer,
    ns: str,
    tiny_model_dir: Path,
    tiny_model_dir_v1: Path,
    workers: StartWorker,
    gateways: StartGateway,
    one_thread: None,
) -> None:
    """`update_info.weights_path` (a checkpoint the gateway reads) after `/pause?mode=abort`: one sync in abort mode,
    acked by the worker, which then serves the new weights; a second replica cannot open an update meanwhile, and a
    caller's own version label is refused (the update stays open for a finish without it)."""
    workers("w1")
    a = httpx.Client(base_url=root(gateways("gw-a", "--rl-control")), timeout=120)
    b = httpx.Client(base_url=root(gateways("gw-b", "--rl-control")), timeout=120)
    assert a.post("/pause", params={"mode": "abort"}).json()["mode"] == "abort"
    assert b.get("/is_paused").json() == {"is_paused": True}  # the hold is the namespace's, not one replica's
    assert a.post("/start_weight_update").status_code == 200
    other = b.post("/start_weight_update")
    assert other.status_code == 409 and other.json()["error"]["code"] == "weight_update_elsewhere"
    path = {"weights_path": str(tiny_model_dir_v1)}
    assert a.post("/update_weights", json={"update_info": path}).json()["tensors"] == 1
    label = a.post("/finish_weight_update", json={"weight_version": "v7"})
    assert label.status_code == 400 and label.json()["error"]["param"] == "weight_version"
    done = a.post("/finish_weight_update", json={"weight_version": "1"}).json()
    assert (done["version"], done["mode"], done["acked"], done["evicted"]) == (1, "abort", ["w1"], [])
    assert b.post("/resume").json() == {"status": "resumed"}
    prompt = [5, 6, 7, 8]
    answer = b.post(
        "/inference/v1/generate", json={"token_ids": prompt, "sampling_params": {"max_tokens": 8, "logprobs": 0}}
    )
    choice = answer.json()["choices"][0]
    assert choice["weight_versions"][0]["version"] == "1"
    got = [c["logprob"] for c in choice["logprobs"]["content"]]
    np.testing.assert_allclose(got, forward_logprobs(tiny_model_dir_v1, prompt, choice["token_ids"]), atol=2e-4)
    assert a.get("/weight_info").json() == {"weight_version": "1"}
